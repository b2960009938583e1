#pragma once
// Global average pooling on Cuda: one thread per (sample, channel) plane forward; one thread per input
// value backward (each reads its plane's gradient, so nothing is written twice).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/launch.cuh"

#include <cstddef>

namespace fusedp::kernels::cuda {

namespace detail {
template <class Epi>
__global__ void global_avg_pool_forward_kernel(std::size_t planes, int plane, const float* x, float* y, float* z,
                                               bool bf16) {
  kernel_prologue();
  for (std::size_t p = grid_index(); p < planes; p += grid_stride()) {
    float s = 0.0f;
    for (int i = 0; i < plane; ++i) s += x[p * plane + i];
    const float v = s / float(plane);
    if constexpr (Epi::saves_input) z[p] = v;
    y[p] = stored_value(Epi::apply(v), bf16);
  }
}
template <class Epi>
__global__ void global_avg_pool_backward_kernel(std::size_t n, int plane, const float* y, const float* z,
                                                const float* dy, float* dx, bool bf16) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    const std::size_t p = i / plane;
    float d = dy[p];
    if constexpr (!Epi::empty) d *= Epi::derivative(z ? z[p] : y[p], y[p]);
    dx[i] = stored_value(d / float(plane), bf16);
  }
}
}  // namespace detail

/// y = Epi(mean of each plane of x), z before Epi when Epi saves it; `bf16`: y stored as bf16 values.
template <class Epi>
void global_avg_pool_forward(cudaStream_t stream, std::size_t planes, int plane, const float* x, float* y, float* z,
                             bool bf16 = false) {
  launch<detail::global_avg_pool_forward_kernel<Epi>>("global_avg_pool_forward_kernel", elementwise_blocks(planes),
                                                      elementwise_threads, 0, stream, planes, plane, x, y, z, bf16);
}

/// dx from dy (dy itself is not changed); `bf16`: dx stored as bf16 values.
template <class Epi>
void global_avg_pool_backward(cudaStream_t stream, std::size_t planes, int plane, const float* y, const float* z,
                              const float* dy, float* dx, bool bf16 = false) {
  const std::size_t n = planes * std::size_t(plane);
  launch<detail::global_avg_pool_backward_kernel<Epi>>("global_avg_pool_backward_kernel", elementwise_blocks(n),
                                                       elementwise_threads, 0, stream, n, plane, y, z, dy, dx, bf16);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
