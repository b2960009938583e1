#pragma once
// What a layer is: a plain struct that maps an input Shape to an output Shape, declares its parameter
// tensors, and runs forward and backward on a space. The contract is the Layer concept below.
#include "fusedp/core/config.hpp"
#include "fusedp/core/shape.hpp"

#include <array>
#include <cstddef>
#include <cstdint>

namespace fusedp {

/// How a layer takes part in the fusion plan.
enum class LayerKind {
  input,      ///< Input<C,H,W>: the first layer, only a shape
  anchor,     ///< an op that starts a stage: Conv2d, Linear, pooling, Dropout
  pointwise,  ///< an activation: rides in the epilogue of the anchor before it
  reshape,    ///< Flatten: changes the shape, not the memory
};

enum class ParamRole { weight, bias };

/// One parameter tensor of a layer, with its PyTorch shape (so weights map one to one onto torch).
struct ParamSpec {
  ParamRole role;
  std::size_t size;
  std::size_t fan_in;  // PyTorch's default init draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  int rank;
  std::array<int, 4> dims;
};

/// Everything a stage needs in one pass on one space. Forward reads x, w, b and writes y (and z, the
/// values before the epilogue, when the epilogue saves them); backward reads x, y, z, w, dy and writes
/// dx (null for the first stage), dw, db. dy may be overwritten.
template <class Space, class T>
struct StageArgs {
  const Space& space;
  std::size_t batch;
  const T* x;
  T* y;
  T* z;
  const T* w;
  const T* b;
  T* dy;
  T* dx;
  T* dw;
  T* db;
  T* scratch;          // this stage's share of per-thread scratch (Host) or workspace (Cuda)
  bool training;
  std::uint64_t seed;  // the model's seed
  std::uint64_t step;  // the optimizer step, for per-step randomness (dropout)
  std::size_t index;   // the layer's index in the network
};

namespace detail {
template <class L>
concept HasParams = requires { L::template params<Shape<1, 1, 1>>; };
}  // namespace detail

/// The layer contract.
///   kind, name                       how it joins the fusion plan, and how messages name it
///   accepts<In>                      whether it can take an input of shape In
///   expected<In>                     the nearest input shape it accepts (for the error message)
///   output<In>                       its output shape (only instantiated when accepts<In>)
///   params<In> (optional)            its parameter tensors, in PyTorch's order
///   forward/backward (anchors)       per space, with StageArgs
template <class L>
concept Layer = requires {
  { L::kind } -> std::convertible_to<LayerKind>;
  { L::name } -> std::convertible_to<const char*>;
};

/// Parameter tensors of layer L at input shape In (none for a layer without params<>).
template <class L, class In>
constexpr auto params_of() {
  if constexpr (requires { L::template params<In>; }) return L::template params<In>;
  else return std::array<ParamSpec, 0>{};
}

/// Per-thread Host scratch of layer L at input In, in elements.
template <class L, class In>
constexpr std::size_t host_scratch_of() {
  if constexpr (requires { L::template host_scratch<In>; }) return L::template host_scratch<In>;
  else return 0;
}

}  // namespace fusedp
