#pragma once
// DistributedSampler: which samples rank r of w ranks visits in an epoch, as torch.utils.data.
// DistributedSampler does it. Every rank draws the same permutation from (seed, epoch) without
// communicating; rank r takes every w-th index of it starting at r, so shards are disjoint and
// together cover the dataset. For training, every rank gets the same count (padding by repeating
// the permutation from its start, or dropping the tail); for evaluation, every sample is visited
// exactly once and counts may differ by one.
//
// Resuming inside an epoch (EpochPosition): rank r of w takes global positions r, r + w, ..., so
// after k equal steps the ranks together have visited a prefix of the epoch's order, whatever w was.
// set_epoch(epoch, {.samples = S}) splits the rest of that order, positions S, S + 1, ..., among the
// ranks of this run, which may be more or fewer than those that visited the prefix: each remaining
// sample is visited exactly once; the padding that gives every rank the same count repeats samples
// of the visited prefix (from its head, as a whole epoch's padding repeats the epoch's head). At the
// same world size the rest is exactly what each rank would have visited after its first S / w samples.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/data/batches.hpp"

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace fusedp::data {

/// How a DistributedSampler orders and splits the samples.
struct SamplerOptions {
  bool shuffle = true;      ///< a new permutation each epoch (else dataset order)
  std::uint64_t seed = 0;   ///< with the epoch, selects the permutation; must be the same on every rank
  bool drop_last = false;   ///< training: drop the tail so every rank has size / world samples (else pad)
  bool evaluation = false;  ///< every sample exactly once across ranks, no padding; counts may differ
};

/// Where an epoch stands: samples of its global order (all ranks together) already visited. A
/// loader reports it after each batch (DataLoader::position); a checkpoint stores it; set_epoch
/// starts there. 0 is the epoch's start and the dataset's size its end.
struct EpochPosition {
  std::size_t samples = 0;
  friend bool operator==(const EpochPosition&, const EpochPosition&) = default;
};

/// The samples of one rank for one epoch.
///
///     DistributedSampler sampler{train.count, world, rank, {.shuffle = true, .seed = 42}};
///     sampler.set_epoch(epoch);
///     for (std::size_t i : sampler.indices()) ...
class DistributedSampler {
 public:
  using Options = SamplerOptions;

  /// @param size samples in the dataset (> 0)
  /// @param world number of ranks (>= 1); @param rank this rank, in [0, world)
  DistributedSampler(std::size_t size, std::size_t world = 1, std::size_t rank = 0, Options options = {})
      : size_(size), world_(world), rank_(rank), options_(options) {
    require(size > 0, "DistributedSampler: the dataset is empty");
    require(world >= 1, "DistributedSampler: world size must be >= 1, got ", world);
    require(rank < world, "DistributedSampler: rank ", rank, " is not in [0, ", world, ")");
    require(!(options.evaluation && options.drop_last),
            "DistributedSampler: evaluation visits every sample once; it cannot drop_last");
    require(!options.drop_last || size >= world, "DistributedSampler: drop_last with ", size,
            " samples leaves nothing for each of ", world, " ranks");
    order_.resize(size);
    mine_.resize(num_samples_of(rank));  // the most any start leaves
    fill(0, {});
  }

  /// Selects the epoch's permutation (the same on every rank for the same seed and epoch) and where
  /// in it this run starts: `start.samples` positions of the global order already visited, by this
  /// run's ranks or by another number of ranks before a resume (0: the whole epoch; the dataset's
  /// size: none of it). Allocates nothing; call before each epoch, as with PyTorch's sampler.
  void set_epoch(std::uint64_t epoch, EpochPosition start = {}) {
    require(start.samples <= size_, "DistributedSampler::set_epoch: a start at sample ", start.samples,
            " of an epoch of ", size_);
    fill(epoch, start);
  }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// Where the current epoch started (set_epoch's `start`).
  [[nodiscard]] EpochPosition start() const noexcept { return {start_}; }

  /// This rank's dataset indices for the current epoch (from its start), in visiting order.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return {mine_.data(), count_}; }
  /// Number of samples this rank visits in the current epoch (from its start).
  [[nodiscard]] std::size_t num_samples() const noexcept { return count_; }
  /// Number of samples rank `r` visits in the current epoch: every rank can know every rank's count
  /// (to agree on a step count) without communicating.
  [[nodiscard]] std::size_t num_samples_of(std::size_t r) const {
    require(r < world_, "DistributedSampler::num_samples_of: rank ", r, " is not in [0, ", world_, ")");
    const std::size_t rest = size_ - start_;
    if (options_.evaluation) return r < rest ? (rest - r + world_ - 1) / world_ : 0;
    if (options_.drop_last) return rest / world_;
    return (rest + world_ - 1) / world_;
  }
  /// Samples visited in the current epoch (from its start) by all ranks together, padding included.
  [[nodiscard]] std::size_t total_size() const noexcept {
    const std::size_t rest = size_ - start_;
    if (options_.evaluation) return rest;
    return (options_.drop_last ? rest / world_ : (rest + world_ - 1) / world_) * world_;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t world() const noexcept { return world_; }
  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  void fill(std::uint64_t epoch, EpochPosition start) {
    epoch_ = epoch;
    start_ = start.samples;
    if (options_.shuffle) permutation_into(order_, options_.seed, epoch);
    else std::iota(order_.begin(), order_.end(), std::size_t(0));
    // The padded global order is order_[k] for k < size_, then padding: the head repeated as often as
    // needed, as PyTorch pads; from a start S > 0 the head of the visited prefix order_[0, S), so no
    // sample after S is visited twice. Rank r takes positions S + r, S + r + w, S + r + 2w, ...
    count_ = num_samples_of(rank_);
    for (std::size_t j = 0; j < count_; ++j) {
      const std::size_t k = start_ + rank_ + j * world_;
      mine_[j] = order_[k < size_ ? k : start_ > 0 ? (k - size_) % start_ : k % size_];
    }
  }

  std::size_t size_, world_, rank_;
  Options options_;
  std::uint64_t epoch_ = 0;
  std::size_t start_ = 0;  // global positions of the epoch visited before this run's share
  std::size_t count_ = 0;  // this rank's samples from start_ on (mine_ holds the most any start leaves)
  std::vector<std::size_t> order_;  // the epoch's permutation of all samples
  std::vector<std::size_t> mine_;   // this rank's share of it
};

}  // namespace fusedp::data
