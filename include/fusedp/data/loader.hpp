#pragma once
// DataLoader: batches of an in-memory Dataset in the order of a DistributedSampler, augmented and
// normalized, prepared ahead of time by a worker thread.
//
//     fp::data::DataLoader loader{train, fp::data::DistributedSampler{train.count, 1, 0, {.seed = 42}},
//                                 {.batch = 128, .augment = {.crop_padding = 4, .flip = true},
//                                  .normalize = {mean, stddev}, .seed = 42}};
//     for (std::uint64_t epoch = 1; epoch <= epochs; ++epoch) {
//       loader.set_epoch(epoch);
//       while (auto b = loader.next()) model.train_step(b->images, b->labels, loss, opt);
//     }
//
// What a batch holds is a pure function of (dataset, sampler options, loader options, epoch, batch
// number): prefetching, thread timing and the slot a batch is written to change nothing.
//
// Memory: `prefetch + 1` batch slots are allocated when the loader is made; after that no batch
// allocates. `Storage` is the slots' buffer type: HostBuffer (DataLoader) or, for batches bound for a
// GPU, PinnedBuffer (data/device_loader.hpp), so that the copies to the device are asynchronous.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/data/augment.hpp"
#include "fusedp/data/dataset.hpp"
#include "fusedp/data/sampler.hpp"
#include "fusedp/exec/trace.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fusedp::data {

/// How a DataLoader forms batches.
struct LoaderOptions {
  std::size_t batch = 64;       ///< samples per batch
  bool drop_last = false;       ///< drop the last, smaller batch of each epoch (else keep it)
  std::size_t prefetch = 1;     ///< batches a worker thread prepares ahead (0: prepared by next() itself)
  Augment augment = {};         ///< random crop and flip (training data)
  Normalization normalize = {}; ///< per-channel normalization after augmentation
  std::uint64_t seed = 0;       ///< seed of the augmentation draws
};

/// One batch. The views stay valid until the next call of next() or set_epoch() on its loader.
struct Batch {
  std::span<const float> images;         ///< (size, C, H, W)
  std::span<const std::int32_t> labels;  ///< (size); empty for a regression dataset
  std::span<const float> targets;        ///< (size, target_size); empty for classification
  std::span<const std::size_t> indices;  ///< the dataset index of each sample
  std::size_t index = 0;                 ///< 0-based number of this batch in its epoch

  [[nodiscard]] std::size_t size() const noexcept { return indices.size(); }
};

/// The loader, with its batch slots in `Storage<T>` buffers (move-only, zeroed, data() and size()).
template <template <class> class Storage>
class BasicDataLoader {
 public:
  using Options = LoaderOptions;

  /// Batches of `data` (which must outlive the loader and not change) in `sampler`'s order.
  BasicDataLoader(const Dataset& data, DistributedSampler sampler, Options options)
      : data_(&data), sampler_(std::move(sampler)), options_(std::move(options)) {
    validate(data, "DataLoader dataset");
    require(sampler_.size() == data.count, "DataLoader: the sampler is for ", sampler_.size(),
            " samples, the dataset holds ", data.count);
    require(options_.batch > 0, "DataLoader: batch must be > 0");
    options_.normalize.validate(data.channels);
    require(options_.augment.crop_padding == 0 || (data.height > 1 && data.width > 1),
            "DataLoader: random crop needs images, the samples are ", data.channels, "x", data.height, "x", data.width);
    require(options_.prefetch <= 64, "DataLoader: prefetch of ", options_.prefetch, " batches (at most 64)");
    batches_ = batches_of(sampler_.num_samples());
    const std::size_t capacity = std::min(options_.batch, sampler_.size());  // a batch at any start
    slots_.resize(options_.prefetch + 1);
    for (Slot& s : slots_) {
      s.images = Storage<float>(capacity * data.sample_size());
      s.labels = Storage<std::int32_t>(data.regression() ? 0 : capacity);
      s.targets = Storage<float>(capacity * data.target_size);
    }
    if (options_.prefetch > 0) worker_ = std::thread([this] { work(); });
  }

  /// A single-process loader (world size 1) whose sampler takes `sampling`.
  BasicDataLoader(const Dataset& data, Options options, SamplerOptions sampling = {})
      : BasicDataLoader(data, DistributedSampler{data.count, 1, 0, sampling}, std::move(options)) {}

  BasicDataLoader(const BasicDataLoader&) = delete;
  BasicDataLoader& operator=(const BasicDataLoader&) = delete;

  ~BasicDataLoader() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }

  /// Starts `epoch` (the sampler's permutation and the augmentation draws) at `start`: the samples of
  /// the epoch's global order that all ranks together have visited (position() of the run that saved
  /// a checkpoint, at any world size), so a resumed run continues where its checkpoint left off and
  /// visits each remaining sample once. The epoch's batches are then those of the rest, numbered from
  /// 0. Batches prepared ahead for the previous epoch are discarded.
  void set_epoch(std::uint64_t epoch, EpochPosition start = {}) {
    require(start.samples <= sampler_.size(), "DataLoader::set_epoch: a start at sample ", start.samples,
            " of an epoch of ", sampler_.size());
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !filling_; });  // the worker reads the sampler while filling
    sampler_.set_epoch(epoch, start);
    batches_ = batches_of(sampler_.num_samples());
    epoch_ = epoch;
    started_ = true;
    next_fill_ = released_ = given_ = 0;
    for (Slot& s : slots_) s.batch = no_batch;
    lock.unlock();
    changed_.notify_all();
  }

  /// The next batch of the epoch, or nothing at its end. The previous batch's views become invalid.
  /// Traced as a data span (exec/trace.hpp): the time the caller waits for the batch.
  std::optional<Batch> next() {
    const trace::Scope span("next batch", trace::Kind::data);
    if (!started_) set_epoch(sampler_.epoch(), sampler_.start());
    std::unique_lock lock(mutex_);
    released_ = given_;  // the caller is done with the batch it had
    if (given_ >= batches_) return std::nullopt;
    const std::size_t b = given_;
    Slot& slot = slots_[b % slots_.size()];
    if (worker_.joinable()) {
      changed_.notify_all();
      changed_.wait(lock, [&] { return slot.batch == b; });
      if (slot.error) std::rethrow_exception(slot.error);  // sticky: the epoch cannot go on
    } else {
      fill(slot, b);
      slot.batch = b;
    }
    ++given_;
    return view(slot, b);
  }

  /// Batches of the current epoch on this rank (from its start).
  [[nodiscard]] std::size_t batches() const noexcept { return batches_; }
  /// Batches handed out so far in the current epoch.
  [[nodiscard]] std::size_t batches_given() const {
    std::lock_guard lock(mutex_);
    return given_;
  }
  /// Where the epoch stands once the batches handed out so far are trained on every rank: the
  /// position a checkpoint records (set_epoch's `start` of a resumed run). With a training sampler
  /// (every rank the same count) every rank reports the same; the end of the epoch is the dataset's
  /// size (a last batch dropped or padded included). An evaluation sampler's ranks may differ.
  [[nodiscard]] EpochPosition position() const {
    std::lock_guard lock(mutex_);
    return position_after(given_);
  }
  /// The position after the epoch's first `batches` batches (position() once they are handed out).
  [[nodiscard]] EpochPosition position_after(std::size_t batches) const {
    require(batches <= batches_, "DataLoader::position_after: ", batches, " batches of an epoch of ", batches_);
    if (batches == batches_) return {sampler_.size()};
    // Every batch before the last holds `batch` samples on every rank: a prefix of the order.
    return {sampler_.start().samples + batches * options_.batch * sampler_.world()};
  }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  [[nodiscard]] const DistributedSampler& sampler() const noexcept { return sampler_; }
  [[nodiscard]] const Dataset& dataset() const noexcept { return *data_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  static constexpr std::size_t no_batch = ~std::size_t(0);

  struct Slot {
    Storage<float> images;
    Storage<std::int32_t> labels;
    Storage<float> targets;
    std::span<const std::size_t> indices;
    std::size_t count = 0;
    std::size_t batch = no_batch;  // which batch the slot holds (no_batch: none yet)
    std::exception_ptr error;
  };

  std::size_t batches_of(std::size_t samples) const noexcept {
    return options_.drop_last ? samples / options_.batch : (samples + options_.batch - 1) / options_.batch;
  }

  std::span<const std::size_t> indices_of(std::size_t b) const {
    const std::span<const std::size_t> all = sampler_.indices();
    const std::size_t first = b * options_.batch;
    return all.subspan(first, std::min(options_.batch, all.size() - first));
  }

  // Writes batch `b` into `slot`; reads only the dataset, the sampler and the options.
  void fill(Slot& slot, std::size_t b) const {
    const Dataset& d = *data_;
    const std::size_t sample = d.sample_size();
    slot.indices = indices_of(b);
    slot.count = slot.indices.size();
    for (std::size_t i = 0; i < slot.count; ++i) {
      const std::size_t s = slot.indices[i];
      const float* src = d.images.data() + s * sample;
      float* dst = slot.images.data() + i * sample;
      if (options_.augment.enabled() || options_.normalize.enabled()) {
        const AugmentDraw draw = draw_augment(options_.augment, options_.seed, epoch_, s);
        transform_sample(src, dst, d.channels, d.height, d.width, options_.augment, draw, options_.normalize);
      } else {
        std::memcpy(dst, src, sample * sizeof(float));
      }
      if (d.regression()) std::memcpy(slot.targets.data() + i * d.target_size, d.targets.data() + s * d.target_size,
                                      d.target_size * sizeof(float));
      else slot.labels[i] = d.labels[s];
    }
  }

  Batch view(const Slot& slot, std::size_t b) const {
    const Dataset& d = *data_;
    Batch out;
    out.images = {slot.images.data(), slot.count * d.sample_size()};
    if (d.regression()) out.targets = {slot.targets.data(), slot.count * d.target_size};
    else out.labels = {slot.labels.data(), slot.count};
    out.indices = slot.indices;
    out.index = b;
    return out;
  }

  // The worker fills batch k into slot k % slots once the batch that slot held last (k - slots) is
  // released, i.e. while k < released_ + slots: up to `prefetch` batches ahead of the one in use.
  void work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] {
        return stop_ || (started_ && next_fill_ < batches_ && next_fill_ < released_ + slots_.size());
      });
      if (stop_) return;
      const std::size_t b = next_fill_;
      Slot& slot = slots_[b % slots_.size()];
      filling_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        fill(slot, b);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      filling_ = false;
      // set_epoch waits for filling_ to drop, so next_fill_ is still b here.
      slot.error = error;
      slot.batch = b;
      ++next_fill_;
      changed_.notify_all();
    }
  }

  const Dataset* data_;
  DistributedSampler sampler_;
  Options options_;
  std::size_t batches_ = 0;
  std::vector<Slot> slots_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t epoch_ = 0;
  bool started_ = false;
  bool filling_ = false;
  bool stop_ = false;
  std::size_t next_fill_ = 0;  // next batch the worker fills
  std::size_t released_ = 0;   // batches before this one are no longer in use by the caller
  std::size_t given_ = 0;      // batches handed out by next() this epoch
  std::thread worker_;
};

/// The loader of host batches.
using DataLoader = BasicDataLoader<HostBuffer>;

}  // namespace fusedp::data
