#pragma once
// MPI between processes and machines: the world (initialized once per process), and a communicator with
// the collectives Parallel<> needs, each checked: a failure throws DeviceError naming the call, the MPI
// error code and text, and the rank. Compiled only where <mpi.h> is on the include path (link
// fusedp::mpi, or MPI::MPI_CXX); elsewhere this header declares nothing.
#include "fusedp/core/config.hpp"

#include <cstdlib>
#include <initializer_list>

namespace fusedp {
/// Whether this process was started by mpirun/mpiexec (Open MPI, MPICH, Slurm's PMI) with more than
/// one rank. Needs no MPI library, so a program built without MPI can say so instead of running alone.
inline bool launched_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(var)) return std::atoi(v) > 1;
  return false;
}
}  // namespace fusedp

#if __has_include(<mpi.h>)
#include "fusedp/core/error.hpp"
#include "fusedp/kernels/bf16.hpp"

// Only MPI's C API is used; its deprecated C++ bindings would only add warnings.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define FUSEDP_HAS_MPI 1

namespace fusedp {

namespace detail {
inline int mpi_world_rank() noexcept {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  throw DeviceError(call, code, length > 0 ? std::string(text, std::size_t(length)) : "unknown MPI error",
                    mpi_world_rank());
}
}  // namespace detail

/// Checks an MPI call; the communicators fusedp uses return errors instead of aborting.
#define FUSEDP_MPI_CHECK(call) ::fusedp::detail::mpi_check((call), #call)

/// The MPI world of this process. The first MpiWorld initializes MPI (threads: funneled, since only the
/// thread that calls Parallel's methods talks to MPI) and the last one to go finalizes it, unless MPI
/// was initialized by someone else. Launch with mpirun; a plain start is a world of one.
class MpiWorld {
 public:
  MpiWorld() : MpiWorld(nullptr, nullptr) {}
  MpiWorld(int* argc, char*** argv) {
    int initialized = 0;
    FUSEDP_MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
      int provided = 0;
      FUSEDP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
      owner_ = true;
    }
    FUSEDP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    FUSEDP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    FUSEDP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    FUSEDP_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_Comm local = MPI_COMM_NULL;
    FUSEDP_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
    FUSEDP_MPI_CHECK(MPI_Comm_rank(local, &local_rank_));
    FUSEDP_MPI_CHECK(MPI_Comm_free(&local));
  }
  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;
  ~MpiWorld() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owner_ && !finalized) MPI_Finalize();
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// Rank among the processes on this machine (to pick a GPU).
  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  bool owner_ = false;
};

namespace parallel {

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return MPI_UINT16_T;
  else static_assert(sizeof(T) == 0, "fusedp: no MPI datatype for this type");
}

namespace detail {
// Sums bf16 values in float and rounds back: the reduction operator of Compress<bf16>.
inline void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = kernels::to_bf16(kernels::from_bf16(a[i]) + kernels::from_bf16(b[i]));
}
}  // namespace detail

/// The collectives of Parallel<> over MPI, on a communicator that returns errors. Counts above INT_MAX
/// are split into several calls.
class MpiCommunicator {
 public:
  explicit MpiCommunicator(const MpiWorld& world) : comm_(world.comm()), rank_(world.rank()), size_(world.size()) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  template <class T>
  void all_reduce_sum(T* data, std::size_t n) const {
    for_chunks(n, [&](std::size_t off, int count) {
      FUSEDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + off, count, mpi_type<T>(), MPI_SUM, comm_));
    });
  }
  /// Starts a sum in place; finish with wait_all.
  template <class T>
  void start_all_reduce_sum(T* data, std::size_t n, std::vector<MPI_Request>& requests) const {
    for_chunks(n, [&](std::size_t off, int count) {
      MPI_Request r = MPI_REQUEST_NULL;
      FUSEDP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + off, count, mpi_type<T>(), MPI_SUM, comm_, &r));
      requests.push_back(r);
    });
  }
  static void wait_all(std::vector<MPI_Request>& requests) {
    if (requests.empty()) return;
    FUSEDP_MPI_CHECK(MPI_Waitall(int(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
    requests.clear();
  }
  /// Sums bf16 values (stored as uint16) in place.
  void all_reduce_sum_bf16(std::uint16_t* data, std::size_t n) const {
    for_chunks(n, [&](std::size_t off, int count) {
      FUSEDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + off, count, MPI_UINT16_T, bf16_op(), comm_));
    });
  }
  template <class T>
  void reduce_sum(T* data, std::size_t n, int root) const {
    for_chunks(n, [&](std::size_t off, int count) {
      FUSEDP_MPI_CHECK(MPI_Reduce(rank_ == root ? MPI_IN_PLACE : data + off, data + off, count, mpi_type<T>(), MPI_SUM,
                                  root, comm_));
    });
  }
  template <class T>
  void broadcast(T* data, std::size_t n, int root) const {
    for_chunks(n, [&](std::size_t off, int count) {
      FUSEDP_MPI_CHECK(MPI_Bcast(data + off, count, mpi_type<T>(), root, comm_));
    });
  }
  /// Every rank's `n` values, in rank order, into `all` (size() x n).
  template <class T>
  void all_gather(const T* mine, T* all, std::size_t n) const {
    require(n <= std::size_t(INT_MAX), "MpiCommunicator::all_gather: ", n, " values per rank is too many");
    FUSEDP_MPI_CHECK(MPI_Allgather(mine, int(n), mpi_type<T>(), all, int(n), mpi_type<T>(), comm_));
  }
  /// In place: rank r's block [displs[r], displs[r] + counts[r]) of `data` reaches every rank.
  template <class T>
  void all_gather_blocks(T* data, const std::vector<int>& counts, const std::vector<int>& displs) const {
    FUSEDP_MPI_CHECK(
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), displs.data(), mpi_type<T>(), comm_));
  }
  /// Sums `data` over ranks; rank r receives block r ([displs[r], displs[r] + counts[r])) in place,
  /// through `scratch` (counts[r] values); the rest of `data` keeps this rank's own values.
  template <class T>
  void reduce_scatter_blocks(T* data, const std::vector<int>& counts, const std::vector<int>& displs, T* scratch) const {
    const auto r = std::size_t(rank_);
    FUSEDP_MPI_CHECK(MPI_Reduce_scatter(data, scratch, counts.data(), mpi_type<T>(), MPI_SUM, comm_));
    std::copy(scratch, scratch + counts[r], data + displs[r]);
  }

  /// All-gather that gives up after `timeout`: a rank that never arrives makes every other rank stop
  /// with a message instead of hanging. A pending collective cannot be cancelled, so on timeout the
  /// job is aborted (MPI_Abort) after the message is printed.
  template <class T>
  void all_gather_or_abort(const T* mine, T* all, std::size_t n, std::chrono::milliseconds timeout,
                           const char* what) const {
    MPI_Request r = MPI_REQUEST_NULL;
    FUSEDP_MPI_CHECK(MPI_Iallgather(mine, int(n), mpi_type<T>(), all, int(n), mpi_type<T>(), comm_, &r));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int done = 0;;) {
      FUSEDP_MPI_CHECK(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "fusedp: rank %d: %s: not every one of the %d ranks arrived within %lld ms; aborting\n",
                     rank_, what, size_, static_cast<long long>(timeout.count()));
        std::fflush(stderr);
        MPI_Abort(comm_, 1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  template <class F>
  static void for_chunks(std::size_t n, F&& f) {
    constexpr std::size_t chunk = std::size_t(INT_MAX) / 2;
    for (std::size_t off = 0; off < n; off += chunk) f(off, int(std::min(chunk, n - off)));
  }
  static MPI_Op bf16_op() {
    static MPI_Op op = [] {
      MPI_Op o = MPI_OP_NULL;
      FUSEDP_MPI_CHECK(MPI_Op_create(&detail::bf16_sum, 1, &o));
      return o;
    }();
    return op;
  }
  MPI_Comm comm_;
  int rank_;
  int size_;
};

}  // namespace parallel
}  // namespace fusedp
#else
#define FUSEDP_HAS_MPI 0
#endif
