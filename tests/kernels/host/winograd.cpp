// Winograd F(4x4, 3x3) on the Host (include/fusedp/kernels/host/winograd.hpp): the transforms against
// the direct 3x3 correlation in double, the three products of a conv (forward, weight and input
// gradients) against naive double loops at geometries whose planes are not multiples of a tile,
// whose tiles span several samples per lane group and several blocks, for 1 to 3 threads; and the
// forward's bits independent of the batch split and the thread count.
#include <fusedp/kernels/host/winograd.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace kh = fusedp::kernels::host;
namespace kw = fusedp::kernels::host::winograd;
namespace k = fusedp::kernels;

namespace {

using kernel_test::value;

constexpr k::ConvGeometry same3x3(int c, int h, int w, int o) { return {c, h, w, 3, 1, 1, o, h, w}; }

// |got - ref| <= tol * (sum of |terms| + 1) for every element; the worst ratio is reported.
struct Bound {
  double tol, worst = 0;
  std::size_t bad = 0;
  void check(double got, double ref, double magnitude) {
    const double e = std::abs(got - ref) / (magnitude + 1.0);
    worst = std::max(worst, e);
    if (!(e <= tol)) ++bad;
  }
};

template <class T>
void check_products(const k::ConvGeometry& g, std::size_t batch, int threads) {
  CAPTURE(g.in_channels);
  CAPTURE(g.in_h);
  CAPTURE(g.in_w);
  CAPTURE(g.out_channels);
  CAPTURE(batch);
  CAPTURE(threads);
  REQUIRE(kw::applies(g));
  const fusedp::Host host{threads};
  const std::size_t C = std::size_t(g.in_channels), O = std::size_t(g.out_channels);
  const std::size_t H = std::size_t(g.in_h), W = std::size_t(g.in_w), P = H * W;
  std::vector<T> w(O * C * 9), x(batch * C * P), dz(batch * O * P), y(batch * O * P, T(7)), dx(batch * C * P, T(7));
  std::vector<T> dw(O * C * 9, T(7));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = T(value(11, i));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(value(12, i));
  for (std::size_t i = 0; i < dz.size(); ++i) dz[i] = T(value(13, i));
  const kw::Plan fwd{g}, bwd{kw::transposed(g)};
  const std::size_t per = std::max({fwd.per_thread(), fwd.weight_gradient_per_thread(), bwd.per_thread()});
  std::vector<T> scratch(std::size_t(threads) * per, T(-3));

  kw::conv3x3(host, g, batch, w.data(), false, x.data(), y.data(), scratch.data(),
              [](std::size_t) { return kh::NoEpilogue{}; });
  kw::weight_gradient3x3(host, g, batch, x.data(), dz.data(), dw.data(), scratch.data());
  kw::conv3x3(host, kw::transposed(g), batch, w.data(), true, dz.data(), dx.data(), scratch.data(),
              [](std::size_t) { return kh::NoEpilogue{}; });

  // F(4x4, 3x3) in fp32 loses a few more bits than a direct sum: the worst errors measured on these
  // geometries are 3.1e-6 (y), 2.6e-6 (dx) and 1.4e-6 (dw) of the magnitude sum, 5e-15 in double;
  // the bounds leave 6x and 20x.
  const double tol = sizeof(T) == 4 ? 2e-5 : 1e-13;
  Bound by{tol}, bdx{tol}, bdw{tol};
  std::vector<double> rdx(dx.size(), 0.0), mdx(dx.size(), 0.0), rdw(dw.size(), 0.0), mdw(dw.size(), 0.0);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t o = 0; o < O; ++o)
      for (std::size_t oy = 0; oy < H; ++oy)
        for (std::size_t ox = 0; ox < W; ++ox) {
          double acc = 0, mag = 0;
          const std::size_t at = (n * O + o) * P + oy * W + ox;
          for (std::size_t c = 0; c < C; ++c)
            for (std::size_t ky = 0; ky < 3; ++ky)
              for (std::size_t kx = 0; kx < 3; ++kx) {
                const std::ptrdiff_t iy = std::ptrdiff_t(oy + ky) - 1, ix = std::ptrdiff_t(ox + kx) - 1;
                if (iy < 0 || iy >= std::ptrdiff_t(H) || ix < 0 || ix >= std::ptrdiff_t(W)) continue;
                const std::size_t wi = (o * C + c) * 9 + ky * 3 + kx, xi = (n * C + c) * P + std::size_t(iy) * W + std::size_t(ix);
                const double t = double(w[wi]) * double(x[xi]);
                acc += t;
                mag += std::abs(t);
                const double tw = double(dz[at]) * double(x[xi]), tx = double(dz[at]) * double(w[wi]);
                rdw[wi] += tw;
                mdw[wi] += std::abs(tw);
                rdx[xi] += tx;
                mdx[xi] += std::abs(tx);
              }
          by.check(double(y[at]), acc, mag);
        }
  for (std::size_t i = 0; i < dx.size(); ++i) bdx.check(double(dx[i]), rdx[i], mdx[i]);
  for (std::size_t i = 0; i < dw.size(); ++i) bdw.check(double(dw[i]), rdw[i], mdw[i]);
  CAPTURE(by.worst);
  CAPTURE(bdx.worst);
  CAPTURE(bdw.worst);
  CHECK(by.bad == 0);
  CHECK(bdx.bad == 0);
  CHECK(bdw.bad == 0);
}

}  // namespace

TEST_CASE("winograd: the F(4x4, 3x3) transforms give the direct 3x3 correlation of a tile (double)") {
  namespace kd = kw::detail;
  for (std::size_t trial = 0; trial < 20; ++trial) {
    double d[6][6], g[9];
    for (std::size_t i = 0; i < 36; ++i) d[i / 6][i % 6] = value(20 + trial, i);
    for (std::size_t i = 0; i < 9; ++i) g[i] = value(40 + trial, i);
    // U = G g G^T
    double gw[6][3], u[6][6];
    for (std::size_t col = 0; col < 3; ++col) {
      double o[6];
      kd::weight_1d(g + col, 3, o);
      for (std::size_t i = 0; i < 6; ++i) gw[i][col] = o[i];
    }
    for (std::size_t i = 0; i < 6; ++i) kd::weight_1d(gw[i], 1, u[i]);
    // V = B^T d B
    double r[6][6], v[6][6];
    for (std::size_t i = 0; i < 6; ++i) kd::input_1d(d[i], r[i]);
    for (std::size_t nu = 0; nu < 6; ++nu) {
      double col[6], o[6];
      for (std::size_t i = 0; i < 6; ++i) col[i] = r[i][nu];
      kd::input_1d(col, o);
      for (std::size_t xi = 0; xi < 6; ++xi) v[xi][nu] = o[xi];
    }
    // Y = A^T (U . V) A
    double s[6][4], y[4][4];
    for (std::size_t xi = 0; xi < 6; ++xi) {
      double m[6];
      for (std::size_t nu = 0; nu < 6; ++nu) m[nu] = u[xi][nu] * v[xi][nu];
      kd::output_1d(m, s[xi]);
    }
    for (std::size_t c = 0; c < 4; ++c) {
      double col[6], o[4];
      for (std::size_t xi = 0; xi < 6; ++xi) col[xi] = s[xi][c];
      kd::output_1d(col, o);
      for (std::size_t i = 0; i < 4; ++i) y[i][c] = o[i];
    }
    for (std::size_t i = 0; i < 4; ++i)
      for (std::size_t j = 0; j < 4; ++j) {
        double ref = 0;
        for (std::size_t a = 0; a < 3; ++a)
          for (std::size_t b = 0; b < 3; ++b) ref += d[i + a][j + b] * g[a * 3 + b];
        CHECK(std::abs(y[i][j] - ref) < 1e-12);
      }
    // The weight gradient of the tile: G^T (V . A dY A^T) G = the correlation of d with dY.
    double dy[4][4], z[6][6], rz[4][6];
    for (std::size_t i = 0; i < 16; ++i) dy[i / 4][i % 4] = value(60 + trial, i);
    for (std::size_t i = 0; i < 4; ++i) kd::gradient_1d(dy[i], rz[i]);
    for (std::size_t nu = 0; nu < 6; ++nu) {
      double col[4], o[6];
      for (std::size_t i = 0; i < 4; ++i) col[i] = rz[i][nu];
      kd::gradient_1d(col, o);
      for (std::size_t xi = 0; xi < 6; ++xi) z[xi][nu] = o[xi];
    }
    double t[6][3], dg[3][3];
    for (std::size_t xi = 0; xi < 6; ++xi) {
      double m[6];
      for (std::size_t nu = 0; nu < 6; ++nu) m[nu] = v[xi][nu] * z[xi][nu];
      kd::weight_gradient_1d(m, t[xi]);
    }
    for (std::size_t b = 0; b < 3; ++b) {
      double col[6], o[3];
      for (std::size_t xi = 0; xi < 6; ++xi) col[xi] = t[xi][b];
      kd::weight_gradient_1d(col, o);
      for (std::size_t a = 0; a < 3; ++a) dg[a][b] = o[a];
    }
    for (std::size_t a = 0; a < 3; ++a)
      for (std::size_t b = 0; b < 3; ++b) {
        double ref = 0;
        for (std::size_t i = 0; i < 4; ++i)
          for (std::size_t j = 0; j < 4; ++j) ref += d[a + i][b + j] * dy[i][j];
        CHECK(std::abs(dg[a][b] - ref) < 1e-12);
      }
  }
}

TEST_CASE("winograd: which convs it takes") {
  CHECK(kw::applies(same3x3(64, 32, 32, 64)));
  CHECK(kw::applies(same3x3(16, 1, 1, 16)));
  CHECK_FALSE(kw::applies(same3x3(15, 8, 8, 64)));   // too few input channels
  CHECK_FALSE(kw::applies(same3x3(64, 8, 8, 15)));   // too few output channels
  CHECK_FALSE(kw::applies({64, 8, 8, 3, 2, 1, 64, 4, 4}));  // stride 2
  CHECK_FALSE(kw::applies({64, 8, 8, 3, 1, 0, 64, 6, 6}));  // no padding
  CHECK_FALSE(kw::applies({64, 8, 8, 5, 1, 2, 64, 8, 8}));  // 5x5
  const kw::Plan p{same3x3(16, 7, 9, 19)};
  CHECK(p.tiles_h() == 2);
  CHECK(p.tiles_w() == 3);
  CHECK(kw::transposed(same3x3(16, 7, 9, 19)).in_channels == 19);
  CHECK(kw::transposed(same3x3(16, 7, 9, 19)).out_channels == 16);
}

TEST_CASE_TEMPLATE("winograd: forward, weight and input gradients match a double reference", T, float, double) {
  for (int threads = 1; threads <= 3; ++threads) {
    check_products<T>(same3x3(16, 7, 9, 19), 3, threads);    // partial tiles at the bottom and right
    check_products<T>(same3x3(17, 4, 4, 24), 37, threads);   // one tile per sample: groups span samples
    check_products<T>(same3x3(16, 20, 20, 16), 5, threads);  // 125 tiles: more than one block
    check_products<T>(same3x3(24, 2, 3, 16), 9, threads);    // planes smaller than a tile
    check_products<T>(same3x3(33, 8, 8, 40), 2, threads);    // channels not a multiple of the lanes
  }
  check_products<T>(same3x3(16, 1, 1, 16), 1, 1);  // a single pixel: all but the centre tap in the border
}

TEST_CASE("winograd: the forward's bits do not depend on the batch split or the thread count") {
  const k::ConvGeometry g = same3x3(32, 12, 12, 48);
  const std::size_t batch = 11, out = std::size_t(g.out_size()), in = g.in_size();
  std::vector<float> w(std::size_t(g.out_channels) * g.patch()), x(batch * in);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(value(31, i));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(value(32, i));
  const std::size_t per = kw::Plan{g}.per_thread();
  auto run = [&](int threads, std::size_t n0, std::size_t n, std::vector<float>& y) {
    std::vector<float> scratch(std::size_t(threads) * per, -3.0f);
    kw::conv3x3(fusedp::Host{threads}, g, n, w.data(), false, x.data() + n0 * in, y.data() + n0 * out, scratch.data(),
                [](std::size_t) { return kh::NoEpilogue{}; });
  };
  std::vector<float> whole(batch * out), split(batch * out), threaded(batch * out);
  run(1, 0, batch, whole);
  run(1, 0, 4, split);
  run(1, 4, batch - 4, split);
  run(3, 0, batch, threaded);
  CHECK(std::memcmp(whole.data(), split.data(), whole.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(whole.data(), threaded.data(), whole.size() * sizeof(float)) == 0);
}

TEST_CASE("winograd: U through the buffer and non-temporal stores has the bits of U stored in place") {
  // transform_weights streams where U is large (36 planes of u_plane values, 4 MiB or more) and its runs
  // are at cache lines (kd::streams: float on AVX-512): the same rows and k through planes that are
  // larger give that path; each plane's packed part must match the one stored in place.
  namespace kd = kw::detail;
  using T = float;
  auto check = [&]<class S>(std::size_t O, std::size_t C, bool rotate, std::size_t r0, std::size_t r1) {
    CAPTURE(S::mr);
    CAPTURE(O);
    CAPTURE(C);
    CAPTURE(rotate);
    CAPTURE(r0);
    const std::size_t row_step = rotate ? 9 : C * 9, k_step = rotate ? O * 9 : 9;
    std::vector<T> w(O * C * 9);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = T(value(40, i));
    const std::size_t packed = kh::detail::round_up(O, S::mr) * C;  // what a plane holds
    // Planes at cache lines, whole lines apart.
    const std::size_t line = 64 / sizeof(T), small = kh::detail::round_up(packed + 1, line);
    const std::size_t large = kh::detail::round_up((std::size_t(4) << 20) / sizeof(T) / 36 + 1, line);
    std::vector<T> a(36 * small + line, T(-7)), b(36 * large + line, T(-7));
    auto at_line = [&](std::vector<T>& v) {
      return reinterpret_cast<T*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) & ~std::uintptr_t(63));
    };
    T* in_place = at_line(a);
    T* streamed = at_line(b);
    REQUIRE_FALSE(kd::streams(in_place, small, C, S::mr));
    // Streamed wherever the runs of C x MR values are whole lines: else both are stored in place.
    CHECK(kd::streams(streamed, large, C, S::mr) == (kd::streams_u && C * S::mr % line == 0));
    kd::transform_weights<S>(w.data(), O, C, row_step, k_step, rotate, r0, r1, small, in_place);
    kd::transform_weights<S>(w.data(), O, C, row_step, k_step, rotate, r0, r1, large, streamed);
    std::size_t differ = 0, written = 0;
    for (std::size_t pt = 0; pt < 36; ++pt)
      for (std::size_t i = 0; i < packed; ++i) {
        differ += std::memcmp(&in_place[pt * small + i], &streamed[pt * large + i], sizeof(T)) != 0;
        written += in_place[pt * small + i] != T(-7);
      }
    CHECK(differ == 0);
    CHECK(written > 0);
  };
  // Every tile shape of this target (their panels of 12, 6, 16 and 8 rows under AVX-512): k in whole
  // blocks of 8 and not (20, 28), one panel or several, padding rows in the last, runs not at lines (5).
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto shape = [&]<class S>() {
      for (bool rotate : {false, true})
        for (std::size_t O : {1u, 13u, 40u, 64u})
          for (std::size_t C : {5u, 8u, 20u, 28u, 40u}) check.template operator()<S>(O, C, rotate, 0, O);
      // A thread's share of the panels, as conv3x3 deals them out.
      check.template operator()<S>(5 * S::mr, 28, false, S::mr, 3 * S::mr);
      check.template operator()<S>(5 * S::mr + 1, 28, true, 3 * S::mr, 5 * S::mr + 1);
    };
    (shape.template operator()<kh::detail::shape_at<I>>(), ...);
  }(std::make_index_sequence<kh::detail::shapes.size()>{});
  // Double never streams (its runs through the buffer would be copies, slower than storing in place).
  std::vector<double> d(64);
  CHECK_FALSE(kd::streams(d.data(), std::size_t(1) << 20, 64, 8));
}
