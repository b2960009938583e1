#pragma once
// The peak arithmetic rate of a space: the denominator of model FLOPs utilization (MFU), which the
// examples print beside the achieved rate (model FLOPs from net/cost.hpp over the time of the steps).
//
//   Host  measured: independent float32 FMA chains on every thread for a few tens of milliseconds,
//         at the vector width this translation unit is compiled for (AVX-512 with -march of such a
//         machine). On the 2-core development machine this gives 426 GFLOP/s, as benchmarks/fma_peak.
//   Cuda  from the device: SMs x clock x the dense rate per SM and clock of its architecture for the
//         space's precision (tensor cores for Tf32 and Bf16, FP32 cores for Fp32), from NVIDIA's
//         data sheets: sm_80 (A100) 1024 TF32 / 2048 BF16 / 128 FP32 FLOP per clock and SM, sm_86 and
//         sm_89 512 / 1024 / 256, sm_90 (H100, H200) 2048 / 4096 / 256. Other architectures: 0 (unknown),
//         and utilization is not printed.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <thread>
#include <vector>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"

#include <type_traits>
#endif

namespace fusedp {

namespace detail {
#if defined(__AVX512F__)
inline constexpr int peak_vector_bytes = 64;
#elif defined(__AVX__)
inline constexpr int peak_vector_bytes = 32;
#else
inline constexpr int peak_vector_bytes = 16;
#endif
using PeakVector [[gnu::vector_size(peak_vector_bytes)]] = float;

// `rounds` rounds of 16 independent FMA chains (more than FMA latency x FMA ports, so throughput binds).
[[gnu::noinline]] inline float fma_chains(long rounds, float seed) {
  constexpr int chains = 16;
  PeakVector acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = PeakVector{} + seed * float(c + 1);
  const PeakVector m = PeakVector{} + 0.999999f, a = PeakVector{} + 1e-7f;
  for (long i = 0; i < rounds; ++i)
    for (int c = 0; c < chains; ++c) acc[c] = acc[c] * m + a;
  PeakVector s{};
  for (int c = 0; c < chains; ++c) s += acc[c];
  float r = 0;
  for (int l = 0; l < peak_vector_bytes / 4; ++l) r += s[l];
  return r;
}
}  // namespace detail

/// The float32 FMA rate of `threads` threads of this CPU, in FLOP/s, measured for about `seconds`.
inline double measure_host_peak_flops(int threads, double seconds = 0.05) {
  require(threads >= 1, "measure_host_peak_flops: threads must be >= 1, got ", threads);
  constexpr double flops_per_round = 2.0 * 16 * (detail::peak_vector_bytes / 4);
  long rounds = 1 << 14;
  for (;;) {  // calibrate on one thread
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = detail::fma_chains(rounds, 1.0f);
    (void)sink;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4 || rounds > (1L << 40)) {
      rounds = std::max(1L, long(double(rounds) * seconds / std::max(dt, 1e-9)));
      break;
    }
    rounds *= 4;
  }
  std::vector<double> rate(static_cast<std::size_t>(threads), 0.0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const auto t0 = std::chrono::steady_clock::now();
      volatile float sink = detail::fma_chains(rounds, float(t + 1));
      (void)sink;
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[std::size_t(t)] = flops_per_round * double(rounds) / dt;
    });
  for (auto& t : pool) t.join();
  double total = 0;
  for (double r : rate) total += r;
  return total;
}

/// Dense FLOP per clock and SM of compute capability `arch` (major * 10 + minor) at a precision:
/// `tensor_cores` (TF32, or BF16 when `bf16`) or FP32 cores; 0 when the architecture is not in the table.
constexpr double cuda_flops_per_clock_per_sm(int arch, bool tensor_cores, bool bf16) {
  double tf32 = 0, fp32 = 0;
  if (arch == 80) tf32 = 1024, fp32 = 128;
  else if (arch == 86 || arch == 87 || arch == 89) tf32 = 512, fp32 = 256;
  else if (arch == 90) tf32 = 2048, fp32 = 256;
  if (!tensor_cores) return fp32;
  return bf16 ? 2 * tf32 : tf32;
}

#if FUSEDP_HAS_CUDA
/// The dense peak of `space`'s device at its precision, in FLOP/s (0 when its architecture is unknown).
template <class P>
double cuda_peak_flops(const CudaSpace<P>& space) {
  int khz = 0;
  FUSEDP_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, space.device()));
  const bool tensor_cores = !std::is_same_v<P, precision::Fp32>;
  const bool bf16 = std::is_same_v<P, precision::Bf16>;
  return double(space.sm_count()) * double(khz) * 1e3 *
         cuda_flops_per_clock_per_sm(space.architecture(), tensor_cores, bf16);
}
#endif

}  // namespace fusedp
