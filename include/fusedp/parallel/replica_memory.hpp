#pragma once
// ReplicaMemory<Net, P, Policies...>: the device memory one replica of Parallel<Net, CudaSpace<P>,
// Policies...> holds, from the types, the replica's shard of a step and the world's size, before
// anything is allocated; and the largest shard that fits a budget. What Parallel<Net, Cuda>::memory_use(i)
// reports from the buffers it holds (tests/gpu/nccl.cu holds the two to each other on a device).
//
// A replica is a Model<Net, CudaSpace<P>> (net/cuda_memory.hpp counts it) that runs one micro-batch at a
// time: its workspace is sized for the largest micro-batch of its shard (ParallelOptions::accumulate
// pieces, the first ones a sample larger where they do not divide it). Beside it, by MemoryUse's parts:
//   optimizer_state  AllReduce: the model's own (state_slots x param_storage floats); ReduceBroadcast:
//                    only the root's replica holds any (it steps and broadcasts the parameters);
//                    ReduceScatter (ZeRO-1): each replica the state of its own block alone
//                    (parallel/shards.hpp: ZeroLayout)
//   reduction        with accumulate > 1, the micro-batches' gradient sum (param_storage floats); the
//                    NCCL channel's scratch for the largest bucket (parallel/reducer.hpp): under
//                    Deterministic every replica's copy of it (world x its floats), under Compress<bf16>
//                    alone its bf16 values
// Not counted, beside what CudaMemory leaves out: NCCL's own buffers (its channels' FIFOs, a few MiB a
// peer; NCCL_BUFFSIZE), a checkpoint's temporary copy of the whole optimizer state under ZeRO.
// Parallel::evaluate runs on local replica 0: evaluating batches of E larger than its micro-batch grows
// its model to E, after which it holds use(E x accumulate) (micro-batches of E). Under ZeRO-1 the last
// replica's block also holds the remainder of the flat buffer: `rank` world - 1 is the largest.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/net/cost.hpp"
#include "fusedp/net/cuda_memory.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/options.hpp"
#include "fusedp/parallel/policy.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fusedp {

/// The device memory of one replica of Parallel<Net, CudaSpace<P>, Policies...> (this header's top).
/// @tparam Net a Sequential<...>
/// @tparam P the precision policy of the replicas' CudaSpace
/// @tparam Policies the Parallel's policy tags, in any order
template <Network Net, class P, class... Policies>
struct ReplicaMemory {
  using policy = parallel::Policy<CudaSpace<P>, Policies...>;
  using model_memory = CudaMemory<Net, P>;

  /// Samples of the largest micro-batch a replica of a world of `world` runs from a shard of `shard`
  /// samples cut into `accumulate` pieces, or fewer where the shard is smaller (parallel/detail/
  /// accumulate.hpp: micro_batch_count).
  static constexpr std::size_t micro_batch(std::size_t shard, std::size_t accumulate, std::size_t world = 1) noexcept {
    const bool synchronized = policy::sync_batch_norm && world > 1;
    const std::size_t pieces =
        synchronized ? accumulate : std::max<std::size_t>(1, std::min(accumulate, shard / Net::min_training_batch));
    return (shard + pieces - 1) / pieces;
  }

  /// Bytes of the NCCL channel's scratch for the largest bucket of the plan `p` makes.
  static std::size_t channel_bytes(std::size_t world, const ParallelOptions& p) {
    if constexpr (!policy::deterministic && !policy::compress) {
      return 0;
    } else {
      std::size_t largest = 0;
      for (const parallel::GradientBucket& b :
           parallel::bucket_plan<Net>(parallel::bucket_capacity<policy>(p), sizeof(float)))
        largest = std::max(largest, b.end - b.begin);
      if constexpr (policy::deterministic) return world * largest * sizeof(float);
      else return largest * sizeof(std::uint16_t);
    }
  }

  /// What replica `rank` of `world` holds on a device of `sm_count` SMs once it has trained on shards of
  /// up to `shard` samples, in bytes by part. `o`: how its model is used (its state_slots: the optimizer's,
  /// Opt::state_slots; its branches follow `p.backward_branches`, not o.branches); `p`: the Parallel's
  /// options (accumulate, bucket_bytes, backward_branches). Shard 0: before the first step.
  static MemoryUse use(std::size_t shard, int sm_count, std::size_t world, const CudaMemoryOptions& o = {},
                       const ParallelOptions& p = {}, std::size_t rank = 0) {
    require(world >= 1 && rank < world, "ReplicaMemory: replica ", rank, " of a world of ", world, " does not exist");
    require(p.accumulate >= 1, "ReplicaMemory: accumulate must be >= 1, got ", p.accumulate);
    MemoryUse m = model_memory::use(micro_batch(shard, std::size_t(p.accumulate), world), sm_count, model_options(o, p));
    if (shard > 0) {
      std::size_t state_floats = o.state_slots * Net::param_storage;
      if constexpr (policy::reduce_kind == parallel::detail::ReduceKind::reduce_scatter)
        state_floats = o.state_slots * parallel::ZeroLayout(Net::param_storage, world, align_elements_count).block(rank).count;
      else if constexpr (policy::reduce_kind == parallel::detail::ReduceKind::reduce_broadcast)
        state_floats = rank == 0 ? state_floats : 0;
      m.optimizer_state = state_floats * sizeof(float);
      m.reduction = (p.accumulate > 1 ? Net::param_storage * sizeof(float) : 0) + channel_bytes(world, p);
    }
    return m;
  }

  /// The largest shard (samples a replica takes each step) whose use() fits `budget_bytes`: `accumulate`
  /// micro-batches of the largest that fits beside what does not grow with it (0 when not even one
  /// sample fits).
  static std::size_t largest_shard(std::size_t budget_bytes, int sm_count, std::size_t world,
                                   const CudaMemoryOptions& o = {}, const ParallelOptions& p = {},
                                   std::size_t rank = 0) {
    const MemoryUse one = use(1, sm_count, world, o, p, rank);
    const std::size_t beside = one.optimizer_state + one.reduction;
    if (budget_bytes < beside) return 0;
    std::size_t shard =
        model_memory::largest_batch(budget_bytes - beside, sm_count, model_options(o, p)) * std::size_t(p.accumulate);
    // Where a micro-batch must hold two samples (BatchNorm1d), a shard of one-sample micro-batches runs
    // fewer, larger ones: back off to the last shard that fits.
    while (shard > 0 && use(shard, sm_count, world, o, p, rank).total() > budget_bytes) --shard;
    return shard;
  }

 private:
  // The options of the replica's model: its branches as Parallel sets them, its optimizer state counted
  // here (none of it, or a block, may be the model's).
  static CudaMemoryOptions model_options(const CudaMemoryOptions& o, const ParallelOptions& p) noexcept {
    CudaMemoryOptions mo = o;
    mo.branches = p.backward_branches;
    mo.state_slots = 0;
    return mo;
  }
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
