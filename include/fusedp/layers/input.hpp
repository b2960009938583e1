#pragma once
// Input<C,H,W>: the shape of one sample, the first layer of every Sequential.
#include "fusedp/core/shape.hpp"
#include "fusedp/layers/layer.hpp"

namespace fusedp {

/// The input of a network: one sample of C channels, H rows, W columns (NCHW, batch excluded).
/// @tparam C channels
/// @tparam H height
/// @tparam W width
template <int C, int H = 1, int W = 1>
struct Input {
  static constexpr LayerKind kind = LayerKind::input;
  static constexpr const char* name = "Input";
  using shape = Shape<C, H, W>;
};

}  // namespace fusedp
