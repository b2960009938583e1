#pragma once
// The math of batch normalization that both spaces share, per channel over (batch, plane) values:
//   forward    y = gamma (x - mean) invstd + beta, invstd = 1 / sqrt(var + eps), var the biased
//              variance of the batch (training) or the running variance (evaluation)
//   running    r = (1 - momentum) r + momentum s, with the unbiased variance (PyTorch's update)
//   backward   dx = gamma invstd (dz - mean(dz) - xhat mean(dz xhat)), dgamma = sum(dz xhat),
//              dbeta = sum(dz)
#include "fusedp/core/config.hpp"

#include <cmath>
#include <cstddef>

namespace fusedp::kernels {

/// Where a BatchNorm layer's tensors stand in its share of the state buffer, for `channels`
/// channels: running_mean, running_var, num_batches_tracked (PyTorch's buffers), then the batch's
/// mean and inverse standard deviation that forward leaves for backward. Each at an aligned offset,
/// as Sequential lays them out.
struct BatchNormState {
  std::size_t channels;
  std::size_t aligned;  // align_elements(channels)
  std::size_t scalar;   // align_elements(1)
  FUSEDP_HD constexpr std::size_t running_mean() const { return 0; }
  FUSEDP_HD constexpr std::size_t running_var() const { return aligned; }
  FUSEDP_HD constexpr std::size_t batches_tracked() const { return 2 * aligned; }
  FUSEDP_HD constexpr std::size_t batch_mean() const { return 2 * aligned + scalar; }
  FUSEDP_HD constexpr std::size_t batch_invstd() const { return 3 * aligned + scalar; }
};

/// Doubles a synchronized (SyncBatchNorm) pass on the Host adds over the replicas for `channels`
/// channels: the sums and the count, then the squared deviations (forward); the two gradient sums and
/// the count. (Cuda's layout is its own: kernels/cuda/batch_norm_split.hpp.)
FUSEDP_HD constexpr std::size_t batch_norm_sync_doubles(std::size_t channels) { return 2 * channels + 1; }

/// The per-channel constants of one forward pass.
template <class T>
struct BatchNormChannel {
  T mean;
  T invstd;
  T gamma;  // 1 without affine parameters
  T beta;   // 0 without affine parameters
  FUSEDP_HD T normalize(T x) const { return gamma * ((x - mean) * invstd) + beta; }
};

template <class T>
FUSEDP_HD T batch_norm_invstd(double var, double eps) {
  using std::sqrt;
  return T(1.0 / sqrt(var + eps));
}

/// An evaluation-mode BatchNorm carried into the epilogue of the layer before it (a conv): its
/// running statistics and affine parameters (gamma, beta null without them), so the epilogue
/// normalizes each value exactly as the BatchNorm's own pass would.
template <class T>
struct BatchNormFold {
  const T* mean;  // running_mean
  const T* var;   // running_var
  const T* gamma;
  const T* beta;
  double eps;
  FUSEDP_HD BatchNormChannel<T> channel(std::size_t c) const {
    return {mean[c], batch_norm_invstd<T>(double(var[c]), eps), gamma ? gamma[c] : T(1), beta ? beta[c] : T(0)};
  }
};

/// PyTorch's running update from a batch's mean and biased variance over `count` values per channel.
template <class T>
FUSEDP_HD void batch_norm_update_running(T& running_mean, T& running_var, double mean, double biased_var,
                                         double count, double momentum) {
  const double unbiased = biased_var * count / (count - 1.0);
  running_mean = T((1.0 - momentum) * double(running_mean) + momentum * mean);
  running_var = T((1.0 - momentum) * double(running_var) + momentum * unbiased);
}

/// The input gradient of one value, given the channel's sums of dz and dz xhat over `count` values.
template <class T>
FUSEDP_HD T batch_norm_input_gradient(T dz, T xhat, T gamma, T invstd, double sum_dz, double sum_dz_xhat,
                                      double count) {
  return T(double(gamma) * double(invstd) *
           (double(dz) - sum_dz / count - double(xhat) * sum_dz_xhat / count));
}

}  // namespace fusedp::kernels
