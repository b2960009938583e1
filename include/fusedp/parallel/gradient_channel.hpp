#pragma once
// GradientChannel: a communicator as the bucket reducer (parallel/reducer.hpp) sees it, bound to the
// memory one replica's gradient lives in. The collectives come from the communicator (in-process, MPI
// or NCCL); the elementwise steps around them (the rank-order sum of gathered values, packing to
// bfloat16) run where the memory is; the channel owns the scratch they need, sized once.
//
//   HostChannel<C>  C = InProcessCommunicator or MpiCommunicator; host memory, host loops
//   NcclChannel     NcclCommunicator on a communication stream; device memory, Cuda kernels
//                   (parallel/nccl_channel.hpp)
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/exec/trace.hpp"
#include "fusedp/kernels/rank_order_sum.hpp"
#include "fusedp/parallel/shards.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if FUSEDP_WITH_MPI
#include "fusedp/parallel/mpi.hpp"
#endif

namespace fusedp::parallel {

/// What the bucket reducer needs. Every collective is called by every replica of the world with the
/// same sizes, on this replica's own buffers.
///   before_reduction()          orders what follows after the work that wrote the gradient
///   all_reduce_sum(g, n)        sum in place on every replica
///   start_all_reduce_sum(g, n, b) the same for bucket b, possibly still running when it returns (then
///                               true): finish_started() waits; progress() moves started ones on
///   timed_on_host               whether the host clock times the channel's work (exec/trace.hpp: a
///                               reduction is traced where it is)
///   reduction_span(b, bytes)    a span of the reduction queued from now until it ends, where the
///                               channel times its own work (NCCL: CUDA events); host channels'
///                               reductions are timed by the reducer (trace::blocking_reduction)
///   all_reduce_sum_bf16(h, n)   sum of bfloat16 values in place
///   reduce_sum(g, n, root)      sum into root's g only
///   all_gather(g, all, n)       every replica's n values, in rank order, into all (size() x n)
///   reduce_scatter_sum(g, z)    ZeRO-1: the sum of replica r's block into replica r's block
///   gathered(n), packed(n)      scratch for n floats / n bfloat16 values (valid until the next call)
///   sum_in_rank_order<Bf16>(all, out, n), pack_bf16(g, h, n), unpack_bf16(h, g, n): elementwise,
///                               where the memory is (kernels/rank_order_sum.hpp's math)
template <class C>
concept GradientChannel = requires(C& c, float* g, const float* cg, std::uint16_t* h, const std::uint16_t* ch,
                                   std::size_t n, const ZeroLayout& z) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.before_reduction();
  c.all_reduce_sum(g, n);
  { c.start_all_reduce_sum(g, n, n) } -> std::convertible_to<bool>;
  c.progress();
  c.finish_started();
  { C::timed_on_host } -> std::convertible_to<bool>;
  c.reduction_span(std::int64_t(0), std::uint64_t(0));
  c.all_reduce_sum_bf16(h, n);
  c.reduce_sum(g, n, 0);
  c.all_gather(cg, g, n);
  c.reduce_scatter_sum(g, z);
  { c.gathered(n) } -> std::same_as<float*>;
  { c.packed(n) } -> std::same_as<std::uint16_t*>;
  c.template sum_in_rank_order<false>(cg, g, n);
  c.template sum_in_rank_order<true>(cg, g, n);
  c.pack_bf16(cg, h, n);
  c.unpack_bf16(ch, g, n);
};

namespace detail {
template <class C>
inline constexpr bool is_mpi_communicator = false;
#if FUSEDP_WITH_MPI
template <>
inline constexpr bool is_mpi_communicator<MpiCommunicator> = true;
using MpiRequest = MPI_Request;
#else
using MpiRequest = int;  // no MPI: never used
#endif
}  // namespace detail

/// A host-memory communicator (InProcessCommunicator, MpiCommunicator) as a GradientChannel. MPI's
/// ZeRO-1 collectives take counts and displacements; the in-process ones the layout itself.
template <class C>
class HostChannel {
  static constexpr bool mpi = detail::is_mpi_communicator<C>;

 public:
  explicit HostChannel(C comm) : comm_(std::move(comm)) {}

  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  [[nodiscard]] int size() const noexcept { return comm_.size(); }
  /// The communicator itself, for the scalar collectives of a step (loss, counts, guard statistics).
  [[nodiscard]] C& comm() noexcept { return comm_; }

  /// The communicator as a ReplicaSum, for SyncBatchNorm's per-channel sums (host memory, in place).
  [[nodiscard]] ReplicaSum replica_sum() noexcept {
    return {&comm_, [](void* c, double* values, std::size_t n, void*) { static_cast<C*>(c)->all_reduce_sum(values, n); }};
  }

  static constexpr bool timed_on_host = true;
  [[nodiscard]] trace::NoScope reduction_span(std::int64_t bucket, std::uint64_t) const noexcept {
    return trace::NoScope("bucket", trace::Kind::reduce, bucket);
  }

  void before_reduction() noexcept {}  // host work is done when it returns
  void all_reduce_sum(float* g, std::size_t n) { comm_.all_reduce_sum(g, n); }
  /// MPI: started (MPI_Iallreduce), true; in-process: done when it returns, false.
  bool start_all_reduce_sum(float* g, std::size_t n, std::size_t bucket) {
    if constexpr (mpi) {
      const std::size_t before = requests_.size();
      const std::int64_t now = trace::active() != nullptr ? trace::now_ns() : 0;
      {
        // The call itself may do part of the reduction on this thread: exposed time.
        const trace::Scope span("start reduction", trace::Kind::wait, std::int64_t(bucket));
        comm_.start_all_reduce_sum(g, n, requests_);
      }
      // One request per chunk of at most INT_MAX / 2 values: the bucket's bytes on the first.
      for (std::size_t i = before; i < requests_.size(); ++i)
        started_.push_back({now, std::int64_t(bucket), i == before ? std::uint64_t(n * sizeof(float)) : 0});
      return true;
    } else {
      comm_.all_reduce_sum(g, n);
      return false;
    }
  }
  /// Tests the started reductions once: Open MPI's non-blocking collectives move on only inside MPI
  /// calls, so backward calls this after each stage.
  void progress() {
    if constexpr (mpi) {
      if (requests_.empty()) return;
      // Open MPI does the reduction's work inside these tests, on this thread: exposed time.
      const trace::Scope span("progress reductions", trace::Kind::wait);
      comm_.test_all(requests_, [this](std::size_t i) { completed(i); });
    }
  }
  /// Waits for the started reductions (traced as a wait: the part of them backward did not hide).
  void finish_started() {
    if constexpr (mpi) {
      if (requests_.empty()) return;
      const trace::Scope span("started reductions", trace::Kind::wait);
      comm_.wait_all(requests_, [this](std::size_t i) { completed(i); });
      started_.clear();
    }
  }
  void all_reduce_sum_bf16(std::uint16_t* h, std::size_t n) { comm_.all_reduce_sum_bf16(h, n); }
  void reduce_sum(float* g, std::size_t n, int root) { comm_.reduce_sum(g, n, root); }
  void all_gather(const float* mine, float* all, std::size_t n) { comm_.all_gather(mine, all, n); }
  void reduce_scatter_sum(float* g, const ZeroLayout& z) {
    if constexpr (mpi) {
      set_blocks(z);
      comm_.reduce_scatter_blocks(g, counts_, displs_, gathered(z.block(std::size_t(rank())).count));
    } else {
      comm_.reduce_scatter_sum(g, z);
    }
  }
  /// ZeRO-1: every replica's block of the parameters into every replica's `p`.
  void all_gather_blocks(float* p, const ZeroLayout& z) {
    if constexpr (mpi) {
      set_blocks(z);
      comm_.all_gather_blocks(p, counts_, displs_);
    } else {
      comm_.all_gather_blocks(p, z);
    }
  }

  float* gathered(std::size_t n) {
    gathered_.reserve_discard(n);
    return gathered_.data();
  }
  std::uint16_t* packed(std::size_t n) {
    packed_.reserve_discard(n);
    return packed_.data();
  }
  template <bool Bf16>
  void sum_in_rank_order(const float* all, float* out, std::size_t n) {
    kernels::host::sum_in_rank_order<Bf16>(all, out, n, size());
  }
  void pack_bf16(const float* g, std::uint16_t* h, std::size_t n) { kernels::host::pack_bf16(g, h, n); }
  void unpack_bf16(const std::uint16_t* h, float* g, std::size_t n) { kernels::host::unpack_bf16(h, g, n); }

 private:
  void set_blocks(const ZeroLayout& z) {
    counts_.resize(z.world);
    displs_.resize(z.world);
    for (std::size_t r = 0; r < z.world; ++r) {
      counts_[r] = int(z.block(r).count);
      displs_[r] = int(z.block(r).offset);
    }
  }

  // Started reduction i was seen complete: its reduce span, from its start until now.
  void completed(std::size_t i) {
    trace::Recorder* r = trace::active();
    if (r == nullptr || i >= started_.size() || started_[i].begin_ns == 0) return;
    const Started& s = started_[i];
    r->add({"bucket", trace::Kind::reduce, trace::comm_lane + trace::current_lane(), s.begin_ns, trace::now_ns(),
            s.bucket, s.bytes});
  }
  struct Started {
    std::int64_t begin_ns;  // 0: tracing was off when it started
    std::int64_t bucket;
    std::uint64_t bytes;
  };

  C comm_;
  std::vector<Started> started_;  // per request of requests_: what it reduces, for the trace
  HostBuffer<float> gathered_;
  HostBuffer<std::uint16_t> packed_;
  std::vector<detail::MpiRequest> requests_;
  std::vector<int> counts_, displs_;
};

}  // namespace fusedp::parallel
