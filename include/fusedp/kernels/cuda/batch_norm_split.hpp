#pragma once
// How a BatchNorm pass on Cuda splits a channel's values over thread blocks, and what each thread of a
// block computes, as functions both compilers see: kernels/cuda/batch_norm.cuh's kernels are made of
// these and a block-wide sum; tests/kernels/cuda/batch_norm_split.cpp runs the same functions on the CPU
// for every thread of every block and checks the results against double.
//
// A channel's batch x plane values (NCHW: `batch` runs of `plane` contiguous values, `channels x plane`
// apart) are indexed k = n plane + p and cut into `chunks` ranges of chunk_size values, one block each.
// A training pass is then two kernels over (channels x chunks) blocks: the first writes each block's
// partial sums, the second adds a channel's partials up in chunk order (every block of the channel
// alike, so no block waits for another) and normalizes, or differentiates, its own range.
// The chunk count depends on the channel's value count alone, never on the device, so every GPU adds
// the same values in the same order.
//
// Why split: one block per channel (sessions 27-36) put ResNet-18's layer1 (64 channels at 128 x 32 x
// 32) on 64 of an H200's 132 SMs, one block of 256 threads each with one load in flight per thread: by
// Little's law about 1 KiB in flight per SM, some 0.1-0.2 TB/s of the 4.8. Split, that channel runs as
// 32 blocks of 4,096 values, with four independent loads per thread per round. Not yet measured.
//
// Forward takes the mean and the variance in one pass over x, from the sums of d = x - K and d^2 with
// K the channel's first value (shifted sums, in double). The variance's relative error is at worst
// about 1e-16 n (1 + (mean - K)^2 / var), n the values one thread adds in sequence: 16 at the sizes
// chunks_for aims at, where it stays below float's 6e-8 unless K lies some 10^3 standard deviations
// from the mean (tests/kernels/cuda/batch_norm_split.cpp: values of mean 1000 and spread 0.01, where
// plain sums of x and x^2 lose the variance, within 1e-9 of two passes in double); at most 2^17 near
// most_values, where the bound is 10^2 deviations (a typical error grows as sqrt(n), not n).
// SyncBatchNorm keeps two passes (the mean over all replicas, then the squared deviations from it) on the
// same split: each pass's partials are combined into per-channel totals (a small kernel), which the
// replicas add up between the kernels, since replicas with shards of other sizes split otherwise.
//
// Nothing here includes CUDA.
#include "fusedp/core/config.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/fast_div.hpp"

#include <cstddef>

namespace fusedp::kernels::cuda {

/// The blocks of a BatchNorm pass over (batch, channels, plane) values: `chunks` blocks per channel,
/// block b = c chunks + j over values [begin(j), end(j)) of channel c.
struct BatchNormSplit {
  static constexpr int threads = 256;  // per block
  static constexpr int unroll = 4;     // independent loads a thread issues per round
  // Values a block aims at: 16 a thread, four rounds of four loads. Chosen by arithmetic, not yet by a
  // measurement: enough blocks to fill 132 SMs several times over at ResNet-18's layer1 and layer2
  // (2,048 and 1,024 blocks at batch 128) while a channel's partials stay few (most_chunks).
  static constexpr int block_values = threads * 16;
  static constexpr int most_chunks = 32;
  /// The most values a channel may hold (batch x plane): k stays an int through the last round.
  static constexpr int most_values = (1 << 30);

  int channels = 0;
  int count = 0;       // values per channel: batch x plane
  int chunks = 1;      // blocks per channel
  int chunk_size = 0;  // values per block, a multiple of 32 (the last block may hold fewer, or none)
  FastDiv plane;
  // A thread's step of `threads` values, as whole planes and the rest: k + threads lies step_planes
  // samples and step_rest values (< plane) further on.
  int step_planes = 0;
  int step_rest = 0;

  /// Blocks per channel for `count` values a channel (a training pass alone).
  FUSEDP_HD static constexpr int chunks_for(std::size_t count) {
    const std::size_t c = count / std::size_t(block_values);
    return c < 1 ? 1 : c > std::size_t(most_chunks) ? most_chunks : int(c);
  }
  /// A split of `chunk_count` blocks per channel.
  FUSEDP_HD constexpr BatchNormSplit(int batch, int channel_count, int plane_size, int chunk_count)
      : channels(channel_count), count(batch * plane_size), chunks(chunk_count), plane(plane_size) {
    const int per = (count + chunks - 1) / chunks;
    chunk_size = (per + 31) / 32 * 32;
    step_planes = threads / plane_size;
    step_rest = threads - step_planes * plane_size;
  }
  /// The split of a training pass alone.
  FUSEDP_HD static constexpr BatchNormSplit training(int batch, int channels, int plane) {
    return {batch, channels, plane, chunks_for(std::size_t(batch) * std::size_t(plane))};
  }

  [[nodiscard]] FUSEDP_HD constexpr int blocks() const { return channels * chunks; }
  /// Block b's channel and chunk (b = c chunks + chunk; its partial sums at 2 b and 2 b + 1).
  FUSEDP_HD constexpr void block(int b, int& c, int& chunk) const {
    c = b / chunks;
    chunk = b - c * chunks;
  }
  [[nodiscard]] FUSEDP_HD constexpr int begin(int chunk) const {
    const long long b = (long long)chunk * chunk_size;
    return b < count ? int(b) : count;
  }
  [[nodiscard]] FUSEDP_HD constexpr int end(int chunk) const {
    const long long e = (long long)begin(chunk) + chunk_size;
    return e < count ? int(e) : count;
  }
  /// Where value k of channel c lies in NCHW.
  [[nodiscard]] FUSEDP_HD std::size_t at(int c, int k) const {
    int n, p;
    plane.divmod(k, n, p);
    return (std::size_t(n) * std::size_t(channels) + std::size_t(c)) * std::size_t(plane.divisor()) + std::size_t(p);
  }
  /// Doubles of the partial sums a pass keeps in scratch: two per block, then the value count at
  /// count_at() (backward; for SyncBatchNorm the replicas' counts added up).
  [[nodiscard]] FUSEDP_HD constexpr std::size_t partial_doubles() const { return 2 * std::size_t(blocks()) + 1; }
  [[nodiscard]] FUSEDP_HD constexpr int count_at() const { return 2 * blocks(); }
  /// SyncBatchNorm's per-channel totals, which the replicas add up: channel c's two sums at 2 c and
  /// 2 c + 1, the value count at 2 channels (the layout of partials of one chunk a channel). Two sets
  /// follow the partials in scratch (the sums, then the squared deviations from the global mean).
  [[nodiscard]] FUSEDP_HD constexpr std::size_t totals_doubles() const { return 2 * std::size_t(channels) + 1; }
  [[nodiscard]] FUSEDP_HD constexpr std::size_t scratch_doubles() const {
    return partial_doubles() + 2 * totals_doubles();
  }

  /// Thread t of block (c, chunk): load(i) for its values i in rounds of `unroll` loads, then
  /// use(value, i) for each in order. A thread's values: k = begin + t + r threads, r = 0, 1, ...
  /// One division finds the first; each next one is a step of step_planes samples and step_rest values
  /// (two adds and a compare, where a division per value cost some ten integer instructions: as many as
  /// the value's share of the memory time at 4.8 TB/s in 16 bits, by the issue rates; not measured).
  template <class Load, class Use>
  FUSEDP_HD FUSEDP_ALWAYS_INLINE void visit(int c, int chunk, int t, const Load& load, const Use& use) const {
    using V = decltype(load(std::size_t{}));
    const int first = begin(chunk) + t, last = end(chunk);
    if (first >= last) return;
    const int plane_size = plane.divisor();
    const std::size_t sample = std::size_t(channels) * std::size_t(plane_size);  // one sample's values
    const std::size_t jump = std::size_t(step_planes) * sample + std::size_t(step_rest);
    int n, p;  // where value k lies: sample n, position p in the plane; i its NCHW index
    plane.divmod(first, n, p);
    std::size_t i = (std::size_t(n) * std::size_t(channels) + std::size_t(c)) * std::size_t(plane_size) +
                    std::size_t(p);
    for (int k = first; k < last; k += threads * unroll) {
      std::size_t at_u[unroll];
      V v[unroll];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int u = 0; u < unroll; ++u) {
        at_u[u] = i;
        v[u] = k + u * threads < last ? load(i) : V{};
        i += jump;
        p += step_rest;
        if (p >= plane_size) {  // into the next sample
          p -= plane_size;
          i += sample - std::size_t(plane_size);
        }
      }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int u = 0; u < unroll; ++u)
        if (k + u * threads < last) use(v[u], at_u[u]);
    }
  }
};

/// Doubles of Cuda scratch a BatchNorm layer's training passes need at this batch: the partials, and
/// SyncBatchNorm's two sets of totals (BatchNormSplit::scratch_doubles).
FUSEDP_HD constexpr std::size_t batch_norm_scratch_doubles(std::size_t batch, int channels, int plane) {
  // The split's own sizes, for a batch whose values may pass the int a split counts them in.
  BatchNormSplit sp{1, channels, plane, BatchNormSplit::chunks_for(batch * std::size_t(plane))};
  return sp.scratch_doubles();
}

/// Thread t's sums over its values of channel c in block `chunk`: of d = x - shift and of d^2. (Shift
/// 0: the plain sum; the mean: the squared deviations.)
template <class X>
FUSEDP_HD void batch_norm_thread_sums(const BatchNormSplit& sp, int c, int chunk, int t, const X* x, double shift,
                                      double& sum, double& squares) {
  sum = 0;
  squares = 0;
  sp.visit(
      c, chunk, t, [&](std::size_t i) { return to_float(x[i]); },
      [&](float v, std::size_t) {
        const double d = double(v) - shift;
        sum += d;
        squares += d * d;
      });
}

/// Channel c's two sums over its `chunks` chunks, added in chunk order from `partials` (two per block
/// of chunk-major channels; one chunk: a set of totals).
FUSEDP_HD inline void batch_norm_channel_totals(const double* partials, int chunks, int c, double& a, double& b) {
  a = 0;
  b = 0;
  for (int j = 0; j < chunks; ++j) {
    a += partials[2 * (c * chunks + j)];
    b += partials[2 * (c * chunks + j) + 1];
  }
}
/// Channel c's totals (SyncBatchNorm's, before the replicas add them up) from this replica's partials,
/// and for channel 0 its value count.
FUSEDP_HD inline void batch_norm_combine_channel(const BatchNormSplit& sp, const double* partials, int c,
                                                 double* totals) {
  batch_norm_channel_totals(partials, sp.chunks, c, totals[2 * c], totals[2 * c + 1]);
  if (c == 0) totals[2 * sp.channels] = double(sp.count);
}

/// The mean and the biased variance of `count` values from their shifted sums.
FUSEDP_HD inline void batch_norm_shifted_moments(double shift, double sum, double squares, double count,
                                                 double& mean, double& var) {
  const double m = sum / count;
  mean = shift + m;
  var = squares / count - m * m;
  if (var < 0) var = 0;  // rounding, where every value is (nearly) the same
}

/// Thread t's part of normalizing block `chunk` of channel c: y = Epi(normalize(x) [+ add]), z the value
/// before the epilogue where it saves it. X, Y, A: the elements x, y and add are stored in.
template <class Epi, class X, class Y, class A>
FUSEDP_HD void batch_norm_normalize_thread(const BatchNormSplit& sp, int c, int chunk, int t,
                                           const BatchNormChannel<float>& ch, const X* x, Y* y, float* z,
                                           const A* add, bool bf16) {
  struct In {
    float x, add;
  };
  sp.visit(
      c, chunk, t, [&](std::size_t i) { return In{to_float(x[i]), add ? to_float(add[i]) : 0.0f}; },
      [&](const In& in, std::size_t i) {
        const float v = add ? ch.normalize(in.x) + in.add : ch.normalize(in.x);
        if constexpr (Epi::saves_input) z[i] = v;
        store_element(y + i, stored_value(Epi::apply(v), bf16));
      });
}

/// Thread t's part of the gradient sums of block `chunk` of channel c: applies the epilogue's derivative
/// to dy in place (dz; stored as DY, 16 bits only where the derivative is a mask, so dz is a bf16 value
/// too) and returns its sums of dz and of dz xhat.
template <class Epi, class X, class Y, class DY>
FUSEDP_HD void batch_norm_gradient_thread(const BatchNormSplit& sp, int c, int chunk, int t, float mean,
                                          float invstd, const X* x, const Y* y, const float* z, DY* dy,
                                          double& sum_dz, double& sum_dz_xhat) {
  struct In {
    float dy, x, y, z;
  };
  sum_dz = 0;
  sum_dz_xhat = 0;
  sp.visit(
      c, chunk, t,
      [&](std::size_t i) {
        In in{to_float(dy[i]), to_float(x[i]), 0.0f, 0.0f};
        if constexpr (!Epi::empty) {
          in.y = to_float(y[i]);
          in.z = z ? z[i] : in.y;
        }
        return in;
      },
      [&](const In& in, std::size_t i) {
        float d = in.dy;
        if constexpr (!Epi::empty) {
          d *= Epi::derivative(in.z, in.y);
          store_element(dy + i, d);
        }
        sum_dz += double(d);
        sum_dz_xhat += double(d) * double((in.x - mean) * invstd);
      });
}

/// Thread t's part of the input gradient of block `chunk` of channel c, from the channel's sums of dz
/// and dz xhat over `count` values. DX: the element dx is stored in (`bf16`: as a bf16 value).
template <class X, class DY, class DX>
FUSEDP_HD void batch_norm_input_gradient_thread(const BatchNormSplit& sp, int c, int chunk, int t, float gamma,
                                                float mean, float invstd, const X* x, const DY* dy, DX* dx,
                                                double sum_dz, double sum_dz_xhat, double count, bool bf16) {
  struct In {
    float dy, x;
  };
  sp.visit(
      c, chunk, t, [&](std::size_t i) { return In{to_float(dy[i]), to_float(x[i])}; },
      [&](const In& in, std::size_t i) {
        store_element(dx + i, stored_value(batch_norm_input_gradient(in.dy, (in.x - mean) * invstd, gamma, invstd,
                                                                     sum_dz, sum_dz_xhat, count),
                                           bf16));
      });
}

}  // namespace fusedp::kernels::cuda
