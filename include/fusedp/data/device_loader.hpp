#pragma once
// DeviceLoader: the DataLoader's batches, delivered on a CUDA device.
//
//     fp::Model<Net, fp::Cuda> model{fp::seed(42), fp::Cuda{0}};
//     fp::data::DeviceLoader loader{train, sampler, {.batch = 128, .seed = 42}, model.space()};
//     for (std::uint64_t epoch = 1; epoch <= epochs; ++epoch) {
//       loader.set_epoch(epoch);
//       while (auto b = loader.next()) model.train_step_async(b->images, b->labels, loss, opt);
//     }
//
// A worker thread augments and normalizes batches into pinned (page-locked) host slots, exactly as
// DataLoader does (same batches, bit for bit); each finished slot is copied to the device with
// cudaMemcpyAsync on the loader's own copy stream while the model computes on the batch before it.
// Ordering is by events only, never by waiting on the host:
//   - the model's stream waits for a batch's copy (`copied`) before it reads the batch;
//   - the copy into a device slot waits until the model's stream has queued everything it does with
//     the batch that slot held before (`consumed`, recorded when the next batch is asked for);
//   - a pinned slot goes back to the worker only after its copy has read it (the one host wait, on a
//     copy queued a step earlier, and it is what keeps the host at most two batches ahead).
// So the views of a DeviceBatch stay valid for everything queued on the model's stream before the next
// call of next() or set_epoch().
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/data/loader.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_event.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

namespace fusedp::data {

/// A DataLoader whose batch slots are pinned host memory (the host end of asynchronous copies).
using PinnedDataLoader = BasicDataLoader<PinnedBuffer>;

/// One batch on the device. The views are valid for work queued on the loader's compute stream before
/// the next call of next() or set_epoch() on its loader.
struct DeviceBatch {
  DeviceSpan<const float> images;         ///< (size, C, H, W)
  DeviceSpan<const std::int32_t> labels;  ///< (size); empty for a regression dataset
  DeviceSpan<const float> targets;        ///< (size, target_size); empty for classification
  std::size_t count = 0;                  ///< samples in the batch
  std::size_t index = 0;                  ///< 0-based number of this batch in its epoch

  [[nodiscard]] std::size_t size() const noexcept { return count; }
};

class DeviceLoader {
 public:
  using Options = LoaderOptions;

  /// Batches of `data` in `sampler`'s order, delivered on `space`'s device and ordered before the work
  /// later queued on `space`'s stream (the model's: pass model.space()).
  template <class P>
  DeviceLoader(const Dataset& data, DistributedSampler sampler, Options options, const CudaSpace<P>& space)
      : device_(space.device()), compute_(space.shared_stream()), host_(data, std::move(sampler), std::move(options)) {
    space.activate();
    copy_ = CudaStream::make();
    const std::size_t capacity = std::min(host_.options().batch, data.count);  // a batch at any start
    for (Slot& slot : slots_) {
      slot.images = DeviceBuffer<float>(capacity * data.sample_size());
      slot.labels = DeviceBuffer<std::int32_t>(data.regression() ? 0 : capacity);
      slot.targets = DeviceBuffer<float>(capacity * data.target_size);
      slot.copied = CudaEvent::make();
      slot.consumed = CudaEvent::make();
    }
  }
  /// A single-process loader (world size 1) whose sampler takes `sampling`.
  template <class P>
  DeviceLoader(const Dataset& data, Options options, const CudaSpace<P>& space, SamplerOptions sampling = {})
      : DeviceLoader(data, DistributedSampler{data.count, 1, 0, sampling}, std::move(options), space) {}

  DeviceLoader(const DeviceLoader&) = delete;
  DeviceLoader& operator=(const DeviceLoader&) = delete;
  /// Waits for the copies in flight (they read pinned memory that is freed with the loader) and for
  /// the compute stream (its queued work may still read the device slots).
  ~DeviceLoader() {
    if (copy_.get() != nullptr) (void)cudaStreamSynchronize(copy_.get());
    if (compute_) (void)cudaStreamSynchronize(compute_.get());
  }

  /// Starts `epoch` at `start` (DataLoader::set_epoch). Copies queued for the previous epoch finish
  /// first; their batches are discarded.
  void set_epoch(std::uint64_t epoch, EpochPosition start = {}) {
    const CudaDeviceScope device(device_);  // the caller's device current again on return
    release_current();
    if (pending_) {
      slots_[pending_->slot].copied.synchronize();
      pending_.reset();
    }
    host_.set_epoch(epoch, start);
    handed_ = 0;
  }

  /// The next batch of the epoch on the device, or nothing at its end. The batch after it is copied
  /// while the caller computes on this one.
  std::optional<DeviceBatch> next() {
    const CudaDeviceScope device(device_);  // the caller's device current again on return
    release_current();
    if (!pending_) {
      std::optional<Batch> first = host_.next();
      if (!first) return std::nullopt;
      queue_copy(*first, next_slot_);
    }
    const Pending cur = *pending_;
    pending_.reset();
    Slot& slot = slots_[cur.slot];
    // The pinned slot goes back to the worker with the host loader's next(): its copy must be done.
    slot.copied.synchronize();
    if (std::optional<Batch> ahead = host_.next()) queue_copy(*ahead, 1 - cur.slot);
    slot.copied.make_wait(compute_.get());
    current_ = cur.slot;
    handed_ = cur.index + 1;

    const Dataset& d = host_.dataset();
    DeviceBatch b;
    b.images = {slot.images.data(), cur.count * d.sample_size()};
    if (d.regression()) b.targets = {slot.targets.data(), cur.count * d.target_size};
    else b.labels = {slot.labels.data(), cur.count};
    b.count = cur.count;
    b.index = cur.index;
    return b;
  }

  /// Batches per epoch on this rank.
  [[nodiscard]] std::size_t batches() const noexcept { return host_.batches(); }
  /// Batches handed out so far in the current epoch.
  [[nodiscard]] std::size_t batches_given() const { return handed_; }
  /// Where the epoch stands once the batches handed out so far are trained (DataLoader::position;
  /// the host loader runs a batch ahead).
  [[nodiscard]] EpochPosition position() const { return host_.position_after(handed_); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return host_.epoch(); }
  [[nodiscard]] const DistributedSampler& sampler() const noexcept { return host_.sampler(); }
  [[nodiscard]] const Dataset& dataset() const noexcept { return host_.dataset(); }
  [[nodiscard]] const Options& options() const noexcept { return host_.options(); }
  /// The stream the copies run on.
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return copy_.get(); }
  /// Device memory of the two batch slots, in bytes (CudaMemory's `loader` part predicts it).
  [[nodiscard]] std::size_t device_bytes() const noexcept {
    std::size_t n = 0;
    for (const Slot& s : slots_) n += s.images.size_bytes() + s.labels.size_bytes() + s.targets.size_bytes();
    return n;
  }

 private:
  struct Slot {
    DeviceBuffer<float> images;
    DeviceBuffer<std::int32_t> labels;
    DeviceBuffer<float> targets;
    CudaEvent copied;    // recorded on the copy stream after this slot's copies
    CudaEvent consumed;  // recorded on the compute stream after the work on this slot's batch was queued
  };
  struct Pending {
    int slot = 0;
    std::size_t count = 0;
    std::size_t index = 0;
  };

  // The caller is done queueing work on the batch it holds: mark the point on the compute stream.
  void release_current() {
    if (current_ < 0) return;
    slots_[current_].consumed.record(compute_.get());
    current_ = -1;
  }

  // Queues the copies of host batch `h` into device slot `s`, after the work on the slot's last batch.
  void queue_copy(const Batch& h, int s) {
    Slot& slot = slots_[s];
    cudaStream_t stream = copy_.get();
    slot.consumed.make_wait(stream);  // no-op before its first record
    copy_async(slot.images.data(), h.images.data(), h.images.size(), stream);
    copy_async(slot.labels.data(), h.labels.data(), h.labels.size(), stream);
    copy_async(slot.targets.data(), h.targets.data(), h.targets.size(), stream);
    slot.copied.record(stream);
    pending_ = Pending{s, h.size(), h.index};
    next_slot_ = 1 - s;
  }

  int device_;
  std::shared_ptr<CUstream_st> compute_;
  CudaStream copy_;
  PinnedDataLoader host_;
  std::array<Slot, 2> slots_;
  std::optional<Pending> pending_;  // the batch whose copy is queued and not yet handed out
  int current_ = -1;                // the slot of the batch the caller holds (-1: none)
  int next_slot_ = 0;
  std::size_t handed_ = 0;
};

}  // namespace fusedp::data
#endif  // FUSEDP_HAS_CUDA
