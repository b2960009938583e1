#pragma once
// Conv2d<Out, K, Stride, Pad, Bias>: 2-d convolution, NCHW, weights (Out, C, K, K) as PyTorch, with a
// bias unless Bias is no_bias (PyTorch's bias=False, the conv before a BatchNorm).
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/conv2d.hpp"
#include "fusedp/layers/layer.hpp"

#include <algorithm>
#include <array>
#include <type_traits>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/conv2d.cuh"

#include <cstdint>
#endif

namespace fusedp {

/// Conv2d<Out, K, Stride, Pad, no_bias>: a convolution without bias.
inline constexpr bool no_bias = false;

/// @tparam Out output channels
/// @tparam K square kernel size
/// @tparam Stride stride in both directions
/// @tparam Pad zero padding on every side
/// @tparam Bias whether it adds a bias (`no_bias`: PyTorch's bias=False)
template <int Out, int K, int Stride = 1, int Pad = 0, bool Bias = true>
struct Conv2d {
  static_assert(Out > 0 && K > 0 && Stride > 0 && Pad >= 0,
                "Conv2d<Out, K, Stride, Pad>: Out, K and Stride must be positive and Pad non-negative");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  // Evaluation runs a BatchNorm right after it in its epilogue (StageArgs::fold), on both spaces.
  static constexpr bool folds_batch_norm = true;
  static constexpr const char* name = "Conv2d";
  static constexpr auto attributes = [] {
    if constexpr (Bias) return std::array<int, 4>{Out, K, Stride, Pad};  // (as before no_bias existed)
    else return std::array<int, 5>{Out, K, Stride, Pad, 0};
  }();

  template <class In>
  static constexpr bool accepts = window_out(In::height, K, Stride, Pad) > 0 && window_out(In::width, K, Stride, Pad) > 0;
  template <class In>
  using expected = Shape<In::channels, std::max(In::height, K - 2 * Pad), std::max(In::width, K - 2 * Pad)>;
  template <class In>
  using output = Shape<Out, window_out(In::height, K, Stride, Pad), window_out(In::width, K, Stride, Pad)>;

  template <class In>
  static constexpr kernels::ConvGeometry geometry{In::channels, In::height, In::width, K, Stride, Pad, Out,
                                                        output<In>::height, output<In>::width};
  template <class In>
  static constexpr auto params = [] {
    constexpr ParamSpec weight{ParamRole::weight, std::size_t(Out) * In::channels * K * K,
                               std::size_t(In::channels) * K * K, 4, {Out, In::channels, K, K}};
    constexpr ParamSpec bias{ParamRole::bias, std::size_t(Out), std::size_t(In::channels) * K * K, 1, {Out, 0, 0, 0}};
    if constexpr (Bias) return std::array<ParamSpec, 2>{weight, bias};
    else return std::array<ParamSpec, 1>{weight};
  }();
  template <class In>
  static constexpr std::size_t host_scratch = kernels::host::ConvScratch{geometry<In>}.per_thread();
  /// The Host kernels store y and dx as bf16 values themselves (bf16_y, bf16_dx), rounding each run while
  /// it is in cache rather than in a pass of their own after the stage (net/activation_storage.hpp).
  static constexpr bool host_rounds_stored = true;

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::conv2d_forward<Epi>(a.space, geometry<In>, a.batch, a.w, Bias ? a.b : nullptr, a.x, a.y, a.z,
                                       a.scratch, a.fold, a.add, a.bf16_y);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::conv2d_backward<Epi>(a.space, geometry<In>, a.batch, a.w, a.x, a.y, a.z, a.dy, a.dx, a.dw,
                                        Bias ? a.db : nullptr, a.scratch, a.bf16_dx);
  }

  /// Whether the Cuda backward of this conv with epilogue Epi forms its dz densely in the scratch before
  /// its GEMMs (kernels::cuda::forms_dense_dz of the source it reads; backward_to and backward_maxpool_to
  /// assert that they agree): not where the stage above wrote the dz (DzIn), nor where dy is the dz (an
  /// empty epilogue and no MaxPool2d<Kp> fused after it, Kp 0: ResNet's convs before a BatchNorm); a
  /// fused pooling, even of 1 x 1 windows, unpools through the argmax. CudaGroups and Residual size the
  /// Cuda scratch by it (cuda_scratch's dense_dz).
  template <class Epi, bool DzIn, int Kp = 0>
  static constexpr bool forms_dense_dz = !DzIn && (Kp > 0 || !Epi::empty);

  // Under Bf16 its input, and without an epilogue (whose derivative backward would read it in fp32) its
  // output, may be stored in 16 bits (inside blocks: net/residual.hpp; between stages: net/cuda_plan.hpp).
  template <class In>
  static constexpr bool cuda_reads_16bit = true;
  template <class In, class Epi>
  static constexpr bool cuda_writes_16bit = Epi::empty;
  // Its gradients in 16 bits: dy without an epilogue (then the dz its GEMMs read as stored), dx always
  // (through its sink).
  template <class In, class Epi>
  static constexpr bool cuda_reads_16bit_gradient = Epi::empty;
  template <class In>
  static constexpr bool cuda_writes_16bit_gradient = true;

#if FUSEDP_HAS_CUDA
  // Cuda: implicit GEMMs over NCHW/OIHW (kernels/cuda/conv2d.cuh). dy is not changed. X and Y: the
  // elements the input and the output are stored in (float; BFloat16 where CudaPlan::output_element
  // stores a group's output in 16 bits, net/cuda_plan.hpp), what a.x and a.y (or `pooled`) point to.
  template <class In>
  using cuda_tile_x = kernels::cuda::GemmTiles<In::channels>;
  template <class In>
  using cuda_tile_w = kernels::cuda::GemmTiles<In::channels * K * K>;

  // A: the element of a.add (evaluation with a BatchNorm folded in that adds a block's shortcut).
  template <class In, class Epi, class X = float, class Y = float, class A = float, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    static_assert(std::is_same_v<T, float>, "Conv2d on Cuda: the scalar type must be float");
    kernels::cuda::conv2d_forward<Epi, kernels::cuda::GemmTiles<Out>, P, X, Y, A>(
        kernels::cuda::layer_target(a.space), geometry<In>, int(a.batch), a.w, Bias ? a.b : nullptr,
        reinterpret_cast<const X*>(a.x), reinterpret_cast<Y*>(a.y), a.z, a.fold, reinterpret_cast<const A*>(a.add),
        a.bf16_y);
  }
  // DY, DX: the elements of a.dy and a.dx (cuda_reads_16bit_gradient, cuda_writes_16bit_gradient).
  template <class In, class Epi, class X = float, class Y = float, class DY = float, class DX = float, class T,
            class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    backward_to<In, Epi, false, X, Y, DY>(a, kernels::cuda::StoreSinkOf<DX>{reinterpret_cast<DX*>(a.dx), a.bf16_dx});
  }
  /// Backward with the input gradient to `sink` (kernels/cuda/gradient_sink.cuh: StoreSink{a.dx}, or
  /// the stage below's sink, which then receives its dz). DzIn: a.dy already holds this conv's dz
  /// (batch, Out, OH, OW), written by the stage above through an ActivationSink (net/cuda_plan.hpp) as
  /// kernels::cuda::received_dz_element<P, Epi> (BFloat16 under Bf16 where Epi's derivative is a mask).
  /// Without DzIn the output is read for the activation's derivative, where Epi has one: it must then be
  /// stored in fp32 (Y). DY: the element of a.dy without DzIn (BFloat16 only without an epilogue, where
  /// dy is the dz).
  template <class In, class Epi, bool DzIn, class X = float, class Y = float, class DY = float, class T, class P,
            class Sink>
  static void backward_to(const StageArgs<CudaSpace<P>, T>& a, const Sink& sink) {
    static_assert(std::is_same_v<T, float>, "Conv2d on Cuda: the scalar type must be float");
    static_assert(DzIn || std::is_same_v<Y, float> || Epi::empty,
                  "Conv2d on Cuda: an output stored in 16 bits must receive its dz from the stage above");
    using O = output<In>;
    constexpr int ohw = O::height * O::width;
    static_assert(!DzIn || std::is_same_v<DY, float>, "Conv2d on Cuda: a received dz has its own element");
    static_assert(std::is_same_v<DY, float> || Epi::empty, "Conv2d on Cuda: a 16-bit dy must be the dz");
    // A 16-bit dy without an epilogue is this conv's dz, read as stored.
    constexpr bool stored = DzIn || !std::is_same_v<DY, float>;
    using E = std::conditional_t<DzIn, kernels::cuda::received_dz_element<P, Epi>, DY>;
    using Dz = std::conditional_t<stored, kernels::cuda::StoredGradientOf<E>, kernels::cuda::ConvGradient<Epi>>;
    static_assert(kernels::cuda::forms_dense_dz<Dz>() == forms_dense_dz<Epi, DzIn>,
                  "Conv2d on Cuda: the scratch is sized by forms_dense_dz, which must say what backward does");
    if constexpr (stored)
      backward_from<In, X>(a, kernels::cuda::StoredGradientOf<E>{reinterpret_cast<const E*>(a.dy), Out, ohw, O::width},
                           sink);
    else backward_from<In, X>(a, kernels::cuda::ConvGradient<Epi>{a.dy, a.y, a.z, Out, ohw, O::width}, sink);
  }
  /// Forward of this conv and a following MaxPool2d<Kp> (stride Kp) in one GEMM: a.y is not written;
  /// `pooled` (batch, Out, OH/Kp, OW/Kp) receives the pooled values (stored as bf16 values with a.bf16_y),
  /// `argmax` one byte per pooled value. The pooled values are stored as Y.
  template <class In, class Epi, int Kp, class X = float, class Y = float, class T, class P>
  static void forward_maxpool(const StageArgs<CudaSpace<P>, T>& a, T* pooled, std::uint8_t* argmax) {
    kernels::cuda::conv2d_maxpool_forward<Epi, Kp, kernels::cuda::GemmTiles<Out>, P>(
        kernels::cuda::layer_target(a.space), geometry<In>, int(a.batch), a.w, Bias ? a.b : nullptr,
        reinterpret_cast<const X*>(a.x), reinterpret_cast<Y*>(pooled), argmax, a.bf16_y);
  }
  /// Backward of forward_maxpool, from the gradient `dpool` of the pooled values.
  template <class In, class Epi, int Kp, class T, class P>
  static void backward_maxpool(const StageArgs<CudaSpace<P>, T>& a, const T* dpool, const T* pooled,
                               const std::uint8_t* argmax) {
    backward_maxpool_to<In, Epi, Kp, false>(a, dpool, pooled, argmax, kernels::cuda::StoreSink{a.dx, a.bf16_dx});
  }
  /// backward_maxpool with the input gradient to `sink`. DzIn: `dpool` holds instead the conv's dense
  /// dz (batch, Out, OH, OW), unpooled by the stage above through an UnpoolSink (as
  /// kernels::cuda::received_dz_element<P, Epi>). With a.bf16_dx the
  /// pooling's input gradient is a stored one: dpool is rounded before it is unpooled. Without DzIn the
  /// pooled values are read: they must be stored in fp32 (Y).
  template <class In, class Epi, int Kp, bool DzIn, class X = float, class Y = float, class T, class P, class Sink>
  static void backward_maxpool_to(const StageArgs<CudaSpace<P>, T>& a, const T* dpool, const T* pooled,
                                  const std::uint8_t* argmax, const Sink& sink) {
    static_assert(DzIn || std::is_same_v<Y, float>,
                  "Conv2d on Cuda: pooled values stored in 16 bits must receive their dz from the stage above");
    using O = output<In>;
    using E = kernels::cuda::received_dz_element<P, Epi>;
    using Dz = std::conditional_t<DzIn, kernels::cuda::StoredGradientOf<E>, kernels::cuda::PooledConvGradient<Epi, Kp>>;
    static_assert(kernels::cuda::forms_dense_dz<Dz>() == forms_dense_dz<Epi, DzIn, Kp>,
                  "Conv2d on Cuda: the scratch is sized by forms_dense_dz, which must say what backward does");
    if constexpr (DzIn)
      backward_from<In, X>(a,
                        kernels::cuda::StoredGradientOf<E>{reinterpret_cast<const E*>(dpool), Out, O::height * O::width,
                                                           O::width},
                        sink);
    else
      backward_from<In, X>(
          a,
          kernels::cuda::PooledConvGradient<Epi, Kp>{dpool, pooled, argmax, Out, O::height / Kp, O::width / Kp, a.bf16_dx},
          sink);
  }
  /// The backward GEMMs from a dz source (kernels/cuda/conv2d.cuh: conv2d_backward_to), x read as X.
  template <class In, class X = float, class T, class P, class Dz, class Sink>
  static void backward_from(const StageArgs<CudaSpace<P>, T>& a, const Dz& dz, const Sink& sink) {
    kernels::cuda::conv2d_backward_to<cuda_tile_x<In>, cuda_tile_w<In>, P>(
        kernels::cuda::layer_target(a.space, a.weight_branch, name, std::int64_t(a.index)), geometry<In>, int(a.batch),
        dz, a.w, reinterpret_cast<const X*>(a.x), sink, a.dw, Bias ? a.db : nullptr, a.scratch, a.update);
  }
  /// Floats of Cuda workspace backward needs at exactly this batch size on a device of `sm_count` SMs:
  /// the dense dz where `dense_dz` (forms_dense_dz of the stage's backward; true when the caller does not
  /// know), and the split-K partial sums (see CudaGroups::scratch_elements).
  template <class In>
  static std::size_t cuda_scratch(std::size_t batch, int sm_count, bool dense_dz = true) {
    return kernels::cuda::conv2d_backward_scratch<cuda_tile_w<In>>(geometry<In>, int(batch), sm_count, dense_dz);
  }
#endif
};

namespace detail {
template <int Out, int K, int S, int P, bool B>
std::true_type conv2d_layer(const Conv2d<Out, K, S, P, B>*);
std::false_type conv2d_layer(const void*);
/// Whether layer L is a Conv2d (a Named one too: it derives from its layer), for the plans that treat
/// Conv2d stages specially (net/cuda_plan.hpp, net/cost.hpp).
template <class L>
struct is_conv2d : decltype(conv2d_layer(static_cast<const L*>(nullptr))) {};
}  // namespace detail

}  // namespace fusedp
