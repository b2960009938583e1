// fma_peak: measures the machine's peak arithmetic rates, the denominators of "% of peak" in
// benchmarks/RESULTS.md and of the examples' utilization (exec/peak.hpp measures them): float32 FMA at
// the vector width the compiler targets (zmm with -march of an AVX-512 machine, ymm with AVX2, 128-bit
// otherwise), and where the CPU has them VDPBF16PS (AVX-512 BF16) and AMX's TDPBF16PS, on 1 and on N
// threads. Each thread runs more independent chains than the instruction's latency times its ports, so
// throughput binds, not latency. Each figure is the best of three runs (a preempted run lowers one).
//
//   fma_peak [threads=2] [seconds per run=0.5]
#include <fusedp/exec/cpu_features.hpp>
#include <fusedp/exec/peak.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace fp = fusedp;

namespace {

#if defined(__AVX512F__)
constexpr const char* isa = "AVX-512 (zmm)";
#elif defined(__AVX__)
constexpr const char* isa = "AVX/AVX2 (ymm)";
#else
constexpr const char* isa = "128-bit (SSE/NEON)";
#endif

double best_of_three(int threads, double seconds, fp::HostPeak what) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) best = std::max(best, fp::measure_host_peak_flops(threads, seconds, what) / 1e9);
  return best;
}

void report(const char* title, int threads, double seconds, fp::HostPeak what) {
  std::printf("%s\n", title);
  const double one = best_of_three(1, seconds, what);
  std::printf("1 thread   %8.1f GFLOP/s\n", one);
  if (threads > 1) {
    const double all = best_of_three(threads, seconds, what);
    std::printf("%d threads  %8.1f GFLOP/s  (%.2fx one thread)\n", threads, all, all / one);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  if (threads < 1 || seconds <= 0) {
    std::fprintf(stderr, "usage: fma_peak [threads >= 1] [seconds > 0]\n");
    return 1;
  }
  char title[96];
  std::snprintf(title, sizeof title, "float32 FMA peak, %s, 16 chains", isa);
  report(title, threads, seconds, fp::HostPeak::fma32);
  if (fp::cpu_features().avx512_bf16)
    report("bf16 VDPBF16PS peak (64 FLOP a zmm), 16 chains", threads, seconds, fp::HostPeak::dpbf16);
  else std::printf("bf16 VDPBF16PS: not on this CPU\n");
  if (fp::amx_usable())
    report("bf16 AMX TDPBF16PS peak (16 x 16 x 32 products a tile), 4 tiles", threads, seconds, fp::HostPeak::amx_bf16);
  else std::printf("bf16 AMX tiles: not on this CPU, or not granted by its operating system\n");
  return 0;
}
