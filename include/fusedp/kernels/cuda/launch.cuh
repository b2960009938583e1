#pragma once
// Launch shapes of the elementwise kernels: grid-stride loops over n elements, with a grid large enough
// to fill any current device and small enough for CUDA's limits whatever n is.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include <algorithm>
#include <cstddef>

namespace fusedp::kernels::cuda {

/// Threads per block of the elementwise kernels.
inline constexpr int elementwise_threads = 256;

/// Blocks for n elements: one element per thread up to 2^16 blocks (16.7 M threads, far beyond what
/// any device runs at once), then the grid-stride loop takes over.
inline unsigned elementwise_blocks(std::size_t n) {
  const std::size_t blocks = (n + elementwise_threads - 1) / elementwise_threads;
  return unsigned(std::clamp<std::size_t>(blocks, 1, std::size_t(1) << 16));
}

/// The first index of this thread and the stride of a grid-stride loop.
__device__ FUSEDP_ALWAYS_INLINE std::size_t grid_index() {
  return std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ FUSEDP_ALWAYS_INLINE std::size_t grid_stride() { return std::size_t(gridDim.x) * blockDim.x; }

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
