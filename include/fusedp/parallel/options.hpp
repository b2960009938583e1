#pragma once
// What a Parallel<> is made from (Replicas, Devices, ParallelOptions) and what its evaluation returns.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace fusedp {

/// Replicas in this process: `count` models, each with `threads_per_replica` Host threads (0: the
/// CPUs this process may use, cpu_budget(), divided among the replicas, at least one each).
struct Replicas {
  int count = 1;
  int threads_per_replica = 0;
};
constexpr Replicas replicas(int count, int threads_per_replica = 0) { return {count, threads_per_replica}; }

/// Cuda replicas in this process: one on each listed device (`fp::Devices{0, 1, 2, 3}`).
struct Devices {
  std::vector<int> ids;
  Devices(std::initializer_list<int> list) : ids(list) {}
  explicit Devices(std::vector<int> list) : ids(std::move(list)) {}
};
/// `devices(0, 1)`: the same as Devices{0, 1}.
template <class... Ids>
Devices devices(Ids... ids) {
  return Devices{int(ids)...};
}

struct ParallelOptions {
  /// MPI: Host threads of this rank's replica (0: the CPUs this process may use divided
  /// among the ranks that share them: CpuBudget::per_process).
  int threads = 0;
  /// MPI: how long each collective (the start-up check included) waits for every rank before it
  /// throws DeviceError naming the rank that stopped responding (FUSEDP_COLLECTIVE_TIMEOUT, in
  /// seconds, overrides it; see parallel/mpi.hpp). Cuda: also how long NCCL's start-up and each
  /// step's collectives may take before the communicator is aborted and the step throws (a dead peer
  /// never hangs the job).
  std::chrono::milliseconds timeout{60000};
  /// Cuda with MPI: this rank's device (-1: its rank among the ranks of its machine).
  int device = -1;
  /// Any value that every rank must share, e.g. a hash of the command line's flags.
  std::uint64_t agree_on = 0;
  /// Gradient accumulation: each replica cuts its shard of a step into this many micro-batches, runs
  /// them one after the other (activations for one micro-batch at a time) and sums their gradients
  /// before the one reduction and update of the step. A step's batch is then `accumulate` times the
  /// micro-batch. Every rank must give the same value (checked at start-up). See
  /// parallel/detail/accumulate.hpp.
  int accumulate = 1;
  /// The capacity of a gradient bucket in bytes, instead of the Bucket<bytes> policy's (0: the
  /// policy's). Every rank must give the same value (checked at start-up).
  std::size_t bucket_bytes = 0;
  /// Host: the precision of every replica's GEMMs (HostPrecision::bf16 needs AVX-512 BF16; checked at
  /// construction, and under MPI every rank must give the same value). Cuda: the space type's
  /// precision decides; anything but fp32 here is an error.
  HostPrecision host_precision = HostPrecision::fp32;
  /// Cuda: whether each replica's backward runs its weight gradients beside the next layer's backward
  /// (Model::use_backward_branches; on by default). The order of a step's collectives depends on it
  /// where BatchNorm is synchronized, so under MPI every rank must give the same value (checked at
  /// start-up). Host has no branches: ignored there.
  bool backward_branches = true;
};

namespace parallel {
/// The bucket capacity in bytes of a Parallel with resolved policy set Policy: ParallelOptions::bucket_bytes,
/// or the Bucket<bytes> policy's (0: one bucket).
template <class Policy>
constexpr std::size_t bucket_capacity(const ParallelOptions& o) noexcept {
  return o.bucket_bytes > 0 ? o.bucket_bytes : Policy::bucket_bytes;
}
}  // namespace parallel

/// Loss and accuracy summed over every rank's evaluation samples.
struct GlobalEvaluation {
  double loss_sum = 0;
  std::size_t correct = 0;
  std::size_t count = 0;
  [[nodiscard]] double loss() const { return count ? loss_sum / double(count) : 0.0; }
  [[nodiscard]] double accuracy() const { return count ? double(correct) / double(count) : 0.0; }
};

}  // namespace fusedp
