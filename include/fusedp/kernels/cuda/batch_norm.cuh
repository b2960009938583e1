#pragma once
// Batch normalization on Cuda over NCHW values (kernels/batch_norm.hpp has the math both spaces share,
// kernels/cuda/batch_norm_split.hpp what each thread of these kernels does).
// Training: two kernels over (channels x chunks) blocks. The first takes each block's sums in double
// (per-thread sums, then a fixed tree over the block) into the scratch; the second adds a channel's
// partials up in chunk order, so the result does not depend on timing, and normalizes (forward) or
// differentiates (backward) its block's values. Forward: the shifted sums of x, the mean and variance
// in one pass. Backward: the sums of dz and dz xhat, then dx and the parameter gradients. Evaluation:
// one elementwise kernel with the running statistics.
//
// SyncBatchNorm (a ReplicaSum): the same split, each pass's partials combined into per-channel totals
// that the replicas add up on the stream between the kernels (forward: the sums, then the squared
// deviations from the global mean; backward: the sums of dz and dz xhat).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/batch_norm_split.hpp"
#include "fusedp/kernels/cuda/launch.cuh"

#include <cstddef>
#include <type_traits>

namespace fusedp::kernels::cuda {

/// The (batch, channels, plane) values a BatchNorm layer normalizes.
struct BatchNormExtents {
  int batch;
  int channels;
  int plane;
};

namespace detail {
inline constexpr int batch_norm_threads = BatchNormSplit::threads;
inline constexpr int batch_norm_warps = batch_norm_threads / 32;

// The sums over the block of two doubles per thread, in a fixed order: a shuffle tree in each warp,
// then the warps' sums in warp order (every thread gets them). `shared`: 2 x batch_norm_warps doubles.
__device__ FUSEDP_ALWAYS_INLINE void block_sums(double& a, double& b, double* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  if (threadIdx.x % 32 == 0) {
    shared[2 * (threadIdx.x / 32)] = a;
    shared[2 * (threadIdx.x / 32) + 1] = b;
  }
  __syncthreads();
  a = 0;
  b = 0;
  for (int w = 0; w < batch_norm_warps; ++w) {
    a += shared[2 * w];
    b += shared[2 * w + 1];
  }
}

// The shift of channel c's shifted sums: its first value.
template <class X>
__device__ FUSEDP_ALWAYS_INLINE double channel_shift(const BatchNormSplit& sp, int c, const X* x) {
  return double(to_float(x[sp.at(c, 0)]));
}

// Training, once channel c's mean and biased variance over `count` values are known: the state and the
// running update (the channel's first block), and block `chunk`'s normalized values. X, Y, A: the
// elements x, y and add are stored in (float, or BFloat16 on a Bf16 model where the plan stores them
// so: net/residual.hpp, net/cuda_plan.hpp).
template <class Epi, class X, class Y, class A>
__device__ FUSEDP_ALWAYS_INLINE void finish_chunk(const BatchNormSplit& sp, int c, int chunk, const BatchNormState& s,
                                                  double mean, double var, double count, double momentum,
                                                  double eps, const float* gamma, const float* beta, float* state,
                                                  const X* x, Y* y, float* z, const A* add, bool bf16) {
  const BatchNormChannel<float> ch{float(mean), batch_norm_invstd<float>(var, eps), gamma ? gamma[c] : 1.0f,
                                   beta ? beta[c] : 0.0f};
  if (chunk == 0 && threadIdx.x == 0) {
    state[s.batch_mean() + c] = ch.mean;
    state[s.batch_invstd() + c] = ch.invstd;
    batch_norm_update_running(state[s.running_mean() + c], state[s.running_var() + c], mean, var, count, momentum);
    if (c == 0) state[s.batches_tracked()] += 1.0f;
  }
  batch_norm_normalize_thread<Epi>(sp, c, chunk, int(threadIdx.x), ch, x, y, z, add, bf16);
}

// What a pass's first kernel subtracts from x before it sums: the channel's first value (a training
// pass alone: shifted sums), nothing (SyncBatchNorm's sums), the global mean from the replicas' totals
// (its squared deviations).
enum class Shift { first_value, zero, global_mean };

// First kernel of a training forward: each block's sums of x - shift and (x - shift)^2
// (partials[2 b], partials[2 b + 1]). `totals`: SyncBatchNorm's summed totals (Shift::global_mean).
template <class X, Shift S>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_partial_sums_kernel(BatchNormSplit sp, const X* x, const double* totals, double* partials) {
  kernel_prologue();
  __shared__ double shared[2 * batch_norm_warps];
  int c, chunk;
  sp.block(int(blockIdx.x), c, chunk);
  double shift = 0;
  if constexpr (S == Shift::first_value) shift = channel_shift(sp, c, x);
  if constexpr (S == Shift::global_mean) shift = totals[2 * c] / totals[2 * sp.channels];
  double sum, squares;
  batch_norm_thread_sums(sp, c, chunk, int(threadIdx.x), x, shift, sum, squares);
  block_sums(sum, squares, shared);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = sum;
    partials[2 * blockIdx.x + 1] = squares;
  }
}
// SyncBatchNorm: this replica's per-channel totals from its partials, one thread a channel (in chunk
// order), and from them its own parameter gradients (backward; before the replicas add the totals).
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_combine_kernel(BatchNormSplit sp, const double* partials, double* totals, float* dgamma,
                              float* dbeta) {
  kernel_prologue();
  const int c = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= sp.channels) return;
  batch_norm_combine_channel(sp, partials, c, totals);
  if (dgamma) dgamma[c] = float(totals[2 * c + 1]);
  if (dbeta) dbeta[c] = float(totals[2 * c]);
}
// Second kernel of a training pass alone: the channel's statistics from the partials, then its block's
// values.
template <class Epi, class X, class Y, class A>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_train_kernel(BatchNormSplit sp, BatchNormState s, double momentum, double eps, const float* gamma,
                            const float* beta, float* state, const X* x, Y* y, float* z, const A* add, bool bf16,
                            const double* partials) {
  kernel_prologue();
  int c, chunk;
  sp.block(int(blockIdx.x), c, chunk);
  double sum, squares, mean, var;
  batch_norm_channel_totals(partials, sp.chunks, c, sum, squares);
  const double count = double(sp.count);
  batch_norm_shifted_moments(channel_shift(sp, c, x), sum, squares, count, mean, var);
  finish_chunk<Epi>(sp, c, chunk, s, mean, var, count, momentum, eps, gamma, beta, state, x, y, z, add, bf16);
}
// SyncBatchNorm's last forward kernel: the statistics of every replica's values from the summed totals
// (`sums`: the sums of x; `squares`: the squared deviations from their mean, at 2 c + 1), then the
// block's values.
template <class Epi, class X, class Y, class A>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_finish_kernel(BatchNormSplit sp, BatchNormState s, double momentum, double eps, const float* gamma,
                             const float* beta, float* state, const X* x, Y* y, float* z, const double* sums,
                             const double* squares, const A* add, bool bf16) {
  kernel_prologue();
  int c, chunk;
  sp.block(int(blockIdx.x), c, chunk);
  const double count = sums[2 * sp.channels];
  finish_chunk<Epi>(sp, c, chunk, s, sums[2 * c] / count, squares[2 * c + 1] / count, count, momentum, eps, gamma,
                    beta, state, x, y, z, add, bf16);
}

template <class Epi, class X, class Y, class A>
__global__ void batch_norm_eval_kernel(BatchNormExtents g, BatchNormState s, double eps, const float* gamma,
                                       const float* beta, const float* state, const X* x, Y* y, float* z,
                                       const A* add, bool bf16) {
  kernel_prologue();
  const std::size_t n = std::size_t(g.batch) * g.channels * g.plane;
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    const int c = int(i / g.plane % g.channels);
    const BatchNormChannel<float> ch{state[s.running_mean() + c],
                                     batch_norm_invstd<float>(double(state[s.running_var() + c]), eps),
                                     gamma ? gamma[c] : 1.0f, beta ? beta[c] : 0.0f};
    const float xi = to_float(x[i]);
    const float v = add ? ch.normalize(xi) + to_float(add[i]) : ch.normalize(xi);
    if constexpr (Epi::saves_input) z[i] = v;
    store_element(y + i, stored_value(Epi::apply(v), bf16));
  }
}

// Backward, first kernel: applies the epilogue's derivative to dy in place (stored as DY: in 16 bits
// only where the derivative is a mask, so that dz is a bf16 value too) and writes each block's sums of
// dz and dz xhat (partials[2 b], partials[2 b + 1]) and the value count (partials[2 blocks]).
template <class Epi, class X, class Y, class DY>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_gradient_sums_kernel(BatchNormSplit sp, BatchNormState s, const float* state, const X* x,
                                    const Y* y, const float* z, DY* dy, double* partials) {
  kernel_prologue();
  __shared__ double shared[2 * batch_norm_warps];
  int c, chunk;
  sp.block(int(blockIdx.x), c, chunk);
  double sum_dz, sum_dz_xhat;
  batch_norm_gradient_thread<Epi>(sp, c, chunk, int(threadIdx.x), state[s.batch_mean() + c],
                                  state[s.batch_invstd() + c], x, y, z, dy, sum_dz, sum_dz_xhat);
  block_sums(sum_dz, sum_dz_xhat, shared);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = sum_dz;
    partials[2 * blockIdx.x + 1] = sum_dz_xhat;
    if (blockIdx.x == 0) partials[sp.count_at()] = double(sp.count);
  }
}
// Backward, second kernel: the channel's sums from `sums` (two per chunk, `sum_chunks` a channel, in
// chunk order, then the value count: a pass's partials alone, SyncBatchNorm's summed totals of one
// chunk), then dx over its block's values (where dx is wanted) and the parameter gradients (where
// dgamma and dbeta are given: alone).
template <class X, class DY, class DX>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_input_gradient_kernel(BatchNormSplit sp, BatchNormState s, const float* gamma, const float* state,
                                     const X* x, const DY* dy, DX* dx, float* dgamma, float* dbeta,
                                     const double* sums, int sum_chunks, bool bf16) {
  kernel_prologue();
  int c, chunk;
  sp.block(int(blockIdx.x), c, chunk);
  double sum_dz, sum_dz_xhat;
  batch_norm_channel_totals(sums, sum_chunks, c, sum_dz, sum_dz_xhat);
  if (chunk == 0 && threadIdx.x == 0) {
    if (dgamma) dgamma[c] = float(sum_dz_xhat);
    if (dbeta) dbeta[c] = float(sum_dz);
  }
  if (dx)
    batch_norm_input_gradient_thread(sp, c, chunk, int(threadIdx.x), gamma ? gamma[c] : 1.0f,
                                     state[s.batch_mean() + c], state[s.batch_invstd() + c], x, dy, dx, sum_dz,
                                     sum_dz_xhat, sums[2 * sp.channels * sum_chunks], bf16);
}
}  // namespace detail

/// Forward of a BatchNorm layer (see kernels/host/batch_norm.hpp for the contract). `sums`: in training,
/// batch_norm_scratch_doubles(batch, channels, plane) doubles of device memory (the partial sums and, with
/// `sync`, SyncBatchNorm's totals). `bf16`: y stored as bf16 values. X, Y, A: the elements x, y and `add`
/// are stored in (float, or kernels::BFloat16); z is fp32. Training needs batch x plane <=
/// BatchNormSplit::most_values (the layer checks it), and y, z and add apart from x: every block of a
/// channel reads the channel's first x (the shift) while the first block writes its y.
template <class Epi, class X = float, class Y = float, class A = float>
void batch_norm_forward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, bool training,
                        double momentum, double eps, const float* gamma, const float* beta, float* state,
                        const X* x, Y* y, float* z, const ReplicaSum& sync = {}, double* sums = nullptr,
                        const std::type_identity_t<A>* add = nullptr, bool bf16 = false) {
  using detail::Shift;
  constexpr int threads = detail::batch_norm_threads;
  if (!training) {
    const std::size_t n = std::size_t(g.batch) * g.channels * g.plane;
    launch<detail::batch_norm_eval_kernel<Epi, X, Y, A>>("batch_norm_eval_kernel", elementwise_blocks(n),
                                                         elementwise_threads, 0, stream, g, s, eps, gamma, beta, state,
                                                         x, y, z, add, bf16);
    return;
  }
  const auto sp = BatchNormSplit::training(g.batch, g.channels, g.plane);
  const unsigned blocks = unsigned(sp.blocks());
  double* partials = sums;
  const double* none = nullptr;
  if (!sync) {
    launch<detail::batch_norm_partial_sums_kernel<X, Shift::first_value>>("batch_norm_partial_sums_kernel", blocks,
                                                                          threads, 0, stream, sp, x, none, partials);
    launch<detail::batch_norm_train_kernel<Epi, X, Y, A>>("batch_norm_train_kernel", blocks, threads, 0, stream, sp, s,
                                                          momentum, eps, gamma, beta, state, x, y, z, add, bf16,
                                                          static_cast<const double*>(partials));
    return;
  }
  // SyncBatchNorm: the sums of every replica, the global mean, the squared deviations from it.
  double* totals = sums + sp.partial_doubles();
  double* squares = totals + sp.totals_doubles();
  const unsigned channel_blocks = unsigned((g.channels + threads - 1) / threads);
  float* no_gradient = nullptr;
  launch<detail::batch_norm_partial_sums_kernel<X, Shift::zero>>("batch_norm_partial_sums_kernel", blocks, threads, 0,
                                                                 stream, sp, x, none, partials);
  launch<detail::batch_norm_combine_kernel>("batch_norm_combine_kernel", channel_blocks, threads, 0, stream, sp,
                                            static_cast<const double*>(partials), totals, no_gradient, no_gradient);
  sync(totals, sp.totals_doubles(), stream);
  launch<detail::batch_norm_partial_sums_kernel<X, Shift::global_mean>>(
      "batch_norm_partial_sums_kernel", blocks, threads, 0, stream, sp, x, static_cast<const double*>(totals),
      partials);
  launch<detail::batch_norm_combine_kernel>("batch_norm_combine_kernel", channel_blocks, threads, 0, stream, sp,
                                            static_cast<const double*>(partials), squares, no_gradient, no_gradient);
  sync(squares, sp.totals_doubles(), stream);
  launch<detail::batch_norm_finish_kernel<Epi, X, Y, A>>(
      "batch_norm_finish_kernel", blocks, threads, 0, stream, sp, s, momentum, eps, gamma, beta, state, x, y, z,
      static_cast<const double*>(totals), static_cast<const double*>(squares), add, bf16);
}

/// Backward of a training forward: dy is overwritten with the gradient before the epilogue; `sync`
/// and `sums` as in forward; `bf16`: dx stored as bf16 values. X, Y: as in forward; DY, DX: the elements dy
/// and dx are stored in (float, or kernels::BFloat16: dy only where Epi's derivative is a mask, or none).
template <class Epi, class X = float, class Y = float, class DY = float, class DX = float>
void batch_norm_backward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, const float* gamma,
                         const float* state, const X* x, const Y* y, const float* z, DY* dy, DX* dx,
                         float* dgamma, float* dbeta, const ReplicaSum& sync = {}, double* sums = nullptr,
                         bool bf16 = false) {
  constexpr int threads = detail::batch_norm_threads;
  const auto sp = BatchNormSplit::training(g.batch, g.channels, g.plane);
  const unsigned blocks = unsigned(sp.blocks());
  double* partials = sums;
  launch<detail::batch_norm_gradient_sums_kernel<Epi, X, Y, DY>>("batch_norm_gradient_sums_kernel", blocks, threads,
                                                                 0, stream, sp, s, state, x, y, z, dy, partials);
  const double* channel_sums = partials;
  int sum_chunks = sp.chunks;
  if (sync) {
    // This replica's parameter gradients from its own totals, then the totals of every replica.
    double* totals = sums + sp.partial_doubles();
    launch<detail::batch_norm_combine_kernel>("batch_norm_combine_kernel", unsigned((g.channels + threads - 1) / threads),
                                              threads, 0, stream, sp, static_cast<const double*>(partials), totals,
                                              dgamma, dbeta);
    sync(totals, sp.totals_doubles(), stream);
    channel_sums = totals;
    sum_chunks = 1;
    dgamma = nullptr;
    dbeta = nullptr;
  }
  if (!dx && !dgamma && !dbeta) return;
  launch<detail::batch_norm_input_gradient_kernel<X, DY, DX>>(
      "batch_norm_input_gradient_kernel", blocks, threads, 0, stream, sp, s, gamma, state, x,
      static_cast<const DY*>(dy), dx, dgamma, dbeta, channel_sums, sum_chunks, bf16);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
