// The Cuda GEMM problems run on the CPU: every loader and epilogue of kernels/cuda/ is __host__
// __device__, so this test builds the exact GemmProblem each Cuda stage launches (Linear, Conv2d with
// and without fused max-pooling, their input and weight gradients, split-K plans), executes it block by
// block and thread by thread on the host the way gemm_kernel walks it, and compares the result with the
// Host kernels (in double). It checks the implicit-GEMM index math, the epilogues, the split plans and
// the fixed-order reductions without a GPU; what it cannot check is the kernel's own staging through
// shared memory and the tensor-core fragments (tests/gpu/stages.cu does, on a device).
//
// It needs no device, so it runs (and must pass) wherever the gpu tests are built.
#include "gpu_test.hpp"

#include <fusedp/kernels/bf16.hpp>
#include <fusedp/kernels/cuda/conv2d.cuh>
#include <fusedp/kernels/cuda/fast_div.hpp>
#include <fusedp/kernels/cuda/gemm_dispatch.cuh>
#include <fusedp/kernels/cuda/gemm_mma.cuh>
#include <fusedp/kernels/cuda/linear.cuh>
#include <fusedp/kernels/host/conv2d.hpp>
#include <fusedp/kernels/host/linear.hpp>
#include <fusedp/kernels/host/pool.hpp>
#include <fusedp/net/cuda_groups.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace fp = fusedp;
namespace kc = fusedp::kernels::cuda;
namespace kh = fusedp::kernels::host;
using gpu_test::random_values;

namespace {

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();

// One block of gemm_kernel on the host: the tile as the kernel would hold it after its k-loop (sums in
// double, then rounded), the row sums, then the epilogue called once per thread.
// TileT: a WMMA tile (gemm.cuh, pitch bn + 4) or a tensor-core one (mma_layout.hpp, its own ldc), so
// the epilogues are checked against either tile's block shape, thread count and pitch.
template <class TileT, bool RowSums, class A, class B, class Epi>
void emulate_gemm(const kc::GemmProblem<A, B, Epi>& p, int splits) {
  constexpr int bm = TileT::bm, bn = TileT::bn;
  constexpr int ldc = [] {
    if constexpr (requires { TileT::ldc; }) return TileT::ldc;
    else return bn + 4;
  }();
  std::vector<float> c(std::size_t(bm) * ldc);
  const int bx_count = (p.m + bm - 1) / bm, by_count = (p.n + bn - 1) / bn;
  // The splits in reverse: with an active reduction (SplitTileReduction, LinearForwardReduction) the
  // last to arrive, split 0, adds them all up.
  for (int z = splits - 1; z >= 0; --z) {
    const int k_begin = z * p.k_chunk, k_end = std::min(p.k, k_begin + p.k_chunk);
    for (int bx = 0; bx < bx_count; ++bx)
      for (int by = 0; by < by_count; ++by) {
        const int m0 = bx * bm, n0 = by * bn;
        for (int lm = 0; lm < bm; ++lm)
          for (int ln = 0; ln < bn; ++ln) {
            double s = 0;
            if (m0 + lm < p.m && n0 + ln < p.n)
              for (int k = k_begin; k < k_end; ++k) s += double(p.a.at(m0 + lm, k)) * double(p.b.at(n0 + ln, k));
            c[std::size_t(lm) * ldc + ln] = float(s);
          }
        if constexpr (RowSums) {
          if (p.row_sums != nullptr && by == 0)
            for (int lm = 0; lm < bm && m0 + lm < p.m; ++lm) {
              double s = 0;
              for (int k = k_begin; k < k_end; ++k) s += double(p.a.at(m0 + lm, k));
              p.put_row_sum(z, m0 + lm, float(s));
            }
        }
        for (int tid = 0; tid < TileT::threads; ++tid) p.epi.template apply<TileT>(c.data(), ldc, m0, n0, z, tid);
        // finish_split_tile: this block arrives at its tile; the last split reduces it, resets the count.
        if constexpr (requires { p.epi.reduction; }) {
          const auto& r = p.epi.reduction;
          if (r.active()) {
            unsigned& count = r.arrivals[std::size_t(bx) * by_count + by];
            if (++count == unsigned(r.splits)) {
              for (int tid = 0; tid < TileT::threads; ++tid)
                r.template reduce_tile<TileT>(p.epi.out, p.epi.m, p.epi.n, m0, n0, tid);
              count = 0;
            }
          }
        }
      }
  }
}

// A split flow's second pass (kc::ReduceSplits, kc::LinearForwardSums) on the host, element by element,
// where kc::PassOnStream launches its kernel on a device: the pass's own code, so the flows' default
// path (reduces_in_gemm says no to every split of the target networks) is emulated as it runs.
struct PassOnHost {
  int* runs = nullptr;  // counts the passes run, where not null
  template <class Pass>
  void operator()(const Pass& pass) const {
    for (std::size_t i = 0; i < pass.size(); ++i) pass(i);
    if (runs != nullptr) ++*runs;
  }
};

// How a split weight gradient's partial products are added up: by the GEMM's own last block per tile
// (SplitTileReduction), by the flow's second pass (kc::ReduceSplits, what reduce_splits_kernel runs:
// no arrival counters), or by a loop written out here, the reference for both.
enum class SplitSums { in_gemm, second_pass, written_out };

// kc::weight_gradient on the host: kc::split_weight_gradient itself (same split plan, same partial
// layout) with the GEMM's blocks run by emulate_gemm and the second pass by PassOnHost; with
// SplitSums::written_out the reduction is reduce_splits_kernel's loop written out here instead. Active
// updates are applied where the kernels apply them. The arrival counters must all be back at zero
// afterwards, and the second pass must have run exactly where it was asked for.
template <class TileT, class A, class B>
void emulate_weight_gradient(int sm_count, int m, int n, int k, const A& a, const B& b, float* dw, float* db,
                             const fp::kernels::LayerUpdate<float>& update = {},
                             SplitSums sums = SplitSums::in_gemm) {
  const kc::SplitPlan s = kc::plan_split(m, n, k, TileT::bm, TileT::bn, TileT::bk, sm_count);
  const std::size_t count = std::size_t(m) * n;
  std::vector<float> scratch(kc::weight_gradient_scratch<TileT>(m, n, k, sm_count) + 1, nan_value);
  std::vector<unsigned> arrivals(fp::Cuda::arrival_counter_count, 0u);
  if (sums != SplitSums::written_out || s.splits == 1) {
    const fp::ArrivalCounters counters =
        sums == SplitSums::in_gemm ? fp::ArrivalCounters{arrivals.data(), arrivals.size()} : fp::ArrivalCounters{};
    int passes = 0;
    kc::split_weight_gradient<TileT>(
        sm_count, m, n, k, a, b, dw, db, scratch.data(), update, counters,
        [&](const auto& p, int splits) { emulate_gemm<TileT, true>(p, splits); }, PassOnHost{&passes});
    CHECK(passes == (sums == SplitSums::second_pass && s.splits > 1 ? 1 : 0));
    CHECK(std::count(arrivals.begin(), arrivals.end(), 0u) == std::ptrdiff_t(arrivals.size()));
    return;
  }
  float* row_partial = scratch.data() + std::size_t(s.splits) * count;
  emulate_gemm<TileT, true>(
      kc::GemmProblem<A, B, kc::StoreRowMajor>{m, n, k, s.k_chunk, a, b, {scratch.data(), m, n, count}, row_partial},
      s.splits);
  for (std::size_t i = 0; i < count; ++i) {
    float sum = 0;
    for (int z = 0; z < s.splits; ++z) sum += scratch[std::size_t(z) * count + i];
    dw[i] = sum;
    if (update.weight.active()) update.weight.apply(update.weight.load(), i, sum);
  }
  for (int i = 0; i < m; ++i) {
    float sum = 0;
    for (int z = 0; z < s.splits; ++z) sum += row_partial[std::size_t(z) * m + i];
    db[i] = sum;
    if (update.bias.active()) update.bias.apply(update.bias.load(), std::size_t(i), sum);
  }
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

constexpr double exact = 1e-6;  // the emulation sums in double: only the final rounding differs

template <class Epi, class TileT>
void check_linear(int batch, int in, int out, int sm_count) {
  CAPTURE(batch);
  CAPTURE(in);
  CAPTURE(out);
  const fp::Host host{1};
  const auto x = random_values(std::size_t(batch) * in, 1), w = random_values(std::size_t(out) * in, 2);
  const auto b = random_values(std::size_t(out), 3), dy = random_values(std::size_t(batch) * out, 4);

  // Host reference in double
  auto xd = widen(x), wd = widen(w), bd = widen(b), dyd = widen(dy);
  std::vector<double> y_ref(std::size_t(batch) * out), z_ref(y_ref.size()), dx_ref(x.size()), dw_ref(w.size()),
      db_ref(b.size());
  double* const zr = Epi::saves_input ? z_ref.data() : nullptr;
  kh::linear_forward<Epi>(host, batch, in, out, wd.data(), bd.data(), xd.data(), y_ref.data(), zr);
  kh::linear_backward<Epi>(host, batch, in, out, wd.data(), xd.data(), y_ref.data(), zr, dyd.data(), dx_ref.data(),
                           dw_ref.data(), db_ref.data());

  std::vector<float> y(y_ref.size(), nan_value), z(y_ref.size(), nan_value), dx(x.size(), nan_value),
      dw(w.size(), nan_value), db(b.size(), nan_value);
  emulate_gemm<TileT, false>(kc::linear_forward_problem<Epi>(batch, in, out, w.data(), b.data(), x.data(), y.data(),
                                                             Epi::saves_input ? z.data() : nullptr),
                             1);
  FUSEDP_CHECK_CLOSE(y, y_ref, exact, "linear y");
  if constexpr (Epi::saves_input) FUSEDP_CHECK_CLOSE(z, z_ref, exact, "linear z");

  // backward from the Cuda forward's own y and z (a ReLU mask must match the y it came from)
  const kc::EpilogueGradient<Epi> g{dy.data(), y.data(), Epi::saves_input ? z.data() : nullptr};
  using TileIn = TileT;
  emulate_gemm<TileIn, false>(kc::linear_dx_problem<Epi>(batch, in, out, w.data(), g, dx.data()), 1);
  FUSEDP_CHECK_CLOSE(dx, dx_ref, exact, "linear dx");
  const auto ops = kc::linear_dw_operands<Epi>(batch, in, out, g, x.data());
  emulate_weight_gradient<TileIn>(sm_count, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(), db.data());
  FUSEDP_CHECK_CLOSE(dw, dw_ref, exact, "linear dw");
  FUSEDP_CHECK_CLOSE(db, db_ref, exact, "linear db");
}

// What the tensor-core mainloop copies of an operand (kernels/cuda/gemm_mma.cuh: source(row, k), a
// null address for a zero) is what the WMMA mainloop loads (at(row, k)), for every element.
template <class L>
void check_sources(const L& op, int rows, int k, const char* what) {
  static_assert(kc::CopyOperand<L>, "a convolution operand the tensor-core mainloop cannot copy");
  int bad = 0;
  const auto same = [](const typename L::element* src, float want) {
    if (src == nullptr) return want == 0.0f;
    const float v = fp::kernels::to_float(*src);
    return std::memcmp(&v, &want, sizeof want) == 0;
  };
  for (int r = 0; r < rows; ++r)
    for (int q = 0; q < k; ++q) {
      const float want = op.at(r, q);
      if (!same(op.source(r, q), want) && bad++ < 3) FAIL_CHECK(what << ": source(" << r << ", " << q << ") differs from at()");
      // The cursors the kernel hoists (once per thread's row, once per slice's k) give the same address.
      if constexpr (kc::RowCursorOperand<L>) {
        if (op.source(op.row_cursor(r), q) != op.source(r, q) && bad++ < 3)
          FAIL_CHECK(what << ": the row cursor of " << r << " misplaces k " << q);
      }
      if constexpr (kc::KCursorOperand<L>) {
        if (op.source(r, op.k_cursor(q)) != op.source(r, q) && bad++ < 3)
          FAIL_CHECK(what << ": the k cursor of " << q << " misplaces row " << r);
      }
    }
  CHECK(bad == 0);
}

// The conv GEMMs as conv2d_backward runs them (dz stored densely) offer the tensor-core mainloop
// addresses that match what the WMMA loaders read.
void check_conv_sources(const kc::ConvShape& s, int batch, const float* w, const float* x, const float* dz_dense) {
  const kc::StoredGradient dz{dz_dense, s.o, s.ohw, s.ow};
  const auto dxp = kc::conv2d_dx_problem(s, batch, dz, w, nullptr);
  check_sources(dxp.a, dxp.m, dxp.k, "dx A (dz gathered per input pixel)");
  check_sources(dxp.b, dxp.n, dxp.k, "dx B (weights by input channel)");
  const auto ops = kc::conv2d_dw_operands(s, batch, dz, x);
  check_sources(ops.a, ops.m, ops.k, "dW A (dz by channel)");
  check_sources(ops.b, ops.n, ops.k, "dW B (im2col by pixel)");
  const kc::MmaDevice h200{90, 232448};
  CHECK(kc::gemm_mma_can_run<kc::mma::MmaTile128x64>(dxp, h200));
  CHECK(kc::gemm_mma_can_run<kc::mma::MmaTile128x128>(kc::GemmProblem<decltype(ops.a), decltype(ops.b), kc::StoreRowMajor>{
                                                          ops.m, ops.n, ops.k, ops.k, ops.a, ops.b, {}, nullptr},
                                                      h200));
}

template <class Epi, class TileF, class TileX, class TileW>
void check_conv(const fp::kernels::ConvGeometry& g, int batch, int sm_count) {
  CAPTURE(batch);
  CAPTURE(g.in_channels);
  CAPTURE(g.in_h);
  CAPTURE(g.in_w);
  CAPTURE(g.kernel);
  CAPTURE(g.stride);
  CAPTURE(g.pad);
  CAPTURE(g.out_channels);
  const fp::Host host{1};
  const auto x = random_values(batch * g.in_size(), 11), w = random_values(g.out_channels * g.patch(), 12);
  const auto b = random_values(std::size_t(g.out_channels), 13), dy = random_values(batch * g.out_size(), 14);
  auto xd = widen(x), wd = widen(w), bd = widen(b), dyd = widen(dy);
  std::vector<double> y_ref(batch * g.out_size()), z_ref(y_ref.size()), dx_ref(x.size()), dw_ref(w.size()),
      db_ref(b.size()), scratch(kh::ConvScratch{g}.per_thread());
  double* const zr = Epi::saves_input ? z_ref.data() : nullptr;
  kh::conv2d_forward<Epi>(host, g, batch, wd.data(), bd.data(), xd.data(), y_ref.data(), zr, scratch.data());
  kh::conv2d_backward<Epi>(host, g, batch, wd.data(), xd.data(), y_ref.data(), zr, dyd.data(), dx_ref.data(),
                           dw_ref.data(), db_ref.data(), scratch.data());

  const kc::ConvShape s(g);
  std::vector<float> y(y_ref.size(), nan_value), z(y_ref.size(), nan_value), dx(x.size(), nan_value),
      dw(w.size(), nan_value), db(b.size(), nan_value);
  emulate_gemm<TileF, false>(kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), y.data(),
                                                             Epi::saves_input ? z.data() : nullptr),
                             1);
  FUSEDP_CHECK_CLOSE(y, y_ref, exact, "conv y");
  {
    const auto fwd = kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), y.data(), nullptr);
    check_sources(fwd.a, fwd.m, fwd.k, "forward A (im2col)");
    const kc::MmaDevice h200{90, 232448};
    CHECK(kc::gemm_mma_can_run<kc::mma::MmaTile128x128>(fwd, h200) == (s.patch % 4 == 0));  // weights: 16-byte copies
    check_conv_sources(s, batch, w.data(), x.data(), dy.data());
  }
  const kc::ConvGradient<Epi> dz{dy.data(), y.data(), Epi::saves_input ? z.data() : nullptr, s.o, s.ohw, s.ow};
  emulate_gemm<TileX, false>(kc::conv2d_dx_problem(s, batch, dz, w.data(), dx.data()), 1);
  FUSEDP_CHECK_CLOSE(dx, dx_ref, exact, "conv dx");
  const auto ops = kc::conv2d_dw_operands(s, batch, dz, x.data());
  emulate_weight_gradient<TileW>(sm_count, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(), db.data());
  FUSEDP_CHECK_CLOSE(dw, dw_ref, exact, "conv dw");
  FUSEDP_CHECK_CLOSE(db, db_ref, exact, "conv db");
}

// Whether every Kp x Kp window of the (batch, c, h, w) conv outputs y (pre: before the activation) has
// one clear winner: no two values within `tol` of each other but exact ties (zeros a ReLU made of clearly
// negative values), and no value within `tol` of zero before the activation (which may cut it either way).
// Elsewhere the fp32 GEMM's winner against the double reference's is a coin toss.
bool clear_winners(const std::vector<double>& y, const std::vector<double>& pre, int batch, int c, int h, int w,
                   int kp) {
  double scale = 0;
  for (double v : y) scale = std::max(scale, std::abs(v));
  const double tol = 1e-5 * std::max(scale, 1.0);
  for (double v : pre)
    if (std::abs(v) < tol) return false;
  for (int n = 0; n < batch * c; ++n)
    for (int i = 0; i + kp <= h; i += kp)
      for (int j = 0; j + kp <= w; j += kp) {
        double first = -std::numeric_limits<double>::infinity(), second = first;
        for (int a = 0; a < kp; ++a)
          for (int b = 0; b < kp; ++b) {
            const double v = y[(std::size_t(n) * h + i + a) * w + j + b];
            if (v > first) second = std::exchange(first, v);
            else if (v > second) second = v;
          }
        if (first != second && first - second < tol) return false;
      }
  return true;
}

// Conv + Epi + MaxPool2d<Kp> fused, against the Host conv stage followed by the Host pool stage, on
// inputs whose windows have clear winners (clear_winners; about one draw in 40 has a near tie).
template <class Epi, int Kp, class TileF, class TileX, class TileW>
void check_conv_maxpool(const fp::kernels::ConvGeometry& g, int batch, int sm_count) {
  CAPTURE(batch);
  CAPTURE(g.in_h);
  CAPTURE(g.in_w);
  CAPTURE(Kp);
  const fp::Host host{1};
  const int ph = g.out_h / Kp, pw = g.out_w / Kp;
  const fp::kernels::ConvGeometry gp{g.out_channels, g.out_h, g.out_w, Kp, Kp, 0, g.out_channels, ph, pw};
  std::vector<double> yc(batch * g.out_size()), pre(yc.size()), scratch(kh::ConvScratch{g}.per_thread());
  double* const none = nullptr;
  std::vector<float> x, w, b;
  std::vector<double> xd, wd, bd;
  for (std::uint64_t draw = 0;; draw += 100) {
    REQUIRE(draw < 2000);
    x = random_values(batch * g.in_size(), 21 + draw);
    w = random_values(g.out_channels * g.patch(), 22 + draw);
    b = random_values(std::size_t(g.out_channels), 23 + draw);
    xd = widen(x), wd = widen(w), bd = widen(b);
    kh::conv2d_forward<Epi>(host, g, batch, wd.data(), bd.data(), xd.data(), yc.data(), none, scratch.data());
    kh::conv2d_forward<fp::kernels::Epilogue<>>(host, g, batch, wd.data(), bd.data(), xd.data(), pre.data(), none,
                                                scratch.data());
    if (clear_winners(yc, pre, batch, g.out_channels, g.out_h, g.out_w, Kp)) break;
  }
  const auto dpool = random_values(batch * gp.out_size(), 24);
  auto dpd = widen(dpool);
  std::vector<double> pooled_ref(batch * gp.out_size()), dyc(yc.size()), dx_ref(x.size()), dw_ref(w.size()),
      db_ref(b.size());
  kh::pool_forward<fp::kernels::PoolOp::max, Kp, Kp, fp::kernels::Epilogue<>>(host, gp, batch, yc.data(), pooled_ref.data(),
                                                                      none);
  kh::pool_backward<fp::kernels::PoolOp::max, Kp, Kp, fp::kernels::Epilogue<>>(host, gp, batch, yc.data(), pooled_ref.data(),
                                                                       none, dpd.data(), dyc.data());
  kh::conv2d_backward<Epi>(host, g, batch, wd.data(), xd.data(), yc.data(), none, dyc.data(), dx_ref.data(),
                           dw_ref.data(), db_ref.data(), scratch.data());

  const kc::ConvShape s(g);
  std::vector<float> pooled(pooled_ref.size(), nan_value), dx(x.size(), nan_value), dw(w.size(), nan_value),
      db(b.size(), nan_value);
  std::vector<std::uint8_t> argmax(pooled.size(), 0xff);
  emulate_gemm<TileF, false>(
      kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(), pooled.data(), argmax.data()), 1);
  FUSEDP_CHECK_CLOSE(pooled, pooled_ref, exact, "pooled");
  {
    const auto fwd =
        kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(), pooled.data(), argmax.data());
    check_sources(fwd.a, fwd.m, fwd.k, "pooled forward A (im2col window by window)");
  }
  CHECK(std::all_of(argmax.begin(), argmax.end(), [](std::uint8_t a) { return a < Kp * Kp; }));
  const kc::PooledConvGradient<Epi, Kp> dz{dpool.data(), pooled.data(), argmax.data(), s.o, ph, pw};
  emulate_gemm<TileX, false>(kc::conv2d_dx_problem(s, batch, dz, w.data(), dx.data()), 1);
  FUSEDP_CHECK_CLOSE(dx, dx_ref, exact, "conv+pool dx");
  const auto ops = kc::conv2d_dw_operands(s, batch, dz, x.data());
  emulate_weight_gradient<TileW>(sm_count, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(), db.data());
  FUSEDP_CHECK_CLOSE(dw, dw_ref, exact, "conv+pool dw");
  FUSEDP_CHECK_CLOSE(db, db_ref, exact, "conv+pool db");
}

using fp::kernels::Epilogue;
using fp::kernels::Gelu;
using fp::kernels::Relu;
using fp::kernels::Tanh;

// --- fused gradient boundaries (gradient_sink.cuh) ----------------------------------------------------
// The input-gradient GEMM of the layer above writes the layer below's dz through a sink; the unfused
// path stores that GEMM's values plainly and forms dz in a pass of its own (materialize_dz_kernel's
// functor, or the loaders' EpilogueGradient). Both start from the same GEMM values, so the results must
// be the same bits, every element written (the fused buffers start as NaN).

void check_same_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ == 0) first = i;
  CHECK_MESSAGE(bad == 0, std::string(what) << ": " << bad << " of " << got.size() << " values differ, the first at " << first
                               << " (" << got[first] << " against " << want[first] << ")");
}

// --- operands stored in 16 bits (BFloat16, a 16-bit workspace) ----------------------------------------

// An operand over BFloat16 elements offers the tensor-core mainloop the addresses its fp32 twin (the
// same values as floats) offers: null at the same places, the same value behind every other one.
template <class L16, class L32>
void check_held_sources(const L16& h, const L32& f, int rows, int k, const char* what) {
  static_assert(std::is_same_v<typename L16::element, fp::kernels::BFloat16> && kc::held_in_registers<L16>);
  static_assert(std::is_same_v<typename L32::element, float> && !kc::held_in_registers<L32>);
  check_sources(h, rows, k, what);
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int q = 0; q < k; ++q) {
      const auto* a = h.source(r, q);
      const float* b = f.source(r, q);
      const bool same = (a == nullptr) == (b == nullptr) && (a == nullptr || fp::kernels::to_float(*a) == *b);
      if (!same && bad++ < 3) FAIL_CHECK(what << ": (" << r << ", " << q << ") differs from the fp32 operand");
    }
  CHECK(bad == 0);
}

// A convolution's and a Linear layer's GEMM problems over 16-bit stored activations and gradients give
// the bits of the same problems over fp32 copies of the same values: their sources (above) and every
// result the emulated blocks compute from at().
template <class Epi, int Kp, class TileF, class TileX, class TileW>
void check_conv_held(const fp::kernels::ConvGeometry& g, int batch, int sm_count) {
  CAPTURE(batch);
  CAPTURE(g.in_channels);
  CAPTURE(g.stride);
  CAPTURE(g.pad);
  const kc::ConvShape s(g);
  auto x = random_values(batch * g.in_size(), 61), dz = random_values(batch * g.out_size(), 62);
  const auto w = random_values(g.out_channels * g.patch(), 63), b = random_values(std::size_t(g.out_channels), 64);
  const auto xh = gpu_test::stored_bf16(x), dzh = gpu_test::stored_bf16(dz);
  std::vector<float> y[2], dx[2], dw[2], db[2], pooled[2];
  std::vector<std::uint8_t> argmax[2];
  const auto run = [&](int i, const auto* xe, const auto* dze) {
    using E = std::remove_cvref_t<decltype(*xe)>;
    y[i].assign(batch * g.out_size(), nan_value);
    dx[i].assign(x.size(), nan_value);
    dw[i].assign(w.size(), nan_value);
    db[i].assign(b.size(), nan_value);
    emulate_gemm<TileF, false>(kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), xe, y[i].data(), nullptr), 1);
    const kc::StoredGradientOf<E> sd{dze, s.o, s.ohw, s.ow};
    emulate_gemm<TileX, false>(kc::conv2d_dx_problem(s, batch, sd, w.data(), dx[i].data()), 1);
    const auto ops = kc::conv2d_dw_operands(s, batch, sd, xe);
    emulate_weight_gradient<TileW>(sm_count, ops.m, ops.n, ops.k, ops.a, ops.b, dw[i].data(), db[i].data());
    if constexpr (Kp > 1) {
      pooled[i].assign(std::size_t(batch) * s.o * (s.oh / Kp) * (s.ow / Kp), nan_value);
      argmax[i].assign(pooled[i].size(), 0xff);
      emulate_gemm<TileF, false>(
          kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), xe, pooled[i].data(), argmax[i].data()), 1);
    }
  };
  run(0, x.data(), dz.data());
  run(1, xh.data(), dzh.data());
  check_same_bits(y[1], y[0], "held conv y");
  check_same_bits(dx[1], dx[0], "held conv dx");
  check_same_bits(dw[1], dw[0], "held conv dw");
  check_same_bits(db[1], db[0], "held conv db");
  if constexpr (Kp > 1) {
    check_same_bits(pooled[1], pooled[0], "held conv pooled");
    CHECK(argmax[1] == argmax[0]);
  }

  float* const no_y = nullptr;
  const auto fwd32 = kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), no_y, nullptr);
  const auto fwd16 = kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), xh.data(), no_y, nullptr);
  check_held_sources(fwd16.a, fwd32.a, fwd32.m, fwd32.k, "forward A (im2col of bf16)");
  const kc::StoredGradient sd32{dz.data(), s.o, s.ohw, s.ow};
  const kc::StoredGradientOf<fp::kernels::BFloat16> sd16{dzh.data(), s.o, s.ohw, s.ow};
  const auto dx32 = kc::conv2d_dx_problem(s, batch, sd32, w.data(), nullptr);
  const auto dx16 = kc::conv2d_dx_problem(s, batch, sd16, w.data(), nullptr);
  check_held_sources(dx16.a, dx32.a, dx32.m, dx32.k, "dx A (bf16 dz gathered per input pixel)");
  const auto ops32 = kc::conv2d_dw_operands(s, batch, sd32, x.data());
  const auto ops16 = kc::conv2d_dw_operands(s, batch, sd16, xh.data());
  check_held_sources(ops16.a, ops32.a, ops32.m, ops32.k, "dW A (bf16 dz by channel)");
  check_held_sources(ops16.b, ops32.b, ops32.n, ops32.k, "dW B (im2col of bf16 by pixel)");
  if constexpr (Kp > 1) {
    const auto p32 = kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(), no_y, nullptr);
    const auto p16 = kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), xh.data(), no_y, nullptr);
    check_held_sources(p16.a, p32.a, p32.m, p32.k, "pooled forward A (im2col of bf16 window by window)");
  }
}

// Rows and Columns of BFloat16: the same sources and products as over floats; four-element copies need
// the base aligned to four elements (8 bytes) and the leading dimension a multiple of four.
void check_rows_columns_held() {
  const int rows = 37, k = 45, ld = 48;
  auto v = random_values(std::size_t(ld) * ld, 65);
  const auto h = gpu_test::stored_bf16(v);
  check_held_sources(kc::RowsOf<fp::kernels::BFloat16>{h.data(), ld}, kc::Rows{v.data(), ld}, rows, k, "bf16 Rows");
  check_held_sources(kc::ColumnsOf<fp::kernels::BFloat16>{h.data(), ld}, kc::Columns{v.data(), ld}, rows, k,
                     "bf16 Columns");
  using H = kc::RowsOf<fp::kernels::BFloat16>;
  using Problem = kc::GemmProblem<H, kc::Rows, kc::StoreRowMajor>;
  const kc::MmaDevice h200{90, 232448};
  const auto* base = reinterpret_cast<const fp::kernels::BFloat16*>(std::uintptr_t(1024));
  const auto can = [&](const fp::kernels::BFloat16* p, int lda) {
    return kc::gemm_mma_can_run<kc::mma::MmaTile128x64>(Problem{8, 8, 8, 8, {p, lda}, {nullptr, 8}, {}, nullptr}, h200);
  };
  CHECK(can(base, 8));
  CHECK(can(base + 4, 8));       // 8 bytes in: an 8-byte load
  CHECK_FALSE(can(base + 2, 8)); // 4 bytes in
  CHECK_FALSE(can(base, 6));     // rows start 12 bytes apart
}

// dz of a conv output (batch, o, oh, ow) from a dz functor, as materialize_dz_kernel writes it.
template <class Dz>
std::vector<float> materialized(const Dz& dz, int batch, int o, int oh, int ow) {
  std::vector<float> out(std::size_t(batch) * o * oh * ow);
  std::size_t i = 0;
  for (int img = 0; img < batch; ++img)
    for (int ch = 0; ch < o; ++ch)
      for (int oy = 0; oy < oh; ++oy)
        for (int ox = 0; ox < ow; ++ox) out[i++] = dz(img, ch, oy, ox);
  return out;
}

// The lower stage of a boundary: a conv with MaxPool2d<Kp> fused (geometry g), its forward emulated.
template <class Epi, int Kp>
struct PooledConvBelow {
  fp::kernels::ConvGeometry g;
  int batch, ph, pw;
  std::vector<float> pooled;
  std::vector<std::uint8_t> argmax;
  PooledConvBelow(const fp::kernels::ConvGeometry& geometry, int b)
      : g(geometry), batch(b), ph(geometry.out_h / Kp), pw(geometry.out_w / Kp),
        pooled(std::size_t(b) * geometry.out_channels * ph * pw, nan_value), argmax(pooled.size(), 0xff) {
    const auto x = random_values(batch * g.in_size(), 31), w = random_values(g.out_channels * g.patch(), 32);
    const auto bias = random_values(std::size_t(g.out_channels), 33);
    emulate_gemm<kc::tile_for<64>, false>(kc::conv2d_maxpool_problem<Epi, Kp>(kc::ConvShape(g), batch, w.data(),
                                                                              bias.data(), x.data(), pooled.data(),
                                                                              argmax.data()),
                                          1);
  }
  [[nodiscard]] int features() const { return g.out_channels * ph * pw; }
  // What the unfused backward of the lower conv reads, from the pooled gradient the GEMM above stored.
  [[nodiscard]] std::vector<float> dz_from(const std::vector<float>& dpool) const {
    const kc::PooledConvGradient<Epi, Kp> dz{dpool.data(), pooled.data(), argmax.data(), g.out_channels, ph, pw};
    return materialized(dz, batch, g.out_channels, g.out_h, g.out_w);
  }
  [[nodiscard]] kc::UnpoolSink<Epi, Kp> sink(float* dz) const {
    return {dz, pooled.data(), argmax.data(), g.out_h, g.out_w};
  }
  [[nodiscard]] std::size_t dz_size() const { return std::size_t(batch) * g.out_size(); }
};

// A Conv2d above a conv + max-pool: its dx GEMM through an UnpoolSink gives the dense dz that
// unpooling the stored dx gives.
template <class Epi, int Kp, class TileX>
void check_conv_unpools(const fp::kernels::ConvGeometry& below_g, int upper_out, int batch) {
  CAPTURE(below_g.out_h);
  CAPTURE(below_g.out_w);
  CAPTURE(Kp);
  const PooledConvBelow<Epi, Kp> below(below_g, batch);
  const fp::kernels::ConvGeometry up{below_g.out_channels, below.ph, below.pw, 3, 1, 1, upper_out, below.ph, below.pw};
  const kc::ConvShape s(up);
  const auto w = random_values(up.out_channels * up.patch(), 34), dz_up = random_values(batch * up.out_size(), 35);
  const kc::StoredGradient dz{dz_up.data(), s.o, s.ohw, s.ow};
  std::vector<float> dpool(below.pooled.size(), nan_value), fused(below.dz_size(), nan_value);
  emulate_gemm<TileX, false>(kc::conv2d_dx_problem(s, batch, dz, w.data(), dpool.data()), 1);
  emulate_gemm<TileX, false>(kc::conv2d_dx_problem_to(s, batch, dz, w.data(), below.sink(fused.data())), 1);
  check_same_bits(fused, below.dz_from(dpool), "conv dx unpooled into the conv below");
}

// A Linear above a Flatten and a conv + max-pool (CIFAR's fc1): its dx GEMM, with dz formed as loaded
// (Epi above) or stored, through an UnpoolSink.
template <class EpiBelow, int Kp, class EpiAbove, class TileX>
void check_linear_unpools(const fp::kernels::ConvGeometry& below_g, int out, int batch) {
  const PooledConvBelow<EpiBelow, Kp> below(below_g, batch);
  const int in = below.features();
  const auto w = random_values(std::size_t(out) * in, 41), dy = random_values(std::size_t(batch) * out, 42);
  const auto y = random_values(std::size_t(batch) * out, 43, -0.5f, 1.0f), z = random_values(y.size(), 44);
  const kc::EpilogueGradient<EpiAbove> g{dy.data(), y.data(), z.data()};
  std::vector<float> dpool(std::size_t(batch) * in, nan_value), fused(below.dz_size(), nan_value),
      fused_stored(fused.size(), nan_value);
  emulate_gemm<TileX, false>(kc::linear_dx_problem<EpiAbove>(batch, in, out, w.data(), g, dpool.data()), 1);
  emulate_gemm<TileX, false>(kc::linear_dx_problem_to(batch, in, out, w.data(), g, below.sink(fused.data())), 1);
  const std::vector<float> want = below.dz_from(dpool);
  check_same_bits(fused, want, "linear dx unpooled into the conv below");
  // the Linear's own dz stored first (what it reads when it received it): the same GEMM values
  std::vector<float> dz_above(dy.size());
  for (std::size_t i = 0; i < dz_above.size(); ++i) dz_above[i] = g(i);
  emulate_gemm<TileX, false>(
      kc::linear_stored_dx_problem(batch, in, out, w.data(), dz_above.data(), below.sink(fused_stored.data())), 1);
  check_same_bits(fused_stored, want, "stored linear dz, dx unpooled into the conv below");
}

// A Conv2d above a Conv2d with an activation: dx through an ActivationSink is ConvGradient's dz.
template <class Epi, class TileX>
void check_conv_activates(const fp::kernels::ConvGeometry& below_g, int upper_out, int batch) {
  const kc::ConvShape sb(below_g);
  const auto xb = random_values(batch * below_g.in_size(), 51), wb = random_values(below_g.out_channels * below_g.patch(), 52);
  const auto bb = random_values(std::size_t(below_g.out_channels), 53);
  std::vector<float> y(batch * below_g.out_size(), nan_value), z(y.size(), nan_value);
  float* const zp = Epi::saves_input ? z.data() : nullptr;
  emulate_gemm<kc::tile_for<64>, false>(
      kc::conv2d_forward_problem<Epi>(sb, batch, wb.data(), bb.data(), xb.data(), y.data(), zp), 1);
  const fp::kernels::ConvGeometry up{below_g.out_channels, below_g.out_h, below_g.out_w, 3, 2, 1, upper_out,
                                     (below_g.out_h - 1) / 2 + 1, (below_g.out_w - 1) / 2 + 1};
  const kc::ConvShape s(up);
  const auto w = random_values(up.out_channels * up.patch(), 54), dz_up = random_values(batch * up.out_size(), 55);
  const kc::StoredGradient dz{dz_up.data(), s.o, s.ohw, s.ow};
  std::vector<float> dy(y.size(), nan_value), fused(y.size(), nan_value);
  emulate_gemm<TileX, false>(kc::conv2d_dx_problem(s, batch, dz, w.data(), dy.data()), 1);
  emulate_gemm<TileX, false>(
      kc::conv2d_dx_problem_to(s, batch, dz, w.data(), kc::ActivationSink<Epi>{fused.data(), y.data(), zp}), 1);
  const kc::ConvGradient<Epi> want{dy.data(), y.data(), zp, sb.o, sb.ohw, sb.ow};
  check_same_bits(fused, materialized(want, batch, sb.o, sb.oh, sb.ow), "conv dx times the activation below");
}

// A Linear above a Linear with an activation: dx through an ActivationSink is the dz the lower Linear's
// loaders form; its backward from that stored dz (linear_backward_stored's operands) gives the same dx,
// dW and db bits as from dy with the derivative applied as loaded.
template <class Epi, class TileIn>
void check_linear_activates(int batch, int in, int mid, int out, int sm_count) {
  const auto x = random_values(std::size_t(batch) * in, 61), w1 = random_values(std::size_t(mid) * in, 62);
  const auto b1 = random_values(std::size_t(mid), 63), w2 = random_values(std::size_t(out) * mid, 64);
  const auto dy2 = random_values(std::size_t(batch) * out, 65);
  std::vector<float> y(std::size_t(batch) * mid, nan_value), z(y.size(), nan_value);
  float* const zp = Epi::saves_input ? z.data() : nullptr;
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_forward_problem<Epi>(batch, in, mid, w1.data(), b1.data(), x.data(), y.data(), zp), 1);
  const kc::EpilogueGradient<Epilogue<>> g2{dy2.data(), nullptr, nullptr};
  std::vector<float> dy(y.size(), nan_value), fused(y.size(), nan_value);
  emulate_gemm<kc::tile_for<64>, false>(kc::linear_dx_problem<Epilogue<>>(batch, mid, out, w2.data(), g2, dy.data()), 1);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_dx_problem_to(batch, mid, out, w2.data(), g2, kc::ActivationSink<Epi>{fused.data(), y.data(), zp}), 1);
  const kc::EpilogueGradient<Epi> g{dy.data(), y.data(), zp};
  std::vector<float> want(y.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = g(i);
  check_same_bits(fused, want, "linear dx times the activation below");

  std::vector<float> dx(x.size(), nan_value), dx_stored(x.size(), nan_value), dw(w1.size(), nan_value),
      dw_stored(w1.size(), nan_value), db(b1.size(), nan_value), db_stored(b1.size(), nan_value);
  emulate_gemm<TileIn, false>(kc::linear_dx_problem<Epi>(batch, in, mid, w1.data(), g, dx.data()), 1);
  emulate_gemm<TileIn, false>(
      kc::linear_stored_dx_problem(batch, in, mid, w1.data(), fused.data(), kc::StoreSink{dx_stored.data()}), 1);
  check_same_bits(dx_stored, dx, "linear dx from stored dz");
  const auto ops = kc::linear_dw_operands<Epi>(batch, in, mid, g, x.data());
  emulate_weight_gradient<TileIn>(sm_count, ops.m, ops.n, ops.k, ops.a, ops.b, dw.data(), db.data());
  const auto stored = kc::linear_stored_dw_operands(batch, in, mid, fused.data(), x.data());
  emulate_weight_gradient<TileIn>(sm_count, stored.m, stored.n, stored.k, stored.a, stored.b, dw_stored.data(),
                                  db_stored.data());
  check_same_bits(dw_stored, dw, "linear dW from stored dz");
  check_same_bits(db_stored, db, "linear db from stored dz");
}

}  // namespace

TEST_CASE("FastDiv divides like / for every divisor the loaders use") {
  for (int d = 1; d < 3000; ++d) {
    const kc::FastDiv f(d);
    for (int n : {0, 1, d - 1, d, d + 1, 2 * d + 1, 12345, 999999, (1 << 30) + 7, 0x7fffffff}) {
      if (n < 0) continue;
      int q = 0, r = 0;
      f.divmod(n, q, r);
      REQUIRE_MESSAGE(q == n / d, "d=" << d << " n=" << n);
      REQUIRE(r == n % d);
    }
  }
}

TEST_CASE("Linear GEMM problems reproduce the Host kernels (CPU emulation)") {
  // sizes that are not multiples of any tile; sm_count 132 (an H100/H200) and 8 make different splits
  check_linear<Epilogue<Relu>, kc::tile_for<45>>(77, 45, 37, 132);
  check_linear<Epilogue<Gelu>, kc::tile_for<45>>(77, 45, 37, 8);
  check_linear<Epilogue<>, kc::tile_for<13>>(300, 13, 70, 132);
  check_linear<Epilogue<Tanh>, kc::tile_for<29>>(1000, 29, 9, 132);
  check_linear<Epilogue<Relu, Tanh>, kc::tile_for<130>>(33, 130, 65, 132);
}

TEST_CASE("Conv2d implicit-GEMM problems reproduce the Host kernels (CPU emulation)") {
  // in_channels, h, w, kernel, stride, pad, out_channels, out_h, out_w
  constexpr fp::kernels::ConvGeometry a{3, 11, 9, 3, 2, 1, 5, 6, 5};
  check_conv<Epilogue<Relu>, kc::tile_for<5>, kc::tile_for<3>, kc::tile_for<27>>(a, 7, 132);
  constexpr fp::kernels::ConvGeometry b{4, 10, 12, 5, 1, 0, 6, 6, 8};
  check_conv<Epilogue<Gelu>, kc::tile_for<6>, kc::tile_for<4>, kc::tile_for<100>>(b, 5, 8);
  constexpr fp::kernels::ConvGeometry c{2, 7, 7, 1, 1, 0, 33, 7, 7};
  check_conv<Epilogue<>, kc::tile_for<33>, kc::tile_for<2>, kc::tile_for<2>>(c, 9, 132);
  constexpr fp::kernels::ConvGeometry d{3, 9, 8, 4, 3, 2, 7, 4, 3};
  check_conv<Epilogue<Tanh>, kc::tile_for<7>, kc::tile_for<3>, kc::tile_for<48>>(d, 3, 132);
}

TEST_CASE("Conv2d + MaxPool2d fused problems reproduce the Host conv and pool stages (CPU emulation)") {
  constexpr fp::kernels::ConvGeometry a{3, 13, 11, 3, 1, 1, 7, 13, 11};  // odd output: floor-mode remainder
  check_conv_maxpool<Epilogue<Relu>, 2, kc::tile_for<7>, kc::tile_for<3>, kc::tile_for<27>>(a, 5, 132);
  constexpr fp::kernels::ConvGeometry b{1, 28, 28, 5, 1, 0, 6, 24, 24};   // LeNet's first stage
  check_conv_maxpool<Epilogue<Relu>, 2, kc::tile_for<6>, kc::tile_for<1>, kc::tile_for<25>>(b, 3, 132);
  constexpr fp::kernels::ConvGeometry c{2, 17, 18, 2, 1, 0, 40, 16, 17};
  check_conv_maxpool<Epilogue<Tanh>, 4, kc::tile_for<40>, kc::tile_for<2>, kc::tile_for<8>>(c, 2, 8);
}

// The layers' GEMMs with the tiles they take on the tensor cores (FUSEDP_CUDA_MMA_LAYERS=1: GemmTiles<n>::mma,
// 128-row blocks of 256 threads, pitch BN + 8): the same epilogues (bias, activation, the pooling window's
// maximum and argmax, the split weight gradient's partials and row sums) reproduce the Host kernels.
TEST_CASE("the layers' GEMM problems with the tensor-core tiles reproduce the Host kernels (CPU emulation)") {
  using kc::GemmTiles;
  check_linear<Epilogue<Relu>, GemmTiles<45>::mma>(77, 45, 37, 132);
  check_linear<Epilogue<>, GemmTiles<13>::mma>(300, 13, 70, 132);
  check_linear<Epilogue<Relu, Tanh>, GemmTiles<130>::mma>(33, 130, 65, 132);
  const fp::kernels::ConvGeometry a{3, 9, 11, 3, 1, 1, 5, 9, 11};
  check_conv<Epilogue<Relu>, GemmTiles<5>::mma, GemmTiles<3>::mma, GemmTiles<27>::mma>(a, 7, 132);
  const fp::kernels::ConvGeometry c{2, 12, 10, 1, 1, 0, 33, 12, 10};
  check_conv<Epilogue<>, GemmTiles<33>::mma, GemmTiles<2>::mma, GemmTiles<2>::mma>(c, 9, 132);
  const fp::kernels::ConvGeometry d{16, 8, 8, 3, 2, 1, 72, 4, 4};  // strided, n > 64: the 128 x 128 tile
  check_conv<Epilogue<Relu>, GemmTiles<72>::mma, GemmTiles<16>::mma, GemmTiles<144>::mma>(d, 5, 8);
  const fp::kernels::ConvGeometry e{3, 12, 12, 3, 1, 1, 7, 12, 12};
  check_conv_maxpool<Epilogue<Relu>, 2, GemmTiles<7>::mma, GemmTiles<3>::mma, GemmTiles<27>::mma>(e, 5, 132);
  const fp::kernels::ConvGeometry f{2, 16, 16, 3, 1, 1, 40, 16, 16};
  check_conv_maxpool<Epilogue<Tanh>, 4, GemmTiles<40>::mma, GemmTiles<2>::mma, GemmTiles<18>::mma>(f, 2, 8);
}

TEST_CASE("16-bit operands: a layer's problems over BFloat16 give the bits of fp32 copies of the values (CPU emulation)") {
  using kc::GemmTiles;
  check_rows_columns_held();
  const fp::kernels::ConvGeometry a{3, 9, 11, 3, 1, 1, 5, 9, 11};
  check_conv_held<Epilogue<Relu>, 1, GemmTiles<5>::mma, GemmTiles<3>::mma, GemmTiles<27>::mma>(a, 7, 132);
  const fp::kernels::ConvGeometry d{16, 8, 8, 3, 2, 1, 72, 4, 4};  // strided, n > 64: the 128 x 128 tile
  check_conv_held<Epilogue<Relu>, 2, GemmTiles<72>::mma, GemmTiles<16>::mma, GemmTiles<144>::mma>(d, 5, 8);
  const fp::kernels::ConvGeometry e{3, 12, 12, 3, 1, 1, 7, 12, 12};
  check_conv_held<Epilogue<Tanh>, 2, GemmTiles<7>::mma, GemmTiles<3>::mma, GemmTiles<27>::mma>(e, 5, 132);
}

TEST_CASE("fused gradient boundaries: a dx GEMM's sink gives the unfused pass's bits (CPU emulation)") {
  using kc::GemmTiles;
  // in_channels, h, w, kernel, stride, pad, out_channels, out_h, out_w
  constexpr fp::kernels::ConvGeometry lenet1{1, 28, 28, 5, 1, 0, 6, 24, 24};     // LeNet's conv1 + pool
  check_conv_unpools<Epilogue<Relu>, 2, kc::tile_for<6>>(lenet1, 16, 3);
  check_conv_unpools<Epilogue<Relu>, 2, GemmTiles<6>::mma>(lenet1, 16, 3);
  constexpr fp::kernels::ConvGeometry odd{3, 13, 11, 3, 1, 1, 7, 13, 11};       // windows leave a row and a column
  check_conv_unpools<Epilogue<Relu>, 2, kc::tile_for<7>>(odd, 9, 4);
  constexpr fp::kernels::ConvGeometry wide{2, 17, 18, 2, 1, 0, 40, 16, 17};     // 4x4 windows, a column left
  check_conv_unpools<Epilogue<Tanh>, 4, GemmTiles<40>::mma>(wide, 5, 2);
  constexpr fp::kernels::ConvGeometry no_act{4, 10, 10, 3, 1, 1, 33, 10, 10};
  check_conv_unpools<Epilogue<>, 2, kc::tile_for<33>>(no_act, 8, 3);

  constexpr fp::kernels::ConvGeometry cifar2{8, 16, 16, 3, 1, 1, 12, 16, 16};   // CIFAR's conv2 + pool, narrower
  check_linear_unpools<Epilogue<Relu>, 2, Epilogue<Relu>, kc::tile_for<768>>(cifar2, 37, 5);
  check_linear_unpools<Epilogue<Relu>, 2, Epilogue<>, GemmTiles<768>::mma>(cifar2, 10, 3);
  check_linear_unpools<Epilogue<Tanh>, 2, Epilogue<Gelu>, kc::tile_for<210>>(odd, 20, 2);
  check_linear_unpools<Epilogue<>, 2, Epilogue<Relu>, kc::tile_for<33>>(no_act, 12, 2);    // no activation below
  constexpr fp::kernels::ConvGeometry tall{3, 11, 7, 3, 1, 0, 5, 9, 5};          // 4x4 windows: 2 x 1 pooled,
  check_conv_unpools<Epilogue<Relu>, 4, kc::tile_for<5>>(tall, 6, 3);            // a row and a column left
  constexpr fp::kernels::ConvGeometry single{2, 5, 5, 3, 1, 1, 4, 5, 5};         // one window a plane
  check_conv_unpools<Epilogue<Relu>, 4, GemmTiles<4>::mma>(single, 3, 2);

  constexpr fp::kernels::ConvGeometry plain{3, 9, 11, 3, 1, 1, 6, 9, 11};
  check_conv_activates<Epilogue<Relu>, kc::tile_for<6>>(plain, 7, 3);
  check_conv_activates<Epilogue<Gelu>, GemmTiles<6>::mma>(plain, 5, 2);  // saves z

  check_linear_activates<Epilogue<Relu>, kc::tile_for<45>>(77, 45, 37, 21, 132);
  check_linear_activates<Epilogue<Gelu>, GemmTiles<45>::mma>(33, 45, 64, 10, 8);
  check_linear_activates<Epilogue<Relu, Tanh>, kc::tile_for<130>>(300, 130, 19, 7, 132);
}

// The optimizer applied by a weight gradient's GEMM (issue 17) against the gradients stored and then
// the separate pass (optimizer_kernel: op(params[i], grads[i], state[i]...), without the decay on the
// bias under Decay::weights), bit for bit. The weight sits `offset` elements into flat buffers of
// `total`, the bias after it; state slots are `total` apart (Adam's second).
template <class TileT, class Op, class A, class B>
void check_fused_update(const Op& op, int sm_count, int m, int n, int k, const A& a, const B& b) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(sm_count);
  constexpr int slots = std::is_same_v<Op, fp::kernels::SgdStep<float>> ? 1 : 2;
  const std::size_t count = std::size_t(m) * n, offset = 7, bias = offset + count + 3, total = bias + m + 5;
  const auto params = random_values(total, 31), state0 = random_values(slots * total, 32, 0.0f, 1.0f);
  auto separate = [&](const Op& o, std::vector<float>& p, std::vector<float>& st, std::size_t at, const float* g,
                      std::size_t n_elements) {
    for (std::size_t i = 0; i < n_elements; ++i) {
      if constexpr (slots == 1) o(p[at + i], g[i], st[at + i]);
      else o(p[at + i], g[i], st[at + i], st[total + at + i]);
    }
  };
  // The reference: the gradient summed by reduce_splits_kernel's loop written out, then the separate
  // pass; against it the GEMM whose last blocks sum and update, and the second pass that sums and
  // updates (either may finish a layer's split: reduces_in_gemm).
  std::vector<float> dw_sep(count, nan_value), db_sep(m, nan_value), p_sep = params, s_sep = state0;
  emulate_weight_gradient<TileT>(sm_count, m, n, k, a, b, dw_sep.data(), db_sep.data(), {}, SplitSums::written_out);
  separate(op, p_sep, s_sep, offset, dw_sep.data(), count);
  separate(op.decay_all ? op : fp::kernels::without_decay(op), p_sep, s_sep, bias, db_sep.data(), std::size_t(m));

  const auto any = fp::kernels::AnyStep<float>::of(op);
  for (const SplitSums sums : {SplitSums::in_gemm, SplitSums::second_pass}) {
    CAPTURE(int(sums));
    std::vector<float> dw(count, nan_value), db(m, nan_value), p = params, st = state0;
    const fp::kernels::UpdateTarget<float> whole{&any, p.data(), st.data(), total};
    emulate_weight_gradient<TileT>(sm_count, m, n, k, a, b, dw.data(), db.data(),
                                   fp::kernels::LayerUpdate<float>{whole.at(offset, true), whole.at(bias, false)}, sums);
    CHECK(std::memcmp(dw.data(), dw_sep.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(db.data(), db_sep.data(), std::size_t(m) * sizeof(float)) == 0);
    CHECK(std::memcmp(p.data(), p_sep.data(), total * sizeof(float)) == 0);  // nothing outside the tensors moves
    CHECK(std::memcmp(st.data(), s_sep.data(), st.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(p.data() + offset, params.data() + offset, count * sizeof(float)) != 0);  // the updates ran
    CHECK(std::memcmp(p.data() + bias, params.data() + bias, std::size_t(m) * sizeof(float)) != 0);
  }
}

TEST_CASE("a weight gradient that applies the optimizer gives the separate pass's bits (CPU emulation)") {
  using Sgd = fp::kernels::SgdStep<float>;
  using Adam = fp::kernels::AdamStep<float>;
  // lr, momentum, dampening, weight decay, nesterov, first step, decay everything
  const Sgd sgds[] = {Sgd{0.05f, 0.9f, 0.0f, 5e-4f, false, true, true}, Sgd{0.05f, 0.9f, 0.0f, 5e-4f, true, false, false},
                      Sgd{0.1f, 0.0f, 0.0f, 0.0f, false, false, true}, Sgd{0.02f, 0.8f, 0.1f, 1e-2f, false, false, true}};
  // lr, beta1, beta2, eps, weight decay, decoupled (AdamW), 1 - beta1^t, 1 - beta2^t
  const Adam adams[] = {Adam{1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, true, 1 - 0.9f * 0.9f, 1 - 0.999f * 0.999f, true},
                        Adam{3e-3f, 0.8f, 0.99f, 1e-6f, 1e-4f, false, 0.2f, 0.01f, false}};

  // A Linear's dW = dz^T x: one that the plan leaves unsplit (a wide layer, many SMs busy) and one that
  // it splits (few outputs, a long batch).
  const int batch = 300, in = 96, out = 40;
  const auto x = random_values(std::size_t(batch) * in, 33), dz = random_values(std::size_t(batch) * out, 34);
  const auto ops = kc::linear_stored_dw_operands(batch, in, out, dz.data(), x.data());
  using TileL = kc::tile_for<96>;
  const kc::SplitPlan one = kc::plan_split(ops.m, ops.n, ops.k, TileL::bm, TileL::bn, TileL::bk, 1);
  const kc::SplitPlan many = kc::plan_split(ops.m, ops.n, ops.k, TileL::bm, TileL::bn, TileL::bk, 132);
  REQUIRE(one.splits == 1);
  REQUIRE(many.splits > 1);
  for (int sms : {1, 132}) {
    for (const Sgd& op : sgds) check_fused_update<TileL>(op, sms, ops.m, ops.n, ops.k, ops.a, ops.b);
    for (const Adam& op : adams) check_fused_update<TileL>(op, sms, ops.m, ops.n, ops.k, ops.a, ops.b);
  }
  // 150 outputs: three row bands of tiles, so three tiles reduce rows of the bias and the others none.
  const auto dz150 = random_values(std::size_t(batch) * 150, 37);
  const auto ops150 = kc::linear_stored_dw_operands(batch, in, 150, dz150.data(), x.data());
  REQUIRE(kc::plan_split(ops150.m, ops150.n, ops150.k, TileL::bm, TileL::bn, TileL::bk, 132).splits > 1);
  check_fused_update<TileL>(sgds[1], 132, ops150.m, ops150.n, ops150.k, ops150.a, ops150.b);
  check_fused_update<TileL>(adams[1], 132, ops150.m, ops150.n, ops150.k, ops150.a, ops150.b);
  // A long batch: many splits (the sums' loads go four splits at a time), 96 columns finished four at a
  // time, 97 one by one.
  const int long_batch = 3000;
  const auto xl = random_values(std::size_t(long_batch) * 97, 38), dzl = random_values(std::size_t(long_batch) * out, 39);
  for (int cols : {96, 97}) {
    const auto opsl = kc::linear_stored_dw_operands(long_batch, cols, out, dzl.data(), xl.data());
    REQUIRE(kc::plan_split(opsl.m, opsl.n, opsl.k, TileL::bm, TileL::bn, TileL::bk, 132).splits >= 9);
    check_fused_update<TileL>(sgds[0], 132, opsl.m, opsl.n, opsl.k, opsl.a, opsl.b);
    check_fused_update<TileL>(adams[0], 132, opsl.m, opsl.n, opsl.k, opsl.a, opsl.b);
  }
  // A conv's dW over batch x pixels, on the tensor-core tile.
  constexpr fp::kernels::ConvGeometry g{3, 9, 11, 3, 1, 1, 6, 9, 11};
  const kc::ConvShape s(g);
  const int cb = 5;
  const auto cx = random_values(std::size_t(cb) * g.in_size(), 35), cdz = random_values(std::size_t(cb) * g.out_size(), 36);
  const auto cops = kc::conv2d_dw_operands(s, cb, kc::StoredGradient{cdz.data(), s.o, s.ohw, s.ow}, cx.data());
  for (int sms : {1, 132}) {
    check_fused_update<kc::GemmTiles<27>::mma>(sgds[1], sms, cops.m, cops.n, cops.k, cops.a, cops.b);
    check_fused_update<kc::GemmTiles<27>::mma>(adams[0], sms, cops.m, cops.n, cops.k, cops.a, cops.b);
  }
}

// A Linear forward the plan splits (few rows and columns, a long reduction): kc::split_linear_forward
// itself with the blocks emulated on `TileT` (either mainloop's grid), its parts finished by the GEMM's
// last block per tile, against the same parts finished by linear_forward_reduce_kernel's loop written
// out here: the same bits, every counter back at zero, and both close to the Host model in double.
template <class Epi, class TileT, int Out>
void check_split_linear_forward(int batch, int in, int sm_count) {
  CAPTURE(batch);
  CAPTURE(in);
  CAPTURE(Out);
  CAPTURE(TileT::bm);
  CAPTURE(TileT::bn);
  using Tiles = kc::GemmTiles<Out>;
  const kc::SplitPlan s = kc::linear_forward_split<Tiles>(batch, in, Out, sm_count);
  REQUIRE(s.splits > 1);
  const fp::Host host{1};
  const auto x = random_values(std::size_t(batch) * in, 41), w = random_values(std::size_t(Out) * in, 42);
  const auto b = random_values(std::size_t(Out), 43);
  const auto xd = widen(x), wd = widen(w), bd = widen(b);
  const std::size_t count = std::size_t(batch) * Out;
  std::vector<double> y_ref(count), z_ref(count);
  kh::linear_forward<Epi>(host, batch, in, Out, wd.data(), bd.data(), xd.data(), y_ref.data(),
                          Epi::saves_input ? z_ref.data() : nullptr);

  // In the GEMM: scratch poisoned (and one more float), so a tile finished before all its parts arrived,
  // or a read past the parts, shows.
  std::vector<float> scratch(kc::linear_forward_scratch<Tiles>(batch, in, Out, sm_count) + 1, nan_value);
  std::vector<float> y(count, nan_value), z(count, nan_value);
  std::vector<unsigned> arrivals(fp::Cuda::arrival_counter_count, 0u);
  const fp::ArrivalCounters counters{arrivals.data(), arrivals.size()};
  REQUIRE(kc::arrivals_cover<typename Tiles::wmma, typename Tiles::mma>(counters, batch, Out));
  // The walk the widths below are chosen for: runs of four where the width is a multiple of 4.
  CHECK(kc::runs_of_four(scratch.data(), Out, count) == (Out % 4 == 0));
  // The flow itself, with counters (the GEMM's last blocks finish) and without (its second pass does).
  const auto flow = [&](const fp::ArrivalCounters& a, std::vector<float>& yf, std::vector<float>& zf, int& passes) {
    std::fill(scratch.begin(), scratch.end(), nan_value);
    bool in_gemm = false;
    kc::split_linear_forward<Epi, Tiles>(
        sm_count, batch, in, Out, w.data(), b.data(), x.data(), yf.data(), Epi::saves_input ? zf.data() : nullptr,
        scratch.data(), a, false,
        [&](const auto& p, int splits) {
          if constexpr (requires { p.epi.reduction; }) in_gemm = p.epi.reduction.active();
          emulate_gemm<TileT, false>(p, splits);
        },
        PassOnHost{&passes});
    return in_gemm;
  };
  int passes = 0;
  CHECK(flow(counters, y, z, passes));
  CHECK(passes == 0);
  CHECK(std::count(arrivals.begin(), arrivals.end(), 0u) == std::ptrdiff_t(arrivals.size()));
  std::vector<float> yp(count, nan_value), zp(count, nan_value);
  CHECK_FALSE(flow(fp::ArrivalCounters{}, yp, zp, passes));
  CHECK(passes == 1);

  // The second kernel's way: the same parts, then the sum in split order, the bias, Epi.
  std::vector<float> parts(scratch.size(), nan_value), y2(count, nan_value), z2(count, nan_value);
  emulate_gemm<TileT, false>(
      kc::GemmProblem<kc::Rows, kc::Rows, kc::PartialsRowMajor<kc::LinearForwardReduction<Epi>>>{
          batch, Out, in, s.k_chunk, kc::Rows{x.data(), in}, kc::Rows{w.data(), in}, {parts.data(), batch, Out, count},
          nullptr},
      s.splits);
  for (std::size_t i = 0; i < count; ++i) {
    float sum = 0;
    for (int q = 0; q < s.splits; ++q) sum += parts[std::size_t(q) * count + i];
    const float v = sum + b[i % Out];
    z2[i] = v;
    y2[i] = Epi::apply(v);
  }
  CHECK(std::memcmp(y.data(), y2.data(), count * sizeof(float)) == 0);
  CHECK(std::memcmp(yp.data(), y2.data(), count * sizeof(float)) == 0);
  if constexpr (Epi::saves_input) CHECK(std::memcmp(z.data(), z2.data(), count * sizeof(float)) == 0);
  if constexpr (Epi::saves_input) CHECK(std::memcmp(zp.data(), z2.data(), count * sizeof(float)) == 0);
  // fp32 sums of parts exact in double: only their roundings differ.
  FUSEDP_CHECK_CLOSE(y, y_ref, exact, "split linear y");
  if constexpr (Epi::saves_input) FUSEDP_CHECK_CLOSE(z, z_ref, exact, "split linear z");
}

TEST_CASE("a split Linear forward finished by the GEMM's last blocks or its second pass gives the same bits (CPU "
          "emulation)") {
  // One row of WMMA tiles (20 x 70: 1 x 2) split many ways; 2 x 3 (100 x 130); on the tensor-core tile.
  // Widths that are multiples of 4 (72, 128) are finished four at a time, the others one by one.
  check_split_linear_forward<Epilogue<Relu>, kc::GemmTiles<70>::wmma, 70>(20, 1000, 132);
  check_split_linear_forward<Epilogue<Relu>, kc::GemmTiles<72>::wmma, 72>(20, 1000, 132);
  check_split_linear_forward<Epilogue<Gelu>, kc::GemmTiles<130>::wmma, 130>(100, 600, 132);
  check_split_linear_forward<Epilogue<Gelu>, kc::GemmTiles<128>::wmma, 128>(100, 600, 132);
  check_split_linear_forward<Epilogue<>, kc::GemmTiles<130>::mma, 130>(100, 600, 132);
  check_split_linear_forward<Epilogue<Tanh>, kc::GemmTiles<72>::mma, 72>(20, 1000, 8);
}

namespace {

// --- bf16 activation storage (net/activation_storage.hpp) ----------------------------------------------
// Under precision::Bf16 a stage's output and input gradient are stored as bf16 values; the Cuda kernels
// round as they write (kernels::stored_value). Each epilogue and sink run with bf16 must store exactly
// the fp32 run's values rounded, and keep what a stage saves for itself (z) in fp32; the max-pooling
// epilogue compares the rounded values, so its winner is the one a separate pooling over the stored
// conv output picks; a sink rounds the GEMM's value before it forms dz, as the unfused pass reads it.

std::vector<float> rounded(std::vector<float> v) {
  for (float& e : v) e = fp::kernels::round_bf16(e);
  return v;
}
bool holds_non_bf16(const std::vector<float>& v) {
  return std::any_of(v.begin(), v.end(), [](float e) { return fp::kernels::round_bf16(e) != e; });
}

template <class Epi, class TileT>
void check_linear_stores_bf16(int batch, int in, int out) {
  const auto x = random_values(std::size_t(batch) * in, 71), w = random_values(std::size_t(out) * in, 72);
  const auto b = random_values(std::size_t(out), 73);
  std::vector<float> y(std::size_t(batch) * out, nan_value), z(y.size(), nan_value), yb(y.size(), nan_value),
      zb(y.size(), nan_value);
  emulate_gemm<TileT, false>(
      kc::linear_forward_problem<Epi>(batch, in, out, w.data(), b.data(), x.data(), y.data(), z.data(), false), 1);
  emulate_gemm<TileT, false>(
      kc::linear_forward_problem<Epi>(batch, in, out, w.data(), b.data(), x.data(), yb.data(), zb.data(), true), 1);
  REQUIRE(holds_non_bf16(y));
  check_same_bits(yb, rounded(y), "linear y stored in bf16");
  if constexpr (Epi::saves_input) check_same_bits(zb, z, "linear z kept in fp32");
}

// Both ways a split Linear forward finishes: by the GEMM's last blocks, and by the second kernel's loop.
template <class Epi, class TileT, int Out>
void check_split_linear_stores_bf16(int batch, int in, int sm_count) {
  using Tiles = kc::GemmTiles<Out>;
  const kc::SplitPlan s = kc::linear_forward_split<Tiles>(batch, in, Out, sm_count);
  REQUIRE(s.splits > 1);
  const auto x = random_values(std::size_t(batch) * in, 74), w = random_values(std::size_t(Out) * in, 75);
  const auto b = random_values(std::size_t(Out), 76);
  const std::size_t count = std::size_t(batch) * Out;
  std::vector<unsigned> arrivals(fp::Cuda::arrival_counter_count, 0u);
  const fp::ArrivalCounters counters{arrivals.data(), arrivals.size()};
  std::vector<float> parts;
  const auto run = [&](bool bf16, std::vector<float>& y, std::vector<float>& z) {
    std::vector<float> scratch(kc::linear_forward_scratch<Tiles>(batch, in, Out, sm_count), nan_value);
    bool in_gemm = false;
    kc::split_linear_forward<Epi, Tiles>(sm_count, batch, in, Out, w.data(), b.data(), x.data(), y.data(),
                                         z.data(), scratch.data(), counters, bf16, [&](const auto& p, int splits) {
                                           if constexpr (requires { p.epi.reduction; }) in_gemm = p.epi.reduction.active();
                                           emulate_gemm<TileT, false>(p, splits);
                                         }, PassOnHost{});
    CHECK(in_gemm);  // finished by the GEMM's last blocks
    CHECK(std::count(arrivals.begin(), arrivals.end(), 0u) == std::ptrdiff_t(arrivals.size()));
    parts = scratch;
  };
  std::vector<float> y(count, nan_value), z(count, nan_value), yb(count, nan_value), zb(count, nan_value);
  run(false, y, z);
  run(true, yb, zb);
  REQUIRE(holds_non_bf16(y));
  check_same_bits(yb, rounded(y), "split linear y stored in bf16");
  if constexpr (Epi::saves_input) check_same_bits(zb, z, "split linear z kept in fp32");
  std::vector<float> y2(count, nan_value), z2(count, nan_value);
  for (std::size_t i = 0; i < count; ++i)
    kc::finish_linear_sums<Epi>(parts.data(), s.splits, count, i, Out, b.data(), y2.data(), z2.data(), true);
  check_same_bits(y2, yb, "split linear y stored in bf16 by the second kernel");
}

template <class Epi, class TileT>
void check_conv_stores_bf16(const fp::kernels::ConvGeometry& g, int batch) {
  const kc::ConvShape s(g);
  const auto x = random_values(batch * g.in_size(), 77), w = random_values(g.out_channels * g.patch(), 78);
  const auto b = random_values(std::size_t(g.out_channels), 79);
  const std::size_t n = batch * g.out_size();
  std::vector<float> y(n, nan_value), z(n, nan_value), yb(n, nan_value), zb(n, nan_value);
  float* const zp = Epi::saves_input ? z.data() : nullptr;
  float* const zbp = Epi::saves_input ? zb.data() : nullptr;
  emulate_gemm<TileT, false>(kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), y.data(), zp), 1);
  emulate_gemm<TileT, false>(
      kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), yb.data(), zbp, nullptr, nullptr, true), 1);
  REQUIRE(holds_non_bf16(y));
  check_same_bits(yb, rounded(y), "conv y stored in bf16");
  if constexpr (Epi::saves_input) check_same_bits(zb, z, "conv z kept in fp32");

  // Evaluation with a BatchNorm and a residual add folded in: the same rounding of what it writes.
  const auto mean = random_values(std::size_t(g.out_channels), 80), var = random_values(mean.size(), 81, 0.5f, 2.0f);
  const auto gamma = random_values(mean.size(), 82), beta = random_values(mean.size(), 83), add = random_values(n, 84);
  const fp::kernels::BatchNormFold<float> fold{mean.data(), var.data(), gamma.data(), beta.data(), 1e-5};
  std::vector<float> f(n, nan_value), fb(n, nan_value);
  emulate_gemm<TileT, false>(
      kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), f.data(), nullptr, &fold, add.data()), 1);
  emulate_gemm<TileT, false>(kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), fb.data(), nullptr,
                                                             &fold, add.data(), true),
                             1);
  REQUIRE(holds_non_bf16(f));
  check_same_bits(fb, rounded(f), "conv y with a folded BatchNorm stored in bf16");
}

// The fused max-pooling in bf16 against a separate pooling (the Host's) over the conv output stored in
// bf16: the same pooled values and the same winners, ties that the rounding makes included. Returns
// the number of windows whose winner the rounding changed (which fp32 comparisons would get wrong).
template <class Epi, int Kp, class TileT>
int check_conv_maxpool_stores_bf16(const fp::kernels::ConvGeometry& g, int batch) {
  const kc::ConvShape s(g);
  const int ph = g.out_h / Kp, pw = g.out_w / Kp;
  const fp::kernels::ConvGeometry gp{g.out_channels, g.out_h, g.out_w, Kp, Kp, 0, g.out_channels, ph, pw};
  const auto x = random_values(batch * g.in_size(), 85), w = random_values(g.out_channels * g.patch(), 86);
  const auto b = random_values(std::size_t(g.out_channels), 87);
  std::vector<float> yb(batch * g.out_size(), nan_value);
  emulate_gemm<TileT, false>(
      kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), yb.data(), nullptr, nullptr, nullptr, true),
      1);
  // The Host's pooling of the stored output; its winners where a unit gradient lands.
  const fp::Host host{1};
  const std::size_t pooled_n = batch * gp.out_size();
  std::vector<float> pooled_ref(pooled_n), ones(pooled_n, 1.0f), winners(yb.size());
  float* const none = nullptr;
  kh::pool_forward<fp::kernels::PoolOp::max, Kp, Kp, Epilogue<>>(host, gp, batch, yb.data(), pooled_ref.data(), none);
  kh::pool_backward<fp::kernels::PoolOp::max, Kp, Kp, Epilogue<>>(host, gp, batch, yb.data(), pooled_ref.data(), none,
                                                                  ones.data(), winners.data());
  std::vector<float> pooled(pooled_n, nan_value), pooled_fp32(pooled_n, nan_value);
  std::vector<std::uint8_t> argmax(pooled_n, 0xff), argmax_fp32(pooled_n, 0xff);
  emulate_gemm<TileT, false>(kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(), pooled.data(),
                                                                 argmax.data(), true),
                             1);
  emulate_gemm<TileT, false>(kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(),
                                                                 pooled_fp32.data(), argmax_fp32.data()),
                             1);
  check_same_bits(pooled, pooled_ref, "pooled values stored in bf16");
  int wrong = 0, changed = 0;
  for (std::size_t j = 0; j < pooled_n; ++j) {
    const std::size_t plane = j / (ph * pw), wp = j % (ph * pw);
    const int py = int(wp) / pw, px = int(wp) % pw, at = argmax[j];
    const std::size_t pixel = plane * g.out_h * g.out_w + std::size_t(py * Kp + at / Kp) * g.out_w + px * Kp + at % Kp;
    wrong += winners[pixel] == 1.0f ? 0 : 1;
    changed += argmax[j] != argmax_fp32[j] ? 1 : 0;
  }
  CHECK_MESSAGE(wrong == 0, wrong << " of " << pooled_n << " windows have another winner than the separate pooling");
  return changed;
}

// The values of 16-bit elements as floats.
std::vector<float> widened(const std::vector<fp::kernels::BFloat16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = fp::kernels::to_float(v[i]);
  return out;
}

// The sinks with bf16 against the unfused pass reading the stored, rounded input gradient; where the
// stage below's derivative is a mask, the sinks storing dz in 16 bits (received_dz_element) against
// the fp32 ones.
template <class Epi, int Kp>
void check_sinks_store_bf16(const fp::kernels::ConvGeometry& below_g, int upper_out, int batch) {
  // StoreSink and UnpoolSink: a conv's dx GEMM above a conv + max-pool.
  const PooledConvBelow<Epi, Kp> below(below_g, batch);
  const fp::kernels::ConvGeometry up{below_g.out_channels, below.ph, below.pw, 3, 1, 1, upper_out, below.ph, below.pw};
  const kc::ConvShape s(up);
  const auto w = random_values(up.out_channels * up.patch(), 88), dz_up = random_values(batch * up.out_size(), 89);
  const kc::StoredGradient dz{dz_up.data(), s.o, s.ohw, s.ow};
  std::vector<float> dpool(below.pooled.size(), nan_value), dpool_bf16(dpool.size(), nan_value),
      fused(below.dz_size(), nan_value);
  emulate_gemm<kc::tile_for<64>, false>(kc::conv2d_dx_problem(s, batch, dz, w.data(), dpool.data()), 1);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::conv2d_dx_problem_to(s, batch, dz, w.data(), kc::StoreSink{dpool_bf16.data(), true}), 1);
  REQUIRE(holds_non_bf16(dpool));
  check_same_bits(dpool_bf16, rounded(dpool), "dx stored in bf16");
  // In 16-bit elements (a gradient the layer below reads so: CudaWorkspace::dx_element): the same values.
  std::vector<fp::kernels::BFloat16> dpool16(dpool.size(), fp::kernels::BFloat16{0xffff});
  emulate_gemm<kc::tile_for<64>, false>(kc::conv2d_dx_problem_to(
                                            s, batch, dz, w.data(), kc::StoreSinkOf<fp::kernels::BFloat16>{dpool16.data(), true}),
                                        1);
  check_same_bits(widened(dpool16), dpool_bf16, "dx stored in 16 bits");
  kc::UnpoolSink<Epi, Kp> unpool = below.sink(fused.data());
  unpool.bf16 = true;
  emulate_gemm<kc::tile_for<64>, false>(kc::conv2d_dx_problem_to(s, batch, dz, w.data(), unpool), 1);
  check_same_bits(fused, below.dz_from(dpool_bf16), "dx unpooled from its bf16 value");
  using E = kc::received_dz_element<fp::precision::Bf16, Epi>;
  static_assert(std::is_same_v<E, fp::kernels::BFloat16> == fp::kernels::derivative_is_mask<Epi>);
  if constexpr (std::is_same_v<E, fp::kernels::BFloat16>) {
    // Where the derivative is a mask the sink stores dz in 16 bits: the same values.
    std::vector<E> fused16(fused.size(), E{0xffff});
    const kc::UnpoolSink<Epi, Kp, E> unpool16(fused16.data(), below.pooled.data(), below.argmax.data(), below_g.out_h,
                                              below_g.out_w, true);
    emulate_gemm<kc::tile_for<64>, false>(kc::conv2d_dx_problem_to(s, batch, dz, w.data(), unpool16), 1);
    check_same_bits(widened(fused16), fused, "dx unpooled into 16 bits");
  }
  // Unfused, from an fp32 pooled gradient (the logits' gradient where the pooling is the network's output):
  // the pooling's input gradient rounded as it would be stored.
  kc::PooledConvGradient<Epi, Kp> from_fp32{dpool.data(), below.pooled.data(), below.argmax.data(),
                                            below_g.out_channels, below.ph, below.pw, true};
  check_same_bits(materialized(from_fp32, batch, below_g.out_channels, below_g.out_h, below_g.out_w),
                  below.dz_from(dpool_bf16), "dz of a fused max-pooling from an fp32 gradient");

  // ActivationSink: a Linear's dx GEMM above a Linear with Epi (and its y, z).
  const int in = 29, mid = 45, out = 17;
  const auto x = random_values(std::size_t(batch) * in, 90), w1 = random_values(std::size_t(mid) * in, 91);
  const auto b1 = random_values(std::size_t(mid), 92), w2 = random_values(std::size_t(out) * mid, 93);
  const auto dy2 = random_values(std::size_t(batch) * out, 94);
  std::vector<float> y(std::size_t(batch) * mid, nan_value), z(y.size(), nan_value);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_forward_problem<Epi>(batch, in, mid, w1.data(), b1.data(), x.data(), y.data(), z.data(), true), 1);
  const kc::EpilogueGradient<Epilogue<>> g2{dy2.data(), nullptr, nullptr};
  std::vector<float> dy(y.size(), nan_value), dz_fused(y.size(), nan_value);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_dx_problem_to(batch, mid, out, w2.data(), g2, kc::StoreSink{dy.data(), true}), 1);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_dx_problem_to(batch, mid, out, w2.data(), g2, kc::ActivationSink<Epi>{dz_fused.data(), y.data(), z.data(), true}),
      1);
  const kc::EpilogueGradient<Epi> g{dy.data(), y.data(), z.data()};
  std::vector<float> want(y.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = g(i);
  check_same_bits(dz_fused, want, "dz formed from the bf16 input gradient");
  if constexpr (std::is_same_v<E, fp::kernels::BFloat16>) {
    std::vector<E> dz16(y.size(), E{0xffff});
    emulate_gemm<kc::tile_for<64>, false>(
        kc::linear_dx_problem_to(batch, mid, out, w2.data(), g2, kc::ActivationSink<Epi, E>{dz16.data(), y.data(), z.data(), true}),
        1);
    check_same_bits(widened(dz16), want, "dz formed from the bf16 input gradient, stored in 16 bits");
    // The layer below reads it as it would read the fp32 dz: the same input and weight gradients.
    std::vector<float> dx32(std::size_t(batch) * in, nan_value), dx16(dx32.size(), nan_value);
    emulate_gemm<kc::tile_for<64>, false>(
        kc::linear_stored_dx_problem(batch, in, mid, w1.data(), dz_fused.data(), kc::StoreSink{dx32.data()}), 1);
    emulate_gemm<kc::tile_for<64>, false>(
        kc::linear_stored_dx_problem(batch, in, mid, w1.data(), dz16.data(), kc::StoreSink{dx16.data()}), 1);
    check_same_bits(dx16, dx32, "a Linear's dx from its dz in 16 bits");
    std::vector<float> dw32(std::size_t(mid) * in, nan_value), db32(mid, nan_value), dw16(dw32), db16(db32);
    const auto o32 = kc::linear_stored_dw_operands(batch, in, mid, dz_fused.data(), x.data());
    const auto o16 = kc::linear_stored_dw_operands(batch, in, mid, dz16.data(), x.data());
    emulate_weight_gradient<kc::tile_for<32>>(8, o32.m, o32.n, o32.k, o32.a, o32.b, dw32.data(), db32.data());
    emulate_weight_gradient<kc::tile_for<32>>(8, o16.m, o16.n, o16.k, o16.a, o16.b, dw16.data(), db16.data());
    check_same_bits(dw16, dw32, "a Linear's dW from its dz in 16 bits");
    check_same_bits(db16, db32, "a Linear's db from its dz in 16 bits");
  }
}

// --- stage outputs stored in 16 bits (CudaPlan::output_element) ----------------------------------------
// Under Bf16 the plan stores some group outputs as BFloat16 (net/cuda_plan.hpp). A writer told so stores
// the bits of the bf16 values it stores in fp32 with `bf16` set; a reader told its input is BFloat16
// (the GEMMs of the layer above, the sink that takes the derivative) computes from it what it computes
// from fp32 copies of the same values. Outputs are poisoned (NaN in either width) before each run.

using BF16 = fp::kernels::BFloat16;
constexpr BF16 nan_bf16{0xffff};

// A Linear reading x in 16 bits and writing y in 16 bits (GEMM epilogue, or both finishes of a split
// forward) against fp32 x and y; the weight gradient of the same layer from the 16-bit x.
template <class Epi, class TileT, int Out>
void check_linear_narrow(int batch, int in, int sm_count) {
  CAPTURE(batch);
  CAPTURE(in);
  auto x = random_values(std::size_t(batch) * in, 101);
  const auto x16 = gpu_test::stored_bf16(x);  // x now holds the bf16 values x16 stores
  const auto w = random_values(std::size_t(Out) * in, 102), b = random_values(std::size_t(Out), 103);
  const std::size_t n = std::size_t(batch) * Out;
  std::vector<float> y(n, nan_value), z(n, nan_value), z16(n, nan_value);
  std::vector<BF16> y16(n, nan_bf16);
  emulate_gemm<TileT, false>(kc::linear_forward_problem<Epi>(batch, in, Out, w.data(), b.data(), x.data(), y.data(),
                                                            z.data(), true),
                             1);
  emulate_gemm<TileT, false>(kc::linear_forward_problem<Epi>(batch, in, Out, w.data(), b.data(), x16.data(),
                                                            y16.data(), z16.data(), true),
                             1);
  check_same_bits(widened(y16), y, "linear y in 16 bits");
  if constexpr (Epi::saves_input) check_same_bits(z16, z, "linear z kept in fp32 beside a 16-bit y");

  // Split over `in` (the plan for few rows and a long reduction), finished by the GEMM's last blocks
  // (with counters) or by the flow's second pass (kc::LinearForwardSums, without).
  using Tiles = kc::GemmTiles<Out>;
  const kc::SplitPlan sp = kc::linear_forward_split<Tiles>(batch, in, Out, sm_count);
  REQUIRE(sp.splits > 1);
  std::vector<unsigned> arrivals(fp::Cuda::arrival_counter_count, 0u);
  const fp::ArrivalCounters counters{arrivals.data(), arrivals.size()};
  const auto split = [&](const fp::ArrivalCounters& a, const auto* xe, auto* ye, float* ze) {
    std::vector<float> scratch(kc::linear_forward_scratch<Tiles>(batch, in, Out, sm_count), nan_value);
    bool in_gemm = false;
    int passes = 0;
    kc::split_linear_forward<Epi, Tiles>(sm_count, batch, in, Out, w.data(), b.data(), xe, ye, ze,
                                         scratch.data(), a, true, [&](const auto& p, int splits) {
                                           if constexpr (requires { p.epi.reduction; }) in_gemm = p.epi.reduction.active();
                                           emulate_gemm<TileT, false>(p, splits);
                                         }, PassOnHost{&passes});
    CHECK(in_gemm == (a.data != nullptr));
    CHECK(passes == (a.data != nullptr ? 0 : 1));
  };
  std::vector<float> ys(n, nan_value), zs(n, nan_value), zs16(n, nan_value), zk16(n, nan_value);
  std::vector<BF16> ys16(n, nan_bf16), yk16(n, nan_bf16);
  split(counters, x.data(), ys.data(), zs.data());
  split(counters, x16.data(), ys16.data(), zs16.data());
  check_same_bits(widened(ys16), ys, "split linear y in 16 bits");
  if constexpr (Epi::saves_input) check_same_bits(zs16, zs, "split linear z kept in fp32 beside a 16-bit y");
  split(fp::ArrivalCounters{}, x16.data(), yk16.data(), zk16.data());
  check_same_bits(widened(yk16), ys, "split linear y in 16 bits by the second pass");
  std::vector<float> yk(n, nan_value), zk(n, nan_value);  // bf16 values in fp32 elements
  split(fp::ArrivalCounters{}, x.data(), yk.data(), zk.data());
  check_same_bits(yk, ys, "split linear y rounded to bf16 by the second pass");
  if constexpr (Epi::saves_input) check_same_bits(zk, zs, "split linear z by the second pass beside bf16 values");
  if constexpr (Epi::saves_input) check_same_bits(zk16, zs, "split linear z by the second pass beside a 16-bit y");

  // dW = dz^T x and db with x read in 16 bits (the stored dz fp32 here; its 16 bits are checked above).
  const auto dz = random_values(n, 104);
  std::vector<float> dw(std::size_t(Out) * in, nan_value), db(Out, nan_value), dw16(dw), db16(db);
  const auto o32 = kc::linear_stored_dw_operands(batch, in, Out, dz.data(), x.data());
  const auto o16 = kc::linear_stored_dw_operands(batch, in, Out, dz.data(), x16.data());
  emulate_weight_gradient<kc::tile_for<32>>(sm_count, o32.m, o32.n, o32.k, o32.a, o32.b, dw.data(), db.data());
  emulate_weight_gradient<kc::tile_for<32>>(sm_count, o16.m, o16.n, o16.k, o16.a, o16.b, dw16.data(), db16.data());
  check_same_bits(dw16, dw, "linear dW from x in 16 bits");
  check_same_bits(db16, db, "linear db beside x in 16 bits");
}

// A conv writing its output (or, with Kp > 1, its pooled values and argmax) in 16 bits from x in 16
// bits, against fp32.
template <class Epi, int Kp, class TileT>
void check_conv_narrow(const fp::kernels::ConvGeometry& g, int batch) {
  CAPTURE(batch);
  const kc::ConvShape s(g);
  auto x = random_values(batch * g.in_size(), 105);
  const auto x16 = gpu_test::stored_bf16(x);
  const auto w = random_values(g.out_channels * g.patch(), 106), b = random_values(std::size_t(g.out_channels), 107);
  const std::size_t n = batch * g.out_size();
  std::vector<float> y(n, nan_value), z(n, nan_value), z16(n, nan_value);
  std::vector<BF16> y16(n, nan_bf16);
  float* const zp = Epi::saves_input ? z.data() : nullptr;
  float* const zp16 = Epi::saves_input ? z16.data() : nullptr;
  emulate_gemm<TileT, false>(
      kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x.data(), y.data(), zp, nullptr, nullptr, true), 1);
  emulate_gemm<TileT, false>(
      kc::conv2d_forward_problem<Epi>(s, batch, w.data(), b.data(), x16.data(), y16.data(), zp16, nullptr, nullptr, true),
      1);
  check_same_bits(widened(y16), y, "conv y in 16 bits");
  if constexpr (Epi::saves_input) check_same_bits(z16, z, "conv z kept in fp32 beside a 16-bit y");
  if constexpr (Kp > 1) {
    const std::size_t pn = std::size_t(batch) * g.out_channels * (g.out_h / Kp) * (g.out_w / Kp);
    std::vector<float> pooled(pn, nan_value);
    std::vector<BF16> pooled16(pn, nan_bf16);
    std::vector<std::uint8_t> argmax(pn, 0xff), argmax16(pn, 0xff);
    emulate_gemm<TileT, false>(kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x.data(),
                                                                   pooled.data(), argmax.data(), true),
                               1);
    emulate_gemm<TileT, false>(kc::conv2d_maxpool_problem<Epi, Kp>(s, batch, w.data(), b.data(), x16.data(),
                                                                   pooled16.data(), argmax16.data(), true),
                               1);
    check_same_bits(widened(pooled16), pooled, "pooled values in 16 bits");
    CHECK(argmax16 == argmax);
  }
}

// The sinks reading the output of the stage below in 16 bits (Y = BFloat16) against reading fp32 copies:
// every element of dz the same, for dz stored as E (received_dz_element) either way.
template <class Epi, int Kp>
void check_sinks_read_narrow(const fp::kernels::ConvGeometry& below_g, int batch) {
  using E = kc::received_dz_element<fp::precision::Bf16, Epi>;
  const auto as_floats = [](const std::vector<E>& v) {
    if constexpr (std::is_same_v<E, BF16>) return widened(v);
    else return v;
  };
  const E poison = [] {
    if constexpr (std::is_same_v<E, BF16>) return nan_bf16;
    else return nan_value;
  }();
  // UnpoolSink: the pooled values of a conv + max-pool (rounded as a Bf16 model stores them).
  const PooledConvBelow<Epi, Kp> below(below_g, batch);
  std::vector<float> pooled = below.pooled;
  const auto pooled16 = gpu_test::stored_bf16(pooled);
  const auto v = random_values(pooled.size(), 108);
  std::vector<E> dz(below.dz_size(), poison), dz16(below.dz_size(), poison);
  const kc::UnpoolSink<Epi, Kp, E> wide(dz.data(), pooled.data(), below.argmax.data(), below_g.out_h, below_g.out_w, true);
  const kc::UnpoolSink<Epi, Kp, E, BF16> narrow(dz16.data(), pooled16.data(), below.argmax.data(), below_g.out_h,
                                                below_g.out_w, true);
  for (std::size_t i = 0; i < pooled.size(); ++i) {
    wide.put(i, v[i]);
    narrow.put(i, v[i]);
  }
  check_same_bits(as_floats(dz16), as_floats(dz), "dz unpooled from pooled values read in 16 bits");
  // ActivationSink: a Linear's output y (and z, fp32, where Epi saves it) stored with bf16.
  const int in = 23, out = 40;
  const auto x = random_values(std::size_t(batch) * in, 109), w = random_values(std::size_t(out) * in, 110);
  const auto b = random_values(std::size_t(out), 111);
  std::vector<float> y(std::size_t(batch) * out, nan_value), zl(y.size(), nan_value);
  emulate_gemm<kc::tile_for<64>, false>(
      kc::linear_forward_problem<Epi>(batch, in, out, w.data(), b.data(), x.data(), y.data(), zl.data(), true), 1);
  const auto y16 = gpu_test::stored_bf16(y);  // y holds bf16 values already: unchanged
  const auto g = random_values(y.size(), 112);
  std::vector<E> a(y.size(), poison), a16(y.size(), poison);
  const kc::ActivationSink<Epi, E> wide_a{a.data(), y.data(), zl.data(), true};
  const kc::ActivationSink<Epi, E, BF16> narrow_a{a16.data(), y16.data(), zl.data(), true};
  for (std::size_t i = 0; i < y.size(); ++i) {
    wide_a.put(i, g[i]);
    narrow_a.put(i, g[i]);
  }
  check_same_bits(as_floats(a16), as_floats(a), "dz formed from y read in 16 bits");
}

}  // namespace

TEST_CASE("bf16 storage: epilogues and sinks store the fp32 values rounded, the fused pooling the stored winners (CPU emulation)") {
  using kc::GemmTiles;
  check_linear_stores_bf16<Epilogue<Relu>, kc::tile_for<37>>(77, 45, 37);
  check_linear_stores_bf16<Epilogue<Gelu>, GemmTiles<64>::mma>(33, 45, 64);  // saves z
  check_split_linear_stores_bf16<Epilogue<Gelu>, kc::GemmTiles<72>::wmma, 72>(20, 1000, 132);
  check_split_linear_stores_bf16<Epilogue<Tanh>, kc::GemmTiles<72>::mma, 72>(20, 1000, 8);
  constexpr fp::kernels::ConvGeometry a{3, 11, 9, 3, 2, 1, 5, 6, 5};
  check_conv_stores_bf16<Epilogue<Relu>, kc::tile_for<5>>(a, 7);
  constexpr fp::kernels::ConvGeometry b{4, 10, 12, 5, 1, 0, 6, 6, 8};
  check_conv_stores_bf16<Epilogue<Gelu>, GemmTiles<6>::mma>(b, 5);
  // Enough windows that the rounding ties some: LeNet's conv1 + pool, a 4x4 pooling with a column left.
  constexpr fp::kernels::ConvGeometry lenet1{1, 28, 28, 5, 1, 0, 6, 24, 24};
  int changed = check_conv_maxpool_stores_bf16<Epilogue<Relu>, 2, kc::tile_for<6>>(lenet1, 16);
  constexpr fp::kernels::ConvGeometry wide{2, 17, 18, 2, 1, 0, 40, 16, 17};
  changed += check_conv_maxpool_stores_bf16<Epilogue<Tanh>, 4, GemmTiles<40>::mma>(wide, 6);
  MESSAGE(changed, " pooling windows whose winner the bf16 rounding changed");
  CHECK(changed > 0);  // the comparison of rounded values was exercised
  constexpr fp::kernels::ConvGeometry odd{3, 13, 11, 3, 1, 1, 7, 13, 11};
  check_sinks_store_bf16<Epilogue<Relu>, 2>(odd, 9, 4);
  check_sinks_store_bf16<Epilogue<>, 2>(odd, 4, 3);  // no activation: dz is the gradient itself
  check_sinks_store_bf16<Epilogue<Tanh>, 2>(odd, 5, 3);
  check_sinks_store_bf16<Epilogue<Gelu>, 2>(odd, 6, 2);  // saves z
}

TEST_CASE("16-bit stage outputs: writers store the bits of their bf16 values, readers compute from them what they compute from fp32 (CPU emulation)") {
  using kc::GemmTiles;
  // Linear: few rows and a long reduction, so the forward is split (as CIFAR's fc1's is); tiles and
  // epilogues of each kind.
  check_linear_narrow<Epilogue<Relu>, kc::GemmTiles<72>::wmma, 72>(20, 1000, 132);
  check_linear_narrow<Epilogue<Gelu>, kc::GemmTiles<72>::mma, 72>(20, 1000, 8);  // saves z
  check_linear_narrow<Epilogue<Tanh>, kc::GemmTiles<130>::mma, 130>(100, 600, 132);
  // Conv: plain and with max-pooling fused (2x2, and 4x4 with a column left).
  constexpr fp::kernels::ConvGeometry a{3, 11, 9, 3, 2, 1, 5, 6, 5};
  check_conv_narrow<Epilogue<Relu>, 1, kc::tile_for<5>>(a, 7);
  constexpr fp::kernels::ConvGeometry b{4, 10, 12, 5, 1, 0, 6, 6, 8};
  check_conv_narrow<Epilogue<Gelu>, 1, GemmTiles<6>::mma>(b, 5);
  constexpr fp::kernels::ConvGeometry lenet1{1, 28, 28, 5, 1, 0, 6, 24, 24};
  check_conv_narrow<Epilogue<Relu>, 2, kc::tile_for<6>>(lenet1, 6);
  constexpr fp::kernels::ConvGeometry wide{2, 17, 18, 2, 1, 0, 40, 16, 17};
  check_conv_narrow<Epilogue<Tanh>, 4, GemmTiles<40>::mma>(wide, 3);
  // The sinks: a mask derivative (dz in 16 bits too), Tanh (from y), GELU (from z and y).
  constexpr fp::kernels::ConvGeometry odd{3, 13, 11, 3, 1, 1, 7, 13, 11};
  check_sinks_read_narrow<Epilogue<Relu>, 2>(odd, 5);
  check_sinks_read_narrow<Epilogue<Tanh>, 2>(odd, 4);
  check_sinks_read_narrow<Epilogue<Gelu>, 2>(odd, 3);
}

TEST_CASE("split-K plans cover the reduction exactly once") {
  for (int sms : {1, 8, 132})
    for (int k : {1, 31, 128, 129, 1000, 4096, 123457})
      for (int m : {1, 64, 300})
        for (int n : {1, 16, 65}) {
          const kc::SplitPlan s = kc::plan_split(m, n, k, 64, 64, 32, sms);
          REQUIRE(s.splits >= 1);
          REQUIRE(s.k_chunk >= 1);
          if (s.splits > 1) REQUIRE(s.k_chunk % 32 == 0);
          REQUIRE(std::int64_t(s.splits) * s.k_chunk >= k);             // covers k
          REQUIRE(std::int64_t(s.splits - 1) * s.k_chunk < std::int64_t(k));  // no empty split
        }
}

// gemm_dispatch.cuh: which mainloop a layer's GEMM takes, and the split plans it follows (the choice
// is host code; what either kernel computes is checked above and in test_gpu_gemm_mma).
TEST_CASE("the mainloop switch: FUSEDP_CUDA_GEMM's values, and what falls back to WMMA") {
  CHECK(kc::parse_gemm_mainloop(nullptr) == kc::GemmMainloop::wmma);
  CHECK(kc::parse_gemm_mainloop("") == kc::GemmMainloop::wmma);
  CHECK(kc::parse_gemm_mainloop("wmma") == kc::GemmMainloop::wmma);
  CHECK(kc::parse_gemm_mainloop("mma") == kc::GemmMainloop::mma);
  // A build whose layers have the tensor-core mainloop (FUSEDP_CUDA_MMA_LAYERS=1) prefers it when unset.
  CHECK(kc::parse_gemm_mainloop(nullptr, kc::GemmMainloop::mma) == kc::GemmMainloop::mma);
  CHECK(kc::parse_gemm_mainloop("", kc::GemmMainloop::mma) == kc::GemmMainloop::mma);
  CHECK(kc::parse_gemm_mainloop("wmma", kc::GemmMainloop::mma) == kc::GemmMainloop::wmma);
  // Asking a build whose layers have only WMMA for mma is an error, not a silent WMMA run.
  CHECK(kc::checked_layer_mainloop(kc::GemmMainloop::wmma) == kc::GemmMainloop::wmma);
  if (kc::layers_have_mma) {
    CHECK(kc::checked_layer_mainloop(kc::GemmMainloop::mma) == kc::GemmMainloop::mma);
  } else {
    CHECK_THROWS_WITH_AS((void)kc::checked_layer_mainloop(kc::GemmMainloop::mma),
                         doctest::Contains("FUSEDP_CUDA_GEMM is 'mma', but this build's layers have only the WMMA mainloop"),
                         fp::InvalidArgument);
  }
  for (const char* bad : {"MMA", "tensor", "mma "}) {
    const std::string want = "FUSEDP_CUDA_GEMM is '" + std::string(bad) + "'; it must be 'wmma' or 'mma'";
    CHECK_THROWS_WITH_AS((void)kc::parse_gemm_mainloop(bad), doctest::Contains(want.c_str()), fp::InvalidArgument);
  }

  const kc::GemmTarget mma{nullptr, 132, {90, 232448}, kc::GemmMainloop::mma};
  kc::GemmTarget wmma = mma, turing = mma, ampere_small = mma;
  wmma.mainloop = kc::GemmMainloop::wmma;
  turing.device = {75, 65536};
  ampere_small.device = {86, 101376};  // 99 KiB a block: the largest MN-major tiles do not fit
  using Tf32 = fp::precision::Tf32;
  using Bf16 = fp::precision::Bf16;
  using Fp32 = fp::precision::Fp32;

  // A convolution's forward: the weights are copied 16 bytes a row, so a patch of 27 (3 channels, 3x3)
  // or 25 (LeNet's first layer) falls back; 288 (32 channels, 3x3) takes the tensor cores.
  for (const fp::kernels::ConvGeometry& g :
       {fp::kernels::ConvGeometry{3, 32, 32, 3, 1, 1, 32, 32, 32}, fp::kernels::ConvGeometry{1, 28, 28, 5, 1, 0, 6, 24, 24},
        fp::kernels::ConvGeometry{32, 16, 16, 3, 1, 1, 64, 16, 16}}) {
    CAPTURE(g.patch());
    const int batch = 4;
    const std::vector<float> w(g.out_channels * g.patch()), b(g.out_channels), x(batch * g.in_size()),
        dz(batch * g.out_size());
    std::vector<float> y(batch * g.out_size());
    const kc::ConvShape s(g);
    const auto fwd = kc::conv2d_forward_problem<Epilogue<Relu>>(s, batch, w.data(), b.data(), x.data(), y.data(), nullptr);
    const bool aligned = g.patch() % 4 == 0;
    CHECK(kc::takes_mma<kc::mma::MmaTile128x64, Tf32>(fwd, mma) == aligned);
    CHECK(kc::takes_mma<kc::mma::MmaTile128x64, Bf16>(fwd, mma) == aligned);
    CHECK_FALSE(kc::takes_mma<kc::mma::MmaTile128x64, Fp32>(fwd, mma));  // exact fp32 stays on FFMA
    CHECK_FALSE(kc::takes_mma<kc::mma::MmaTile128x64, Tf32>(fwd, wmma));
    CHECK_FALSE(kc::takes_mma<kc::mma::MmaTile128x64, Tf32>(fwd, turing));
    // dx and dW gather 4 bytes at a time: any geometry runs, on a device with the shared memory.
    const kc::StoredGradient sd{dz.data(), s.o, s.ohw, s.ow};
    const auto dxp = kc::conv2d_dx_problem(s, batch, sd, w.data(), nullptr);
    CHECK(kc::takes_mma<kc::mma::MmaTile128x16, Tf32>(dxp, mma));
    CHECK(kc::takes_mma<kc::mma::MmaTile128x16, Tf32>(dxp, ampere_small));
    CHECK_FALSE(kc::takes_mma<kc::mma::MmaTile128x16, Tf32>(dxp, turing));
  }

  // A Linear layer's forward reads rows of x and W: in = 75 floats a row is not 16-byte aligned.
  for (int in : {64, 75, 8192}) {
    CAPTURE(in);
    const int batch = 8, out = 96;
    const std::vector<float> w(std::size_t(out) * in), b(out), x(std::size_t(batch) * in);
    std::vector<float> y(std::size_t(batch) * out);
    const auto fwd = kc::linear_forward_problem<Epilogue<Relu>>(batch, in, out, w.data(), b.data(), x.data(), y.data(), nullptr);
    CHECK(kc::takes_mma<kc::mma::MmaTile128x128, Tf32>(fwd, mma) == (in % 4 == 0));
  }
}

TEST_CASE("the split reduction switch: FUSEDP_CUDA_SPLIT_REDUCTION's values") {
  CHECK(kc::parse_split_reduction(nullptr) == kc::SplitReduction::automatic);
  CHECK(kc::parse_split_reduction("") == kc::SplitReduction::automatic);
  CHECK(kc::parse_split_reduction("auto") == kc::SplitReduction::automatic);
  CHECK(kc::parse_split_reduction("gemm") == kc::SplitReduction::gemm);
  CHECK(kc::parse_split_reduction("kernel") == kc::SplitReduction::kernel);
  for (const char* bad : {"GEMM", "second", "kernel ", "automatic"}) {
    const std::string want =
        "FUSEDP_CUDA_SPLIT_REDUCTION is '" + std::string(bad) + "'; it must be 'auto', 'gemm' or 'kernel'";
    CHECK_THROWS_WITH_AS((void)kc::parse_split_reduction(bad), doctest::Contains(want.c_str()), fp::InvalidArgument);
  }
}

// A stream's arrival counters in host memory, for split GEMMs whose blocks are emulated: without a limit
// on the last block's chain (FUSEDP_CUDA_SPLIT_REDUCTION=gemm), or with one.
namespace {
struct HostCounters {
  std::vector<unsigned> counters = std::vector<unsigned>(fp::Cuda::arrival_counter_count, 0u);
  [[nodiscard]] fp::ArrivalCounters unlimited() { return {counters.data(), counters.size()}; }
  [[nodiscard]] fp::ArrivalCounters limited(int trips) {
    fp::ArrivalCounters a = unlimited();
    a.reduction_trip_limit = trips;
    return a;
  }
  [[nodiscard]] bool all_zero() const {
    return std::count(counters.begin(), counters.end(), 0u) == std::ptrdiff_t(counters.size());
  }
};
}  // namespace

// Who adds up a split GEMM's parts by default: its last block per tile only where the chain of round
// trips to L2 that takes (tile_reduction_trips) is at most split_tile_reduction_trips (one block walking
// a chain of hundreds alone would hold the GPU for tens of microseconds), else a second kernel; with
// counters that set no limit (FUSEDP_CUDA_SPLIT_REDUCTION=gemm) always the last block; without counters
// never.
TEST_CASE("a split GEMM's last block adds up its tile's parts only where the chain is short") {
  // The chains by hand: the busiest thread's runs of four columns (ceil(rows x bn/4 / threads)), one
  // chain a run where n is a multiple of 4 else one a column (at most 4), one more for the row sums;
  // each chain splits/4 + splits%4 round trips.
  CHECK(kc::tile_reduction_trips<kc::TileWide>(8, 8, 8, true) == (1 + 1) * 2);
  CHECK(kc::tile_reduction_trips<kc::TileWide>(8, 8, 32, false) == 1 * 8);
  CHECK(kc::tile_reduction_trips<kc::TileWide>(8, 8, 33, false) == 1 * (8 + 1));
  CHECK(kc::tile_reduction_trips<kc::TileTall16>(128, 2, 8, false) == 4 * 2 * 2);  // two columns: two chains a run
  // LeNet at batch 128: conv1's weight gradient (6 x 25 in 256 parts: one run of 4 columns and the bias),
  // conv2's (16 x 54 in 100: two runs), fc1's forward (128 x 120 in 3: eight 16-byte runs).
  CHECK(kc::tile_reduction_trips<kc::tile_for<25>>(6, 25, 256, true) == (4 + 1) * 64);
  CHECK(kc::tile_reduction_trips<kc::tile_for<54>>(16, 54, 100, true) == (2 * 4 + 1) * 25);
  CHECK(kc::tile_reduction_trips<kc::tile_for<120>>(128, 120, 3, false) == 8 * 3);
  // The CIFAR-10 CNN: conv1's weight gradient (64 x 27 in 256) on either mainloop's tile, conv2's (128 x
  // 576 in 15 on WMMA's plan, 52 on the tensor-core one), fc1's forward (128 x 1024 in 9), fc2's (128 x
  // 10 in 8).
  CHECK(kc::tile_reduction_trips<kc::tile_for<27>>(64, 27, 256, true) == (4 * 4 + 1) * 64);
  CHECK(kc::tile_reduction_trips<kc::mma::mma_tile_for<27>>(64, 27, 256, true) == (2 * 4 + 1) * 64);
  CHECK(kc::tile_reduction_trips<kc::tile_for<576>>(128, 576, 15, true) == (8 + 1) * 6);
  CHECK(kc::tile_reduction_trips<kc::mma::mma_tile_for<576>>(128, 576, 52, true) == (16 + 1) * 13);
  CHECK(kc::tile_reduction_trips<kc::tile_for<1024>>(128, 1024, 9, false) == 8 * 3);
  CHECK(kc::tile_reduction_trips<kc::mma::mma_tile_for<1024>>(128, 1024, 9, false) == 16 * 3);
  CHECK(kc::tile_reduction_trips<kc::tile_for<10>>(128, 10, 8, false) == 4 * 4 * 2);

  HostCounters c;
  const fp::ArrivalCounters unlimited = c.unlimited();
  const auto limit = [&](int trips) { return c.limited(trips); };
  const fp::ArrivalCounters layers = limit(kc::split_tile_reduction_trips);
  // The limit itself is allowed, one round trip less is not; no counters, never.
  CHECK(kc::reduces_in_gemm<kc::TileWide>(limit(4), 8, 8, 8, true));
  CHECK(!kc::reduces_in_gemm<kc::TileWide>(limit(3), 8, 8, 8, true));
  CHECK(kc::reduces_in_gemm<kc::TileWide>(layers, 8, 8, 8, true));
  CHECK(!kc::reduces_in_gemm<kc::TileWide>(fp::ArrivalCounters{}, 8, 8, 8, true));
  // Every split of the target networks at batch 128 takes the second kernel by default, and the GEMM's
  // last block without a limit.
  const auto second_kernel = [&](auto tile, int m, int n, int splits, bool row_sums) {
    using TileT = decltype(tile);
    CAPTURE(m);
    CAPTURE(n);
    CAPTURE(splits);
    CHECK(!kc::reduces_in_gemm<TileT>(layers, m, n, splits, row_sums));
    CHECK(kc::reduces_in_gemm<TileT>(unlimited, m, n, splits, row_sums));
  };
  second_kernel(kc::tile_for<25>{}, 6, 25, 256, true);
  second_kernel(kc::tile_for<54>{}, 16, 54, 100, true);
  second_kernel(kc::tile_for<120>{}, 128, 120, 3, false);
  second_kernel(kc::tile_for<27>{}, 64, 27, 256, true);
  second_kernel(kc::mma::mma_tile_for<27>{}, 64, 27, 256, true);
  second_kernel(kc::tile_for<576>{}, 128, 576, 15, true);
  second_kernel(kc::mma::mma_tile_for<576>{}, 128, 576, 52, true);
  second_kernel(kc::tile_for<1024>{}, 128, 1024, 9, false);
  second_kernel(kc::tile_for<10>{}, 128, 10, 8, false);
  // The splits those chains assumed are plan_split's and linear_forward_split's for 132 SMs.
  constexpr int sms = 132;
  const auto splits_of = [](auto tile, int m, int n, int k) {
    using TileT = decltype(tile);
    return kc::plan_split(m, n, k, TileT::bm, TileT::bn, TileT::bk, sms).splits;
  };
  CHECK(splits_of(kc::tile_for<25>{}, 6, 25, 128 * 24 * 24) == 256);
  CHECK(splits_of(kc::tile_for<54>{}, 16, 54, 128 * 10 * 10) == 100);
  CHECK(splits_of(kc::tile_for<27>{}, 64, 27, 128 * 32 * 32) == 256);
  CHECK(splits_of(kc::mma::mma_tile_for<27>{}, 64, 27, 128 * 32 * 32) == 256);
  CHECK(splits_of(kc::tile_for<576>{}, 128, 576, 128 * 16 * 16) == 15);
  CHECK(splits_of(kc::mma::mma_tile_for<576>{}, 128, 576, 128 * 16 * 16) == 52);
  CHECK(kc::linear_forward_split<kc::GemmTiles<120>>(128, 400, 120, sms).splits == 3);
  CHECK(kc::linear_forward_split<kc::GemmTiles<1024>>(128, 8192, 1024, sms).splits == 9);
  CHECK(kc::linear_forward_split<kc::GemmTiles<10>>(128, 1024, 10, sms).splits == 8);
  // Where the two mainloops' tiles differ, both are asked: fc1's forward is 24 round trips on WMMA's
  // tile, 48 on the tensor-core one.
  CHECK(kc::reduces_in_gemm<kc::tile_for<1024>>(limit(24), 128, 1024, 9, false));
  CHECK(!kc::reduces_in_gemm<kc::tile_for<1024>, kc::mma::mma_tile_for<1024>>(limit(24), 128, 1024, 9, false));
}

// The wiring: a split weight gradient and a split Linear forward hand their tiles to the GEMM's last
// block exactly when reduces_in_gemm says so. The GEMM "launch" records whether its problem carries an
// active reduction and stops the flow there, before a second kernel would be launched (no device here),
// so both answers are observed, at the limit and one round trip under it.
TEST_CASE("split GEMMs hand their tiles to the last block exactly when reduces_in_gemm says so") {
  struct Stop {};
  HostCounters c;
  const fp::ArrivalCounters unlimited = c.unlimited();
  const auto limit = [&](int trips) { return c.limited(trips); };
  constexpr int sms = 132;
  float dummy = 0;  // never read: the flow stops at the GEMM
  const auto weight_gradient = [&](int m, int n, int k, const fp::ArrivalCounters& a) {
    bool in_gemm = false, split = false;
    const auto stop = [&](const auto& p, int splits) {
      in_gemm = p.epi.reduction.active();
      split = splits > 1;
      throw Stop{};
    };
    CHECK_THROWS_AS((kc::split_weight_gradient<kc::tile_for<64>>(sms, m, n, k, kc::Columns{&dummy, m},
                                                                 kc::Columns{&dummy, n}, &dummy, &dummy, &dummy, {}, a,
                                                                 stop, PassOnHost{})),
                    Stop);
    CHECK(split);
    return in_gemm;
  };
  // 8 x 8 over 1024: 8 parts, one run and the row sums, 4 round trips.
  CHECK(weight_gradient(8, 8, 1024, limit(4)));
  CHECK(!weight_gradient(8, 8, 1024, limit(3)));
  CHECK(weight_gradient(8, 8, 1024, limit(kc::split_tile_reduction_trips)));
  CHECK(!weight_gradient(64, 27, 128 * 32 * 32, limit(kc::split_tile_reduction_trips)));
  CHECK(weight_gradient(64, 27, 128 * 32 * 32, unlimited));

  const auto linear_forward = [&]<int Out>(std::integral_constant<int, Out>, int batch, int in,
                                           const fp::ArrivalCounters& a) {
    bool in_gemm = false, split = false;
    const auto stop = [&](const auto& p, int splits) {
      if constexpr (requires { p.epi.reduction; }) in_gemm = p.epi.reduction.active();
      split = splits > 1;
      throw Stop{};
    };
    CHECK_THROWS_AS((kc::split_linear_forward<Epilogue<Relu>, kc::GemmTiles<Out>>(
                        sms, batch, in, Out, &dummy, &dummy, &dummy, &dummy, nullptr, &dummy, a, false, stop,
                        PassOnHost{})),
                    Stop);
    CHECK(split);
    return in_gemm;
  };
  const std::integral_constant<int, 10> fc2;
  const std::integral_constant<int, 1024> fc1;
  // The CIFAR-10 CNN's fc2 forward: 32 round trips on WMMA's tile (16 on the tensor-core one).
  CHECK(linear_forward(fc2, 128, 1024, limit(32)));
  CHECK(!linear_forward(fc2, 128, 1024, limit(31)));
  CHECK(!linear_forward(fc2, 128, 1024, limit(kc::split_tile_reduction_trips)));
  CHECK(!linear_forward(fc1, 128, 8192, limit(kc::split_tile_reduction_trips)));
  CHECK(linear_forward(fc1, 128, 8192, unlimited));
  // The tiles asked are the ones that may run: the tensor-core tile's 48 round trips only where the
  // layers have it.
  CHECK(linear_forward(fc1, 128, 8192, limit(24)) == !kc::layers_have_mma);
  CHECK(c.all_zero());
}

// Every number of loads in flight gives the same sums: the adds are in split order whatever InFlight is,
// so the second kernels (split_sums_in_flight) and the GEMM's last blocks (4) give the same bits.
TEST_CASE("split sums: the same bits with any number of loads in flight") {
  const std::size_t stride = 12;
  const auto parts = random_values(stride * 41, 63);
  for (int splits = 1; splits <= 41; ++splits) {
    CAPTURE(splits);
    for (std::size_t i : {std::size_t(0), std::size_t(4), std::size_t(8)}) {
      const auto a = kc::split_sums<1, 4>(parts.data(), splits, stride, i);
      const auto b = kc::split_sums<1, kc::split_sums_in_flight>(parts.data(), splits, stride, i);
      const auto c = kc::split_sums<4, kc::split_sums_in_flight>(parts.data(), splits, stride, i);
      const auto d = kc::split_sums<4, 4>(parts.data(), splits, stride, i);
      float serial = 0;
      for (int z = 0; z < splits; ++z) serial += parts[std::size_t(z) * stride + i];
      CHECK(std::memcmp(&a.v[0], &serial, sizeof(float)) == 0);
      CHECK(std::memcmp(&b.v[0], &serial, sizeof(float)) == 0);
      CHECK(std::memcmp(&c.v[0], &d.v[0], 4 * sizeof(float)) == 0);
      CHECK(std::memcmp(&c.v[0], &serial, sizeof(float)) == 0);
    }
  }
}

TEST_CASE("weight gradients on the tensor-core mainloop: whole-slice splits, scratch for either plan") {
  using TileW = kc::TileWide;
  using TileM = kc::mma::MmaTile128x128;
  const kc::MmaDevice h200{90, 232448};
  // dW (m x n) = dz^T x over k = the batch (or batch x pixels): Linear and conv shapes of the examples.
  struct Shape {
    int m, n, k_per_sample;
  };
  for (const Shape sh : {Shape{1024, 8192, 1}, Shape{10, 1024, 1}, Shape{64, 288, 256}, Shape{512, 4608, 16},
                         Shape{128, 576, 64}, Shape{6, 25, 576}})
    for (int batch : {1, 3, 64, 128, 256, 1000})
      for (int sms : {1, 108, 132}) {
        CAPTURE(sh.m);
        CAPTURE(sh.n);
        CAPTURE(batch);
        CAPTURE(sms);
        const int k = batch * sh.k_per_sample;
        const kc::SplitPlan pm = kc::plan_split(sh.m, sh.n, k, TileM::bm, TileM::bn, TileM::bk, sms);
        const kc::SplitPlan pw = kc::plan_split(sh.m, sh.n, k, TileW::bm, TileW::bn, TileW::bk, sms);
        // The plan the target follows splits where the tensor-core mainloop can run it ...
        const std::vector<float> a(4), b(4);
        const kc::GemmProblem<kc::Columns, kc::Columns, kc::StoreRowMajor> p{
            sh.m, sh.n, k, pm.k_chunk, kc::Columns{a.data(), sh.m + (4 - sh.m % 4) % 4},
            kc::Columns{b.data(), sh.n + (4 - sh.n % 4) % 4}, {}, nullptr};
        CHECK(kc::gemm_mma_can_run<TileM>(p, h200));
        // ... and the scratch holds the partial products of either plan.
        const std::size_t scratch = kc::weight_gradient_scratch_on<TileW, TileM>(sh.m, sh.n, k, sms);
        for (const kc::SplitPlan& s : {pm, pw})
          if (s.splits > 1) CHECK(scratch >= std::size_t(s.splits) * (std::size_t(sh.m) * sh.n + sh.m));
      }
}

// A model reserves its scratch once, for the largest batch it has seen (Model::reserve), and then runs
// any smaller batch in it: an epoch's last batch, a Parallel replica's micro-batches. A split-K plan
// gives fewer rows more splits, so the floats a stage needs are not monotonic in the batch; the scratch
// must be the most over every batch up to the reserved one (CudaGroups::scratch_elements), not the need
// at that batch, or the smaller batch's partial sums run past the buffer on the device.
template <class Net>
void check_scratch_serves_smaller_batches(int reserved, bool expect_dip) {
  using Groups = fp::CudaGroups<Net, fp::precision::Tf32>;
  for (const int sms : {1, 108, 132}) {
    CAPTURE(sms);
    const std::size_t scratch = Groups::scratch_elements(sms, std::size_t(reserved));
    const std::size_t at_reserved = Groups::scratch_elements_at(sms, std::size_t(reserved));
    int dips = 0;
    for (int b = 1; b <= reserved; ++b) {
      CAPTURE(b);
      const std::size_t need = Groups::scratch_elements_at(sms, std::size_t(b));
      CHECK(need <= scratch);
      dips += need > at_reserved;
    }
    CHECK(scratch >= at_reserved);
    // The case that makes this test matter: some smaller batch needs more than the reserved one.
    if (expect_dip && sms == 132) {
      MESSAGE(dips, " batches below ", reserved, " need more scratch than ", reserved, " itself (", at_reserved,
              " floats) on 132 SMs; reserved ", scratch);
      CHECK(dips > 0);
    }
  }
}

TEST_CASE("a model's scratch serves every batch up to the one it reserved for") {
  // Linear 4096 -> 1024 splits its forward over `in`: 9 splits at batch 100, 16 at 60 (132 SMs).
  using WideLinear = fp::Sequential<fp::Input<4096>, fp::Linear<1024>, fp::ReLU, fp::Linear<10>>;
  check_scratch_serves_smaller_batches<WideLinear>(100, true);
  check_scratch_serves_smaller_batches<WideLinear>(256, false);
  using Cnn = fp::Sequential<fp::Input<3, 32, 32>, fp::Conv2d<32, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                             fp::Conv2d<64, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<1024>,
                             fp::ReLU, fp::Linear<10>>;
  check_scratch_serves_smaller_batches<Cnn>(128, false);
}
