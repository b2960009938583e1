#pragma once
// MPI between processes and machines, part 2: MpiCommunicator, the collectives of Parallel<> over an
// MpiWorld (parallel/mpi_world.hpp), each a non-blocking call polled against the collective timeout,
// large ones as rings of MPI_Isend/MPI_Irecv. Compiled only where the build asks for MPI
// (FUSEDP_WITH_MPI=1, which linking fusedp::mpi defines; see core/config.hpp).
#include "fusedp/parallel/mpi_world.hpp"

#if FUSEDP_WITH_MPI
#include "fusedp/kernels/bf16.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace fusedp {
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

/// The default hook of MpiCommunicator::wait_all: nothing to tell.
struct NoRequestHook {
  constexpr void operator()(std::size_t) const noexcept {}
};

/// The collectives of Parallel<> over MPI, on a communicator that returns errors. Counts above INT_MAX
/// are split into several calls. Each collective is a non-blocking call polled until it completes:
/// a failure or a wait beyond timeout() throws DeviceError naming this rank, the call, and the rank
/// that stopped responding (see CollectiveWatch), and breaks the world (see MpiWorld).
class MpiCommunicator {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds default_timeout{60000};

  /// `timeout`: how long one collective may wait for the other ranks; FUSEDP_COLLECTIVE_TIMEOUT,
  /// when set, overrides it (see collective_timeout).
  explicit MpiCommunicator(const MpiWorld& world, std::chrono::milliseconds timeout = default_timeout)
      : comm_(world.comm()),
        rank_(world.rank()),
        size_(world.size()),
        timeout_(collective_timeout(timeout)),
        watch_(&world.collective_watch()) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// How long a failing rank waits for the others' answers: a tenth of the timeout, 0.2 to 5 s.
  [[nodiscard]] std::chrono::milliseconds grace() const noexcept {
    return std::clamp(timeout_ / 10, std::chrono::milliseconds(200), std::chrono::milliseconds(5000));
  }

  /// Sums `n` values of every rank into `data` in place; every rank gets the same bits.
  template <class T>
  void all_reduce_sum(T* data, std::size_t n) const {
    for_chunks(n, [&](std::size_t off, int count) {
      if (use_ring(std::size_t(count) * sizeof(T))) {
        watch_->begin(fusedp::detail::MpiCall::ring_allreduce);
        const Blocks b = even_blocks(std::size_t(count));
        const std::size_t mine = b.first[std::size_t(rank_)];
        ring_reduce_scatter(data + off, b, data + off + mine);
        ring_all_gather(data + off, b);
        return;
      }
      run(fusedp::detail::MpiCall::allreduce, nullptr, [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, data + off, count, mpi_type<T>(), MPI_SUM, comm_, r);
      });
    });
  }
  /// Starts a sum in place; finish with wait_all.
  template <class T>
  void start_all_reduce_sum(T* data, std::size_t n, std::vector<MPI_Request>& requests) const {
    for_chunks(n, [&](std::size_t off, int count) {
      watch_->begin(fusedp::detail::MpiCall::allreduce);
      MPI_Request r = MPI_REQUEST_NULL;
      fusedp::detail::mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data + off, count, mpi_type<T>(), MPI_SUM, comm_, &r),
                                "MPI_Iallreduce");
      requests.push_back(r);
    });
  }
  /// Waits for the collectives started with start_*, as every collective waits. `on_done(i)` is told
  /// when it sees request i complete.
  template <class Done = NoRequestHook>
  void wait_all(std::vector<MPI_Request>& requests, Done&& on_done = {}) const {
    wait(requests.data(), requests.size(), on_done);
    requests.clear();
  }
  /// Tests each started request once (which also moves Open MPI's non-blocking collectives on: they
  /// progress only inside MPI calls); `on_done(i)` is told of each one it sees complete.
  template <class Done>
  void test_all(std::vector<MPI_Request>& requests, Done&& on_done) const {
    const fusedp::detail::WorldErrorsReturn errors_return;
    for (std::size_t i = 0; i < requests.size(); ++i) test(requests[i], i, on_done);
  }
  /// Sums bf16 values (stored as uint16) in place.
  void all_reduce_sum_bf16(std::uint16_t* data, std::size_t n) const {
    for_chunks(n, [&](std::size_t off, int count) {
      run(fusedp::detail::MpiCall::allreduce, nullptr, [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, data + off, count, MPI_UINT16_T, bf16_op(), comm_, r);
      });
    });
  }
  /// The sum of every rank's `n` values into `data` of rank `root`; the others' `data` is unchanged.
  template <class T>
  void reduce_sum(T* data, std::size_t n, int root) const {
    for_chunks(n, [&](std::size_t off, int count) {
      if (use_ring(std::size_t(count) * sizeof(T))) {
        watch_->begin(fusedp::detail::MpiCall::ring_reduce);
        ring_reduce(data + off, even_blocks(std::size_t(count)), root);
        return;
      }
      run(fusedp::detail::MpiCall::reduce, nullptr, [&](MPI_Request* r) {
        return MPI_Ireduce(rank_ == root ? MPI_IN_PLACE : data + off, data + off, count, mpi_type<T>(), MPI_SUM, root,
                           comm_, r);
      });
    });
  }
  template <class T>
  void broadcast(T* data, std::size_t n, int root) const {
    for_chunks(n, [&](std::size_t off, int count) {
      run(fusedp::detail::MpiCall::bcast, nullptr,
          [&](MPI_Request* r) { return MPI_Ibcast(data + off, count, mpi_type<T>(), root, comm_, r); });
    });
  }
  /// Every rank's `n` values, in rank order, into `all` (size() x n). `what`, when given, names the
  /// exchange in messages ("Parallel start-up check").
  template <class T>
  void all_gather(const T* mine, T* all, std::size_t n, const char* what = nullptr) const {
    require(n <= std::size_t(INT_MAX), "MpiCommunicator::all_gather: ", n, " values per rank is too many");
    if (use_ring(n * std::size_t(size_) * sizeof(T))) {
      watch_->begin(fusedp::detail::MpiCall::ring_allgather, what);
      Blocks b;
      for (int r = 0; r < size_; ++r) b.add(n * std::size_t(r), int(n));
      T* at = all + n * std::size_t(rank_);
      if (at != mine) std::copy(mine, mine + n, at);
      ring_all_gather(all, b);
      return;
    }
    run(fusedp::detail::MpiCall::allgather, what, [&](MPI_Request* r) {
      return MPI_Iallgather(mine, int(n), mpi_type<T>(), all, int(n), mpi_type<T>(), comm_, r);
    });
  }
  /// In place: rank r's block [displs[r], displs[r] + counts[r]) of `data` reaches every rank.
  template <class T>
  void all_gather_blocks(T* data, const std::vector<int>& counts, const std::vector<int>& displs) const {
    const Blocks b = given_blocks(counts, displs);
    if (use_ring(b.total * sizeof(T))) {
      watch_->begin(fusedp::detail::MpiCall::ring_allgather);
      ring_all_gather(data, b);
      return;
    }
    run(fusedp::detail::MpiCall::allgatherv, nullptr, [&](MPI_Request* r) {
      return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), displs.data(), mpi_type<T>(),
                             comm_, r);
    });
  }
  /// Sums `data` over ranks; rank r receives block r ([displs[r], displs[r] + counts[r])) in place,
  /// through `scratch` (counts[r] values); the rest of `data` keeps this rank's own values.
  template <class T>
  void reduce_scatter_blocks(T* data, const std::vector<int>& counts, const std::vector<int>& displs, T* scratch) const {
    const auto r = std::size_t(rank_);
    const Blocks b = given_blocks(counts, displs);
    if (use_ring(b.total * sizeof(T))) {
      watch_->begin(fusedp::detail::MpiCall::ring_reduce_scatter);
      ring_reduce_scatter(data, b, scratch);
    } else {
      run(fusedp::detail::MpiCall::reduce_scatter, nullptr, [&](MPI_Request* q) {
        return MPI_Ireduce_scatter(data, scratch, counts.data(), mpi_type<T>(), MPI_SUM, comm_, q);
      });
    }
    std::copy(scratch, scratch + counts[r], data + displs[r]);
  }

  /// all_gather that waits at most `timeout` (FUSEDP_COLLECTIVE_TIMEOUT overrides it) and, when it
  /// fails, aborts the job (MPI_Abort) after the message naming the missing rank is printed, instead
  /// of throwing.
  template <class T>
  void all_gather_or_abort(const T* mine, T* all, std::size_t n, std::chrono::milliseconds timeout,
                           const char* what) const {
    MpiCommunicator once = *this;
    once.timeout_ = collective_timeout(timeout);
    try {
      once.all_gather(mine, all, n, what);
    } catch (const DeviceError&) {
      watch_->linger(once.grace());
      MPI_Abort(comm_, 1);
    }
  }

 private:
  // Rings. Open MPI's non-blocking collectives (libnbc) are slower than its blocking ones: measured
  // on the 2-core development machine with 2 ranks, MPI_Iallreduce took 1.5 to 2.4 times as long as
  // MPI_Allreduce for 57 k to 1 M floats, MPI_Ireduce 2 to 3 times MPI_Reduce, MPI_Iallgather of
  // 28 k floats a rank 5 times MPI_Allgather, MPI_Ireduce_scatter 1.15 to 1.25 times. So payloads of
  // at least 2 KiB a rank run as rings of MPI_Isend/MPI_Irecv steps on the side channel's
  // communicator, polled like every collective: size() - 1 steps that each pass a block to the next
  // rank (right) and take one from the previous (left). The ring all-reduce matched MPI_Allreduce on
  // 2 ranks and beat it on 3 (1.9 against 2.3 ms for 1 M floats). Each block is summed on one rank
  // and copied to the others, so every rank gets the same bits.

  static constexpr std::size_t ring_min_block_bytes = 2048;  // below: libnbc (latency-bound)
  static constexpr int ring_tag = 7010, ring_root_tag = 7011;

  // Block b of a ring collective: elements [first[b], first[b] + length[b]) of the buffer.
  struct Blocks {
    std::vector<std::size_t> first;
    std::vector<int> length;
    std::size_t total = 0;
    std::size_t longest = 0;
    void add(std::size_t at, int n) {
      first.push_back(at);
      length.push_back(n);
      total += std::size_t(n);
      longest = std::max(longest, std::size_t(n));
    }
  };
  Blocks even_blocks(std::size_t count) const {
    Blocks b;
    const auto p = std::size_t(size_);
    for (std::size_t r = 0; r < p; ++r) b.add(count * r / p, int(count * (r + 1) / p - count * r / p));
    return b;
  }
  Blocks given_blocks(const std::vector<int>& counts, const std::vector<int>& displs) const {
    require(counts.size() == std::size_t(size_) && displs.size() == std::size_t(size_), "MpiCommunicator: ",
            counts.size(), " counts and ", displs.size(), " offsets for ", size_, " ranks");
    Blocks b;
    for (std::size_t r = 0; r < counts.size(); ++r) b.add(std::size_t(displs[r]), counts[r]);
    return b;
  }
  bool use_ring(std::size_t bytes) const { return size_ > 1 && bytes >= std::size_t(size_) * ring_min_block_bytes; }
  std::size_t left_of(std::size_t steps) const {
    const auto p = std::size_t(size_);
    return (std::size_t(rank_) + p * 2 - steps % p) % p;
  }

  // At least `values` values of scratch space (grown, never shrunk: no allocation in steady state).
  template <class T>
  T* scratch(std::size_t values) const {
    if (scratch_.size() < values * sizeof(T)) scratch_.resize(values * sizeof(T));
    return reinterpret_cast<T*>(scratch_.data());
  }

  // One step: send `count_out` values from `out` to the right, receive `count_in` from the left.
  template <class T>
  void ring_step(const T* out, int count_out, T* in, int count_in, int tag) const {
    const MPI_Comm ring = watch_->comm();
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    std::array<MPI_Request, 2> r{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    fusedp::detail::mpi_check(MPI_Irecv(in, count_in, mpi_type<T>(), left, tag, ring, &r[0]), "MPI_Irecv");
    fusedp::detail::mpi_check(MPI_Isend(out, count_out, mpi_type<T>(), right, tag, ring, &r[1]), "MPI_Isend");
    wait(r.data(), r.size());
  }

  // Sums block b of every rank's `data` onto rank b, into `result` (length[rank] values, which may
  // be this rank's block of `data`); `data` is only read, except through `result`. Block b's partial
  // sum starts on rank b + 1 and travels right, each rank adding its own values.
  template <class T>
  void ring_reduce_scatter(const T* data, const Blocks& b, T* result) const {
    const auto p = std::size_t(size_);
    T* partial = scratch<T>(2 * b.longest);
    T* incoming = partial + b.longest;
    const T* out = data + b.first[left_of(1)];  // step 0 sends block rank - 1, this rank's own values
    for (std::size_t s = 0; s + 1 < p; ++s) {
      const std::size_t send = left_of(s + 1), receive = left_of(s + 2);
      ring_step(out, b.length[send], incoming, b.length[receive], ring_tag);
      T* into = s + 2 == p ? result : partial;  // the last block received is this rank's
      const T* own = data + b.first[receive];
      for (std::size_t i = 0, e = std::size_t(b.length[receive]); i < e; ++i) into[i] = incoming[i] + own[i];
      out = partial;
    }
  }

  // Rank r's block of `data` (already in place there) reaches every rank.
  template <class T>
  void ring_all_gather(T* data, const Blocks& b) const {
    for (std::size_t s = 0; s + 1 < std::size_t(size_); ++s) {
      const std::size_t send = left_of(s), receive = left_of(s + 1);
      ring_step(data + b.first[send], b.length[send], data + b.first[receive], b.length[receive], ring_tag);
    }
  }

  // The sum of every rank's `data` into `data` of `root`: a ring reduce-scatter, then each rank
  // sends its summed block to the root.
  template <class T>
  void ring_reduce(T* data, const Blocks& b, int root) const {
    const auto me = std::size_t(rank_);
    if (rank_ == root) {
      ring_reduce_scatter(data, b, data + b.first[me]);
      std::vector<MPI_Request> r(std::size_t(size_), MPI_REQUEST_NULL);
      for (int q = 0; q < size_; ++q)
        if (q != root)
          fusedp::detail::mpi_check(MPI_Irecv(data + b.first[std::size_t(q)], b.length[std::size_t(q)], mpi_type<T>(),
                                              q, ring_root_tag, watch_->comm(), &r[std::size_t(q)]),
                                    "MPI_Irecv");
      wait(r.data(), r.size());
    } else {
      T* mine = scratch<T>(3 * b.longest) + 2 * b.longest;  // after ring_reduce_scatter's two blocks
      ring_reduce_scatter(data, b, mine);
      MPI_Request r = MPI_REQUEST_NULL;
      fusedp::detail::mpi_check(
          MPI_Isend(mine, b.length[me], mpi_type<T>(), root, ring_root_tag, watch_->comm(), &r), "MPI_Isend");
      wait(&r, 1);
    }
  }

  // Starts one collective and waits for it.
  template <class Start>
  void run(fusedp::detail::MpiCall call, const char* what, Start&& start) const {
    watch_->begin(call, what);
    MPI_Request r = MPI_REQUEST_NULL;
    fusedp::detail::mpi_check(start(&r), fusedp::detail::mpi_call_name(std::uint64_t(call)));
    wait(&r, 1);
  }

  // Polls until every request completes. The first 10 ms spin on MPI_Test, as a blocking collective
  // would (Open MPI's non-blocking collectives progress only inside MPI calls); up to 1 s it yields
  // between tests, then sleeps 1 ms, and reads the side channel. Past the timeout, or on an error, it
  // finds out who is missing and fails.
  void wait(MPI_Request* requests, std::size_t n) const {
    NoRequestHook none;
    wait(requests, n, none);
  }
  template <class Done>
  void wait(MPI_Request* requests, std::size_t n, Done& on_done) const {
    constexpr auto spin = std::chrono::milliseconds(10);
    constexpr auto yield = std::chrono::seconds(1);
    const fusedp::detail::WorldErrorsReturn errors_return;
    const auto start = clock::now();
    for (;;) {
      bool pending = false;
      for (std::size_t i = 0; i < n; ++i) pending = !test(requests[i], i, on_done) || pending;
      if (!pending) return;
      const auto waited = clock::now() - start;
      if (waited < spin) continue;
      watch_->serve(true);
      if (waited > timeout_) fail_timeout();
      if (waited < yield) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // Whether request r (number i) is complete; tells on_done(i) when this test completed it.
  template <class Done>
  bool test(MPI_Request& r, std::size_t i, Done& on_done) const {
    if (r == MPI_REQUEST_NULL) return true;
    int done = 0;
    const int code = MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) fail_error(code);
    if (done) on_done(i);
    return done != 0;
  }
  [[noreturn]] void fail_timeout() const {
    std::string why = watch_->diagnose(grace());
    if (why.empty()) why = "every other rank waits in it too (an MPI or network problem?)";
    watch_->fail(watch_->call_name(), MPI_ERR_OTHER,
                 watch_->describe() + " did not complete within " + std::to_string(timeout_.count()) + " ms: " + why,
                 true);
  }
  [[noreturn]] void fail_error(int code) const {
    const std::string text = fusedp::detail::mpi_error_text(code);
    const std::string why = watch_->diagnose(grace());
    watch_->fail(watch_->call_name(), code, watch_->describe() + ": " + text + (why.empty() ? "" : "; " + why), true);
  }

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
  std::chrono::milliseconds timeout_;
  fusedp::detail::CollectiveWatch* watch_;
  mutable std::vector<std::byte> scratch_;  // the rings' partial sums and incoming blocks
};

}  // namespace parallel
}  // namespace fusedp
#endif  // FUSEDP_WITH_MPI
