#pragma once
// MPI between processes and machines, part 1: the world (initialized once per process) and the watch
// that keeps every collective from waiting forever; parallel/mpi.hpp has the communicator with the
// collectives Parallel<> needs. Every call is checked: a failure throws DeviceError naming the call,
// the MPI error code and text, and the rank. Compiled only where the build asks for MPI (FUSEDP_WITH_MPI=1,
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
/// "rank 1", "ranks 1 and 2", "ranks 1, 2 and 3"; with `hosts` (every rank's host, empty when all
/// run on one), each with its machine: "rank 1 (on b)", "ranks 2 and 3 (on b)", "ranks 1 (on a) and 3 (on b)".
inline std::string rank_list(const std::vector<int>& ranks, const std::vector<std::string>& hosts = {}) {
  const auto host = [&](int r) {
    return std::size_t(r) < hosts.size() ? " (on " + hosts[std::size_t(r)] + ")" : std::string();
  };
  bool one_host = true;
  for (int r : ranks) one_host = one_host && host(r) == host(ranks.front());
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]) +
         (one_host ? "" : host(ranks[i]));
  if (one_host && !ranks.empty()) s += host(ranks.front());
  return s;
}

/// The name of the machine this process runs on, as MPI gives it (MPI_Get_processor_name).
inline std::string processor_name() {
  char name[MPI_MAX_PROCESSOR_NAME + 1] = {};
  int length = 0;
  if (MPI_Get_processor_name(name, &length) != MPI_SUCCESS) return {};
  return std::string(name, std::size_t(std::max(0, std::min(length, int(MPI_MAX_PROCESSOR_NAME)))));
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
  /// Every rank's host name (learnt in a Parallel's start-up check), so that messages name the
  /// machine of a rank that stopped responding; kept only when the ranks run on several machines.
  void set_hosts(std::vector<std::string> hosts) {
    const bool several = std::any_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h != hosts.front(); });
    if (several && hosts.size() == std::size_t(size_)) hosts_ = std::move(hosts);
  }

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
      what += ": " + rank_list(named, hosts_) + (n[2] > std::uint64_t(max_named) ? " and more" : "") + " stopped responding";
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
      s = rank_list(missing_, hosts_) + " stopped responding (no answer within " + std::to_string(grace.count()) +
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
  std::vector<std::string> hosts_;  // empty: one machine
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
}  // namespace fusedp
#endif  // FUSEDP_WITH_MPI
