#pragma once
// A test knob for backward's concurrent weight gradients (net/backward_cursor.hpp): with a delay set,
// every weight gradient forked onto the side stream first waits there for about that many clock cycles,
// so that the model's stream runs far ahead of it. A missing wait (a later step writing what the weight
// gradient still reads, a reducer starting on a bucket before its gradient) then changes the bits,
// which tests compare with the serial order (tests/gpu/model.cu); in the default timing such a race
// could pass unseen, and compute-sanitizer's racecheck does not see races between streams. Use it with
// programmatic dependent launch off (kernels/cuda/launch.cuh): on, the delay's prologue lets the weight
// gradient be scheduled at once, and its blocks, waiting on the SMs, may keep the model's stream from
// running ahead (gpu_test::HeldBranches sets both).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/kernels/cuda/launch.cuh"

#include <cuda_runtime.h>

#include <atomic>

namespace fusedp::kernels::cuda {

namespace detail {
inline std::atomic<long long>& branch_delay_cycles() {
  static std::atomic<long long> cycles{0};
  return cycles;
}

// One thread that holds its stream for about `cycles` clock cycles (a template, so that every
// translation unit may hold it).
template <class = void>
__global__ void branch_delay_kernel(long long cycles) {
  kernel_prologue();
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
}  // namespace detail

/// Clock cycles each forked weight gradient waits on the side stream first (0, the default: none). For
/// tests only; Model's step graphs are recorded again after a change.
inline void set_branch_delay(long long cycles) noexcept {
  detail::branch_delay_cycles().store(cycles < 0 ? 0 : cycles, std::memory_order_relaxed);
}
[[nodiscard]] inline long long branch_delay() noexcept {
  return detail::branch_delay_cycles().load(std::memory_order_relaxed);
}

/// Queues the delay on `stream` when one is set.
inline void delay_branch(cudaStream_t stream) {
  const long long cycles = branch_delay();
  if (cycles > 0) launch<detail::branch_delay_kernel<>>("branch_delay_kernel", 1, 1, 0, stream, cycles);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
