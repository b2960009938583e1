#pragma once
// Parallel<Net, Space, Policies...>: data-parallel training. Replicas of one Model each take a shard of
// the batch, compute gradients, and the gradients are combined as the policies say before the update.
// Two process models: replicas in this process (threads; DataParallel style), or one replica per MPI
// rank (mpirun; DistributedDataParallel style, across machines through mpirun's host list).
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/host/gradient.hpp"
#include "fusedp/loss/softmax_cross_entropy.hpp"
#include "fusedp/net/model.hpp"
#include "fusedp/parallel/bucket_plan.hpp"
#include "fusedp/parallel/mpi.hpp"
#include "fusedp/parallel/nccl.hpp"
#include "fusedp/parallel/policy.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedp {

/// Replicas in this process: `count` models, each with `threads_per_replica` Host threads (0: the
/// hardware threads divided among the replicas, at least one each).
struct Replicas {
  int count = 1;
  int threads_per_replica = 0;
};
constexpr Replicas replicas(int count, int threads_per_replica = 0) { return {count, threads_per_replica}; }

/// Cuda replicas in this process: one on each listed device (`fp::Devices{0, 1, 2, 3}`).
struct Devices {
  std::vector<int> ids;
  Devices(std::initializer_list<int> list) : ids(list) {}
  explicit Devices(std::vector<int> list) : ids(std::move(list)) {}
};
/// `devices(0, 1)`: the same as Devices{0, 1}.
template <class... Ids>
Devices devices(Ids... ids) {
  return Devices{int(ids)...};
}

struct ParallelOptions {
  /// MPI: Host threads of this rank's replica (0: the hardware threads divided among the ranks of
  /// this machine).
  int threads = 0;
  /// MPI: how long each collective (the start-up check included) waits for every rank before it
  /// throws DeviceError naming the rank that stopped responding (FUSEDP_COLLECTIVE_TIMEOUT, in
  /// seconds, overrides it; see parallel/mpi.hpp). Cuda: also how long NCCL's start-up and each
  /// step's collectives may take before the communicator is aborted and the step throws (a dead peer
  /// never hangs the job).
  std::chrono::milliseconds timeout{60000};
  /// Cuda with MPI: this rank's device (-1: its rank among the ranks of its machine).
  int device = -1;
  /// Any value that every rank must share, e.g. a hash of the command line's flags.
  std::uint64_t agree_on = 0;
};

/// Loss and accuracy summed over every rank's evaluation samples.
struct GlobalEvaluation {
  double loss_sum = 0;
  std::size_t correct = 0;
  std::size_t count = 0;
  [[nodiscard]] double loss() const { return count ? loss_sum / double(count) : 0.0; }
  [[nodiscard]] double accuracy() const { return count ? double(correct) / double(count) : 0.0; }
};

namespace parallel::detail {
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
inline std::vector<double> checked_weights(std::span<const double> weights, std::size_t world) {
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

/// Evaluation sums added over the ranks of `comm` (a collective).
template <class Comm>
GlobalEvaluation sum_over(Comm& comm, const GlobalEvaluation& local) {
  std::array<double, 3> sums{local.loss_sum, double(local.correct), double(local.count)};
  comm.all_reduce_sum(sums.data(), sums.size());
  return {sums[0], std::size_t(sums[1]), std::size_t(sums[2])};
}

/// The smallest of every rank's `local` (a collective over `world` ranks).
template <class Comm>
std::size_t min_over(Comm& comm, std::size_t world, std::size_t local) {
  std::vector<std::uint64_t> all(world);
  const std::uint64_t mine = local;
  comm.all_gather(&mine, all.data(), 1);
  return std::size_t(*std::min_element(all.begin(), all.end()));
}
}  // namespace parallel::detail

/// Data-parallel training of Net on Space with the given policies (see parallel/policy.hpp).
/// @tparam Net a Sequential<...>
/// @tparam Space the execution space of every replica
/// @tparam Policies scatter, reduce, comm and knob tags, in any order
template <Network Net, class Space, class... Policies>
class Parallel {
  static_assert(std::is_same_v<Space, Host>,
                "fusedp::Parallel: replicas on the Cuda space need nvcc and NCCL (<nccl.h> on the include path: "
                "link NCCL::NCCL or fusedp::cuda); this primary template is the Host one");

 public:
  using policy = parallel::Policy<Space, Policies...>;
  using value_type = float;
  using model_type = Model<Net, Space, float>;
  using plan = parallel::BucketPlan<Net, policy::bucket_bytes, sizeof(float)>;
  static constexpr bool sharded = std::is_same_v<typename policy::scatter_policy, scatter::Sharded>;
  static constexpr bool weighted = std::is_same_v<typename policy::scatter_policy, scatter::Weighted>;
  static constexpr parallel::detail::ReduceKind reduce_kind = policy::reduce_kind;

  /// `r.count` replicas in this process, started from the same parameters (drawn from `seed`).
  explicit Parallel(Replicas r, Seed seed = {}, ParallelOptions options = {})
      : options_(options), pool_(check_replicas(r)) {
    static_assert(std::is_same_v<typename policy::comm_policy, comm::Auto> ||
                      std::is_same_v<typename policy::comm_policy, comm::InProcess>,
                  "fusedp::Parallel: replicas in one process reduce in shared memory (category comm: Auto or "
                  "InProcess); construct from an MpiWorld for comm::Mpi");
    const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
    const int per = r.threads_per_replica > 0 ? r.threads_per_replica : std::max(1, hw / r.count);
    models_.reserve(std::size_t(r.count));
    for (int i = 0; i < r.count; ++i) models_.emplace_back(seed, Host{per});
    world_ = std::size_t(r.count);
    for (std::size_t i = 1; i < models_.size(); ++i) copy_params(models_[0], models_[i]);
    init_shared();
  }

#if FUSEDP_WITH_MPI
  /// One replica on each rank of `world` (launched by mpirun). Every rank checks that all ranks run the
  /// same network, parameter count, policies, world size and options.agree_on; a mismatch throws on
  /// every rank. Then the parameters of rank 0 are broadcast.
  explicit Parallel(const MpiWorld& world, Seed seed = {}, ParallelOptions options = {})
      : options_(options), pool_(1), comm_(std::in_place, world, options.timeout) {
    static_assert(std::is_same_v<typename policy::comm_policy, comm::Auto> ||
                      std::is_same_v<typename policy::comm_policy, comm::Mpi>,
                  "fusedp::Parallel: one replica per MPI rank reduces through MPI (category comm: Auto or Mpi)");
    world_ = std::size_t(world.size());
    rank_ = world.rank();
    handshake();  // first: the only collective that cannot hang on a missing rank
    const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
    const int threads = options.threads > 0 ? options.threads : std::max(1, hw / std::max(1, local_ranks(world)));
    models_.emplace_back(seed, Host{threads});
    comm_->broadcast(models_[0].params().data(), Net::param_storage, 0);
    init_shared();
  }
#endif

  /// Replicas taking part in all (ranks times local replicas).
  [[nodiscard]] std::size_t world_size() const noexcept { return world_; }
  /// This process's rank (0 without MPI).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == 0; }
  /// Replicas in this process.
  [[nodiscard]] std::size_t local_replicas() const noexcept { return models_.size(); }
  /// Replica `i` of this process. All replicas hold the same parameters between steps.
  [[nodiscard]] model_type& model(std::size_t i = 0) { return models_.at(i); }
  [[nodiscard]] const model_type& model(std::size_t i = 0) const { return models_.at(i); }

  /// Run-time weights of scatter::Weighted, one per replica (world_size()).
  void set_weights(std::span<const double> weights) {
    static_assert(weighted, "fusedp::Parallel::set_weights: only scatter::Weighted takes weights");
    weights_ = parallel::detail::checked_weights(weights, world_);
  }

  /// One data-parallel step. With Even or Weighted, `inputs` is the global batch (the same on every
  /// rank) and each replica takes its slice; with Sharded it is this process's own data (split evenly
  /// among the local replicas). Returns the mean loss over the global batch. Bad input throws before
  /// anything changes.
  template <class Loss, class Opt>
  float train_step(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                   const Loss& loss, Opt& opt) {
    opt.validate();
    const std::size_t in = model_type::input_size;
    const std::size_t batch = parallel::detail::checked_batch<model_type, Loss>(inputs, targets);
    const std::vector<parallel::Shard> shards = local_shards(batch);
    std::size_t local = 0;
    for (const auto& sh : shards) local += sh.count;
    const std::size_t global = global_count(local, batch);

    std::vector<float> losses(models_.size());
    // Average: each replica's gradient is its share of the mean over the global batch (its loss sum
    // divided by the global count), so the reduction is a plain sum. Sum: each replica's own mean.
    auto normalizer = [&](const parallel::Shard& sh) { return policy::sum ? sh.count : global; };
    for (std::size_t b = 0; b < plan::count; ++b) arrivals_[b].store(0, std::memory_order_relaxed);

    auto targets_of = [&](const parallel::Shard& s) {
      const std::size_t t = targets.size() / batch;
      return targets.subspan(s.offset * t, s.count * t);
    };
    if (comm_) {
      losses[0] = models_[0].compute_gradients(inputs.subspan(shards[0].offset * in, shards[0].count * in),
                                               targets_of(shards[0]), loss,
                                               [&](std::size_t stage) { mpi_stage_done(stage); }, normalizer(shards[0]));
      mpi_finish_reduction();
    } else {
      pool_.run_on_all([&](int r) {
        const auto& s = shards[std::size_t(r)];
        losses[std::size_t(r)] = models_[std::size_t(r)].compute_gradients(
            inputs.subspan(s.offset * in, s.count * in), targets_of(s), loss,
            [&](std::size_t stage) { local_stage_done(stage); }, normalizer(s));
      });
      if constexpr (!policy::overlap) {
        pool_.run_on_all([&](int r) {
          for (std::size_t b = 0; b < plan::count; ++b) {
            const auto& bucket = plan::buckets[b];
            const std::size_t n = bucket.end - bucket.begin, w = models_.size();
            reduce_local(bucket.begin + n * std::size_t(r) / w, bucket.begin + n * (std::size_t(r) + 1) / w);
          }
        });
      }
    }
    apply_update(opt);

    double weighted_loss = 0;
    for (std::size_t r = 0; r < models_.size(); ++r) weighted_loss += double(losses[r]) * double(shards[r].count);
#if FUSEDP_WITH_MPI
    if (comm_) comm_->all_reduce_sum(&weighted_loss, 1);
#endif
    return float(weighted_loss / double(global));
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
#if FUSEDP_WITH_MPI
    if (comm_) return parallel::detail::sum_over(*comm_, local);
#endif
    return local;
  }

  /// The smallest of every rank's `local` (steps per epoch): ranks that agree on it never wait in a
  /// collective for a rank that has run out of data.
  [[nodiscard]] std::size_t agree_steps(std::size_t local) const {
#if FUSEDP_WITH_MPI
    if (comm_) return parallel::detail::min_over(*comm_, world_, local);
#endif
    return local;
  }

 private:
  static int check_replicas(Replicas r) {
    require(r.count >= 1, "Parallel: replica count must be >= 1, got ", r.count);
    require(r.threads_per_replica >= 0, "Parallel: threads per replica must be >= 0, got ", r.threads_per_replica);
    return r.count;
  }
#if FUSEDP_WITH_MPI
  static int local_ranks(const MpiWorld& world) {
    // Ranks on this machine: the highest local rank + 1, agreed by all.
    std::vector<std::uint64_t> all(std::size_t(world.size()));
    const std::uint64_t mine = std::uint64_t(world.local_rank());
    parallel::MpiCommunicator(world).all_gather(&mine, all.data(), 1);
    return int(*std::max_element(all.begin(), all.end()) + 1);
  }

  void handshake() {
    const std::array<std::uint64_t, 7> mine{0x66757365647031ull /* "fusedp1" */,
                                            FUSEDP_VERSION_MAJOR * 10000ull + FUSEDP_VERSION_MINOR * 100ull,
                                            Net::fingerprint,
                                            Net::param_count,
                                            policy::hash,
                                            world_,
                                            options_.agree_on};
    static constexpr const char* what[] = {"library",     "library version", "network fingerprint", "parameter count",
                                           "policy hash", "world size",      "agree_on value"};
    std::vector<std::uint64_t> all(mine.size() * world_);
    comm_->all_gather(mine.data(), all.data(), mine.size(), "Parallel start-up check");
    std::ostringstream diff;
    for (std::size_t r = 1; r < world_; ++r)
      for (std::size_t k = 0; k < mine.size(); ++k)
        if (all[r * mine.size() + k] != all[k])
          diff << "\n  rank " << r << " has " << what[k] << " " << all[r * mine.size() + k] << ", rank 0 has " << all[k];
    if (!diff.str().empty())
      throw InvalidArgument("Parallel: the ranks were not started with the same network and settings:" + diff.str());
  }
#endif

  void init_shared() {
    arrivals_ = std::make_unique<std::atomic<int>[]>(plan::count);
    zero_ = parallel::element_blocks(Net::param_storage, world_, align_elements_count);
    if (weighted) weights_.assign(world_, 1.0);
  }

  static void copy_params(const model_type& from, model_type& to) {
    std::copy(from.params().begin(), from.params().end(), to.params().begin());
  }

  // This process's shards of a batch, one per local replica.
  std::vector<parallel::Shard> local_shards(std::size_t batch) const {
    return parallel::detail::process_shards(sharded, weighted, batch, models_.size(), world_, weights_,
                                            comm_ ? rank_ : -1);
  }

  std::size_t global_count(std::size_t local, std::size_t batch) const {
    if (!sharded) return batch;
#if FUSEDP_WITH_MPI
    if (comm_) {
      std::uint64_t n = local;
      comm_->all_reduce_sum(&n, 1);
      return std::size_t(n);
    }
#endif
    return local;
  }

  // In process: the last replica to finish a bucket reduces it while the others continue backward.
  void local_stage_done(std::size_t stage) {
    if constexpr (policy::overlap) {
      for (std::size_t b = 0; b < plan::count; ++b)
        if (plan::buckets[b].ready_after == stage &&
            arrivals_[b].fetch_add(1, std::memory_order_acq_rel) + 1 == int(models_.size()))
          reduce_local(plan::buckets[b].begin, plan::buckets[b].end);
    }
  }

  // The one way gradients are added: in rank order, through bfloat16 with Compress.
  static float accumulate(float sum, float value) {
    if constexpr (policy::compress) return kernels::round_bf16(sum + kernels::round_bf16(value));
    else return sum + value;
  }

  // Sums elements [begin, end) of every replica's gradient in replica order into every replica.
  void reduce_local(std::size_t begin, std::size_t end) {
    const std::size_t n = models_.size();
    float* first = models_[0].grads().data();
    for (std::size_t i = begin; i < end; ++i) {
      float s = 0;
      for (std::size_t r = 0; r < n; ++r) s = accumulate(s, models_[r].grads()[i]);
      first[i] = s;
    }
    if (reduce_kind != parallel::detail::ReduceKind::reduce_broadcast)
      for (std::size_t r = 1; r < n; ++r) std::copy(first + begin, first + end, models_[r].grads().data() + begin);
  }

  // MPI: reduce a bucket when backward completes it (Overlap), else everything after backward.
  void mpi_stage_done([[maybe_unused]] std::size_t stage) {
#if FUSEDP_WITH_MPI
    if constexpr (policy::overlap && reduce_kind != parallel::detail::ReduceKind::reduce_scatter) {
      for (std::size_t b = 0; b < plan::count; ++b)
        if (plan::buckets[b].ready_after == stage) mpi_reduce_bucket(plan::buckets[b], true);
    }
#endif
  }
  void mpi_finish_reduction() {
#if FUSEDP_WITH_MPI
    if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_scatter) {
      float* g = models_[0].grads().data();
      if constexpr (policy::deterministic || policy::compress) {
        for (const auto& b : plan::buckets) mpi_reduce_bucket(b, false);
      } else {
        const auto [counts, displs] = zero_blocks();
        gathered_.reserve_discard(std::size_t(counts[std::size_t(rank_)]));
        comm_->reduce_scatter_blocks(g, counts, displs, gathered_.data());
      }
    } else if constexpr (!policy::overlap) {
      for (const auto& b : plan::buckets) mpi_reduce_bucket(b, false);
    }
    comm_->wait_all(requests_);
#endif
  }

#if FUSEDP_WITH_MPI
  void mpi_reduce_bucket(const parallel::GradientBucket& bucket, bool may_start) {
    float* g = models_[0].grads().data() + bucket.begin;
    const std::size_t n = bucket.end - bucket.begin;
    if constexpr (policy::deterministic) {
      // Every rank's values, then a sum in rank order: the same bits whatever MPI's algorithm.
      gathered_.reserve_discard(n * world_);
      comm_->all_gather(g, gathered_.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        float s = 0;
        for (std::size_t r = 0; r < world_; ++r) s = accumulate(s, gathered_[r * n + i]);
        g[i] = s;
      }
    } else if constexpr (policy::compress) {
      packed_.reserve_discard(n);
      for (std::size_t i = 0; i < n; ++i) packed_[i] = kernels::to_bf16(g[i]);
      comm_->all_reduce_sum_bf16(packed_.data(), n);
      for (std::size_t i = 0; i < n; ++i) g[i] = kernels::from_bf16(packed_[i]);
    } else if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast) {
      comm_->reduce_sum(g, n, 0);
    } else if (may_start) {
      comm_->start_all_reduce_sum(g, n, requests_);
    } else {
      comm_->all_reduce_sum(g, n);
    }
  }

  std::pair<std::vector<int>, std::vector<int>> zero_blocks() const {
    std::vector<int> counts(world_), displs(world_);
    for (std::size_t r = 0; r < world_; ++r) {
      counts[r] = int(zero_[r].count);
      displs[r] = int(zero_[r].offset);
    }
    return {counts, displs};
  }
#endif

  template <class Opt>
  void apply_update(Opt& opt) {
    using parallel::detail::ReduceKind;
    if constexpr (reduce_kind == ReduceKind::all_reduce) {
      if (models_.size() == 1) models_[0].step(opt);
      else pool_.run_on_all([&](int r) { models_[std::size_t(r)].step(opt); });
    } else if constexpr (reduce_kind == ReduceKind::reduce_broadcast) {
      // Only the root (replica 0, or rank 0 over MPI) holds the summed gradient and optimizer state.
      // A guarded optimizer's decision is the root's, shared with every rank so they act together.
      bool applied = true;
      if constexpr (requires { typename Opt::on_nonfinite; }) {
        if (comm_) {
          kernels::host::GradientStats stats;
          if (rank_ == 0) stats = kernels::host::gradient_stats(models_[0].space(), models_[0].grads().data(), Net::param_storage);
          applied = opt.decide(share_from_root(stats), models_[0].steps() + 1, "the gradient summed on rank 0") != 0.0;
        }
      }
      if (rank_ == 0) applied = models_[0].step(opt);
      else models_[0].set_step_counters(models_[0].steps() + 1, models_[0].optimizer_steps() + (applied ? 1 : 0));
#if FUSEDP_WITH_MPI
      if (comm_) comm_->broadcast(models_[0].params().data(), Net::param_storage, 0);
#endif
      for (std::size_t r = 1; r < models_.size(); ++r) {
        copy_params(models_[0], models_[r]);
        models_[r].set_step_counters(models_[0].steps(), models_[0].optimizer_steps());
      }
    } else {
      zero_update(opt);
    }
  }

  // ZeRO-1: replica g (global index) owns block g of the flat buffer and the optimizer state of that
  // block only; it updates its block, then the blocks are all-gathered.
  template <class Opt>
  void zero_update(Opt& opt) {
    if (zero_owner_ == nullptr || std::strcmp(zero_owner_, Opt::name) != 0) {
      zero_state_.clear();
      for (std::size_t r = 0; r < models_.size(); ++r)
        zero_state_.emplace_back(Opt::state_slots * zero_[global_index(r)].count);
      zero_owner_ = Opt::name;
      zero_steps_ = 0;
    }
    // A guarded optimizer decides on the whole gradient: each replica measures its block, the parts
    // are added over all replicas, and every replica takes the same decision.
    double factor = 1.0;
    if constexpr (requires { typename Opt::on_nonfinite; }) {
      kernels::host::GradientStats stats;
      for (std::size_t r = 0; r < models_.size(); ++r) {
        const parallel::Shard block = zero_[global_index(r)];
        stats += kernels::host::gradient_stats(models_[r].space(), models_[r].grads().data() + block.offset, block.count);
      }
      factor = opt.decide(sum_stats(stats), models_[0].steps() + 1, models_[0].first_nonfinite_tensor());
      if (factor == 0.0) {
        for (auto& m : models_) m.set_step_counters(m.steps() + 1, zero_steps_);
        return;
      }
    }
    ++zero_steps_;
    auto update = [&](std::size_t r) {
      const parallel::Shard block = zero_[global_index(r)];
      model_type& m = models_[r];
      if (factor != 1.0) kernels::host::scale_gradient(m.space(), m.grads().data() + block.offset, block.count, float(factor));
      opt.step(m.space(), m.params().data() + block.offset, m.grads().data() + block.offset, zero_state_[r].data(),
               block.count, zero_steps_);
    };
    if (models_.size() == 1) update(0);
    else pool_.run_on_all([&](int r) { update(std::size_t(r)); });
#if FUSEDP_WITH_MPI
    if (comm_) {
      const auto [counts, displs] = zero_blocks();
      comm_->all_gather_blocks(models_[0].params().data(), counts, displs);
    }
#endif
    if (models_.size() > 1) {
      pool_.run_on_all([&](int r) {
        const parallel::Shard block = zero_[std::size_t(r)];
        for (std::size_t d = 0; d < models_.size(); ++d)
          if (d != std::size_t(r))
            std::copy(models_[std::size_t(r)].params().data() + block.offset,
                      models_[std::size_t(r)].params().data() + block.offset + block.count,
                      models_[d].params().data() + block.offset);
      });
    }
    for (auto& m : models_) m.set_step_counters(m.steps() + 1, zero_steps_);
  }

  std::size_t global_index(std::size_t local) const { return comm_ ? std::size_t(rank_) : local; }

  // Gradient stats of parts held by different ranks, added up (in-process: already whole).
  kernels::host::GradientStats sum_stats(kernels::host::GradientStats local) const {
#if FUSEDP_WITH_MPI
    if (comm_) {
      std::array<double, 2> v{local.sum_squares, local.finite ? 0.0 : 1.0};
      comm_->all_reduce_sum(v.data(), v.size());
      return {v[0], v[1] == 0.0};
    }
#endif
    return local;
  }
  // Rank 0's stats on every rank.
  kernels::host::GradientStats share_from_root(kernels::host::GradientStats stats) const {
#if FUSEDP_WITH_MPI
    if (comm_) {
      std::array<double, 2> v{stats.sum_squares, stats.finite ? 0.0 : 1.0};
      comm_->broadcast(v.data(), v.size(), 0);
      return {v[0], v[1] == 0.0};
    }
#endif
    return stats;
  }

  ParallelOptions options_;
  Host pool_;  // one thread per local replica
  std::vector<model_type> models_;
  std::size_t world_ = 1;
  int rank_ = 0;
  std::vector<double> weights_;
  std::unique_ptr<std::atomic<int>[]> arrivals_;
  std::vector<parallel::Shard> zero_;
  std::vector<HostBuffer<float>> zero_state_;
  const char* zero_owner_ = nullptr;
  std::uint64_t zero_steps_ = 0;
#if FUSEDP_WITH_MPI
  std::optional<parallel::MpiCommunicator> comm_;
  std::vector<MPI_Request> requests_;
  HostBuffer<float> gathered_;
  HostBuffer<std::uint16_t> packed_;
#else
  std::optional<int> comm_;  // never engaged without MPI
#endif
};

}  // namespace fusedp

#if FUSEDP_HAS_CUDA && FUSEDP_HAS_NCCL
#include "fusedp/kernels/cuda/gradient.cuh"

// Parallel<Net, CudaSpace<P>, Policies...>: replicas on GPUs, gradients through NCCL. Two process
// models, as on Host: one process driving one replica per listed device (a thread each), or one replica
// per MPI rank (mpirun; the NCCL unique id travels over MPI, each rank takes the device of its rank
// among the ranks of its machine). Gradients are summed in the compile-time buckets of BucketPlan on a
// communication stream of each replica: with Overlap, a bucket's collective is queued as soon as the
// Cuda model's stage hook says backward has queued its last gradient (an event orders it after those
// kernels); the optimizer waits for the last one (another event). Shards scale their gradient by
// (shard / global batch) first, so every reduction is a plain sum, as on Host.
// Available on Cuda: every policy of Host. AllReduce; ReduceBroadcast; ReduceScatter (ZeRO-1: see
// below); Deterministic (an all-gather and a sum in rank order, the Host's order and bits); Compress<bf16>
// (each bucket packed to bfloat16 rounded to nearest even, summed by NCCL in ncclBfloat16, unpacked);
// Average/Sum; every scatter policy; Guarded optimizers (the gradient's sum of squares and first
// non-finite element measured on the device over this rank's part, combined over the ranks with NCCL,
// one 16-byte read per step, so every rank takes the same decision). Steps do not replay CUDA graphs
// (the NCCL calls sit between the model's kernels); each step waits for its update before returning.
//
// ZeRO-1 layout: rank r owns elements [r*s, (r+1)*s) of the flat buffer, s = param_storage rounded
// down to a multiple of world * alignment, divided by world; the last rank also owns the remainder
// (fewer than world * align_elements_count elements). Gradients: ncclReduceScatter in place on the
// world*s elements, the remainder all-reduced (tiny); each rank updates its own block with optimizer
// state for that block only; parameters: ncclAllGather in place, the remainder broadcast by the last
// rank. Nothing is padded or copied, so the model's buffers serve as they are. With Deterministic or
// Compress the gradient is all-reduced in buckets as those policies say, then each rank updates its
// block the same way.
namespace fusedp {

namespace parallel::detail {
// g[i] *= s: a shard's share of the mean over the global batch.
template <int = 0>
__global__ void scale_kernel(float* g, std::size_t n, float s) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    g[i] *= s;
}
// out[i] = all[0 * n + i] + all[1 * n + i] + ... in rank order, from 0: the Host's reduce_local, bit for bit
// (with Compress, each value and each partial sum rounded to bfloat16, as the Host's accumulate).
template <bool Bf16 = false>
__global__ void sum_in_rank_order_kernel(const float* __restrict__ all, float* __restrict__ out, std::size_t n, int world) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    float s = 0;
    for (int r = 0; r < world; ++r) {
      if constexpr (Bf16) s = kernels::round_bf16(s + kernels::round_bf16(all[std::size_t(r) * n + i]));
      else s += all[std::size_t(r) * n + i];
    }
    out[i] = s;
  }
}
inline unsigned elementwise_blocks(std::size_t n) { return unsigned(std::min<std::size_t>((n + 255) / 256, 8192)); }

struct StreamDeleter {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};
struct CudaEventDeleter {
  void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
};
using CudaEvent = std::unique_ptr<CUevent_st, CudaEventDeleter>;
inline CudaEvent make_event() {
  cudaEvent_t e = nullptr;
  FUSEDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return CudaEvent(e);
}
}  // namespace parallel::detail

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
  using plan = parallel::BucketPlan<Net, policy::bucket_bytes, sizeof(float)>;
  static constexpr bool sharded = std::is_same_v<typename policy::scatter_policy, scatter::Sharded>;
  static constexpr bool weighted = std::is_same_v<typename policy::scatter_policy, scatter::Weighted>;
  static constexpr parallel::detail::ReduceKind reduce_kind = policy::reduce_kind;
  /// ZeRO-1 with a plain sum: one reduce-scatter after backward instead of the bucketed all-reduce.
  static constexpr bool zero_reduce_scatter =
      reduce_kind == parallel::detail::ReduceKind::reduce_scatter && !policy::deterministic && !policy::compress;

  /// `r.count` replicas in this process on devices 0 .. r.count - 1 (r.threads_per_replica is unused).
  /// More replicas than visible devices is an error.
  explicit Parallel(Replicas r, Seed seed = {}, ParallelOptions options = {})
      : Parallel(Devices(first_devices(r.count)), seed, options) {}

  /// One replica on each of `d`'s devices, in this process, started from the same parameters (drawn
  /// from `seed`, then broadcast from the first device over NCCL).
  explicit Parallel(const Devices& d, Seed seed = {}, ParallelOptions options = {})
      : options_(options), pool_(check_devices(d.ids)) {
    world_ = d.ids.size();
    if (weighted) weights_.assign(world_, 1.0);
    std::vector<parallel::NcclCommunicator> comms = parallel::NcclCommunicator::init_all(d.ids, options.timeout);
    replicas_.reserve(world_);
    for (std::size_t i = 0; i < world_; ++i) replicas_.emplace_back(seed, d.ids[i], std::move(comms[i]), world_);
    init_zero();
    broadcast_parameters();
  }

#if FUSEDP_WITH_MPI
  /// One replica on each rank of `world` (mpirun), on device options.device or, by default, the device
  /// numbered by the rank's place among the ranks of its machine. Every rank checks that all ranks run
  /// the same network, policies, world size and options.agree_on, and that each has its device; then
  /// NCCL is bootstrapped over MPI and rank 0's parameters are broadcast.
  explicit Parallel(const MpiWorld& world, Seed seed = {}, ParallelOptions options = {})
      : options_(options), pool_(1), mpi_(std::in_place, world, options.timeout) {
    world_ = std::size_t(world.size());
    rank_ = world.rank();
    if (weighted) weights_.assign(world_, 1.0);
    handshake();
    const int device = agree_on_devices(world);
    replicas_.emplace_back(seed, device, parallel::NcclCommunicator::from_mpi(world, device, options.timeout), world_);
    init_zero();
    broadcast_parameters();
  }
#endif

  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;
  /// Waits for queued collectives (unless their communicator was aborted) before memory is freed.
  ~Parallel() {
    for (auto& rep : replicas_)
      if (rep.comm.valid()) (void)cudaStreamSynchronize(rep.comm_stream.get());
  }

  /// Replicas taking part in all (ranks times local replicas).
  [[nodiscard]] std::size_t world_size() const noexcept { return world_; }
  /// This process's rank (0 without MPI).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == 0; }
  /// Replicas in this process.
  [[nodiscard]] std::size_t local_replicas() const noexcept { return replicas_.size(); }
  /// Replica `i` of this process (its parameters and gradients are device memory; see cuda_model.hpp).
  [[nodiscard]] model_type& model(std::size_t i = 0) { return replicas_.at(i).model; }
  [[nodiscard]] const model_type& model(std::size_t i = 0) const { return replicas_.at(i).model; }
  /// ZeRO-1 (ReduceScatter): the block of the flat buffer that replica `global` (its rank) owns and
  /// updates; the whole buffer for the other policies' single replica.
  [[nodiscard]] parallel::Shard zero_block(std::size_t global) const noexcept {
    return {global * shard_, shard_ + (global + 1 == world_ ? tail_ : 0)};
  }
  /// ZeRO-1: the optimizer state of local replica `i`'s block (state_slots x its block), on its device.
  [[nodiscard]] std::span<const float> zero_optimizer_state(std::size_t i = 0) const {
    return replicas_.at(i).zero_state.span();
  }

  /// The NCCL communicator of local replica `i`.
  [[nodiscard]] parallel::NcclCommunicator& communicator(std::size_t i = 0) { return replicas_.at(i).comm; }

  /// Run-time weights of scatter::Weighted, one per replica (world_size()).
  void set_weights(std::span<const double> weights) {
    static_assert(weighted, "fusedp::Parallel::set_weights: only scatter::Weighted takes weights");
    weights_ = parallel::detail::checked_weights(weights, world_);
  }

  /// One data-parallel step (host inputs, as on Host: the global batch with Even or Weighted, this
  /// process's own data with Sharded). Returns the mean loss over the global batch once the update
  /// has run on every local replica. A collective that does not finish within options.timeout aborts
  /// the communicator and throws DeviceError naming the rank.
  template <class Loss, class Opt>
  float train_step(std::span<const float> inputs, std::span<const typename Loss::template target<float>> targets,
                   const Loss& loss, Opt& opt) {
    opt.validate();
    const std::size_t in = model_type::input_size;
    const std::size_t batch = parallel::detail::checked_batch<model_type, Loss>(inputs, targets);
    const std::vector<parallel::Shard> shards = local_shards(batch);
    std::size_t local = 0;
    for (const auto& sh : shards) local += sh.count;
    const std::size_t global = global_count(local, batch);
    const std::size_t per_target = targets.size() / batch;

    std::vector<float> losses(replicas_.size());
    auto run = [&](std::size_t r) {
      Replica& rep = replicas_[r];
      const parallel::Shard& s = shards[r];
      rep.model.space().activate();
      // Average: this shard's gradient becomes its share of the mean over the global batch.
      rep.factor = policy::sum || s.count == global ? 1.0f : float(double(s.count) / double(global));
      rep.launched.fill(false);
      losses[r] = rep.model.compute_gradients(inputs.subspan(s.offset * in, s.count * in),
                                              targets.subspan(s.offset * per_target, s.count * per_target), loss,
                                              [&](std::size_t stage) { stage_done(rep, stage); });
      if constexpr (zero_reduce_scatter) {
        launch_reduce_scatter(rep);
      } else {
        for (std::size_t b = 0; b < plan::count; ++b)
          if (!rep.launched[b]) launch_bucket(rep, b);
      }
      finish(rep, global_index(r), opt);
    };
    if (replicas_.size() == 1) run(0);
    else pool_.run_on_all([&](int r) { run(std::size_t(r)); });

    double weighted_loss = 0;
    for (std::size_t r = 0; r < replicas_.size(); ++r) weighted_loss += double(losses[r]) * double(shards[r].count);
#if FUSEDP_WITH_MPI
    if (mpi_) mpi_->all_reduce_sum(&weighted_loss, 1);
#endif
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
#if FUSEDP_WITH_MPI
    if (mpi_) return parallel::detail::sum_over(*mpi_, local);
#endif
    return local;
  }

  /// The smallest of every rank's `local` (steps per epoch), so no rank waits for one out of data.
  [[nodiscard]] std::size_t agree_steps(std::size_t local) const {
#if FUSEDP_WITH_MPI
    if (mpi_) return parallel::detail::min_over(*mpi_, world_, local);
#endif
    return local;
  }

 private:
  // The largest bucket, in elements (Deterministic gathers one bucket of every rank at a time).
  static constexpr std::size_t largest_bucket = [] {
    std::size_t most = 0;
    for (const auto& b : plan::buckets) most = std::max(most, b.end - b.begin);
    return most;
  }();

  struct Replica {
    model_type model;
    parallel::NcclCommunicator comm;
    std::unique_ptr<CUstream_st, parallel::detail::StreamDeleter> comm_stream;
    std::array<parallel::detail::CudaEvent, plan::count> ready;  // bucket b's gradients are final
    parallel::detail::CudaEvent reduced;                         // the collectives queued so far are done
    parallel::detail::CudaEvent stepped;                         // the root's update is done
    DeviceBuffer<float> gathered;                                // Deterministic: world x largest bucket
    DeviceBuffer<std::uint16_t> packed;                          // Compress: largest bucket in bf16
    DeviceBuffer<float> zero_state;                              // ZeRO-1: state_slots x own block
    const char* zero_owner = nullptr;                            // the optimizer zero_state belongs to
    std::uint64_t zero_steps = 0;                                // updates applied with zero_state
    std::array<bool, plan::count> launched{};
    float factor = 1;

    Replica(Seed seed, int device, parallel::NcclCommunicator c, std::size_t world)
        : model(seed, space_type{device}), comm(std::move(c)) {
      model.space().activate();
      // The collectives get the highest priority, so a bucket's reduction is not queued behind the
      // rest of backward.
      int least = 0, greatest = 0;
      FUSEDP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      cudaStream_t s = nullptr;
      FUSEDP_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
      comm_stream.reset(s);
      for (auto& e : ready) e = parallel::detail::make_event();
      reduced = parallel::detail::make_event();
      stepped = parallel::detail::make_event();
      if constexpr (policy::deterministic) gathered = DeviceBuffer<float>(world * largest_bucket);
      if constexpr (policy::compress && !policy::deterministic) packed = DeviceBuffer<std::uint16_t>(largest_bucket);
    }
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
  void handshake() {
    const std::array<std::uint64_t, 7> mine{0x66757365647031ull /* "fusedp1" */,
                                            FUSEDP_VERSION_MAJOR * 10000ull + FUSEDP_VERSION_MINOR * 100ull,
                                            Net::fingerprint,
                                            Net::param_count,
                                            policy::hash ^ (std::uint64_t(P::name[0]) << 56),  // and the precision
                                            world_,
                                            options_.agree_on};
    static constexpr const char* what[] = {"library",     "library version", "network fingerprint", "parameter count",
                                           "policy hash", "world size",      "agree_on value"};
    std::vector<std::uint64_t> all(mine.size() * world_);
    mpi_->all_gather_or_abort(mine.data(), all.data(), mine.size(), options_.timeout, "Parallel start-up check");
    std::ostringstream diff;
    for (std::size_t r = 1; r < world_; ++r)
      for (std::size_t k = 0; k < mine.size(); ++k)
        if (all[r * mine.size() + k] != all[k])
          diff << "\n  rank " << r << " has " << what[k] << " " << all[r * mine.size() + k] << ", rank 0 has " << all[k];
    if (!diff.str().empty())
      throw InvalidArgument("Parallel: the ranks were not started with the same network and settings:" + diff.str());
  }

  // This rank's device; every rank learns whether every rank has one, so all fail together.
  int agree_on_devices(const MpiWorld& world) {
    const int count = cuda_device_count();
    const int device = options_.device >= 0 ? options_.device : world.local_rank();
    const std::array<std::uint64_t, 2> mine{std::uint64_t(device), std::uint64_t(count)};
    std::vector<std::uint64_t> all(2 * world_);
    mpi_->all_gather_or_abort(mine.data(), all.data(), 2, options_.timeout, "Parallel device check");
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

  // Rank 0's parameters (local replica 0, or MPI rank 0) on every replica, before the first step.
  void broadcast_parameters() {
    {
      parallel::NcclGroup group(rank_);
      for (auto& rep : replicas_)
        rep.comm.broadcast(rep.model.params().data(), Net::param_storage, 0, rep.comm_stream.get());
      group.end();
    }
    for (auto& rep : replicas_) {
      rep.comm.wait_ready("ncclBroadcast of the parameters");
      rep.comm.wait(rep.comm_stream.get(), "Parallel start-up: the broadcast of rank 0's parameters");
    }
  }

  std::vector<parallel::Shard> local_shards(std::size_t batch) const {
    return parallel::detail::process_shards(sharded, weighted, batch, replicas_.size(), world_, weights_,
                                            mpi_ ? rank_ : -1);
  }

  std::size_t global_count(std::size_t local, std::size_t batch) const {
    if (!sharded) return batch;
#if FUSEDP_WITH_MPI
    if (mpi_) {
      std::uint64_t n = local;
      mpi_->all_reduce_sum(&n, 1);
      return std::size_t(n);
    }
#endif
    return local;
  }

  std::size_t global_index(std::size_t local) const { return mpi_ ? std::size_t(rank_) : local; }

  void init_zero() {
    shard_ = Net::param_storage / (world_ * align_elements_count) * align_elements_count;
    tail_ = Net::param_storage - world_ * shard_;
  }

  void stage_done([[maybe_unused]] Replica& rep, [[maybe_unused]] std::size_t stage) {
    if constexpr (policy::overlap && !zero_reduce_scatter) {
      for (std::size_t b = 0; b < plan::count; ++b)
        if (plan::buckets[b].ready_after == stage && !rep.launched[b]) launch_bucket(rep, b);
    }
  }

  // Queues bucket b's reduction on the communication stream, after the kernels queued so far on the
  // model's stream (which include every kernel writing the bucket).
  void launch_bucket(Replica& rep, std::size_t b) {
    const parallel::GradientBucket& bucket = plan::buckets[b];
    float* g = rep.model.grads().data() + bucket.begin;
    const std::size_t n = bucket.end - bucket.begin;
    cudaStream_t ms = rep.model.space().stream(), cs = rep.comm_stream.get();
    if (rep.factor != 1.0f) {
      parallel::detail::scale_kernel<><<<parallel::detail::elementwise_blocks(n), 256, 0, ms>>>(g, n, rep.factor);
      FUSEDP_CUDA_CHECK_LAUNCH("scale_kernel (Parallel: a shard's share of the global mean)");
    }
    FUSEDP_CUDA_CHECK(cudaEventRecord(rep.ready[b].get(), ms));
    FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(cs, rep.ready[b].get(), 0));
    if constexpr (policy::deterministic) {
      rep.comm.all_gather(g, rep.gathered.data(), n, cs);
      parallel::detail::sum_in_rank_order_kernel<policy::compress><<<parallel::detail::elementwise_blocks(n), 256, 0, cs>>>(
          rep.gathered.data(), g, n, int(world_));
      FUSEDP_CUDA_CHECK_LAUNCH("sum_in_rank_order_kernel (Parallel: Deterministic)");
    } else if constexpr (policy::compress) {
      kernels::cuda::pack_bf16(cs, g, rep.packed.data(), n);
      rep.comm.all_reduce_sum_bf16(rep.packed.data(), n, cs);
      kernels::cuda::unpack_bf16(cs, rep.packed.data(), g, n);
    } else if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast) {
      rep.comm.reduce_sum(g, n, 0, cs);
    } else {
      rep.comm.all_reduce_sum(g, n, cs);
    }
    rep.launched[b] = true;
  }

  // ZeRO-1 without Deterministic or Compress: after backward, the shard's scale, then one reduce-scatter
  // in place (block rank() of the sum lands in this rank's block) and the remainder all-reduced.
  void launch_reduce_scatter(Replica& rep) {
    float* g = rep.model.grads().data();
    cudaStream_t ms = rep.model.space().stream(), cs = rep.comm_stream.get();
    if (rep.factor != 1.0f) {
      parallel::detail::scale_kernel<><<<parallel::detail::elementwise_blocks(Net::param_storage), 256, 0, ms>>>(
          g, Net::param_storage, rep.factor);
      FUSEDP_CUDA_CHECK_LAUNCH("scale_kernel (Parallel: a shard's share of the global mean)");
    }
    FUSEDP_CUDA_CHECK(cudaEventRecord(rep.ready[0].get(), ms));
    FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(cs, rep.ready[0].get(), 0));
    if (shard_ > 0) rep.comm.reduce_scatter_sum_in_place(g, shard_, cs);
    if (tail_ > 0) rep.comm.all_reduce_sum(g + world_ * shard_, tail_, cs);
  }

  // A guarded optimizer's decision, the same on every rank: each replica measures its part of the
  // reduced gradient on the communication stream (its ZeRO block, so the parts cover the whole once;
  // with ReduceBroadcast the root measures the whole sum it holds), the parts are combined with NCCL
  // (a sum of the squares, the smallest first index), and the 16-byte result is read once.
  template <class Opt>
  double decide(Replica& rep, std::size_t global, const Opt& opt) {
    cudaStream_t cs = rep.comm_stream.get();
    kernels::cuda::GradientStatsBuffer& stats = rep.model.stats_buffer();
    parallel::Shard part = zero_block(global);
    if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast)
      part = global == 0 ? parallel::Shard{0, Net::param_storage} : parallel::Shard{0, 0};
    stats.enqueue(cs, rep.model.grads().data() + part.offset, part.count, part.offset);
    if (world_ > 1) {
      rep.comm.all_reduce_sum(&stats.result()->sum_squares, 1, cs);
      rep.comm.all_reduce_min(&stats.result()->first_nonfinite, 1, cs);
    }
    stats.copy_to_host(cs);
    rep.comm.wait(cs, "Parallel::train_step (the guard's gradient statistics)");
    const kernels::cuda::DeviceGradientStats s = stats.host();
    return opt.decide(kernels::host::GradientStats{s.sum_squares, s.finite()}, rep.model.steps() + 1,
                      model_type::nonfinite_tensor_name(s.first_nonfinite));
  }

  // After the last bucket: the update waits for the reductions (and a guarded optimizer decides on
  // them); ReduceBroadcast steps on the root and broadcasts its parameters; ReduceScatter updates this
  // rank's block and all-gathers. Then waits for it all, polling NCCL (see NcclCommunicator::wait).
  template <class Opt>
  void finish(Replica& rep, std::size_t global, Opt& opt) {
    cudaStream_t ms = rep.model.space().stream(), cs = rep.comm_stream.get();
    double factor = 1.0;
    if constexpr (requires { typename Opt::on_nonfinite; }) factor = decide(rep, global, opt);
    FUSEDP_CUDA_CHECK(cudaEventRecord(rep.reduced.get(), cs));
    FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(ms, rep.reduced.get(), 0));
    if constexpr (reduce_kind == parallel::detail::ReduceKind::all_reduce) {
      (void)rep.model.apply_step(opt, factor);
    } else if constexpr (reduce_kind == parallel::detail::ReduceKind::reduce_broadcast) {
      // Only the root holds the summed gradient and the optimizer state.
      if (global == 0) (void)rep.model.apply_step(opt, factor);
      else rep.model.set_step_counters(rep.model.steps() + 1, rep.model.optimizer_steps() + (factor != 0.0 ? 1 : 0));
      FUSEDP_CUDA_CHECK(cudaEventRecord(rep.stepped.get(), ms));
      FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(cs, rep.stepped.get(), 0));
      rep.comm.broadcast(rep.model.params().data(), Net::param_storage, 0, cs);
      FUSEDP_CUDA_CHECK(cudaEventRecord(rep.reduced.get(), cs));
      FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(ms, rep.reduced.get(), 0));
    } else {
      zero_update(rep, global, opt, factor);
    }
    rep.comm.wait(ms, "Parallel::train_step (gradient reduction and update)");
  }

  // ZeRO-1: this replica updates its block with the optimizer state of that block only, then the
  // blocks are all-gathered in place. A skipped step (factor 0) changes neither.
  template <class Opt>
  void zero_update(Replica& rep, std::size_t global, Opt& opt, double factor) {
    cudaStream_t ms = rep.model.space().stream(), cs = rep.comm_stream.get();
    const parallel::Shard block = zero_block(global);
    if (rep.zero_owner == nullptr || std::strcmp(rep.zero_owner, Opt::name) != 0) {
      rep.model.space().synchronize();  // nothing in flight may use the state that is freed
      rep.zero_state = DeviceBuffer<float>(Opt::state_slots * block.count);
      rep.zero_owner = Opt::name;
      rep.zero_steps = 0;
    }
    if (factor == 0.0) {
      (void)rep.model.apply_step(opt, 0.0);  // counts the skipped step
      rep.model.set_step_counters(rep.model.steps(), rep.zero_steps);
      return;
    }
    ++rep.zero_steps;
    float* p = rep.model.params().data() + block.offset;
    float* g = rep.model.grads().data() + block.offset;
    if (factor != 1.0) kernels::cuda::scale_gradient(ms, g, block.count, float(factor));
    opt.step(rep.model.space(), p, g, rep.zero_state.data(), block.count, rep.zero_steps);
    FUSEDP_CUDA_CHECK(cudaEventRecord(rep.stepped.get(), ms));
    FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(cs, rep.stepped.get(), 0));
    float* all = rep.model.params().data();
    if (shard_ > 0) rep.comm.all_gather_in_place(all, shard_, cs);
    if (tail_ > 0) rep.comm.broadcast(all + world_ * shard_, tail_, int(world_) - 1, cs);
    FUSEDP_CUDA_CHECK(cudaEventRecord(rep.reduced.get(), cs));
    FUSEDP_CUDA_CHECK(cudaStreamWaitEvent(ms, rep.reduced.get(), 0));
    rep.model.set_step_counters(rep.model.steps() + 1, rep.zero_steps);
  }

  ParallelOptions options_;
  Host pool_;  // one thread per local replica
  std::vector<Replica> replicas_;
  std::size_t world_ = 1;
  int rank_ = 0;
  std::size_t shard_ = 0;  // ZeRO-1: elements of each rank's block, the last rank's remainder aside
  std::size_t tail_ = 0;   // ZeRO-1: the remainder, owned by the last rank
  std::vector<double> weights_;
#if FUSEDP_WITH_MPI
  std::optional<parallel::MpiCommunicator> mpi_;
#else
  std::optional<int> mpi_;  // never engaged without MPI
#endif
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA && FUSEDP_HAS_NCCL
