#pragma once
// Losses on Cuda: one thread per row (softmax cross-entropy) or per value (squared error) runs the
// function both spaces share (kernels/loss.hpp), writing the gradient and the loss in one pass; a CUB block reduction sums each block's losses
// and one more block sums those in a fixed order, so the mean loss is deterministic (cub::BlockReduce
// adds every thread's value in a fixed pattern). Including CUB costs about 2.5 s of nvcc CPU time in
// each translation unit that sees a loss header (measured with nvcc 13.0 on the 2-core CI machine). A label outside
// [0, classes) (possible only for targets already on the device; host targets are checked before any
// work) sets a flag and makes the loss NaN.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/loss.hpp"

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fusedp::kernels::cuda {

/// Rows per block of the loss kernels.
inline constexpr int loss_threads = 256;

/// Where a loss kernel leaves its results on the device.
struct LossOutput {
  float* value;        // the mean loss (one float)
  float* block_sums;   // loss_blocks(batch) floats
  int* bad_target;     // set to 1 when a label is out of range; never cleared by the kernels
  unsigned* arrivals;  // blocks done so far; zero before a launch, and the kernels leave it zero
};

/// Blocks of the loss kernels for a batch (and floats of LossOutput::block_sums).
inline int loss_blocks(std::size_t batch) { return int((batch + loss_threads - 1) / loss_threads); }

/// The device memory a model's loss kernels write (LossOutput) and its pinned host end: the loss of the
/// latest step stays on the device until read() is asked for it.
class LossResult {
 public:
  LossResult() : status_(1), value_host_(1), status_host_(1) {}
  /// Room for the block sums of batches up to `batch`.
  void allocate(std::size_t batch) {
    values_ = DeviceBuffer<float>(1 + std::size_t(loss_blocks(batch)));
    if (arrivals_.size() == 0) arrivals_ = DeviceBuffer<unsigned>(1);  // zeroed (and synchronized) by DeviceBuffer
  }
  [[nodiscard]] bool allocated() const noexcept { return values_.size() > 0; }
  /// Bytes held on the device and in pinned host memory.
  [[nodiscard]] std::size_t device_bytes() const noexcept {
    return values_.size_bytes() + status_.size_bytes() + arrivals_.size_bytes();
  }
  [[nodiscard]] std::size_t pinned_bytes() const noexcept { return value_host_.size_bytes() + status_host_.size_bytes(); }
  [[nodiscard]] LossOutput output() noexcept {
    return {values_.data(), values_.data() + 1, status_.data(), arrivals_.data()};
  }
  /// Reads the mean loss after the work queued on `stream` (waits). A label that was outside
  /// [0, classes) throws InvalidArgument naming `loss` (the flag is cleared first, so the model can go on).
  float read(cudaStream_t stream, const char* loss, std::size_t classes) {
    copy_async(value_host_.data(), values_.data(), 1, stream);
    copy_async(status_host_.data(), status_.data(), 1, stream);
    FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (status_host_[0] != 0) {
      FUSEDP_CUDA_CHECK(cudaMemsetAsync(status_.data(), 0, sizeof(int), stream));
      FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream));
      throw InvalidArgument(std::string(loss) + ": a label on the device is outside [0, " + std::to_string(classes) +
                            ") (the step ran; its loss is NaN)");
    }
    return value_host_[0];
  }

 private:
  DeviceBuffer<float> values_;  // the mean, then the block sums
  DeviceBuffer<int> status_;
  DeviceBuffer<unsigned> arrivals_;  // LossOutput::arrivals
  PinnedBuffer<float> value_host_;
  PinnedBuffer<int> status_host_;
};

namespace detail {
using LossReduce = cub::BlockReduce<float, loss_threads>;

// The end of every loss kernel: this block's sum goes to block_sums, and the last block to finish
// (counted in out.arrivals, which it sets back to zero for the next launch) adds them up in index
// order: thread t the sums t, t + loss_threads, ..., then one block reduction, the order and the bits
// of the separate one-block pass this replaces (one launch fewer per step).
__device__ inline void finish_loss(float block_sum, int blocks, float scale, const LossOutput& out,
                                   typename LossReduce::TempStorage& temp) {
  bool arrived_last = false;
  if (threadIdx.x == 0) {
    out.block_sums[blockIdx.x] = block_sum;
    __threadfence();  // the sum is visible to every block before the count says it is there
    arrived_last = atomicAdd(out.arrivals, 1u) == unsigned(blocks - 1);
    __threadfence();
  }
  if (!__syncthreads_or(arrived_last)) return;  // a barrier too: `temp` is free again
  __threadfence();
  float s = 0.0f;
  for (int i = int(threadIdx.x); i < blocks; i += loss_threads) s += __ldcg(out.block_sums + i);  // from L2
  const float total = LossReduce(temp).Sum(s);
  if (threadIdx.x == 0) {
    *out.value = total * scale;
    *out.arrivals = 0u;
  }
}

template <class RowLoss>
__global__ void __launch_bounds__(loss_threads) loss_rows_kernel(int batch, RowLoss row_loss, float scale,
                                                                 LossOutput out) {
  kernel_prologue();
  __shared__ typename LossReduce::TempStorage temp;
  const int row = int(blockIdx.x) * loss_threads + int(threadIdx.x);
  const float l = row < batch ? row_loss(row) : 0.0f;
  finish_loss(LossReduce(temp).Sum(l), int(gridDim.x), scale, out, temp);
}

struct SoftmaxCrossEntropyRow {
  const float* logits;
  const std::int32_t* labels;
  float* dlogits;
  int classes;
  float scale;
  int* bad_target;
  float smoothing;
  __device__ float operator()(int row) const {
    const std::int32_t label = labels[row];
    float* d = dlogits ? dlogits + std::size_t(row) * classes : nullptr;
    if (label < 0 || label >= classes) {
      atomicOr(bad_target, 1);
      if (d)
        for (int c = 0; c < classes; ++c) d[c] = 0.0f;
      return __int_as_float(0x7fc00000);  // NaN
    }
    return softmax_cross_entropy_row(logits + std::size_t(row) * classes, classes, int(label), d, scale, smoothing);
  }
};

// The squared error is a sum over values, not rows: one thread per value (grid-stride, so reads and
// writes are coalesced whatever the row width), then the same two-level fixed-order reduction.
struct SquaredErrorValues {
  const float* y;
  const float* targets;
  float* dy;
  std::size_t n;
  float scale;
};

template <int = 0>
__global__ void __launch_bounds__(loss_threads) squared_error_kernel(SquaredErrorValues v, LossOutput out) {
  kernel_prologue();
  __shared__ typename LossReduce::TempStorage temp;
  float s = 0.0f;
  const std::size_t stride = std::size_t(gridDim.x) * loss_threads;
  for (std::size_t i = std::size_t(blockIdx.x) * loss_threads + threadIdx.x; i < v.n; i += stride)
    s += squared_error_element(v.y[i], v.targets[i], v.dy ? v.dy + i : nullptr, v.scale);
  finish_loss(LossReduce(temp).Sum(s), int(gridDim.x), v.scale, out, temp);
}

inline void require_loss_output(const LossOutput& out) {
  require(out.value != nullptr && out.block_sums != nullptr && out.bad_target != nullptr && out.arrivals != nullptr,
          "Cuda loss: a LossOutput needs the value, the block sums, the label flag and the arrival count "
          "(LossResult::output() gives all four)");
}

template <class RowLoss>
void run_loss(cudaStream_t stream, std::size_t batch, const RowLoss& row_loss, float scale, const LossOutput& out) {
  require_loss_output(out);
  launch<loss_rows_kernel<RowLoss>>("loss_rows_kernel", loss_blocks(batch), loss_threads, 0, stream, int(batch),
                                    row_loss, scale, out);
}
}  // namespace detail

/// Mean softmax cross-entropy of `batch` rows of `classes` logits; dlogits (when not null) receives its
/// gradient, (softmax - target) / batch (target: the label smoothed by `smoothing`).
inline void softmax_cross_entropy(cudaStream_t stream, std::size_t batch, std::size_t classes, const float* logits,
                                  const std::int32_t* labels, float* dlogits, const LossOutput& out,
                                  float smoothing = 0.0f) {
  const float scale = 1.0f / float(batch);
  detail::run_loss(
      stream, batch,
      detail::SoftmaxCrossEntropyRow{logits, labels, dlogits, int(classes), scale, out.bad_target, smoothing}, scale,
      out);
}

/// Mean squared error over batch x outputs values; dy (when not null) receives its gradient.
inline void mean_squared_error(cudaStream_t stream, std::size_t batch, std::size_t outputs, const float* y,
                               const float* targets, float* dy, const LossOutput& out) {
  const float scale = 1.0f / float(batch * outputs);
  const int blocks = loss_blocks(batch);  // no more than LossOutput::block_sums holds
  detail::require_loss_output(out);
  launch<detail::squared_error_kernel<>>("squared_error_kernel", blocks, loss_threads, 0, stream,
                                         detail::SquaredErrorValues{y, targets, dy, batch * outputs, scale}, out);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
