#pragma once
// MPI between processes and machines: the world (initialized once per process), and a communicator with
// the collectives Parallel<> needs, each checked: a failure throws DeviceError naming the call, the MPI
// error code and text, and the rank. Compiled only where the build asks for MPI (FUSEDP_WITH_MPI=1,
// which linking fusedp::mpi defines; see core/config.hpp); elsewhere this header declares only
// launched_by_mpirun and collective_timeout, whatever the include path holds.
//
// A collective never waits forever: each runs as non-blocking MPI calls polled against a deadline
// (collective_timeout); large ones as rings of MPI_Isend/MPI_Irecv steps, since Open MPI's
// non-blocking collectives are slower than its blocking ones (see MpiCommunicator). When it errors
// or times out, this rank asks every other rank, over a side channel of its own, which collective it
// waits in; ranks that do not answer are named ("rank 1 stopped responding"). The message is printed on stderr and thrown as DeviceError; the world is then
// broken: later collectives throw at once, and the MpiWorld, when destroyed, aborts the job
// (MPI_Abort) instead of finalizing, which would wait for the missing rank.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace fusedp {
/// Whether this process was started by mpirun/mpiexec (Open MPI, MPICH, Slurm's PMI) with more than
/// one rank. Needs no MPI library, so a program built without MPI can say so instead of running alone.
inline bool launched_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(var)) return std::atoi(v) > 1;
  return false;
}

/// How long a collective may wait for the other ranks: FUSEDP_COLLECTIVE_TIMEOUT (seconds, a
/// positive number, fractions allowed) when it is set, which overrides the program's choice, else
/// `fallback` (ParallelOptions::timeout, 60 s unless the program says otherwise). A malformed value
/// throws InvalidArgument naming the variable.
inline std::chrono::milliseconds collective_timeout(std::chrono::milliseconds fallback) {
  const char* v = std::getenv("FUSEDP_COLLECTIVE_TIMEOUT");
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const double seconds = std::strtod(v, &end);
  if (end == v || *end != 0 || !std::isfinite(seconds) || seconds <= 0 || seconds > 1e7)
    throw InvalidArgument(std::string("FUSEDP_COLLECTIVE_TIMEOUT='") + v +
                          "': expected a positive number of seconds (e.g. 60 or 0.5)");
  return std::chrono::milliseconds(std::max<long long>(1, std::llround(seconds * 1000)));
}
}  // namespace fusedp

#if FUSEDP_WITH_MPI
#if !__has_include(<mpi.h>)
#error "fusedp: FUSEDP_WITH_MPI is 1 but <mpi.h> is not on the include path: link fusedp::mpi (or add MPI's include folders and libraries), or build without FUSEDP_WITH_MPI"
#endif
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
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace fusedp {

namespace detail {
inline int mpi_world_rank() noexcept {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  return length > 0 ? std::string(text, std::size_t(length)) : "unknown MPI error";
}
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  throw DeviceError(call, code, mpi_error_text(code), mpi_world_rank());
}

/// The collectives fusedp issues; the index travels in the side channel's messages.
enum class MpiCall : std::uint64_t {
  allreduce, reduce, bcast, allgather, allgatherv, reduce_scatter,  // Open MPI's non-blocking collectives
  ring_allreduce, ring_reduce, ring_allgather, ring_reduce_scatter,   // fusedp's rings (MpiCommunicator)
  count
};
inline const char* mpi_call_name(std::uint64_t call) noexcept {
  constexpr const char* names[] = {"MPI_Iallreduce",
                                   "MPI_Ireduce",
                                   "MPI_Ibcast",
                                   "MPI_Iallgather",
                                   "MPI_Iallgatherv",
                                   "MPI_Ireduce_scatter",
                                   "ring all-reduce (MPI_Isend/MPI_Irecv)",
                                   "ring reduce (MPI_Isend/MPI_Irecv)",
                                   "ring all-gather (MPI_Isend/MPI_Irecv)",
                                   "ring reduce-scatter (MPI_Isend/MPI_Irecv)"};
  return call < std::uint64_t(MpiCall::count) ? names[call] : "an unknown collective";
}

/// "rank 1", "ranks 1 and 3", "ranks 1, 3 and 4".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  return s;
}

/// While it lives, errors of MPI_Test are returned rather than fatal. Open MPI 4 reports an error of a
/// non-blocking collective through MPI_COMM_WORLD's error handler (its requests carry no
/// communicator), which aborts by default; the program's handler is restored afterwards.
class WorldErrorsReturn {
 public:
  WorldErrorsReturn() noexcept {
    if (MPI_Comm_get_errhandler(MPI_COMM_WORLD, &saved_) != MPI_SUCCESS) saved_ = MPI_ERRHANDLER_NULL;
    else MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  ~WorldErrorsReturn() {
    if (saved_ == MPI_ERRHANDLER_NULL) return;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, saved_);
    MPI_Errhandler_free(&saved_);
  }
  WorldErrorsReturn(const WorldErrorsReturn&) = delete;
  WorldErrorsReturn& operator=(const WorldErrorsReturn&) = delete;

 private:
  MPI_Errhandler saved_ = MPI_ERRHANDLER_NULL;
};

/// What this rank knows about the collectives of one world, and the side channel over which ranks
/// ask each other about them when one fails. The channel is a duplicate of the world's communicator,
/// so its messages never meet Open MPI's collectives (fusedp's rings travel on it too, under tags of
/// their own), and costs nothing until a collective waits long: a rank reads it only while it waits.
///
/// When a collective errors or times out on a rank, that rank asks every other rank which collective
/// it is waiting in (diagnose). A rank answers while it waits in any collective, or while it
/// diagnoses or lingers after its own failure, with the number of collectives it has started and the
/// name of the last one. A rank that gives no answer within the grace period is named as the one
/// that stopped responding (dead, stopped, or not calling collectives any more). The failing rank
/// then tells the others what it found (a notice), so that ranks still waiting fail at once with
/// the same diagnosis instead of waiting for their own timeout.
class CollectiveWatch {
 public:
  using Message = std::array<std::uint64_t, 12>;  // see the tags
  static constexpr int max_named = 8;              // missing ranks a notice carries

  CollectiveWatch(MPI_Comm side, int rank, int size) : comm_(side), rank_(rank), size_(size) {}
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;
  ~CollectiveWatch() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!failed_ && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The side channel's communicator, which also carries the point-to-point steps of the rings
  /// (tags of their own).
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] bool failed() const noexcept { return failed_; }
  /// Collectives started on the world so far (the same count on every rank that keeps up).
  [[nodiscard]] std::uint64_t sequence() const noexcept { return sequence_; }
  [[nodiscard]] const char* call_name() const noexcept { return mpi_call_name(call_); }
  [[nodiscard]] std::chrono::milliseconds grace() const noexcept { return grace_; }

  /// A collective starts. After a failure the world cannot be trusted: every later one throws.
  void begin(MpiCall call, const char* what = nullptr) {
    if (failed_)
      throw DeviceError(mpi_call_name(std::uint64_t(call)), MPI_ERR_OTHER,
                        "an earlier collective failed (" + failure_ + "); this MPI world cannot be used any more",
                        rank_);
    ++sequence_;
    call_ = std::uint64_t(call);
    what_ = what;
  }
  /// "collective #17", with the caller's label when it gave one ("collective #1 (Parallel start-up
  /// check)").
  [[nodiscard]] std::string describe() const {
    return "collective #" + std::to_string(sequence_) + (what_ ? std::string(" (") + what_ + ")" : "");
  }

  /// Answers the other ranks' questions. With `take_notices`, a failure reported by another rank
  /// makes this rank fail too (throws).
  void serve(bool take_notices) {
    for (;;) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, ask_tag, comm_, &flag, &status) != MPI_SUCCESS || !flag) break;
      Message question{};
      if (MPI_Recv(question.data(), words, MPI_UINT64_T, status.MPI_SOURCE, ask_tag, comm_, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        break;
      Message& answer = outgoing_.emplace_back();
      answer.fill(0);
      answer[0] = sequence_;
      answer[1] = call_;
      send(answer, status.MPI_SOURCE, answer_tag);
    }
    if (!take_notices) return;
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, notice_tag, comm_, &flag, &status) != MPI_SUCCESS || !flag) return;
    Message n{};
    if (MPI_Recv(n.data(), words, MPI_UINT64_T, status.MPI_SOURCE, notice_tag, comm_, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      return;
    std::vector<int> named;
    for (std::uint64_t i = 0; i < std::min<std::uint64_t>(n[2], max_named); ++i) named.push_back(int(n[3 + i]));
    std::string what = "rank " + std::to_string(status.MPI_SOURCE) + " gave up on collective #" + std::to_string(n[0]) +
                       " (" + mpi_call_name(n[1]) + ")";
    if (!named.empty())
      what += ": " + rank_list(named) + (n[2] > std::uint64_t(max_named) ? " and more" : "") + " stopped responding";
    else
      what += " (see its message)";
    if (n[0] != sequence_) what += "; this rank waits in " + describe() + " (" + call_name() + ")";
    fail(call_name(), MPI_ERR_OTHER, what, false);
  }

  /// Asks every other rank which collective it waits in and waits up to `grace` for the answers.
  /// Returns what was found, for the message: who did not answer, who waits elsewhere; empty when
  /// every rank answered from this same collective.
  [[nodiscard]] std::string diagnose(std::chrono::milliseconds grace) {
    using clock = std::chrono::steady_clock;
    grace_ = grace;
    Message& question = outgoing_.emplace_back();
    question.fill(0);
    question[0] = sequence_;
    question[1] = call_;
    answers_.assign(std::size_t(size_), Message{});
    std::vector<MPI_Request> pending(std::size_t(size_), MPI_REQUEST_NULL);
    std::vector<char> answered(std::size_t(size_), 0);
    answered[std::size_t(rank_)] = 1;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      send(question, r, ask_tag);
      if (MPI_Irecv(answers_[std::size_t(r)].data(), words, MPI_UINT64_T, r, answer_tag, comm_,
                    &pending[std::size_t(r)]) != MPI_SUCCESS)
        pending[std::size_t(r)] = MPI_REQUEST_NULL;
    }
    const auto deadline = clock::now() + grace;
    for (;;) {
      bool all = true;
      for (int r = 0; r < size_; ++r) {
        MPI_Request& p = pending[std::size_t(r)];
        if (p == MPI_REQUEST_NULL) continue;
        int done = 0;
        if (MPI_Test(&p, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) p = MPI_REQUEST_NULL;  // counts as no answer
        else if (done) answered[std::size_t(r)] = 1;
        else all = false;
      }
      if (all || clock::now() > deadline) break;
      serve(false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (MPI_Request& p : pending)
      if (p != MPI_REQUEST_NULL && MPI_Cancel(&p) == MPI_SUCCESS) MPI_Wait(&p, MPI_STATUS_IGNORE);

    missing_.clear();
    others_answered_ = false;
    std::string elsewhere;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && answered[std::size_t(r)]) others_answered_ = true;
      if (!answered[std::size_t(r)]) {
        missing_.push_back(r);
      } else if (r != rank_ && answers_[std::size_t(r)][0] != sequence_) {
        const Message& a = answers_[std::size_t(r)];
        const std::string there = "collective #" + std::to_string(a[0]) + " (" + mpi_call_name(a[1]) + ")";
        if (a[0] > sequence_)
          elsewhere += "; rank " + std::to_string(r) + " has gone on to " + there;
        else
          elsewhere += "; rank " + std::to_string(r) + " waits in an earlier " + there +
                       ": the ranks issued different collectives";
      }
    }
    std::string s;
    if (!missing_.empty())
      s = rank_list(missing_) + " stopped responding (no answer within " + std::to_string(grace.count()) +
          " ms to a question over the side channel: dead, stopped, or no longer calling collectives)";
    if (!elsewhere.empty()) s += s.empty() ? elsewhere.substr(2) : elsewhere;
    return s;
  }

  /// This rank's collective failed: the world is marked broken, the message printed on stderr (the
  /// MpiWorld's destructor aborts the job, which may leave no later chance), the other ranks told
  /// (with `tell_others`), and the error thrown.
  [[noreturn]] void fail(const char* call, int code, const std::string& message, bool tell_others) {
    failed_ = true;
    failure_ = message;
    DeviceError error(call, code, message, rank_);
    std::fprintf(stderr, "fusedp: %s\n", error.what());
    std::fflush(stderr);
    if (tell_others) {
      Message& n = outgoing_.emplace_back();
      n.fill(0);
      n[0] = sequence_;
      n[1] = call_;
      n[2] = missing_.size();
      for (std::size_t i = 0; i < missing_.size() && i < std::size_t(max_named); ++i)
        n[3 + i] = std::uint64_t(missing_[i]);
      for (int r = 0; r < size_; ++r)
        if (r != rank_) send(n, r, notice_tag);
    }
    throw error;
  }

  /// Keeps answering questions for `how_long` (a failed rank before the job is aborted, so that the
  /// ranks diagnosing at the same time get their answers and print their own message). Not needed
  /// when no other rank answered this one's questions.
  void linger(std::chrono::milliseconds how_long) {
    if (!others_answered_) return;
    const auto until = std::chrono::steady_clock::now() + how_long;
    while (std::chrono::steady_clock::now() < until) {
      serve(false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  static constexpr int words = int(sizeof(Message) / sizeof(std::uint64_t));
  // ask: [sequence, call]; answer: [sequence, call]; notice: [sequence, call, missing count, missing...]
  static constexpr int ask_tag = 7001, answer_tag = 7002, notice_tag = 7003;

  // Fire and forget: the message lives in outgoing_ (stable addresses) until the watch goes.
  void send(const Message& m, int to, int tag) {
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(m.data(), words, MPI_UINT64_T, to, tag, comm_, &r) == MPI_SUCCESS) MPI_Request_free(&r);
  }

  MPI_Comm comm_;
  int rank_, size_;
  std::uint64_t sequence_ = 0;
  std::uint64_t call_ = 0;
  const char* what_ = nullptr;
  bool failed_ = false;
  std::string failure_;
  std::chrono::milliseconds grace_{200};
  std::vector<int> missing_;
  bool others_answered_ = true;  // until a diagnosis says otherwise
  std::deque<Message> outgoing_;
  std::vector<Message> answers_;  // kept: a cancelled receive must never write into freed memory
};
}  // namespace detail

/// Checks an MPI call; the communicators fusedp uses return errors instead of aborting.
#define FUSEDP_MPI_CHECK(call) ::fusedp::detail::mpi_check((call), #call)

/// The MPI world of this process. The first MpiWorld initializes MPI (threads: funneled, since only the
/// thread that calls Parallel's methods talks to MPI) and the last one to go finalizes it, unless MPI
/// was initialized by someone else. Launch with mpirun; a plain start is a world of one.
///
/// After a collective of this world failed (an error, or a rank that stopped responding), the
/// destructor aborts the job (MPI_Abort, exit code 1) instead of finalizing MPI, which would wait for
/// the missing rank: a program may catch the DeviceError (to save what it can), but the process ends
/// when the world goes.
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
    MPI_Comm side = MPI_COMM_NULL;  // inherits MPI_ERRORS_RETURN
    FUSEDP_MPI_CHECK(MPI_Comm_dup(comm_, &side));
    watch_ = std::make_unique<detail::CollectiveWatch>(side, rank_, size_);
  }
  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;
  ~MpiWorld() {
    if (watch_ && watch_->failed()) {
      watch_->linger(watch_->grace());
      std::fprintf(stderr, "fusedp: rank %d: aborting the MPI job after the failed collective\n", rank_);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    watch_.reset();
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
  /// The state of this world's collectives, shared by its communicators (internal).
  [[nodiscard]] detail::CollectiveWatch& collective_watch() const noexcept { return *watch_; }
  /// Whether a collective of this world has failed (the world is then unusable).
  [[nodiscard]] bool failed() const noexcept { return watch_ && watch_->failed(); }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  bool owner_ = false;
  std::unique_ptr<detail::CollectiveWatch> watch_;
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
  /// Waits for the collectives started with start_*, as every collective waits.
  void wait_all(std::vector<MPI_Request>& requests) const {
    wait(requests.data(), requests.size());
    requests.clear();
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
    constexpr auto spin = std::chrono::milliseconds(10);
    constexpr auto yield = std::chrono::seconds(1);
    const fusedp::detail::WorldErrorsReturn errors_return;
    const auto start = clock::now();
    for (;;) {
      bool pending = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (requests[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        const int code = MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE);
        if (code != MPI_SUCCESS) fail_error(code);
        pending = pending || !done;
      }
      if (!pending) return;
      const auto waited = clock::now() - start;
      if (waited < spin) continue;
      watch_->serve(true);
      if (waited > timeout_) fail_timeout();
      if (waited < yield) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
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
