#pragma once
// Activation layers. Each names the shared functor it applies; the fusion plan puts it in the epilogue
// of the anchor op before it (Conv2d, Linear, pooling), or in a pointwise stage of its own.
#include "fusedp/kernels/activation.hpp"
#include "fusedp/layers/layer.hpp"

#include <array>
#include <bit>
#include <cstdint>

namespace fusedp {

namespace detail {
template <class Op, const char* Name>
struct Activation {
  static constexpr LayerKind kind = LayerKind::pointwise;
  static constexpr const char* name = Name;
  using op = Op;
  template <class In>
  static constexpr bool accepts = true;
  template <class In>
  using expected = In;
  template <class In>
  using output = In;
};
inline constexpr char relu_name[] = "ReLU";
inline constexpr char leaky_relu_name[] = "LeakyReLU";
inline constexpr char tanh_name[] = "Tanh";
inline constexpr char sigmoid_name[] = "Sigmoid";
inline constexpr char gelu_name[] = "GELU";
}  // namespace detail

struct ReLU : detail::Activation<kernels::Relu, detail::relu_name> {};
/// @tparam Slope the slope for negative inputs (PyTorch's negative_slope, default 0.01)
template <float Slope = 0.01f>
struct LeakyReLU : detail::Activation<kernels::LeakyRelu<Slope>, detail::leaky_relu_name> {
  static constexpr std::array<std::uint32_t, 1> attributes{std::bit_cast<std::uint32_t>(Slope)};
};
struct Tanh : detail::Activation<kernels::Tanh, detail::tanh_name> {};
struct Sigmoid : detail::Activation<kernels::Sigmoid, detail::sigmoid_name> {};
/// GELU, exact (erf) form.
struct GELU : detail::Activation<kernels::Gelu, detail::gelu_name> {};

}  // namespace fusedp

#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/pointwise.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/pointwise.cuh"
#endif

namespace fusedp {

/// Runs a stage made only of activations (a run that no anchor op absorbed, e.g. at the very start
/// or after Flatten). The input is kept, so backward needs no saved tensor.
struct PointwiseStage {
  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::pointwise_forward<Epi>(a.space, a.batch * In::size, a.x, a.y);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::pointwise_backward<Epi>(a.space, a.batch * In::size, a.x, a.y, a.dy, a.dx);
  }

#if FUSEDP_HAS_CUDA
  template <class In, class Epi, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    kernels::cuda::pointwise_forward<Epi>(a.space.stream(), a.batch * In::size, a.x, a.y, a.bf16_y);
  }
  template <class In, class Epi, class T, class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    kernels::cuda::pointwise_backward<Epi>(a.space.stream(), a.batch * In::size, a.x, a.y, a.dy, a.dx, a.bf16_dx);
  }
#endif
};

}  // namespace fusedp
