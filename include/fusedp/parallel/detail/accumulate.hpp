#pragma once
// Gradient accumulation, written once for both Parallel specializations: a replica's shard of a step
// is cut into `micro` micro-batches that run forward and backward one after the other (the workspace is
// sized for one micro-batch), and their gradients are added in order into an accumulator, with no
// communication in between (DDP's no_sync, Horovod's backward_passes_per_step). During the last
// micro-batch's backward each bucket of the bucket plan gets the accumulated sum added as soon as
// backward has finished it, and only then is handed to the reducer: the reduction still overlaps the
// last backward, and happens once per step.
//
// Every micro-batch's gradient is its share of the mean over the whole global batch (the normalizer),
// so the sum is the gradient of the mean over the K-times-larger batch; the order of the additions is
// fixed (micro-batch 0, 1, ...), so under Deterministic the result is bitwise the same on every run
// and every communicator.
#include "fusedp/core/error.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/net/model.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/options.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <cstddef>
#include <span>

namespace fusedp::parallel::detail {

/// `o` after checking what a Parallel constructor cannot take.
[[nodiscard]] inline ParallelOptions checked_options(ParallelOptions o) {
  require(o.accumulate >= 1, "Parallel: ParallelOptions::accumulate must be >= 1, got ", o.accumulate);
  return o;
}

/// How many micro-batches a shard of `count` samples runs: `micro`, or fewer when the shard has fewer
/// samples than that: one per sample, or per `least` samples where a micro-batch must hold that many
/// (Sequential::min_training_batch: a BatchNorm over one value a channel, without SyncBatchNorm's
/// sums), at least one. SyncBatchNorm sums statistics over the replicas inside every micro-batch, so
/// there every shard must have at least `micro` samples (every replica then runs the same number of
/// micro-batches).
[[nodiscard]] inline std::size_t micro_batch_count(std::size_t count, std::size_t micro, bool synchronized,
                                                   std::size_t least = 1) {
  require(micro >= 1, "Parallel: accumulate must be >= 1, got ", micro);
  require(count >= 1, "Parallel: a replica's shard holds no sample");
  if (synchronized) {
    require(count >= micro, "Parallel: accumulate ", micro, " with batch_norm::Sync needs at least ", micro,
            " samples in every replica's shard, this one has ", count,
            " (every replica must run as many micro-batches)");
    return micro;
  }
  return std::max<std::size_t>(1, std::min(micro, count / least));
}

/// Refuses a step whose smallest shard, `smallest` samples, cannot run: fewer than `micro` under
/// batch_norm::Sync (`synchronized`: every replica runs as many micro-batches, see micro_batch_count),
/// or fewer than `least` without it (a BatchNorm over one value a channel: Sequential::min_training_batch).
/// Parallel calls it with every replica's shard known to every replica, before any of them starts, so
/// that all refuse and nothing changes (no replica runs a micro-batch, or updates its statistics,
/// before another throws).
inline void require_micro_batches(std::size_t smallest, std::size_t micro, bool synchronized, std::size_t least) {
  if (synchronized && micro > 1)
    require(smallest >= micro, "Parallel: accumulate ", micro, " with batch_norm::Sync needs at least ", micro,
            " samples in every replica's shard, the smallest has ", smallest,
            " (every replica must run as many micro-batches)");
  if (!synchronized)
    require(smallest >= least, "Parallel: a replica's shard of ", smallest,
            " sample(s), but a BatchNorm of this network gets one value a channel and sample, and training needs "
            "at least ", least, " in every shard (more than one value per channel; or batch_norm::Sync)");
}

/// Micro-batch k of `pieces` over `count` samples, as even_shards(count, pieces)[k] (the first
/// count % pieces take one more), without building the list inside a step.
[[nodiscard]] constexpr Shard micro_batch(std::size_t count, std::size_t pieces, std::size_t k) noexcept {
  const std::size_t base = count / pieces, extra = count % pieces;
  return {k * base + (k < extra ? k : extra), base + (k < extra ? 1 : 0)};
}

/// Gradients of one replica's shard over its micro-batches, summed into the model's gradient buffer
/// (see the comment above). `add(src, dst, n)` adds n values on the model's space (dst += src);
/// `copy(src, dst, n)` copies them; `acc` holds Net::param_storage values of the model's space. Each
/// bucket of `plan` reaches `stage_done` complete. `first_sample`: where the shard begins in the
/// step's global batch (Dropout masks). Returns the shard's mean loss.
template <class Model, class Target, class Loss, class Add, class Copy, class StageDone>
float accumulate_gradients(Model& m, std::span<const GradientBucket> plan, float* acc, std::size_t micro,
                           std::span<const float> inputs,
                           std::span<const Target> targets, const Loss& loss, std::size_t normalizer,
                           ReplicaSum sync, std::size_t first_sample, Add&& add, Copy&& copy, StageDone&& stage_done) {
  const std::size_t in = Model::input_size;
  const std::size_t count = inputs.size() / in;
  const std::size_t pieces =
      micro <= 1 ? 1 : micro_batch_count(count, micro, bool(sync), Model::network::min_training_batch);
  // One piece (a shard of one sample) is the step's gradient itself: the sum buffer holds an earlier
  // step's micro-batches, which must not be added to it.
  if (pieces == 1) return m.compute_gradients(inputs, targets, loss, stage_done, normalizer, sync, first_sample);
  const std::size_t per_sample = targets.size() / count;
  double loss_sum = 0;
  for (std::size_t k = 0; k < pieces; ++k) {
    const Shard p = micro_batch(count, pieces, k);
    const std::span<const float> x = inputs.subspan(p.offset * in, p.count * in);
    const std::span<const Target> y = targets.subspan(p.offset * per_sample, p.count * per_sample);
    float l = 0;
    if (k + 1 < pieces) {
      l = m.compute_gradients(x, y, loss, NoStageHook{}, normalizer, sync, first_sample + p.offset);
      if (k == 0) copy(m.grads().data(), acc, Model::network::param_storage);
      else add(m.grads().data(), acc, Model::network::param_storage);
    } else {
      float* g = m.grads().data();
      l = m.compute_gradients(
          x, y, loss,
          [&](std::size_t stage) {
            for (const GradientBucket& b : plan)
              if (b.ready_after == stage) add(acc + b.begin, g + b.begin, b.end - b.begin);
            stage_done(stage);
          },
          normalizer, sync, first_sample + p.offset);
    }
    loss_sum += double(l) * double(p.count);
  }
  return float(loss_sum / double(count));
}

}  // namespace fusedp::parallel::detail
