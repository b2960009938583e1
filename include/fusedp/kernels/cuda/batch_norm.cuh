#pragma once
// Batch normalization on Cuda over NCHW values (kernels/batch_norm.hpp has the math both spaces share).
// Training: one block per channel reduces the channel's (batch, plane) values in double, in a fixed
// order (per-thread strided partial sums, then a shared-memory tree), so the result does not depend
// on timing; the same block then normalizes the channel. Evaluation: one elementwise kernel with the
// running statistics. Backward: one block per channel, the sums of dz and dz * xhat, then dx.
//
// SyncBatchNorm (a ReplicaSum): the same per-channel pieces as separate kernels, the sums added over
// the replicas on the stream between them (forward: the sums, then the squared deviations from the
// global mean; backward: the sums of dz and dz xhat).
//
// One block per channel leaves most SMs idle for narrow layers at small batches; a split over the
// batch with a second pass is the known next step (see docs/PERFORMANCE.md when measured).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/bf16.hpp"
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
inline constexpr int batch_norm_threads = 256;

// The sum over the block of one double per thread (every thread gets it).
__device__ FUSEDP_ALWAYS_INLINE double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = batch_norm_threads / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double r = shared[0];
  __syncthreads();
  return r;
}

// Where value k of channel c's (batch, plane) values lies in NCHW.
__device__ FUSEDP_ALWAYS_INLINE std::size_t channel_at(const BatchNormExtents& g, int c, std::size_t k) {
  return (k / g.plane * g.channels + c) * std::size_t(g.plane) + k % g.plane;
}
__device__ FUSEDP_ALWAYS_INLINE std::size_t channel_count(const BatchNormExtents& g) {
  return std::size_t(g.batch) * g.plane;
}
// Channel c's sum over the block (every thread gets it).
template <class X>
__device__ FUSEDP_ALWAYS_INLINE double channel_sum(const BatchNormExtents& g, int c, const X* x, double* shared) {
  double sum = 0;
  for (std::size_t k = threadIdx.x; k < channel_count(g); k += batch_norm_threads)
    sum += double(to_float(x[channel_at(g, c, k)]));
  return block_sum(sum, shared);
}
// Channel c's sum of squared deviations from `mean` over the block.
template <class X>
__device__ FUSEDP_ALWAYS_INLINE double channel_squares(const BatchNormExtents& g, int c, const X* x, double mean,
                                                       double* shared) {
  double sq = 0;
  for (std::size_t k = threadIdx.x; k < channel_count(g); k += batch_norm_threads) {
    const double d = double(to_float(x[channel_at(g, c, k)])) - mean;
    sq += d * d;
  }
  return block_sum(sq, shared);
}
// Training, once channel c's mean and biased variance over `count` values are known: the state, the
// running update and the normalized values. X, Y, A: the elements x, y and add are stored in (float,
// or BFloat16 on a Bf16 model where the plan stores them so: net/residual.hpp, net/cuda_plan.hpp).
template <class Epi, class X, class Y, class A>
__device__ FUSEDP_ALWAYS_INLINE void finish_channel(const BatchNormExtents& g, int c, const BatchNormState& s,
                                                    double mean, double var, double count, double momentum,
                                                    double eps, const float* gamma, const float* beta, float* state,
                                                    const X* x, Y* y, float* z, const A* add, bool bf16) {
  const BatchNormChannel<float> ch{float(mean), batch_norm_invstd<float>(var, eps), gamma ? gamma[c] : 1.0f,
                                   beta ? beta[c] : 0.0f};
  if (threadIdx.x == 0) {
    state[s.batch_mean() + c] = ch.mean;
    state[s.batch_invstd() + c] = ch.invstd;
    batch_norm_update_running(state[s.running_mean() + c], state[s.running_var() + c], mean, var, count, momentum);
    if (c == 0) state[s.batches_tracked()] += 1.0f;
  }
  for (std::size_t k = threadIdx.x; k < channel_count(g); k += batch_norm_threads) {
    const std::size_t i = channel_at(g, c, k);
    const float xi = to_float(x[i]);
    const float v = add ? ch.normalize(xi) + to_float(add[i]) : ch.normalize(xi);
    if constexpr (Epi::saves_input) z[i] = v;
    store_element(y + i, stored_value(Epi::apply(v), bf16));
  }
}

template <class Epi, class X, class Y, class A>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_train_kernel(BatchNormExtents g, BatchNormState s, double momentum, double eps, const float* gamma,
                            const float* beta, float* state, const X* x, Y* y, float* z, const A* add, bool bf16) {
  kernel_prologue();
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  const double count = double(channel_count(g));
  const double mean = channel_sum(g, c, x, shared) / count;
  const double var = channel_squares(g, c, x, mean, shared) / count;
  finish_channel<Epi>(g, c, s, mean, var, count, momentum, eps, gamma, beta, state, x, y, z, add, bf16);
}

// SyncBatchNorm's phases, one block per channel, the sums added over the replicas in between.
// sums[c]: channel c's sum, sums[channels]: the value count; squares[c]: its squared deviations.
template <class X>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_sum_kernel(BatchNormExtents g, const X* x, double* sums) {
  kernel_prologue();
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  const double sum = channel_sum(g, c, x, shared);
  if (threadIdx.x == 0) {
    sums[c] = sum;
    if (c == 0) sums[g.channels] = double(channel_count(g));
  }
}
template <class X>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_squares_kernel(BatchNormExtents g, const X* x, const double* sums, double* squares) {
  kernel_prologue();
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  const double sq = channel_squares(g, c, x, sums[c] / sums[g.channels], shared);
  if (threadIdx.x == 0) squares[c] = sq;
}
template <class Epi, class X, class Y, class A>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_finish_kernel(BatchNormExtents g, BatchNormState s, double momentum, double eps, const float* gamma,
                             const float* beta, float* state, const X* x, Y* y, float* z, const double* sums,
                             const double* squares, const A* add, bool bf16) {
  kernel_prologue();
  const int c = blockIdx.x;
  const double count = sums[g.channels];
  finish_channel<Epi>(g, c, s, sums[c] / count, squares[c] / count, count, momentum, eps, gamma, beta, state, x, y,
                      z, add, bf16);
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

// Applies the epilogue's derivative to channel c's dy in place (stored as DY: in 16 bits only where the
// derivative is a mask, so that dz is a bf16 value too); its sums of dz and dz xhat over the block, and
// (thread 0) its parameter gradients, this batch's part.
template <class Epi, class X, class Y, class DY>
__device__ FUSEDP_ALWAYS_INLINE void gradient_sums(const BatchNormExtents& g, int c, const BatchNormState& s,
                                                   const float* state, const X* x, const Y* y,
                                                   const float* z, DY* dy, float* dgamma, float* dbeta,
                                                   double* shared, double& sum_dz, double& sum_dz_xhat) {
  const float mean = state[s.batch_mean() + c], invstd = state[s.batch_invstd() + c];
  sum_dz = 0;
  sum_dz_xhat = 0;
  for (std::size_t k = threadIdx.x; k < channel_count(g); k += batch_norm_threads) {
    const std::size_t i = channel_at(g, c, k);
    float d = to_float(dy[i]);
    if constexpr (!Epi::empty) {
      const float yi = to_float(y[i]);
      d *= Epi::derivative(z ? z[i] : yi, yi);
      store_element(dy + i, d);
    }
    sum_dz += double(d);
    sum_dz_xhat += double(d) * double((to_float(x[i]) - mean) * invstd);
  }
  sum_dz = block_sum(sum_dz, shared);
  sum_dz_xhat = block_sum(sum_dz_xhat, shared);
  if (threadIdx.x == 0) {
    if (dgamma) dgamma[c] = float(sum_dz_xhat);
    if (dbeta) dbeta[c] = float(sum_dz);
  }
}
template <class X, class DY, class DX>
__device__ FUSEDP_ALWAYS_INLINE void input_gradient(const BatchNormExtents& g, int c, const BatchNormState& s,
                                                    const float* gamma, const float* state, const X* x,
                                                    const DY* dy, DX* dx, double sum_dz, double sum_dz_xhat,
                                                    double count, bool bf16) {
  const float mean = state[s.batch_mean() + c], invstd = state[s.batch_invstd() + c];
  const float gm = gamma ? gamma[c] : 1.0f;
  for (std::size_t k = threadIdx.x; k < channel_count(g); k += batch_norm_threads) {
    const std::size_t i = channel_at(g, c, k);
    store_element(dx + i, stored_value(batch_norm_input_gradient(to_float(dy[i]), (to_float(x[i]) - mean) * invstd, gm,
                                                                 invstd, sum_dz, sum_dz_xhat, count),
                                       bf16));
  }
}

template <class Epi, class X, class Y, class DY, class DX>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_backward_kernel(BatchNormExtents g, BatchNormState s, const float* gamma, const float* state,
                               const X* x, const Y* y, const float* z, DY* dy, DX* dx, float* dgamma,
                               float* dbeta, bool bf16) {
  kernel_prologue();
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  double sum_dz, sum_dz_xhat;
  gradient_sums<Epi>(g, c, s, state, x, y, z, dy, dgamma, dbeta, shared, sum_dz, sum_dz_xhat);
  if (dx) input_gradient(g, c, s, gamma, state, x, dy, dx, sum_dz, sum_dz_xhat, double(channel_count(g)), bf16);
}

// SyncBatchNorm's backward: sums[c] and sums[channels + c] channel c's sums of dz and dz xhat,
// sums[2 channels] the value count, added over the replicas between the two kernels.
template <class Epi, class X, class Y, class DY>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_gradient_sums_kernel(BatchNormExtents g, BatchNormState s, const float* state, const X* x,
                                    const Y* y, const float* z, DY* dy, float* dgamma, float* dbeta,
                                    double* sums) {
  kernel_prologue();
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  double sum_dz, sum_dz_xhat;
  gradient_sums<Epi>(g, c, s, state, x, y, z, dy, dgamma, dbeta, shared, sum_dz, sum_dz_xhat);
  if (threadIdx.x == 0) {
    sums[c] = sum_dz;
    sums[g.channels + c] = sum_dz_xhat;
    if (c == 0) sums[2 * g.channels] = double(channel_count(g));
  }
}
template <class X, class DY, class DX>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_input_gradient_kernel(BatchNormExtents g, BatchNormState s, const float* gamma, const float* state,
                                     const X* x, const DY* dy, DX* dx, const double* sums, bool bf16) {
  kernel_prologue();
  const int c = blockIdx.x;
  input_gradient(g, c, s, gamma, state, x, dy, dx, sums[c], sums[g.channels + c], sums[2 * g.channels], bf16);
}
}  // namespace detail

/// Forward of a BatchNorm layer (see kernels/host/batch_norm.hpp for the contract; with `sync`,
/// `sums` is batch_norm_sync_doubles(channels) doubles of device memory). `bf16`: y stored as bf16 values.
/// X, Y, A: the elements x, y and `add` are stored in (float, or kernels::BFloat16); z is fp32.
template <class Epi, class X = float, class Y = float, class A = float>
void batch_norm_forward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, bool training,
                        double momentum, double eps, const float* gamma, const float* beta, float* state,
                        const X* x, Y* y, float* z, const ReplicaSum& sync = {}, double* sums = nullptr,
                        const std::type_identity_t<A>* add = nullptr, bool bf16 = false) {
  const unsigned blocks = unsigned(g.channels);
  if (training && !sync) {
    launch<detail::batch_norm_train_kernel<Epi, X, Y, A>>("batch_norm_train_kernel", blocks, detail::batch_norm_threads, 0,
                                                 stream, g, s, momentum, eps, gamma, beta, state, x, y, z, add, bf16);
  } else if (training) {
    double* squares = sums + g.channels + 1;
    launch<detail::batch_norm_sum_kernel<X>>("batch_norm_sum_kernel", blocks, detail::batch_norm_threads, 0, stream, g, x,
                                          sums);
    sync(sums, std::size_t(g.channels) + 1, stream);
    launch<detail::batch_norm_squares_kernel<X>>("batch_norm_squares_kernel", blocks, detail::batch_norm_threads, 0,
                                              stream, g, x, sums, squares);
    sync(squares, std::size_t(g.channels), stream);
    launch<detail::batch_norm_finish_kernel<Epi, X, Y, A>>("batch_norm_finish_kernel", blocks, detail::batch_norm_threads, 0,
                                                  stream, g, s, momentum, eps, gamma, beta, state, x, y, z, sums,
                                                  squares, add, bf16);
  } else {
    const std::size_t n = std::size_t(g.batch) * g.channels * g.plane;
    launch<detail::batch_norm_eval_kernel<Epi, X, Y, A>>("batch_norm_eval_kernel", elementwise_blocks(n), elementwise_threads, 0,
                                                stream, g, s, eps, gamma, beta, state, x, y, z, add, bf16);
  }
}

/// Backward of a training forward: dy is overwritten with the gradient before the epilogue; `sync`
/// and `sums` as in forward; `bf16`: dx stored as bf16 values. X, Y: as in forward; DY, DX: the elements dy
/// and dx are stored in (float, or kernels::BFloat16: dy only where Epi's derivative is a mask, or none).
template <class Epi, class X = float, class Y = float, class DY = float, class DX = float>
void batch_norm_backward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, const float* gamma,
                         const float* state, const X* x, const Y* y, const float* z, DY* dy, DX* dx,
                         float* dgamma, float* dbeta, const ReplicaSum& sync = {}, double* sums = nullptr,
                         bool bf16 = false) {
  const unsigned blocks = unsigned(g.channels);
  if (!sync) {
    launch<detail::batch_norm_backward_kernel<Epi, X, Y, DY, DX>>("batch_norm_backward_kernel", blocks, detail::batch_norm_threads, 0,
                                                    stream, g, s, gamma, state, x, y, z, dy, dx, dgamma, dbeta, bf16);
    return;
  }
  launch<detail::batch_norm_gradient_sums_kernel<Epi, X, Y, DY>>("batch_norm_gradient_sums_kernel", blocks,
                                                       detail::batch_norm_threads, 0, stream, g, s, state, x, y, z, dy,
                                                       dgamma, dbeta, sums);
  sync(sums, batch_norm_sync_doubles(std::size_t(g.channels)), stream);
  if (!dx) return;
  launch<detail::batch_norm_input_gradient_kernel<X, DY, DX>>("batch_norm_input_gradient_kernel", blocks,
                                                   detail::batch_norm_threads, 0, stream, g, s, gamma, state, x, dy, dx,
                                                   sums, bf16);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
