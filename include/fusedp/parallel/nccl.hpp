#pragma once
// NCCL between GPUs: an owning communicator, its bootstrap (one process driving several devices, or one
// process per rank with the unique id sent over MPI), the collectives Parallel<Net, Cuda> needs, and a
// wait that never hangs on a dead peer. Every call is checked: a failure throws DeviceError naming the
// call, NCCL's error string (with its last-error detail) and the rank.
//
// Compiled only by nvcc (FUSEDP_HAS_CUDA) where the build asks for NCCL (FUSEDP_WITH_NCCL=1, which
// linking fusedp::cuda defines; see core/config.hpp); elsewhere this header declares nothing.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_NCCL
#if !__has_include(<nccl.h>)
#error "fusedp: FUSEDP_WITH_NCCL is 1 but <nccl.h> is not on the include path: link fusedp::cuda (or NCCL::NCCL), or build without FUSEDP_WITH_NCCL"
#endif
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/parallel/mpi.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedp::parallel {

namespace detail {
inline std::string nccl_message(ncclResult_t code, ncclComm_t comm) {
  std::string m = ncclGetErrorString(code);
  // The last error names the cause NCCL saw (a missing peer, an unsupported device, ...).
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  return m;
}
inline void nccl_check(ncclResult_t code, const char* call, int rank, ncclComm_t comm = nullptr) {
  if (code != ncclSuccess && code != ncclInProgress) throw DeviceError(call, int(code), nccl_message(code, comm), rank);
}
}  // namespace detail

template <class T>
ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat;
  else if constexpr (std::is_same_v<T, double>) return ncclDouble;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return ncclUint64;
  else if constexpr (std::is_same_v<T, unsigned long long> && sizeof(T) == 8) return ncclUint64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else static_assert(sizeof(T) == 0, "fusedp: no NCCL datatype for this type");
}

/// Starts an NCCL group on construction and ends it in end() (checked) or, if end() was not reached
/// (an exception), in the destructor: collectives queued in between on several communicators of this
/// process are launched together, as NCCL requires when one thread drives several devices.
class NcclGroup {
 public:
  explicit NcclGroup(int rank = -1) : rank_(rank) { detail::nccl_check(ncclGroupStart(), "ncclGroupStart", rank_); }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  /// Ends the group. With non-blocking communicators the result may be ncclInProgress: the members'
  /// wait_ready() then finish it.
  ncclResult_t end() {
    open_ = false;
    const ncclResult_t code = ncclGroupEnd();
    detail::nccl_check(code, "ncclGroupEnd", rank_);
    return code;
  }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }

 private:
  int rank_;
  bool open_ = true;
};

/// One NCCL communicator (one rank on one device). Move-only; destroyed with ncclCommDestroy, or aborted
/// with ncclCommAbort when a wait ran out of time or NCCL reported an asynchronous error (a dead peer, a
/// network failure), after which every call throws.
class NcclCommunicator {
 public:
  using clock = std::chrono::steady_clock;

  NcclCommunicator() = default;

  /// Rank `rank` of `size` on `device`, joining the others that use `id` (ncclCommInitRank, made
  /// non-blocking so that a rank that never arrives makes this one give up after `timeout`: the
  /// communicator is then aborted and DeviceError names this rank).
  NcclCommunicator(const ncclUniqueId& id, int rank, int size, int device, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), device_(device), timeout_(timeout) {
    require(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank, " of ", size);
    FUSEDP_CUDA_CHECK(cudaSetDevice(device));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t code = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    if (code != ncclSuccess && code != ncclInProgress) {
      if (comm_ != nullptr) (void)ncclCommAbort(std::exchange(comm_, nullptr));
      throw DeviceError("ncclCommInitRankConfig", int(code), detail::nccl_message(code, nullptr), rank);
    }
    wait_ready("ncclCommInitRankConfig (waiting for every rank to join)");
  }

  /// One communicator per device of `devices`, all in this process (ncclCommInitAll): rank i runs on
  /// devices[i]. Drive them from one thread inside an NcclGroup, or from one thread each.
  [[nodiscard]] static std::vector<NcclCommunicator> init_all(std::span<const int> devices,
                                                              std::chrono::milliseconds timeout) {
    require(!devices.empty(), "NcclCommunicator::init_all: no devices");
    std::vector<ncclComm_t> comms(devices.size(), nullptr);
    const ncclResult_t code = ncclCommInitAll(comms.data(), int(devices.size()), devices.data());
    detail::nccl_check(code, "ncclCommInitAll", 0);
    std::vector<NcclCommunicator> all(devices.size());
    for (std::size_t i = 0; i < devices.size(); ++i) {
      all[i].comm_ = comms[i];
      all[i].rank_ = int(i);
      all[i].size_ = int(devices.size());
      all[i].device_ = devices[i];
      all[i].timeout_ = timeout;
    }
    return all;
  }

  /// A unique id for a new clique (ncclGetUniqueId); rank 0 makes it and the others receive it.
  [[nodiscard]] static ncclUniqueId unique_id() {
    ncclUniqueId id{};
    detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", -1);
    return id;
  }

#if FUSEDP_WITH_MPI
  /// This rank of `world` on `device`: rank 0 makes the unique id and sends it to every rank over MPI,
  /// then every rank joins (giving up after `timeout`, see the constructor).
  [[nodiscard]] static NcclCommunicator from_mpi(const MpiWorld& world, int device, std::chrono::milliseconds timeout) {
    static_assert(sizeof(ncclUniqueId) % sizeof(std::uint64_t) == 0);
    std::array<std::uint64_t, sizeof(ncclUniqueId) / sizeof(std::uint64_t)> words{};
    if (world.rank() == 0) {
      const ncclUniqueId id = unique_id();
      std::memcpy(words.data(), &id, sizeof id);
    }
    MpiCommunicator(world).broadcast(words.data(), words.size(), 0);
    ncclUniqueId id{};
    std::memcpy(&id, words.data(), sizeof id);
    return NcclCommunicator(id, world.rank(), world.size(), device, timeout);
  }
#endif

  NcclCommunicator(NcclCommunicator&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)), rank_(o.rank_), size_(o.size_), device_(o.device_), timeout_(o.timeout_) {}
  NcclCommunicator& operator=(NcclCommunicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, nullptr);
      rank_ = o.rank_;
      size_ = o.size_;
      device_ = o.device_;
      timeout_ = o.timeout_;
    }
    return *this;
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator() { release(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }
  [[nodiscard]] bool valid() const noexcept { return comm_ != nullptr; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Sums `n` values of every rank into `data` in place, on `stream`.
  template <class T>
  void all_reduce_sum(T* data, std::size_t n, cudaStream_t stream) {
    issue(ncclAllReduce(data, data, n, nccl_type<T>(), ncclSum, live("ncclAllReduce"), stream), "ncclAllReduce");
  }
  /// The smallest of every rank's `n` values into `data` in place, on `stream`.
  template <class T>
  void all_reduce_min(T* data, std::size_t n, cudaStream_t stream) {
    issue(ncclAllReduce(data, data, n, nccl_type<T>(), ncclMin, live("ncclAllReduce"), stream), "ncclAllReduce");
  }
  /// Sums `n` bfloat16 values (the upper halves of floats, kernels/bf16.hpp) of every rank into `data`
  /// in place, on `stream` (ncclBfloat16: partial sums are rounded to bfloat16 as they travel).
  void all_reduce_sum_bf16(std::uint16_t* data, std::size_t n, cudaStream_t stream) {
    issue(ncclAllReduce(data, data, n, ncclBfloat16, ncclSum, live("ncclAllReduce"), stream), "ncclAllReduce (bf16)");
  }
  /// `data` holds size() blocks of `n` values: the sum over every rank of block rank() is left in that
  /// block (ncclReduceScatter in place); the other blocks are not meaningful afterwards. On `stream`.
  template <class T>
  void reduce_scatter_sum_in_place(T* data, std::size_t n, cudaStream_t stream) {
    issue(ncclReduceScatter(data, data + std::size_t(rank_) * n, n, nccl_type<T>(), ncclSum, live("ncclReduceScatter"),
                            stream),
          "ncclReduceScatter");
  }
  /// `data` holds size() blocks of `n` values: block r of rank r goes to block r of every rank
  /// (ncclAllGather in place), on `stream`.
  template <class T>
  void all_gather_in_place(T* data, std::size_t n, cudaStream_t stream) {
    issue(ncclAllGather(data + std::size_t(rank_) * n, data, n, nccl_type<T>(), live("ncclAllGather"), stream),
          "ncclAllGather");
  }
  /// Every rank's `n` values, in rank order, into `all` (size() x n), on `stream`.
  template <class T>
  void all_gather(const T* mine, T* all, std::size_t n, cudaStream_t stream) {
    issue(ncclAllGather(mine, all, n, nccl_type<T>(), live("ncclAllGather"), stream), "ncclAllGather");
  }
  /// The sum of every rank's `n` values into `data` of rank `root` (in place), on `stream`.
  template <class T>
  void reduce_sum(T* data, std::size_t n, int root, cudaStream_t stream) {
    issue(ncclReduce(data, data, n, nccl_type<T>(), ncclSum, root, live("ncclReduce"), stream), "ncclReduce");
  }
  /// Rank `root`'s `n` values into `data` of every rank, on `stream`.
  template <class T>
  void broadcast(T* data, std::size_t n, int root, cudaStream_t stream) {
    issue(ncclBroadcast(data, data, n, nccl_type<T>(), root, live("ncclBroadcast"), stream), "ncclBroadcast");
  }

  /// Waits until a non-blocking call on this communicator has finished (ncclCommGetAsyncError leaves
  /// ncclInProgress); an error or the timeout aborts the communicator and throws.
  void wait_ready(const char* what) {
    const auto deadline = clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t code = ncclCommGetAsyncError(live(what), &state);
      if (code != ncclSuccess) fail(what, code);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what, state);
      if (clock::now() > deadline) fail_timeout(what);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  /// Waits for `stream` (which may wait on this communicator's collectives) to drain, polling NCCL for
  /// asynchronous errors meanwhile: a peer that died or never arrives makes this rank abort the
  /// communicator and throw after timeout() instead of hanging. `what` names the work waited for.
  void wait(cudaStream_t stream, const char* what) {
    const auto deadline = clock::now() + timeout_;
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) FUSEDP_CUDA_CHECK(q);
      ncclResult_t state = ncclSuccess;
      const ncclResult_t code = ncclCommGetAsyncError(live(what), &state);
      if (code != ncclSuccess) fail(what, code);
      if (state != ncclSuccess && state != ncclInProgress) fail(what, state);
      if (clock::now() > deadline) fail_timeout(what);
      // A step's tail is short: spin briefly before sleeping.
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }

  /// Aborts the communicator (ncclCommAbort): pending collectives stop, the kernels exit, and every
  /// later call throws. Safe to call more than once.
  void abort() noexcept {
    if (comm_ != nullptr) (void)ncclCommAbort(std::exchange(comm_, nullptr));
  }

 private:
  ncclComm_t live(const char* what) const {
    if (comm_ == nullptr)
      throw DeviceError(what, int(ncclInvalidUsage), "the NCCL communicator was aborted or never created", rank_);
    return comm_;
  }
  void issue(ncclResult_t code, const char* call) {
    if (code == ncclSuccess) return;
    if (code == ncclInProgress) return wait_ready(call);  // a non-blocking communicator still busy
    fail(call, code);
  }
  [[noreturn]] void fail(const char* what, ncclResult_t code) {
    const std::string message = detail::nccl_message(code, comm_);
    abort();
    throw DeviceError(what, int(code), message + "; the communicator was aborted", rank_);
  }
  [[noreturn]] void fail_timeout(const char* what) {
    abort();
    throw DeviceError(what, int(ncclSystemError),
                      "not finished after " + std::to_string(timeout_.count()) + " ms (rank " + std::to_string(rank_) +
                          " of " + std::to_string(size_) + " on device " + std::to_string(device_) +
                          "): a peer died, hangs or never arrived; the communicator was aborted",
                      rank_);
  }
  void release() noexcept {
    if (comm_ == nullptr) return;
    // Another thread may have made another device current; NCCL frees this device's memory.
    int current = -1;
    const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device_;
    (void)cudaSetDevice(device_);
    (void)ncclCommDestroy(std::exchange(comm_, nullptr));
    if (restore) (void)cudaSetDevice(current);
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  std::chrono::milliseconds timeout_{60000};
};

}  // namespace fusedp::parallel
#endif  // FUSEDP_HAS_NCCL
