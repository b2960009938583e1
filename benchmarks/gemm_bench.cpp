// gemm_bench: GFLOP/s of the Host GEMM (kernels/host/gemm.hpp) on the products a train step of the seed
// networks runs, with their operand layouts (N: row-major, T: transposed), on one thread or split over
// threads. Each case reports the best of many repetitions, so a busy machine lowers fewer numbers.
// Products of k-contiguous operands (A row-major, B transposed) are also timed in gemm_nt
// (kernels/host/gemm_nt.hpp, on one thread: a convolution's weight gradient is one thread's per sample),
// and the last column says which of the two use_nt picks.
//
// With --bf16 (third argument) each product is also timed at precision bf16 (gemm_bf16.hpp, AVX-512
// BF16), in the columns after the fp32 ones.
//
//   gemm_bench [threads=1] [seconds per case=0.3] [--bf16]
#include <fusedp/kernels/host/gemm.hpp>
#include <fusedp/kernels/host/gemm_bf16.hpp>
#include <fusedp/kernels/host/gemm_nt.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kh = fusedp::kernels::host;

namespace {

struct Case {
  const char* name;
  std::size_t m, n, k;
  bool ta, tb;  // A stored as (k x m), B stored as (n x k)
  bool a_in_place = false;  // A read where it lies (gemm_a_in_place), as linear.hpp runs the forward
};

// (batch 64) CIFAR-10 CNN: conv2 per sample and linear1 over the batch; LeNet: per sample and batch.
constexpr Case cases[] = {
    {"cifar conv2 fwd   W*col", 128, 256, 576, false, false},
    {"cifar conv2 dW    dz*col^T", 128, 576, 256, false, true},
    {"cifar conv2 dx    W^T*dz", 576, 256, 128, true, false},
    {"cifar conv1 fwd   W*col", 64, 1024, 27, false, false},
    {"cifar conv1 dW    dz*col^T", 64, 27, 1024, false, true},
    {"cifar fc1 fwd     x*W^T", 64, 1024, 8192, false, true},
    {"cifar fc1 dW      dz^T*x", 1024, 8192, 64, true, false},
    {"cifar fc1 dx      dz*W", 64, 8192, 1024, false, false},
    // fc1's forward as linear.hpp runs it: y^T = W x^T, W read in place.
    {"cifar fc1 fwd     W*x^T, in place", 1024, 64, 8192, false, true, true},
    {"lenet conv1 fwd   W*col", 6, 576, 25, false, false},
    {"lenet conv1 dW    dz*col^T", 6, 25, 576, false, true},
    {"lenet conv2 fwd   W*col", 16, 100, 54, false, false},
    {"lenet conv2 dW    dz*col^T", 16, 54, 100, false, true},
    {"lenet conv2 dx    W^T*dz", 54, 100, 16, true, false},
    {"lenet fc1 fwd     x*W^T", 64, 120, 400, false, true},
    {"lenet fc1 dW      dz^T*x", 120, 400, 64, true, false},
    {"lenet fc1 dx      dz*W", 64, 400, 120, false, false},
    // ResNet-18 (CIFAR form): the weight gradients of each stage's 3x3 convs, per sample.
    {"resnet l1 conv dW dz*col^T", 64, 576, 1024, false, true},
    {"resnet l2 conv dW dz*col^T", 128, 1152, 256, false, true},
    {"resnet l3 conv dW dz*col^T", 256, 2304, 64, false, true},
    {"resnet l4 conv dW dz*col^T", 512, 4608, 16, false, true},
    // The conv weight gradients as conv2d.hpp runs them: dW^T = col dz^T, the im2col matrix in place.
    {"cifar conv2 dW^T  col*dz^T", 576, 128, 256, false, true, true},
    {"resnet l1 dW^T    col*dz^T", 576, 64, 1024, false, true, true},
    {"resnet l2 dW^T    col*dz^T", 1152, 128, 256, false, true, true},
    {"resnet l3 dW^T    col*dz^T", 2304, 256, 64, false, true, true},
    {"resnet l4 dW^T    col*dz^T", 4608, 512, 16, false, true, true},
};

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.3;
  const fusedp::Host host{threads};
  const bool bf16 = argc > 3 && std::string(argv[3]) == "--bf16";
  const fusedp::Host bf16_host = bf16 ? host.with_precision(fusedp::HostPrecision::bf16) : host;
  std::printf("%-34s %6s %6s %6s %5s %9s %9s %9s %9s %5s\n", "product", "m", "n", "k", "tile", "us", "GFLOP/s",
              "nt us", "nt GF/s", "picks");
  if (threads != 1) std::printf("(gemm_nt on one thread)\n");
  for (const Case& c : cases) {
    std::vector<float> a(c.m * c.k), b(c.k * c.n), out(c.m * c.n);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(i % 7) * 0.1f - 0.3f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(i % 5) * 0.1f - 0.2f;
    const kh::MatrixRef<float> ar = c.ta ? kh::MatrixRef<float>{a.data(), 1, c.m} : kh::row_major(a.data(), c.k);
    const kh::MatrixRef<float> br = c.tb ? kh::MatrixRef<float>{b.data(), 1, c.k} : kh::row_major(b.data(), c.n);
    auto best_of = [&](auto&& once) {
      once();
      double best = 1e30, total = 0;
      while (total < seconds) {
        const auto t0 = std::chrono::steady_clock::now();
        once();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
        total += dt;
      }
      return best;
    };
    const double flop = 2.0 * double(c.m * c.n * c.k);
    const double best = best_of([&] {
      if (c.a_in_place) kh::gemm_a_in_place(host, c.m, c.n, c.k, ar, br, out.data(), c.n, false);
      else kh::gemm(host, c.m, c.n, c.k, ar, br, out.data(), c.n, false);
    });
    const auto s = kh::choose_tile<float>(c.m, c.n);
    std::printf("%-34s %6zu %6zu %6zu %2zux%zu %9.1f %9.1f", c.name, c.m, c.n, c.k, kh::detail::shapes[s].mr,
                kh::detail::shapes[s].nv, best * 1e6, flop / best / 1e9);
    if (bf16 && !c.a_in_place) {
      const double t = best_of(
          [&] { kh::gemm_at_precision(bf16_host, c.m, c.n, c.k, ar, br, out.data(), c.n, false); });
      std::printf("  bf16 %9.1f us %7.1f GF/s", t * 1e6, flop / t / 1e9);
    }
    if (!c.ta && c.tb) {
      const double nt =
          best_of([&] { kh::gemm_nt(c.m, c.n, c.k, a.data(), c.k, b.data(), c.k, out.data(), c.n, false); });
      std::printf(" %9.1f %9.1f %5s", nt * 1e6, flop / nt / 1e9, kh::use_nt(c.m, c.n, c.k) ? "nt" : "gemm");
    }
    std::printf("\n");
  }
  return 0;
}
