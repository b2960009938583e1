#pragma once
// A timeline of training: spans of time recorded by the code that does the work (each stage's forward
// and backward, the loss, the optimizer, each bucket's reduction, waits for data and for collectives,
// checkpoint saves), written as a Chrome trace (the JSON that chrome://tracing and ui.perfetto.dev
// open), one file per process. scripts/trace_report.py merges the files of a run and splits each step's
// time into compute, exposed communication and data wait.
//
// Off unless a Recorder is installed (trace::Session): a span then costs one relaxed atomic load and a
// branch, and nothing is recorded. On, a span costs two reads of the steady clock and an append under
// a mutex (RESULTS.md states the measured cost per step).
//
// Lanes are the trace's threads. Lane r holds replica r's work: its step, the stages, the loss, the
// optimizer, and the time it is blocked in a collective (kind wait: a gradient reduction it waits for;
// kind collective: the small ones of a step, loss and counts). Lane comm_lane + r holds what replica
// r's communicator does: each bucket's reduction from the moment it is handed over until it is seen
// complete (kind reduce). A blocking reduction is one span on each lane with the same two times; a
// reduction started during backward (Overlap over MPI) runs on the comm lane while the replica goes on,
// and only the wait for it at the end of backward is on the replica's lane. Lane branch_lane + r holds
// the weight-gradient GEMMs a Cuda replica runs on its side stream beside the rest of its backward
// (kind backward; exec/cuda_branch.hpp): they overlap the stages on lane r. So, over a run,
//   overlap = 1 - (time in wait spans) / (time in reduce spans)
// is the fraction of reduction time hidden behind backward: exactly 0 when every reduction blocks.
//
// Spans on a replica lane nest (a step holds its stages; nothing else overlaps), as the Chrome format
// wants of complete events ("ph": "X") on a thread. Reduce spans are written as async pairs ("b", "e")
// on their comm lane, since buckets in flight together overlap without nesting.
//
// How a space's work is timed is SpaceSpans<Space>: Host's by the host clock around the call (its work
// is done when the call returns), Cuda's by CUDA events on its stream (exec/cuda_trace.hpp), whose
// spans reach the recorder when the events complete and at the latest when the Session ends.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedp::trace {

/// What a span is; its name in the trace's "cat" field is kind_name().
enum class Kind : std::uint8_t {
  step,        // one training step of a replica (holds the rest of the step)
  forward,     // a stage's forward pass (index: its anchor layer)
  loss,        // the loss and its gradient
  backward,    // a stage's backward pass (index: its anchor layer)
  optimizer,   // the update of the parameters
  reduce,      // a bucket's reduction, on the comm lane (index: the bucket; bytes: its size)
  wait,        // a replica blocked on a gradient reduction (a blocking one, or the wait for started ones)
  collective,  // a replica blocked in another collective of the step (loss, counts, parameters)
  data,        // waiting for the next batch from a loader
  checkpoint,  // saving a checkpoint
  evaluate,    // evaluating on a dataset
};

[[nodiscard]] constexpr const char* kind_name(Kind k) noexcept {
  switch (k) {
    case Kind::step: return "step";
    case Kind::forward: return "forward";
    case Kind::loss: return "loss";
    case Kind::backward: return "backward";
    case Kind::optimizer: return "optimizer";
    case Kind::reduce: return "reduce";
    case Kind::wait: return "wait";
    case Kind::collective: return "collective";
    case Kind::data: return "data";
    case Kind::checkpoint: return "checkpoint";
    case Kind::evaluate: return "evaluate";
  }
  return "?";
}

/// The first comm lane: replica r's communicator is lane comm_lane + r.
inline constexpr std::uint32_t comm_lane = 1000;
/// The first branch lane: replica r's weight gradients on a side stream are lane branch_lane + r.
inline constexpr std::uint32_t branch_lane = 2000;

/// One span. `name` has static storage (a layer's name, a literal).
struct Span {
  const char* name = "";
  Kind kind = Kind::step;
  std::uint32_t lane = 0;
  std::int64_t begin_ns = 0;  // steady clock
  std::int64_t end_ns = 0;
  std::int64_t index = -1;  // the layer of a stage, the bucket of a reduction, the number of a step (-1: none)
  std::uint64_t bytes = 0;  // the bytes a reduction sums (0: none)
};

/// The steady clock in nanoseconds (the same clock in every process of a machine on Linux:
/// CLOCK_MONOTONIC).
[[nodiscard]] inline std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// The time gradient reductions were in flight over a run and the part of it a replica waited: each
/// replica's time with at least one of its reductions in flight (the union of its reduce spans, so
/// buckets in flight together count once) and, of that time, the time it was blocked in a wait span.
struct OverlapFigure {
  double reduce_seconds = 0;   // summed over the replicas of the process
  double exposed_seconds = 0;  // the part of reduce_seconds spent waiting
  /// The share of the reduction time hidden behind backward: 1 - exposed / reduce (0 without any).
  [[nodiscard]] double overlap() const noexcept {
    if (reduce_seconds <= 0) return 0.0;
    return std::clamp(1.0 - exposed_seconds / reduce_seconds, 0.0, 1.0);
  }
};

namespace detail {
// The union of intervals [begin, end), sorted and merged.
inline std::vector<std::pair<std::int64_t, std::int64_t>> merged(std::vector<std::pair<std::int64_t, std::int64_t>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& [b, e] : v) {
    if (!out.empty() && b <= out.back().second) out.back().second = std::max(out.back().second, e);
    else out.emplace_back(b, e);
  }
  return out;
}
inline std::int64_t length(const std::vector<std::pair<std::int64_t, std::int64_t>>& v) {
  std::int64_t n = 0;
  for (const auto& [b, e] : v) n += e - b;
  return n;
}
// The length of the intersection of two merged unions.
inline std::int64_t common(const std::vector<std::pair<std::int64_t, std::int64_t>>& a,
                           const std::vector<std::pair<std::int64_t, std::int64_t>>& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const std::int64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (lo < hi) n += hi - lo;
    if (a[i].second < b[j].second) ++i;
    else ++j;
  }
  return n;
}
}  // namespace detail

/// The spans of one process. Thread-safe: replicas in threads record into one Recorder.
class Recorder {
 public:
  /// @param rank the process's rank (the trace's pid), @param world the number of processes
  explicit Recorder(int rank = 0, int world = 1, std::string host = {})
      : rank_(rank), world_(world), host_(std::move(host)), steady_origin_ns_(now_ns()),
        system_origin_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count()) {
    spans_.reserve(1 << 14);
  }
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  void add(const Span& s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    spans_.push_back(s);
  }
  /// Names a lane in the trace ("replica 0", "rank 0 comm"); lanes without a name get one from
  /// their number.
  void name_lane(std::uint32_t lane, std::string name) {
    const std::lock_guard<std::mutex> lock(mutex_);
    lane_names_[lane] = std::move(name);
  }

  [[nodiscard]] std::vector<Span> spans() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return spans_;
  }
  [[nodiscard]] std::size_t size() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return spans_.size();
  }
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// The overlap of gradient reduction with backward over every span recorded so far.
  [[nodiscard]] OverlapFigure overlap() const {
    using Intervals = std::vector<std::pair<std::int64_t, std::int64_t>>;
    std::map<std::uint32_t, std::pair<Intervals, Intervals>> lanes;  // replica: its reductions, its waits
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      for (const Span& s : spans_) {
        if (s.kind == Kind::reduce && s.lane >= comm_lane && s.lane < branch_lane)
          lanes[s.lane - comm_lane].first.emplace_back(s.begin_ns, s.end_ns);
        else if (s.kind == Kind::wait && s.lane < comm_lane) lanes[s.lane].second.emplace_back(s.begin_ns, s.end_ns);
      }
    }
    std::int64_t reduce = 0, exposed = 0;  // integer nanoseconds: the same sums whatever the order
    for (auto& [lane, v] : lanes) {
      const Intervals r = detail::merged(std::move(v.first));
      reduce += detail::length(r);
      exposed += detail::common(r, detail::merged(std::move(v.second)));
    }
    return {double(reduce) * 1e-9, double(exposed) * 1e-9};
  }

  /// The trace as Chrome trace JSON (complete events, "ph": "X", times in microseconds).
  [[nodiscard]] std::string json() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    out.reserve(160 * spans_.size() + 1024);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"fusedp\":{\"rank\":%d,\"world\":%d,\"host\":\"",
                  rank_, world_);
    out += buf;
    append_escaped(out, host_);
    std::snprintf(buf, sizeof buf, "\",\"steady_origin_us\":%.3f,\"system_origin_us\":%.3f}},\"traceEvents\":[\n",
                  double(steady_origin_ns_) * 1e-3, double(system_origin_ns_) * 1e-3);
    out += buf;
    std::snprintf(buf, sizeof buf,
                  "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d\"}},\n"
                  "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}",
                  rank_, rank_, rank_, rank_);
    out += buf;
    std::map<std::uint32_t, std::string> lanes = lane_names_;
    for (const Span& s : spans_)
      if (!lanes.count(s.lane))
        lanes[s.lane] = s.lane >= branch_lane ? "replica " + std::to_string(s.lane - branch_lane) + " backward branch"
                        : s.lane >= comm_lane ? "replica " + std::to_string(s.lane - comm_lane) + " comm"
                                              : "replica " + std::to_string(s.lane);
    for (const auto& [lane, name] : lanes) {
      std::snprintf(buf, sizeof buf, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%u,\"args\":{\"name\":\"",
                    rank_, lane);
      out += buf;
      append_escaped(out, name);
      std::snprintf(buf, sizeof buf,
                    "\"}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%u,\"args\":{\"sort_index\":%u}}",
                    rank_, lane, lane);
      out += buf;
    }
    std::uint64_t async_id = 0;
    for (const Span& s : spans_) {
      std::string name = s.name;
      if (s.index >= 0 && s.kind != Kind::step) {
        name += ' ';
        name += std::to_string(s.index);
      }
      if (s.kind == Kind::reduce) {
        // An async pair: reductions in flight together overlap on their lane without nesting.
        ++async_id;
        for (int edge = 0; edge < 2; ++edge) {
          out += ",\n{\"name\":\"";
          append_escaped(out, name);
          std::snprintf(buf, sizeof buf, "\",\"cat\":\"reduce\",\"ph\":\"%s\",\"id\":%llu,\"pid\":%d,\"tid\":%u,\"ts\":%.3f",
                        edge == 0 ? "b" : "e", static_cast<unsigned long long>(async_id), rank_, s.lane,
                        double(edge == 0 ? s.begin_ns : s.end_ns) * 1e-3);
          out += buf;
          if (edge == 0) {
            std::snprintf(buf, sizeof buf, ",\"args\":{\"bucket\":%lld,\"bytes\":%llu}",
                          static_cast<long long>(s.index), static_cast<unsigned long long>(s.bytes));
            out += buf;
          }
          out += "}";
        }
        continue;
      }
      out += ",\n{\"name\":\"";
      append_escaped(out, name);
      std::snprintf(buf, sizeof buf, "\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f",
                    kind_name(s.kind), rank_, s.lane, double(s.begin_ns) * 1e-3, double(s.end_ns - s.begin_ns) * 1e-3);
      out += buf;
      if (s.kind == Kind::step && s.index >= 0) {
        std::snprintf(buf, sizeof buf, ",\"args\":{\"step\":%lld}", static_cast<long long>(s.index));
        out += buf;
      } else if ((s.kind == Kind::forward || s.kind == Kind::backward) && s.index >= 0) {
        std::snprintf(buf, sizeof buf, ",\"args\":{\"layer\":%lld}", static_cast<long long>(s.index));
        out += buf;
      } else if (s.bytes > 0) {
        std::snprintf(buf, sizeof buf, ",\"args\":{\"bytes\":%llu}", static_cast<unsigned long long>(s.bytes));
        out += buf;
      }
      out += "}";
    }
    out += "\n]}\n";
    return out;
  }

  /// Writes json() to `path`; a file that cannot be written throws DataError naming it.
  void write(const std::string& path) const {
    const std::string text = json();
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) throw DataError(path, "cannot open the trace file for writing");
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    const bool closed = std::fclose(f) == 0;
    if (!ok || !closed) throw DataError(path, "could not write the whole trace (" + std::to_string(text.size()) + " bytes)");
  }

 private:
  static void append_escaped(std::string& out, const std::string& s) {
    for (const char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char u[8];
        std::snprintf(u, sizeof u, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
        out += u;
      } else {
        out += c;
      }
    }
  }

  mutable std::mutex mutex_;
  std::vector<Span> spans_;
  std::map<std::uint32_t, std::string> lane_names_;
  int rank_;
  int world_;
  std::string host_;
  std::int64_t steady_origin_ns_;
  std::int64_t system_origin_ns_;
};

namespace detail {
/// Moves spans timed elsewhere (CUDA events, exec/cuda_trace.hpp) into their recorders, waiting for
/// them (`wait`) or taking only the finished ones. Registered once by the header that times them.
using FlushHook = void (*)(bool wait);
inline std::vector<FlushHook>& flush_hooks() {
  static std::vector<FlushHook> hooks;
  return hooks;
}
inline std::mutex& flush_mutex() {
  static std::mutex m;
  return m;
}
inline bool add_flush_hook(FlushHook h) {
  const std::lock_guard<std::mutex> lock(flush_mutex());
  flush_hooks().push_back(h);
  return true;
}
inline void flush_pending(bool wait) {
  std::vector<FlushHook> hooks;
  {
    const std::lock_guard<std::mutex> lock(flush_mutex());
    hooks = flush_hooks();
  }
  for (FlushHook h : hooks) h(wait);
}
inline std::atomic<Recorder*>& active_slot() noexcept {
  static std::atomic<Recorder*> slot{nullptr};
  return slot;
}
inline std::uint32_t& thread_lane() noexcept {
  thread_local std::uint32_t lane = 0;
  return lane;
}
}  // namespace detail

/// The installed recorder, or nullptr (tracing off).
[[nodiscard]] inline Recorder* active() noexcept { return detail::active_slot().load(std::memory_order_relaxed); }
/// The lane this thread records on (0 unless a Lane scope says otherwise).
[[nodiscard]] inline std::uint32_t current_lane() noexcept { return detail::thread_lane(); }

/// Installs `r` as the process's recorder while it lives (one at a time: a second throws).
class Session {
 public:
  explicit Session(Recorder& r) {
    Recorder* none = nullptr;
    require(detail::active_slot().compare_exchange_strong(none, &r), "trace::Session: a recorder is already installed");
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  /// Ends the session: spans still timed elsewhere (queued GPU work) are waited for and recorded.
  ~Session() {
    detail::active_slot().store(nullptr);  // first: no span begun from here on refers to the recorder
    try {
      detail::flush_pending(true);
    } catch (...) {  // out of memory while moving spans: they are lost, the run goes on
    }
  }
};

/// While it lives, this thread records on `lane` (a replica's thread: its index).
class Lane {
 public:
  explicit Lane(std::uint32_t lane) noexcept : previous_(detail::thread_lane()) { detail::thread_lane() = lane; }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() { detail::thread_lane() = previous_; }

 private:
  std::uint32_t previous_;
};

/// A span that records nothing (work no clock here can time).
class NoScope {
 public:
  explicit NoScope(const char*, Kind, std::int64_t = -1, std::uint64_t = 0) noexcept {}
  void end() noexcept {}
};

/// A span from construction to destruction (or end()) on this thread's lane; nothing when tracing is off.
class Scope {
 public:
  explicit Scope(const char* name, Kind kind, std::int64_t index = -1, std::uint64_t bytes = 0) noexcept
      : recorder_(active()) {
    if (recorder_ != nullptr) {
      span_ = Span{name, kind, current_lane(), now_ns(), 0, index, bytes};
    }
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  ~Scope() { end(); }
  /// Ends the span now (once).
  void end() noexcept {
    if (recorder_ == nullptr) return;
    span_.end_ns = now_ns();
    try {
      recorder_->add(span_);
    } catch (...) {  // out of memory: the span is lost, the run goes on
    }
    recorder_ = nullptr;
  }

 private:
  Recorder* recorder_;
  Span span_{};
};

/// A reduction that blocked this thread from `begin_ns` until now: a reduce span on the comm lane and a
/// wait span on this lane, with the same times.
inline void blocking_reduction(std::int64_t begin_ns, std::int64_t index, std::uint64_t bytes) {
  Recorder* r = active();
  if (r == nullptr) return;
  const std::int64_t end = now_ns();
  const std::uint32_t lane = current_lane();
  try {
    r->add(Span{"bucket", Kind::reduce, comm_lane + lane, begin_ns, end, index, bytes});
    r->add(Span{"reduction", Kind::wait, lane, begin_ns, end, index, bytes});
  } catch (...) {  // out of memory: the spans are lost, the run goes on
  }
}

/// How the work of execution space Space is timed: SpaceSpans<Space>::open(space, name, kind, index)
/// returns the span of what follows until it ends. Specialized beside each space: Host's work is done
/// when its calls return, so the host clock times it (exec/host.hpp: a Scope); Cuda's is queued on a
/// stream, so CUDA events time it (exec/cuda.hpp: a CudaScope). Anything else is not timed.
template <class Space>
struct SpaceSpans {
  static NoScope open(const Space&, const char* name, Kind kind, std::int64_t index = -1) noexcept {
    return NoScope(name, kind, index);
  }
};

}  // namespace fusedp::trace
