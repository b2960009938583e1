#pragma once
// The peak arithmetic rate of a space: the denominator of model FLOPs utilization (MFU), which the
// examples print beside the achieved rate (model FLOPs from net/cost.hpp over the time of the steps).
//
//   Host  measured: independent chains of one instruction on every thread for a few tens of
//         milliseconds. The instruction is the one the Host's precision does its products with
//         (host_peak_instruction): float32 FMA at the vector width this translation unit is compiled
//         for (AVX-512 with -march of such a machine); at bf16 VDPBF16PS (64 FLOP a zmm), or AMX's
//         TDPBF16PS (16 x 16 x 32 products, 16384 FLOP a tile) where its GEMMs run on tiles. On a
//         2-core Xeon with AMX (benchmarks/fma_peak, 2026-12-07, 2 threads): 468 GFLOP/s float32 FMA,
//         7070 TDPBF16PS (its VDPBF16PS figure then, 903, came from chains GCC had merged into one; not
//         measured since); on a 2-core AMD EPYC Zen 4 (2026-12-07): 231 float32 FMA, 462 VDPBF16PS. So
//         a bf16 run's utilization is a share of its instruction's rate, not of fp32's (which read 130%
//         for ResNet-18's bf16 step on the Xeon).
//   Cuda  from the device: SMs x clock x the dense rate per SM and clock of its architecture for the
//         space's precision (tensor cores for Tf32 and Bf16, FP32 cores for Fp32), from NVIDIA's
//         data sheets: sm_80 (A100) 1024 TF32 / 2048 BF16 / 128 FP32 FLOP per clock and SM, sm_86 and
//         sm_89 512 / 1024 / 256, sm_90 (H100, H200) 2048 / 4096 / 256. Other architectures: 0 (unknown),
//         and utilization is not printed.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/amx.hpp"
#include "fusedp/exec/cpu_features.hpp"
#include "fusedp/exec/host.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
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

// The chains below must stay in registers, or each instruction waits on a store and a load (a quarter
// of the rate). GCC at -O2 (RelWithDebInfo's level) keeps an array of vectors in memory even when its
// loops are unrolled, so these functions ask for -O3's; Clang's -O2 already does it.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define FUSEDP_PEAK_CHAINS __attribute__((optimize("O3")))
#else
#define FUSEDP_PEAK_CHAINS
#endif

// `rounds` rounds of 16 independent FMA chains (more than FMA latency x FMA ports, so throughput binds).
FUSEDP_PEAK_CHAINS [[gnu::noinline]] inline float fma_chains(long rounds, float seed) {
  constexpr int chains = 16;
  PeakVector acc[chains];
  FUSEDP_UNROLL(16)  // every loop over the chains unrolled, so that -O2 keeps them in registers too
  for (int c = 0; c < chains; ++c) acc[c] = PeakVector{} + seed * float(c + 1);
  const PeakVector m = PeakVector{} + 0.999999f, a = PeakVector{} + 1e-7f;
  for (long i = 0; i < rounds; ++i)
    for (int c = 0; c < chains; ++c) acc[c] = acc[c] * m + a;
  PeakVector s{};
  FUSEDP_UNROLL(16)
  for (int c = 0; c < chains; ++c) s += acc[c];
  float r = 0;
  for (int l = 0; l < peak_vector_bytes / 4; ++l) r += s[l];
  return r;
}

#if FUSEDP_HOST_AVX512_BF16
// bf16 1.0 in every 16-bit element of a zmm or a tile row, so every chain adds exact small integers.
inline constexpr std::uint16_t bf16_one = 0x3F80;

// `rounds` rounds of 16 independent VDPBF16PS chains (each lane += 1 * 1 + 1 * 1); returns the sum of
// every lane of every chain, 1920 + 512 x rounds exactly while that is below 2^24. Chain c starts at c:
// chains that start equal are one computation, and GCC computed it once (one VDPBF16PS a round, not 16:
// a rate of 16 instructions a latency, 624 GFLOP/s a Zen 4 core where the instruction's throughput gives
// a third of it).
FUSEDP_PEAK_CHAINS [[gnu::noinline, gnu::target("avx512f,avx512bw,avx512bf16")]] inline float dpbf16_chains(long rounds) {
  constexpr int chains = 16;
  __m512 acc[chains];
  FUSEDP_UNROLL(16)
  for (int c = 0; c < chains; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512bh one = (__m512bh)_mm512_set1_epi16(short(bf16_one));
  for (long i = 0; i < rounds; ++i)
    for (int c = 0; c < chains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], one, one);
  __m512 s = acc[0];
  FUSEDP_UNROLL(15)
  for (int c = 1; c < chains; ++c) s = _mm512_add_ps(s, acc[c]);
  alignas(64) float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns of -Wuninitialized in its headers)
  _mm512_store_ps(lanes, s);
  float sum = 0;
  for (float l : lanes) sum += l;
  return sum;
}

// `rounds` rounds of TDPBF16PS into four independent C tiles (0 .. 3) from the same A and B tiles of
// ones (4, 5), in the tile shapes of exec/amx.hpp: each element of C += 32 a round. Returns the sum of
// the four tiles' first and last elements, 256 x rounds exactly while that is below 2^24. The caller
// has checked amx_usable().
[[gnu::noinline, gnu::target("amx-tile,amx-bf16,avx512f")]] inline float amx_chains(long rounds) {
  configure_tiles();
  alignas(64) std::uint16_t ones[16 * 32];
  for (std::uint16_t& e : ones) e = bf16_one;
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long i = 0; i < rounds; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  float sum = 0;
  for (const auto& tile : c) sum += tile[0] + tile[16 * 16 - 1];
  return sum;
}
#endif

// The FLOP/s of `threads` threads each running `chains(rounds)`, `flops_per_round` a round, with
// `rounds` calibrated on one thread to take about `seconds`.
template <class Chains>
double measured_rate(int threads, double seconds, double flops_per_round, Chains chains) {
  long rounds = 1 << 10;
  for (;;) {  // calibrate on one thread
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = chains(rounds);
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
      volatile float sink = chains(rounds);
      (void)sink;
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[std::size_t(t)] = flops_per_round * double(rounds) / dt;
    });
  for (auto& t : pool) t.join();
  double total = 0;
  for (double r : rate) total += r;
  return total;
}
}  // namespace detail

/// The instruction whose rate is a Host's peak.
enum class HostPeak : unsigned char {
  fma32,     ///< float32 FMA at this translation unit's vector width
  dpbf16,    ///< VDPBF16PS (AVX-512 BF16)
  amx_bf16,  ///< TDPBF16PS on AMX tiles
};

/// The name of an instruction in messages: "fp32 FMA", "VDPBF16PS", "AMX TDPBF16PS".
[[nodiscard]] constexpr const char* to_string(HostPeak p) noexcept {
  return p == HostPeak::fma32 ? "fp32 FMA" : p == HostPeak::dpbf16 ? "VDPBF16PS" : "AMX TDPBF16PS";
}

/// The instruction `host` computes its products with: fp32 FMA at fp32 (and at bf16_emulated, which
/// computes bf16 products with fp32 instructions); at bf16, TDPBF16PS where its GEMMs run on tiles
/// (Host::bf16_tiles), else VDPBF16PS.
[[nodiscard]] inline HostPeak host_peak_instruction(const Host& host) noexcept {
  if (host.precision() != HostPrecision::bf16) return HostPeak::fma32;
  return host.bf16_tiles() ? HostPeak::amx_bf16 : HostPeak::dpbf16;
}

/// The rate of `threads` threads of this CPU running `what` (float32 FMA by default), in FLOP/s,
/// measured for about `seconds`. Throws InvalidArgument where this CPU (or this build) cannot run `what`.
inline double measure_host_peak_flops(int threads, double seconds = 0.05, HostPeak what = HostPeak::fma32) {
  require(threads >= 1, "measure_host_peak_flops: threads must be >= 1, got ", threads);
  require(seconds > 0, "measure_host_peak_flops: seconds must be > 0, got ", seconds);
  if (what == HostPeak::fma32)
    return detail::measured_rate(threads, seconds, 2.0 * 16 * (detail::peak_vector_bytes / 4),
                                 [](long rounds) { return detail::fma_chains(rounds, 1.0f); });
#if FUSEDP_HOST_AVX512_BF16
  if (what == HostPeak::dpbf16 && cpu_features().avx512_bf16)
    return detail::measured_rate(threads, seconds, 16 * 64.0, [](long rounds) { return detail::dpbf16_chains(rounds); });
  if (what == HostPeak::amx_bf16 && amx_usable())
    return detail::measured_rate(threads, seconds, 4 * 16384.0, [](long rounds) { return detail::amx_chains(rounds); });
#endif
  throw InvalidArgument(std::string("measure_host_peak_flops: ") + to_string(what) +
                        " does not run here (" +
                        (FUSEDP_HOST_AVX512_BF16 ? "this CPU, or its operating system, lacks it"
                                                 : "this build has no x86 intrinsics: not x86-64 GCC or Clang") +
                        ")");
}

/// The peak of `host`'s products on `threads` threads (host_peak_instruction), in FLOP/s.
inline double measure_host_peak_flops(const Host& host, int threads, double seconds = 0.05) {
  return measure_host_peak_flops(threads, seconds, host_peak_instruction(host));
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
