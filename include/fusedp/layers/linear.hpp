#pragma once
// Linear<Out>: y = x W^T + b over a flat input, W (Out, In) as PyTorch.
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/linear.hpp"
#include "fusedp/layers/layer.hpp"

#include <array>

namespace fusedp {

/// A fully connected layer. Its input must be flat (C, 1, 1): put Flatten after a Conv2d or pooling.
/// @tparam Out output features
template <int Out>
struct Linear {
  static_assert(Out > 0, "Linear<Out>: Out must be positive");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  static constexpr const char* name = "Linear";
  static constexpr std::array<int, 1> attributes{Out};

  template <class In>
  static constexpr bool accepts = In::is_flat;
  template <class In>
  using expected = Shape<int(In::size), 1, 1>;
  template <class In>
  using output = Shape<Out, 1, 1>;

  template <class In>
  static constexpr std::array<ParamSpec, 2> params{{
      {ParamRole::weight, std::size_t(Out) * In::size, In::size, 2, {Out, int(In::size), 0, 0}},
      {ParamRole::bias, std::size_t(Out), In::size, 1, {Out, 0, 0, 0}},
  }};

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::linear_forward<Epi>(a.space, a.batch, In::size, std::size_t(Out), a.w, a.b, a.x, a.y, a.z);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::linear_backward<Epi>(a.space, a.batch, In::size, std::size_t(Out), a.w, a.x, a.y, a.z, a.dy, a.dx,
                                        a.dw, a.db);
  }
};

}  // namespace fusedp
