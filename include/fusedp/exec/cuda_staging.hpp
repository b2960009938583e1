#pragma once
// HostStaging: host data on its way to the device (nvcc only). A batch of inputs and its targets is
// copied into pinned buffers and from there, asynchronously on a stream, into device buffers; the next
// batch waits until the previous copies have read the pinned buffers (an event), so a caller may
// reuse its own memory as soon as stage() returns. Also the pinned end of device-to-host copies of
// outputs.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_event.hpp"

#include <cstddef>
#include <cstring>
#include <span>

namespace fusedp {

/// Pinned and device buffers for one batch of T inputs and raw target bytes, and pinned outputs.
template <class T>
class HostStaging {
 public:
  HostStaging() : staged_(CudaEvent::make()) {}

  /// Room for `inputs` values, `target_bytes` bytes of targets and `outputs` values (frees the old
  /// buffers: nothing in flight may use them).
  void allocate(std::size_t inputs, std::size_t target_bytes, std::size_t outputs) {
    inputs_ = DeviceBuffer<T>(inputs);
    targets_ = DeviceBuffer<unsigned char>(target_bytes);
    pinned_inputs_ = PinnedBuffer<T>(inputs);
    pinned_targets_ = PinnedBuffer<unsigned char>(target_bytes);
    outputs_ = PinnedBuffer<T>(outputs);
  }

  /// Queues the copies of `inputs` and `targets` (may be empty) to the device on `stream`.
  template <class Target>
  void stage(std::span<const T> inputs, std::span<const Target> targets, cudaStream_t stream) {
    staged_.synchronize();  // the previous copies have read the pinned buffers
    std::memcpy(pinned_inputs_.data(), inputs.data(), inputs.size_bytes());
    copy_async(inputs_.data(), pinned_inputs_.data(), inputs.size(), stream);
    if (!targets.empty()) {
      std::memcpy(pinned_targets_.data(), targets.data(), targets.size_bytes());
      copy_async(targets_.data(), pinned_targets_.data(), targets.size_bytes(), stream);
    }
    staged_.record(stream);
  }

  /// The staged inputs and targets on the device.
  [[nodiscard]] const T* inputs() const noexcept { return inputs_.data(); }
  template <class Target>
  [[nodiscard]] const Target* targets() const noexcept {
    return reinterpret_cast<const Target*>(targets_.data());
  }

  /// Bytes held on the device (the staged inputs and targets) and in pinned host memory.
  [[nodiscard]] std::size_t device_bytes() const noexcept { return inputs_.size_bytes() + targets_.size_bytes(); }
  [[nodiscard]] std::size_t pinned_bytes() const noexcept {
    return pinned_inputs_.size_bytes() + pinned_targets_.size_bytes() + outputs_.size_bytes();
  }

  /// Copies `n` device values to pinned host memory and waits: valid until the next call.
  std::span<const T> to_host(const T* device, std::size_t n, cudaStream_t stream) {
    copy_async(outputs_.data(), device, n, stream);
    FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return {outputs_.data(), n};
  }

 private:
  DeviceBuffer<T> inputs_;
  DeviceBuffer<unsigned char> targets_;
  PinnedBuffer<T> pinned_inputs_;
  PinnedBuffer<unsigned char> pinned_targets_;
  PinnedBuffer<T> outputs_;
  CudaEvent staged_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
