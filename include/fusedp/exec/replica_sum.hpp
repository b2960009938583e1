#pragma once
// ReplicaSum: sums a few doubles over every replica taking part in a data-parallel step, in place
// (what SyncBatchNorm needs in the middle of forward and backward: per-channel sums over the global
// batch). Type-erased, so that layers and kernels call it without seeing parallel/: Parallel<> fills
// it from its communicator for the length of a step, and it stays empty everywhere else. On Host the
// values are host memory and the call returns when the sum is there; on Cuda they are device memory
// and the sum is queued after the work on the given stream, and the stream's later work after it.
#include <cstddef>

namespace fusedp {

struct ReplicaSum {
  using function = void (*)(void* context, double* values, std::size_t n, void* stream);
  void* context = nullptr;
  function sum = nullptr;

  /// Whether there is a group to sum over (false outside Parallel<..., batch_norm::Sync>).
  [[nodiscard]] explicit operator bool() const noexcept { return sum != nullptr; }
  /// Sums `n` values in place over the replicas; `stream` is the Cuda stream (a cudaStream_t) the
  /// values are written on, null on Host.
  void operator()(double* values, std::size_t n, void* stream = nullptr) const { sum(context, values, n, stream); }
};

}  // namespace fusedp
