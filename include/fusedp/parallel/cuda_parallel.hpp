#pragma once
// Parallel<Net, CudaSpace<P>, Policies...>: replicas on GPUs, gradients through NCCL. Two process
// models, as on Host: one process driving one replica per listed device (a thread each), or one replica
// per MPI rank (mpirun; the NCCL unique id travels over MPI, each rank takes the device of its rank
// among the ranks of its machine). Each replica's BucketReducer (parallel/reducer.hpp, the one the Host
// uses) queues the reductions on the replica's NcclChannel: with Overlap a bucket's collective is queued
// as soon as the Cuda model's stage hook says backward has queued its last gradient (an event orders it
// after those kernels); the update waits for the last one (another event), or, with AllReduce and an
// optimizer that is not Guarded, is queued bucket by bucket on the communication stream behind each
// bucket's all-reduce (the fused update: parallel/detail/bucket_update.hpp). Shards' gradients are their
// share of the global mean (Model::compute_gradients' normalizer), so every reduction is a plain sum.
// Available on Cuda: every policy of Host. AllReduce; ReduceBroadcast; ReduceScatter (ZeRO-1: see
// ZeroLayout); Deterministic (an all-gather and a sum in rank order, the Host's order and bits);
// Compress<bf16> (each bucket packed to bfloat16 rounded to nearest even, summed by NCCL in
// ncclBfloat16, unpacked); Average/Sum; every scatter policy; Guarded optimizers (the gradient's sum of
// squares and first non-finite element measured on the device over this rank's part, combined over the
// ranks with NCCL, one 16-byte read per step, so every rank takes the same decision). Steps do not
// replay CUDA graphs (the NCCL calls sit between the model's kernels); each step waits for its update
// before returning.
#include "fusedp/parallel/parallel.hpp"

#if FUSEDP_HAS_NCCL
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/cuda/gradient.cuh"
#include "fusedp/kernels/cuda/optimizer.cuh"
#include "fusedp/kernels/cuda/pointwise.cuh"
#include "fusedp/net/model.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/detail/accumulate.hpp"
#include "fusedp/parallel/detail/bucket_update.hpp"
#include "fusedp/parallel/detail/startup.hpp"
#include "fusedp/parallel/detail/step.hpp"
#include "fusedp/parallel/nccl.hpp"
#include "fusedp/parallel/nccl_channel.hpp"
#include "fusedp/parallel/policy.hpp"
#include "fusedp/parallel/process_group.hpp"
#include "fusedp/parallel/reducer.hpp"
#include "fusedp/parallel/replica_memory.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedp {

/// Data-parallel training of Net on GPUs (see the comment above and parallel/policy.hpp).
/// @tparam Net a Sequential<...>
/// @tparam P the precision policy of every replica's CudaSpace
/// @tparam Policies scatter, reduce, comm and knob tags, in any order
template <Network Net, class P, class... Policies>
class Parallel<Net, CudaSpace<P>, Policies...> {
 public:
  using space_type = CudaSpace<P>;
  using policy = parallel::Policy<space_type, Policies...>;
  using value_type = float;
  using model_type = Model<Net, space_type, float>;
  /// The bucket capacity in bytes: ParallelOptions::bucket_bytes, or the Bucket<bytes> policy's.
  static constexpr std::size_t bucket_bytes(const ParallelOptions& o) noexcept {
    return parallel::bucket_capacity<policy>(o);
  }
  static constexpr bool sharded = std::is_same_v<typename policy::scatter_policy, scatter::Sharded>;
  static constexpr bool weighted = std::is_same_v<typename policy::scatter_policy, scatter::Weighted>;
  static constexpr parallel::detail::ReduceKind reduce_kind = policy::reduce_kind;
  static_assert(parallel::fits_network<Net, policy>());

  /// `r.count` replicas in this process on devices 0 .. r.count - 1 (r.threads_per_replica is unused).
  /// More replicas than visible devices is an error.
  explicit Parallel(Replicas r, Seed seed = {}, ParallelOptions options = {})
      : Parallel(Devices(first_devices(r.count)), seed, options) {}

  /// One replica on each of `d`'s devices, in this process, started from the same parameters (drawn
  /// from `seed`, then broadcast from the first device over NCCL).
  explicit Parallel(const Devices& d, Seed seed = {}, ParallelOptions options = {})
      : options_(checked_cuda_options(options)), pool_(Host::dedicated(check_devices(d.ids))) {
    world_ = d.ids.size();
    std::vector<parallel::NcclCommunicator> comms = parallel::NcclCommunicator::init_all(d.ids, options.timeout);
    replicas_.reserve(world_);
    for (std::size_t i = 0; i < world_; ++i) replicas_.emplace_back(seed, d.ids[i], std::move(comms[i]));
    init();
  }

#if FUSEDP_WITH_MPI
  /// One replica on each rank of `world` (mpirun), on device options.device or, by default, the device
  /// numbered by the rank's place among the ranks of its machine. Every rank checks that all ranks run
  /// the same network, policies, world size and options.agree_on, and that each has its device; then
  /// NCCL is bootstrapped over MPI and rank 0's parameters are broadcast.
  explicit Parallel(const MpiWorld& world, Seed seed = {}, ParallelOptions options = {})
      : options_(checked_cuda_options(options)), pool_(1), processes_(world, options.timeout) {
    world_ = std::size_t(world.size());
    parallel::MpiCommunicator& comm = *processes_.mpi();
    world.collective_watch().set_hosts(parallel::detail::check_same_run(
        {Net::fingerprint, Net::param_count, policy::hash ^ precision_hash,  // and the precision
         world_, options.agree_on, std::uint64_t(options.accumulate), std::uint64_t(options.bucket_bytes),
         std::uint64_t(options.backward_branches), fusedp::detail::processor_name()},
        world_, [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t n) {
          comm.all_gather_or_abort(mine, all, n, options_.timeout, "Parallel start-up check");
        }));
    const int device = agree_on_devices(world, comm);
    replicas_.emplace_back(seed, device, parallel::NcclCommunicator::from_mpi(world, device, options.timeout));
    init();
  }
#endif

  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;
  /// Waits for queued collectives (unless their communicator was aborted) before memory is freed.
  ~Parallel() {
    for (auto& rep : replicas_)
      if (rep.channel.comm().valid()) (void)cudaStreamSynchronize(rep.channel.stream());
  }

  /// Replicas taking part in all (ranks times local replicas).
  [[nodiscard]] std::size_t world_size() const noexcept { return world_; }
  /// This process's rank (0 without MPI).
  [[nodiscard]] int rank() const noexcept { return processes_.rank(); }
  [[nodiscard]] bool is_root() const noexcept { return rank() == 0; }
  /// Replicas in this process.
  [[nodiscard]] std::size_t local_replicas() const noexcept { return replicas_.size(); }
  /// Micro-batches per step (ParallelOptions::accumulate).
  [[nodiscard]] std::size_t accumulate() const noexcept { return std::size_t(options_.accumulate); }
  /// The fused update (on by default): with AllReduce and an optimizer that is not Guarded, each
  /// bucket's update is queued on the communication stream right behind the bucket's all-reduce (with
  /// Overlap, while backward goes on) instead of one pass after the last reduction; the same bits
  /// either way (parallel/detail/bucket_update.hpp). The update applied is the optimizer's per-element
  /// update<float>(t) (kernels::cuda::apply_optimizer), not its step(). A step that fails in a
  /// reduction may leave the buckets reduced before it updated, with the step not counted.
  void use_fused_update(bool on) noexcept { fused_update_ = on; }
  [[nodiscard]] bool uses_fused_update() const noexcept { return fused_update_; }
  /// What local replica `i` holds on its device, in bytes by part: its model's memory_use(), the ZeRO
  /// block's optimizer state, and the reduction's memory (the micro-batches' gradient sum, the channel's
  /// scratch). ReplicaMemory<Net, P, Policies...> (parallel/replica_memory.hpp) predicts it.
  [[nodiscard]] MemoryUse memory_use(std::size_t i = 0) const {
    const Replica& rep = replicas_.at(i);
    MemoryUse m = rep.model.memory_use();
    m.optimizer_state += rep.zero_state.size_bytes();
    m.reduction = rep.acc.size_bytes() + rep.channel.device_bytes();
    return m;
  }

  /// Replica `i` of this process (its parameters and gradients are device memory; see cuda_model.hpp).
  [[nodiscard]] model_type& model(std::size_t i = 0) { return replicas_.at(i).model; }
  [[nodiscard]] const model_type& model(std::size_t i = 0) const { return replicas_.at(i).model; }
  /// ZeRO-1 (ReduceScatter): the block of the flat buffer that replica `global` (its rank) owns and
  /// updates.
  [[nodiscard]] parallel::Shard zero_block(std::size_t global) const noexcept { return zero_.block(global); }
  /// ZeRO-1: the optimizer state of local replica `i`'s block (state_slots x its block), on its device.
  [[nodiscard]] std::span<const float> zero_optimizer_state(std::size_t i = 0) const {
    return replicas_.at(i).zero_state.span();
  }

  /// The optimizer state of the whole flat buffer in host memory (state_slots x param_storage values,
  /// as one Model holds it; empty before the first step), for a checkpoint: see the Host Parallel.
  /// ReduceScatter under MPI gathers the blocks with NCCL (a collective: every rank calls it).
  [[nodiscard]] std::vector<float> gather_optimizer_state() {
    if constexpr (reduce_kind != parallel::detail::ReduceKind::reduce_scatter) {
      model_type& m = replicas_[0].model;
      m.space().activate();
      std::vector<float> out(m.optimizer_state().size());
      if (!out.empty()) m.copy_optimizer_state_to_host(out);
      return out;
    } else {
      if (replicas_[0].model.optimizer_name() == nullptr || zero_slots_ == 0) return {};
      const std::size_t n = Net::param_storage;
      std::vector<float> full(zero_slots_ * n, 0.0f);
      if (processes_.under_mpi() && world_ > 1) {
        Replica& rep = replicas_[0];
        rep.model.space().activate();
        const parallel::Shard block = zero_.block(std::size_t(rank()));
        const cudaStream_t cs = rep.channel.stream();
        DeviceBuffer<float> whole(n);
        for (std::size_t k = 0; k < zero_slots_; ++k) {
          FUSEDP_CUDA_CHECK(cudaMemcpyAsync(whole.data() + block.offset, rep.zero_state.data() + k * block.count,
                                            block.count * sizeof(float), cudaMemcpyDeviceToDevice, cs));
          rep.channel.all_gather_blocks(whole.data(), zero_);
          // The gather first, under the communicator's timeout: a copy into pageable memory blocks the
          // host until the stream reaches it, so queued behind a gather that waits for a dead peer it
          // would hang without one.
          rep.channel.comm().wait(cs, "Parallel::gather_optimizer_state (the ZeRO-1 blocks)");
          FUSEDP_CUDA_CHECK(cudaMemcpyAsync(full.data() + k * n, whole.data(), n * sizeof(float),
                                            cudaMemcpyDeviceToHost, cs));
          FUSEDP_CUDA_CHECK(cudaStreamSynchronize(cs));
        }
      } else {
        for (std::size_t r = 0; r < replicas_.size(); ++r) {
          replicas_[r].model.space().activate();
          const parallel::Shard block = zero_.block(r);
          for (std::size_t k = 0; k < zero_slots_; ++k)
            FUSEDP_CUDA_CHECK(cudaMemcpy(full.data() + k * n + block.offset,
                                         replicas_[r].zero_state.data() + k * block.count, block.count * sizeof(float),
                                         cudaMemcpyDeviceToHost));
        }
      }
      return full;
    }
  }

  /// Sets the optimizer state of Opt on every local replica from `full` (host memory, as
  /// gather_optimizer_state gives; empty: zero state), as the reduce policy holds it (ReduceScatter:
  /// each replica's block of the current world size). Communicates nothing.
  template <class Opt>
  void load_optimizer_state(std::span<const float> full) {
    const std::size_t n = Net::param_storage;
    require(full.empty() || full.size() == Opt::state_slots * n, "Parallel::load_optimizer_state: ", full.size(),
            " values for ", Opt::name, ", which holds ", Opt::state_slots * n);
    for (std::size_t r = 0; r < replicas_.size(); ++r) {
      Replica& rep = replicas_[r];
      rep.model.space().activate();
      if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_scatter) {
        const parallel::Shard block = zero_.block(global_index(r));
        if (rep.model.template adopt_optimizer<Opt>() || rep.zero_state.size() != Opt::state_slots * block.count)
          rep.zero_state = DeviceBuffer<float>(Opt::state_slots * block.count);
        zero_slots_ = Opt::state_slots;
        std::vector<float> mine(Opt::state_slots * block.count, 0.0f);
        if (!full.empty())
          for (std::size_t k = 0; k < Opt::state_slots; ++k)
            std::copy_n(full.data() + k * n + block.offset, block.count, mine.data() + k * block.count);
        // On the model's stream, waited for: a plain cudaMemcpy from pageable memory runs on the legacy
        // default stream, which the model's non-blocking stream (the next step's update) does not wait for.
        if (!mine.empty())
          fusedp::detail::copy_to_space(rep.model.space(), rep.zero_state.data(), mine.data(), mine.size());
      } else {
        if (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast && global_index(r) != 0) continue;
        if (full.empty()) rep.model.template load_optimizer_state<Opt>(std::vector<float>(Opt::state_slots * n, 0.0f));
        else rep.model.template load_optimizer_state<Opt>(full);
      }
    }
  }

  /// Whether `mine` holds on every rank (a collective under MPI).
  [[nodiscard]] bool all_ranks(bool mine) const { return processes_.min(mine ? 1 : 0) == 1; }

  /// The NCCL communicator of local replica `i`.
  [[nodiscard]] parallel::NcclCommunicator& communicator(std::size_t i = 0) { return replicas_.at(i).channel.comm(); }

  /// Run-time weights of scatter::Weighted, one per replica (world_size()).
  void set_weights(std::span<const double> weights) { weights_ = parallel::detail::checked_weights<weighted>(weights, world_); }

  /// One data-parallel step (host inputs, as on Host: the global batch with Even or Weighted, this
  /// process's own data with Sharded; ParallelOptions::accumulate micro-batches per replica). Returns the mean loss over the global batch once the update
  /// has run on every local replica. A collective that does not finish within options.timeout aborts
  /// the communicator and throws DeviceError naming the rank.
  template <class Loss, class Opt>
  float train_step(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                   const Loss& loss, Opt& opt) {
    opt.validate();
    const std::size_t in = model_type::input_size;
    const std::size_t batch = parallel::detail::checked_batch<model_type, Loss>(inputs, targets);
    const std::vector<parallel::Shard> shards = parallel::detail::process_shards(
        sharded, weighted, batch, replicas_.size(), world_, weights_, processes_.under_mpi() ? rank() : -1);
    // Even and Weighted: every replica's shard is known here (Sharded: once the counts are summed, below),
    // so that all refuse before any starts.
    if constexpr (!sharded)
      parallel::detail::require_micro_batches(
          parallel::detail::smallest_shard(weighted, batch, world_, weights_),
          std::size_t(options_.accumulate), synchronized(), Net::min_training_batch);
    std::uint64_t local = 0;
    for (const auto& sh : shards) local += sh.count;
    std::uint64_t global = batch;
    std::size_t process_first = 0;  // Sharded: where this process's data begins in the global batch
    if constexpr (sharded) {
      // Every process's count, in rank order: the global batch and this process's place in it.
      std::vector<std::uint64_t>& counts = process_counts_;
      counts.assign(std::size_t(processes_.size()), 0);  // allocates on the first step only
      counts[std::size_t(processes_.rank())] = local;
      processes_.all_reduce_sum(counts.data(), counts.size());
      global = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) {
        global += counts[i];
        if (i < std::size_t(processes_.rank())) process_first += std::size_t(counts[i]);
      }
      // Each process's replicas split its count evenly: every process refuses together, before any changes.
      parallel::detail::require_micro_batches(
          std::size_t(*std::min_element(counts.begin(), counts.end())) / replicas_.size(),
          std::size_t(options_.accumulate), synchronized(), Net::min_training_batch);
    }

    std::vector<float> losses(replicas_.size());
    auto run = [&](std::size_t r) {
      Replica& rep = replicas_[r];
      const parallel::Shard& s = shards[r];
      rep.model.space().activate();
      // Each replica's spans on its own lane: its step, timed on its device's stream.
      const trace::Lane lane{std::uint32_t(r)};
      const auto span = trace::SpaceSpans<space_type>::open(rep.model.space(), "step", trace::Kind::step,
                                                            std::int64_t(rep.model.steps() + 1));
      // Average: this shard's gradient becomes its share of the mean over the global batch.
      const std::size_t normalizer = policy::sum ? s.count : std::size_t(global);
      float* grads = rep.model.grads().data();
      rep.reducer.begin();
      const ReplicaSum sync = synchronized() ? rep.channel.replica_sum() : ReplicaSum{};
      const std::size_t micro = std::size_t(options_.accumulate);
      if (micro > 1 && rep.acc.size() == 0) rep.acc = DeviceBuffer<float>(Net::param_storage);
      cudaStream_t stream = rep.model.space().stream();
      // The fused update: each bucket's update queued on the communication stream right behind its
      // all-reduce, while backward goes on (the same bits as one pass).
      const bool by_bucket = updates_buckets<Opt>() && fused_update_ && rep.reducer.covers(Net::param_storage) &&
                             parallel::detail::holds_state_of(rep.model, opt);
      parallel::detail::BucketStep<float> bucket_step{};
      if constexpr (updates_buckets<Opt>()) {
        if (by_bucket) bucket_step = parallel::detail::bucket_step(rep.model, opt);
      }
      auto on_final = [&](std::size_t begin, std::size_t end) {
        if constexpr (updates_buckets<Opt>()) {
          if (!by_bucket) return;
          const kernels::DecayRuns runs = rep.model.decay_runs(begin);
          opt.check_runs(runs);
          const trace::CudaScope span(rep.channel.stream(), "optimizer", trace::Kind::optimizer, std::int64_t(begin), 0,
                                      trace::comm_lane + trace::current_lane());
          kernels::cuda::apply_optimizer<int(Opt::state_slots)>(
              rep.channel.stream(), bucket_step.params + begin, bucket_step.grads + begin, bucket_step.state + begin,
              end - begin, opt.template update<float>(bucket_step.t), nullptr, runs, bucket_step.stride);
        }
      };
      losses[r] = parallel::detail::accumulate_gradients(
          rep.model, rep.reducer.plan(), rep.acc.data(), micro, inputs.subspan(s.offset * in, s.count * in),
          parallel::detail::targets_of(targets, batch, s), loss, normalizer, sync, process_first + s.offset,
          [&](const float* src, float* dst, std::size_t n) { kernels::cuda::copy_values(stream, n, src, dst, true); },
          [&](const float* src, float* dst, std::size_t n) { kernels::cuda::copy_values(stream, n, src, dst, false); },
          [&](std::size_t stage) { rep.reducer.stage_done(rep.channel, grads, stage, on_final); });
      rep.reducer.finish(rep.channel, grads, zero_, on_final);
      finish(rep, global_index(r), opt, by_bucket);
    };
    if (replicas_.size() == 1) run(0);
    else pool_.run_on_all([&](int r) { run(std::size_t(r)); });

    double weighted_loss = 0;
    for (std::size_t r = 0; r < replicas_.size(); ++r) weighted_loss += double(losses[r]) * double(shards[r].count);
    processes_.all_reduce_sum(&weighted_loss, 1);
    return float(weighted_loss / double(global));
  }

  /// Evaluates this process's samples on local replica 0 and sums loss and correct predictions over
  /// all ranks (a collective; see the Host Parallel).
  template <class Loss>
  GlobalEvaluation evaluate(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                            const Loss& loss) {
    replicas_[0].model.space().activate();
    return sum_over_ranks(parallel::detail::evaluate_local(replicas_[0].model, inputs, targets, loss));
  }

  /// Adds up every rank's evaluation sums (a collective).
  [[nodiscard]] GlobalEvaluation sum_over_ranks(const GlobalEvaluation& local) const {
    return parallel::detail::sum_over(processes_, local);
  }

  /// The smallest of every rank's `local` (steps per epoch), so no rank waits for one out of data.
  [[nodiscard]] std::size_t agree_steps(std::size_t local) const { return processes_.min(local); }

 private:
  using Reducer = parallel::BucketReducer<policy>;
  // The precision's whole name, for the ranks' start-up check (its first letter alone would let two
  // precisions whose names share it pass as one).
  static constexpr std::uint64_t precision_hash = [] {
    fusedp::detail::Fnv1a f;
    f.text(P::name);
    return f.h;
  }();
  // Whether BatchNorm layers take their statistics over every replica's shard (SyncBatchNorm).
  [[nodiscard]] bool synchronized() const noexcept { return policy::sync_batch_norm && world_ > 1; }

  // Whether a step with Opt can apply the update bucket by bucket (parallel/detail/bucket_update.hpp).
  template <class Opt>
  static constexpr bool updates_buckets() {
    return parallel::detail::updates_buckets<policy, Opt> &&
           requires(const Opt& o, const kernels::DecayRuns& d) {
             o.template update<float>(std::uint64_t(1));
             o.check_runs(d);
             Opt::state_slots;
           };
  }

  struct Replica {
    model_type model;
    parallel::NcclChannel channel;
    Reducer reducer;
    DeviceBuffer<float> zero_state;  // ZeRO-1: state_slots x own block
    DeviceBuffer<float> acc;         // accumulate > 1: the sum of the micro-batches' gradients

    Replica(Seed seed, int device, parallel::NcclCommunicator c)
        : model(seed, space_type{device}), channel(std::move(c), model.space().stream()) {}
  };

  static std::vector<int> first_devices(int count) {
    require(count >= 1, "Parallel: replica count must be >= 1, got ", count);
    std::vector<int> list;
    for (int i = 0; i < count; ++i) list.push_back(i);
    return list;
  }
  static int check_devices(const std::vector<int>& ids) {
    require(!ids.empty(), "Parallel: no devices given");
    const int count = cuda_device_count();
    if (count == 0)
      throw DeviceError("Parallel on Cuda", int(cudaErrorNoDevice), "no CUDA device: " + cuda_unavailable_reason());
    require(ids.size() <= std::size_t(count), "Parallel: ", ids.size(), " replicas on the Cuda space need ", ids.size(),
            " devices (one replica per device), but ", count, " CUDA device(s) are visible; use at most ", count,
            " replicas, or the Host space");
    for (std::size_t i = 0; i < ids.size(); ++i) {
      require(ids[i] >= 0 && ids[i] < count, "Parallel: device ", ids[i], " does not exist (", count,
              " CUDA device(s) are visible)");
      for (std::size_t j = 0; j < i; ++j)
        require(ids[j] != ids[i], "Parallel: device ", ids[i], " is listed twice; NCCL needs one replica per device");
    }
    return int(ids.size());
  }

#if FUSEDP_WITH_MPI
  // This rank's device; every rank learns whether every rank has one, so all fail together.
  int agree_on_devices(const MpiWorld& world, parallel::MpiCommunicator& comm) {
    const int count = cuda_device_count();
    const int device = options_.device >= 0 ? options_.device : world.local_rank();
    const std::array<std::uint64_t, 2> mine{std::uint64_t(device), std::uint64_t(count)};
    std::vector<std::uint64_t> all(2 * world_);
    comm.all_gather_or_abort(mine.data(), all.data(), 2, options_.timeout, "Parallel device check");
    std::ostringstream bad;
    for (std::size_t r = 0; r < world_; ++r)
      if (all[2 * r] >= all[2 * r + 1])
        bad << "\n  rank " << r << " wants device " << all[2 * r] << " but sees " << all[2 * r + 1] << " CUDA device(s)";
    if (!bad.str().empty())
      throw InvalidArgument("Parallel on Cuda: one replica per device, and some ranks have none (start at most as "
                            "many ranks per machine as it has GPUs, or set ParallelOptions::device):" + bad.str());
    return device;
  }
#endif

  void init() {
    for (auto& rep : replicas_) {
      rep.reducer = Reducer(parallel::bucket_plan<Net>(bucket_bytes(options_), sizeof(float)));
      rep.model.use_backward_branches(options_.backward_branches);
    }
    zero_ = parallel::ZeroLayout(Net::param_storage, world_, align_elements_count);
    if (weighted) weights_.assign(world_, 1.0);
    broadcast_parameters();
  }

  // Rank 0's parameters (local replica 0, or MPI rank 0) on every replica, before the first step.
  void broadcast_parameters() {
    {
      parallel::NcclGroup group(rank());
      for (auto& rep : replicas_)
        rep.channel.comm().broadcast(rep.model.params().data(), Net::param_storage, 0, rep.channel.stream());
      group.end();
    }
    for (auto& rep : replicas_) {
      rep.channel.comm().wait_ready("ncclBroadcast of the parameters");
      rep.channel.comm().wait(rep.channel.stream(), "Parallel start-up: the broadcast of rank 0's parameters");
    }
  }

  std::size_t global_index(std::size_t local) const {
    return processes_.under_mpi() ? std::size_t(rank()) : local;
  }

  // A guarded optimizer's decision, the same on every rank: each replica measures its part of the
  // reduced gradient on the communication stream (its ZeRO block, so the parts cover the whole once;
  // with ReduceBroadcast the root measures the whole sum it holds), the parts are combined with NCCL
  // (a sum of the squares, the smallest first index), and the 16-byte result is read once.
  template <class Opt>
  double decide(Replica& rep, std::size_t global, const Opt& opt) {
    cudaStream_t cs = rep.channel.stream();
    parallel::NcclCommunicator& comm = rep.channel.comm();
    kernels::cuda::GradientStatsBuffer& stats = rep.model.stats_buffer();
    parallel::Shard part = zero_.block(global);
    if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast)
      part = global == 0 ? parallel::Shard{0, Net::param_storage} : parallel::Shard{0, 0};
    stats.enqueue(cs, rep.model.grads().data() + part.offset, part.count, part.offset);
    if (world_ > 1) {
      comm.all_reduce_sum(&stats.result()->sum_squares, 1, cs);
      comm.all_reduce_min(&stats.result()->first_nonfinite, 1, cs);
    }
    stats.copy_to_host(cs);
    comm.wait(cs, "Parallel::train_step (the guard's gradient statistics)");
    const kernels::cuda::DeviceGradientStats s = stats.host();
    return opt.decide(kernels::host::GradientStats{s.sum_squares, s.finite()}, rep.model.steps() + 1,
                      model_type::nonfinite_tensor_name(s.first_nonfinite));
  }

  // After the last bucket: the update waits for the reductions (and a guarded optimizer decides on
  // them), unless the buckets were updated as they were reduced (`by_bucket`); ReduceBroadcast steps on
  // the root and broadcasts its parameters; ReduceScatter updates this rank's block and all-gathers.
  // Then waits for it all, polling NCCL (see NcclCommunicator::wait).
  template <class Opt>
  void finish(Replica& rep, std::size_t global, Opt& opt, bool by_bucket) {
    double factor = 1.0;
    if constexpr (requires { typename Opt::on_nonfinite; }) factor = decide(rep, global, opt);
    rep.channel.finish_into_model_stream();
    if constexpr (reduce_kind == parallel::detail::ReduceKind::all_reduce) {
      if (by_bucket) rep.model.count_step(true);
      else (void)rep.model.apply_step(opt, factor);
    } else if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast) {
      // Only the root holds the summed gradient and the optimizer state.
      if (global == 0) (void)rep.model.apply_step(opt, factor);
      else rep.model.count_step(factor != 0.0);
      rep.channel.after_model_stream();
      rep.channel.comm().broadcast(rep.model.params().data(), Net::param_storage, 0, rep.channel.stream());
      rep.channel.finish_into_model_stream();
    } else {
      zero_update(rep, global, opt, factor);
    }
    if constexpr (policy::broadcast_buffers) {
      // Rank 0's running statistics on every replica (after this step's forward updated them).
      rep.channel.after_model_stream();
      rep.channel.comm().broadcast(rep.model.buffers().data(), Net::state_storage, 0, rep.channel.stream());
      rep.channel.finish_into_model_stream();
    }
    rep.channel.comm().wait(rep.model.space().stream(), "Parallel::train_step (gradient reduction and update)");
  }

  // ZeRO-1: this replica updates its block with the optimizer state of that block only, then the
  // blocks are all-gathered in place. A skipped step (factor 0) changes neither.
  template <class Opt>
  void zero_update(Replica& rep, std::size_t global, Opt& opt, double factor) {
    const parallel::Shard block = zero_.block(global);
    if (rep.model.template adopt_optimizer<Opt>()) rep.zero_state = DeviceBuffer<float>(Opt::state_slots * block.count);
    zero_slots_ = Opt::state_slots;
    if (factor == 0.0) {
      rep.model.count_step(false);
      return;
    }
    float* p = rep.model.params().data() + block.offset;
    float* g = rep.model.grads().data() + block.offset;
    if (factor != 1.0) kernels::cuda::scale_gradient(rep.model.space().stream(), g, block.count, float(factor));
    opt.step(rep.model.space(), p, g, rep.zero_state.data(), block.count, rep.model.optimizer_steps() + 1,
             rep.model.decay_runs(block.offset));
    rep.model.count_step(true);
    rep.channel.after_model_stream();
    rep.channel.all_gather_blocks(rep.model.params().data(), zero_);
    rep.channel.finish_into_model_stream();
  }

  static ParallelOptions checked_cuda_options(const ParallelOptions& o) {
    require(o.host_precision == HostPrecision::fp32, "Parallel on Cuda: ParallelOptions::host_precision (",
            to_string(o.host_precision),
            ") is for Host replicas; a Cuda replica's precision is its space's type (CudaSpace<precision::Bf16>)");
    return parallel::detail::checked_options(o);
  }

  ParallelOptions options_;
  Host pool_;  // one thread of its own per local replica (dedicated: replicas wait for each other)
  parallel::ProcessGroup processes_;
  std::vector<std::uint64_t> process_counts_;  // Sharded: every process's count in the step
  std::vector<Replica> replicas_;
  std::size_t world_ = 1;
  parallel::ZeroLayout zero_;
  std::vector<double> weights_;
  std::size_t zero_slots_ = 0;  // ZeRO-1: state slots of the optimizer whose blocks the replicas hold
  bool fused_update_ = true;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_NCCL
