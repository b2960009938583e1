#pragma once
// Flatten: (C, H, W) -> (C*H*W, 1, 1). In NCHW this is the same memory, so it costs nothing and the
// order of features is PyTorch's.
#include "fusedp/core/shape.hpp"
#include "fusedp/layers/layer.hpp"

namespace fusedp {

struct Flatten {
  static constexpr LayerKind kind = LayerKind::reshape;
  static constexpr const char* name = "Flatten";
  template <class In>
  static constexpr bool accepts = true;
  template <class In>
  using expected = In;
  template <class In>
  using output = Shape<int(In::size), 1, 1>;
};

}  // namespace fusedp
