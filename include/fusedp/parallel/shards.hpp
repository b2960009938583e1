#pragma once
// How a global batch is divided among replicas: even slices or slices proportional to run-time weights.
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace fusedp::parallel {

/// A contiguous slice of a batch: samples [offset, offset + count).
struct Shard {
  std::size_t offset;
  std::size_t count;
};

/// `batch` samples over `world` replicas: the first batch % world replicas get one more.
[[nodiscard]] inline std::vector<Shard> even_shards(std::size_t batch, std::size_t world) {
  require(world > 0, "even_shards: no replicas");
  require(batch >= world, "Parallel: a batch of ", batch, " samples is smaller than the ", world,
          " replicas; every replica needs at least one sample");
  std::vector<Shard> s(world);
  std::size_t offset = 0;
  for (std::size_t r = 0; r < world; ++r) {
    s[r] = {offset, batch / world + (r < batch % world ? 1 : 0)};
    offset += s[r].count;
  }
  return s;
}

/// `batch` samples in proportion to `weights` (largest remainder; every replica at least one sample).
[[nodiscard]] inline std::vector<Shard> weighted_shards(std::size_t batch, std::span<const double> weights) {
  const std::size_t world = weights.size();
  require(world > 0, "weighted_shards: no weights");
  require(batch >= world, "Parallel: a batch of ", batch, " samples is smaller than the ", world,
          " replicas; every replica needs at least one sample");
  // In units of the largest weight, so that the sum stays finite for any finite weights.
  double largest = 0;
  for (double w : weights) largest = std::max(largest, w);
  double total = 0;
  for (double w : weights) total += w / largest;
  std::vector<std::size_t> count(world, 1);  // one each first, the rest by weight
  std::vector<double> remainder(world);
  const std::size_t rest = batch - world;
  std::size_t given = 0;
  for (std::size_t r = 0; r < world; ++r) {
    const double exact = double(rest) * (weights[r] / largest) / total;
    const auto whole = std::size_t(std::floor(exact));
    count[r] += whole;
    given += whole;
    remainder[r] = exact - double(whole);
  }
  while (given < rest) {  // hand out what rounding left, largest remainder first (lowest rank on ties)
    std::size_t best = 0;
    for (std::size_t r = 1; r < world; ++r)
      if (remainder[r] > remainder[best]) best = r;
    ++count[best];
    remainder[best] = -1;
    ++given;
  }
  std::vector<Shard> s(world);
  std::size_t offset = 0;
  for (std::size_t r = 0; r < world; ++r) {
    s[r] = {offset, count[r]};
    offset += count[r];
  }
  return s;
}

/// ZeRO-1's ownership of the flat buffer of `n` elements among `world` replicas: replica r owns
/// [r*s, (r+1)*s) with s = n rounded down to a multiple of world * align, divided by world; the last
/// replica also owns the remainder (fewer than world * align elements). Equal blocks let NCCL
/// reduce-scatter and all-gather in place; the same layout on Host keeps one checkpoint format.
struct ZeroLayout {
  std::size_t world = 1;
  std::size_t shard = 0;  // elements of every block, the remainder aside
  std::size_t tail = 0;   // the remainder, owned by the last replica
  ZeroLayout() = default;
  ZeroLayout(std::size_t n, std::size_t world_size, std::size_t align)
      : world(world_size), shard(n / (world_size * align) * align), tail(n - world_size * shard) {}
  /// The block replica `r` owns.
  [[nodiscard]] Shard block(std::size_t r) const noexcept { return {r * shard, shard + (r + 1 == world ? tail : 0)}; }
};

}  // namespace fusedp::parallel
