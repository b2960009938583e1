#pragma once
// Spans of work queued on a CUDA stream, for the timeline (exec/trace.hpp). A CudaScope records a CUDA
// event on the stream where the work begins and one where it ends; once both have completed, the
// span's times are the events' times on the host's steady clock. A device's clock is tied to the
// host's by an anchor, an event the host waits for (within the few microseconds that wait takes to
// return), taken again every 10 s: a span's length is measured between its own two events (0.5 us
// resolution), its start from the anchor (cudaEventElapsedTime's float milliseconds stay within a
// microsecond over 10 s), and the host and GPU clocks drift apart by no more than 10 s allow. While
// the work is queued the scope is also an NVTX range of the same name, so Nsight Systems shows the
// names on the CPU timeline and projects them onto the kernels queued inside.
//
// Work being recorded into a CUDA graph is not timed (an event recorded during stream capture becomes
// a dependency of the graph, not a time); its NVTX range is still pushed. A replayed graph runs no
// host code, so a step replayed from a graph is one span, the step's own (recorded around the
// launch, outside the graph).
//
// Spans are moved into their recorder as their events complete: each new span takes the finished
// ones, and the end of the trace::Session waits for the rest. Events are reused, so a traced run
// creates a few dozen per device.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/trace.hpp"

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

namespace fusedp::trace {

namespace detail {

// The spans whose events have not completed yet, for every device of the process.
class CudaTimeline {
 public:
  static CudaTimeline& instance() {
    static CudaTimeline t;
    return t;
  }
  static constexpr std::size_t none = std::size_t(-1);

  // A span of `s` beginning where `stream` is now; none when it cannot be timed (capture, an error).
  std::size_t begin(cudaStream_t stream, const Span& s, Recorder* recorder) noexcept {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone)
      return none;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return none;
    resolve(false);
    try {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!anchor(device, stream)) return none;
      cudaEvent_t b = take(device), e = take(device);
      if (b == nullptr || e == nullptr || cudaEventRecord(b, stream) != cudaSuccess) {
        give(device, b);
        give(device, e);
        return none;
      }
      const std::size_t id = next_id_++;
      pending_.push_back({id, s, recorder, device, anchors_[device], b, e, false});
      return id;
    } catch (...) {  // out of memory: this span is not timed
      return none;
    }
  }

  void end(std::size_t id, cudaStream_t stream) noexcept {
    if (id == none) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    Pending* p = find(id);
    if (p == nullptr) return;
    p->ended = cudaEventRecord(p->end, stream) == cudaSuccess;
    if (!p->ended) p->recorder = nullptr;  // dropped when resolved
  }

  // Moves every span whose events completed into its recorder; `wait`: waits for all of them first.
  void resolve(bool wait) noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::size_t kept = 0;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      bool done = false;
      if (!p.ended) {
        done = wait;  // never ended: nothing to time
        if (done) p.recorder = nullptr;
      } else if (wait) {
        done = true;
        if (cudaEventSynchronize(p.end) != cudaSuccess) p.recorder = nullptr;
      } else {
        const cudaError_t q = cudaEventQuery(p.end);
        done = q != cudaErrorNotReady;
        if (q != cudaSuccess && q != cudaErrorNotReady) p.recorder = nullptr;
      }
      if (!done) {
        if (kept != i) pending_[kept] = p;
        ++kept;
        continue;
      }
      if (p.recorder != nullptr) record(p);
      give(p.device, p.begin);
      give(p.device, p.end);
    }
    pending_.resize(kept);
    if (pending_.empty()) {  // no span refers to an older anchor any more
      for (cudaEvent_t e : retired_) cudaEventDestroy(e);
      retired_.clear();
    }
  }

 private:
  struct Anchor {
    cudaEvent_t event = nullptr;
    std::int64_t host_ns = 0;
  };
  struct Pending {
    std::size_t id;
    Span span;
    Recorder* recorder;
    int device;
    Anchor anchor;  // the device's anchor when the span began
    cudaEvent_t begin;
    cudaEvent_t end;
    bool ended;
  };
  static constexpr std::int64_t anchor_interval_ns = 10'000'000'000;

  CudaTimeline() { (void)add_flush_hook([](bool wait) { instance().resolve(wait); }); }

  // The pending span `id` (a span that ends is usually among the latest begun).
  Pending* find(std::size_t id) noexcept {
    for (auto it = pending_.rbegin(); it != pending_.rend(); ++it)
      if (it->id == id) return &*it;
    return nullptr;
  }

  // Ties device's clock to the host's: an event the host waits for, read when the wait returns; again
  // after anchor_interval_ns (the host waits for the stream's queued work then, once in 10 s).
  bool anchor(int device, cudaStream_t stream) {
    Anchor& a = anchors_[device];
    if (a.event != nullptr && now_ns() - a.host_ns < anchor_interval_ns) return true;
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return a.event != nullptr;
    if (cudaEventRecord(e, stream) != cudaSuccess || cudaEventSynchronize(e) != cudaSuccess) {
      cudaEventDestroy(e);
      return a.event != nullptr;
    }
    if (a.event != nullptr) retired_.push_back(a.event);
    a = {e, now_ns()};
    return true;
  }

  cudaEvent_t take(int device) noexcept {
    std::vector<cudaEvent_t>& free = free_[device];
    if (!free.empty()) {
      cudaEvent_t e = free.back();
      free.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
  }
  void give(int device, cudaEvent_t e) noexcept {
    if (e != nullptr) free_[device].push_back(e);
  }

  void record(const Pending& p) noexcept {
    float begin_ms = 0, length_ms = 0;
    if (cudaEventElapsedTime(&begin_ms, p.anchor.event, p.begin) != cudaSuccess ||
        cudaEventElapsedTime(&length_ms, p.begin, p.end) != cudaSuccess)
      return;
    Span s = p.span;
    s.begin_ns = p.anchor.host_ns + std::int64_t(double(begin_ms) * 1e6);
    s.end_ns = s.begin_ns + std::int64_t(double(length_ms) * 1e6);
    try {
      p.recorder->add(s);
    } catch (...) {  // out of memory: the span is lost, the run goes on
    }
  }

  std::mutex mutex_;
  std::vector<Pending> pending_;
  std::map<int, std::vector<cudaEvent_t>> free_;
  std::map<int, Anchor> anchors_;
  std::vector<cudaEvent_t> retired_;  // anchors replaced while spans begun under them were pending
  std::size_t next_id_ = 0;
};

}  // namespace detail

/// A span of the work queued on `stream` from construction to destruction (or end()), timed by CUDA
/// events, and an NVTX range while it lives; nothing when tracing is off. On this thread's lane, or on
/// `lane` (a communicator's: comm_lane + replica).
class CudaScope {
 public:
  CudaScope(cudaStream_t stream, const char* name, Kind kind, std::int64_t index = -1, std::uint64_t bytes = 0,
            std::uint32_t lane = std::uint32_t(-1)) noexcept
      : recorder_(active()), stream_(stream) {
    if (recorder_ == nullptr) return;
    char label[96];
    if (index >= 0) std::snprintf(label, sizeof label, "%s %lld", name, static_cast<long long>(index));
    else std::snprintf(label, sizeof label, "%s", name);
    nvtxRangePushA(label);
    const Span s{name, kind, lane == std::uint32_t(-1) ? current_lane() : lane, 0, 0, index, bytes};
    id_ = detail::CudaTimeline::instance().begin(stream, s, recorder_);
  }
  CudaScope(const CudaScope&) = delete;
  CudaScope& operator=(const CudaScope&) = delete;
  ~CudaScope() { end(); }
  void end() noexcept {
    if (recorder_ == nullptr) return;
    detail::CudaTimeline::instance().end(id_, stream_);
    nvtxRangePop();
    recorder_ = nullptr;
  }

 private:
  Recorder* recorder_;
  cudaStream_t stream_;
  std::size_t id_ = detail::CudaTimeline::none;
};

}  // namespace fusedp::trace
#endif  // FUSEDP_HAS_CUDA
