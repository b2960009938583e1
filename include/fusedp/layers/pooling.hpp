#pragma once
// MaxPool2d<K, Stride> and AvgPool2d<K, Stride>: square windows, no padding, floor mode (as PyTorch).
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/pool.hpp"
#include "fusedp/layers/layer.hpp"

#include <algorithm>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/pool.cuh"
#endif

namespace fusedp {

namespace detail {
template <kernels::PoolOp Op, int K, int Stride>
struct Pool2d {
  static_assert(K > 0 && Stride > 0, "pooling: K and Stride must be positive");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  static constexpr const char* name = Op == kernels::PoolOp::max ? "MaxPool2d" : "AvgPool2d";
  static constexpr std::array<int, 2> attributes{K, Stride};

  template <class In>
  static constexpr bool accepts = In::height >= K && In::width >= K;
  template <class In>
  using expected = Shape<In::channels, std::max(In::height, K), std::max(In::width, K)>;
  template <class In>
  using output = Shape<In::channels, window_out(In::height, K, Stride, 0), window_out(In::width, K, Stride, 0)>;
  template <class In>
  static constexpr kernels::ConvGeometry geometry{In::channels, In::height, In::width, K, Stride, 0,
                                                        In::channels, output<In>::height, output<In>::width};

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::pool_forward<Op, K, Stride, Epi>(a.space, geometry<In>, a.batch, a.x, a.y, a.z);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::pool_backward<Op, K, Stride, Epi>(a.space, geometry<In>, a.batch, a.x, a.y, a.z, a.dy, a.dx);
  }

#if FUSEDP_HAS_CUDA
  // Cuda: a pooling kernel of its own (a MaxPool2d that the Cuda plan fuses into the conv before it
  // never gets here). dy is not changed.
  template <class In, class Epi, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    kernels::cuda::pool_forward<Op, K, Stride, Epi>(a.space.stream(), geometry<In>, a.batch, a.x, a.y, a.z,
                                                    a.bf16_y);
  }
  template <class In, class Epi, class T, class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    kernels::cuda::pool_backward<Op, K, Stride, Epi>(a.space.stream(), geometry<In>, a.batch, a.x, a.y, a.z, a.dy,
                                                     a.dx, a.bf16_dx);
  }
#endif
};
}  // namespace detail

/// Max over K x K windows.
/// @tparam K window size
/// @tparam Stride step between windows (defaults to K)
template <int K, int Stride = K>
struct MaxPool2d : detail::Pool2d<kernels::PoolOp::max, K, Stride> {};

namespace detail {
// The window of a max-pooling layer whose stride equals its window (a Named one too: it derives from
// its layer); 0 for any other layer. What the plans fuse into the conv before it (net/cuda_plan.hpp,
// net/cost.hpp).
template <int K, int S>
constexpr int max_pool_window(const Pool2d<kernels::PoolOp::max, K, S>*) {
  return K == S ? K : 0;
}
constexpr int max_pool_window(const void*) { return 0; }
template <class L>
inline constexpr int max_pool_window_of = max_pool_window(static_cast<const L*>(nullptr));
}  // namespace detail

/// Mean over K x K windows.
/// @tparam K window size
/// @tparam Stride step between windows (defaults to K)
template <int K, int Stride = K>
struct AvgPool2d : detail::Pool2d<kernels::PoolOp::average, K, Stride> {};

}  // namespace fusedp
