#pragma once
// BatchNorm2d and BatchNorm1d: per-channel normalization with PyTorch's semantics. Training steps
// normalize with the batch's statistics (biased variance) and update the running statistics (with
// the unbiased variance, by `Momentum`); predict and evaluate use the running statistics. The mode
// is the call's: Model::train_step and compute_gradients train, predict and evaluate do not.
// running_mean, running_var and num_batches_tracked live in the network's state buffer
// (Sequential::state_layout), beside the parameters and never in the gradient buffer. Momentum and Eps
// are doubles, as PyTorch holds them (a float 0.1f would move the running statistics by 1e-8).
// Under Parallel<..., batch_norm::Sync> a training pass takes its statistics over every replica's
// shard (StageArgs::sync), as PyTorch's SyncBatchNorm.
#include "fusedp/core/error.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/activation.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/host/batch_norm.hpp"
#include "fusedp/layers/layer.hpp"

#include <array>
#include <bit>
#include <cstdint>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/batch_norm.cuh"

#include <type_traits>
#endif

namespace fusedp {

namespace detail {
template <bool OneD, double Momentum, double Eps, bool Affine>
struct BatchNorm {
  static_assert(Momentum >= 0.0 && Momentum <= 1.0, "BatchNorm: Momentum must lie in [0, 1]");
  static_assert(Eps > 0.0, "BatchNorm: Eps must be positive");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  // Forward takes StageArgs::add, added before the epilogue: a residual block whose body ends here
  // runs its add (and the activation after it) in this layer's normalizing pass.
  static constexpr bool adds_before_epilogue = true;
  static constexpr const char* name = OneD ? "BatchNorm1d" : "BatchNorm2d";
  static constexpr std::array<std::uint64_t, 3> attributes{std::bit_cast<std::uint64_t>(Momentum),
                                                           std::bit_cast<std::uint64_t>(Eps), Affine ? 1u : 0u};

  // BatchNorm1d takes features (C, 1, 1); BatchNorm2d any (C, H, W).
  template <class In>
  static constexpr bool accepts = !OneD || (In::height == 1 && In::width == 1);
  template <class In>
  using expected = Shape<In::size, 1, 1>;
  template <class In>
  using output = In;

  template <class In>
  static constexpr std::array<ParamSpec, Affine ? 2 : 0> params = [] {
    std::array<ParamSpec, Affine ? 2 : 0> p{};
    if constexpr (Affine) {
      const std::size_t c = std::size_t(In::channels);
      p[0] = ParamSpec{ParamRole::weight, c, c, 1, {In::channels, 0, 0, 0}, {}, true, 1.0f, true};
      p[1] = ParamSpec{ParamRole::bias, c, c, 1, {In::channels, 0, 0, 0}, {}, true, 0.0f, true};
    }
    return p;
  }();
  template <class In>
  static constexpr std::array<StateSpec, 5> state{{
      {"running_mean", StateKind::buffer, std::size_t(In::channels), 1, {In::channels, 0, 0, 0}, 0.0f},
      {"running_var", StateKind::buffer, std::size_t(In::channels), 1, {In::channels, 0, 0, 0}, 1.0f},
      {"num_batches_tracked", StateKind::buffer, 1, 0, {0, 0, 0, 0}, 0.0f},
      {"batch_mean", StateKind::transient, std::size_t(In::channels), 1, {In::channels, 0, 0, 0}, 0.0f},
      {"batch_invstd", StateKind::transient, std::size_t(In::channels), 1, {In::channels, 0, 0, 0}, 0.0f},
  }};
  template <class In>
  static constexpr double forward_macs = 0;  // memory-bound: no GEMM
  /// The fewest samples a training batch may hold (without SyncBatchNorm): two where a channel gets
  /// one value a sample (BatchNorm1d, or 1 x 1 planes), as PyTorch asks for.
  template <class In>
  static constexpr std::size_t min_training_batch = In::height * In::width == 1 ? 2 : 1;
  template <class In>
  static constexpr kernels::BatchNormState state_offsets{std::size_t(In::channels),
                                                         align_elements(std::size_t(In::channels)),
                                                         align_elements(1)};

  /// In evaluation, the running statistics and affine parameters for the epilogue of the layer before
  /// (StageArgs::fold): that layer's pass then computes this one's output.
  static constexpr bool folds_into_previous = true;
  /// The Host kernels store y and dx as bf16 values themselves (as Conv2d's).
  static constexpr bool host_rounds_stored = true;
  template <class In, class T, class Space>
  static kernels::BatchNormFold<T> eval_fold(const StageArgs<Space, T>& a) {
    constexpr kernels::BatchNormState s = state_offsets<In>;
    return {a.state + s.running_mean(), a.state + s.running_var(), Affine ? a.w : nullptr, Affine ? a.b : nullptr,
            double(Eps)};
  }

  template <class In>
  static kernels::host::BatchNormGeometry geometry(std::size_t batch) {
    return {batch, std::size_t(In::channels), std::size_t(In::height) * std::size_t(In::width)};
  }

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    const auto g = geometry<In>(a.batch);
    require(!a.training || a.sync || g.count() > 1, name, " (layer ", a.index,
            "): training needs more than one value per channel, got a batch of ", a.batch, " x ", g.plane);
    host_sums<In> sums;  // SyncBatchNorm's per-channel sums: on the stack, so no step allocates
    kernels::host::batch_norm_forward<Epi>(a.space, g, state_offsets<In>, a.training, double(Momentum),
                                           double(Eps), Affine ? a.w : nullptr, Affine ? a.b : nullptr, a.state,
                                           a.x, a.y, a.z, a.sync, sums.data(), a.add, a.bf16_y);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    host_sums<In> sums;
    kernels::host::batch_norm_backward<Epi>(a.space, geometry<In>(a.batch), state_offsets<In>,
                                            Affine ? a.w : nullptr, a.state, a.x, a.y, a.z, a.dy, a.dx,
                                            Affine ? a.dw : nullptr, Affine ? a.db : nullptr, a.sync, sums.data(),
                                            a.bf16_dx, a.keeps_dz);
  }
  template <class In>
  using host_sums = std::array<double, kernels::batch_norm_sync_doubles(std::size_t(In::channels))>;

  // A block's inner networks (net/residual.hpp) store a BatchNorm's input and output in 16 bits under
  // Bf16 where the neighbours take them (backward reads y, for the epilogue's derivative, as stored; z,
  // where the epilogue keeps its input, is fp32).
  template <class In>
  static constexpr bool cuda_reads_16bit = true;
  template <class In, class Epi>
  static constexpr bool cuda_writes_16bit = true;
  // And its gradients: dy, which backward overwrites with dz (a bf16 value where Epi's derivative is a
  // mask), and dx.
  template <class In, class Epi>
  static constexpr bool cuda_reads_16bit_gradient = kernels::derivative_is_mask<Epi>;
  template <class In>
  static constexpr bool cuda_writes_16bit_gradient = true;

#if FUSEDP_HAS_CUDA
  // X, Y, A: the elements a.x, a.y and a.add point to (float, or kernels::BFloat16: cuda_reads_16bit,
  // cuda_writes_16bit; an add in 16 bits is a block's input or its projection's output); a.z is fp32; DY,
  // DX the elements of a.dy and a.dx (cuda_reads_16bit_gradient, cuda_writes_16bit_gradient).
  template <class In, class Epi, class X = float, class Y = float, class A = float, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    static_assert(std::is_same_v<T, float>, "BatchNorm on Cuda: the scalar type must be float");
    require(!a.training || a.sync || a.batch * std::size_t(In::height * In::width) > 1, name, " (layer ", a.index,
            "): training needs more than one value per channel, got a batch of ", a.batch, " x ",
            In::height * In::width);
    require(!a.training || a.batch * std::size_t(In::height * In::width) <= kernels::cuda::BatchNormSplit::most_values,
            name, " (layer ", a.index, "): training on Cuda takes at most ", kernels::cuda::BatchNormSplit::most_values,
            " values per channel, got a batch of ", a.batch, " x ", In::height * In::width,
            " (split the batch: Parallel's micro-batches or accumulation)");
    kernels::cuda::batch_norm_forward<Epi, X, Y, A>(
        a.space.stream(), extents<In>(a.batch), state_offsets<In>, a.training, double(Momentum), double(Eps),
        Affine ? a.w : nullptr, Affine ? a.b : nullptr, a.state, reinterpret_cast<const X*>(a.x),
        reinterpret_cast<Y*>(a.y), a.z, a.sync, device_sums(a.scratch), reinterpret_cast<const A*>(a.add), a.bf16_y);
  }
  template <class In, class Epi, class X = float, class Y = float, class DY = float, class DX = float, class T,
            class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    static_assert(std::is_same_v<DY, float> || kernels::derivative_is_mask<Epi>,
                  "BatchNorm on Cuda: a 16-bit dy must hold dz exactly (an epilogue whose derivative is a mask)");
    kernels::cuda::batch_norm_backward<Epi>(a.space.stream(), extents<In>(a.batch), state_offsets<In>,
                                            Affine ? a.w : nullptr, a.state, reinterpret_cast<const X*>(a.x),
                                            reinterpret_cast<const Y*>(a.y), a.z, reinterpret_cast<DY*>(a.dy),
                                            reinterpret_cast<DX*>(a.dx),
                                            Affine ? a.dw : nullptr, Affine ? a.db : nullptr, a.sync,
                                            device_sums(a.scratch), a.bf16_dx);
  }
  // The training passes' partial sums (or SyncBatchNorm's) in the stage's scratch (floats), at an 8-byte
  // boundary.
  template <class In>
  static std::size_t cuda_scratch(std::size_t batch, int) {
    return 2 * kernels::cuda::batch_norm_scratch_doubles(batch, In::channels, In::height * In::width) + 1;
  }
  static double* device_sums(float* scratch) {
    return reinterpret_cast<double*>((reinterpret_cast<std::uintptr_t>(scratch) + 7) & ~std::uintptr_t(7));
  }
  template <class In>
  static kernels::cuda::BatchNormExtents extents(std::size_t batch) {
    return {int(batch), In::channels, In::height * In::width};
  }
#endif
};
}  // namespace detail

/// Normalizes each channel of (C, H, W) over the batch and the plane (PyTorch's nn.BatchNorm2d).
/// @tparam Momentum weight of a batch's statistics in the running ones (PyTorch's momentum, 0.1)
/// @tparam Eps added to the variance (1e-5)
/// @tparam Affine whether it has a learned scale (weight, starts at 1) and shift (bias, starts at 0)
template <double Momentum = 0.1, double Eps = 1e-5, bool Affine = true>
struct BatchNorm2d : detail::BatchNorm<false, Momentum, Eps, Affine> {};

/// Normalizes each feature of (F, 1, 1) over the batch (PyTorch's nn.BatchNorm1d on (N, F)).
/// @tparam Momentum weight of a batch's statistics in the running ones (0.1)
/// @tparam Eps added to the variance (1e-5)
/// @tparam Affine whether it has a learned scale and shift
template <double Momentum = 0.1, double Eps = 1e-5, bool Affine = true>
struct BatchNorm1d : detail::BatchNorm<true, Momentum, Eps, Affine> {};

}  // namespace fusedp
