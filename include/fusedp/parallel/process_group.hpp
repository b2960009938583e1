#pragma once
// ProcessGroup: this process among the processes of a data-parallel job. Alone (replicas in this process
// only), or one rank of an MpiWorld (mpirun). The collectives of the job's host values (the loss of a
// step, sample counts, evaluation sums, the steps every rank agrees on) go through it; alone each is the
// identity. The one place where a Parallel asks whether it runs under MPI.
#include "fusedp/core/config.hpp"
#include "fusedp/parallel/mpi.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace fusedp::parallel {

class ProcessGroup {
 public:
  /// This process alone.
  ProcessGroup() = default;
#if FUSEDP_WITH_MPI
  /// This rank of `world`; each collective waits at most `timeout` (see MpiCommunicator).
  ProcessGroup(const MpiWorld& world, std::chrono::milliseconds timeout) : mpi_(std::in_place, world, timeout) {}
  /// The MPI communicator of the job, or nullptr when this process is alone.
  [[nodiscard]] MpiCommunicator* mpi() noexcept { return mpi_ ? &*mpi_ : nullptr; }
#endif

  [[nodiscard]] bool under_mpi() const noexcept {
#if FUSEDP_WITH_MPI
    return mpi_.has_value();
#else
    return false;
#endif
  }
  /// This process's rank (0 when alone) and the number of processes.
  [[nodiscard]] int rank() const noexcept {
#if FUSEDP_WITH_MPI
    if (mpi_) return mpi_->rank();
#endif
    return 0;
  }
  [[nodiscard]] int size() const noexcept {
#if FUSEDP_WITH_MPI
    if (mpi_) return mpi_->size();
#endif
    return 1;
  }

  /// Sums `n` values over the processes, in place.
  template <class T>
  void all_reduce_sum(T* values, std::size_t n) const {
#if FUSEDP_WITH_MPI
    if (mpi_) mpi_->all_reduce_sum(values, n);
#else
    (void)values;
    (void)n;
#endif
  }
  /// The smallest of every process's `local`.
  [[nodiscard]] std::size_t min(std::size_t local) const {
#if FUSEDP_WITH_MPI
    if (mpi_) {
      std::vector<std::uint64_t> all(std::size_t(mpi_->size()));
      const std::uint64_t mine = local;
      mpi_->all_gather(&mine, all.data(), 1);
      return std::size_t(*std::min_element(all.begin(), all.end()));
    }
#endif
    return local;
  }

 private:
#if FUSEDP_WITH_MPI
  std::optional<MpiCommunicator> mpi_;
#endif
};

}  // namespace fusedp::parallel
