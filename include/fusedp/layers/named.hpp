#pragma once
// Named<name, L>: layer L under a name of its own in checkpoints and messages. Without it a layer's
// tensors are named by its position (PyTorch's nn.Sequential: "3.weight"); with it, by the name
// ("conv1.weight"), so a network can match a PyTorch module with named children (torchvision's
// ResNet: conv1, bn1, layer1.0.conv1, ..., fc). Everything else is L's.
//
// The name is a character array with static storage, passed by reference, not a string literal: nvcc
// cannot spell a class-type template argument (a literal's wrapper), nor a pointer to an array, in
// the host stubs of the kernels that a network type reaches:
//
//   inline constexpr char stem[] = "stem";
//   using Net = fp::Sequential<fp::Input<3, 32, 32>, fp::Named<stem, fp::Conv2d<16, 3>>, ...>;
#include "fusedp/layers/layer.hpp"

namespace fusedp {

/// @tparam Name the layer's key in PyTorch's state_dict (may hold dots: "layer1.0")
/// @tparam L the layer (or a Residual block's Projection)
template <const auto& Name, class L>
struct Named : L {
  static_assert(Name[0] != '\0', "Named: the name must not be empty");
  static constexpr const char* torch_name = Name;
};

}  // namespace fusedp
