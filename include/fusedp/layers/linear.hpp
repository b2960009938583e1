#pragma once
// Linear<Out>: y = x W^T + b over a flat input, W (Out, In) as PyTorch.
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/linear.hpp"
#include "fusedp/layers/layer.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/linear.cuh"
#endif

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

#if FUSEDP_HAS_CUDA
  // Cuda: one GEMM forward (bias and Epi in its epilogue); backward a dx GEMM and a weight-gradient
  // GEMM that load dz = dy * Epi' on the fly (or read dz stored), the bias gradient summed by the
  // latter. dy is not changed. X and Y: the elements the input and the output are stored in (float;
  // BFloat16 where CudaPlan::output_element stores a group's output in 16 bits, net/cuda_plan.hpp), what
  // a.x and a.y point to.
  template <class In, class Epi, class X = float, class Y = float, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    static_assert(std::is_same_v<T, float>, "Linear on Cuda: the scalar type must be float");
    kernels::cuda::linear_forward<Epi, kernels::cuda::GemmTiles<Out>, P>(
        kernels::cuda::layer_target(a.space), int(a.batch), int(In::size), Out, a.w, a.b,
        reinterpret_cast<const X*>(a.x), reinterpret_cast<Y*>(a.y), a.z, a.scratch, a.bf16_y);
  }
  template <class In, class Epi, class T, class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    backward_to<In, Epi, false>(a, kernels::cuda::StoreSink{a.dx, a.bf16_dx});
  }
  /// Backward with the input gradient to `sink` (kernels/cuda/gradient_sink.cuh: StoreSink{a.dx}, or
  /// the stage below's sink, which then receives its dz). DzIn: a.dy already holds dz (batch, Out),
  /// written by the stage above through an ActivationSink (net/cuda_plan.hpp) as
  /// kernels::cuda::received_dz_element<P, Epi> (BFloat16 under Bf16 where Epi's derivative is a mask).
  /// Without DzIn the output is read for the activation's derivative: it must be stored in fp32 (Y).
  template <class In, class Epi, bool DzIn, class X = float, class Y = float, class T, class P, class Sink>
  static void backward_to(const StageArgs<CudaSpace<P>, T>& a, const Sink& sink) {
    static_assert(std::is_same_v<T, float>, "Linear on Cuda: the scalar type must be float");
    static_assert(DzIn || std::is_same_v<Y, float>,
                  "Linear on Cuda: an output stored in 16 bits must receive its dz from the stage above");
    const X* x = reinterpret_cast<const X*>(a.x);
    using Tiles = kernels::cuda::GemmTiles<int(In::size)>;
    const auto target = kernels::cuda::layer_target(a.space, a.weight_branch, name, std::int64_t(a.index));
    using E = kernels::cuda::received_dz_element<P, Epi>;
    if constexpr (DzIn)
      kernels::cuda::linear_backward_stored<Tiles, P>(target, int(a.batch), int(In::size), Out, a.w, x,
                                                      reinterpret_cast<const E*>(a.dy), sink, a.dw, a.db, a.scratch,
                                                      a.update);
    else
      kernels::cuda::linear_backward_to<Epi, Tiles, P>(target, int(a.batch), int(In::size), Out, a.w, x, a.y, a.z,
                                                       a.dy, sink, a.dw, a.db, a.scratch, a.update);
  }
  /// Floats of Cuda workspace forward and backward need at exactly this batch size on a device of
  /// `sm_count` SMs (split-K partial sums; not monotonic in the batch, see CudaGroups::scratch_elements).
  template <class In>
  static std::size_t cuda_scratch(std::size_t batch, int sm_count) {
    return std::max(kernels::cuda::linear_backward_scratch<kernels::cuda::GemmTiles<int(In::size)>>(
                        int(batch), int(In::size), Out, sm_count),
                    kernels::cuda::linear_forward_scratch<kernels::cuda::GemmTiles<Out>>(int(batch), int(In::size),
                                                                                       Out, sm_count));
  }
#endif
};

namespace detail {
template <int Out>
std::true_type linear_layer(const Linear<Out>*);
std::false_type linear_layer(const void*);
/// Whether layer L is a Linear (a Named one too: it derives from its layer), for the plans that treat
/// Linear stages specially (net/cuda_plan.hpp, net/cost.hpp).
template <class L>
struct is_linear : decltype(linear_layer(static_cast<const L*>(nullptr))) {};
}  // namespace detail

}  // namespace fusedp
