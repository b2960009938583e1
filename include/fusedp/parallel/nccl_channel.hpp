#pragma once
// NcclChannel: one GPU replica's NcclCommunicator as a GradientChannel (parallel/gradient_channel.hpp).
// Every collective is queued on the replica's communication stream (the device's highest priority, so
// a bucket's reduction is not queued behind the rest of backward), ordered after the work queued so
// far on the model's stream by an event; the elementwise steps are Cuda kernels on the same stream.
// Nothing waits: the caller orders the update after the channel's stream (finish_into) and polls NCCL
// while it waits (NcclCommunicator::wait). Compiled by nvcc where the build asks for NCCL.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_NCCL
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_event.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/kernels/cuda/gradient.cuh"
#include "fusedp/kernels/cuda/rank_order_sum.cuh"
#include "fusedp/parallel/nccl.hpp"
#include "fusedp/parallel/shards.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

namespace fusedp::parallel {

class NcclChannel {
 public:
  /// `comm` on the current device; `model_stream`: where the replica's gradients are written.
  NcclChannel(NcclCommunicator comm, cudaStream_t model_stream)
      : comm_(std::move(comm)),
        stream_(CudaStream::make(true)),
        model_stream_(model_stream),
        ready_(CudaEvent::make()),
        done_(CudaEvent::make()) {}

  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  [[nodiscard]] int size() const noexcept { return comm_.size(); }
  [[nodiscard]] NcclCommunicator& comm() noexcept { return comm_; }
  /// The communication stream.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }

  /// The communicator as a ReplicaSum, for SyncBatchNorm's per-channel sums: device memory written on
  /// the given stream, summed on the channel's stream in between two events, so the stream's later
  /// work sees the sum and NCCL's calls stay in this channel's order.
  [[nodiscard]] ReplicaSum replica_sum() noexcept {
    return {this, [](void* c, double* values, std::size_t n, void* stream) {
              NcclChannel& ch = *static_cast<NcclChannel*>(c);
              const cudaStream_t on = static_cast<cudaStream_t>(stream);
              order_after(ch.ready_, on, ch.stream_.get());
              ch.comm_.all_reduce_sum(values, n, ch.stream_.get());
              order_after(ch.done_, ch.stream_.get(), on);
            }};
  }

  /// NCCL's work is queued on a stream: the host clock does not time it (exec/trace.hpp).
  static constexpr bool timed_on_host = false;

  void before_reduction() { order_after(ready_, model_stream_, stream_.get()); }
  void all_reduce_sum(float* g, std::size_t n) { comm_.all_reduce_sum(g, n, stream_.get()); }
  /// Queued on the channel's stream like every call: never waits. Returns false (nothing the host
  /// clock could time is running).
  bool start_all_reduce_sum(float* g, std::size_t n, std::size_t /*bucket*/) {
    all_reduce_sum(g, n);
    return false;
  }
  void progress() noexcept {}
  void finish_started() noexcept {}
  void all_reduce_sum_bf16(std::uint16_t* h, std::size_t n) { comm_.all_reduce_sum_bf16(h, n, stream_.get()); }
  void reduce_sum(float* g, std::size_t n, int root) { comm_.reduce_sum(g, n, root, stream_.get()); }
  void all_gather(const float* mine, float* all, std::size_t n) { comm_.all_gather(mine, all, n, stream_.get()); }
  /// ZeRO-1: ncclReduceScatter in place on the world * shard elements, the remainder all-reduced.
  void reduce_scatter_sum(float* g, const ZeroLayout& z) {
    if (z.shard > 0) comm_.reduce_scatter_sum_in_place(g, z.shard, stream_.get());
    if (z.tail > 0) comm_.all_reduce_sum(g + z.world * z.shard, z.tail, stream_.get());
  }
  /// ZeRO-1: ncclAllGather in place, the remainder broadcast by the last replica.
  void all_gather_blocks(float* p, const ZeroLayout& z) {
    if (z.shard > 0) comm_.all_gather_in_place(p, z.shard, stream_.get());
    if (z.tail > 0) comm_.broadcast(p + z.world * z.shard, z.tail, int(z.world) - 1, stream_.get());
  }

  /// Scratch on the device, grown when asked for more (after the queued work that may use it).
  float* gathered(std::size_t n) { return grow(gathered_, n); }
  std::uint16_t* packed(std::size_t n) { return grow(packed_, n); }
  /// Bytes of that scratch (parallel/replica_memory.hpp predicts them).
  [[nodiscard]] std::size_t device_bytes() const noexcept { return gathered_.size_bytes() + packed_.size_bytes(); }
  template <bool Bf16>
  void sum_in_rank_order(const float* all, float* out, std::size_t n) {
    kernels::cuda::sum_in_rank_order<Bf16>(stream_.get(), all, out, n, size());
  }
  void pack_bf16(const float* g, std::uint16_t* h, std::size_t n) { kernels::cuda::pack_bf16(stream_.get(), g, h, n); }
  void unpack_bf16(const std::uint16_t* h, float* g, std::size_t n) {
    kernels::cuda::unpack_bf16(stream_.get(), h, g, n);
  }

  /// The span of a reduction queued on the channel's stream from now until it ends: GPU time, on the
  /// replica's comm lane (exec/trace.hpp).
  [[nodiscard]] trace::CudaScope reduction_span(std::int64_t bucket, std::uint64_t bytes) noexcept {
    return trace::CudaScope(stream_.get(), "bucket", trace::Kind::reduce, bucket, bytes,
                            trace::comm_lane + trace::current_lane());
  }

  /// Orders the work queued later on the model's stream after everything queued on the channel. Traced
  /// as a wait on the model's stream: the time it stands still for the reductions (exposed).
  void finish_into_model_stream() {
    const trace::CudaScope span(model_stream_, "reductions", trace::Kind::wait);
    order_after(done_, stream_.get(), model_stream_);
  }
  /// Orders later collectives after the work queued so far on the model's stream (an update).
  void after_model_stream() { order_after(ready_, model_stream_, stream_.get()); }

 private:
  template <class T>
  T* grow(DeviceBuffer<T>& b, std::size_t n) {
    if (b.size() < n) {
      // The old buffer may still be read by queued collectives: wait for them, polling NCCL, so that a
      // peer that died makes this rank throw after the timeout rather than block in a synchronize.
      comm_.wait(stream_.get(), "the channel's queued collectives, before its scratch grows");
      b = DeviceBuffer<T>(n);
    }
    return b.data();
  }

  NcclCommunicator comm_;
  CudaStream stream_;
  cudaStream_t model_stream_;
  CudaEvent ready_;  // the model's work that the next collectives wait for
  CudaEvent done_;   // the channel's work that the model's next work waits for
  DeviceBuffer<float> gathered_;
  DeviceBuffer<std::uint16_t> packed_;
};

}  // namespace fusedp::parallel
#endif  // FUSEDP_HAS_NCCL
