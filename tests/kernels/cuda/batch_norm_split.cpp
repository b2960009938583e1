// BatchNorm's Cuda kernels (kernels/cuda/batch_norm.cuh) run on the CPU, block by block and thread by
// thread, with the functions of kernels/cuda/batch_norm_split.hpp they are made of: which values each
// thread visits, the sums it takes, and what it writes. The block-wide sum is emulated as the kernels
// compute it (a __shfl_down_sync tree in each warp, then the warps in order). The results are checked
// against double: the batch statistics (on values far from zero, where one-pass sums fail), the
// normalized values, and the gradients. What this cannot check is the hardware (the shuffles, the
// barrier, the launches); tests/gpu/residual.cu compares the kernels with the Host model on a device.
#include <doctest/doctest.h>

#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/cuda/batch_norm_split.hpp>

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace fp = fusedp;
namespace k = fusedp::kernels;
using k::cuda::BatchNormSplit;

namespace {

constexpr int threads = BatchNormSplit::threads;

// detail::block_sums: lane l adds lane l + offset's value (its own where l + offset >= 32, as
// __shfl_down_sync returns), offsets 16, 8, 4, 2, 1; then lane 0 of each warp, added in warp order.
double block_sum(const std::vector<double>& per_thread) {
  double total = 0;
  for (int w = 0; w < threads / 32; ++w) {
    double lane[32];
    for (int l = 0; l < 32; ++l) lane[l] = per_thread[std::size_t(32 * w + l)];
    for (int offset = 16; offset > 0; offset /= 2) {
      double next[32];
      for (int l = 0; l < 32; ++l) next[l] = lane[l] + (l + offset < 32 ? lane[l + offset] : lane[l]);
      for (int l = 0; l < 32; ++l) lane[l] = next[l];
    }
    total += lane[0];
  }
  return total;
}

struct Extents {
  int batch, channels, plane;
  [[nodiscard]] std::size_t size() const { return std::size_t(batch) * channels * plane; }
  [[nodiscard]] std::size_t at(int n, int c, int p) const { return (std::size_t(n) * channels + c) * plane + p; }
};

// Shapes the split meets: ResNet-18's layer1 at batch 128 (32 chunks), a plane of 49 over chunks whose
// bounds cut through samples, BatchNorm1d's plane of 1, fewer values than a block has threads, and a
// count whose chunks cut through a sample, one value past a multiple of the chunk count, and planes
// of 256 and 16 values (a thread's step of 256 values is one sample, or 16).
const Extents shapes[] = {{128, 2, 1024}, {97, 3, 49}, {300, 5, 1}, {3, 4, 5}, {4097, 1, 2}, {33, 2, 257}, {8193, 1, 1},
                          {40, 3, 256}, {300, 3, 16}};

std::vector<float> random_values(std::size_t n, float mean, float spread, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, spread);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

}  // namespace

TEST_CASE("BatchNormSplit: the blocks of a channel visit each of its values once, at its NCHW index, in rounds") {
  CHECK(BatchNormSplit::chunks_for(1) == 1);
  CHECK(BatchNormSplit::chunks_for(128 * 1024) == 32);   // ResNet-18's layer1 at batch 128
  CHECK(BatchNormSplit::chunks_for(128 * 256) == 8);     // layer2
  CHECK(BatchNormSplit::chunks_for(128 * 16) == 1);      // layer4
  CHECK(BatchNormSplit::chunks_for(std::size_t(1) << 40) == BatchNormSplit::most_chunks);
  for (const Extents& e : shapes) {
    CAPTURE(e.batch);
    CAPTURE(e.plane);
    const auto sp = BatchNormSplit::training(e.batch, e.channels, e.plane);
    CHECK(sp.count == e.batch * e.plane);
    CHECK(sp.chunk_size % 32 == 0);
    CHECK(sp.blocks() == e.channels * sp.chunks);
    CHECK(sp.partial_doubles() == 2 * std::size_t(sp.blocks()) + 1);
    for (int b = 0; b < sp.blocks(); ++b) {
      int c, j;
      sp.block(b, c, j);
      REQUIRE(c * sp.chunks + j == b);
      REQUIRE((0 <= j && j < sp.chunks && 0 <= c && c < e.channels));
    }
    // The partials, then SyncBatchNorm's two sets of totals.
    CHECK(k::cuda::batch_norm_scratch_doubles(std::size_t(e.batch), e.channels, e.plane) ==
          sp.partial_doubles() + 2 * (2 * std::size_t(e.channels) + 1));
    for (const auto& s : {sp, BatchNormSplit{e.batch, e.channels, e.plane, 1}}) {
      std::vector<int> seen(e.size(), 0);
      for (int c = 0; c < e.channels; ++c) {
        CHECK(s.begin(0) == 0);
        CHECK(s.end(s.chunks - 1) == s.count);
        for (int j = 0; j < s.chunks; ++j) {
          CHECK(s.begin(j) <= s.end(j));
          if (j > 0) CHECK(s.begin(j) == s.end(j - 1));
          for (int t = 0; t < threads; ++t) {
            std::vector<std::size_t> loaded, used;
            s.visit(
                c, j, t,
                [&](std::size_t i) {
                  loaded.push_back(i);
                  return int(i);
                },
                [&](int v, std::size_t i) {
                  CHECK(std::size_t(v) == i);  // each value reaches use() with its own index
                  used.push_back(i);
                  ++seen[i];
                });
            REQUIRE(loaded == used);
            // Thread t's values: k = begin + t + r threads, in order, each where NCHW puts it.
            for (std::size_t r = 0; r < used.size(); ++r) {
              const int kk = s.begin(j) + t + int(r) * threads;
              REQUIRE(kk < s.end(j));
              CHECK(used[r] == e.at(kk / e.plane, c, kk % e.plane));
            }
            CHECK(s.begin(j) + t + int(used.size()) * threads >= s.end(j));
          }
        }
      }
      for (std::size_t i = 0; i < seen.size(); ++i) REQUIRE(seen[i] == 1);
    }
  }
}

namespace {

// The two kernels of a training forward alone (batch_norm_partial_sums_kernel, batch_norm_train_kernel),
// over every block and thread: y, and the mean and the biased variance the second kernel computes.
template <class Epi, class X, class Y>
void emulate_forward(const Extents& e, const std::vector<X>& x, std::vector<Y>& y, std::vector<float>& z,
                     const std::vector<float>& add, const std::vector<float>& gamma, const std::vector<float>& beta,
                     std::vector<double>& mean, std::vector<double>& var, bool bf16) {
  const auto sp = BatchNormSplit::training(e.batch, e.channels, e.plane);
  std::vector<double> partials(sp.partial_doubles(), std::nan(""));
  auto shift = [&](int c) { return double(k::to_float(x[sp.at(c, 0)])); };
  for (int b = 0; b < sp.blocks(); ++b) {
    int c, j;
    sp.block(b, c, j);
    std::vector<double> sum(threads), squares(threads);
    for (int t = 0; t < threads; ++t)
      k::cuda::batch_norm_thread_sums(sp, c, j, t, x.data(), shift(c), sum[std::size_t(t)], squares[std::size_t(t)]);
    partials[std::size_t(2 * b)] = block_sum(sum);
    partials[std::size_t(2 * b + 1)] = block_sum(squares);
  }
  mean.assign(std::size_t(e.channels), 0);
  var.assign(std::size_t(e.channels), 0);
  for (int b = 0; b < sp.blocks(); ++b) {
    int c, j;
    sp.block(b, c, j);
    double s1, s2, m, v;
    k::cuda::batch_norm_channel_totals(partials.data(), sp.chunks, c, s1, s2);
    k::cuda::batch_norm_shifted_moments(shift(c), s1, s2, double(sp.count), m, v);
    if (j == 0) {
      mean[std::size_t(c)] = m;
      var[std::size_t(c)] = v;
    }
    const k::BatchNormChannel<float> ch{float(m), k::batch_norm_invstd<float>(v, 1e-5), gamma[std::size_t(c)],
                                        beta[std::size_t(c)]};
    for (int t = 0; t < threads; ++t)
      k::cuda::batch_norm_normalize_thread<Epi>(sp, c, j, t, ch, x.data(), y.data(), z.data(),
                                                add.empty() ? nullptr : add.data(), bf16);
  }
}

// Channel c's mean and biased variance in double, in two passes.
void reference_moments(const Extents& e, const std::vector<double>& x, int c, double& mean, double& var) {
  double s = 0;
  for (int n = 0; n < e.batch; ++n)
    for (int p = 0; p < e.plane; ++p) s += x[e.at(n, c, p)];
  mean = s / (double(e.batch) * e.plane);
  double q = 0;
  for (int n = 0; n < e.batch; ++n)
    for (int p = 0; p < e.plane; ++p) q += (x[e.at(n, c, p)] - mean) * (x[e.at(n, c, p)] - mean);
  var = q / (double(e.batch) * e.plane);
}

}  // namespace

TEST_CASE("BatchNorm's Cuda training forward, emulated: statistics to double precision far from zero, y to float's") {
  using Epi = k::Epilogue<k::Gelu>;  // saves its input: z is written too
  for (const Extents& e : shapes) {
    if (e.batch * e.plane < 2) continue;
    CAPTURE(e.batch);
    CAPTURE(e.plane);
    // Values around 1000 with a spread of 0.01: mean^2 / var = 10^10, where sums of x and x^2 in double
    // lose the variance to ~1e-6 and the shifted sums keep it to ~1e-12.
    const auto x = random_values(e.size(), 1000.0f, 0.01f, 7u + unsigned(e.plane));
    const auto add = random_values(e.size(), 0.0f, 1.0f, 8u);
    const auto gamma = random_values(std::size_t(e.channels), 1.0f, 0.2f, 9u);
    const auto beta = random_values(std::size_t(e.channels), 0.0f, 0.2f, 10u);
    std::vector<float> y(e.size(), std::nanf("")), z(e.size(), std::nanf(""));
    std::vector<double> mean, var;
    emulate_forward<Epi>(e, x, y, z, add, gamma, beta, mean, var, false);
    const std::vector<double> xd(x.begin(), x.end());
    for (int c = 0; c < e.channels; ++c) {
      double m, v;
      reference_moments(e, xd, c, m, v);
      CHECK(std::abs(mean[std::size_t(c)] - m) <= 1e-12 * std::abs(m));
      CHECK(std::abs(var[std::size_t(c)] - v) <= 1e-9 * v);
      const double invstd = 1 / std::sqrt(v + 1e-5);
      for (int n = 0; n < e.batch; ++n)
        for (int p = 0; p < e.plane; ++p) {
          const std::size_t i = e.at(n, c, p);
          // The kernel normalizes in float: x - mean loses float's rounding of x near 1000 (6e-5),
          // which the variance of 1e-4 magnifies 100 times; bound it by that.
          const double pre = gamma[std::size_t(c)] * (xd[i] - m) * invstd + beta[std::size_t(c)] + add[i];
          const double tol = 1e-2 * (1 + std::abs(pre));
          REQUIRE(std::abs(z[i] - pre) <= tol);
          REQUIRE(std::abs(y[i] - k::Gelu{}(z[i])) <= 1e-6 * (1 + std::abs(z[i])));
        }
    }
  }
}

TEST_CASE("BatchNorm's Cuda training forward, emulated in BF16 storage: y is the rounding of the fp32 pass") {
  using Epi = k::Epilogue<k::Relu>;
  const Extents e{64, 3, 36};
  const auto xf = random_values(e.size(), 0.5f, 2.0f, 11u);
  std::vector<k::BFloat16> xh(e.size());
  std::vector<float> xr(e.size());
  for (std::size_t i = 0; i < e.size(); ++i) {
    xh[i].bits = k::to_bf16(xf[i]);
    xr[i] = k::round_bf16(xf[i]);  // the same values in fp32 elements
  }
  const std::vector<float> gamma{1.5f, 0.5f, -1.0f}, beta{0.1f, -0.2f, 0.3f};
  std::vector<k::BFloat16> yh(e.size());
  std::vector<float> yf(e.size()), z;
  std::vector<double> mh, vh, mf, vf;
  emulate_forward<Epi>(e, xh, yh, z, {}, gamma, beta, mh, vh, true);
  emulate_forward<Epi>(e, xr, yf, z, {}, gamma, beta, mf, vf, true);
  CHECK(mh == mf);
  CHECK(vh == vf);
  for (std::size_t i = 0; i < e.size(); ++i) REQUIRE(k::to_float(yh[i]) == yf[i]);
}

TEST_CASE("BatchNorm's Cuda backward, emulated: dz in place, the parameter gradients and dx against double") {
  using Epi = k::Epilogue<k::Relu>;
  for (const Extents& e : shapes) {
    if (e.batch * e.plane < 2) continue;
    CAPTURE(e.batch);
    CAPTURE(e.plane);
    const auto sp = BatchNormSplit::training(e.batch, e.channels, e.plane);
    const auto x = random_values(e.size(), 0.3f, 1.5f, 21u + unsigned(e.batch));
    const auto y = random_values(e.size(), 0.0f, 1.0f, 22u);  // Relu's output: its sign masks dy
    const auto dy0 = random_values(e.size(), 0.0f, 1.0f, 23u);
    const auto gamma = random_values(std::size_t(e.channels), 1.0f, 0.2f, 24u);
    std::vector<float> mean(std::size_t(e.channels)), invstd(std::size_t(e.channels));
    for (int c = 0; c < e.channels; ++c) {
      mean[std::size_t(c)] = 0.25f + 0.1f * float(c);
      invstd[std::size_t(c)] = 0.8f + 0.05f * float(c);
    }
    // batch_norm_gradient_sums_kernel
    std::vector<float> dy = dy0;
    std::vector<double> partials(sp.partial_doubles(), std::nan(""));
    for (int b = 0; b < sp.blocks(); ++b) {
      int c, j;
      sp.block(b, c, j);
      std::vector<double> a(threads), g(threads);
      for (int t = 0; t < threads; ++t)
        k::cuda::batch_norm_gradient_thread<Epi>(sp, c, j, t, mean[std::size_t(c)], invstd[std::size_t(c)], x.data(),
                                                 y.data(), static_cast<const float*>(nullptr), dy.data(),
                                                 a[std::size_t(t)], g[std::size_t(t)]);
      partials[std::size_t(2 * b)] = block_sum(a);
      partials[std::size_t(2 * b + 1)] = block_sum(g);
    }
    partials[std::size_t(sp.count_at())] = double(sp.count);
    // batch_norm_input_gradient_kernel
    std::vector<float> dx(e.size(), std::nanf(""));
    std::vector<double> dgamma(std::size_t(e.channels)), dbeta(std::size_t(e.channels));
    for (int b = 0; b < sp.blocks(); ++b) {
      int c, j;
      sp.block(b, c, j);
      double sdz, sdzx;
      k::cuda::batch_norm_channel_totals(partials.data(), sp.chunks, c, sdz, sdzx);
      if (j == 0) {
        dbeta[std::size_t(c)] = sdz;
        dgamma[std::size_t(c)] = sdzx;
      }
      for (int t = 0; t < threads; ++t)
        k::cuda::batch_norm_input_gradient_thread(sp, c, j, t, gamma[std::size_t(c)], mean[std::size_t(c)],
                                                  invstd[std::size_t(c)], x.data(), dy.data(), dx.data(), sdz, sdzx,
                                                  partials[std::size_t(sp.count_at())], false);
    }
    // The reference in double.
    const double count = double(e.batch) * e.plane;
    for (int c = 0; c < e.channels; ++c) {
      double sdz = 0, sdzx = 0, scale = 0;
      auto xhat = [&](std::size_t i) { return (double(x[i]) - mean[std::size_t(c)]) * invstd[std::size_t(c)]; };
      auto dz = [&](std::size_t i) { return y[i] > 0 ? double(dy0[i]) : 0.0; };
      for (int n = 0; n < e.batch; ++n)
        for (int p = 0; p < e.plane; ++p) {
          const std::size_t i = e.at(n, c, p);
          REQUIRE(dy[i] == float(dz(i)));  // dz written in place
          sdz += dz(i);
          sdzx += dz(i) * xhat(i);
          scale += std::abs(dz(i));
        }
      CHECK(std::abs(dbeta[std::size_t(c)] - sdz) <= 1e-12 * (1 + scale));
      CHECK(std::abs(dgamma[std::size_t(c)] - sdzx) <= 1e-6 * (1 + scale));  // xhat in float, as the kernel
      for (int n = 0; n < e.batch; ++n)
        for (int p = 0; p < e.plane; ++p) {
          const std::size_t i = e.at(n, c, p);
          const double want = double(gamma[std::size_t(c)]) * invstd[std::size_t(c)] *
                              (dz(i) - sdz / count - xhat(i) * sdzx / count);
          REQUIRE(std::abs(dx[i] - want) <= 1e-5 * (1 + std::abs(want)));
        }
    }
  }
}

namespace {

// A pass's first kernel over every block: per_thread(c, chunk, t, a, b) gives thread t's two sums; the
// partials as the kernel writes them, and the value count after them.
template <class PerThread>
std::vector<double> emulate_partials(const BatchNormSplit& sp, const PerThread& per_thread) {
  std::vector<double> partials(sp.partial_doubles(), std::nan(""));
  for (int b = 0; b < sp.blocks(); ++b) {
    int c, j;
    sp.block(b, c, j);
    std::vector<double> a(threads), g(threads);
    for (int t = 0; t < threads; ++t) per_thread(c, j, t, a[std::size_t(t)], g[std::size_t(t)]);
    partials[std::size_t(2 * b)] = block_sum(a);
    partials[std::size_t(2 * b + 1)] = block_sum(g);
  }
  partials[std::size_t(sp.count_at())] = double(sp.count);
  return partials;
}
// batch_norm_combine_kernel: every channel's totals from a replica's partials.
std::vector<double> emulate_combine(const BatchNormSplit& sp, const std::vector<double>& partials) {
  std::vector<double> totals(sp.totals_doubles(), std::nan(""));
  for (int c = 0; c < sp.channels; ++c) k::cuda::batch_norm_combine_channel(sp, partials.data(), c, totals.data());
  return totals;
}
// The replicas' ReplicaSum: element by element.
std::vector<double> added(const std::vector<std::vector<double>>& each) {
  std::vector<double> sum(each[0].size(), 0.0);
  for (const auto& v : each) {
    REQUIRE(v.size() == sum.size());  // every replica's totals have the same layout, whatever its shard
    for (std::size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return sum;
}

}  // namespace

TEST_CASE("SyncBatchNorm's Cuda passes, emulated over replicas split otherwise: the statistics and gradients of "
          "all their values") {
  using Epi = k::Epilogue<k::Relu>;
  // Shards of 20, 9, 3 and 0 samples of 2 x 32 x 32: 5, 2, 1 and 1 (empty) chunks a channel.
  const int channels = 2, plane = 1024;
  const std::vector<int> shards{20, 9, 3, 0};
  std::vector<BatchNormSplit> splits;
  std::vector<std::vector<float>> xs;
  for (std::size_t r = 0; r < shards.size(); ++r) {
    splits.push_back(BatchNormSplit::training(shards[r], channels, plane));
    xs.push_back(random_values(std::size_t(shards[r]) * channels * plane, 3.0f + float(r), 0.5f, 31u + unsigned(r)));
  }
  CHECK(splits[0].chunks == 5);
  CHECK(splits[1].chunks == 2);
  CHECK(splits[2].chunks == 1);
  CHECK((splits[3].chunks == 1 && splits[3].count == 0));
  // Forward: the sums, added; the squared deviations from the global mean, added.
  std::vector<std::vector<double>> each;
  for (std::size_t r = 0; r < shards.size(); ++r)
    each.push_back(emulate_combine(splits[r], emulate_partials(splits[r], [&](int c, int j, int t, double& a, double& b) {
                                     k::cuda::batch_norm_thread_sums(splits[r], c, j, t, xs[r].data(), 0.0, a, b);
                                   })));
  const std::vector<double> sums = added(each);
  each.clear();
  for (std::size_t r = 0; r < shards.size(); ++r)
    each.push_back(emulate_combine(splits[r], emulate_partials(splits[r], [&](int c, int j, int t, double& a, double& b) {
                                     k::cuda::batch_norm_thread_sums(splits[r], c, j, t, xs[r].data(),
                                                                     sums[std::size_t(2 * c)] / sums[2 * channels], a, b);
                                   })));
  const std::vector<double> squares = added(each);
  const double count = sums[2 * channels];
  CHECK(count == double((20 + 9 + 3) * plane));
  std::vector<double> mean(channels), invstd(channels);
  for (int c = 0; c < channels; ++c) {
    double s = 0, n = 0;
    for (std::size_t r = 0; r < shards.size(); ++r)
      for (int i = 0; i < shards[r]; ++i)
        for (int p = 0; p < plane; ++p, ++n) s += xs[r][(std::size_t(i) * channels + c) * plane + p];
    const double m = s / n;
    double q = 0;
    for (std::size_t r = 0; r < shards.size(); ++r)
      for (int i = 0; i < shards[r]; ++i)
        for (int p = 0; p < plane; ++p) {
          const double d = xs[r][(std::size_t(i) * channels + c) * plane + p] - m;
          q += d * d;
        }
    CHECK(std::abs(sums[std::size_t(2 * c)] / count - m) <= 1e-13 * std::abs(m));
    CHECK(std::abs(squares[std::size_t(2 * c + 1)] / count - q / n) <= 1e-12 * q / n);
    mean[std::size_t(c)] = m;
    invstd[std::size_t(c)] = 1 / std::sqrt(q / n + 1e-5);
  }
  // Backward: each replica's dz sums, its own parameter gradients from them, then the added totals.
  std::vector<std::vector<float>> dys, dxs;
  each.clear();
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const auto& sp = splits[r];
    const auto y = random_values(xs[r].size(), 0.0f, 1.0f, 41u + unsigned(r));
    dys.push_back(random_values(xs[r].size(), 0.0f, 1.0f, 51u + unsigned(r)));
    std::vector<float> dy = dys[r];
    for (std::size_t i = 0; i < dy.size(); ++i) dys[r][i] = y[i] > 0 ? dys[r][i] : 0.0f;  // dz, for the reference
    const auto partials = emulate_partials(sp, [&](int c, int j, int t, double& a, double& b) {
      k::cuda::batch_norm_gradient_thread<Epi>(sp, c, j, t, float(mean[std::size_t(c)]),
                                               float(invstd[std::size_t(c)]), xs[r].data(), y.data(),
                                               static_cast<const float*>(nullptr), dy.data(), a, b);
    });
    CHECK(dy == dys[r]);
    each.push_back(emulate_combine(sp, partials));
    dxs.push_back(std::move(dy));  // dz, which the input gradient reads
  }
  const std::vector<double> totals = added(each);
  CHECK(totals[2 * channels] == count);
  for (int c = 0; c < channels; ++c) {
    double sdz = 0, sdzx = 0;
    for (std::size_t r = 0; r < shards.size(); ++r) {
      double own = 0;
      for (int i = 0; i < shards[r]; ++i)
        for (int p = 0; p < plane; ++p) {
          const std::size_t at = (std::size_t(i) * channels + c) * plane + p;
          const double xhat = double(float((xs[r][at] - float(mean[std::size_t(c)])) * float(invstd[std::size_t(c)])));
          own += dys[r][at];
          sdz += dys[r][at];
          sdzx += dys[r][at] * xhat;
        }
      CHECK(std::abs(each[r][std::size_t(2 * c)] - own) <= 1e-12 * (1 + std::abs(own)));  // this replica's dbeta
    }
    CHECK(std::abs(totals[std::size_t(2 * c)] - sdz) <= 1e-12 * (1 + std::abs(sdz)));
    CHECK(std::abs(totals[std::size_t(2 * c + 1)] - sdzx) <= 1e-9 * (1 + std::abs(sdzx)));
  }
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const auto& sp = splits[r];
    std::vector<float> dx(xs[r].size(), std::nanf(""));
    for (int b = 0; b < sp.blocks(); ++b) {
      int c, j;
      sp.block(b, c, j);
      double a, g;
      k::cuda::batch_norm_channel_totals(totals.data(), 1, c, a, g);
      for (int t = 0; t < threads; ++t)
        k::cuda::batch_norm_input_gradient_thread(sp, c, j, t, 1.0f, float(mean[std::size_t(c)]),
                                                  float(invstd[std::size_t(c)]), xs[r].data(), dxs[r].data(),
                                                  dx.data(), a, g, totals[2 * channels], false);
    }
    for (int c = 0; c < channels; ++c)
      for (int i = 0; i < shards[r]; ++i)
        for (int p = 0; p < plane; ++p) {
          const std::size_t at = (std::size_t(i) * channels + c) * plane + p;
          const double xhat = (double(xs[r][at]) - float(mean[std::size_t(c)])) * float(invstd[std::size_t(c)]);
          const double want = double(float(invstd[std::size_t(c)])) *
                              (dys[r][at] - totals[std::size_t(2 * c)] / count -
                               xhat * totals[std::size_t(2 * c + 1)] / count);
          REQUIRE(std::abs(dx[at] - want) <= 1e-5 * (1 + std::abs(want)));
        }
  }
}
