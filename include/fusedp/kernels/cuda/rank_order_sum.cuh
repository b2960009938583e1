#pragma once
// The rank-order sum of gathered gradients on Cuda (kernels/rank_order_sum.hpp's math, one thread per
// element): Parallel's Deterministic policy over NCCL, bit for bit what the Host computes.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/rank_order_sum.hpp"

#include <cstddef>

namespace fusedp::kernels::cuda {

namespace detail {
template <bool Bf16>
__global__ void sum_in_rank_order_kernel(const float* __restrict__ all, float* __restrict__ out, std::size_t n,
                                         int world) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) out[i] = kernels::sum_in_rank_order<Bf16>(all, n, world, i);
}
}  // namespace detail

/// out[i] = all[0 * n + i] + all[1 * n + i] + ... in rank order, from 0 (through bfloat16 when Bf16), on
/// `stream`.
template <bool Bf16>
void sum_in_rank_order(cudaStream_t stream, const float* all, float* out, std::size_t n, int world) {
  if (n == 0) return;
  launch<detail::sum_in_rank_order_kernel<Bf16>>("sum_in_rank_order_kernel (Parallel: Deterministic)",
                                                 elementwise_blocks(n), elementwise_threads, 0, stream, all, out, n,
                                                 world);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
