// The tensor-core GEMM mainloop (kernels/cuda/gemm_mma.cuh) on a device: every tile of the closed set
// and every operand layout (Rows and Columns for A and B), with edges in m, n and k, split-K and the
// row sums, against a double GEMM of the TF32-rounded operands on the host, and against the WMMA
// gemm_kernel it is to replace. The CPU emulation of the same index math is
// tests/kernels/cuda/mma_layout.cpp; this is what checks the hardware (the cp.async pipeline, the real
// ldmatrix and mma.sync).
#include "gpu_test.hpp"

#include <algorithm>

#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/cuda/conv2d.cuh>
#include <fusedp/kernels/cuda/gemm_dispatch.cuh>
#include <fusedp/kernels/cuda/gemm_mma.cuh>
#include <fusedp/kernels/cuda/linear.cuh>
#include <fusedp/kernels/host/linear.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace fp = fusedp;
namespace kc = fusedp::kernels::cuda;
namespace mma = fusedp::kernels::cuda::mma;

namespace {

// A (rows x k) operand as the loader L reads it, leading dimension padded to a multiple of 4.
template <class L>
struct HostOperand {
  int rows, k, ld;
  std::vector<float> data;
  float at(int r, int kk) const {
    return L::k_fastest ? data[std::size_t(r) * ld + kk] : data[std::size_t(kk) * ld + r];
  }
};

template <class L>
HostOperand<L> make_operand(int rows, int k, std::uint64_t stream) {
  HostOperand<L> o{rows, k, ((L::k_fastest ? k : rows) + 3) / 4 * 4, {}};
  const int outer = L::k_fastest ? rows : k;
  o.data = gpu_test::random_values(std::size_t(outer) * o.ld, stream);
  return o;
}

template <class TileT, class A, class B, class P = fp::precision::Tf32>
void check_mma_gemm(const fp::Cuda& space, int m, int n, int k, int k_chunk, std::uint64_t stream) {
  constexpr bool bf16 = std::is_same_v<P, fp::precision::Bf16>;
  CAPTURE(bf16);
  CAPTURE(TileT::bm);
  CAPTURE(TileT::bn);
  CAPTURE(A::k_fastest);
  CAPTURE(B::k_fastest);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(k_chunk);
  const HostOperand<A> ha = make_operand<A>(m, k, stream);
  const HostOperand<B> hb = make_operand<B>(n, k, stream + 1);
  const auto da = gpu_test::upload(space, ha.data), db = gpu_test::upload(space, hb.data);
  const int splits = (k + k_chunk - 1) / k_chunk;
  const std::size_t count = std::size_t(m) * n;
  auto c = gpu_test::poisoned<float>(space, splits * count);
  auto sums = gpu_test::poisoned<float>(space, std::size_t(splits) * m);
  const kc::GemmProblem<A, B, kc::StoreRowMajor> p{m,          n, k, k_chunk, A{da.data(), ha.ld}, B{db.data(), hb.ld},
                                                   {c.data(), m, n, count}, sums.data()};
  const auto dev = kc::MmaDevice::of(space);
  if (TileT::template smem_bytes<kc::major_of<A>, kc::major_of<B>> > dev.smem_per_block) {
    MESSAGE("tile does not fit this device's shared memory per block: the WMMA mainloop runs it");
    CHECK_FALSE(kc::gemm_mma_can_run<TileT>(p, dev));
    return;
  }
  REQUIRE(kc::gemm_mma_can_run<TileT>(p, dev));
  kc::launch_gemm_mma<TileT, true, P>(p, splits, dev, space.stream());
  const auto got = gpu_test::download(space, c), got_sums = gpu_test::download(space, sums);

  std::vector<double> want(splits * count), want_sums(std::size_t(splits) * m);
  double worst = 0;
  for (int z = 0; z < splits; ++z) {
    const int k0 = z * k_chunk, k1 = std::min(k, k0 + k_chunk);
    for (int i = 0; i < m; ++i) {
      double rs = 0, rs_abs = 0;
      for (int kk = k0; kk < k1; ++kk) {
        rs += ha.at(i, kk);
        rs_abs += std::fabs(ha.at(i, kk));
      }
      worst = std::max(worst, std::fabs(got_sums[std::size_t(z) * m + i] - rs) / (rs_abs + 1e-30));
      for (int j = 0; j < n; ++j) {
        double s = 0, mag = 0;
        for (int kk = k0; kk < k1; ++kk) {
          const auto round = [](float v) { return bf16 ? mma::round_bf16_host(v) : mma::round_tf32_host(v); };
          const double pr = double(round(ha.at(i, kk))) * double(round(hb.at(j, kk)));
          s += pr;
          mag += std::fabs(pr);
        }
        const double g = got[z * count + std::size_t(i) * n + j];
        worst = std::max(worst, std::isfinite(g) ? std::fabs(g - s) / (mag + 1e-30) : INFINITY);
      }
    }
  }
  // fp32 accumulation of TF32 (BF16) products: a few ulps of the magnitude sum, not the operands' rounding.
  CHECK_MESSAGE(worst <= 1e-5, "worst error relative to the sum of |products|: " << worst);
}

template <class TileT>
void check_all_layouts(const fp::Cuda& space, int m, int n, int k, int k_chunk, std::uint64_t stream) {
  check_mma_gemm<TileT, kc::Rows, kc::Rows>(space, m, n, k, k_chunk, stream);
  check_mma_gemm<TileT, kc::Rows, kc::Columns>(space, m, n, k, k_chunk, stream + 10);
  check_mma_gemm<TileT, kc::Columns, kc::Rows>(space, m, n, k, k_chunk, stream + 20);
  check_mma_gemm<TileT, kc::Columns, kc::Columns>(space, m, n, k, k_chunk, stream + 30);
}

// A convolution's three implicit GEMMs (forward with bias and ReLU, dx, dW with db; dz stored densely
// as conv2d_backward leaves it) on the tensor-core mainloop and on the WMMA one: the gathers' zero fill
// (padding, stride) and the epilogues over the new tiles.
template <int O, int C, int Patch>
void check_conv_both(const fp::Cuda& space, const fp::kernels::ConvGeometry& g, int batch, std::uint64_t stream) {
  CAPTURE(batch);
  CAPTURE(g.in_channels);
  CAPTURE(g.stride);
  CAPTURE(g.pad);
  using Epi = fp::kernels::Epilogue<fp::kernels::Relu>;
  using P = fp::precision::Tf32;
  const auto arch = kc::MmaDevice::of(space);
  const int sms = space.sm_count();
  const cudaStream_t st = space.stream();
  const kc::ConvShape s(g);
  const auto x = gpu_test::upload(space, gpu_test::random_values(batch * g.in_size(), stream));
  const auto w = gpu_test::upload(space, gpu_test::random_values(g.out_channels * g.patch(), stream + 1));
  const auto b = gpu_test::upload(space, gpu_test::random_values(std::size_t(g.out_channels), stream + 2));
  const auto dzv = gpu_test::upload(space, gpu_test::random_values(batch * g.out_size(), stream + 3));
  const std::size_t scratch_floats = std::max(kc::weight_gradient_scratch<kc::tile_for<Patch>>(O, Patch, batch * s.ohw, sms),
                                              kc::weight_gradient_scratch<kc::mma::mma_tile_for<Patch>>(O, Patch, batch * s.ohw, sms));
  // [run][y, dx, dW, db]. Runs: WMMA with the split weight gradient reduced by reduce_splits_kernel;
  // the tensor-core mainloop reducing its own tiles (the stream's arrival counters); WMMA reducing its
  // own tiles, twice (the counters must be back at zero for the second).
  std::vector<float> got[4][4];
  for (int kernel = 0; kernel < 4; ++kernel) {
    // Poisoned for every run: no run may find the partial products of the one before.
    auto scratch = gpu_test::poisoned<float>(space, scratch_floats + 1);
    auto y = gpu_test::poisoned<float>(space, batch * g.out_size());
    auto dx = gpu_test::poisoned<float>(space, batch * g.in_size());
    auto dw = gpu_test::poisoned<float>(space, g.out_channels * g.patch());
    auto db = gpu_test::poisoned<float>(space, std::size_t(g.out_channels));
    const auto fwd = kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), y.data(), nullptr);
    const kc::StoredGradient sd{dzv.data(), s.o, s.ohw, s.ow};
    const auto dxp = kc::conv2d_dx_problem(s, batch, sd, w.data(), dx.data());
    const auto ops = kc::conv2d_dw_operands(s, batch, sd, x.data());
    if (kernel != 1) {
      kc::launch_gemm<kc::tile_for<O>, P, false>(fwd, 1, st);
      kc::launch_gemm<kc::tile_for<C>, P, false>(dxp, 1, st);
      kc::weight_gradient<kc::tile_for<Patch>, P>(st, sms, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(), db.data(),
                                                   scratch.data(), {},
                                                   kernel == 0 ? fp::ArrivalCounters{} : space.arrival_counters());
    } else {
      if (kc::gemm_mma_can_run<kc::mma::mma_tile_for<O>>(fwd, arch))
        kc::launch_gemm_mma<kc::mma::mma_tile_for<O>, false>(fwd, 1, arch, st);
      else kc::launch_gemm<kc::tile_for<O>, P, false>(fwd, 1, st);  // weight rows not 16-byte aligned
      kc::launch_gemm_mma<kc::mma::mma_tile_for<C>, false>(dxp, 1, arch, st);
      kc::weight_gradient_mma<kc::mma::mma_tile_for<Patch>>(st, sms, arch, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(),
                                                             db.data(), scratch.data(), {}, space.arrival_counters());
    }
    got[kernel][0] = gpu_test::download(space, y);
    got[kernel][1] = gpu_test::download(space, dx);
    got[kernel][2] = gpu_test::download(space, dw);
    got[kernel][3] = gpu_test::download(space, db);
    const fp::ArrivalCounters counters = space.arrival_counters();
    const auto left = gpu_test::download(space, std::span<const unsigned>(counters.data, counters.count));
    CHECK(std::count(left.begin(), left.end(), 0u) == std::ptrdiff_t(left.size()));  // all back at zero
  }
  // Both round each operand to TF32 once and accumulate in fp32, in different orders.
  FUSEDP_CHECK_CLOSE(got[1][0], got[0][0], 1e-5, "conv forward");
  FUSEDP_CHECK_CLOSE(got[1][1], got[0][1], 1e-5, "conv dx");
  FUSEDP_CHECK_CLOSE(got[1][2], got[0][2], 1e-5, "conv dW");
  FUSEDP_CHECK_CLOSE(got[1][3], got[0][3], 1e-6, "conv db");
  // The same sums in the same order, by the GEMM's last blocks or by the second kernel: the same bits.
  for (int run : {2, 3}) {
    CAPTURE(run);
    for (int t = 0; t < 4; ++t) CHECK(got[run][t] == got[0][t]);
  }
}

bool same_bits(const std::vector<float>& u, const std::vector<float>& v) {
  return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
}

// Operands stored in 16 bits (loaded through registers, stored to shared memory as fp32) against fp32
// operands holding the same values (copied by cp.async): the same products in the same order, so the
// same bits, for A, B or both in 16 bits, with edges (partial copies of four) and split-K.
template <class TileT, template <class> class A, template <class> class B, class P>
void check_held_gemm(const fp::Cuda& space, int m, int n, int k, int k_chunk, std::uint64_t stream) {
  using BF = fp::kernels::BFloat16;
  CAPTURE(TileT::bn);
  CAPTURE(A<float>::k_fastest);
  CAPTURE(B<float>::k_fastest);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  const int lda = ((A<float>::k_fastest ? k : m) + 3) / 4 * 4, ldb = ((B<float>::k_fastest ? k : n) + 3) / 4 * 4;
  auto va = gpu_test::random_values(std::size_t(A<float>::k_fastest ? m : k) * lda, stream);
  auto vb = gpu_test::random_values(std::size_t(B<float>::k_fastest ? n : k) * ldb, stream + 1);
  const auto ha = gpu_test::stored_bf16(va), hb = gpu_test::stored_bf16(vb);
  const auto da = gpu_test::upload(space, va), db = gpu_test::upload(space, vb);
  const auto da16 = gpu_test::upload(space, ha), db16 = gpu_test::upload(space, hb);
  const int splits = (k + k_chunk - 1) / k_chunk;
  const std::size_t count = std::size_t(m) * n;
  const auto dev = kc::MmaDevice::of(space);
  const auto run = [&](const auto& a, const auto& b) {
    auto c = gpu_test::poisoned<float>(space, splits * count);
    auto sums = gpu_test::poisoned<float>(space, std::size_t(splits) * m);
    using Pr = kc::GemmProblem<std::remove_cvref_t<decltype(a)>, std::remove_cvref_t<decltype(b)>, kc::StoreRowMajor>;
    const Pr p{m, n, k, k_chunk, a, b, {c.data(), m, n, count}, sums.data()};
    REQUIRE(kc::gemm_mma_can_run<TileT>(p, dev));
    kc::launch_gemm_mma<TileT, true, P>(p, splits, dev, space.stream());
    std::vector<float> out = gpu_test::download(space, c), s = gpu_test::download(space, sums);
    out.insert(out.end(), s.begin(), s.end());
    return out;
  };
  const auto fp32 = run(A<float>{da.data(), lda}, B<float>{db.data(), ldb});
  CHECK(std::all_of(fp32.begin(), fp32.end(), [](float v) { return std::isfinite(v); }));
  CHECK(same_bits(run(A<BF>{da16.data(), lda}, B<float>{db.data(), ldb}), fp32));
  CHECK(same_bits(run(A<float>{da.data(), lda}, B<BF>{db16.data(), ldb}), fp32));
  CHECK(same_bits(run(A<BF>{da16.data(), lda}, B<BF>{db16.data(), ldb}), fp32));
}

// A convolution's implicit GEMMs over bf16-stored x and dz (forward, forward with the max-pooling
// fused, dx, dW with db) against the same GEMMs over fp32 copies of the values: the same bits.
template <int O, int C, int Patch>
void check_conv_held(const fp::Cuda& space, const fp::kernels::ConvGeometry& g, int batch, std::uint64_t stream) {
  using BF = fp::kernels::BFloat16;
  using Epi = fp::kernels::Epilogue<fp::kernels::Relu>;
  using P = fp::precision::Bf16;
  CAPTURE(g.in_channels);
  CAPTURE(g.stride);
  const auto arch = kc::MmaDevice::of(space);
  const int sms = space.sm_count();
  const cudaStream_t st = space.stream();
  const kc::ConvShape s(g);
  auto xv = gpu_test::random_values(batch * g.in_size(), stream), dzv = gpu_test::random_values(batch * g.out_size(), stream + 1);
  const auto xh = gpu_test::stored_bf16(xv), dzh = gpu_test::stored_bf16(dzv);
  const auto x = gpu_test::upload(space, xv), dz = gpu_test::upload(space, dzv);
  const auto x16 = gpu_test::upload(space, xh), dz16 = gpu_test::upload(space, dzh);
  const auto w = gpu_test::upload(space, gpu_test::random_values(g.out_channels * g.patch(), stream + 2));
  const auto b = gpu_test::upload(space, gpu_test::random_values(std::size_t(g.out_channels), stream + 3));
  const int ph = s.oh / 2, pw = s.ow / 2;
  std::vector<float> got[2][5];
  std::vector<std::uint8_t> winners[2];
  bool forward_ran = false;
  const auto run = [&](int i, const auto* xe, const auto* dze) {
    using E = std::remove_cvref_t<decltype(*xe)>;
    auto scratch = gpu_test::poisoned<float>(space, kc::weight_gradient_scratch<kc::mma::mma_tile_for<Patch>>(O, Patch, batch * s.ohw, sms) + 1);
    auto y = gpu_test::poisoned<float>(space, batch * g.out_size());
    auto pooled = gpu_test::poisoned<float>(space, std::size_t(batch) * O * ph * pw);
    auto argmax = gpu_test::poisoned<std::uint8_t>(space, std::size_t(batch) * O * ph * pw);
    auto dx = gpu_test::poisoned<float>(space, batch * g.in_size());
    auto dw = gpu_test::poisoned<float>(space, g.out_channels * g.patch());
    auto db = gpu_test::poisoned<float>(space, std::size_t(g.out_channels));
    const auto fwd = kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), xe, y.data(), nullptr);
    forward_ran = kc::gemm_mma_can_run<kc::mma::mma_tile_for<O>>(fwd, arch);  // weight rows 16-byte aligned
    if (forward_ran) {
      kc::launch_gemm_mma<kc::mma::mma_tile_for<O>, false, P>(fwd, 1, arch, st);
      kc::launch_gemm_mma<kc::mma::mma_tile_for<O>, false, P>(
          kc::conv2d_maxpool_problem<Epi, 2>(s, batch, w.data(), b.data(), xe, pooled.data(), argmax.data()), 1, arch, st);
    }
    const kc::StoredGradientOf<E> sd{dze, s.o, s.ohw, s.ow};
    kc::launch_gemm_mma<kc::mma::mma_tile_for<C>, false, P>(kc::conv2d_dx_problem(s, batch, sd, w.data(), dx.data()), 1,
                                                            arch, st);
    const auto ops = kc::conv2d_dw_operands(s, batch, sd, xe);
    kc::weight_gradient_mma<kc::mma::mma_tile_for<Patch>, P>(st, sms, arch, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(),
                                                             db.data(), scratch.data(), {}, space.arrival_counters());
    got[i][0] = gpu_test::download(space, y);
    got[i][1] = gpu_test::download(space, pooled);
    got[i][2] = gpu_test::download(space, dx);
    got[i][3] = gpu_test::download(space, dw);
    got[i][4] = gpu_test::download(space, db);
    winners[i] = gpu_test::download(space, argmax);
  };
  run(0, x.data(), dz.data());
  run(1, x16.data(), dz16.data());
  const char* what[] = {"y", "pooled", "dx", "dW", "db"};
  for (int t = forward_ran ? 0 : 2; t < 5; ++t) {  // without the forward, y and pooled stay poisoned
    CAPTURE(what[t]);
    CHECK(same_bits(got[1][t], got[0][t]));
    CHECK(std::all_of(got[0][t].begin(), got[0][t].end(), [](float v) { return std::isfinite(v); }));
  }
  if (forward_ran) CHECK(winners[1] == winners[0]);
}

}  // namespace

TEST_CASE("gemm_mma: operands stored in 16 bits give the bits of fp32 operands holding the same values") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) return;
  using Bf = fp::precision::Bf16;
  using Tf = fp::precision::Tf32;
  check_held_gemm<mma::MmaTile128x128, kc::RowsOf, kc::RowsOf, Bf>(space, 300, 270, 203, 203, 1200);
  check_held_gemm<mma::MmaTile128x64, kc::RowsOf, kc::ColumnsOf, Bf>(space, 131, 70, 200, 64, 1210);
  check_held_gemm<mma::MmaTile128x32, kc::ColumnsOf, kc::RowsOf, Tf>(space, 129, 45, 97, 97, 1220);
  check_held_gemm<mma::MmaTile128x16, kc::ColumnsOf, kc::ColumnsOf, Bf>(space, 130, 21, 1000, 256, 1230);
  constexpr fp::kernels::ConvGeometry cifar2{64, 16, 16, 3, 1, 1, 128, 16, 16};
  check_conv_held<128, 64, 576>(space, cifar2, 16, 1240);
  constexpr fp::kernels::ConvGeometry strided{3, 11, 9, 3, 2, 1, 5, 6, 5};
  check_conv_held<5, 3, 27>(space, strided, 7, 1250);
}

TEST_CASE("gemm_mma: a convolution's implicit GEMMs equal the WMMA mainloop's") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) return;
  // in_channels, h, w, kernel, stride, pad, out_channels, out_h, out_w
  constexpr fp::kernels::ConvGeometry cifar2{64, 16, 16, 3, 1, 1, 128, 16, 16};  // CIFAR-10 CNN conv2
  check_conv_both<128, 64, 576>(space, cifar2, 16, 800);
  constexpr fp::kernels::ConvGeometry strided{3, 11, 9, 3, 2, 1, 5, 6, 5};  // stride 2, padding, odd sizes
  check_conv_both<5, 3, 27>(space, strided, 7, 900);
  constexpr fp::kernels::ConvGeometry lenet1{1, 28, 28, 5, 1, 0, 6, 24, 24};
  check_conv_both<6, 1, 25>(space, lenet1, 33, 1000);
}

TEST_CASE("gemm_mma: every tile and operand layout, edges in m, n and k, against double") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) {
    MESSAGE("gemm_mma needs sm_80; this device is sm_" << space.architecture());
    return;
  }
  check_all_layouts<mma::MmaTile128x128>(space, 300, 270, 203, 203, 100);
  check_all_layouts<mma::MmaTile128x64>(space, 131, 70, 70, 70, 200);
  check_all_layouts<mma::MmaTile128x32>(space, 129, 45, 97, 97, 300);
  check_all_layouts<mma::MmaTile128x16>(space, 130, 21, 66, 66, 400);
}

TEST_CASE("gemm_mma: many slices per block (the stage ring wraps), split-K with a short last split") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) return;
  check_all_layouts<mma::MmaTile128x128>(space, 256, 256, 1024, 1024, 500);
  check_all_layouts<mma::MmaTile128x64>(space, 64, 40, 2000, 512, 600);
}

TEST_CASE("gemm_mma: BF16 (m16n8k16) for every operand layout, against double of the bf16-rounded operands") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) return;
  using Bf = fp::precision::Bf16;
  check_mma_gemm<mma::MmaTile128x128, kc::Rows, kc::Rows, Bf>(space, 300, 270, 203, 203, 1100);
  check_mma_gemm<mma::MmaTile128x64, kc::Rows, kc::Columns, Bf>(space, 131, 70, 200, 64, 1110);
  check_mma_gemm<mma::MmaTile128x32, kc::Columns, kc::Rows, Bf>(space, 129, 45, 97, 97, 1120);
  check_mma_gemm<mma::MmaTile128x16, kc::Columns, kc::Columns, Bf>(space, 130, 21, 66, 66, 1130);
}

TEST_CASE("gemm_mma: equals the WMMA gemm_kernel within TF32 rounding on a Linear-sized problem") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  if (space.architecture() < 80) return;
  const int m = 128, n = 1024, k = 8192;  // the CIFAR-10 CNN's fc1 forward at batch 128
  const auto x = gpu_test::random_values(std::size_t(m) * k, 700), w = gpu_test::random_values(std::size_t(n) * k, 701);
  const auto dx = gpu_test::upload(space, x), dw = gpu_test::upload(space, w);
  auto c_mma = gpu_test::poisoned<float>(space, std::size_t(m) * n);
  auto c_wmma = gpu_test::poisoned<float>(space, std::size_t(m) * n);
  using P = kc::GemmProblem<kc::Rows, kc::Rows, kc::StoreRowMajor>;
  const P pm{m, n, k, k, {dx.data(), k}, {dw.data(), k}, {c_mma.data(), m, n, 0}, nullptr};
  const P pw{m, n, k, k, {dx.data(), k}, {dw.data(), k}, {c_wmma.data(), m, n, 0}, nullptr};
  // Through gemm_dispatch.cuh's switch, as the layers will launch it.
  const kc::GemmTarget mma_target = kc::GemmTarget::of(space, kc::GemmMainloop::mma);
  REQUIRE(kc::takes_mma<mma::MmaTile128x128, fp::precision::Tf32>(pm, mma_target));
  kc::launch_gemm_on<kc::TileWide, mma::MmaTile128x128, fp::precision::Tf32, false>(pm, 1, mma_target);
  kc::launch_gemm_on<kc::TileWide, mma::MmaTile128x128, fp::precision::Tf32, false>(
      pw, 1, kc::GemmTarget::of(space, kc::GemmMainloop::wmma));
  FUSEDP_CHECK_CLOSE(gpu_test::download(space, c_mma), gpu_test::download(space, c_wmma), 1e-5,
                     "mma.sync vs WMMA (both round each operand to TF32 once)");
}

// gemm_dispatch.cuh's switch, as the layers will use it: the tensor-core weight gradient (its own
// split plan) within TF32 rounding of WMMA's; a target that cannot run it falls back to WMMA exactly.
TEST_CASE("gemm_dispatch: weight_gradient_on with either mainloop, and the fallback") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  using TileW = kc::TileWide;
  using TileM = mma::MmaTile128x128;
  const int m = 96, n = 300, k = 128 * 64;  // dW of a 300-input Linear layer, 96 outputs, 8192 rows
  const auto dz = gpu_test::random_values(std::size_t(k) * m, 720), x = gpu_test::random_values(std::size_t(k) * n, 721);
  const auto ddz = gpu_test::upload(space, dz), dx = gpu_test::upload(space, x);
  const kc::Columns a{ddz.data(), m}, b{dx.data(), n};
  auto scratch = gpu_test::poisoned<float>(space, kc::weight_gradient_scratch_on<TileW, TileM>(m, n, k, space.sm_count()));
  const auto run = [&](const kc::GemmTarget& t) {
    auto dw = gpu_test::poisoned<float>(space, std::size_t(m) * n);
    auto db = gpu_test::poisoned<float>(space, std::size_t(m));
    kc::weight_gradient_on<TileW, TileM, fp::precision::Tf32>(t, m, n, k, a, b, dw.data(), db.data(), scratch.data());
    std::vector<float> out = gpu_test::download(space, dw), sums = gpu_test::download(space, db);
    out.insert(out.end(), sums.begin(), sums.end());
    return out;
  };
  const auto wmma = run(kc::GemmTarget::of(space, kc::GemmMainloop::wmma));
  const kc::GemmTarget mma_target = kc::GemmTarget::of(space, kc::GemmMainloop::mma);
  const auto tensor = run(mma_target);
  FUSEDP_CHECK_CLOSE(tensor, wmma, 1e-5, "weight_gradient_on: mma.sync vs WMMA");
  kc::GemmTarget old = mma_target;
  old.device.arch = 75;  // as on a Turing card: every launch falls back
  CHECK(run(old) == run(kc::GemmTarget{space.stream(), space.sm_count(), {75, 65536}, kc::GemmMainloop::wmma}));
}

// linear.cuh's split forward (a small batch through a wide layer) on either mainloop: its parts finished
// by the GEMM's last block per tile (the stream's arrival counters), twice, against the same parts
// finished by linear_forward_reduce_kernel (no counters): the same bits; each close to the Host model.
// Out = 300 is finished in runs of four, 298 one element at a time.
template <int Out>
void check_split_linear_forward(const fp::Cuda& space) {
  CAPTURE(Out);
  using Epi = fp::kernels::Epilogue<fp::kernels::Gelu>;  // saves z too
  using P = fp::precision::Tf32;
  using Tiles = kc::GemmTiles<Out>;
  // 130 rows: three WMMA tiles and two tensor-core ones along m, so the counters' index runs over rows too.
  const int batch = 130, in = 4096, sms = space.sm_count();
  const kc::SplitPlan plan = kc::linear_forward_split<Tiles>(batch, in, Out, sms);
  REQUIRE(plan.splits > 1);
  const auto x = gpu_test::random_values(std::size_t(batch) * in, 730), w = gpu_test::random_values(std::size_t(Out) * in, 731);
  const auto b = gpu_test::random_values(std::size_t(Out), 732);
  const auto dx = gpu_test::upload(space, x), dw = gpu_test::upload(space, w), dbias = gpu_test::upload(space, b);
  const std::size_t count = std::size_t(batch) * Out;

  const fp::Host host{1};
  const std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end());
  std::vector<double> y_ref(count), z_ref(count);
  fp::kernels::host::linear_forward<Epi>(host, batch, in, Out, wd.data(), bd.data(), xd.data(), y_ref.data(), z_ref.data());

  const auto same_bits = [](const std::vector<float>& u, const std::vector<float>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
  };
  for (const kc::GemmMainloop loop : {kc::GemmMainloop::wmma, kc::GemmMainloop::mma}) {
    CAPTURE(int(loop));
    if (loop == kc::GemmMainloop::mma && space.architecture() < 80) continue;
    std::vector<float> got[3][2];  // [second kernel, in the GEMM, again][y, z]
    for (int run = 0; run < 3; ++run) {
      const kc::GemmTarget t = kc::GemmTarget::of(space, loop, run == 0 ? kc::SplitReduction::kernel : kc::SplitReduction::gemm);
      auto scratch = gpu_test::poisoned<float>(space, kc::linear_forward_scratch<Tiles>(batch, in, Out, sms));
      auto y = gpu_test::poisoned<float>(space, count), z = gpu_test::poisoned<float>(space, count);
      bool in_gemm = false, tensor_cores = false;
      kc::split_linear_forward<Epi, Tiles>(
          t.sm_count, batch, in, Out, dw.data(), dbias.data(), dx.data(), y.data(), z.data(), scratch.data(),
          t.arrivals, false,
          [&](const auto& p, int splits) {
            if constexpr (requires { p.epi.reduction; }) in_gemm = p.epi.reduction.active();
            tensor_cores = kc::takes_mma<typename Tiles::mma, P>(p, t);
            kc::launch_gemm_on<typename Tiles::wmma, typename Tiles::mma, P, false>(p, splits, t);
          },
          kc::PassOnStream{t.stream});
      CHECK(in_gemm == (run > 0));  // the runs compare what they say they compare
      CHECK(tensor_cores == (loop == kc::GemmMainloop::mma));
      got[run][0] = gpu_test::download(space, y);
      got[run][1] = gpu_test::download(space, z);
      const fp::ArrivalCounters counters = space.arrival_counters();
      const auto left = gpu_test::download(space, std::span<const unsigned>(counters.data, counters.count));
      CHECK(std::count(left.begin(), left.end(), 0u) == std::ptrdiff_t(left.size()));
    }
    for (int run : {1, 2}) {
      CAPTURE(run);
      CHECK(same_bits(got[run][0], got[0][0]));
      CHECK(same_bits(got[run][1], got[0][1]));
    }
    // TF32 operands over 4096 terms, against double.
    FUSEDP_CHECK_CLOSE(got[0][0], y_ref, 5e-3, "split linear y");
    FUSEDP_CHECK_CLOSE(got[0][1], z_ref, 5e-3, "split linear z");
  }
}

TEST_CASE("linear forward: a split forward finished in the GEMM gives the second kernel's bits") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  check_split_linear_forward<300>(space);
  check_split_linear_forward<298>(space);
}

// Who adds up split parts, as a target says: by default the GEMM's last block only where that takes at
// most split_tile_reduction_trips round trips; FUSEDP_CUDA_SPLIT_REDUCTION=gemm however many; =kernel
// never (no counters). A weight gradient's branch onto the side stream keeps the limit with its own
// counters.
TEST_CASE("gemm_dispatch: the split reduction's counters and limit, on the model's stream and a branch") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space;
  const auto automatic = kc::GemmTarget::of(space, kc::GemmMainloop::wmma, kc::SplitReduction::automatic);
  const auto gemm = kc::GemmTarget::of(space, kc::GemmMainloop::wmma, kc::SplitReduction::gemm);
  const auto kernel = kc::GemmTarget::of(space, kc::GemmMainloop::wmma, kc::SplitReduction::kernel);
  CHECK(automatic.arrivals.data == space.arrival_counters().data);
  CHECK(automatic.arrivals.reduction_trip_limit == kc::split_tile_reduction_trips);
  CHECK(gemm.arrivals.data == space.arrival_counters().data);
  CHECK(gemm.arrivals.reduction_trip_limit == std::numeric_limits<int>::max());
  CHECK(kernel.arrivals.data == nullptr);
  const fp::CudaSideStream side = fp::CudaSideStream::make();
  const fp::CudaBranch branch = side.branch(automatic.arrivals, "weight gradient", 1);
  CHECK(branch.arrivals.data != nullptr);
  CHECK(branch.arrivals.data != automatic.arrivals.data);
  CHECK(branch.arrivals.reduction_trip_limit == kc::split_tile_reduction_trips);
  CHECK(side.branch(kernel.arrivals, "weight gradient", 1).arrivals.data == nullptr);
}

TEST_CASE("gemm_mma: a problem it cannot run is refused with a message, nothing launched") {
  const float* misaligned = reinterpret_cast<const float*>(std::uintptr_t(64) + 4);
  const kc::GemmProblem<kc::Rows, kc::Rows, kc::StoreRowMajor> p{8, 8, 8, 8, {misaligned, 8}, {misaligned, 8},
                                                                 {nullptr, 8, 8, 0}, nullptr};
  using T = mma::MmaTile128x16;
  using RowsProblem = kc::GemmProblem<kc::Rows, kc::Rows, kc::StoreRowMajor>;
  const kc::MmaDevice h200{90, 232448}, a100{80, 166912}, rtx{86, 101376}, turing{75, 65536};
  CHECK_FALSE(kc::gemm_mma_can_run<T>(p, h200));  // misaligned base
  const RowsProblem ok{8, 8, 8, 8, {nullptr, 8}, {nullptr, 8}, {nullptr, 8, 8, 0}, nullptr};
  CHECK(kc::gemm_mma_can_run<T>(ok, h200));
  CHECK(kc::gemm_mma_can_run<T>(ok, a100));
  CHECK_FALSE(kc::gemm_mma_can_run<T>(ok, turing));  // no cp.async / mma.sync TF32
  CHECK_FALSE(kc::gemm_mma_can_run<T>(RowsProblem{8, 8, 8, 8, {nullptr, 6}, {nullptr, 8}, {nullptr, 8, 8, 0}, nullptr},
                                      h200));  // leading dimension not a multiple of 4
  CHECK_FALSE(kc::gemm_mma_can_run<T>(RowsProblem{8, 8, 100, 40, {nullptr, 8}, {nullptr, 8}, {nullptr, 8, 8, 0}, nullptr},
                                      h200));  // a split of 40: not whole 32-deep slices
  // The largest tile with MN-major operands (104 KiB) fits an H200's and an A100's block, not an sm_86's.
  using ColsProblem = kc::GemmProblem<kc::Columns, kc::Columns, kc::StoreRowMajor>;
  const ColsProblem cols{8, 8, 8, 8, {nullptr, 8}, {nullptr, 8}, {nullptr, 8, 8, 0}, nullptr};
  CHECK(kc::gemm_mma_can_run<mma::MmaTile128x128>(cols, h200));
  CHECK(kc::gemm_mma_can_run<mma::MmaTile128x128>(cols, a100));
  CHECK_FALSE(kc::gemm_mma_can_run<mma::MmaTile128x128>(cols, rtx));
  CHECK(kc::gemm_mma_can_run<mma::MmaTile128x128>(ok, rtx));  // K-major: 96 KiB
  const auto launch = [&] { kc::launch_gemm_mma<T, false>(p, 1, h200, nullptr); };
  CHECK_THROWS_WITH_AS(launch(), doctest::Contains("aligned to four elements"), fp::Error);
}
