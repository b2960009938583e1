#pragma once
// Linear on Cuda: y = Epi(x W^T + b) with x (batch, in), W (out, in) as PyTorch, as one GEMM whose
// epilogue adds the bias and applies the activation; when the (batch, out) grid has too few tiles to
// fill the GPU (a small batch through a wide layer), the reduction is split over blocks and the last
// block of each tile sums the parts in a fixed order and applies bias and activation (a second kernel
// does, where the stream has no arrival counters or the last block's chain of loads would be over their
// limit: reduces_in_gemm). Backward as two GEMMs that
// load dz = dy * Epi' on the fly (dz is never stored), the weight-gradient GEMM also summing the bias
// gradient; where dy already holds dz (no activation, or the stage above wrote dz through a sink:
// gradient_sink.cuh), both read it as plain rows and columns, which the tensor-core mainloop copies.
// The input gradient goes to a sink too, so the stage below can receive its dz from this GEMM. `bf16`:
// y is stored as bf16 values (kernels::stored_value; the input gradient's sink says so for dx).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/gemm_dispatch.cuh"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/cuda/gradient_sink.cuh"

#include <cstddef>

namespace fusedp::kernels::cuda {

/// The gradient before an epilogue, dz = dy * Epi'(z, y), at a flat index: what a backward GEMM loads
/// in place of dy. z is read only when the epilogue saved it (Epi::saves_input).
template <class Epi>
struct EpilogueGradient {
  const float* dy;
  const float* y;
  const float* z;
  FUSEDP_HD float operator()(std::size_t i) const {
    if constexpr (Epi::empty) return dy[i];
    else if constexpr (Epi::saves_input) return dy[i] * Epi::derivative(z[i], y[i]);
    else return dy[i] * Epi::derivative(y[i], y[i]);
  }
};

/// dz (batch, out) as rows: at(b, o).
template <class Epi>
struct GradientRows {
  EpilogueGradient<Epi> g;
  int ld;
  static constexpr bool k_fastest = true;
  FUSEDP_HD float at(int r, int k) const { return g(std::size_t(r) * ld + k); }
};

/// dz (batch, out) as columns: at(o, b).
template <class Epi>
struct GradientColumns {
  EpilogueGradient<Epi> g;
  int ld;
  static constexpr bool k_fastest = false;
  FUSEDP_HD float at(int r, int k) const { return g(std::size_t(k) * ld + r); }
};

/// Epilogue of a Linear forward: y (m, n) = Epi(C + b), z = C + b when the epilogue saves it. Y: y's
/// element (float, or BFloat16 where the plan stores this output in 16 bits); z is fp32.
template <class Epi, class Y = float>
struct BiasActivationRows {
  Y* y;
  float* z;
  const float* bias;
  int m, n;
  bool bf16 = false;
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int /*split*/, int tid) const {
    for_each_in_tile<TileT, false>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      const float v = c[lm * ldc + ln] + bias[gn];
      const std::size_t i = std::size_t(gm) * n + gn;
      if constexpr (Epi::saves_input) z[i] = v;
      store_element(y + i, stored_value(Epi::apply(v), bf16));
    });
  }
};

/// The GEMM of a Linear forward: C (batch, out) = x (batch, in) W^T, epilogue bias + Epi. X, Y: x's and
/// y's stored elements.
template <class Epi, class X, class Y>
GemmProblem<RowsOf<X>, Rows, BiasActivationRows<Epi, Y>> linear_forward_problem(int batch, int in, int out,
                                                                                 const float* w, const float* b,
                                                                                 const X* x, Y* y, float* z,
                                                                                 bool bf16 = false) {
  return {batch, out, in, in, RowsOf<X>{x, in}, Rows{w, in}, BiasActivationRows<Epi, Y>{y, z, b, batch, out, bf16},
          nullptr};
}

/// Epilogue of an input gradient (m, n) row-major: the sink receives C at index row * n + col.
template <class Sink>
struct SinkRowMajor {
  Sink sink;
  int m, n;
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int /*split*/, int tid) const {
    for_each_in_tile<TileT, false>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      sink.put(std::size_t(gm) * n + gn, c[lm * ldc + ln]);
    });
  }
};

/// The GEMM of a Linear's input gradient: dx (batch, in) = dz (batch, out) W (out, in), dz formed as
/// it is loaded, each value to `sink`.
template <class Epi, class Sink>
GemmProblem<GradientRows<Epi>, Columns, SinkRowMajor<Sink>> linear_dx_problem_to(int batch, int in, int out,
                                                                                  const float* w,
                                                                                  const EpilogueGradient<Epi>& g,
                                                                                  const Sink& sink) {
  return {batch, in, out, out, GradientRows<Epi>{g, out}, Columns{w, in}, SinkRowMajor<Sink>{sink, batch, in}, nullptr};
}
/// linear_dx_problem_to storing dx.
template <class Epi>
GemmProblem<GradientRows<Epi>, Columns, SinkRowMajor<StoreSink>> linear_dx_problem(int batch, int in, int out,
                                                                                   const float* w,
                                                                                   const EpilogueGradient<Epi>& g,
                                                                                   float* dx) {
  return linear_dx_problem_to(batch, in, out, w, g, StoreSink{dx});
}
/// The input-gradient GEMM from dz stored (batch, out) as E (float, or BFloat16 where a sink stored it
/// in 16 bits): plain rows, which the tensor-core mainloop copies.
template <class Sink, class E>
GemmProblem<RowsOf<E>, Columns, SinkRowMajor<Sink>> linear_stored_dx_problem(int batch, int in, int out,
                                                                             const float* w, const E* dz,
                                                                             const Sink& sink) {
  return {batch, in, out, out, RowsOf<E>{dz, out}, Columns{w, in}, SinkRowMajor<Sink>{sink, batch, in}, nullptr};
}

/// The operands of a weight-gradient GEMM: dW (m, n) = sum over k of a(m, k) b(n, k).
template <class A, class B>
struct WeightGradientOperands {
  int m, n, k;
  A a;
  B b;
};

/// dW (out, in) = dz^T x: a(o, b) = dz by columns, b(i, b) = x (stored as X) by columns; the row sums
/// of a are db.
template <class Epi, class X>
WeightGradientOperands<GradientColumns<Epi>, ColumnsOf<X>> linear_dw_operands(int batch, int in, int out,
                                                                              const EpilogueGradient<Epi>& g,
                                                                              const X* x) {
  return {out, in, batch, GradientColumns<Epi>{g, out}, ColumnsOf<X>{x, in}};
}

/// dW (out, in) = dz^T x from dz stored (batch, out) as E, x as X: a(o, b) and b(i, b) both plain
/// columns (tensor-core copies); the row sums of a are db.
template <class E, class X>
WeightGradientOperands<ColumnsOf<E>, ColumnsOf<X>> linear_stored_dw_operands(int batch, int in, int out, const E* dz,
                                                                             const X* x) {
  return {out, in, batch, ColumnsOf<E>{dz, out}, ColumnsOf<X>{x, in}};
}

/// y[i + c] (and z[i + c], before Epi) of a split Linear forward (batch x n, row-major), c < L: the parts
/// summed in split order (split_sums), plus the bias, then Epi. Both halves that may finish a split
/// forward call it, so they give the same bits. Y: y's stored element.
template <class Epi, int L = 1, int InFlight = 4, class Y>
FUSEDP_HD FUSEDP_ALWAYS_INLINE void finish_linear_sums(const float* partial, int splits, std::size_t count,
                                                       std::size_t i, int n, const float* bias, Y* y, float* z,
                                                       bool bf16) {
  const Lanes<L> s = split_sums<L, InFlight>(partial, splits, count, i);
  const std::size_t col = i % std::size_t(n);  // a run of L never crosses a row (n % L == 0)
  for (int c = 0; c < L; ++c) {
    const float v = s.v[c] + bias[col + c];
    if constexpr (Epi::saves_input) z[i + c] = v;
    store_element(y + i + c, stored_value(Epi::apply(v), bf16));
  }
}

/// The second half of a split Linear forward done by the GEMM's own blocks (as SplitTileReduction does
/// for a weight gradient): the last split of a tile to finish (counted in `arrivals`, one counter per
/// output tile, zero before the launch and set back to zero) finishes the tile's elements with
/// finish_linear_sums, four at a time where it can. One launch fewer per split forward (the CIFAR-10
/// CNN's fc1). Y: y's stored element.
template <class Epi, class Y = float>
struct LinearForwardReduction {
  unsigned* arrivals = nullptr;
  int splits = 1;
  const float* bias = nullptr;
  Y* y = nullptr;
  float* z = nullptr;  // written only when Epi saves its input
  bool bf16 = false;
  [[nodiscard]] FUSEDP_HD bool active() const { return arrivals != nullptr; }
  template <class TileT>
  FUSEDP_HD void reduce_tile(const float* partial, int m, int n, int m0, int n0, int tid) const {
    const std::size_t count = std::size_t(m) * n;
    for_each_run_in_tile<TileT>(tid, m0, n0, m, n, runs_of_four(partial, n, count), [&](int gm, int gn, auto lanes) {
      finish_linear_sums<Epi, decltype(lanes)::value>(partial, splits, count, std::size_t(gm) * n + gn, n, bias, y, z,
                                                     bf16);
    });
  }
};

/// The second half of a split Linear forward as a pass of its own (linear_forward_reduce_kernel, where
/// reduces_in_gemm says no): finish_linear_sums for element i of y (and z). Host code may call it
/// (tests/gpu/emulation.cu runs the pass element by element). Y: y's stored element.
template <class Epi, class Y>
struct LinearForwardSums {
  const float* partial = nullptr;
  int splits = 1;
  std::size_t count = 0;  // elements of y: batch x n
  int n = 0;
  const float* bias = nullptr;
  Y* y = nullptr;
  float* z = nullptr;  // written only when Epi saves its input
  bool bf16 = false;

  [[nodiscard]] FUSEDP_HD std::size_t size() const { return count; }
  FUSEDP_HD void operator()(std::size_t i) const {
    finish_linear_sums<Epi, 1, split_sums_in_flight>(partial, splits, count, i, n, bias, y, z, bf16);
  }
};

/// LinearForwardSums over its elements, grid-stride.
template <class Pass>
__global__ void linear_forward_reduce_kernel(Pass pass) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < pass.size(); i += grid_stride()) pass(i);
}

/// Launches linear_forward_reduce_kernel over `pass` on `stream` (PassOnStream).
template <class Epi, class Y>
void launch_pass(const LinearForwardSums<Epi, Y>& pass, cudaStream_t stream) {
  launch<linear_forward_reduce_kernel<LinearForwardSums<Epi, Y>>>(
      "linear_forward_reduce_kernel", elementwise_blocks(pass.size()), elementwise_threads, 0, stream, pass);
}

/// The split of linear_forward (WMMA's tile's plan, whichever mainloop runs it: its parts are whole
/// 32-deep slices, so the tensor-core mainloop can run them too).
template <class Tiles>
SplitPlan linear_forward_split(int batch, int in, int out, int sm_count) {
  using T = typename Tiles::wmma;
  return plan_split(batch, out, in, T::bm, T::bn, T::bk, sm_count);
}

/// Scratch (floats) of linear_forward: the split parts, when the forward is split.
template <class Tiles>
std::size_t linear_forward_scratch(int batch, int in, int out, int sm_count) {
  const SplitPlan s = linear_forward_split<Tiles>(batch, in, out, sm_count);
  return s.splits == 1 ? 0 : std::size_t(s.splits) * std::size_t(batch) * std::size_t(out);
}

/// The flow of linear_forward with the GEMM launched by `run_gemm(problem, splits)`: one GEMM with bias
/// and Epi in its epilogue when the plan does not split (or there is no scratch), else the parts into
/// `scratch`, finished by the GEMM's last block per tile where reduces_in_gemm says so for either
/// mainloop's grid, else by the LinearForwardSums pass `run_pass(pass)` runs (on a device: PassOnStream,
/// linear_forward_reduce_kernel). Shared by linear_forward and tests/gpu/emulation.cu, which runs the
/// blocks and the pass on the host. X, Y: x's and y's stored elements.
template <class Epi, class Tiles, class X, class Y, class Launch, class Pass>
void split_linear_forward(int sm_count, int batch, int in, int out, const float* w, const float* b, const X* x, Y* y,
                          float* z, float* scratch, const ArrivalCounters& arrivals, bool bf16, Launch&& run_gemm,
                          Pass&& run_pass) {
  const SplitPlan s = linear_forward_split<Tiles>(batch, in, out, sm_count);
  if (s.splits == 1 || scratch == nullptr) {
    run_gemm(linear_forward_problem<Epi>(batch, in, out, w, b, x, y, z, bf16), 1);
    return;
  }
  const std::size_t count = std::size_t(batch) * out;
  // The tiles that may run: WMMA's, and the tensor-core one where the layers have it.
  const bool in_kernel = [&] {
    if constexpr (layers_have_mma)
      return reduces_in_gemm<typename Tiles::wmma, typename Tiles::mma>(arrivals, batch, out, s.splits, false);
    else
      return reduces_in_gemm<typename Tiles::wmma>(arrivals, batch, out, s.splits, false);
  }();
  PartialsRowMajor<LinearForwardReduction<Epi, Y>> parts{scratch, batch, out, count};
  if (in_kernel) parts.reduction = {arrivals.data, s.splits, b, y, z, bf16};
  run_gemm(GemmProblem<RowsOf<X>, Rows, PartialsRowMajor<LinearForwardReduction<Epi, Y>>>{
               batch, out, in, s.k_chunk, RowsOf<X>{x, in}, Rows{w, in}, parts, nullptr},
           s.splits);
  if (in_kernel) return;
  run_pass(LinearForwardSums<Epi, Y>{scratch, s.splits, count, out, b, y, z, bf16});
}

/// Forward of Linear over `batch` rows, split over `in` when the grid would leave SMs idle (`scratch`:
/// linear_forward_scratch floats) on `t`, the split parts finished as split_linear_forward says (by the
/// GEMM itself with t.arrivals where reduces_in_gemm allows). Tiles: GemmTiles<out>. `bf16`: y stored
/// as bf16 values. X, Y: x's and y's stored elements (float, or BFloat16 in a 16-bit workspace).
template <class Epi, class Tiles, class P, class X, class Y>
void linear_forward(const GemmTarget& t, int batch, int in, int out, const float* w, const float* b, const X* x, Y* y,
                    float* z, float* scratch, bool bf16 = false) {
  split_linear_forward<Epi, Tiles>(
      t.sm_count, batch, in, out, w, b, x, y, z, scratch, t.arrivals, bf16,
      [&](const auto& p, int splits) { launch_layer_gemm<Tiles, P>(p, splits, t); }, PassOnStream{t.stream});
}

/// Scratch (floats) of linear_backward. Tiles: GemmTiles<in>.
template <class Tiles>
std::size_t linear_backward_scratch(int batch, int in, int out, int sm_count) {
  return layer_weight_gradient_scratch<Tiles>(out, in, batch, sm_count);
}

/// Backward of Linear from dz stored (batch, out): dy itself when there is no activation, or what the
/// stage above wrote through an ActivationSink. Both GEMMs read it as plain rows and columns; the input
/// gradient goes to `sink`. Tiles: GemmTiles<in>. X: x's stored element.
template <class Tiles, class P, class Sink, class E, class X>
void linear_backward_stored(const GemmTarget& t, int batch, int in, int out, const float* w, const X* x,
                            const E* dz, const Sink& sink, float* dw, float* db, float* scratch,
                            const LayerUpdate<float>& update = {}) {
  if (sink.active()) launch_layer_gemm<Tiles, P>(linear_stored_dx_problem(batch, in, out, w, dz, sink), 1, t);
  const auto ops = linear_stored_dw_operands(batch, in, out, dz, x);
  layer_weight_gradient<Tiles, P>(t, ops.m, ops.n, ops.k, ops.a, ops.b, dw, db, scratch, update);
}

/// Backward of Linear: the input gradient dz W to `sink` (StoreSink{dx}, or the stage below's sink;
/// none when the sink is not active: the first layer), dW = dz^T x, db = column sums of dz, with dz =
/// dy * Epi' computed as each GEMM loads it (read in place when Epi is empty); dy is not changed. dW
/// and db are set, not accumulated. Tiles: GemmTiles<in> (the n of both GEMMs). An active `update`
/// applies the optimizer to w and b as dW and db are finished, after the input gradient's GEMM has read w.
/// X: x's stored element (float, or BFloat16 in a 16-bit workspace).
template <class Epi, class Tiles, class P, class Sink, class X>
void linear_backward_to(const GemmTarget& t, int batch, int in, int out, const float* w, const X* x,
                        const float* y, const float* z, const float* dy, const Sink& sink, float* dw, float* db,
                        float* scratch, const LayerUpdate<float>& update = {}) {
  if constexpr (Epi::empty) {
    linear_backward_stored<Tiles, P>(t, batch, in, out, w, x, dy, sink, dw, db, scratch, update);
  } else {
    const EpilogueGradient<Epi> g{dy, y, z};
    if (sink.active()) launch_layer_gemm<Tiles, P>(linear_dx_problem_to(batch, in, out, w, g, sink), 1, t);
    const auto ops = linear_dw_operands(batch, in, out, g, x);
    layer_weight_gradient<Tiles, P>(t, ops.m, ops.n, ops.k, ops.a, ops.b, dw, db, scratch, update);
  }
}

/// linear_backward_to storing the input gradient to dx (none when dx is null).
template <class Epi, class Tiles, class P>
void linear_backward(const GemmTarget& t, int batch, int in, int out, const float* w, const float* x, const float* y,
                     const float* z, const float* dy, float* dx, float* dw, float* db, float* scratch) {
  linear_backward_to<Epi, Tiles, P>(t, batch, in, out, w, x, y, z, dy, StoreSink{dx}, dw, db, scratch);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
