// The Host pooling kernels (include/fusedp/kernels/host/pool.hpp) against naive double-precision
// loops: max (the 2x2 stride-2 vector path and the generic one, overlapping windows, ties resolved to
// the first maximum in scan order) and average pooling, with epilogues, odd sizes whose last row and
// column no window covers, 1 to 3 threads.
#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/host/pool.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

namespace kh = fusedp::kernels::host;
namespace k = fusedp::kernels;

namespace {

using kernel_test::value;

}  // namespace

namespace {

template <k::PoolOp Op, int K, int S, class Epi, class T>
void check_pool(int c, int h, int w, std::size_t batch, int threads) {
  CAPTURE(c);
  CAPTURE(h);
  CAPTURE(w);
  CAPTURE(K);
  CAPTURE(S);
  CAPTURE(threads);
  const fusedp::Host host{threads};
  const k::ConvGeometry g{c, h, w, K, S, 0, c, (h - K) / S + 1, (w - K) / S + 1};
  std::vector<T> x(batch * g.in_size()), y(batch * g.out_size()), z(batch * g.out_size()), dy(batch * g.out_size());
  std::vector<T> dx(batch * g.in_size(), T(7));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(value(5, i));
  // Ties: every seventh input repeats its neighbour, so "the first maximum" matters.
  for (std::size_t i = 1; i < x.size(); i += 7) x[i] = x[i - 1];
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = T(value(6, i));
  const std::vector<T> dy_in = dy;
  kh::pool_forward<Op, K, S, Epi>(host, g, batch, x.data(), y.data(), Epi::saves_input ? z.data() : nullptr);
  kh::pool_backward<Op, K, S, Epi>(host, g, batch, x.data(), y.data(), Epi::saves_input ? z.data() : nullptr,
                                   dy.data(), dx.data());
  std::vector<double> ddx(x.size(), 0.0);
  std::size_t bad = 0;
  for (std::size_t p = 0; p < batch * std::size_t(c); ++p)
    for (int oy = 0; oy < g.out_h; ++oy)
      for (int ox = 0; ox < g.out_w; ++ox) {
        double v = Op == k::PoolOp::max ? -1e300 : 0.0;
        std::size_t arg = 0;
        for (int ky = 0; ky < K; ++ky)
          for (int kx = 0; kx < K; ++kx) {
            const std::size_t i = p * g.in_size() / std::size_t(c) + std::size_t(oy * S + ky) * w + std::size_t(ox * S + kx);
            if (Op == k::PoolOp::max) {
              if (double(x[i]) > v) {
                v = double(x[i]);
                arg = i;
              }
            } else {
              v += double(x[i]) / (K * K);
            }
          }
        const std::size_t o = p * g.out_pixels() + std::size_t(oy) * g.out_w + ox;
        const double yr = Epi::apply(v);
        if (std::abs(double(y[o]) - yr) > 1e-6 * (std::abs(yr) + 1)) ++bad;
        const double d = double(dy_in[o]) * Epi::derivative(v, yr);
        if (Op == k::PoolOp::max) {
          ddx[arg] += d;
        } else {
          for (int ky = 0; ky < K; ++ky)
            for (int kx = 0; kx < K; ++kx)
              ddx[p * g.in_size() / std::size_t(c) + std::size_t(oy * S + ky) * w + std::size_t(ox * S + kx)] += d / (K * K);
        }
      }
  for (std::size_t i = 0; i < dx.size(); ++i)
    if (std::abs(double(dx[i]) - ddx[i]) > 1e-6 * (std::abs(ddx[i]) + 1)) ++bad;
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("max and average pooling match a double reference, ties to the first maximum", T, float, double) {
  for (int threads = 1; threads <= 3; ++threads) {
    check_pool<k::PoolOp::max, 2, 2, k::Epilogue<>, T>(6, 24, 24, 3, threads);     // LeNet
    check_pool<k::PoolOp::max, 2, 2, k::Epilogue<k::Relu>, T>(3, 11, 9, 2, threads);  // odd: last row/col dropped
    check_pool<k::PoolOp::max, 2, 2, k::Epilogue<k::Tanh>, T>(2, 5, 70, 2, threads);  // rows of 35: every chunk width
    check_pool<k::PoolOp::max, 3, 2, k::Epilogue<k::Tanh>, T>(2, 9, 10, 2, threads);  // overlapping windows
    check_pool<k::PoolOp::max, 3, 3, k::Epilogue<>, T>(2, 10, 11, 2, threads);
    check_pool<k::PoolOp::average, 2, 2, k::Epilogue<k::Gelu>, T>(3, 7, 8, 2, threads);
    check_pool<k::PoolOp::average, 3, 1, k::Epilogue<>, T>(2, 6, 5, 2, threads);
  }
}

TEST_CASE("2x2 max pooling propagates NaN and sends its gradient there") {
  const fusedp::Host host{1};
  const k::ConvGeometry g{1, 2, 40, 2, 2, 0, 1, 1, 20};
  std::vector<float> x(80, 0.5f), y(20), dy(20, 1.0f), dx(80, 7.0f);
  x[3] = std::nanf("");   // window 1, top right
  x[40 + 10] = 9.0f;      // window 5, bottom left
  kh::pool_forward<k::PoolOp::max, 2, 2, k::Epilogue<>>(host, g, 1, x.data(), y.data(), static_cast<float*>(nullptr));
  CHECK(std::isnan(y[1]));
  CHECK(y[5] == 9.0f);
  CHECK(y[0] == 0.5f);
  kh::pool_backward<k::PoolOp::max, 2, 2, k::Epilogue<>>(host, g, 1, x.data(), y.data(), static_cast<float*>(nullptr),
                                                          dy.data(), dx.data());
  CHECK(dx[3] == 1.0f);
  CHECK(dx[2] == 0.0f);
  CHECK(dx[50] == 1.0f);
  CHECK(dx[0] == 1.0f);  // all equal: the first in scan order
  CHECK(dx[1] == 0.0f);
  CHECK(dx[40] == 0.0f);
}
