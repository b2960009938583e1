#pragma once
// Owning CUDA events and streams (nvcc only): the one RAII for them, used by the Cuda model, the
// DeviceLoader and Parallel on Cuda. Every call is checked (FUSEDP_CUDA_CHECK).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda_check.hpp"

#include <cuda_runtime.h>

#include <memory>

namespace fusedp {

/// An event without timing (the cheap kind), for ordering work between streams. Move-only; the null
/// state (default-constructed or moved from) owns nothing.
class CudaEvent {
 public:
  /// An empty handle; make() creates one.
  CudaEvent() = default;
  [[nodiscard]] static CudaEvent make() {
    cudaEvent_t e = nullptr;
    FUSEDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CudaEvent event;
    event.event_.reset(e);
    return event;
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_.get(); }
  /// Marks the work queued on `stream` so far.
  void record(cudaStream_t stream) const { FUSEDP_CUDA_CHECK(cudaEventRecord(event_.get(), stream)); }
  /// Makes later work on `stream` wait for the marked work (no-op before the first record).
  void make_wait(cudaStream_t stream) const { FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(stream, event_.get(), 0)); }
  /// Waits on the host for the marked work.
  void synchronize() const { FUSEDP_CUDA_CHECK(cudaEventSynchronize(event_.get())); }

 private:
  struct Deleter {
    void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
  };
  std::unique_ptr<CUevent_st, Deleter> event_;
};

/// Orders everything queued on `from` so far before what is queued on `to` later, through `event`.
inline void order_after(const CudaEvent& event, cudaStream_t from, cudaStream_t to) {
  event.record(from);
  event.make_wait(to);
}

/// A non-blocking stream on the current device. Move-only. `highest_priority` asks for the device's
/// highest priority (collectives, so that they are not queued behind the rest of backward).
class CudaStream {
 public:
  CudaStream() = default;
  [[nodiscard]] static CudaStream make(bool highest_priority = false) {
    int priority = 0;
    if (highest_priority) {
      int least = 0;
      FUSEDP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &priority));
    }
    cudaStream_t s = nullptr;
    FUSEDP_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
    CudaStream stream;
    stream.stream_ = std::shared_ptr<CUstream_st>(s, [](cudaStream_t p) { cudaStreamDestroy(p); });
    return stream;
  }
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_.get(); }
  /// Shared ownership, for spaces and loaders that hand the stream on.
  [[nodiscard]] const std::shared_ptr<CUstream_st>& shared() const noexcept { return stream_; }
  void synchronize() const { FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream_.get())); }

 private:
  std::shared_ptr<CUstream_st> stream_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
