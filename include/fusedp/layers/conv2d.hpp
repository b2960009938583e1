#pragma once
// Conv2d<Out, K, Stride, Pad>: 2-d convolution with bias, NCHW, weights (Out, C, K, K) as PyTorch.
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/conv2d.hpp"
#include "fusedp/layers/layer.hpp"

#include <algorithm>
#include <array>

namespace fusedp {

/// @tparam Out output channels
/// @tparam K square kernel size
/// @tparam Stride stride in both directions
/// @tparam Pad zero padding on every side
template <int Out, int K, int Stride = 1, int Pad = 0>
struct Conv2d {
  static_assert(Out > 0 && K > 0 && Stride > 0 && Pad >= 0,
                "Conv2d<Out, K, Stride, Pad>: Out, K and Stride must be positive and Pad non-negative");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  static constexpr const char* name = "Conv2d";
  static constexpr std::array<int, 4> attributes{Out, K, Stride, Pad};

  template <class In>
  static constexpr bool accepts = window_out(In::height, K, Stride, Pad) > 0 && window_out(In::width, K, Stride, Pad) > 0;
  template <class In>
  using expected = Shape<In::channels, std::max(In::height, K - 2 * Pad), std::max(In::width, K - 2 * Pad)>;
  template <class In>
  using output = Shape<Out, window_out(In::height, K, Stride, Pad), window_out(In::width, K, Stride, Pad)>;

  template <class In>
  static constexpr kernels::host::ConvGeometry geometry{In::channels, In::height, In::width, K, Stride, Pad, Out,
                                                        output<In>::height, output<In>::width};
  template <class In>
  static constexpr std::array<ParamSpec, 2> params{{
      {ParamRole::weight, std::size_t(Out) * In::channels * K * K, std::size_t(In::channels) * K * K, 4,
       {Out, In::channels, K, K}},
      {ParamRole::bias, std::size_t(Out), std::size_t(In::channels) * K * K, 1, {Out, 0, 0, 0}},
  }};
  template <class In>
  static constexpr std::size_t host_scratch = geometry<In>.scratch_per_thread();

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::conv2d_forward<Epi>(a.space, geometry<In>, a.batch, a.w, a.b, a.x, a.y, a.z, a.scratch);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::conv2d_backward<Epi>(a.space, geometry<In>, a.batch, a.w, a.x, a.y, a.z, a.dy, a.dx, a.dw, a.db,
                                        a.scratch);
  }
};

}  // namespace fusedp
