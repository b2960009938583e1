#pragma once
// Stand-alone pointwise stages on Cuda: an activation chain no anchor absorbed, and dropout (its mask
// recomputed in backward from the counter-based RNG, as on Host, so nothing is stored).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/dropout.hpp"

#include <cstddef>

namespace fusedp::kernels::cuda {

namespace detail {
template <class Epi>
__global__ void pointwise_forward_kernel(std::size_t n, const float* x, float* y) {
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) y[i] = Epi::apply(x[i]);
}
template <class Epi>
__global__ void pointwise_backward_kernel(std::size_t n, const float* x, const float* y, const float* dy, float* dx) {
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) dx[i] = dy[i] * Epi::derivative(x[i], y[i]);
}
template <class T>
__global__ void dropout_kernel(std::size_t n, DropoutMask mask, bool apply, const T* x, T* y) {
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) y[i] = apply ? x[i] * T(mask.scale(i)) : x[i];
}
}  // namespace detail

/// y = Epi(x) over n values.
template <class Epi>
void pointwise_forward(cudaStream_t stream, std::size_t n, const float* x, float* y) {
  if (n == 0) return;
  detail::pointwise_forward_kernel<Epi><<<elementwise_blocks(n), elementwise_threads, 0, stream>>>(n, x, y);
  FUSEDP_CUDA_CHECK_LAUNCH("pointwise_forward_kernel");
}

/// dx = dy * Epi'(x).
template <class Epi>
void pointwise_backward(cudaStream_t stream, std::size_t n, const float* x, const float* y, const float* dy,
                        float* dx) {
  if (n == 0) return;
  detail::pointwise_backward_kernel<Epi><<<elementwise_blocks(n), elementwise_threads, 0, stream>>>(n, x, y, dy, dx);
  FUSEDP_CUDA_CHECK_LAUNCH("pointwise_backward_kernel");
}

/// Dropout forward (y = x * mask in training, y = x otherwise) and backward (dx = dy * mask): the same
/// kernel, the mask a function of (seed, stream, index).
inline void dropout(cudaStream_t stream, std::size_t n, const DropoutMask& mask, bool training, const float* x,
                    float* y) {
  if (n == 0) return;
  detail::dropout_kernel<float><<<elementwise_blocks(n), elementwise_threads, 0, stream>>>(n, mask, training, x, y);
  FUSEDP_CUDA_CHECK_LAUNCH("dropout_kernel");
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
