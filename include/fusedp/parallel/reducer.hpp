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
// A bucket hook (`on_final(begin, end)`) learns each bucket once its reduced values are final in the
// channel's order: at once for a reduction done when it returns (in-process) or queued on the stream the
// hook's own work is queued on (NCCL), after finish_started() for a started one (MPI: after backward,
// even if it completed earlier). Parallel's fused update applies the optimizer to each bucket there
// (issue 17).
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

/// The bucket hook that does nothing.
struct NoBucketHook {
  void operator()(std::size_t, std::size_t) const noexcept {}
};

/// Reduces one replica's flat gradient as the policy says, bucket by bucket.
/// @tparam Policy a parallel::Policy<...>
template <class Policy>
class BucketReducer {
 public:
  BucketReducer() = default;
  /// Reduces the buckets of `plan` (bucket_plan or BucketPlan::buckets).
  explicit BucketReducer(std::vector<GradientBucket> plan)
      : plan_(std::move(plan)), done_(plan_.size(), 0), pending_(plan_.size(), 0) {}
  [[nodiscard]] const std::vector<GradientBucket>& plan() const noexcept { return plan_; }

  /// ZeRO-1 with a plain sum: one reduce-scatter after backward instead of the buckets.
  static constexpr bool whole_reduce_scatter =
      Policy::reduce_kind == detail::ReduceKind::reduce_scatter && !Policy::deterministic && !Policy::compress;

  /// Before backward starts: no bucket is reduced yet.
  void begin() noexcept {
    std::fill(done_.begin(), done_.end(), char(0));
    std::fill(pending_.begin(), pending_.end(), char(0));
  }

  /// Whether the buckets tile the whole flat buffer of `storage` elements, in reverse order (what a
  /// bucket hook that updates the parameters needs: every element in exactly one bucket).
  [[nodiscard]] bool covers(std::size_t storage) const noexcept {
    std::size_t end = storage;
    for (const GradientBucket& b : plan_) {
      if (b.end != end || b.begin > b.end) return false;
      end = b.begin;
    }
    return end == 0;
  }

  /// Backward has finished (Cuda: queued) stage `stage`: with Overlap, the buckets it completes are reduced.
  /// Every stage also moves the reductions already started on (GradientChannel::progress). `on_final`: the
  /// bucket hook (see above).
  template <GradientChannel C, class Final = NoBucketHook>
  void stage_done(C& channel, float* grads, std::size_t stage, Final&& on_final = {}) {
    if constexpr (Policy::overlap && !whole_reduce_scatter) {
      channel.progress();
      for (std::size_t b = 0; b < plan_.size(); ++b)
        if (plan_[b].ready_after == stage && !done_[b]) reduce(channel, grads, b, true, on_final);
    }
  }

  /// After backward: reduces what is left and waits for what was started (Cuda: queues it); the hook
  /// learns the buckets it has not seen yet, in plan order.
  template <GradientChannel C, class Final = NoBucketHook>
  void finish(C& channel, float* grads, const ZeroLayout& zero, Final&& on_final = {}) {
    if constexpr (whole_reduce_scatter) {
      const std::int64_t begin = traced<C>() ? trace::now_ns() : 0;
      channel.before_reduction();
      [[maybe_unused]] const auto span =
          channel.reduction_span(-1, (zero.world * zero.shard + zero.tail) * sizeof(float));
      channel.reduce_scatter_sum(grads, zero);
      if (begin != 0) trace::blocking_reduction(begin, -1, (zero.world * zero.shard + zero.tail) * sizeof(float));
    } else {
      for (std::size_t b = 0; b < plan_.size(); ++b)
        if (!done_[b]) reduce(channel, grads, b, false, on_final);
    }
    channel.finish_started();
    for (std::size_t b = 0; b < plan_.size(); ++b)
      if (pending_[b]) {
        pending_[b] = 0;
        on_final(plan_[b].begin, plan_[b].end);
      }
  }

 private:
  // Reduces bucket b, then tells the hook when the sum is final now (the reduction's span has ended
  // by then, so the hook's own work is not counted as reduction time).
  template <GradientChannel C, class Final>
  void reduce(C& channel, float* grads, std::size_t b, bool may_start, Final& on_final) {
    done_[b] = 1;
    if (collective(channel, grads, b, may_start)) pending_[b] = 1;
    else on_final(plan_[b].begin, plan_[b].end);
  }

  // The collectives of bucket b; returns whether the reduction was started and may still be running.
  template <GradientChannel C>
  bool collective(C& channel, float* grads, std::size_t b, bool may_start) {
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
    return started;
  }

  // Whether this reduction is traced: tracing is on and the host clock times the channel's work.
  template <GradientChannel C>
  static bool traced() noexcept {
    return C::timed_on_host && trace::active() != nullptr;
  }

  std::vector<GradientBucket> plan_;
  std::vector<char> done_;     // per bucket: reduced (or queued) in this step
  std::vector<char> pending_;  // per bucket: started, its hook waits for finish()
};

}  // namespace fusedp::parallel
