#pragma once
// What both Parallel specializations do the same way around a step: the input checks, the shard split,
// the run-time weights' checks, one model's evaluation sums, and the sums over the processes.
#include "fusedp/core/error.hpp"
#include "fusedp/loss/softmax_cross_entropy.hpp"
#include "fusedp/parallel/options.hpp"
#include "fusedp/parallel/process_group.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace fusedp::parallel::detail {

/// One model's evaluation sums on this process's samples (none when `inputs` is empty).
template <class Model, class Loss>
GlobalEvaluation evaluate_local(Model& model, std::span<const float> inputs,
                                std::span<const typename Loss::template target<float>> targets, const Loss& loss) {
  GlobalEvaluation local;
  if (inputs.empty()) return local;
  const std::size_t batch = inputs.size() / Model::input_size;
  const auto e = model.evaluate(inputs, targets, loss);
  local.loss_sum = double(e.loss) * double(batch);
  if constexpr (std::is_same_v<typename Loss::template target<float>, std::int32_t>)
    local.correct = count_correct(e.outputs, targets);
  local.count = batch;
  return local;
}

/// Evaluation sums added over the processes (a collective).
inline GlobalEvaluation sum_over(const ProcessGroup& processes, const GlobalEvaluation& local) {
  std::array<double, 3> sums{local.loss_sum, double(local.correct), double(local.count)};
  processes.all_reduce_sum(sums.data(), sums.size());
  return {sums[0], std::size_t(sums[1]), std::size_t(sums[2])};
}

/// The number of samples in a data-parallel step's inputs, after checking them and their targets.
template <class Model, class Loss>
std::size_t checked_batch(std::span<const float> inputs,
                          std::span<const typename Loss::template target<float>> targets) {
  const std::size_t in = Model::input_size;
  require(!inputs.empty() && inputs.size() % in == 0, "Parallel: ", inputs.size(),
          " input values are not a whole number of samples of ", in, " values");
  const std::size_t batch = inputs.size() / in;
  Loss::validate(targets, batch, Model::output_size);
  return batch;
}

/// scatter::Weighted's run-time weights, checked: one per replica of the world, finite and > 0.
template <bool Weighted>
std::vector<double> checked_weights(std::span<const double> weights, std::size_t world) {
  static_assert(Weighted, "fusedp::Parallel::set_weights: only scatter::Weighted takes weights");
  require(weights.size() == world, "Parallel::set_weights: ", weights.size(), " weights for ", world, " replicas");
  for (double w : weights) require(std::isfinite(w) && w > 0, "Parallel::set_weights: weights must be finite and > 0");
  return {weights.begin(), weights.end()};
}

/// This process's shards of a batch, one per local replica: Sharded splits this process's own data
/// among its replicas; Even and Weighted split the global batch among the world's replicas, of which
/// an MPI rank (rank >= 0) keeps its own.
inline std::vector<Shard> process_shards(bool sharded, bool weighted, std::size_t batch, std::size_t local_replicas,
                                         std::size_t world, std::span<const double> weights, int rank) {
  if (sharded) return even_shards(batch, local_replicas);
  std::vector<Shard> all = weighted ? weighted_shards(batch, weights) : even_shards(batch, world);
  if (rank >= 0) return {all[std::size_t(rank)]};
  return all;
}

/// The fewest samples a replica gets from `shards` (process_shards' list, or every replica's when a
/// process knows them all).
[[nodiscard]] inline std::size_t smallest_count(std::span<const Shard> shards) {
  std::size_t least = shards.empty() ? 0 : shards[0].count;
  for (const Shard& s : shards) least = std::min(least, s.count);
  return least;
}

/// The fewest samples any replica of the world gets in a step of `batch` under Even or Weighted (under
/// Sharded each process knows the others' counts only once they are summed).
[[nodiscard]] inline std::size_t smallest_shard(bool weighted, std::size_t batch, std::size_t world,
                                                std::span<const double> weights) {
  if (!weighted) return batch / world;  // even_shards gives the first batch % world one more
  return smallest_count(weighted_shards(batch, weights));
}

/// The slice of a step's targets that goes with shard `s` of a batch of `batch` samples.
template <class Target>
std::span<const Target> targets_of(std::span<const Target> targets, std::size_t batch, const Shard& s) {
  const std::size_t per_sample = targets.size() / batch;
  return targets.subspan(s.offset * per_sample, s.count * per_sample);
}

}  // namespace fusedp::parallel::detail
