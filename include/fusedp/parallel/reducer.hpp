#pragma once
// BucketReducer<Policy>: the one place where the reduce policy becomes collectives. Each replica holds
// one; it walks the bucket plan (parallel/bucket_plan.hpp) as backward completes stages (Overlap: a bucket is
// reduced, or queued, as soon as backward has finished it) and reduces what is left after backward, over
// any GradientChannel: replicas of this process, MPI ranks, NCCL devices. Per bucket:
//   Deterministic     all-gather every replica's values, sum in rank order (kernels/rank_order_sum.hpp):
//                     the same bits whatever the communicator's own algorithm
//   Compress<bf16>    pack to bfloat16, sum in bfloat16, unpack
//   ReduceBroadcast   sum into the root only (the root steps and broadcasts the parameters)
//   otherwise         sum in place on every replica
// ReduceScatter (ZeRO-1) without Deterministic or Compress skips the buckets: one reduce-scatter of the
// whole buffer after backward leaves each replica the sum of the block it updates.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/trace.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/gradient_channel.hpp"
#include "fusedp/parallel/policy.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace fusedp::parallel {

/// Reduces one replica's flat gradient as the policy says, bucket by bucket.
/// @tparam Policy a parallel::Policy<...>
template <class Policy>
class BucketReducer {
 public:
  BucketReducer() = default;
  /// Reduces the buckets of `plan` (bucket_plan or BucketPlan::buckets).
  explicit BucketReducer(std::vector<GradientBucket> plan) : plan_(std::move(plan)), done_(plan_.size(), 0) {}
  [[nodiscard]] const std::vector<GradientBucket>& plan() const noexcept { return plan_; }

  /// ZeRO-1 with a plain sum: one reduce-scatter after backward instead of the buckets.
  static constexpr bool whole_reduce_scatter =
      Policy::reduce_kind == detail::ReduceKind::reduce_scatter && !Policy::deterministic && !Policy::compress;

  /// Before backward starts: no bucket is reduced yet.
  void begin() noexcept { std::fill(done_.begin(), done_.end(), char(0)); }

  /// Backward has finished (Cuda: queued) stage `stage`: with Overlap, the buckets it completes are reduced.
  /// Every stage also moves the reductions already started on (GradientChannel::progress).
  template <GradientChannel C>
  void stage_done(C& channel, float* grads, std::size_t stage) {
    if constexpr (Policy::overlap && !whole_reduce_scatter) {
      channel.progress();
      for (std::size_t b = 0; b < plan_.size(); ++b)
        if (plan_[b].ready_after == stage && !done_[b]) reduce(channel, grads, b, true);
    }
  }

  /// After backward: reduces what is left and waits for what was started (Cuda: queues it).
  template <GradientChannel C>
  void finish(C& channel, float* grads, const ZeroLayout& zero) {
    if constexpr (whole_reduce_scatter) {
      const std::int64_t begin = traced<C>() ? trace::now_ns() : 0;
      channel.before_reduction();
      [[maybe_unused]] const auto span =
          channel.reduction_span(-1, (zero.world * zero.shard + zero.tail) * sizeof(float));
      channel.reduce_scatter_sum(grads, zero);
      if (begin != 0) trace::blocking_reduction(begin, -1, (zero.world * zero.shard + zero.tail) * sizeof(float));
    } else {
      for (std::size_t b = 0; b < plan_.size(); ++b)
        if (!done_[b]) reduce(channel, grads, b, false);
    }
    channel.finish_started();
  }

 private:
  template <GradientChannel C>
  void reduce(C& channel, float* grads, std::size_t b, bool may_start) {
    float* g = grads + plan_[b].begin;
    const std::size_t n = plan_[b].end - plan_[b].begin;
    const std::int64_t begin = traced<C>() ? trace::now_ns() : 0;
    bool started = false;
    channel.before_reduction();
    [[maybe_unused]] const auto span = channel.reduction_span(std::int64_t(b), n * sizeof(float));
    if constexpr (Policy::deterministic) {
      float* all = channel.gathered(n * std::size_t(channel.size()));
      channel.all_gather(g, all, n);
      channel.template sum_in_rank_order<Policy::compress>(all, g, n);
    } else if constexpr (Policy::compress) {
      std::uint16_t* h = channel.packed(n);
      channel.pack_bf16(g, h, n);
      channel.all_reduce_sum_bf16(h, n);
      channel.unpack_bf16(h, g, n);
    } else if constexpr (Policy::reduce_kind == detail::ReduceKind::reduce_broadcast) {
      channel.reduce_sum(g, n, 0);
    } else if (may_start) {
      started = channel.start_all_reduce_sum(g, n, b);
    } else {
      channel.all_reduce_sum(g, n);
    }
    if (begin != 0 && !started) trace::blocking_reduction(begin, std::int64_t(b), n * sizeof(float));
    done_[b] = 1;
  }

  // Whether this reduction is traced: tracing is on and the host clock times the channel's work.
  template <GradientChannel C>
  static bool traced() noexcept {
    return C::timed_on_host && trace::active() != nullptr;
  }

  std::vector<GradientBucket> plan_;
  std::vector<char> done_;  // per bucket: reduced (or queued) in this step
};

}  // namespace fusedp::parallel
