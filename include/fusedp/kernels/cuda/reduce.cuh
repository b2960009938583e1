#pragma once
// A deterministic block-wide sum: a butterfly over the lanes of each warp, then the first warp over
// the warps' sums. Every thread's value enters in the same position on every run, so the sum does not
// depend on scheduling. (cub::BlockReduce does the same; including CUB costs about 3 s of nvcc time in
// every translation unit that sees a loss header, measured on the 2-core CI machine, which is why the
// twenty lines below stand in for it.)
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
namespace fusedp::kernels::cuda {

/// Sum of `v` over the `Threads` threads of the block (Threads a multiple of 32, at most 1024); the
/// result is valid in thread 0. `scratch` holds Threads / 32 floats of shared memory. Every thread of
/// the block must call it.
template <int Threads>
__device__ float block_sum(float v, float* scratch) {
  static_assert(Threads % 32 == 0 && Threads <= 1024, "block_sum: whole warps, at most 32 of them");
  constexpr int warps = Threads / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) {
    total = lane < warps ? scratch[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  }
  return total;
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
