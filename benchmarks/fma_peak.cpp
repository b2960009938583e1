// fma_peak: measures the machine's float32 fused multiply-add peak at the vector width the compiler
// targets (zmm with -march of an AVX-512 machine, ymm with AVX2, 128-bit otherwise), on 1 and on N
// threads. Each thread runs `Chains` independent FMA chains, more than the FMA latency (4 cycles)
// times the FMA ports (2), so the loop is bound by FMA throughput, not by latency. The numbers are the
// denominator of "% of peak" in benchmarks/RESULTS.md.
//
//   fma_peak [threads=2] [seconds per run=0.5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int vector_bytes = 64;
constexpr const char* isa = "AVX-512 (zmm)";
#elif defined(__AVX__)
constexpr int vector_bytes = 32;
constexpr const char* isa = "AVX/AVX2 (ymm)";
#else
constexpr int vector_bytes = 16;
constexpr const char* isa = "128-bit (SSE/NEON)";
#endif
using V [[gnu::vector_size(vector_bytes)]] = float;
constexpr int lanes = vector_bytes / 4;
constexpr int chains = 16;

// Runs `iters` rounds of `chains` independent FMAs; returns a value so nothing is optimized away.
[[gnu::noinline]] float run(long iters, float seed) {
  V acc[chains];
  for (int c = 0; c < chains; ++c) acc[c] = V{} + seed * float(c + 1);
  V m = V{} + 0.999999f, a = V{} + 1e-7f;
  for (long i = 0; i < iters; ++i) {
    for (int c = 0; c < chains; ++c) acc[c] = acc[c] * m + a;
  }
  V s = V{};
  for (int c = 0; c < chains; ++c) s += acc[c];
  float r = 0;
  for (int l = 0; l < lanes; ++l) r += s[l];
  return r;
}

// GFLOP/s (2 flops per lane per FMA) of `threads` threads running the chains for about `seconds`.
double measure(int threads, double seconds) {
  long iters = 1 << 20;
  // Calibrate on one thread so that one run takes about `seconds`.
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = run(iters, 1.0f);
    (void)sink;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4) {
      iters = long(double(iters) * seconds / dt);
      break;
    }
    iters *= 4;
  }
  std::vector<double> best(threads, 0.0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) {  // best of three: a preempted run only lowers one sample
        const auto t0 = std::chrono::steady_clock::now();
        volatile float sink = run(iters, float(t + 1));
        (void)sink;
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best[t] = std::max(best[t], 2.0 * lanes * chains * double(iters) / dt / 1e9);
      }
    });
  for (auto& p : pool) p.join();
  double total = 0;
  for (double b : best) total += b;
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  if (threads < 1 || seconds <= 0) {
    std::fprintf(stderr, "usage: fma_peak [threads >= 1] [seconds > 0]\n");
    return 1;
  }
  std::printf("float32 FMA peak, %s, %d chains\n", isa, chains);
  const double one = measure(1, seconds);
  std::printf("1 thread   %7.1f GFLOP/s\n", one);
  if (threads > 1) {
    const double all = measure(threads, seconds);
    std::printf("%d threads  %7.1f GFLOP/s  (%.2fx one thread)\n", threads, all, all / one);
  }
  return 0;
}
