// gemm_gpu: the tensor-core mainloop (kernels/cuda/gemm_mma.cuh) against the WMMA gemm_kernel it is
// to replace, on the GEMM problems of the seed networks at batch 128 (and the width-128 MLP at 2^18
// rows), TF32 (two problems also in BF16): CIFAR-10 conv2's three implicit GEMMs with the operands
// conv2d.cuh builds (im2col gathered on the fly, dz stored densely as conv2d_backward leaves it), and
// plain GEMMs of operands in memory with the layouts a Linear reads (Rows: the reduction index
// contiguous; Columns: the rows contiguous). Weight gradients run the split-K flow (partial products,
// then the fixed-order sum) with the bias row sums, as the layers do. Times are CUDA events around
// each launch, median of 30 after 5 warm-ups. One line per problem and kernel (placeholders here):
//
//   GEMM name=cifar.conv2.dw m=128 n=576 k=32768 impl=mma us=<time> tflops=<rate> peak_pct=<share>
//
// then a Markdown table (benchmarks/RESULTS.md). A second table times the BF16 mainloop on the same
// CIFAR-10 problems with the activations and gradients in memory as fp32 (copied by cp.async) and as
// BFloat16 (half the bytes, loaded through registers: what a 16-bit workspace would make the layers run):
//
//   HELD name=cifar.conv2.dw impl=fp32 us=<time>   and   HELD name=cifar.conv2.dw impl=bf16 us=<time>
//
// Written and compiled without a GPU; its numbers exist only once someone runs it on one
// (benchmarks/gpu/check.sh does).
#include <fusedp/exec/peak.hpp>
#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/cuda/conv2d.cuh>
#include <fusedp/kernels/cuda/gemm.cuh>
#include <fusedp/kernels/cuda/gemm_mma.cuh>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace kc = fusedp::kernels::cuda;

namespace {

struct Row {
  std::string name;
  int m, n, k;
  double us_wmma, us_mma;
};

template <class F>
double median_us(cudaStream_t stream, F&& launch) {
  cudaEvent_t start, stop;
  FUSEDP_CUDA_CHECK(cudaEventCreate(&start));
  FUSEDP_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 30; ++i) {
    FUSEDP_CUDA_CHECK(cudaEventRecord(start, stream));
    launch();
    FUSEDP_CUDA_CHECK(cudaEventRecord(stop, stream));
    FUSEDP_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    FUSEDP_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  FUSEDP_CUDA_CHECK(cudaEventDestroy(start));
  FUSEDP_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return 1e3 * double(ms[ms.size() / 2]);
}

template <class L>
L operand(const float* p, int rows, int k) {
  return L{p, L::k_fastest ? k : rows};
}
template <class L>
const char* layout_name() {
  return L::k_fastest ? "rows" : "cols";
}

// One problem: C (m x n) = A(m, k) B(n, k), a plain store (forward, input gradient), or with `weight`
// the split-K weight gradient with row sums. N: the layer width that picks both kernels' tiles; P: TF32
// or BF16 on both.
template <int N, class A, class B, class P = fp::precision::Tf32>
Row run(const fp::Cuda& space, const char* name, int m, int n, int k, bool weight, float* a, float* b, float* c,
        float* sums, float* scratch) {
  using TileW = kc::tile_for<N>;
  using TileM = kc::mma::mma_tile_for<N>;
  const A oa = operand<A>(a, m, k);
  const B ob = operand<B>(b, n, k);
  const cudaStream_t s = space.stream();
  const int sms = space.sm_count();
  const auto arch = kc::MmaDevice::of(space);
  const kc::GemmProblem<A, B, kc::StoreRowMajor> p{m, n, k, k, oa, ob, {c, m, n, 0}, nullptr};
  const double us_wmma = median_us(s, [&] {
    if (weight) kc::weight_gradient<TileW, P>(s, sms, m, n, k, oa, ob, c, sums, scratch);
    else kc::launch_gemm<TileW, P, false>(p, 1, s);
  });
  const double us_mma = median_us(s, [&] {
    if (weight) kc::weight_gradient_mma<TileM, P>(s, sms, arch, m, n, k, oa, ob, c, sums, scratch);
    else kc::launch_gemm_mma<TileM, false, P>(p, 1, arch, s);
  });
  return {name, m, n, k, us_wmma, us_mma};
}

// CIFAR-10 conv2 (64 -> 128 channels, 3x3, pad 1, 16x16 planes) at batch 128: forward (ReLU epilogue),
// input gradient and weight gradient (with db) as conv2d.cuh's problems, each kernel with its tiles.
void run_conv(const fp::Cuda& space, std::vector<Row>& rows, float* x, float* w, float* b, float* y, float* dz,
              float* dx, float* dw, float* db, float* scratch) {
  constexpr fp::kernels::ConvGeometry g{64, 16, 16, 3, 1, 1, 128, 16, 16};
  constexpr int batch = 128;
  using Epi = fp::kernels::Epilogue<fp::kernels::Relu>;
  using P = fp::precision::Tf32;
  const kc::ConvShape s(g);
  const cudaStream_t st = space.stream();
  const int sms = space.sm_count();
  const auto arch = kc::MmaDevice::of(space);
  const auto fwd = kc::conv2d_forward_problem<Epi>(s, batch, w, b, x, y, nullptr);
  rows.push_back({"cifar.conv2.fwd", fwd.m, fwd.n, fwd.k,
                  median_us(st, [&] { kc::launch_gemm<kc::tile_for<128>, P, false>(fwd, 1, st); }),
                  median_us(st, [&] { kc::launch_gemm_mma<kc::mma::mma_tile_for<128>, false>(fwd, 1, arch, st); })});
  const kc::StoredGradient sd{dz, s.o, s.ohw, s.ow};
  const auto dxp = kc::conv2d_dx_problem(s, batch, sd, w, dx);
  rows.push_back({"cifar.conv2.dx", dxp.m, dxp.n, dxp.k,
                  median_us(st, [&] { kc::launch_gemm<kc::tile_for<64>, P, false>(dxp, 1, st); }),
                  median_us(st, [&] { kc::launch_gemm_mma<kc::mma::mma_tile_for<64>, false>(dxp, 1, arch, st); })});
  const auto ops = kc::conv2d_dw_operands(s, batch, sd, x);
  rows.push_back({"cifar.conv2.dw", ops.m, ops.n, ops.k, median_us(st, [&] {
                    kc::weight_gradient<kc::tile_for<576>, P>(st, sms, ops.m, ops.n, ops.k, ops.a, ops.b, dw, db, scratch);
                  }),
                  median_us(st, [&] {
                    kc::weight_gradient_mma<kc::mma::mma_tile_for<576>>(st, sms, arch, ops.m, ops.n, ops.k, ops.a, ops.b,
                                                                        dw, db, scratch);
                  })});
}

// The BF16 mainloop on one problem with its activation operands in memory as fp32 and as BFloat16.
struct HeldRow {
  std::string name;
  double us_fp32, us_bf16;
};

// CIFAR-10 conv2's three implicit GEMMs and fc1's three GEMMs (batch 128) in BF16, x and dz read from
// fp32 (x32, dz32) or from BFloat16 (x16, dz16) memory; weights fp32 either way.
void run_held(const fp::Cuda& space, std::vector<HeldRow>& rows, const float* x32, const float* dz32,
              const fp::kernels::BFloat16* x16, const fp::kernels::BFloat16* dz16, const float* w, const float* b,
              float* c, float* sums, float* scratch) {
  using P = fp::precision::Bf16;
  using Epi = fp::kernels::Epilogue<fp::kernels::Relu>;
  constexpr fp::kernels::ConvGeometry g{64, 16, 16, 3, 1, 1, 128, 16, 16};
  constexpr int batch = 128;
  const kc::ConvShape s(g);
  const cudaStream_t st = space.stream();
  const int sms = space.sm_count();
  const auto arch = kc::MmaDevice::of(space);
  const auto both = [&](const char* name, auto&& launch) {
    rows.push_back({name, median_us(st, [&] { launch(x32, dz32); }), median_us(st, [&] { launch(x16, dz16); })});
  };
  both("cifar.conv2.fwd", [&](const auto* x, const auto*) {
    kc::launch_gemm_mma<kc::mma::mma_tile_for<128>, false, P>(
        kc::conv2d_forward_problem<Epi>(s, batch, w, b, x, c, nullptr), 1, arch, st);
  });
  both("cifar.conv2.dx", [&](const auto*, const auto* dz) {
    using E = std::remove_cvref_t<decltype(*dz)>;
    const kc::StoredGradientOf<E> sd{dz, s.o, s.ohw, s.ow};
    kc::launch_gemm_mma<kc::mma::mma_tile_for<64>, false, P>(kc::conv2d_dx_problem(s, batch, sd, w, c), 1, arch, st);
  });
  both("cifar.conv2.dw", [&](const auto* x, const auto* dz) {
    using E = std::remove_cvref_t<decltype(*dz)>;
    const kc::StoredGradientOf<E> sd{dz, s.o, s.ohw, s.ow};
    const auto ops = kc::conv2d_dw_operands(s, batch, sd, x);
    kc::weight_gradient_mma<kc::mma::mma_tile_for<576>, P>(st, sms, arch, ops.m, ops.n, ops.k, ops.a, ops.b, c, sums,
                                                           scratch);
  });
  const int in = 8192, out = 1024;
  both("cifar.fc1.fwd", [&](const auto* x, const auto*) {
    using E = std::remove_cvref_t<decltype(*x)>;
    const kc::GemmProblem<kc::RowsOf<E>, kc::Rows, kc::StoreRowMajor> p{batch, out, in, in, {x, in}, {w, in},
                                                                        {c, batch, out, 0}, nullptr};
    kc::launch_gemm_mma<kc::mma::mma_tile_for<1024>, false, P>(p, 1, arch, st);
  });
  both("cifar.fc1.dx", [&](const auto*, const auto* dz) {
    using E = std::remove_cvref_t<decltype(*dz)>;
    const kc::GemmProblem<kc::RowsOf<E>, kc::Columns, kc::StoreRowMajor> p{batch, in, out, out, {dz, out}, {w, in},
                                                                           {c, batch, in, 0}, nullptr};
    kc::launch_gemm_mma<kc::mma::mma_tile_for<8192>, false, P>(p, 1, arch, st);
  });
  both("cifar.fc1.dw", [&](const auto* x, const auto* dz) {
    using E = std::remove_cvref_t<decltype(*dz)>;
    kc::weight_gradient_mma<kc::mma::mma_tile_for<8192>, P>(st, sms, arch, out, in, batch, kc::ColumnsOf<E>{dz, out},
                                                            kc::ColumnsOf<E>{x, in}, c, sums, scratch);
  });
}

}  // namespace

int main() try {
  if (fp::cuda_device_count() == 0) {
    std::printf("gemm_gpu: no CUDA device (%s)\n", fp::cuda_unavailable_reason().c_str());
    return 3;
  }
  fp::Cuda space;
  if (space.architecture() < 80) {
    std::printf("gemm_gpu: the tensor-core mainloop needs sm_80; this device is sm_%d\n", space.architecture());
    return 3;
  }
  const double peak = fp::cuda_peak_flops(space);  // dense TF32 tensor-core rate of this device
  // Operands up to 4096 x 4096 and 32768 x 1152 floats; scratch for the largest split plan.
  const std::size_t big = std::size_t(40) << 20;
  fp::DeviceBuffer<float> a(big), b(big), c(big), sums(std::size_t(1) << 20), scratch(std::size_t(64) << 20);
  const auto fill = [&](fp::DeviceBuffer<float>& buf, float v) {
    std::vector<float> h(buf.size());
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = v * float(int(i % 97) - 48) / 48.0f;
    fp::copy_async(buf.data(), h.data(), h.size(), space.stream());
    space.synchronize();
  };
  fill(a, 1.0f);
  fill(b, 0.5f);
  using R = kc::Rows;
  using C = kc::Columns;
  float *pa = a.data(), *pb = b.data(), *pc = c.data(), *ps = sums.data(), *pt = scratch.data();
  std::vector<Row> rows;
  // The CIFAR-10 CNN at batch 128: conv2's implicit GEMMs, then fc1's three GEMMs.
  run_conv(space, rows, pa, pb, pb + (std::size_t(1) << 20), pc, pa + (std::size_t(16) << 20), pc, pc, ps, pt);
  rows.push_back(run<1024, R, R>(space, "cifar.fc1.fwd", 128, 1024, 8192, false, pa, pb, pc, ps, pt));
  rows.push_back(run<8192, R, C>(space, "cifar.fc1.dx", 128, 8192, 1024, false, pa, pb, pc, ps, pt));
  rows.push_back(run<8192, C, C>(space, "cifar.fc1.dw", 1024, 8192, 128, true, pa, pb, pc, ps, pt));
  // The width-128 MLP at 2^18 rows: one hidden layer's forward and weight gradient.
  rows.push_back(run<128, R, R>(space, "mlp128.fwd", 262144, 128, 128, false, pa, pb, pc, ps, pt));
  rows.push_back(run<128, C, C>(space, "mlp128.dw", 128, 128, 262144, true, pa, pb, pc, ps, pt));
  // A square reference.
  rows.push_back(run<4096, R, R>(space, "square4096", 4096, 4096, 4096, false, pa, pb, pc, ps, pt));
  // BF16 tensor cores (m16n8k16) on both, for the same square and fc1's weight gradient; the % of peak
  // column is still of the TF32 peak (BF16's is twice it).
  rows.push_back(run<4096, R, R, fp::precision::Bf16>(space, "square4096.bf16", 4096, 4096, 4096, false, pa, pb, pc,
                                                       ps, pt));
  rows.push_back(run<8192, C, C, fp::precision::Bf16>(space, "cifar.fc1.dw.bf16", 1024, 8192, 128, true, pa, pb, pc,
                                                       ps, pt));
  // The same values as BFloat16 for the 16-bit operands (x from a, dz from a's second half).
  fp::DeviceBuffer<fp::kernels::BFloat16> a16(big);
  {
    std::vector<float> h(a16.size());
    fp::copy_async(h.data(), a.data(), h.size(), space.stream());
    space.synchronize();
    std::vector<fp::kernels::BFloat16> h16(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) h16[i].bits = fp::kernels::to_bf16(h[i]);
    fp::copy_async(a16.data(), h16.data(), h16.size(), space.stream());
    space.synchronize();
  }
  std::vector<HeldRow> held;
  const std::size_t half = big / 2;
  run_held(space, held, pa, pa + half, a16.data(), a16.data() + half, pb, pb + (std::size_t(1) << 20), pc, ps, pt);

  std::printf("| problem | m x n x k | WMMA us | WMMA TFLOP/s | mma.sync us | mma.sync TFLOP/s | %% of %.0f TFLOP/s |\n",
              peak / 1e12);
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double flops = 2.0 * r.m * r.n * double(r.k);
    const double tw = flops / (r.us_wmma * 1e-6) / 1e12, tm = flops / (r.us_mma * 1e-6) / 1e12;
    std::printf("GEMM name=%s m=%d n=%d k=%d impl=wmma us=%.1f tflops=%.1f\n", r.name.c_str(), r.m, r.n, r.k, r.us_wmma, tw);
    std::printf("GEMM name=%s m=%d n=%d k=%d impl=mma us=%.1f tflops=%.1f peak_pct=%.1f\n", r.name.c_str(), r.m, r.n,
                r.k, r.us_mma, tm, 100.0 * tm * 1e12 / peak);
    std::printf("| %s | %d x %d x %d | %.1f | %.1f | %.1f | %.1f | %.1f |\n", r.name.c_str(), r.m, r.n, r.k, r.us_wmma, tw,
                r.us_mma, tm, 100.0 * tm * 1e12 / peak);
  }
  std::printf("\n| problem (BF16 mainloop) | x, dz fp32 us | x, dz BFloat16 us | BFloat16 / fp32 |\n|---|---|---|---|\n");
  for (const HeldRow& r : held) {
    std::printf("HELD name=%s impl=fp32 us=%.1f\n", r.name.c_str(), r.us_fp32);
    std::printf("HELD name=%s impl=bf16 us=%.1f\n", r.name.c_str(), r.us_bf16);
    std::printf("| %s | %.1f | %.1f | %.2f |\n", r.name.c_str(), r.us_fp32, r.us_bf16, r.us_bf16 / r.us_fp32);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gemm_gpu: %s\n", e.what());
  return 1;
}
