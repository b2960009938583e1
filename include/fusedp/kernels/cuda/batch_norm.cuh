#pragma once
// Batch normalization on Cuda over NCHW values (kernels/batch_norm.hpp has the math both spaces share).
// Training: one block per channel reduces the channel's (batch, plane) values in double, in a fixed
// order (per-thread strided partial sums, then a shared-memory tree), so the result does not depend
// on timing; the same block then normalizes the channel. Evaluation: one elementwise kernel with the
// running statistics. Backward: one block per channel, the sums of dz and dz * xhat, then dx.
//
// One block per channel leaves most SMs idle for narrow layers at small batches; a split over the
// batch with a second pass is the known next step (see docs/PERFORMANCE.md when measured).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/cuda/launch.cuh"

#include <cstddef>

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

template <class Epi>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_train_kernel(BatchNormExtents g, BatchNormState s, double momentum, double eps, const float* gamma,
                            const float* beta, float* state, const float* x, float* y, float* z) {
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  const std::size_t count = std::size_t(g.batch) * g.plane;
  auto at = [&](std::size_t k) { return (k / g.plane * g.channels + c) * std::size_t(g.plane) + k % g.plane; };
  double sum = 0;
  for (std::size_t k = threadIdx.x; k < count; k += batch_norm_threads) sum += double(x[at(k)]);
  const double mean = block_sum(sum, shared) / double(count);
  double sq = 0;
  for (std::size_t k = threadIdx.x; k < count; k += batch_norm_threads) {
    const double d = double(x[at(k)]) - mean;
    sq += d * d;
  }
  const double var = block_sum(sq, shared) / double(count);
  const BatchNormChannel<float> ch{float(mean), batch_norm_invstd<float>(var, eps), gamma ? gamma[c] : 1.0f,
                                   beta ? beta[c] : 0.0f};
  if (threadIdx.x == 0) {
    state[s.batch_mean() + c] = ch.mean;
    state[s.batch_invstd() + c] = ch.invstd;
    batch_norm_update_running(state[s.running_mean() + c], state[s.running_var() + c], mean, var, double(count),
                              momentum);
    if (c == 0) state[s.batches_tracked()] += 1.0f;
  }
  for (std::size_t k = threadIdx.x; k < count; k += batch_norm_threads) {
    const std::size_t i = at(k);
    const float v = ch.normalize(x[i]);
    if constexpr (Epi::saves_input) z[i] = v;
    y[i] = Epi::apply(v);
  }
}

template <class Epi>
__global__ void batch_norm_eval_kernel(BatchNormExtents g, BatchNormState s, double eps, const float* gamma,
                                       const float* beta, const float* state, const float* x, float* y, float* z) {
  const std::size_t n = std::size_t(g.batch) * g.channels * g.plane;
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    const int c = int(i / g.plane % g.channels);
    const BatchNormChannel<float> ch{state[s.running_mean() + c],
                                     batch_norm_invstd<float>(double(state[s.running_var() + c]), eps),
                                     gamma ? gamma[c] : 1.0f, beta ? beta[c] : 0.0f};
    const float v = ch.normalize(x[i]);
    if constexpr (Epi::saves_input) z[i] = v;
    y[i] = Epi::apply(v);
  }
}

template <class Epi>
__global__ void __launch_bounds__(batch_norm_threads)
    batch_norm_backward_kernel(BatchNormExtents g, BatchNormState s, const float* gamma, const float* state,
                               const float* x, const float* y, const float* z, float* dy, float* dx, float* dgamma,
                               float* dbeta) {
  __shared__ double shared[batch_norm_threads];
  const int c = blockIdx.x;
  const std::size_t count = std::size_t(g.batch) * g.plane;
  auto at = [&](std::size_t k) { return (k / g.plane * g.channels + c) * std::size_t(g.plane) + k % g.plane; };
  const float mean = state[s.batch_mean() + c], invstd = state[s.batch_invstd() + c];
  const float gm = gamma ? gamma[c] : 1.0f;
  double sum_dz = 0, sum_dz_xhat = 0;
  for (std::size_t k = threadIdx.x; k < count; k += batch_norm_threads) {
    const std::size_t i = at(k);
    float d = dy[i];
    if constexpr (!Epi::empty) d *= Epi::derivative(z ? z[i] : y[i], y[i]);
    dy[i] = d;
    sum_dz += double(d);
    sum_dz_xhat += double(d) * double((x[i] - mean) * invstd);
  }
  sum_dz = block_sum(sum_dz, shared);
  sum_dz_xhat = block_sum(sum_dz_xhat, shared);
  if (threadIdx.x == 0) {
    if (dgamma) dgamma[c] = float(sum_dz_xhat);
    if (dbeta) dbeta[c] = float(sum_dz);
  }
  if (!dx) return;
  for (std::size_t k = threadIdx.x; k < count; k += batch_norm_threads) {
    const std::size_t i = at(k);
    dx[i] = batch_norm_input_gradient(dy[i], (x[i] - mean) * invstd, gm, invstd, sum_dz, sum_dz_xhat,
                                      double(count));
  }
}
}  // namespace detail

/// Forward of a BatchNorm layer (see kernels/host/batch_norm.hpp for the contract).
template <class Epi>
void batch_norm_forward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, bool training,
                        double momentum, double eps, const float* gamma, const float* beta, float* state,
                        const float* x, float* y, float* z) {
  if (training) {
    detail::batch_norm_train_kernel<Epi><<<unsigned(g.channels), detail::batch_norm_threads, 0, stream>>>(
        g, s, momentum, eps, gamma, beta, state, x, y, z);
    FUSEDP_CUDA_CHECK_LAUNCH("batch_norm_train_kernel");
  } else {
    const std::size_t n = std::size_t(g.batch) * g.channels * g.plane;
    detail::batch_norm_eval_kernel<Epi><<<elementwise_blocks(n), elementwise_threads, 0, stream>>>(
        g, s, eps, gamma, beta, state, x, y, z);
    FUSEDP_CUDA_CHECK_LAUNCH("batch_norm_eval_kernel");
  }
}

/// Backward of a training forward: dy is overwritten with the gradient before the epilogue.
template <class Epi>
void batch_norm_backward(cudaStream_t stream, const BatchNormExtents& g, const BatchNormState& s, const float* gamma,
                         const float* state, const float* x, const float* y, const float* z, float* dy, float* dx,
                         float* dgamma, float* dbeta) {
  detail::batch_norm_backward_kernel<Epi><<<unsigned(g.channels), detail::batch_norm_threads, 0, stream>>>(
      g, s, gamma, state, x, y, z, dy, dx, dgamma, dbeta);
  FUSEDP_CUDA_CHECK_LAUNCH("batch_norm_backward_kernel");
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
