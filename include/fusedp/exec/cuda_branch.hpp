#pragma once
// A second stream beside a Cuda model's own, for the weight-gradient GEMMs of backward: a layer's
// weight gradient needs its dz and its input, and nothing the next layer's input gradient writes, so
// the two run at once (net/backward_cursor.hpp says when the branch is waited for). In a recorded step
// graph the fork and the joins become edges: the graph has concurrent branches, not a second stream.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_check.hpp"
#include "fusedp/exec/cuda_event.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

namespace fusedp {

/// Where a layer's weight-gradient GEMM runs (a view of a CudaSideStream): after `fork` is recorded on
/// the model's stream behind the layer's input-gradient GEMM, on `stream` with that stream's own
/// arrival counters (kernels/cuda/gemm_dispatch.cuh: layer_weight_gradient). Null stream: in order.
/// `name` and `index` name its span on the timeline (trace::branch_lane).
struct CudaBranch {
  cudaStream_t stream = nullptr;
  ArrivalCounters arrivals{};
  cudaEvent_t fork = nullptr;
  const char* name = "weight gradient";
  std::int64_t index = -1;
};

/// Owns the side stream of a model on the current device, its arrival counters (a split-K weight
/// gradient on it must not share the model stream's, which the next layer's kernels may use at the same
/// time) and its events: `fork` (model stream -> side), two `marks` (side -> model stream), used in turn
/// so that a step's mark is not overwritten by the next step's before the model stream waited for it.
class CudaSideStream {
 public:
  CudaSideStream() = default;
  /// A side stream on the current device.
  [[nodiscard]] static CudaSideStream make() {
    CudaSideStream s;
    s.stream_ = CudaStream::make();
    s.arrivals_ = std::make_shared<DeviceBuffer<unsigned>>(CudaSpace<>::arrival_counter_count);  // zeroed
    s.fork_ = CudaEvent::make();
    s.marks_[0] = CudaEvent::make();
    s.marks_[1] = CudaEvent::make();
    return s;
  }
  [[nodiscard]] bool ready() const noexcept { return stream_.get() != nullptr; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }
  /// Device memory it holds, in bytes (its arrival counters).
  [[nodiscard]] std::size_t device_bytes() const noexcept { return arrivals_ ? arrivals_->size_bytes() : 0; }
  /// Waits for everything queued on the side stream.
  void synchronize() const { stream_.synchronize(); }
  /// The branch a layer's weight gradient takes (with counters only where `main` has them: a target that
  /// reduces splits in a kernel of their own uses none on either stream).
  [[nodiscard]] CudaBranch branch(const ArrivalCounters& main, const char* name, std::int64_t index) const noexcept {
    const ArrivalCounters own{arrivals_->data(), arrivals_->size(), main.reduction_trip_limit};
    return {stream_.get(), main.data != nullptr ? own : ArrivalCounters{}, fork_.get(), name, index};
  }
  /// Marks the work queued on the side stream so far under `slot` (0 or 1).
  void mark(int slot) const { marks_[slot].record(stream_.get()); }
  /// Makes later work on `main` wait for what `slot` marked.
  void join(int slot, cudaStream_t main) const { marks_[slot].make_wait(main); }

 private:
  CudaStream stream_;
  std::shared_ptr<DeviceBuffer<unsigned>> arrivals_;  // as CudaSpace's: kernels write them through a const view
  CudaEvent fork_;
  CudaEvent marks_[2];
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
