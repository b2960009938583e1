// ReplicaMemory (parallel/replica_memory.hpp): what one replica of Parallel<Net, Cuda> holds on its
// device, predicted from the types. Without a device, here: the model's part is CudaMemory's at the
// largest micro-batch, with its branches as ParallelOptions says; the optimizer state is the model's
// under AllReduce, the root's alone under ReduceBroadcast, each replica's ZeRO block under
// ReduceScatter (together the whole); the reduction's memory is the micro-batches' sum and the channel's
// scratch for the largest bucket (world copies under Deterministic, bf16 under Compress); largest_shard
// is the last shard that fits; bad arguments are errors that say so. That Parallel::memory_use() equals
// the prediction is tests/gpu/nccl.cu's, on a device.
#include "gpu_test.hpp"

#include "../support/seed_networks.hpp"

#include <fusedp/parallel/replica_memory.hpp>

#include <cstddef>

namespace fp = fusedp;

namespace {

using LeNet = seed_networks::LeNet;
using P = fp::precision::Tf32;
template <class... Policies>
using RM = fp::ReplicaMemory<LeNet, P, Policies...>;
using Model = fp::CudaMemory<LeNet, P>;
constexpr int sm = 132;
constexpr std::size_t f = sizeof(float);

// LeNet's parameters by tensor, aligned to 16 floats: conv1 150 (160) + 6 (16), conv2 864 + 16, fc1
// 48,000 + 120 (128), fc2 7,200 + 60 (64), fc3 600 (608) + 10 (16).
constexpr std::size_t storage = 160 + 16 + 864 + 16 + 48000 + 128 + 7200 + 64 + 608 + 16;
static_assert(LeNet::param_storage == storage);

// Every part but optimizer_state and reduction (which each test checks): the replica's model at `micro`
// samples.
void check_model_part(const fp::MemoryUse& got, std::size_t micro, bool branches = true) {
  CAPTURE(micro);
  fp::MemoryUse want = Model::use(micro, sm, {.state_slots = 0, .branches = branches});
  want.optimizer_state = got.optimizer_state;
  want.reduction = got.reduction;
  gpu_test::check_same(got, want);
}

}  // namespace

TEST_CASE("ReplicaMemory: an AllReduce replica holds its model, its optimizer state and nothing else") {
  const fp::MemoryUse m = RM<>::use(64, sm, 4, {.state_slots = 2});
  check_model_part(m, 64);
  CHECK(m.optimizer_state == 2 * storage * f);
  CHECK(m.reduction == 0);
  CHECK(m.total() == Model::use(64, sm, {.state_slots = 2}).total());
  // Before the first step: no state, no reduction memory.
  const fp::MemoryUse before = RM<>::use(0, sm, 4, {.state_slots = 2});
  check_model_part(before, 0);
  CHECK(before.optimizer_state == 0);
  // The replica's branches are ParallelOptions' (a model's own default does not apply).
  check_model_part(RM<>::use(64, sm, 4, {}, {.backward_branches = false}), 64, false);
  check_model_part(RM<>::use(64, sm, 4, {.branches = false}, {.backward_branches = true}), 64, true);
}

TEST_CASE("ReplicaMemory: accumulate sizes the model for the largest micro-batch and adds the gradient sum") {
  const fp::ParallelOptions four{.accumulate = 4};
  check_model_part(RM<>::use(64, sm, 2, {}, four), 16);
  check_model_part(RM<>::use(66, sm, 2, {}, four), 17);  // 17, 17, 16, 16
  check_model_part(RM<>::use(3, sm, 2, {}, four), 1);    // fewer samples than pieces: one each
  CHECK(RM<>::use(64, sm, 2, {}, four).reduction == storage * f);
  CHECK(RM<>::use(64, sm, 2, {}, {.accumulate = 1}).reduction == 0);
}

TEST_CASE("ReplicaMemory: the channel's scratch for the largest bucket, under Deterministic and Compress") {
  // One bucket (no Bucket policy, no bucket_bytes): the whole flat buffer.
  CHECK(RM<fp::Deterministic>::use(32, sm, 4).reduction == 4 * storage * f);
  CHECK(RM<fp::Compress<fp::bf16>>::use(32, sm, 4).reduction == storage * 2);
  // 4 KiB buckets: fc1's weight (48,000 floats) is a bucket of its own, the largest.
  CHECK(RM<fp::Deterministic, fp::Bucket<4096>>::use(32, sm, 2).reduction == 2 * 48000 * f);
  CHECK(RM<fp::Deterministic>::use(32, sm, 2, {}, {.bucket_bytes = 4096}).reduction == 2 * 48000 * f);
  CHECK(RM<fp::Compress<fp::bf16>, fp::Bucket<4096>>::use(32, sm, 2).reduction == 48000 * 2);
  // Deterministic with Compress gathers fp32 values and sums them in bf16: the gather's scratch alone.
  CHECK(RM<fp::Deterministic, fp::Compress<fp::bf16>, fp::Bucket<4096>>::use(32, sm, 3).reduction == 3 * 48000 * f);
  // Plain sums run in place.
  CHECK(RM<fp::Bucket<4096>, fp::Overlap>::use(32, sm, 8).reduction == 0);
  // With accumulate both add up.
  CHECK(RM<fp::Deterministic>::use(32, sm, 2, {}, {.accumulate = 2}).reduction == (storage + 2 * storage) * f);
}

TEST_CASE("ReplicaMemory: the optimizer state of ReduceBroadcast's root and of ZeRO-1's blocks") {
  using Root = RM<fp::reduce::ReduceBroadcast<>>;
  CHECK(Root::use(32, sm, 3, {.state_slots = 1}, {}, 0).optimizer_state == storage * f);
  CHECK(Root::use(32, sm, 3, {.state_slots = 1}, {}, 1).optimizer_state == 0);
  CHECK(Root::use(32, sm, 3, {.state_slots = 1}, {}, 2).optimizer_state == 0);
  using Zero = RM<fp::reduce::ReduceScatter<>>;
  // 3 replicas: blocks of 19,024 floats (57,072 / 3, a multiple of 16), the last one with the remainder
  // (none here).
  constexpr std::size_t block = 19024;
  CHECK(Zero::use(32, sm, 3, {.state_slots = 2}, {}, 0).optimizer_state == 2 * block * f);
  CHECK(Zero::use(32, sm, 3, {.state_slots = 2}, {}, 1).optimizer_state == 2 * block * f);
  CHECK(Zero::use(32, sm, 3, {.state_slots = 2}, {}, 2).optimizer_state == 2 * (storage - 2 * block) * f);
  CHECK(Zero::use(32, sm, 1, {.state_slots = 2}).optimizer_state == 2 * storage * f);
  check_model_part(Zero::use(32, sm, 3, {.state_slots = 2}, {}, 2), 32);
}

TEST_CASE("ReplicaMemory: largest_shard is the last shard that fits, in whole micro-batches") {
  const std::size_t budget = 64 * (std::size_t(1) << 20);
  for (int accumulate : {1, 3}) {
    CAPTURE(accumulate);
    const fp::ParallelOptions p{.accumulate = accumulate};
    const fp::CudaMemoryOptions o{.state_slots = 2};
    const std::size_t s = RM<fp::Deterministic>::largest_shard(budget, sm, 4, o, p);
    CHECK(s > 0);
    CHECK(s % std::size_t(accumulate) == 0);
    CHECK(RM<fp::Deterministic>::use(s, sm, 4, o, p).total() <= budget);
    CHECK(RM<fp::Deterministic>::use(s + 1, sm, 4, o, p).total() > budget);
  }
  // Not even the state and the reduction's memory fit: 0.
  CHECK(RM<fp::Deterministic>::largest_shard(4 * storage * f, sm, 4) == 0);
}

TEST_CASE("ReplicaMemory: a replica outside the world, or accumulate 0, is an error that says so") {
  CHECK_THROWS_WITH_AS((void)RM<>::use(8, sm, 2, {}, {}, 2), doctest::Contains("replica 2 of a world of 2"),
                       fp::InvalidArgument);
  CHECK_THROWS_WITH_AS((void)RM<>::use(8, sm, 0), doctest::Contains("world of 0"), fp::InvalidArgument);
  CHECK_THROWS_WITH_AS((void)RM<>::use(8, sm, 2, {}, {.accumulate = 0}), doctest::Contains("accumulate must be >= 1"),
                       fp::InvalidArgument);
}

TEST_CASE("ReplicaMemory: micro-batches as Parallel cuts them, of two samples where a BatchNorm1d needs them") {
  using Bn1d = fp::Sequential<fp::Input<8, 1, 1>, fp::Linear<8>, fp::BatchNorm1d<>, fp::ReLU, fp::Linear<3>>;
  using Broadcast = fp::ReplicaMemory<Bn1d, P, fp::batch_norm::Broadcast>;
  CHECK(Broadcast::micro_batch(5, 4) == 3);  // two pieces, 3 and 2
  CHECK(Broadcast::micro_batch(3, 4) == 3);  // one piece
  CHECK(Broadcast::micro_batch(16, 4) == 4);
  using Sync = fp::ReplicaMemory<Bn1d, P, fp::batch_norm::Sync>;
  CHECK(Sync::micro_batch(5, 4, 2) == 2);  // SyncBatchNorm across 2 replicas: 4 pieces, sums over both
  CHECK(Sync::micro_batch(5, 4, 1) == 3);  // one replica has no one to sum with
  CHECK(RM<>::micro_batch(5, 4) == 2);     // LeNet: 4 pieces, 2, 1, 1, 1
}
