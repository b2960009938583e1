#pragma once
// Batch normalization on the Host over NCHW values, one channel per task (kernels/batch_norm.hpp has
// the math). Sums are taken in double in a fixed order (partial sums in double lanes, see
// channel_sums), so results do not depend on the thread count.
// Alone, each channel is summed, normalized and (backward) differentiated in one task while its
// values are in cache. With a ReplicaSum (SyncBatchNorm) the same per-channel pieces run as phases
// over all channels, the sums added over the replicas between them: the mean, then the sum of squared
// deviations from the global mean (two passes, as alone, so the variance is as exact), and backward
// the sums of dz and dz xhat.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/exec/replica_sum.hpp"
#include "fusedp/kernels/activation.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

namespace fusedp::kernels::host {

/// The (batch, channels, plane) values a BatchNorm layer normalizes.
struct BatchNormGeometry {
  std::size_t batch;
  std::size_t channels;
  std::size_t plane;  // H * W (1 for BatchNorm1d)
  [[nodiscard]] std::size_t count() const { return batch * plane; }
  [[nodiscard]] std::size_t at(std::size_t n, std::size_t c) const { return (n * channels + c) * plane; }
};

namespace detail {
// The channel sums run in double with independent partial sums: one running double sum is an add per
// 4 cycles (the latency), which made BatchNorm a seventh of ResNet-18's Host step (stage_bench: 6.4 ms
// forward and 9.0 ms backward for 64 channels of 64 x 32 x 32). Here each run of a plane is read in
// chunks of `wide` floats widened to double lanes, into `chains` partial vectors, and the remainder
// adds up one by one; the partials are added up in a fixed order at the end, so a channel's sum
// depends on its values and the plane's length only (never on the thread count).
inline constexpr std::size_t wide = simd::lanes<double>;  // 8 under AVX-512, 1 in scalar builds
inline constexpr std::size_t chains = 4;
using Wide = simd::vec_n<double, wide>;

// `wide` values of p widened to double.
template <class T>
FUSEDP_ALWAYS_INLINE Wide widen(const T* p) {  // p: `wide` values of T (a vector of them, or memory)
  if constexpr (std::is_same_v<T, double>) {
    return simd::load_as<Wide>(p);
  } else if constexpr (wide == 1) {
    return Wide(*p);
  } else {
#if FUSEDP_VECTOR_EXTENSIONS
    return __builtin_convertvector(simd::load_as<simd::vec_n<T, wide>>(p), Wide);
#endif
  }
}

template <class W>
FUSEDP_ALWAYS_INLINE double total(const W& v) {
  if constexpr (std::is_same_v<W, double>) {
    return v;
  } else {
    double s = 0;
    for (std::size_t l = 0; l < wide; ++l) s += v[l];
    return s;
  }
}

// NS sums over the values of a channel: for each sample's run of `plane` values at `at(n)`,
// chunk(acc, i) adds elements [i, i + wide) of the run into acc[0, NS) and one(sums, i) adds element i
// into sums[0, NS).
template <std::size_t NS, class At, class Chunk, class One>
FUSEDP_ALWAYS_INLINE std::array<double, NS> channel_sums(std::size_t batch, std::size_t plane, const At& at,
                                                          const Chunk& chunk, const One& one) {
  Wide acc[chains][NS] = {};
  std::array<double, NS> rest{};
  for (std::size_t n = 0; n < batch; ++n) {
    const std::size_t base = at(n);
    // Counted loops: GCC (nvcc's host pass) warned of an overflowing iteration in `i + step <= plane` ones.
    const std::size_t rounds = plane / (chains * wide), chunks = plane % (chains * wide) / wide;
    std::size_t i = 0;
    for (std::size_t r = 0; r < rounds; ++r, i += chains * wide)
      FUSEDP_UNROLL(4)
      for (std::size_t q = 0; q < chains; ++q) chunk(acc[q], base + i + q * wide);
    for (std::size_t r = 0; r < chunks; ++r, i += wide) chunk(acc[0], base + i);
    // The last plane % wide values, counted too: `for (; i < plane; ++i)` drew GCC 12's
    // -Waggressive-loop-optimizations ("iteration 4611686018427387903 invokes undefined behavior") on
    // AVX2 builds (seen in CI, 2026-12-04).
    if constexpr (wide > 1)  // (scalar builds: chunks of one value leave nothing)
      for (std::size_t r = 0; r < plane % wide; ++r) one(rest.data(), base + i + r);
  }
  std::array<double, NS> out{};
  for (std::size_t k = 0; k < NS; ++k) {
    Wide t = acc[0][k];
    for (std::size_t q = 1; q < chains; ++q) t += acc[q][k];
    out[k] = total(t) + rest[k];
  }
  return out;
}

template <class T>
double channel_sum(const BatchNormGeometry& g, const T* x, std::size_t c) {
  return channel_sums<1>(
      g.batch, g.plane, [&](std::size_t n) { return g.at(n, c); },
      [&](Wide* acc, std::size_t i) { acc[0] += widen(x + i); },
      [&](double* sums, std::size_t i) { sums[0] += double(x[i]); })[0];
}
template <class T>
double channel_squares(const BatchNormGeometry& g, const T* x, std::size_t c, double mean) {
  const Wide m = Wide{} + mean;
  return channel_sums<1>(
      g.batch, g.plane, [&](std::size_t n) { return g.at(n, c); },
      [&](Wide* acc, std::size_t i) {
        const Wide d = widen(x + i) - m;
        acc[0] += d * d;
      },
      [&](double* sums, std::size_t i) {
        const double d = double(x[i]) - mean;
        sums[0] += d * d;
      })[0];
}
// y = Epi(normalize(x) [+ add]) over channel c; z the values before the epilogue when it saves them;
// each plane of y rounded to bf16 values as it is written where bf16_y.
template <class Epi, class T>
void normalize_channel(const BatchNormGeometry& g, const BatchNormChannel<T>& ch, std::size_t c, const T* x, T* y,
                       T* z, const T* add, bool bf16_y) {
  for (std::size_t n = 0; n < g.batch; ++n) {
    const std::size_t at = g.at(n, c);
    if (add == nullptr) {
      for (std::size_t i = 0; i < g.plane; ++i) {
        const T v = ch.normalize(x[at + i]);
        if constexpr (Epi::saves_input) z[at + i] = v;
        y[at + i] = Epi::apply(v);
      }
    } else {
      for (std::size_t i = 0; i < g.plane; ++i) {
        const T v = ch.normalize(x[at + i]) + add[at + i];
        if constexpr (Epi::saves_input) z[at + i] = v;
        y[at + i] = Epi::apply(v);
      }
    }
    round_run_if(bf16_y, y + at, g.plane);
  }
}
// Whether backward forms dz = dy ReLU'(y) as it reads dy, in each of its two passes over the channel
// (alone, the second finds y in cache; with SyncBatchNorm the passes are phases over all channels),
// instead of storing dz into dy in a pass of its own: where the caller
// does not need dz afterwards (keep_dz false) and the epilogue is ReLU. Storing cost a write of every
// dy, back to memory; the products are the same (dy x 1 or dy x 0 in T), so the bits are.
template <class Epi>
inline constexpr bool gates_relu = std::is_same_v<Epi, Epilogue<Relu>>;

// dz at i: dy[i], or dy[i] Epi'(y[i]) where `gate` (ReLU's mask, as Epilogue<Relu>::derivative takes it).
template <class Epi, bool Gate, class T>
FUSEDP_ALWAYS_INLINE T dz_at(const T* dy, const T* y, std::size_t i) {
  if constexpr (Gate) return dy[i] * Epi::derivative(y[i], y[i]);
  else return dy[i];
}

// The channel's sums of dz and dz xhat, dz formed as dz_at forms it; xhat in T, as the input gradient
// computes it, then widened.
template <class Epi, bool Gate, class T>
std::pair<double, double> channel_dz_sums(const BatchNormGeometry& g, std::size_t c, T mean, T invstd, const T* x,
                                          const T* y, const T* dy) {
  using V = simd::vec_n<T, wide>;
  const auto sums = channel_sums<2>(
      g.batch, g.plane, [&](std::size_t n) { return g.at(n, c); },
      [&](Wide* acc, std::size_t i) {
        const V xhat = (simd::load_as<V>(x + i) - mean) * invstd;
        V dz = simd::load_as<V>(dy + i);
        if constexpr (Gate) {
#if FUSEDP_VECTOR_EXTENSIONS
          if constexpr (wide > 1) dz = dz * simd::select<V>(simd::load_as<V>(y + i) > T(0), V{} + T(1), V{});
          else dz = dz_at<Epi, true>(dy, y, i);
#else
          dz = dz_at<Epi, true>(dy, y, i);
#endif
        }
        const Wide d = widen(reinterpret_cast<const T*>(&dz));
        acc[0] += d;
        acc[1] += d * widen(reinterpret_cast<const T*>(&xhat));
      },
      [&](double* s, std::size_t i) {
        const T dz = dz_at<Epi, Gate>(dy, y, i);
        s[0] += double(dz);
        s[1] += double(dz) * double((x[i] - mean) * invstd);
      });
  return {sums[0], sums[1]};
}

// The channel's sums of dz and dz xhat. dz is stored into dy first (the epilogue's derivative applied in
// place) where `keep_dz` or the epilogue is not ReLU; a ReLU's is formed in each pass otherwise (gates_relu).
template <class Epi, class T>
std::pair<double, double> channel_gradient_sums(const BatchNormGeometry& g, std::size_t c, T mean, T invstd,
                                                const T* x, const T* y, const T* z, T* dy, bool keep_dz) {
  if constexpr (gates_relu<Epi>)
    if (!keep_dz) return channel_dz_sums<Epi, true>(g, c, mean, invstd, x, y, dy);
  if constexpr (!Epi::empty) {
    const T* before = z ? z : y;  // what the derivative reads (its input, or its output when that is enough)
    for (std::size_t n = 0; n < g.batch; ++n) {
      const std::size_t at = g.at(n, c);
      for (std::size_t i = 0; i < g.plane; ++i) dy[at + i] *= Epi::derivative(before[at + i], y[at + i]);
    }
  }
  return channel_dz_sums<Epi, false>(g, c, mean, invstd, x, y, dy);
}
// dx over channel c, from dz as channel_gradient_sums left it: in dy, or formed from dy and y again
// (gates_relu without keep_dz).
template <class Epi, class T>
void channel_input_gradient(const BatchNormGeometry& g, std::size_t c, T mean, T invstd, T gamma, double sum_dz,
                            double sum_dz_xhat, double count, const T* x, const T* y, const T* dy, T* dx,
                            bool bf16_dx, bool keep_dz) {
  auto run = [&]<bool Gate>() {
    for (std::size_t n = 0; n < g.batch; ++n) {
      const std::size_t at = g.at(n, c);
      for (std::size_t i = 0; i < g.plane; ++i)
        dx[at + i] = batch_norm_input_gradient(dz_at<Epi, Gate>(dy, y, at + i), (x[at + i] - mean) * invstd, gamma,
                                               invstd, sum_dz, sum_dz_xhat, count);
      round_run_if(bf16_dx, dx + at, g.plane);
    }
  };
  if (gates_relu<Epi> && !keep_dz) run.template operator()<gates_relu<Epi>>();
  else run.template operator()<false>();
}
}  // namespace detail

/// y = Epi(normalize(x) + add) (add: null, or values of x's layout added before the epilogue, a
/// residual block's shortcut); z the values before the epilogue when it needs them (else null).
/// Training: the batch's statistics, left in the state for backward, and the running statistics
/// updated; evaluation: the running statistics. gamma and beta are null without affine parameters.
/// With `sync`, the batch is every replica's shard together (`sums`: batch_norm_sync_doubles(channels)).
/// Backward is the same with or without `add`: the gradient of the sum is normalize(x)'s. With `bf16_y`
/// (float), y is stored as bf16 values, rounded as written (net/activation_storage.hpp).
template <class Epi, class T>
void batch_norm_forward(const Host& host, const BatchNormGeometry& g, const BatchNormState& s, bool training,
                        double momentum, double eps, const T* gamma, const T* beta, T* state, const T* x, T* y,
                        T* z, const ReplicaSum& sync = {}, double* sums = nullptr, const T* add = nullptr,
                        bool bf16_y = false) {
  auto channel = [&](std::size_t c) {
    return BatchNormChannel<T>{T(0), T(0), gamma ? gamma[c] : T(1), beta ? beta[c] : T(0)};
  };
  // Training, once the channel's mean and biased variance over `count` values are known.
  auto finish = [&](std::size_t c, double mean, double var, double count) {
    BatchNormChannel<T> ch = channel(c);
    ch.mean = T(mean);
    ch.invstd = batch_norm_invstd<T>(var, eps);
    state[s.batch_mean() + c] = ch.mean;
    state[s.batch_invstd() + c] = ch.invstd;
    batch_norm_update_running(state[s.running_mean() + c], state[s.running_var() + c], mean, var, count, momentum);
    detail::normalize_channel<Epi>(g, ch, c, x, y, z, add, bf16_y);
  };
  if (training) state[s.batches_tracked()] += T(1);
  if (!training) {
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) {
        BatchNormChannel<T> ch = channel(c);
        ch.mean = state[s.running_mean() + c];
        ch.invstd = batch_norm_invstd<T>(double(state[s.running_var() + c]), eps);
        detail::normalize_channel<Epi>(g, ch, c, x, y, z, add, bf16_y);
      }
    });
  } else if (!sync) {
    const double count = double(g.count());
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) {
        const double mean = detail::channel_sum(g, x, c) / count;
        finish(c, mean, detail::channel_squares(g, x, c, mean) / count, count);
      }
    });
  } else {
    // sums[c]: the channel's sum, then its squared deviations; sums[channels]: the value count.
    double* squares = sums + g.channels + 1;
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) sums[c] = detail::channel_sum(g, x, c);
    });
    sums[g.channels] = double(g.count());
    sync(sums, g.channels + 1);
    const double count = sums[g.channels];
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) squares[c] = detail::channel_squares(g, x, c, sums[c] / count);
    });
    sync(squares, g.channels);
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) finish(c, sums[c] / count, squares[c] / count, count);
    });
  }
}

/// Backward of a training forward. dy is overwritten with the gradient before the epilogue (dz) where
/// `keep_dz` (a residual block's shortcut takes it); without, it may be left as it was (it is, under
/// ReLU). dgamma and dbeta are set to this batch's part (null without affine parameters), dx skipped when
/// null (and stored as bf16 values with `bf16_dx`). With `sync` as in forward (`sums`:
/// batch_norm_sync_doubles(channels)).
template <class Epi, class T>
void batch_norm_backward(const Host& host, const BatchNormGeometry& g, const BatchNormState& s, const T* gamma,
                         const T* state, const T* x, const T* y, const T* z, T* dy, T* dx, T* dgamma, T* dbeta,
                         const ReplicaSum& sync = {}, double* sums = nullptr, bool bf16_dx = false,
                         bool keep_dz = true) {
  auto mean_of = [&](std::size_t c) { return state[s.batch_mean() + c]; };
  auto invstd_of = [&](std::size_t c) { return state[s.batch_invstd() + c]; };
  auto gamma_of = [&](std::size_t c) { return gamma ? gamma[c] : T(1); };
  auto parameter_gradients = [&](std::size_t c, double sum_dz, double sum_dz_xhat) {
    if (dgamma) dgamma[c] = T(sum_dz_xhat);
    if (dbeta) dbeta[c] = T(sum_dz);
  };
  if (!sync) {
    const double count = double(g.count());
    host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
      for (std::size_t c = c0; c < c1; ++c) {
        const auto [sum_dz, sum_dz_xhat] =
            detail::channel_gradient_sums<Epi>(g, c, mean_of(c), invstd_of(c), x, y, z, dy, keep_dz);
        parameter_gradients(c, sum_dz, sum_dz_xhat);
        if (dx)
          detail::channel_input_gradient<Epi>(g, c, mean_of(c), invstd_of(c), gamma_of(c), sum_dz, sum_dz_xhat,
                                              count, x, y, dy, dx, bf16_dx, keep_dz);
      }
    });
    return;
  }
  // sums[c]: the channel's sum of dz, sums[channels + c]: of dz xhat; sums[2 channels]: the count.
  host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
    for (std::size_t c = c0; c < c1; ++c) {
      const auto [sum_dz, sum_dz_xhat] =
          detail::channel_gradient_sums<Epi>(g, c, mean_of(c), invstd_of(c), x, y, z, dy, keep_dz);
      parameter_gradients(c, sum_dz, sum_dz_xhat);  // this shard's part: Parallel adds the parts
      sums[c] = sum_dz;
      sums[g.channels + c] = sum_dz_xhat;
    }
  });
  sums[2 * g.channels] = double(g.count());
  sync(sums, 2 * g.channels + 1);
  if (!dx) return;
  const double count = sums[2 * g.channels];
  host.parallel_for(g.channels, [&](std::size_t c0, std::size_t c1, int) {
    for (std::size_t c = c0; c < c1; ++c)
      detail::channel_input_gradient<Epi>(g, c, mean_of(c), invstd_of(c), gamma_of(c), sums[c],
                                          sums[g.channels + c], count, x, y, dy, dx, bf16_dx, keep_dz);
  });
}

}  // namespace fusedp::kernels::host
