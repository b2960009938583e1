#pragma once
// Parallel's fused update (issue 17), written once for both specializations: with AllReduce every
// replica holds the whole sum of a bucket as soon as that bucket's reduction is final, so the
// optimizer can update the bucket's parameters then (BucketReducer's bucket hook) instead of in one
// pass after the last reduction. On Cuda the update is queued on the communication stream right
// behind the bucket's all-reduce, so with Overlap it runs while backward goes on (and delays the next
// bucket's all-reduce by its own time: whether that pays is for a multi-GPU measurement); in one Host
// process it runs on the replica's thread right after the bucket's sum, while the bucket's gradient
// is still in cache; under MPI, started reductions are updated after backward. The first step of an
// optimizer (whose state does not exist yet) runs the one pass. The update is
// elementwise and every bucket is updated once with the step's numbers, so the parameters and the
// optimizer state are those of the one pass, bit for bit (tests/parallel/bucket_update.cpp).
//
// Not with ReduceBroadcast (only the root holds the sum) or ReduceScatter (each replica updates its
// own block after a reduce-scatter), nor with a Guarded optimizer: its decision (skip, clip) needs
// the whole gradient's statistics before any update.
#include "fusedp/parallel/policy.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace fusedp::parallel::detail {

/// Whether Parallel with `Policy` can update bucket by bucket with optimizer Opt.
template <class Policy, class Opt>
inline constexpr bool updates_buckets =
    Policy::reduce_kind == ReduceKind::all_reduce && !requires { typename Opt::on_nonfinite; };

/// What every bucket's update of one step shares, fixed before backward starts: the model's flat
/// buffers, the distance between the optimizer state's slots, and the step number.
template <class T>
struct BucketStep {
  T* params = nullptr;
  const T* grads = nullptr;
  T* state = nullptr;
  std::size_t stride = 0;  // elements between state slots: the whole buffer's size
  std::uint64_t t = 0;     // the optimizer step being taken (1-based)
};

/// Whether model `m` already holds the whole optimizer state of Opt. A step that would first allocate
/// (or replace) it runs the one pass instead: creating the state before forward would discard the old
/// state even when the step then throws on bad input (a loss option), which must change nothing.
template <class Model, class Opt>
bool holds_state_of(const Model& m, const Opt&) {
  const char* owner = m.optimizer_name();
  return owner != nullptr && std::strcmp(owner, Opt::name) == 0 &&
         m.optimizer_state().size() == Opt::state_slots * Model::network::param_storage;
}

/// The BucketStep of model `m`'s next update with `opt` (holds_state_of(m, opt): the state exists).
template <class Model, class Opt>
BucketStep<float> bucket_step(Model& m, const Opt& opt) {
  opt.validate();
  const std::span<float> state = m.template optimizer_state<Opt>();
  return {m.params().data(), m.grads().data(), state.data(), Model::network::param_storage, m.optimizer_steps() + 1};
}

}  // namespace fusedp::parallel::detail
