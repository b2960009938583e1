#pragma once
// Policies of Parallel<>: empty tags in any order, each category with a default, resolved in one place.
// A duplicate, an unknown tag or a tag the space cannot run is a static_assert naming the category.
#include "fusedp/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace fusedp {

/// How a batch reaches the replicas.
namespace scatter {
/// The caller passes the global batch; replica r takes an even contiguous slice (the default).
struct Even {};
/// The caller passes the global batch; replica r takes a slice proportional to its run-time weight.
struct Weighted {};
/// Each replica or rank reads its own shard (a DistributedSampler); nothing is scattered.
struct Sharded {};
}  // namespace scatter

/// How gradients are combined. Knobs may be given inside (AllReduce<Bucket<1 << 20>, Overlap>) or
/// beside it in Parallel's list.
namespace reduce {
/// Every replica receives the summed gradient and applies the same update (the default).
template <class... Knobs>
struct AllReduce {};
/// Gradients are summed on the root, which steps and broadcasts the parameters (classic DataParallel).
template <class... Knobs>
struct ReduceBroadcast {};
/// ZeRO-1: replica r receives the sum of its slice of the gradient, keeps the optimizer state of that
/// slice only, updates it, and the parameters are all-gathered.
template <class... Knobs>
struct ReduceScatter {};
}  // namespace reduce

/// Which library moves the bytes; Auto picks by space and process model.
namespace comm {
struct Auto {};
struct InProcess {};
struct Mpi {};
struct Nccl {};
}  // namespace comm

/// Gradients are reduced in buckets of at most Bytes, in reverse layer order (a tensor larger than a
/// bucket is a bucket of its own). Without it the whole gradient is one bucket.
template <std::size_t Bytes>
struct Bucket {
  static_assert(Bytes > 0, "fusedp::Bucket<Bytes>: Bytes must be positive");
  static constexpr std::size_t bytes = Bytes;
};
/// Each bucket is reduced as soon as backward has finished it, while backward goes on.
struct Overlap {};
/// The bfloat16 format for Compress.
struct bf16 {};
/// Gradients travel (and are summed) in a narrower format.
template <class Format>
struct Compress {
  static_assert(std::is_same_v<Format, bf16>, "fusedp::Compress<Format>: only Compress<bf16> exists");
};
/// The reduced gradient is the gradient of the mean loss over the global batch (the default).
struct Average {};
/// The reduced gradient is the sum of each replica's mean-loss gradient.
struct Sum {};
/// Gradients are summed in rank order, so results do not depend on timing or on the reduction
/// algorithm of the communicator.
struct Deterministic {};

/// How replicas treat BatchNorm's statistics (category batch_norm; a network with BatchNorm must name
/// one).
namespace batch_norm {
/// Each replica normalizes with the statistics of its own shard (DDP without SyncBatchNorm); after
/// every step rank 0's running statistics are copied to every replica (DDP's default,
/// broadcast_buffers=True), so every replica evaluates and saves the same statistics.
struct Broadcast {};
/// SyncBatchNorm: every BatchNorm layer takes its batch statistics (forward: per-channel sums and
/// squared deviations; backward: the sums of dz and dz xhat) over every replica's shard, added through
/// the communicator (in-process, MPI, NCCL), so N replicas compute what one model computes on the
/// global batch, and hold the same running statistics without a broadcast. Costs three small
/// collectives per layer and step.
struct Sync {};
}  // namespace batch_norm

namespace parallel::detail {

template <class... Ts>
struct list {};

template <class T>
struct is_norm : std::bool_constant<std::is_same_v<T, batch_norm::Broadcast> || std::is_same_v<T, batch_norm::Sync>> {};

template <class T>
struct is_scatter : std::bool_constant<std::is_same_v<T, scatter::Even> || std::is_same_v<T, scatter::Weighted> ||
                                       std::is_same_v<T, scatter::Sharded>> {};
template <class T>
struct is_comm : std::bool_constant<std::is_same_v<T, comm::Auto> || std::is_same_v<T, comm::InProcess> ||
                                    std::is_same_v<T, comm::Mpi> || std::is_same_v<T, comm::Nccl>> {};

enum class ReduceKind { all_reduce, reduce_broadcast, reduce_scatter };
template <class T>
struct reduce_of {
  static constexpr bool value = false;
};
template <class... K>
struct reduce_of<reduce::AllReduce<K...>> {
  static constexpr bool value = true;
  static constexpr ReduceKind kind = ReduceKind::all_reduce;
  using knobs = list<K...>;
};
template <class... K>
struct reduce_of<reduce::ReduceBroadcast<K...>> {
  static constexpr bool value = true;
  static constexpr ReduceKind kind = ReduceKind::reduce_broadcast;
  using knobs = list<K...>;
};
template <class... K>
struct reduce_of<reduce::ReduceScatter<K...>> {
  static constexpr bool value = true;
  static constexpr ReduceKind kind = ReduceKind::reduce_scatter;
  using knobs = list<K...>;
};

template <class T>
struct bucket_of : std::false_type {};
template <std::size_t B>
struct bucket_of<Bucket<B>> : std::true_type {
  static constexpr std::size_t bytes = B;
};
template <class T>
struct compress_of : std::false_type {};
template <class F>
struct compress_of<Compress<F>> : std::true_type {};

template <class T>
constexpr bool is_knob = bucket_of<T>::value || compress_of<T>::value || std::is_same_v<T, Overlap> ||
                         std::is_same_v<T, Average> || std::is_same_v<T, Sum> ||
                         std::is_same_v<T, Deterministic>;

// The reduce policy's own knobs join the top-level list.
template <class Out, class... P>
struct flatten_into;
template <class... O>
struct flatten_into<list<O...>> {
  using type = list<O...>;
};
template <class... O, class P, class... Ps>
struct flatten_into<list<O...>, P, Ps...> {
  template <class R, bool IsReduce = reduce_of<R>::value>
  struct expand {
    using type = list<R>;
  };
  template <class R>
  struct expand<R, true> {
    template <class K>
    struct with;
    template <class... K>
    struct with<list<K...>> {
      using type = list<R, K...>;
    };
    using type = typename with<typename reduce_of<R>::knobs>::type;
  };
  template <class A, class B>
  struct cat;
  template <class... A, class... B>
  struct cat<list<A...>, list<B...>> {
    using type = list<A..., B...>;
  };
  using type = typename flatten_into<typename cat<list<O...>, typename expand<P>::type>::type, Ps...>::type;
};

template <template <class> class Pred, class... P>
constexpr std::size_t count_if(list<P...>) {
  return (std::size_t(0) + ... + std::size_t(Pred<P>::value));
}
template <class T>
struct is_reduce : std::bool_constant<reduce_of<T>::value> {};
template <class T>
struct is_overlap : std::is_same<T, Overlap> {};
template <class T>
struct is_scaling : std::bool_constant<std::is_same_v<T, Average> || std::is_same_v<T, Sum>> {};
template <class T>
struct is_deterministic : std::is_same<T, Deterministic> {};
template <class T>
struct is_known : std::bool_constant<is_scatter<T>::value || is_comm<T>::value || reduce_of<T>::value || is_knob<T> ||
                                     is_norm<T>::value> {};

template <template <class> class Pred, class Default, class L>
struct pick;
template <template <class> class Pred, class Default>
struct pick<Pred, Default, list<>> {
  using type = Default;
};
template <template <class> class Pred, class Default, class P, class... Ps>
struct pick<Pred, Default, list<P, Ps...>> {
  using type = std::conditional_t<Pred<P>::value, P, typename pick<Pred, Default, list<Ps...>>::type>;
};

template <class Space>
constexpr bool is_device_space() {
  return std::string_view(Space::name) == "Cuda";
}

}  // namespace parallel::detail

namespace parallel {

/// The resolved policy set of a Parallel<Net, Space, Policies...>.
template <class Space, class... Policies>
struct Policy {
  using all = typename detail::flatten_into<detail::list<>, Policies...>::type;
  static constexpr bool all_known = [] {
    return []<class... P>(detail::list<P...>) { return (true && ... && detail::is_known<P>::value); }(all{});
  }();
  static_assert(all_known,
                "fusedp::Parallel: a policy is not one of scatter::{Even, Weighted, Sharded}, "
                "reduce::{AllReduce, ReduceBroadcast, ReduceScatter}<...>, comm::{Auto, InProcess, Mpi, Nccl}, "
                "Bucket<bytes>, Overlap, Compress<bf16>, Average, Sum, Deterministic, batch_norm::{Broadcast, Sync}");
  static_assert(detail::count_if<detail::is_scatter>(all{}) <= 1,
                "fusedp::Parallel: more than one scatter policy (category scatter: Even, Weighted, Sharded)");
  static_assert(detail::count_if<detail::is_reduce>(all{}) <= 1,
                "fusedp::Parallel: more than one reduce policy (category reduce: AllReduce, ReduceBroadcast, "
                "ReduceScatter)");
  static_assert(detail::count_if<detail::is_comm>(all{}) <= 1,
                "fusedp::Parallel: more than one communicator (category comm: Auto, InProcess, Mpi, Nccl)");
  static_assert(detail::count_if<detail::bucket_of>(all{}) <= 1, "fusedp::Parallel: more than one Bucket<bytes> (category bucket)");
  static_assert(detail::count_if<detail::is_overlap>(all{}) <= 1, "fusedp::Parallel: Overlap given twice");
  static_assert(detail::count_if<detail::compress_of>(all{}) <= 1, "fusedp::Parallel: more than one Compress<>");
  static_assert(detail::count_if<detail::is_scaling>(all{}) <= 1,
                "fusedp::Parallel: more than one scaling policy (category scaling: Average, Sum)");
  static_assert(detail::count_if<detail::is_deterministic>(all{}) <= 1,
                "fusedp::Parallel: Deterministic given twice");
  static_assert(detail::count_if<detail::is_norm>(all{}) <= 1,
                "fusedp::Parallel: more than one batch_norm policy (category batch_norm: Broadcast, Sync)");

  using scatter_policy = typename detail::pick<detail::is_scatter, scatter::Even, all>::type;
  using reduce_policy = typename detail::pick<detail::is_reduce, reduce::AllReduce<>, all>::type;
  using comm_policy = typename detail::pick<detail::is_comm, comm::Auto, all>::type;
  using bucket_policy = typename detail::pick<detail::bucket_of, void, all>::type;

  static constexpr detail::ReduceKind reduce_kind = detail::reduce_of<reduce_policy>::kind;
  static constexpr bool bucketed = !std::is_void_v<bucket_policy>;
  static constexpr std::size_t bucket_bytes = [] {
    if constexpr (bucketed) return bucket_policy::bytes;
    else return std::size_t(0);
  }();
  static constexpr bool overlap = detail::count_if<detail::is_overlap>(all{}) == 1;
  static constexpr bool compress = detail::count_if<detail::compress_of>(all{}) == 1;
  using scaling_policy = typename detail::pick<detail::is_scaling, Average, all>::type;
  static constexpr bool sum = std::is_same_v<scaling_policy, Sum>;
  static constexpr bool deterministic = detail::count_if<detail::is_deterministic>(all{}) == 1;
  using norm_policy = typename detail::pick<detail::is_norm, void, all>::type;
  static constexpr bool broadcast_buffers = std::is_same_v<norm_policy, batch_norm::Broadcast>;
  static constexpr bool sync_batch_norm = std::is_same_v<norm_policy, batch_norm::Sync>;

  static_assert(!std::is_same_v<comm_policy, comm::Nccl> || detail::is_device_space<Space>(),
                "fusedp::Parallel: comm::Nccl needs the Cuda space (category comm); Host uses InProcess or Mpi");
  static_assert(!detail::is_device_space<Space>() || std::is_same_v<comm_policy, comm::Auto> ||
                    std::is_same_v<comm_policy, comm::Nccl>,
                "fusedp::Parallel: on the Cuda space gradients move through NCCL (category comm: Auto or Nccl)");

  /// A number that differs when the policies differ: ranks compare it at start-up.
  static constexpr std::uint64_t hash = std::uint64_t(reduce_kind) | std::uint64_t(overlap) << 4 |
                                        std::uint64_t(compress) << 5 | std::uint64_t(sum) << 6 |
                                        std::uint64_t(deterministic) << 7 |
                                        std::uint64_t(std::is_same_v<scatter_policy, scatter::Weighted>) << 8 |
                                        std::uint64_t(std::is_same_v<scatter_policy, scatter::Sharded>) << 9 |
                                        std::uint64_t(broadcast_buffers) << 10 |
                                        std::uint64_t(sync_batch_norm) << 11 |
                                        std::uint64_t(bucket_bytes) << 16;
};

/// Whether policy set P fits network Net: a network with running statistics (BatchNorm) needs a
/// batch_norm policy, so that replicas do not silently evaluate and save different statistics.
template <class Net, class P>
constexpr bool fits_network() {
  static_assert(Net::state_storage == 0 || P::broadcast_buffers || P::sync_batch_norm,
                "fusedp::Parallel: the network holds BatchNorm running statistics, which each replica would "
                "update from its own shard: name how replicas keep them (category batch_norm): "
                "batch_norm::Sync (SyncBatchNorm: statistics over every replica's shard, what one model "
                "computes on the global batch) or batch_norm::Broadcast (each shard's own statistics, rank "
                "0's running statistics copied to every replica after each step, as DDP's "
                "broadcast_buffers)");
  return true;
}

}  // namespace parallel
}  // namespace fusedp
