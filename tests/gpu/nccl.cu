// Parallel<Net, Cuda> over NCCL and the NCCL communicator itself, with the devices this machine has.
// With one device (world size 1) a Parallel run must reproduce Model<Net, Cuda>::train_step with the
// same batch: bit for bit in fp32 (the collectives sum one rank, the shard scale is 1), within the TF32
// bound with TF32, for every policy set (buckets, Overlap, Deterministic, ReduceBroadcast, ReduceScatter
// = ZeRO-1). Compress<bf16> with one rank reproduces a model whose gradients were rounded to bfloat16
// (to nearest even) before each update, bit for bit. With two or more devices, 2 replicas with B/2
// samples each reproduce 1 replica with B (Compress within the Host test's bfloat16 bound, 1e-2). A
// communicator whose peer never arrives gives up after its timeout instead of hanging. The fused update
// (each bucket's update queued behind its all-reduce) gives the one pass's parameters and optimizer
// state bit for bit.
#include "gpu_test.hpp"

#include <fusedp/parallel/parallel.hpp>
#include <fusedp/train/parallel_checkpoint.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>
#include "../data/temp_dir.hpp"
#include "../support/seed_networks.hpp"

#if !FUSEDP_HAS_NCCL
#error "tests/gpu/nccl.cu needs <nccl.h> (tests/CMakeLists.txt builds it only where NCCL::NCCL exists)"
#endif

namespace fp = fusedp;
using namespace gpu_test;

namespace {

using seed_networks::LeNet;
// 4 KiB buckets: LeNet's 57k parameters make many buckets, several per stage for the Linear layers.
using Small = fp::Bucket<4096>;
static_assert(fp::parallel::BucketPlan<LeNet, Small::bytes>::count > 4);

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
Batch batch_of(std::size_t size, std::uint64_t step) {
  Batch b{random_values(size * LeNet::input_shape::size, 100 + step), std::vector<std::int32_t>(size)};
  const auto u = random_values(size, 200 + step, 0.0f, 1.0f);
  for (std::size_t i = 0; i < size; ++i) b.y[i] = std::int32_t(std::size_t(u[i] * 10.0f) % 10);
  return b;
}

constexpr int steps = 20;
constexpr std::size_t batch = 32;
const fp::Sgd sgd_options{{.lr = 0.05f, .momentum = 0.9f}};

// Losses and final parameters of `steps` steps of a trainer (a Model or a Parallel).
struct Run {
  std::vector<float> losses;
  std::vector<float> params;
};
template <class Trainer>
Run train(Trainer& t, std::size_t size) {
  fp::Sgd opt = sgd_options;
  Run r;
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    r.losses.push_back(
        t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, opt));
  }
  if constexpr (requires { t.model(0); }) r.params = params_on_host(t.model(0));
  else r.params = params_on_host(t);
  return r;
}

template <class Space, class... Policies>
void world_one_reproduces_model(const char* what) {
  INFO(what);
  fp::Model<LeNet, Space> single{fp::seed(7), Space{0}};
  const Run want = train(single, batch);
  fp::Parallel<LeNet, Space, Policies...> dp{fp::replicas(1), fp::seed(7)};
  REQUIRE(dp.world_size() == 1);
  const Run got = train(dp, batch);
  CHECK(dp.model().steps() == std::uint64_t(steps));
  if constexpr (std::is_same_v<Space, fp::CudaFp32>) {
    for (int s = 0; s < steps; ++s) CHECK_MESSAGE(got.losses[std::size_t(s)] == want.losses[std::size_t(s)], "step " << s);
    CHECK(got.params == want.params);
  } else {
    // TF32 kernels are deterministic too, so this is usually exact; the bound is what is promised.
    CHECK(relative_error(got.losses, want.losses) < bound<Space>(8));
    CHECK(relative_error(got.params, want.params) < bound<Space>(8));
  }
}

}  // namespace

TEST_CASE("NcclCommunicator: one rank sums, gathers and broadcasts in place") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space{0};
  fp::parallel::NcclCommunicator comm(fp::parallel::NcclCommunicator::unique_id(), 0, 1, 0, std::chrono::seconds(60));
  CHECK(comm.valid());
  CHECK(comm.size() == 1);
  const std::vector<float> values = random_values(1000, 1);
  fp::DeviceBuffer<float> d = upload(space, values), all(1000);
  comm.all_reduce_sum(d.data(), d.size(), space.stream());
  comm.all_gather(d.data(), all.data(), d.size(), space.stream());
  comm.broadcast(d.data(), d.size(), 0, space.stream());
  comm.reduce_sum(d.data(), d.size(), 0, space.stream());
  comm.wait(space.stream(), "the test's collectives");
  CHECK(download(space, d) == values);
  CHECK(download(space, all) == values);
}

TEST_CASE("NcclCommunicator: one rank's reduce-scatter, all-gather in place, bf16 sum and min leave values as they are") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Cuda space{0};
  fp::parallel::NcclCommunicator comm(fp::parallel::NcclCommunicator::unique_id(), 0, 1, 0, std::chrono::seconds(60));
  const std::vector<float> values = random_values(1000, 2);
  fp::DeviceBuffer<float> d = upload(space, values);
  comm.reduce_scatter_sum_in_place(d.data(), d.size(), space.stream());
  comm.all_gather_in_place(d.data(), d.size(), space.stream());
  comm.all_reduce_min(d.data(), d.size(), space.stream());
  std::vector<std::uint16_t> packed(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) packed[i] = fp::kernels::to_bf16(values[i]);
  fp::DeviceBuffer<std::uint16_t> p = upload(space, packed);
  comm.all_reduce_sum_bf16(p.data(), p.size(), space.stream());
  comm.wait(space.stream(), "the test's collectives");
  CHECK(download(space, d) == values);
  CHECK(download(space, p) == packed);
  // The device's packing is the host's (round to nearest even).
  fp::DeviceBuffer<std::uint16_t> q(values.size());
  fp::kernels::cuda::pack_bf16(space.stream(), d.data(), q.data(), d.size());
  CHECK(download(space, q) == packed);
  fp::kernels::cuda::unpack_bf16(space.stream(), q.data(), d.data(), d.size());
  const std::vector<float> back = download(space, d);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < values.size(); ++i) differ += back[i] != fp::kernels::round_bf16(values[i]) ? 1 : 0;
  CHECK(differ == 0);
}

TEST_CASE("NcclCommunicator: a rank whose peer never arrives gives up after its timeout") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    fp::parallel::NcclCommunicator comm(fp::parallel::NcclCommunicator::unique_id(), 0, 2, 0, std::chrono::seconds(3));
  } catch (const fp::DeviceError& e) {
    message = e.what();
    CHECK(e.rank() == 0);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("gave up after " << seconds << " s: " << message);
  CHECK(message.find("rank 0") != std::string::npos);
  CHECK(message.find("aborted") != std::string::npos);
  CHECK(seconds < 60);
}

TEST_CASE("Parallel on Cuda, world size 1, reproduces Model<Net, Cuda> with the same batch") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  world_one_reproduces_model<fp::CudaFp32>("fp32, AllReduce, one bucket");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::AllReduce<Small>>("fp32, small buckets after backward");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::AllReduce<Small, fp::Overlap>>("fp32, small buckets, Overlap");
  world_one_reproduces_model<fp::CudaFp32, fp::Overlap>("fp32, one bucket, Overlap");
  world_one_reproduces_model<fp::CudaFp32, Small, fp::Overlap, fp::Deterministic>("fp32, Deterministic");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::ReduceBroadcast<Small, fp::Overlap>>("fp32, ReduceBroadcast");
  world_one_reproduces_model<fp::CudaFp32, fp::scatter::Sharded, fp::Sum, Small>("fp32, Sharded, Sum");
  world_one_reproduces_model<fp::Cuda, fp::reduce::AllReduce<Small, fp::Overlap>>("tf32, small buckets, Overlap");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::ReduceScatter<>>("fp32, ReduceScatter (ZeRO-1)");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::ReduceScatter<Small, fp::Overlap>>(
      "fp32, ReduceScatter, small buckets, Overlap");
  world_one_reproduces_model<fp::CudaFp32, fp::reduce::ReduceScatter<Small, fp::Deterministic>>(
      "fp32, ReduceScatter, Deterministic");
  world_one_reproduces_model<fp::CudaFp32, fp::scatter::Sharded, fp::Sum, fp::reduce::ReduceScatter<>>(
      "fp32, Sharded, Sum, ReduceScatter");
  world_one_reproduces_model<fp::Cuda, fp::reduce::ReduceScatter<>>("tf32, ReduceScatter");
}

// `steps` steps of two Parallels on the same batches (batch_of), each with its own optimizer: the same
// loss at every step.
template <class DP, class Opt>
void same_losses(DP& p, Opt& pa, DP& q, Opt& qa, int steps) {
  for (int s = 0; s < steps; ++s) {
    const Batch x = batch_of(batch, std::uint64_t(s));
    const float lp = p.train_step(std::span<const float>(x.x), std::span<const std::int32_t>(x.y),
                                  fp::SoftmaxCrossEntropy{}, pa);
    const float lq = q.train_step(std::span<const float>(x.x), std::span<const std::int32_t>(x.y),
                                  fp::SoftmaxCrossEntropy{}, qa);
    CHECK_MESSAGE(lp == lq, "step " << s);
  }
}

TEST_CASE("Parallel on Cuda: the fused update (each bucket behind its all-reduce) is bit for bit the one pass") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const int devices = std::min(fp::cuda_device_count(), 2);
  const fp::AdamW adamw{{.lr = 0.01f, .weight_decay = 0.05f, .decay = fp::Decay::weights}};
  using DP = fp::Parallel<LeNet, fp::CudaFp32, Small, fp::Overlap>;
  DP fused{fp::replicas(devices), fp::seed(9)}, separate{fp::replicas(devices), fp::seed(9)};
  CHECK(fused.uses_fused_update());
  separate.use_fused_update(false);
  fp::AdamW a = adamw, b = adamw;
  same_losses(fused, a, separate, b, 6);
  for (int r = 0; r < devices; ++r) {
    INFO("replica " << r);
    auto& f = fused.model(std::size_t(r));
    auto& g = separate.model(std::size_t(r));
    CHECK(f.steps() == g.steps());
    CHECK(f.optimizer_steps() == g.optimizer_steps());
    CHECK(params_on_host(f) == params_on_host(g));
    std::vector<float> ga(LeNet::param_storage), gb(LeNet::param_storage);
    f.copy_grads_to_host(ga);
    g.copy_grads_to_host(gb);
    CHECK(ga == gb);
    std::vector<float> sa(f.optimizer_state().size()), sb(g.optimizer_state().size());
    REQUIRE(sa.size() == 2 * LeNet::param_storage);
    f.copy_optimizer_state_to_host(sa);
    g.copy_optimizer_state_to_host(sb);
    CHECK(sa == sb);
  }
}

TEST_CASE("Parallel on Cuda: ParallelOptions::backward_branches reaches every replica, the same bits either way") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const int devices = std::min(fp::cuda_device_count(), 2);
  using DP = fp::Parallel<LeNet, fp::CudaFp32, Small, fp::Overlap>;
  fp::ParallelOptions serial_options;
  serial_options.backward_branches = false;
  DP branched{fp::replicas(devices), fp::seed(9)}, serial{fp::replicas(devices), fp::seed(9), serial_options};
  for (int r = 0; r < devices; ++r) {
    CHECK(branched.model(std::size_t(r)).uses_backward_branches());
    CHECK_FALSE(serial.model(std::size_t(r)).uses_backward_branches());
  }
  fp::Sgd a{{.lr = 0.05f, .momentum = 0.9f}}, b = a;
  same_losses(branched, a, serial, b, 4);
  for (int r = 0; r < devices; ++r) CHECK(params_on_host(branched.model(std::size_t(r))) == params_on_host(serial.model(std::size_t(r))));
}

TEST_CASE("Parallel on Cuda: ReduceScatter keeps optimizer state for its block only, equal to the model's") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Adam adam{{.lr = 0.01f}};
  fp::Model<LeNet, fp::CudaFp32> single{fp::seed(5), fp::CudaFp32{0}};
  fp::Parallel<LeNet, fp::CudaFp32, fp::reduce::ReduceScatter<>> zero{fp::replicas(1), fp::seed(5)};
  fp::Parallel<LeNet, fp::CudaFp32> plain{fp::replicas(1), fp::seed(5)};
  for (int s = 0; s < 5; ++s) {
    const Batch b = batch_of(batch, std::uint64_t(s));
    fp::Adam o1 = adam, o2 = adam, o3 = adam;
    const float l1 = single.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o1);
    const float l2 = zero.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o2);
    const float l3 = plain.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o3);
    CHECK(l1 == l2);
    CHECK(l2 == l3);
  }
  CHECK(params_on_host(zero.model()) == params_on_host(single));
  CHECK(params_on_host(plain.model()) == params_on_host(single));
  // One rank owns the whole buffer: its block's state is the model's whole state, bit for bit.
  const fp::parallel::Shard block = zero.zero_block(0);
  CHECK(block.offset == 0);
  CHECK(block.count == LeNet::param_storage);
  CHECK(zero.model().optimizer_state().empty());  // the state lives in the Parallel, sharded
  REQUIRE(zero.zero_optimizer_state().size() == 2 * LeNet::param_storage);
  std::vector<float> want(single.optimizer_state().size()), got(want.size());
  single.copy_optimizer_state_to_host(want);
  FUSEDP_CUDA_CHECK(cudaMemcpy(got.data(), zero.zero_optimizer_state().data(), got.size() * sizeof(float),
                               cudaMemcpyDeviceToHost));
  CHECK(got == want);
  CHECK(zero.model().optimizer_steps() == 5);
  CHECK(zero.model().steps() == 5);
}

// A model whose gradients are replaced by their bfloat16 rounding (round to nearest even, on the host)
// before every update: what Compress<bf16> computes with one rank.
Run train_with_bf16_gradients(fp::Model<LeNet, fp::CudaFp32>& m) {
  fp::Sgd opt = sgd_options;
  Run r;
  std::vector<float> g(LeNet::param_storage);
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(batch, std::uint64_t(s));
    r.losses.push_back(m.compute_gradients(std::span<const float>(b.x), std::span<const std::int32_t>(b.y),
                                           fp::SoftmaxCrossEntropy{}));
    m.copy_grads_to_host(g);
    for (float& v : g) v = fp::kernels::round_bf16(v);
    fp::copy_async(m.grads().data(), g.data(), g.size(), m.space().stream());
    m.space().synchronize();
    m.step(opt);
  }
  r.params = params_on_host(m);
  return r;
}

template <class... Policies>
void compress_reproduces_rounded_model(const char* what) {
  INFO(what);
  fp::Model<LeNet, fp::CudaFp32> single{fp::seed(13), fp::CudaFp32{0}};
  const Run want = train_with_bf16_gradients(single);
  fp::Parallel<LeNet, fp::CudaFp32, Policies...> dp{fp::replicas(1), fp::seed(13)};
  const Run got = train(dp, batch);
  for (int s = 0; s < steps; ++s) CHECK_MESSAGE(got.losses[std::size_t(s)] == want.losses[std::size_t(s)], "step " << s);
  CHECK(got.params == want.params);
}

TEST_CASE("Parallel on Cuda, world size 1: accumulate K sums the micro-batches' gradients in order, as on Host") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  constexpr std::size_t micro = 4;
  fp::Model<LeNet, fp::CudaFp32> single{fp::seed(11), fp::CudaFp32{0}};
  fp::Parallel<LeNet, fp::CudaFp32, fp::reduce::AllReduce<Small, fp::Overlap>> dp{
      fp::replicas(1), fp::seed(11), {.accumulate = int(micro)}};
  CHECK(dp.accumulate() == micro);
  std::vector<float> acc(LeNet::param_storage), g(LeNet::param_storage);
  for (int s = 0; s < 5; ++s) {
    const Batch b = batch_of(batch, std::uint64_t(s));
    fp::Sgd o1 = sgd_options, o2 = sgd_options;
    (void)dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o2);
    const auto pieces = fp::parallel::even_shards(batch, micro);
    for (std::size_t k = 0; k < micro; ++k) {
      const std::size_t in = LeNet::input_shape::size;
      (void)single.compute_gradients(std::span<const float>(b.x).subspan(pieces[k].offset * in, pieces[k].count * in),
                                     std::span<const std::int32_t>(b.y).subspan(pieces[k].offset, pieces[k].count),
                                     fp::SoftmaxCrossEntropy{}, fp::NoStageHook{}, batch);
      single.copy_grads_to_host(g);
      for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = k == 0 ? g[i] : acc[i] + g[i];
    }
    fp::copy_async(single.grads().data(), acc.data(), acc.size(), single.space().stream());
    single.space().synchronize();
    single.step(o1);
  }
  CHECK(params_on_host(dp.model()) == params_on_host(single));
}

TEST_CASE("Parallel on Cuda, world size 1: a ZeRO-1 checkpoint resumes bit for bit, and in a Host model") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  using Zero = fp::Parallel<LeNet, fp::CudaFp32, fp::reduce::ReduceScatter<Small, fp::Overlap>>;
  const fp::Adam adam{{.lr = 0.01f}};
  fusedp_test::TempDir dir;
  const std::string ck = dir.file("zero");
  Zero run{fp::replicas(1), fp::seed(17)};
  const auto steps_of = [&](auto& t, int from, int to) {
    for (int s = from; s < to; ++s) {
      const Batch b = batch_of(batch, std::uint64_t(s));
      fp::Adam o = adam;
      (void)t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o);
    }
  };
  steps_of(run, 0, 3);
  const std::vector<float> gathered = run.gather_optimizer_state();
  REQUIRE(gathered.size() == 2 * LeNet::param_storage);
  fp::train::save_checkpoint(ck, run, fp::train::TrainingState{});
  steps_of(run, 3, 6);
  Zero resumed{fp::replicas(1), fp::seed(17)};
  (void)fp::train::load_checkpoint(ck, resumed, adam);
  CHECK(resumed.gather_optimizer_state() == gathered);
  steps_of(resumed, 3, 6);
  CHECK(params_on_host(resumed.model()) == params_on_host(run.model()));
  fp::Model<LeNet, fp::Host> host{fp::seed(17), fp::Host{1}};
  (void)fp::train::load_checkpoint(ck, host, adam);
  CHECK(std::vector<float>(host.optimizer_state().begin(), host.optimizer_state().end()) == gathered);
}

TEST_CASE("Parallel on Cuda, world size 1: Compress<bf16> equals the update with bfloat16-rounded gradients") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  compress_reproduces_rounded_model<fp::Compress<fp::bf16>>("Compress, one bucket");
  compress_reproduces_rounded_model<fp::Compress<fp::bf16>, Small, fp::Overlap>("Compress, small buckets, Overlap");
  compress_reproduces_rounded_model<fp::Compress<fp::bf16>, Small, fp::Deterministic>("Compress, Deterministic");
  compress_reproduces_rounded_model<fp::Compress<fp::bf16>, fp::reduce::ReduceBroadcast<Small>>("Compress, ReduceBroadcast");
  compress_reproduces_rounded_model<fp::Compress<fp::bf16>, fp::reduce::ReduceScatter<Small>>("Compress, ReduceScatter");
  // And the rounding is visible: the result differs from fp32 gradients.
  fp::Model<LeNet, fp::CudaFp32> plain{fp::seed(13), fp::CudaFp32{0}};
  fp::Model<LeNet, fp::CudaFp32> rounded{fp::seed(13), fp::CudaFp32{0}};
  CHECK(train(plain, batch).params != train_with_bf16_gradients(rounded).params);
}

namespace {
// After `steps` steps of shards of `batch` samples, Parallel::memory_use() equals ReplicaMemory's
// prediction for replica 0 of a world of 1, part by part.
template <class... Policies>
void holds_what_replica_memory_predicts(const fp::ParallelOptions& options, const char* what) {
  INFO(what);
  fp::Parallel<LeNet, fp::CudaFp32, Policies...> dp{fp::replicas(1), fp::seed(13), options};
  (void)train(dp, batch);
  check_same(dp.memory_use(0), fp::ReplicaMemory<LeNet, fp::precision::Fp32, Policies...>::use(
                                   batch, dp.model().space().sm_count(), 1, {.state_slots = fp::Sgd::state_slots}, options));
}

// Each of dp's local replicas holds what ReplicaMemory predicts for its rank, after training on shards of
// `shard` samples (Sgd).
template <class... Policies>
void replicas_hold_predicted(const fp::Parallel<LeNet, fp::CudaFp32, Policies...>& dp, std::size_t shard) {
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) {
    CAPTURE(r);
    check_same(dp.memory_use(r), fp::ReplicaMemory<LeNet, fp::precision::Fp32, Policies...>::use(
                                     shard, dp.model(r).space().sm_count(), dp.world_size(),
                                     {.state_slots = fp::Sgd::state_slots}, {}, r));
  }
}
}  // namespace

TEST_CASE("Parallel on Cuda holds what ReplicaMemory predicts, for each reduction") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  holds_what_replica_memory_predicts<Small, fp::Overlap>({}, "AllReduce, buckets, Overlap");
  holds_what_replica_memory_predicts<Small, fp::Overlap>({.accumulate = 3}, "accumulate 3");
  holds_what_replica_memory_predicts<Small, fp::Deterministic>({}, "Deterministic");
  holds_what_replica_memory_predicts<fp::Compress<fp::bf16>>({.bucket_bytes = 8192}, "Compress<bf16>, 8 KiB buckets");
  holds_what_replica_memory_predicts<fp::reduce::ReduceScatter<>>({}, "ReduceScatter (ZeRO-1)");
  holds_what_replica_memory_predicts<fp::reduce::ReduceBroadcast<>>({.backward_branches = false}, "ReduceBroadcast");
}

TEST_CASE("Parallel on Cuda: more replicas than devices is an error that says so") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const int devices = fp::cuda_device_count();
  using DP = fp::Parallel<LeNet, fp::Cuda>;
  std::string message;
  try {
    DP dp{fp::replicas(devices + 1)};
  } catch (const fp::InvalidArgument& e) {
    message = e.what();
  }
  MESSAGE(message);
  CHECK(message.find(std::to_string(devices + 1) + " replicas") != std::string::npos);
  CHECK(message.find(std::to_string(devices) + " CUDA device(s) are visible") != std::string::npos);
  CHECK_THROWS_AS(DP(fp::Devices{devices}), fp::InvalidArgument);  // no such device
  CHECK_THROWS_AS(DP(fp::replicas(0)), fp::InvalidArgument);
}

TEST_CASE("Parallel on Cuda: evaluation counts every sample once") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Parallel<LeNet, fp::Cuda, Small, fp::Overlap> dp{fp::replicas(1), fp::seed(3)};
  const Batch b = batch_of(20, 9);
  const auto e = dp.evaluate(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{});
  CHECK(e.count == 20);
  CHECK(e.correct <= 20);
  CHECK(std::isfinite(e.loss()));
}

TEST_CASE("Parallel on Cuda: 2 replicas with B/2 samples each reproduce 1 replica with B") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  if (fp::cuda_device_count() < 2) {
    MESSAGE("skipped: needs 2 CUDA devices, " << fp::cuda_device_count() << " visible");
    return;
  }
  fp::Model<LeNet, fp::CudaFp32> single{fp::seed(11), fp::CudaFp32{0}};
  const Run want = train(single, batch);
  auto compare = [&](const Run& got, const char* what) {
    INFO(what);
    // fp32 with another summation order (two half-batch GEMMs, a scale and a sum): a few ulps per step.
    CHECK(relative_error(got.losses, want.losses) < 1e-4);
    CHECK(relative_error(got.params, want.params) < 1e-4);
  };
  {
    fp::Parallel<LeNet, fp::CudaFp32, Small, fp::Overlap> dp{fp::Devices{0, 1}, fp::seed(11)};
    compare(train(dp, batch), "AllReduce, small buckets, Overlap");
    CHECK(params_on_host(dp.model(0)) == params_on_host(dp.model(1)));
  }
  {
    fp::Parallel<LeNet, fp::CudaFp32, fp::reduce::ReduceBroadcast<>> dp{fp::replicas(2), fp::seed(11)};
    compare(train(dp, batch), "ReduceBroadcast");
    CHECK(params_on_host(dp.model(0)) == params_on_host(dp.model(1)));
    replicas_hold_predicted(dp, batch / 2);  // the root's optimizer state only
    CHECK(dp.memory_use(1).optimizer_state == 0);
  }
  {
    fp::Parallel<LeNet, fp::CudaFp32, fp::reduce::ReduceScatter<>> dp{fp::replicas(2), fp::seed(11)};
    compare(train(dp, batch), "ReduceScatter (ZeRO-1)");
    CHECK(params_on_host(dp.model(0)) == params_on_host(dp.model(1)));
    const fp::parallel::Shard a = dp.zero_block(0), b = dp.zero_block(1);
    CHECK(a.offset == 0);
    CHECK(b.offset == a.count);
    CHECK(a.count + b.count == LeNet::param_storage);
    CHECK(dp.zero_optimizer_state(0).size() == a.count);  // Sgd: one slot, for its block only
    CHECK(dp.zero_optimizer_state(1).size() == b.count);
    replicas_hold_predicted(dp, batch / 2);  // each its block's state
  }
  {
    fp::Parallel<LeNet, fp::CudaFp32, fp::Compress<fp::bf16>, Small, fp::Overlap> dp{fp::replicas(2), fp::seed(11)};
    const Run got = train(dp, batch);
    INFO("Compress<bf16>");
    CHECK(relative_error(got.losses, want.losses) < 1e-2);  // the Host test's bound (tests/parallel/replicas.cpp)
    CHECK(relative_error(got.params, want.params) < 1e-2);
    CHECK(params_on_host(dp.model(0)) == params_on_host(dp.model(1)));
  }
  {
    using DP = fp::Parallel<LeNet, fp::CudaFp32, Small, fp::Overlap, fp::Deterministic>;
    DP a{fp::replicas(2), fp::seed(11)}, b{fp::replicas(2), fp::seed(11)};
    const Run ra = train(a, batch), rb = train(b, batch);
    compare(ra, "Deterministic");
    CHECK(ra.params == rb.params);  // bit for bit, run to run
    CHECK(ra.losses == rb.losses);
    replicas_hold_predicted(a, batch / 2);  // both replicas' copies of the largest bucket
  }
}
