#pragma once
// Stand-alone pointwise stages on Cuda: an activation chain no anchor absorbed, and dropout (its mask
// recomputed in backward from the counter-based RNG, as on Host, so nothing is stored). `bf16`: the
// values written for the next stage (y, dx) are stored as bf16 values (kernels::stored_value).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/dropout.hpp"

#include <cstddef>
#include <type_traits>

namespace fusedp::kernels::cuda {

namespace detail {
template <class Epi>
__global__ void pointwise_forward_kernel(std::size_t n, const float* x, float* y, bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) y[i] = stored_value(Epi::apply(x[i]), bf16);
}
template <class Epi>
__global__ void pointwise_backward_kernel(std::size_t n, const float* x, const float* y, const float* dy, float* dx,
                                          bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride())
    dx[i] = stored_value(dy[i] * Epi::derivative(x[i], y[i]), bf16);
}
template <class Epi>
__global__ void add_forward_kernel(std::size_t n, const float* a, const float* b, float* z, float* y, bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    z[i] = a[i] + b[i];
    y[i] = stored_value(Epi::apply(z[i]), bf16);
  }
}
template <class Epi>
__global__ void epilogue_backward_kernel(std::size_t n, const float* z, const float* y, float* dy) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) dy[i] *= Epi::derivative(z[i], y[i]);
}
template <class S, class D>
__global__ void copy_values_kernel(std::size_t n, const S* src, D* dst, bool accumulate, bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride())
    store_element(dst + i, stored_value(accumulate ? to_float(dst[i]) + to_float(src[i]) : to_float(src[i]), bf16));
}
template <class T>
__global__ void dropout_kernel(std::size_t n, DropoutMask mask, bool apply, const T* x, T* y, bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride())
    y[i] = stored_value(apply ? x[i] * T(mask.scale(i)) : x[i], bf16);
}
}  // namespace detail

/// y = Epi(x) over n values.
template <class Epi>
void pointwise_forward(cudaStream_t stream, std::size_t n, const float* x, float* y, bool bf16 = false) {
  if (n == 0) return;
  launch<detail::pointwise_forward_kernel<Epi>>("pointwise_forward_kernel", elementwise_blocks(n), elementwise_threads,
                                                0, stream, n, x, y, bf16);
}

/// dx = dy * Epi'(x).
template <class Epi>
void pointwise_backward(cudaStream_t stream, std::size_t n, const float* x, const float* y, const float* dy,
                        float* dx, bool bf16 = false) {
  if (n == 0) return;
  launch<detail::pointwise_backward_kernel<Epi>>("pointwise_backward_kernel", elementwise_blocks(n),
                                                 elementwise_threads, 0, stream, n, x, y, dy, dx, bf16);
}

/// z = a + b and y = Epi(z) (a residual block's add and the activation after it); z, the saved sum,
/// stays fp32.
template <class Epi>
void add_forward(cudaStream_t stream, std::size_t n, const float* a, const float* b, float* z, float* y,
                 bool bf16 = false) {
  if (n == 0) return;
  launch<detail::add_forward_kernel<Epi>>("add_forward_kernel", elementwise_blocks(n), elementwise_threads, 0, stream,
                                          n, a, b, z, y, bf16);
}

/// dy *= Epi'(z) in place.
template <class Epi>
void epilogue_backward(cudaStream_t stream, std::size_t n, const float* z, const float* y, float* dy) {
  if (n == 0 || Epi::empty) return;
  launch<detail::epilogue_backward_kernel<Epi>>("epilogue_backward_kernel", elementwise_blocks(n), elementwise_threads,
                                                0, stream, n, z, y, dy);
}

/// dst = src, or dst += src when `accumulate`; S, D: the elements src and dst are stored in (float, or
/// kernels::BFloat16 where the values are bf16 ones: `bf16`, or a copy of 16-bit values).
template <class S = float, class D = float>
void copy_values(cudaStream_t stream, std::size_t n, const std::type_identity_t<S>* src, std::type_identity_t<D>* dst,
                 bool accumulate, bool bf16 = false) {
  if (n == 0) return;
  launch<detail::copy_values_kernel<S, D>>("copy_values_kernel", elementwise_blocks(n), elementwise_threads, 0, stream,
                                           n, src, dst, accumulate, bf16);
}

/// Dropout forward (y = x * mask in training, y = x otherwise) and backward (dx = dy * mask): the same
/// kernel, the mask a function of (seed, stream, index).
inline void dropout(cudaStream_t stream, std::size_t n, const DropoutMask& mask, bool training, const float* x,
                    float* y, bool bf16 = false) {
  if (n == 0) return;
  launch<detail::dropout_kernel<float>>("dropout_kernel", elementwise_blocks(n), elementwise_threads, 0, stream, n,
                                        mask, training, x, y, bf16);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
