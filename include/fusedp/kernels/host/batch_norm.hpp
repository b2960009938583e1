#pragma once
// Batch normalization on the Host over NCHW values, one channel per task (kernels/batch_norm.hpp has
// the math). Sums are taken in double in a fixed order, so results do not depend on the thread count.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/batch_norm.hpp"

#include <cstddef>

namespace fusedp::kernels::host {

/// The (batch, channels, plane) values a BatchNorm layer normalizes.
struct BatchNormGeometry {
  std::size_t batch;
  std::size_t channels;
  std::size_t plane;  // H * W (1 for BatchNorm1d)
  [[nodiscard]] std::size_t count() const { return batch * plane; }
  [[nodiscard]] std::size_t at(std::size_t n, std::size_t c) const { return (n * channels + c) * plane; }
};

/// y = Epi(normalize(x)); z the values before the epilogue when it needs them (else null). Training:
/// the batch's statistics, left in the state for backward, and the running statistics updated;
/// evaluation: the running statistics. gamma and beta are null without affine parameters.
template <class Epi, class T>
void batch_norm_forward(const Host& host, const BatchNormGeometry& g, const BatchNormState& s, bool training,
                        double momentum, double eps, const T* gamma, const T* beta, T* state, const T* x, T* y,
                        T* z) {
  if (training) state[s.batches_tracked()] += T(1);
  host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
    for (std::size_t c = c0; c < c1; ++c) {
      BatchNormChannel<T> ch{T(0), T(0), gamma ? gamma[c] : T(1), beta ? beta[c] : T(0)};
      if (training) {
        double sum = 0;
        for (std::size_t n = 0; n < g.batch; ++n)
          for (std::size_t i = 0; i < g.plane; ++i) sum += double(x[g.at(n, c) + i]);
        const double mean = sum / double(g.count());
        double sq = 0;
        for (std::size_t n = 0; n < g.batch; ++n)
          for (std::size_t i = 0; i < g.plane; ++i) {
            const double d = double(x[g.at(n, c) + i]) - mean;
            sq += d * d;
          }
        const double var = sq / double(g.count());
        ch.mean = T(mean);
        ch.invstd = batch_norm_invstd<T>(var, eps);
        state[s.batch_mean() + c] = ch.mean;
        state[s.batch_invstd() + c] = ch.invstd;
        batch_norm_update_running(state[s.running_mean() + c], state[s.running_var() + c], mean, var,
                                  double(g.count()), momentum);
      } else {
        ch.mean = state[s.running_mean() + c];
        ch.invstd = batch_norm_invstd<T>(double(state[s.running_var() + c]), eps);
      }
      for (std::size_t n = 0; n < g.batch; ++n) {
        const std::size_t at = g.at(n, c);
        for (std::size_t i = 0; i < g.plane; ++i) {
          const T v = ch.normalize(x[at + i]);
          if constexpr (Epi::saves_input) z[at + i] = v;
          y[at + i] = Epi::apply(v);
        }
      }
    }
  });
}

/// Backward of a training forward. dy is overwritten with the gradient before the epilogue; dgamma
/// and dbeta are set (null without affine parameters), dx skipped when null.
template <class Epi, class T>
void batch_norm_backward(const Host& host, const BatchNormGeometry& g, const BatchNormState& s, const T* gamma,
                         const T* state, const T* x, const T* y, const T* z, T* dy, T* dx, T* dgamma, T* dbeta) {
  host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
    for (std::size_t c = c0; c < c1; ++c) {
      const T mean = state[s.batch_mean() + c], invstd = state[s.batch_invstd() + c];
      const T gm = gamma ? gamma[c] : T(1);
      double sum_dz = 0, sum_dz_xhat = 0;
      for (std::size_t n = 0; n < g.batch; ++n) {
        const std::size_t at = g.at(n, c);
        for (std::size_t i = 0; i < g.plane; ++i) {
          T& d = dy[at + i];
          if constexpr (!Epi::empty) d *= Epi::derivative(z ? z[at + i] : y[at + i], y[at + i]);
          sum_dz += double(d);
          sum_dz_xhat += double(d) * double((x[at + i] - mean) * invstd);
        }
      }
      if (dgamma) dgamma[c] = T(sum_dz_xhat);
      if (dbeta) dbeta[c] = T(sum_dz);
      if (!dx) continue;
      for (std::size_t n = 0; n < g.batch; ++n) {
        const std::size_t at = g.at(n, c);
        for (std::size_t i = 0; i < g.plane; ++i)
          dx[at + i] = batch_norm_input_gradient(dy[at + i], (x[at + i] - mean) * invstd, gm, invstd, sum_dz,
                                                 sum_dz_xhat, double(g.count()));
      }
    }
  });
}

}  // namespace fusedp::kernels::host
