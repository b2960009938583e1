#pragma once
// GraphCache<Key, N>: CUDA graphs of a repeated piece of work (a training step), each keyed by what
// the recorded work depends on (nvcc only). Work with a new key runs directly once; the second time
// the same key is seen it is recorded as a graph, and replayed from then on. N keys are kept (least
// recently used goes first), so work alternating between N sets of buffers (a DeviceLoader's two
// slots) replays too. A recording that fails is tried once more with every launch plain (PlainLaunchScope:
// no programmatic dependent launch, whose edges beside a second dependency, as where backward's branches
// join, a driver may refuse to record), and the cache records so from then on; where that fails too, the
// key runs directly from then on, and the cache turns itself off with the reason kept.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace fusedp {

namespace detail {
inline thread_local bool plain_launches = false;
}  // namespace detail

/// While it lives, the calling thread's kernels::cuda::launch calls are plain launches, without
/// programmatic dependent launch (kernels::cuda::launches_dependently says false on this thread alone;
/// the process-wide dependent_launch() setting is left as it is). GraphCache records under one where a
/// recording with dependent launches failed. Nests.
class PlainLaunchScope {
 public:
  PlainLaunchScope() noexcept : previous_(std::exchange(detail::plain_launches, true)) {}
  ~PlainLaunchScope() { detail::plain_launches = previous_; }
  PlainLaunchScope(const PlainLaunchScope&) = delete;
  PlainLaunchScope& operator=(const PlainLaunchScope&) = delete;

 private:
  bool previous_;
};
/// Whether a PlainLaunchScope lives on the calling thread.
[[nodiscard]] inline bool plain_launches_here() noexcept { return detail::plain_launches; }

/// Recorded graphs of work queued on one stream, by key.
/// @tparam Key what the work depends on (equality comparable; a recorded graph is replayed only for
///             an equal key)
/// @tparam N how many keys are kept
template <class Key, std::size_t N = 2>
class GraphCache {
 public:
  explicit GraphCache(bool enabled = true) : enabled_(enabled) {}

  /// Runs `body` (which queues work on `stream`) directly, or as the graph recorded for `key`.
  /// Returns whether it ran as a graph (recorded just now, or before).
  template <class Body>
  bool run(cudaStream_t stream, const Key& key, Body&& body) {
    if (!enabled_) {
      body();
      return false;
    }
    Entry* entry = nullptr;
    for (Entry& e : entries_)
      if (e.seen && e.key == key) entry = &e;
    if (entry == nullptr) {
      entry = &entries_[0];
      for (Entry& e : entries_)
        if (e.last_used < entry->last_used) entry = &e;
      *entry = Entry{key, true, ++clock_, {}};
      body();
      return false;
    }
    entry->last_used = ++clock_;
    if (!entry->exec) {
      try {
        entry->exec = record_or_plain(stream, body);
      } catch (const DeviceError& e) {
        // Work that cannot be recorded still runs, launched directly; the reason is kept.
        failure_ = e.what();
        set_enabled(false);
        body();
        return false;
      }
    }
    FUSEDP_CUDA_CHECK(cudaGraphLaunch(entry->exec.get(), stream));
    return true;
  }

  /// Forgets every graph (the buffers they point into are about to change).
  void clear() noexcept {
    for (Entry& e : entries_) e = Entry{};
  }
  void set_enabled(bool on) noexcept {
    enabled_ = on;
    if (!on) clear();
  }
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }
  /// Why recording a graph failed, when it did ("" otherwise).
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }
  /// Why the cache records every launch plain, when it does: the error of the recording that failed with
  /// programmatic dependent launches ("" otherwise).
  [[nodiscard]] const std::string& plain_reason() const noexcept { return plain_reason_; }

 private:
  struct ExecDeleter {
    void operator()(cudaGraphExec_t g) const noexcept { cudaGraphExecDestroy(g); }
  };
  using Exec = std::unique_ptr<CUgraphExec_st, ExecDeleter>;
  struct Entry {
    Key key{};
    bool seen = false;  // the key has run once (directly)
    std::uint64_t last_used = 0;
    Exec exec;          // recorded on the key's second run
  };

  // Records `body`; where that fails, once more with every launch plain, and plain from then on where
  // that succeeds (a failure either way says nothing against dependent launches: the caller turns the
  // cache off). Running `body` twice is no new hazard: a recording that fails has always been followed by
  // a direct run.
  template <class Body>
  Exec record_or_plain(cudaStream_t stream, Body& body) {
    std::string reason;
    if (!plain_) {
      try {
        return record(stream, body);
      } catch (const DeviceError& e) {
        reason = e.what();
      }
    }
    Exec exec;
    {
      const PlainLaunchScope plain;
      exec = record(stream, body);
    }
    if (!plain_) {
      plain_ = true;
      plain_reason_ = std::move(reason);
    }
    return exec;
  }

  // Records everything `body` queues on the stream as a graph (nothing runs while recording).
  template <class Body>
  static Exec record(cudaStream_t stream, Body& body) {
    cudaGraph_t graph = nullptr;
    FUSEDP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    FUSEDP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t code = cudaGraphInstantiateWithFlags(&exec, graph, 0);
    cudaGraphDestroy(graph);
    FUSEDP_CUDA_CHECK(code);
    return Exec(exec);
  }

  std::array<Entry, N> entries_{};
  std::uint64_t clock_ = 0;
  bool enabled_;
  std::string failure_;
  bool plain_ = false;  // a recording failed and the plain one after it worked: record plain from now on
  std::string plain_reason_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
