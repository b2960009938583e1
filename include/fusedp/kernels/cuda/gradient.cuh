#pragma once
// Whole-gradient passes on the device, the Cuda twin of kernels/host/gradient.hpp: the sum of squares
// (in double) with the index of the first element that is not finite, for a guarded update (clipping by
// global norm, catching NaN); scaling; and the bfloat16 packing of a gradient (Compress<bf16>).
//
// The statistics take two small launches (per-block partials, then one block adding them in a fixed
// order), so the result is the same bits run to run; a guarded step reads the 16-byte result once.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/launch.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fusedp::kernels::cuda {

/// Statistics of a gradient, or of a part of it, as the device writes them. Parts combine by adding
/// sum_squares and taking the smallest first_nonfinite (NCCL: ncclSum on the double, ncclMin on the
/// index), so ranks that each hold a part agree on the whole.
struct DeviceGradientStats {
  double sum_squares = 0;
  unsigned long long first_nonfinite = ~0ull;  ///< index in the flat buffer; ~0: every element is finite
  [[nodiscard]] FUSEDP_HD bool finite() const { return first_nonfinite == ~0ull; }
};

namespace detail {
inline constexpr int stats_threads = 256;
// Partials of at most this many blocks: enough to fill a device for a pass this short.
inline constexpr int stats_blocks = 1024;

__device__ FUSEDP_ALWAYS_INLINE void combine(DeviceGradientStats& a, const DeviceGradientStats& b) {
  a.sum_squares += b.sum_squares;
  a.first_nonfinite = b.first_nonfinite < a.first_nonfinite ? b.first_nonfinite : a.first_nonfinite;
}

// Adds up every thread's stats of this block in a fixed tree order; thread 0 gets the block's.
__device__ FUSEDP_ALWAYS_INLINE DeviceGradientStats block_combine(DeviceGradientStats mine) {
  __shared__ double sums[stats_threads];
  __shared__ unsigned long long firsts[stats_threads];
  sums[threadIdx.x] = mine.sum_squares;
  firsts[threadIdx.x] = mine.first_nonfinite;
  __syncthreads();
  for (unsigned half = stats_threads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      sums[threadIdx.x] += sums[threadIdx.x + half];
      if (firsts[threadIdx.x + half] < firsts[threadIdx.x]) firsts[threadIdx.x] = firsts[threadIdx.x + half];
    }
    __syncthreads();
  }
  return {sums[0], firsts[0]};
}

// partials[block]: the stats of the elements this block's threads visit; indices are base + i.
template <class T>
__global__ void __launch_bounds__(stats_threads)
    gradient_partials_kernel(const T* g, std::size_t n, unsigned long long base, DeviceGradientStats* partials) {
  kernel_prologue();
  DeviceGradientStats mine;
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    const double v = double(g[i]);
    mine.sum_squares += v * v;
    if (!isfinite(v) && base + i < mine.first_nonfinite) mine.first_nonfinite = base + i;
  }
  const DeviceGradientStats block = block_combine(mine);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

template <int = 0>
__global__ void __launch_bounds__(stats_threads)
    gradient_total_kernel(const DeviceGradientStats* partials, int count, DeviceGradientStats* out) {
  kernel_prologue();
  DeviceGradientStats mine;
  for (int b = int(threadIdx.x); b < count; b += stats_threads) combine(mine, partials[b]);
  const DeviceGradientStats all = block_combine(mine);
  if (threadIdx.x == 0) *out = all;
}

template <class T>
__global__ void scale_gradient_kernel(T* g, std::size_t n, T factor) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) g[i] *= factor;
}

template <int = 0>
__global__ void pack_bf16_kernel(const float* __restrict__ g, std::uint16_t* __restrict__ packed, std::size_t n) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) packed[i] = to_bf16(g[i]);
}
template <int = 0>
__global__ void unpack_bf16_kernel(const std::uint16_t* __restrict__ packed, float* __restrict__ g, std::size_t n) {
  kernel_prologue();
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) g[i] = from_bf16(packed[i]);
}
}  // namespace detail

/// Device memory for one gradient-statistics pass at a time: the per-block partials and the result.
/// Allocated on the device current at construction.
class GradientStatsBuffer {
 public:
  GradientStatsBuffer() = default;
  /// `allocate`: an empty object (the default) allocates nothing, for owners that may never need it.
  explicit GradientStatsBuffer(bool allocate) {
    if (allocate) {
      partials_ = DeviceBuffer<DeviceGradientStats>(detail::stats_blocks);
      result_ = DeviceBuffer<DeviceGradientStats>(1);
      host_ = PinnedBuffer<DeviceGradientStats>(1);
    }
  }
  [[nodiscard]] bool allocated() const noexcept { return result_.size() != 0; }
  /// Bytes held on the device and in pinned host memory.
  [[nodiscard]] std::size_t device_bytes() const noexcept { return partials_.size_bytes() + result_.size_bytes(); }
  [[nodiscard]] std::size_t pinned_bytes() const noexcept { return host_.size_bytes(); }

  /// Queues the stats of g[0, n) on `stream` into result(); element i is counted as index base + i.
  /// n may be 0 (the result is then {0, all finite}).
  template <class T>
  void enqueue(cudaStream_t stream, const T* g, std::size_t n, std::size_t base = 0) {
    const int blocks = int(std::min<std::size_t>(elementwise_blocks(n), std::size_t(detail::stats_blocks)));
    launch<detail::gradient_partials_kernel<T>>("gradient_partials_kernel", blocks, detail::stats_threads, 0, stream, g,
                                                n, (unsigned long long)base, partials_.data());
    launch<detail::gradient_total_kernel<>>("gradient_total_kernel", 1, detail::stats_threads, 0, stream,
                                            partials_.data(), blocks, result_.data());
  }
  /// The result on the device (a collective may combine it with other ranks' in place).
  [[nodiscard]] DeviceGradientStats* result() noexcept { return result_.data(); }
  /// Queues the copy of result() to host memory on `stream`; host() reads it once the stream is done.
  void copy_to_host(cudaStream_t stream) { copy_async(host_.data(), result_.data(), 1, stream); }
  [[nodiscard]] const DeviceGradientStats& host() const noexcept { return host_[0]; }

 private:
  DeviceBuffer<DeviceGradientStats> partials_;
  DeviceBuffer<DeviceGradientStats> result_;
  PinnedBuffer<DeviceGradientStats> host_;
};

/// g[i] *= factor for i < n, on `stream` (the Host's scale_gradient: the same float product).
template <class T>
void scale_gradient(cudaStream_t stream, T* g, std::size_t n, T factor) {
  if (n == 0) return;
  launch<detail::scale_gradient_kernel<T>>("scale_gradient_kernel", elementwise_blocks(n), elementwise_threads, 0,
                                           stream, g, n, factor);
}

/// packed[i] = bfloat16 of g[i], rounded to nearest even (kernels/bf16.hpp), on `stream`.
inline void pack_bf16(cudaStream_t stream, const float* g, std::uint16_t* packed, std::size_t n) {
  if (n == 0) return;
  launch<detail::pack_bf16_kernel<>>("pack_bf16_kernel", elementwise_blocks(n), elementwise_threads, 0, stream, g,
                                     packed, n);
}
/// g[i] = the float of bfloat16 packed[i], on `stream`.
inline void unpack_bf16(cudaStream_t stream, const std::uint16_t* packed, float* g, std::size_t n) {
  if (n == 0) return;
  launch<detail::unpack_bf16_kernel<>>("unpack_bf16_kernel", elementwise_blocks(n), elementwise_threads, 0, stream,
                                       packed, g, n);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
