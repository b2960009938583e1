#pragma once
// Parallel<Net, Host, Policies...>: data-parallel training on the CPU. Every replica is a rank of one
// communicator, whichever process model was chosen at construction:
//   Replicas   the replicas of this process, one thread each (DataParallel style): InProcessCommunicator
//   MpiWorld   one replica per MPI rank (DistributedDataParallel style, across machines through
//              mpirun's host list): MpiCommunicator
// and a step is written once for both (replica_step): each replica computes the gradient of its shard,
// its BucketReducer reduces it as the policies say (parallel/reducer.hpp), and the update runs as the
// reduce policy says (every replica, the root and a broadcast, or each its ZeRO-1 block and an
// all-gather).
#include "fusedp/parallel/parallel.hpp"

#include "fusedp/core/buffer.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/gradient.hpp"
#include "fusedp/net/model.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/detail/accumulate.hpp"
#include "fusedp/parallel/detail/bucket_update.hpp"
#include "fusedp/parallel/detail/startup.hpp"
#include "fusedp/parallel/detail/step.hpp"
#include "fusedp/parallel/gradient_channel.hpp"
#include "fusedp/parallel/in_process.hpp"
#include "fusedp/parallel/mpi.hpp"
#include "fusedp/parallel/policy.hpp"
#include "fusedp/parallel/process_group.hpp"
#include "fusedp/parallel/reducer.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <variant>
#include <vector>

namespace fusedp {

/// Data-parallel training of Net on the CPU with the given policies (see parallel/policy.hpp).
/// @tparam Net a Sequential<...>
/// @tparam Policies scatter, reduce, comm and knob tags, in any order
template <Network Net, class... Policies>
class Parallel<Net, Host, Policies...> {
 public:
  using policy = parallel::Policy<Host, Policies...>;
  using value_type = float;
  using model_type = Model<Net, Host, float>;
  /// The bucket capacity in bytes: ParallelOptions::bucket_bytes, or the Bucket<bytes> policy's.
  static constexpr std::size_t bucket_bytes(const ParallelOptions& o) noexcept {
    return parallel::bucket_capacity<policy>(o);
  }
  static constexpr bool sharded = std::is_same_v<typename policy::scatter_policy, scatter::Sharded>;
  static constexpr bool weighted = std::is_same_v<typename policy::scatter_policy, scatter::Weighted>;
  static constexpr parallel::detail::ReduceKind reduce_kind = policy::reduce_kind;
  static_assert(parallel::fits_network<Net, policy>());

  /// `r.count` replicas in this process, started from the same parameters (drawn from `seed`).
  explicit Parallel(Replicas r, Seed seed = {}, ParallelOptions options = {})
      : options_(parallel::detail::checked_options(options)), pool_(Host::dedicated(check_replicas(r))), group_(std::make_unique<parallel::InProcessGroup>(r.count)) {
    static_assert(std::is_same_v<typename policy::comm_policy, comm::Auto> ||
                      std::is_same_v<typename policy::comm_policy, comm::InProcess>,
                  "fusedp::Parallel: replicas in one process reduce in shared memory (category comm: Auto or "
                  "InProcess); construct from an MpiWorld for comm::Mpi");
    const int per = r.threads_per_replica > 0 ? r.threads_per_replica : std::max(1, cpu_budget().usable() / r.count);
    models_.reserve(std::size_t(r.count));
    for (int i = 0; i < r.count; ++i) models_.emplace_back(seed, Host{per, options.host_precision});
    for (std::size_t i = 1; i < models_.size(); ++i) models_[i].load_params(models_[0].params());
    InProcessChannels channels;
    channels.reserve(models_.size());
    for (int i = 0; i < r.count; ++i) channels.emplace_back(parallel::InProcessCommunicator(*group_, i));
    channels_.template emplace<InProcessChannels>(std::move(channels));
    init(std::size_t(r.count));
  }

#if FUSEDP_WITH_MPI
  /// One replica on each rank of `world` (launched by mpirun). Every rank checks that all ranks run the
  /// same network, parameter count, policies, world size and options.agree_on; a mismatch throws on
  /// every rank. Then the parameters of rank 0 are broadcast.
  explicit Parallel(const MpiWorld& world, Seed seed = {}, ParallelOptions options = {})
      : options_(parallel::detail::checked_options(options)), pool_(1), processes_(world, options.timeout) {
    static_assert(std::is_same_v<typename policy::comm_policy, comm::Auto> ||
                      std::is_same_v<typename policy::comm_policy, comm::Mpi>,
                  "fusedp::Parallel: one replica per MPI rank reduces through MPI (category comm: Auto or Mpi)");
    parallel::MpiCommunicator& comm = *processes_.mpi();
    // First: the only collective that cannot hang on a missing rank.
    world.collective_watch().set_hosts(parallel::detail::check_same_run(
        {Net::fingerprint, Net::param_count, policy::hash ^ (std::uint64_t(options.host_precision) << 48),  // and the precision
         std::uint64_t(world.size()), options.agree_on,
         std::uint64_t(options.accumulate), std::uint64_t(options.bucket_bytes), 1, fusedp::detail::processor_name()},
        std::size_t(world.size()), [&](const std::uint64_t* mine, std::uint64_t* all, std::size_t n) {
          comm.all_gather(mine, all, n, "Parallel start-up check");
        }));
    const int threads = options.threads > 0 ? options.threads : cpu_budget().per_process(local_ranks(world, comm));
    models_.emplace_back(seed, Host{threads, options.host_precision});
    comm.broadcast(models_[0].params().data(), Net::param_storage, 0);
    channels_.template emplace<MpiChannel>(comm);
    init(std::size_t(world.size()));
  }
#endif

  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  /// Replicas taking part in all (ranks times local replicas).
  [[nodiscard]] std::size_t world_size() const noexcept { return world_; }
  /// This process's rank (0 without MPI).
  [[nodiscard]] int rank() const noexcept { return processes_.rank(); }
  [[nodiscard]] bool is_root() const noexcept { return rank() == 0; }
  /// Replicas in this process.
  [[nodiscard]] std::size_t local_replicas() const noexcept { return models_.size(); }
  /// Micro-batches per step (ParallelOptions::accumulate).
  [[nodiscard]] std::size_t accumulate() const noexcept { return std::size_t(options_.accumulate); }
  /// The fused update (on by default): with AllReduce and an optimizer that is not Guarded, each
  /// replica updates a bucket's parameters once that bucket's sum is final (in-process: right after
  /// its sum; MPI with Overlap: after backward, as the started reductions are waited for), instead of
  /// in one pass after the last reduction; the same bits either way (parallel/detail/bucket_update.hpp).
  /// A step that fails in a reduction may leave the buckets reduced before it updated, with the step
  /// not counted (so their next update takes the same step number).
  void use_fused_update(bool on) noexcept { fused_update_ = on; }
  [[nodiscard]] bool uses_fused_update() const noexcept { return fused_update_; }
  /// Replica `i` of this process. All replicas hold the same parameters between steps.
  [[nodiscard]] model_type& model(std::size_t i = 0) { return models_.at(i); }
  [[nodiscard]] const model_type& model(std::size_t i = 0) const { return models_.at(i); }
  /// ZeRO-1 (ReduceScatter): the block of the flat buffer that replica `global` (its rank) owns and
  /// updates.
  [[nodiscard]] parallel::Shard zero_block(std::size_t global) const noexcept { return zero_.block(global); }
  /// ZeRO-1: the optimizer state of local replica `i`'s block (state_slots x its block).
  [[nodiscard]] std::span<const float> zero_optimizer_state(std::size_t i = 0) const {
    return zero_state_.at(i).span();
  }

  /// The optimizer state of the whole flat buffer (state_slots x param_storage values, as one Model
  /// holds it; empty before the first step), for a checkpoint. ReduceScatter: every replica's block,
  /// gathered (under MPI a collective: every rank calls it, every rank gets the whole); ReduceBroadcast:
  /// the root's (empty on the other ranks); AllReduce: replica 0's.
  [[nodiscard]] std::vector<float> gather_optimizer_state() {
    if constexpr (reduce_kind != parallel::detail::ReduceKind::reduce_scatter) {
      const std::span<const float> s = models_[0].optimizer_state();
      return {s.begin(), s.end()};
    } else {
      if (models_[0].optimizer_name() == nullptr || zero_slots_ == 0) return {};
      const std::size_t n = Net::param_storage;
      std::vector<float> full(zero_slots_ * n, 0.0f);
      for (std::size_t r = 0; r < models_.size(); ++r) {
        const parallel::Shard block = zero_.block(global_index(r));
        for (std::size_t s = 0; s < zero_slots_; ++s)
          std::copy_n(zero_state_[r].data() + s * block.count, block.count, full.data() + s * n + block.offset);
      }
#if FUSEDP_WITH_MPI
      if (auto* mpi = std::get_if<MpiChannel>(&channels_))
        for (std::size_t s = 0; s < zero_slots_; ++s) mpi->all_gather_blocks(full.data() + s * n, zero_);
#endif
      return full;
    }
  }

  /// Sets the optimizer state of Opt from `full` (Opt::state_slots x param_storage values, as
  /// gather_optimizer_state gives; empty: zero state) on every local replica, as the reduce policy
  /// holds it: ReduceScatter keeps each replica's block of the current world size, whatever the world
  /// size that saved it; ReduceBroadcast the root's; AllReduce every replica's. Communicates nothing.
  template <class Opt>
  void load_optimizer_state(std::span<const float> full) {
    const std::size_t n = Net::param_storage;
    require(full.empty() || full.size() == Opt::state_slots * n, "Parallel::load_optimizer_state: ", full.size(),
            " values for ", Opt::name, ", which holds ", Opt::state_slots * n);
    for (std::size_t r = 0; r < models_.size(); ++r) {
      model_type& m = models_[r];
      if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_scatter) {
        const parallel::Shard block = zero_.block(global_index(r));
        if (m.template adopt_optimizer<Opt>() || zero_state_[r].size() != Opt::state_slots * block.count)
          zero_state_[r] = HostBuffer<float>(Opt::state_slots * block.count);
        zero_slots_ = Opt::state_slots;
        for (std::size_t s = 0; s < Opt::state_slots; ++s)
          for (std::size_t i = 0; i < block.count; ++i)
            zero_state_[r].data()[s * block.count + i] = full.empty() ? 0.0f : full[s * n + block.offset + i];
      } else {
        if (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast && global_index(r) != 0) continue;
        const std::span<float> state = m.template optimizer_state<Opt>();
        if (full.empty()) std::fill(state.begin(), state.end(), 0.0f);
        else std::copy(full.begin(), full.end(), state.begin());
      }
    }
  }

  /// Whether `mine` holds on every rank (a collective under MPI): for decisions all ranks must take
  /// together, such as stopping after a signal or a failed save.
  [[nodiscard]] bool all_ranks(bool mine) const { return processes_.min(mine ? 1 : 0) == 1; }

  /// Run-time weights of scatter::Weighted, one per replica (world_size()).
  void set_weights(std::span<const double> weights) { weights_ = parallel::detail::checked_weights<weighted>(weights, world_); }

  /// One data-parallel step. With Even or Weighted, `inputs` is the global batch (the same on every
  /// rank) and each replica takes its slice; with Sharded it is this process's own data (split evenly
  /// among the local replicas). With ParallelOptions::accumulate K, each replica runs its slice as K
  /// micro-batches and the step's one update sees their summed gradient. Returns the mean loss over the
  /// global batch. Bad input throws before anything changes.
  template <class Loss, class Opt>
  float train_step(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                   const Loss& loss, Opt& opt) {
    opt.validate();
    const std::size_t batch = parallel::detail::checked_batch<model_type, Loss>(inputs, targets);
    const std::vector<parallel::Shard> shards = parallel::detail::process_shards(
        sharded, weighted, batch, models_.size(), world_, weights_, processes_.under_mpi() ? rank() : -1);
    // Even and Weighted: every replica's shard is known here (Sharded: once the counts are summed, below),
    // so that all refuse before any starts.
    if constexpr (!sharded)
      parallel::detail::require_micro_batches(
          parallel::detail::smallest_shard(weighted, batch, world_, weights_),
          std::size_t(options_.accumulate), synchronized(), Net::min_training_batch);
    auto one = [&](std::size_t r, auto& channel) {
      return replica_step(r, channel, inputs.subspan(shards[r].offset * model_type::input_size,
                                                     shards[r].count * model_type::input_size),
                          parallel::detail::targets_of(targets, batch, shards[r]), batch, shards[r].offset, loss,
                          opt);
    };
    return std::visit([&](auto& channels) { return on_every_replica(channels, one); }, channels_);
  }

  /// Evaluates this process's samples (`inputs` may be empty on a rank without any) and sums loss and
  /// correct predictions over all ranks: with an evaluation sampler that gives each sample to one
  /// rank, every sample is counted exactly once. Every rank must call it (it is a collective).
  template <class Loss>
  GlobalEvaluation evaluate(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                            const Loss& loss) {
    return sum_over_ranks(parallel::detail::evaluate_local(models_[0], inputs, targets, loss));
  }

  /// Adds up every rank's evaluation sums (a collective): for evaluation loops whose number of
  /// batches differs between ranks, which evaluate locally and combine once at the end.
  [[nodiscard]] GlobalEvaluation sum_over_ranks(const GlobalEvaluation& local) const {
    return parallel::detail::sum_over(processes_, local);
  }

  /// The smallest of every rank's `local` (steps per epoch): ranks that agree on it never wait in a
  /// collective for a rank that has run out of data.
  [[nodiscard]] std::size_t agree_steps(std::size_t local) const { return processes_.min(local); }

 private:
  using InProcessChannels = std::vector<parallel::HostChannel<parallel::InProcessCommunicator>>;
#if FUSEDP_WITH_MPI
  using MpiChannel = parallel::HostChannel<parallel::MpiCommunicator>;
  using Channels = std::variant<InProcessChannels, MpiChannel>;
#else
  using Channels = std::variant<InProcessChannels>;
#endif
  using Reducer = parallel::BucketReducer<policy>;
  template <class Opt>
  static constexpr bool guarded = requires { typename Opt::on_nonfinite; };
  // Whether a step with Opt can apply the update bucket by bucket (parallel/detail/bucket_update.hpp).
  template <class Opt>
  static constexpr bool updates_buckets() {
    return parallel::detail::updates_buckets<policy, Opt> &&
           requires(const Opt& o, const Host& h, float* p, std::size_t n, const kernels::DecayRuns& d) {
             o.step(h, p, p, p, n, std::uint64_t(1), d, n);
           };
  }

  static int check_replicas(Replicas r) {
    require(r.count >= 1, "Parallel: replica count must be >= 1, got ", r.count);
    require(r.threads_per_replica >= 0, "Parallel: threads per replica must be >= 0, got ", r.threads_per_replica);
    return r.count;
  }
#if FUSEDP_WITH_MPI
  // Ranks on this machine: the highest local rank + 1, agreed by all.
  static int local_ranks(const MpiWorld& world, parallel::MpiCommunicator& comm) {
    std::vector<std::uint64_t> all(std::size_t(world.size()));
    const std::uint64_t mine = std::uint64_t(world.local_rank());
    comm.all_gather(&mine, all.data(), 1);
    return int(*std::max_element(all.begin(), all.end()) + 1);
  }
#endif

  void init(std::size_t world) {
    world_ = world;
    reducers_.assign(models_.size(), Reducer(parallel::bucket_plan<Net>(bucket_bytes(options_), sizeof(float))));
    acc_.resize(models_.size());
    if (sharded) counts_.assign(models_.size(), std::vector<std::uint64_t>(world_));
    zero_ = parallel::ZeroLayout(Net::param_storage, world_, align_elements_count);
    zero_state_.resize(models_.size());
    guard_stats_.assign(models_.size(), std::vector<double>(2 + world_));
    if (weighted) weights_.assign(world_, 1.0);
  }

  // Whether BatchNorm layers take their statistics over every replica's shard (SyncBatchNorm).
  [[nodiscard]] bool synchronized() const noexcept { return policy::sync_batch_norm && world_ > 1; }

  // Where the first non-finite value of g[0, n) lies in the flat buffer (`offset` + its index), plus
  // one; 0 where all are finite. A double, exact below 2^53, so that replicas can add and share it.
  static double nonfinite_mark(const float* g, std::size_t n, std::size_t offset) {
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isfinite(g[i])) return double(offset + i + 1);
    return 0.0;
  }
  // The tensor a nonfinite_mark points into, in the words of Model::first_nonfinite_tensor.
  static std::string tensor_marked(double mark) {
    if (mark == 0.0) return "no tensor";
    return ParameterStore<Net, Host, float>::tensor_holding(static_cast<unsigned long long>(mark) - 1);
  }

  // Replica `local`'s rank in the world.
  std::size_t global_index(std::size_t local) const { return processes_.under_mpi() ? std::size_t(rank()) : local; }

  // The replicas of this process, one thread each; the first replica to fail breaks the group, so the
  // others stop in their next collective, and its error is the one rethrown.
  template <class F>
  float on_every_replica(InProcessChannels& channels, F& one) {
    if (channels.size() == 1) return one(0, channels[0]);
    group_->reset();
    std::vector<float> losses(channels.size());
    std::vector<std::exception_ptr> errors(channels.size());
    std::atomic<int> first_failed{-1};
    pool_.run_on_all([&](int r) {
      const trace::Lane lane{std::uint32_t(r)};
      try {
        losses[std::size_t(r)] = one(std::size_t(r), channels[std::size_t(r)]);
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
        int none = -1;
        first_failed.compare_exchange_strong(none, r);
        group_->break_all();
      }
    });
    if (first_failed.load() >= 0) std::rethrow_exception(errors[std::size_t(first_failed.load())]);
    return losses[0];
  }
#if FUSEDP_WITH_MPI
  template <class F>
  float on_every_replica(MpiChannel& channel, F& one) {
    return one(0, channel);
  }
#endif

  // One replica's step, the same for every process model: gradient of the shard, reduction, update.
  // `offset`: the shard's place in the global batch (Even, Weighted) or in this process's data
  // (Sharded). Returns the mean loss over the global batch (the same on every replica).
  template <class Channel, class Loss, class Opt>
  float replica_step(std::size_t r, Channel& channel, std::span<const float> inputs,
                     std::span<const typename Loss::template target<float>> targets, std::size_t batch,
                     std::size_t offset, const Loss& loss, Opt& opt) {
    model_type& m = models_[r];
    const trace::Scope step_span("step", trace::Kind::step, std::int64_t(m.steps() + 1));
    const std::size_t count = inputs.size() / model_type::input_size;
    std::uint64_t global = batch;
    std::size_t first_sample = offset;  // where the shard begins in the step's global batch
    if constexpr (sharded) {
      // Every replica's count, in replica order: the global batch and this shard's place in it.
      std::vector<std::uint64_t>& counts = counts_[r];
      std::fill(counts.begin(), counts.end(), std::uint64_t(0));
      counts[global_index(r)] = count;
      {
        const trace::Scope span("sample counts", trace::Kind::collective);
        channel.comm().all_reduce_sum(counts.data(), counts.size());
      }
      global = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) global += counts[i];
      first_sample = 0;
      for (std::size_t i = 0; i < global_index(r); ++i) first_sample += std::size_t(counts[i]);
      // Every replica's shard is known to every replica now: all refuse together, before any changes.
      parallel::detail::require_micro_batches(std::size_t(*std::min_element(counts.begin(), counts.end())),
                                              std::size_t(options_.accumulate), synchronized(), Net::min_training_batch);
    }
    // Average: each replica's gradient is its share of the mean over the global batch (its loss sum
    // divided by the global count), so the reduction is a plain sum. Sum: each replica's own mean.
    const std::size_t normalizer = policy::sum ? count : std::size_t(global);
    Reducer& reducer = reducers_[r];
    reducer.begin();
    // SyncBatchNorm: the layers' statistics over every replica's shard.
    const ReplicaSum sync = synchronized() ? channel.replica_sum() : ReplicaSum{};
    const std::size_t micro = std::size_t(options_.accumulate);
    if (micro > 1 && acc_[r].size() == 0) acc_[r] = HostBuffer<float>(Net::param_storage);
    // The fused update: each bucket's update as soon as its sum is final (the same bits as one pass).
    const bool by_bucket = updates_buckets<Opt>() && fused_update_ && reducer.covers(Net::param_storage) &&
                           parallel::detail::holds_state_of(m, opt);
    parallel::detail::BucketStep<float> bucket_step{};
    if constexpr (updates_buckets<Opt>()) {
      if (by_bucket) bucket_step = parallel::detail::bucket_step(m, opt);
    }
    auto on_final = [&](std::size_t begin, std::size_t end) {
      if constexpr (updates_buckets<Opt>()) {
        if (!by_bucket) return;
        const trace::Scope span("optimizer", trace::Kind::optimizer);
        opt.step(m.space(), bucket_step.params + begin, bucket_step.grads + begin, bucket_step.state + begin,
                 end - begin, bucket_step.t, m.decay_runs(begin), bucket_step.stride);
      }
    };
    const float l = parallel::detail::accumulate_gradients(
        m, reducer.plan(), acc_[r].data(), micro, inputs, targets, loss, normalizer, sync, first_sample,
        [&](const float* src, float* dst, std::size_t n) { kernels::host::copy_values(m.space(), n, src, dst, true); },
        [&](const float* src, float* dst, std::size_t n) { kernels::host::copy_values(m.space(), n, src, dst, false); },
        [&](std::size_t stage) { reducer.stage_done(channel, m.grads().data(), stage, on_final); });
    reducer.finish(channel, m.grads().data(), zero_, on_final);
    if (by_bucket) m.count_step(true);
    else update(r, channel, opt);
    if constexpr (policy::broadcast_buffers) {
      const trace::Scope span("broadcast state", trace::Kind::collective);
      channel.comm().broadcast(m.buffers().data(), Net::state_storage, 0);
    }
    double weighted_loss = double(l) * double(count);
    {
      const trace::Scope span("loss sum", trace::Kind::collective);
      channel.comm().all_reduce_sum(&weighted_loss, 1);
    }
    return float(weighted_loss / double(global));
  }

  template <class Channel, class Opt>
  void update(std::size_t r, Channel& channel, Opt& opt) {
    using parallel::detail::ReduceKind;
    model_type& m = models_[r];
    if constexpr (reduce_kind == ReduceKind::all_reduce) {
      m.step(opt);  // every replica holds the same sum, so a guard decides the same everywhere
    } else if constexpr (reduce_kind == ReduceKind::reduce_broadcast) {
      // Only the root (replica 0 of the world) holds the summed gradient and the optimizer state. A
      // guarded optimizer's decision is the root's, shared with every replica so they act together.
      double factor = 1.0;
      if constexpr (guarded<Opt>) {
        std::array<double, 3> stats{};  // the sum of squares, not finite, where (nonfinite_mark)
        if (channel.rank() == 0) {
          const auto s = kernels::host::gradient_stats(m.space(), m.grads().data(), Net::param_storage);
          stats = {s.sum_squares, s.finite ? 0.0 : 1.0,
                   s.finite ? 0.0 : nonfinite_mark(m.grads().data(), Net::param_storage, 0)};
        }
        channel.comm().broadcast(stats.data(), stats.size(), 0);
        factor = opt.decide({stats[0], stats[1] == 0.0}, m.steps() + 1, tensor_marked(stats[2]));
      }
      if (channel.rank() == 0) m.apply_step(opt, factor);
      else m.count_step(factor != 0.0);
      const trace::Scope span("broadcast parameters", trace::Kind::collective);
      channel.comm().broadcast(m.params().data(), Net::param_storage, 0);
    } else {
      zero_update(r, channel, opt);
    }
  }

  // ZeRO-1: replica g (its rank in the world) owns block g of the flat buffer and the optimizer state of
  // that block only; it updates its block, then the blocks are all-gathered.
  template <class Channel, class Opt>
  void zero_update(std::size_t r, Channel& channel, Opt& opt) {
    model_type& m = models_[r];
    const parallel::Shard block = zero_.block(std::size_t(channel.rank()));
    if (m.template adopt_optimizer<Opt>()) zero_state_[r] = HostBuffer<float>(Opt::state_slots * block.count);
    zero_slots_ = Opt::state_slots;
    float* g = m.grads().data() + block.offset;
    // A guarded optimizer decides on the whole gradient: each replica measures its block, the parts are
    // added over all replicas, and every replica takes the same decision.
    double factor = 1.0;
    if constexpr (guarded<Opt>) {
      // The sum of squares, not finite, then each replica's first non-finite element of its block in
      // rank order (nonfinite_mark): the first of those is the summed gradient's, which no replica holds
      // whole (outside its block each holds its own shard's gradient).
      const auto s = kernels::host::gradient_stats(m.space(), g, block.count);
      std::vector<double>& stats = guard_stats_[r];  // sized by init: no step allocates
      std::fill(stats.begin(), stats.end(), 0.0);
      stats[0] = s.sum_squares;
      stats[1] = s.finite ? 0.0 : 1.0;
      if (!s.finite) stats[2 + std::size_t(channel.rank())] = nonfinite_mark(g, block.count, block.offset);
      channel.comm().all_reduce_sum(stats.data(), stats.size());
      double first = 0.0;
      for (std::size_t i = 2; i < stats.size() && first == 0.0; ++i) first = stats[i];
      factor = opt.decide({stats[0], stats[1] == 0.0}, m.steps() + 1, tensor_marked(first));
      if (factor == 0.0) {
        m.count_step(false);
        return;
      }
    }
    trace::Scope update_span("optimizer", trace::Kind::optimizer);
    if (factor != 1.0) kernels::host::scale_gradient(m.space(), g, block.count, float(factor));
    opt.step(m.space(), m.params().data() + block.offset, g, zero_state_[r].data(), block.count,
             m.optimizer_steps() + 1, m.decay_runs(block.offset));
    m.count_step(true);
    update_span.end();
    const trace::Scope span("gather parameters", trace::Kind::collective);
    channel.all_gather_blocks(m.params().data(), zero_);
  }

  ParallelOptions options_;
  Host pool_;  // one thread of its own per local replica (dedicated: replicas wait for each other)
  std::unique_ptr<parallel::InProcessGroup> group_;  // the replicas of this process (none under MPI)
  parallel::ProcessGroup processes_;
  std::vector<model_type> models_;
  Channels channels_;
  std::vector<Reducer> reducers_;
  std::size_t world_ = 1;
  std::vector<double> weights_;
  parallel::ZeroLayout zero_;
  std::vector<HostBuffer<float>> zero_state_;
  std::size_t zero_slots_ = 0;  // ZeRO-1: state slots of the optimizer whose blocks zero_state_ holds
  std::vector<std::vector<double>> guard_stats_;  // ZeRO-1's guard: each replica's sums and marks (zero_update)
  std::vector<HostBuffer<float>> acc_;  // accumulate > 1: each replica's sum of its micro-batches' gradients
  std::vector<std::vector<std::uint64_t>> counts_;  // Sharded: each replica's room for every replica's count
  bool fused_update_ = true;
};

}  // namespace fusedp
