#pragma once
// Which mainloop runs a GEMM on Cuda: gemm.cuh's WMMA gemm_kernel (verified on an H200, 2026-11-30) or
// gemm_mma.cuh's tensor-core mainloop (cp.async stages, mma.sync; emulated on the CPU, not yet run on a
// GPU). The layers' GEMMs reach both through this header's launch_gemm_on and weight_gradient_on with
// a GemmTarget, so one switch chooses the mainloop of a whole network, and a problem the tensor-core
// mainloop cannot run (sm_75, weights whose rows are not 16-byte aligned, too little shared memory) or
// a precision it does not have (exact Fp32) falls back to WMMA, problem by problem.
//
// The switch: GemmTarget::mainloop, which GemmTarget::of takes from the environment variable
// FUSEDP_CUDA_GEMM ("wmma" or "mma"), so benchmarks/gpu/check.sh runs the same binaries both ways.
//
// The layers (conv2d.cuh, linear.cuh) launch through launch_layer_gemm and layer_weight_gradient.
// They compile the tensor-core mainloop in only where FUSEDP_CUDA_MMA_LAYERS is 1 (then an unset
// FUSEDP_CUDA_GEMM means mma): each conv layer then instantiates three more kernels and each Linear
// two, for every architecture built, a compile-time cost paid once an H200 has measured the gain.
// With it 0 (the default) the layers run exactly the WMMA kernels, as before.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_branch.hpp"
#include "fusedp/kernels/cuda/branch_delay.cuh"
#include "fusedp/kernels/cuda/gemm.cuh"
#include "fusedp/kernels/cuda/gemm_mma.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#ifndef FUSEDP_CUDA_MMA_LAYERS
#define FUSEDP_CUDA_MMA_LAYERS 0
#endif

namespace fusedp::kernels::cuda {

/// Whether the layers' GEMMs have the tensor-core mainloop compiled in (FUSEDP_CUDA_MMA_LAYERS).
inline constexpr bool layers_have_mma = FUSEDP_CUDA_MMA_LAYERS != 0;

/// The mainloop a GemmTarget prefers.
enum class GemmMainloop {
  wmma,  ///< gemm.cuh's gemm_kernel: WMMA fragments, two register-staged slices
  mma,   ///< gemm_mma.cuh's gemm_mma_kernel where it can run, else wmma
};

/// The mainloop a build prefers when FUSEDP_CUDA_GEMM is unset: mma where the layers have it.
inline constexpr GemmMainloop default_gemm_mainloop = layers_have_mma ? GemmMainloop::mma : GemmMainloop::wmma;

/// The mainloop named by `value`, FUSEDP_CUDA_GEMM's text: "wmma" or "mma"; null or empty is `unset`.
/// Anything else is an InvalidArgument naming the variable and the value.
[[nodiscard]] inline GemmMainloop parse_gemm_mainloop(const char* value, GemmMainloop unset = GemmMainloop::wmma) {
  const std::string_view v = value ? value : "";
  if (v.empty()) return unset;
  if (v == "wmma") return GemmMainloop::wmma;
  if (v == "mma") return GemmMainloop::mma;
  throw InvalidArgument("FUSEDP_CUDA_GEMM is '" + std::string(v) + "'; it must be 'wmma' or 'mma' (or unset: " +
                        (unset == GemmMainloop::mma ? "mma" : "wmma") + ")");
}

/// FUSEDP_CUDA_GEMM's mainloop (default_gemm_mainloop when unset), read at the first call in the
/// process: an eager step asks once per layer, and the process's choice does not change mid-run. A bad
/// value throws at every call, never cached.
[[nodiscard]] inline GemmMainloop gemm_mainloop_from_environment() {
  static const GemmMainloop chosen = parse_gemm_mainloop(std::getenv("FUSEDP_CUDA_GEMM"), default_gemm_mainloop);
  return chosen;
}

/// Who adds up the parts of a split-K GEMM (a weight gradient, a split Linear forward). Every choice
/// gives the same bits.
enum class SplitReduction {
  automatic,  ///< the GEMM's last block per tile where adding up a tile's parts takes it at most
              ///< split_tile_reduction_trips round trips to L2 (one launch), else a second kernel
  gemm,       ///< the GEMM's last block per output tile however long its reduction
  kernel,     ///< a second kernel (reduce_splits_kernel, linear_forward_reduce_kernel)
};

/// The reduction named by `value`, FUSEDP_CUDA_SPLIT_REDUCTION's text: "auto", "gemm" or "kernel"; null
/// or empty is auto. Anything else is an InvalidArgument naming the variable and the value.
[[nodiscard]] inline SplitReduction parse_split_reduction(const char* value) {
  const std::string_view v = value ? value : "";
  if (v.empty() || v == "auto") return SplitReduction::automatic;
  if (v == "gemm") return SplitReduction::gemm;
  if (v == "kernel") return SplitReduction::kernel;
  throw InvalidArgument("FUSEDP_CUDA_SPLIT_REDUCTION is '" + std::string(v) +
                        "'; it must be 'auto', 'gemm' or 'kernel' (or unset: auto)");
}

/// FUSEDP_CUDA_SPLIT_REDUCTION's choice: for comparing them on a device (benchmarks/gpu/check.sh,
/// impl=fusedp-split-gemm and fusedp-split-kernel); the results are the same bits either way. Read at
/// the first call in the process, as gemm_mainloop_from_environment.
[[nodiscard]] inline SplitReduction split_reduction_from_environment() {
  static const SplitReduction chosen = parse_split_reduction(std::getenv("FUSEDP_CUDA_SPLIT_REDUCTION"));
  return chosen;
}

/// The arrival counters split GEMMs on `space` finish their tiles with: the stream's, limited to tiles
/// whose reduction takes at most split_tile_reduction_trips round trips (automatic) or any (gemm), or none
/// (kernel).
template <class P>
[[nodiscard]] ArrivalCounters split_arrivals(const CudaSpace<P>& space,
                                             SplitReduction reduction = split_reduction_from_environment()) {
  if (reduction == SplitReduction::kernel) return {};
  ArrivalCounters a = space.arrival_counters();
  if (reduction == SplitReduction::automatic) a.reduction_trip_limit = split_tile_reduction_trips;
  return a;
}

/// Where a layer's GEMMs run: the stream, the SM count split-K plans size their grids by, the device's
/// architecture and shared memory (what gemm_mma_can_run asks), the preferred mainloop, and the stream's
/// arrival counters, with which split GEMMs add up their own parts where the last block's chain of loads
/// is short enough (split_arrivals; none: a second kernel always does); and
/// where a layer's weight gradient runs (none: on `stream`, after its input gradient).
struct GemmTarget {
  cudaStream_t stream = nullptr;
  int sm_count = 1;
  MmaDevice device{};
  GemmMainloop mainloop = GemmMainloop::wmma;
  ArrivalCounters arrivals{};
  CudaBranch weight_branch{};

  /// `space`'s target; the arrival counters unless `reduction` is SplitReduction::kernel.
  template <class P>
  [[nodiscard]] static GemmTarget of(const CudaSpace<P>& space,
                                     GemmMainloop mainloop = gemm_mainloop_from_environment(),
                                     SplitReduction reduction = split_reduction_from_environment()) {
    return {space.stream(), space.sm_count(), MmaDevice::of(space), mainloop, split_arrivals(space, reduction)};
  }
};

/// Whether problem `p` runs on the tensor-core mainloop with tile TileM at `t`: the target prefers it,
/// the precision has it (Tf32, Bf16; Fp32 stays exact on WMMA's FFMA path) and gemm_mma_can_run agrees.
template <class TileM, class P, class A, class B, class Epi>
[[nodiscard]] bool takes_mma(const GemmProblem<A, B, Epi>& p, const GemmTarget& t) {
  if constexpr (std::is_same_v<P, precision::Fp32> || !CopyOperand<A> || !CopyOperand<B>) {
    return false;
  } else {
    return t.mainloop == GemmMainloop::mma && gemm_mma_can_run<TileM>(p, t.device);
  }
}

/// launch_gemm or launch_gemm_mma, as takes_mma decides. TileW: the WMMA tile (tile_for<n>), TileM:
/// the tensor-core tile (mma::mma_tile_for<n>).
template <class TileW, class TileM, class P, bool RowSums, class A, class B, class Epi>
void launch_gemm_on(const GemmProblem<A, B, Epi>& p, int splits, const GemmTarget& t) {
  if constexpr (!std::is_same_v<P, precision::Fp32> && CopyOperand<A> && CopyOperand<B>) {
    if (takes_mma<TileM, P>(p, t)) {
      launch_gemm_mma<TileM, RowSums, P>(p, splits, t.device, t.stream);
      return;
    }
  }
  launch_gemm<TileW, P, RowSums>(p, splits, t.stream);
}

/// Scratch (floats) weight_gradient_on needs for this shape with either mainloop (the larger plan).
template <class TileW, class TileM>
[[nodiscard]] std::size_t weight_gradient_scratch_on(int m, int n, int k, int sm_count) {
  return std::max(weight_gradient_scratch<TileW>(m, n, k, sm_count), weight_gradient_scratch<TileM>(m, n, k, sm_count));
}

/// weight_gradient on the mainloop `t` prefers: dW (m x n) = sum over k of A(m, k) B(n, k), db the
/// row sums of A when not null, split over k and reduced in a fixed order. On the tensor cores when
/// takes_mma says so for the whole product (its split plan has whole 32-deep slices, so the splits run
/// too: weight_gradient_mma), else exactly weight_gradient, WMMA's plan and all.
/// `scratch`: weight_gradient_scratch_on<TileW, TileM>(m, n, k, t.sm_count) floats; `update` as
/// weight_gradient's; t.arrivals as weight_gradient's `arrivals`.
template <class TileW, class TileM, class P, class A, class B>
void weight_gradient_on(const GemmTarget& t, int m, int n, int k, const A& a, const B& b, float* dw, float* db,
                        float* scratch, const LayerUpdate<float>& update = {}) {
  if constexpr (!std::is_same_v<P, precision::Fp32> && CopyOperand<A> && CopyOperand<B>) {
    if (takes_mma<TileM, P>(GemmProblem<A, B, StoreRowMajor>{m, n, k, k, a, b, {}, nullptr}, t)) {
      weight_gradient_mma<TileM, P>(t.stream, t.sm_count, t.device, m, n, k, a, b, dw, db, scratch, update,
                                    t.arrivals);
      return;
    }
  }
  weight_gradient<TileW, P>(t.stream, t.sm_count, m, n, k, a, b, dw, db, scratch, update, t.arrivals);
}

/// `m`, checked as the mainloop of a layer's GEMMs: mma from a build whose layers lack it
/// (FUSEDP_CUDA_MMA_LAYERS 0) is an InvalidArgument saying how to get it, not a silent WMMA run.
[[nodiscard]] inline GemmMainloop checked_layer_mainloop(GemmMainloop m) {
  if (!layers_have_mma && m == GemmMainloop::mma)
    throw InvalidArgument("FUSEDP_CUDA_GEMM is 'mma', but this build's layers have only the WMMA mainloop: build "
                          "with -DFUSEDP_CUDA_MMA_LAYERS=1 for the tensor-core one, or unset FUSEDP_CUDA_GEMM");
  return m;
}

/// The GemmTarget of a layer's GEMMs on `space` (its mainloop checked_layer_mainloop's).
template <class P>
[[nodiscard]] GemmTarget layer_target(const CudaSpace<P>& space) {
  return GemmTarget::of(space, checked_layer_mainloop(gemm_mainloop_from_environment()));
}
/// layer_target with the layer's weight gradient on `branch`'s side stream (none when null); `name` and
/// `index` (the layer's) name its span there.
template <class P>
[[nodiscard]] GemmTarget layer_target(const CudaSpace<P>& space, const CudaSideStream* branch, const char* name,
                                      std::int64_t index) {
  GemmTarget t = layer_target(space);
  if (branch != nullptr) t.weight_branch = branch->branch(t.arrivals, name, index);
  return t;
}

/// Where a weight gradient runs: on t's stream, or forked onto its weight branch (the fork recorded on
/// t's stream now: after everything queued there, the layer's input-gradient GEMM included, which read
/// the weights the fused update then writes).
[[nodiscard]] inline GemmTarget weight_gradient_target(const GemmTarget& t) {
  if (t.weight_branch.stream == nullptr) return t;
  FUSEDP_CUDA_CHECK(cudaEventRecord(t.weight_branch.fork, t.stream));
  FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(t.weight_branch.stream, t.weight_branch.fork, 0));
  delay_branch(t.weight_branch.stream);  // tests only (branch_delay.cuh)
  GemmTarget w = t;
  w.stream = t.weight_branch.stream;
  w.arrivals = t.weight_branch.arrivals;
  w.weight_branch = {};
  return w;
}

/// The tiles of a layer's GEMM whose n (columns of C) is N, on either mainloop.
template <int N>
struct GemmTiles {
  using wmma = tile_for<N>;
  using mma = mma::mma_tile_for<N>;
};

/// A layer's GEMM: launch_gemm_on's choice where the layers have the tensor-core mainloop, else
/// launch_gemm on WMMA (no tensor-core kernel instantiated). Tiles: GemmTiles<n>.
template <class Tiles, class P, bool RowSums = false, class A, class B, class Epi>
void launch_layer_gemm(const GemmProblem<A, B, Epi>& p, int splits, const GemmTarget& t) {
  if constexpr (layers_have_mma) {
    launch_gemm_on<typename Tiles::wmma, typename Tiles::mma, P, RowSums>(p, splits, t);
  } else {
    launch_gemm<typename Tiles::wmma, P, RowSums>(p, splits, t.stream);
  }
}

/// Scratch (floats) of layer_weight_gradient for this shape.
template <class Tiles>
[[nodiscard]] std::size_t layer_weight_gradient_scratch(int m, int n, int k, int sm_count) {
  if constexpr (layers_have_mma) {
    return weight_gradient_scratch_on<typename Tiles::wmma, typename Tiles::mma>(m, n, k, sm_count);
  } else {
    return weight_gradient_scratch<typename Tiles::wmma>(m, n, k, sm_count);
  }
}

/// A layer's weight gradient: weight_gradient_on where the layers have the tensor-core mainloop, else
/// weight_gradient on WMMA. `scratch`: layer_weight_gradient_scratch<Tiles>(m, n, k, t.sm_count) floats.
/// Active updates apply the optimizer to the weights and the bias as their gradients are finished. With
/// t.weight_branch on the branch's stream (the caller joins it back; net/backward_cursor.hpp), so it
/// must come after every GEMM of the layer that reads the weights.
template <class Tiles, class P, class A, class B>
void layer_weight_gradient(const GemmTarget& t, int m, int n, int k, const A& a, const B& b, float* dw, float* db,
                           float* scratch, const LayerUpdate<float>& update = {}) {
  const GemmTarget w = weight_gradient_target(t);
  std::optional<trace::CudaScope> span;  // on the branch's lane, beside the stage's span
  if (w.stream != t.stream)
    span.emplace(w.stream, t.weight_branch.name, trace::Kind::backward, t.weight_branch.index, 0,
                 trace::branch_lane + trace::current_lane());
  if constexpr (layers_have_mma) {
    weight_gradient_on<typename Tiles::wmma, typename Tiles::mma, P>(w, m, n, k, a, b, dw, db, scratch, update);
  } else {
    weight_gradient<typename Tiles::wmma, P>(w.stream, w.sm_count, m, n, k, a, b, dw, db, scratch, update,
                                             w.arrivals);
  }
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
