#pragma once
// DistributedSampler: which samples rank r of w ranks visits in an epoch, as torch.utils.data.
// DistributedSampler does it. Every rank draws the same permutation from (seed, epoch) without
// communicating; rank r takes every w-th index of it starting at r, so shards are disjoint and
// together cover the dataset. For training, every rank gets the same count (padding by repeating
// the permutation from its start, or dropping the tail); for evaluation, every sample is visited
// exactly once and counts may differ by one.
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
    mine_.resize(num_samples_of(rank));
    fill(0);
  }

  /// Selects the epoch's permutation (the same on every rank for the same seed and epoch). Allocates
  /// nothing; call before each epoch, as with PyTorch's sampler.
  void set_epoch(std::uint64_t epoch) { fill(epoch); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// This rank's dataset indices for the current epoch, in visiting order.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return mine_; }
  /// Number of samples this rank visits per epoch.
  [[nodiscard]] std::size_t num_samples() const noexcept { return mine_.size(); }
  /// Number of samples rank `r` visits per epoch: every rank can know every rank's count (to agree on
  /// a step count) without communicating.
  [[nodiscard]] std::size_t num_samples_of(std::size_t r) const {
    require(r < world_, "DistributedSampler::num_samples_of: rank ", r, " is not in [0, ", world_, ")");
    if (options_.evaluation) return r < size_ ? (size_ - r + world_ - 1) / world_ : 0;
    if (options_.drop_last) return size_ / world_;
    return (size_ + world_ - 1) / world_;
  }
  /// Samples visited per epoch by all ranks together (padding included).
  [[nodiscard]] std::size_t total_size() const noexcept {
    if (options_.evaluation) return size_;
    return (options_.drop_last ? size_ / world_ : (size_ + world_ - 1) / world_) * world_;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t world() const noexcept { return world_; }
  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  void fill(std::uint64_t epoch) {
    epoch_ = epoch;
    if (options_.shuffle) permutation_into(order_, options_.seed, epoch);
    else std::iota(order_.begin(), order_.end(), std::size_t(0));
    // The padded global order is order_[k % size_] for k < total_size(): the head repeated as often
    // as needed, as PyTorch pads. Rank r takes positions r, r + w, r + 2w, ...
    for (std::size_t j = 0; j < mine_.size(); ++j) mine_[j] = order_[(rank_ + j * world_) % size_];
  }

  std::size_t size_, world_, rank_;
  Options options_;
  std::uint64_t epoch_ = 0;
  std::vector<std::size_t> order_;  // the epoch's permutation of all samples
  std::vector<std::size_t> mine_;   // this rank's share of it
};

}  // namespace fusedp::data
