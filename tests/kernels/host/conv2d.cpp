// The Host convolution kernels (include/fusedp/kernels/host/conv2d.hpp) against
// naive double-precision loops: forward (im2col into packed panels, shared packed weights, the
// epilogue per tile) and backward (weight, bias and input gradients) at geometries that are multiples
// of nothing (kernel 1 direct, 2, 3, 5; stride 1-3; padding 0-2; the LeNet and CIFAR shapes), with
// epilogues that save z or not, for 1 to 3 threads.
#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/host/conv2d.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <vector>

namespace kh = fusedp::kernels::host;
namespace k = fusedp::kernels;

namespace {

using kernel_test::value;

constexpr k::ConvGeometry geometry(int c, int h, int w, int kernel, int stride, int pad, int o) {
  return {c, h, w, kernel, stride, pad, o, (h + 2 * pad - kernel) / stride + 1, (w + 2 * pad - kernel) / stride + 1};
}

// |got - ref| within tol * (magnitude + 1), counted.
struct Mismatches {
  double tol;
  std::size_t bad = 0;
  double worst = 0;
  void check(double got, double ref, double magnitude) {
    const double err = std::abs(got - ref) / (magnitude + 1.0);
    worst = std::max(worst, err);
    if (!(err <= tol)) ++bad;
  }
};

// precision bf16: the reference rounds what the kernels' GEMMs round (W, x and dz, the dz as the kernel
// computed it); the direct path's forward and weight gradient (no GEMM) stay fp32, its input gradient
// is a GEMM.
template <class Epi, class T>
void check_conv(const k::ConvGeometry& g, std::size_t batch, int threads, bool first_layer,
                fusedp::HostPrecision precision = fusedp::HostPrecision::fp32, bool tiles = true) {
  CAPTURE(g.in_channels);
  CAPTURE(g.in_h);
  CAPTURE(g.in_w);
  CAPTURE(g.kernel);
  CAPTURE(g.stride);
  CAPTURE(g.pad);
  CAPTURE(g.out_channels);
  CAPTURE(batch);
  CAPTURE(threads);
  CAPTURE(std::string(fusedp::to_string(precision)));
  CAPTURE(tiles);
  const fusedp::Host host = fusedp::Host{threads, precision}.with_bf16_tiles(tiles && fusedp::amx_usable());
  const bool bf16 = precision != fusedp::HostPrecision::fp32;
  // forward and weight gradient: the direct path's stay fp32, unless the bf16 direct path takes the conv
  const bool rounds = bf16 && (!kh::detail::use_direct<T>(g) || kh::detail::direct_bf16_runs<T>(host, g));
  auto r = [&](T v) { return rounds ? double(fusedp::kernels::round_bf16(float(v))) : double(v); };
  auto r_dx = [&](T v) { return bf16 ? double(fusedp::kernels::round_bf16(float(v))) : double(v); };
  const std::size_t O = std::size_t(g.out_channels), K = g.patch(), P = g.out_pixels();
  std::vector<T> w(O * K), b(O), x(batch * g.in_size()), y(batch * g.out_size()), z(batch * g.out_size());
  std::vector<T> dy(batch * g.out_size()), dx(batch * g.in_size()), dw(O * K), db(O);
  std::vector<T> scratch(std::size_t(threads) * kh::ConvScratch{g}.per_thread());
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = T(value(1, i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = T(value(2, i));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(value(3, i));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = T(value(4, i));
  // Garbage in the outputs and the scratch: every kernel must overwrite, not accumulate.
  std::fill(y.begin(), y.end(), T(7));
  std::fill(dx.begin(), dx.end(), T(7));
  std::fill(scratch.begin(), scratch.end(), T(-3));
  const std::vector<T> dy_in = dy;

  kh::conv2d_forward<Epi>(host, g, batch, w.data(), b.data(), x.data(), y.data(), Epi::saves_input ? z.data() : nullptr,
                          scratch.data());
  std::fill(scratch.begin(), scratch.end(), T(-3));
  kh::conv2d_backward<Epi>(host, g, batch, w.data(), x.data(), y.data(), Epi::saves_input ? z.data() : nullptr,
                           dy.data(), first_layer ? nullptr : dx.data(), dw.data(), db.data(), scratch.data());

  const double tol = sizeof(T) == 4 ? 2e-6 * double(K + 8) : 1e-13 * double(K + 8);
  Mismatches fwd{tol}, grad{tol * 4};
  // Forward and dz = dy * Epi'(z) in double.
  std::vector<double> dz(batch * g.out_size());
  std::vector<double> ddx(batch * g.in_size(), 0.0), mag_dx(batch * g.in_size(), 0.0);
  std::vector<double> ddw(O * K, 0.0), mag_dw(O * K, 0.0), ddb(O, 0.0), mag_db(O, 0.0);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t o = 0; o < O; ++o)
      for (int oy = 0; oy < g.out_h; ++oy)
        for (int ox = 0; ox < g.out_w; ++ox) {
          double acc = double(b[o]), mag = std::abs(double(b[o]));
          for (int c = 0; c < g.in_channels; ++c)
            for (int ky = 0; ky < g.kernel; ++ky)
              for (int kx = 0; kx < g.kernel; ++kx) {
                const int iy = oy * g.stride - g.pad + ky, ix = ox * g.stride - g.pad + kx;
                if (iy < 0 || iy >= g.in_h || ix < 0 || ix >= g.in_w) continue;
                const double t = r(w[(o * std::size_t(g.in_channels) + c) * g.kernel * g.kernel + ky * g.kernel + kx]) *
                                 r(x[n * g.in_size() + (std::size_t(c) * g.in_h + iy) * g.in_w + ix]);
                acc += t;
                mag += std::abs(t);
              }
          const std::size_t at = n * g.out_size() + o * P + std::size_t(oy) * g.out_w + ox;
          const double yr = Epi::apply(acc);
          fwd.check(double(y[at]), yr, mag);
          if constexpr (Epi::saves_input) fwd.check(double(z[at]), acc, mag);
          dz[at] = double(dy_in[at]) * Epi::derivative(acc, yr);
          grad.check(double(dy[at]), dz[at], std::abs(dz[at]));
        }
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t o = 0; o < O; ++o)
      for (int oy = 0; oy < g.out_h; ++oy)
        for (int ox = 0; ox < g.out_w; ++ox) {
          const std::size_t at = n * g.out_size() + o * P + std::size_t(oy) * g.out_w + ox;
          const double d = rounds ? r(dy[at]) : dz[at];
          const double d_dx = bf16 ? r_dx(dy[at]) : dz[at];
          ddb[o] += dz[at];
          mag_db[o] += std::abs(dz[at]);
          for (int c = 0; c < g.in_channels; ++c)
            for (int ky = 0; ky < g.kernel; ++ky)
              for (int kx = 0; kx < g.kernel; ++kx) {
                const int iy = oy * g.stride - g.pad + ky, ix = ox * g.stride - g.pad + kx;
                if (iy < 0 || iy >= g.in_h || ix < 0 || ix >= g.in_w) continue;
                const std::size_t wi = (o * std::size_t(g.in_channels) + c) * g.kernel * g.kernel + ky * g.kernel + kx;
                const std::size_t xi = n * g.in_size() + (std::size_t(c) * g.in_h + iy) * g.in_w + ix;
                ddw[wi] += d * r(x[xi]);
                mag_dw[wi] += std::abs(d * r(x[xi]));
                ddx[xi] += d_dx * r_dx(w[wi]);
                mag_dx[xi] += std::abs(d_dx * r_dx(w[wi]));
              }
        }
  for (std::size_t i = 0; i < O * K; ++i) grad.check(double(dw[i]), ddw[i], mag_dw[i]);
  for (std::size_t o = 0; o < O; ++o) grad.check(double(db[o]), ddb[o], mag_db[o]);
  if (!first_layer)
    for (std::size_t i = 0; i < dx.size(); ++i) grad.check(double(dx[i]), ddx[i], mag_dx[i]);
  CAPTURE(fwd.worst);
  CAPTURE(grad.worst);
  CHECK(fwd.bad == 0);
  CHECK(grad.bad == 0);
}

const k::ConvGeometry geometries[] = {
    geometry(1, 28, 28, 5, 1, 0, 6),    // LeNet conv1
    geometry(6, 12, 12, 3, 1, 0, 16),   // LeNet conv2
    geometry(3, 32, 32, 3, 1, 1, 64),   // CIFAR conv1
    geometry(5, 7, 9, 1, 1, 0, 3),      // 1x1: the direct path
    geometry(3, 9, 11, 3, 2, 1, 13),    // stride 2, pad 1
    geometry(2, 10, 8, 4, 3, 2, 5),     // kernel 4, stride 3, pad 2
    geometry(4, 6, 7, 5, 1, 2, 17),     // 5x5 'same', odd channel count
    geometry(7, 5, 13, 2, 1, 0, 29),    // kernel 2, rows that cross panels unevenly
    // More output channels than the direct path takes (in float) and small planes: the GEMM path on
    // products narrower than a register tile, as in ResNet's last stages.
    geometry(8, 4, 4, 3, 1, 1, 40),     // ResNet's last stage in small: 16 output pixels
    geometry(6, 8, 8, 3, 2, 1, 36),     // a stride-2 projection: 4x4 out of 8x8
    geometry(12, 4, 4, 1, 1, 0, 48),    // 1x1 stride 1: the product reads the input itself
    geometry(10, 9, 7, 3, 1, 0, 33),    // 35 output pixels: a partial last panel
    // 64 output pixels and more: the weight gradient as dW^T with the im2col matrix read in place.
    geometry(16, 10, 10, 3, 1, 1, 40),  // 100 pixels, 40 channels
    geometry(28, 8, 8, 3, 1, 1, 264),   // dW^T of 252 x 264 (over 64 K values): reduced by all threads
};

}  // namespace

TEST_CASE_TEMPLATE("conv2d forward and backward match a double reference", T, float, double) {
  for (const auto& g : geometries)
    for (int threads = 1; threads <= 3; ++threads) {
      check_conv<k::Epilogue<>, T>(g, 5, threads, false);
      check_conv<k::Epilogue<k::Tanh>, T>(g, 3, threads, threads == 2);
      check_conv<k::Epilogue<k::Sigmoid, k::Gelu>, T>(g, 4, threads, false);
    }
}

TEST_CASE("conv2d at precision bf16: the GEMMs' operands rounded to bf16, the direct path fp32") {
  std::vector<fusedp::HostPrecision> precisions{fusedp::HostPrecision::bf16_emulated};
  if (fusedp::cpu_features().avx512_bf16) precisions.push_back(fusedp::HostPrecision::bf16);
  // AMX tiles where the CPU has them (the products 16 or more deep), and VDPBF16PS alone.
  for (const auto precision : precisions)
    for (const bool tiles : {true, false}) {
      if (!tiles && !fusedp::amx_usable()) continue;
      for (const auto& g : geometries)
        for (int threads = 1; threads <= 2; ++threads) {
          check_conv<k::Epilogue<>, float>(g, 3, threads, false, precision, tiles);
          check_conv<k::Epilogue<k::Tanh>, float>(g, 2, threads, threads == 2, precision, tiles);
        }
    }
}

namespace {
// The direct path's products: on AMX tiles where the CPU has them, and by VDPBF16PS (the only one on a
// CPU with AVX-512 BF16 and no tiles, such as AMD's Zen 4).
std::vector<bool> direct_kinds() {
  std::vector<bool> tiles{false};
  if (fusedp::amx_usable()) tiles.push_back(true);
  return tiles;
}

// The direct path on `geometries` against double, over `batches`, 1-3 threads and both products.
void check_direct_bf16(std::initializer_list<k::ConvGeometry> geometries, std::initializer_list<std::size_t> batches) {
  const fusedp::Host bf16{2, fusedp::HostPrecision::bf16};
  for (const bool tiles : direct_kinds())
    for (const auto& g : geometries) {
      REQUIRE(kh::detail::direct_bf16_runs<float>(bf16.with_bf16_tiles(tiles), g));
      for (int threads = 1; threads <= 3; ++threads)
        for (std::size_t batch : batches) {
          check_conv<k::Epilogue<>, float>(g, batch, threads, false, fusedp::HostPrecision::bf16, tiles);
          check_conv<k::Epilogue<k::Tanh>, float>(g, batch, threads, threads == 2, fusedp::HostPrecision::bf16, tiles);
        }
    }
}
}  // namespace

TEST_CASE("conv2d at bf16: 3x3 convs straight from the padded grid, no im2col") {
  if (!fusedp::cpu_features().avx512_bf16) {
    MESSAGE("skipped: this CPU has no AVX-512 BF16");
    return;
  }
  // Planes whose grid rows end inside a register block (17 x 19: 357 positions in blocks of 32),
  // 16 wide (the narrowest taken), several blocks of channels in and out, 32 output channels (where
  // fp32 would take the direct path).
  const k::ConvGeometry direct[] = {geometry(32, 16, 16, 3, 1, 1, 32), geometry(64, 17, 19, 3, 1, 1, 96),
                                    geometry(96, 20, 16, 3, 1, 1, 64)};
  check_direct_bf16({direct[0], direct[1], direct[2]}, {3});
  // Not taken: 3 wide, 3 input channels (CIFAR's first conv), stride 3, padding 0, and bf16 emulated.
  const fusedp::Host bf16{2, fusedp::HostPrecision::bf16};
  CHECK_FALSE(kh::detail::direct_bf16_runs<float>(bf16, geometry(64, 8, 3, 3, 1, 1, 64)));
  CHECK_FALSE(kh::detail::direct_bf16_runs<float>(bf16, geometry(3, 32, 32, 3, 1, 1, 64)));
  CHECK_FALSE(kh::detail::direct_bf16_runs<float>(bf16, geometry(64, 32, 32, 3, 3, 1, 64)));
  CHECK_FALSE(kh::detail::direct_bf16_runs<float>(bf16, geometry(64, 32, 32, 3, 1, 0, 64)));
  CHECK_FALSE(kh::detail::direct_bf16_runs<float>(fusedp::Host{2, fusedp::HostPrecision::bf16_emulated}, direct[0]));
  // The forward too, but by VDPBF16PS only on planes min_width or wider (no samples side by side), or
  // where the GEMM would not take it (32 output channels on AVX-512: the fp32 direct path's).
  for (const bool tiles : direct_kinds()) {
    const fusedp::Host host = bf16.with_bf16_tiles(tiles);
    CHECK(kh::detail::direct_bf16_forward<float>(host, direct[0]));
    CHECK(kh::detail::direct_bf16_forward<float>(host, geometry(32, 8, 8, 3, 1, 1, 64)) == tiles);
    CHECK(kh::detail::direct_bf16_forward<float>(host, geometry(32, 16, 16, 3, 2, 1, 64)) == tiles);
    const k::ConvGeometry few = geometry(64, 4, 4, 3, 1, 1, 32);  // (use_direct depends on the vector width)
    CHECK(kh::detail::direct_bf16_forward<float>(host, few) == (tiles || kh::detail::use_direct<float>(few)));
  }
}

TEST_CASE("conv2d at bf16 direct, small planes: several samples side by side on one grid") {
  if (!fusedp::cpu_features().avx512_bf16) {
    MESSAGE("skipped: this CPU has no AVX-512 BF16");
    return;
  }
  // Planes under 16 wide put up to 64 / W samples in a row of one grid (ResNet-18's 8 x 8 and 4 x 4 in
  // small; 7 wide with rows of 5, 12 and 15 wide, three blocks of input channels), a group size per
  // thread, the weight gradient over several groups a pass: batches of 2, 13 and 37 over 1-3 threads
  // give groups whole and partial, a thread's samples in one pass or in several (8 x 8: two groups of 8
  // a pass), and a thread with one sample.
  for (const auto& g : {geometry(32, 8, 8, 3, 1, 1, 64), geometry(64, 4, 4, 3, 1, 1, 32), geometry(32, 5, 7, 3, 1, 1, 32),
                        geometry(32, 6, 12, 3, 1, 1, 64), geometry(32, 3, 15, 3, 1, 1, 32), geometry(96, 4, 4, 3, 1, 1, 32)})
    REQUIRE(kh::conv3x3_bf16::max_samples(g) > 1);
  check_direct_bf16({geometry(32, 8, 8, 3, 1, 1, 64), geometry(64, 4, 4, 3, 1, 1, 32), geometry(32, 5, 7, 3, 1, 1, 32),
                     geometry(32, 6, 12, 3, 1, 1, 64), geometry(32, 3, 15, 3, 1, 1, 32), geometry(96, 4, 4, 3, 1, 1, 32)},
                    {2, 13, 37});
}

TEST_CASE("conv2d at bf16 direct, stride 2: the input's four phases on one grid") {
  if (!fusedp::cpu_features().avx512_bf16) {
    MESSAGE("skipped: this CPU has no AVX-512 BF16");
    return;
  }
  // ResNet's strided convs in small (32 -> 16, 16 -> 8 and 8 -> 4, the last two with samples side by
  // side), odd planes whose last phase row and column fall outside the input (9 x 11 -> 5 x 6; 8 x 9 ->
  // 4 x 5), over batches of 1, 5 and 19 and 1-3 threads.
  check_direct_bf16({geometry(32, 32, 32, 3, 2, 1, 32), geometry(32, 16, 16, 3, 2, 1, 64), geometry(32, 8, 8, 3, 2, 1, 32),
                     geometry(64, 9, 11, 3, 2, 1, 32), geometry(32, 8, 9, 3, 2, 1, 64)},
                    {1, 5, 19});
}

TEST_CASE("conv3x3_bf16 plans: each output once, every read inside its plane, scratch for the largest plan") {
  // Integer bookkeeping of conv3x3_bf16.hpp, checked on any CPU: for each group size a thread may take
  // and each count of images in a group, for_each_run visits each pixel of each present image once,
  // within its block of 32 positions; the farthest read (span + 2 wp + 2: stride 1's last tap, and the
  // stride-2 input gradient's) stays inside a plane; each plan's scratch fits the per-thread sizes.
  namespace c3 = kh::conv3x3_bf16;
  std::vector<k::ConvGeometry> all;
  for (int w = 4; w <= 17; ++w) all.push_back(geometry(32, w % 5 + 3, w, 3, 1, 1, 64));
  for (int w = 7; w <= 32; w += 5) all.push_back(geometry(64, w + 1, w, 3, 2, 1, 32));
  for (const auto& g : all) {
    CAPTURE(g.in_h);
    CAPTURE(g.in_w);
    CAPTURE(g.stride);
    REQUIRE(c3::applies(g));
    const std::size_t P = g.out_pixels();
    for (std::size_t s = 1; s <= c3::max_samples(g); ++s) {
      CAPTURE(s);
      const c3::Plan plan{g, s};
      CHECK(plan.span() + 2 * plan.wp() + 2 <= plan.plane());
      CHECK(plan.per_thread() <= c3::per_thread(g));
      CHECK(plan.weight_gradient_per_thread() <= c3::weight_gradient_per_thread(g));
      const c3::Plan gradient{c3::input_gradient_geometry(g), s};
      CHECK(gradient.per_thread() <= c3::per_thread(c3::input_gradient_geometry(g)));
      for (std::size_t count = 1; count <= s; ++count) {
        std::vector<int> seen(count * P, 0);
        bool inside = true;
        for (std::size_t j0 = 0; j0 < plan.span(); j0 += c3::block)
          c3::detail::for_each_run(plan, count, j0, [&](std::size_t image, std::size_t p, std::size_t at, std::size_t length) {
            inside = inside && image < count && p + length <= P && at + length <= c3::block &&
                     p / std::size_t(g.out_w) == (p + length - 1) / std::size_t(g.out_w);
            for (std::size_t i = 0; i < length && image < count && p + i < P; ++i) ++seen[image * P + p + i];
          });
        CHECK(inside);
        CHECK(std::count(seen.begin(), seen.end(), 1) == std::ptrdiff_t(seen.size()));
      }
    }
    for (std::size_t n = 0; n <= 40; ++n) {
      const c3::Plan plan = c3::Plan::for_count(g, n);
      CHECK(plan.samples >= 1);
      CHECK(plan.samples <= c3::max_samples(g));
    }
  }
}

TEST_CASE("conv3x3_bf16: the products within exactly their scratch, and as conv2d computes them") {
  if (!fusedp::cpu_features().avx512_bf16) {
    MESSAGE("skipped: this CPU has no AVX-512 BF16");
    return;
  }
  // Each product called alone with host.threads() times its own per-thread size and a canary after it:
  // nothing written past it, and the bits conv2d gets with its larger scratch. 4 x 4 with 16 samples on
  // one thread takes the largest group (16 side by side); 2 threads split 13 samples unevenly.
  namespace c3 = kh::conv3x3_bf16;
  struct Case {
    k::ConvGeometry g;
    std::size_t batch;
    int threads;
  };
  const Case cases[] = {Case{geometry(64, 4, 4, 3, 1, 1, 32), 16, 1}, Case{geometry(32, 8, 8, 3, 1, 1, 64), 13, 2},
                        Case{geometry(32, 16, 16, 3, 2, 1, 64), 13, 2}, Case{geometry(32, 9, 7, 3, 2, 1, 32), 5, 3}};
  for (const bool tiles : direct_kinds())
    for (const Case& c : cases) {
      const k::ConvGeometry& g = c.g;
      CAPTURE(g.in_w);
      CAPTURE(g.stride);
      CAPTURE(c.threads);
      CAPTURE(tiles);
      const fusedp::Host host = fusedp::Host{c.threads, fusedp::HostPrecision::bf16}.with_bf16_tiles(tiles);
      const std::size_t O = std::size_t(g.out_channels), K = g.patch(), T = std::size_t(c.threads), canary = 4096;
      std::vector<float> w(O * K), x(c.batch * g.in_size()), dz(c.batch * g.out_size());
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(value(1, i));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(value(3, i));
      for (std::size_t i = 0; i < dz.size(); ++i) dz[i] = float(value(4, i));
      // conv2d's results (no bias, no epilogue: the same products).
      std::vector<float> y_ref(dz.size()), dx_ref(x.size()), dw_ref(w.size()), dy = dz;
      std::vector<float> big(T * kh::ConvScratch{g}.per_thread());
      kh::conv2d_forward<k::Epilogue<>>(host, g, c.batch, w.data(), static_cast<const float*>(nullptr), x.data(),
                                        y_ref.data(), static_cast<float*>(nullptr), big.data());
      kh::conv2d_backward<k::Epilogue<>>(host, g, c.batch, w.data(), x.data(), y_ref.data(), static_cast<const float*>(nullptr),
                                         dy.data(), dx_ref.data(), dw_ref.data(), static_cast<float*>(nullptr), big.data());
      auto run = [&](std::size_t per_thread, const auto& product) {
        std::vector<float> scratch(T * per_thread + canary, -3.0f);
        product(scratch.data());
        CHECK(std::all_of(scratch.end() - canary, scratch.end(), [](float v) { return v == -3.0f; }));
      };
      std::vector<float> y(dz.size(), 7.0f), dx(x.size(), 7.0f), dw(w.size(), 7.0f);
      run(c3::per_thread(g), [&](float* scratch) {
        c3::conv3x3(host, g, c.batch, w.data(), x.data(), y.data(), scratch,
                     [](std::size_t) { return [](std::size_t, std::size_t, float*, std::size_t) {}; });
      });
      run(c3::per_thread(c3::input_gradient_geometry(g)),
          [&](float* scratch) { c3::input_gradient3x3(host, g, c.batch, w.data(), dz.data(), dx.data(), scratch, false); });
      run(c3::weight_gradient_per_thread(g),
          [&](float* scratch) { c3::weight_gradient3x3(host, g, c.batch, x.data(), dz.data(), dw.data(), scratch); });
      // (Without tiles, conv2d's forward on planes under min_width is the im2col GEMM: other bits.)
      if (kh::detail::direct_bf16_forward<float>(host, g)) CHECK(y == y_ref);
      CHECK(dx == dx_ref);
      CHECK(dw == dw_ref);
    }
}

TEST_CASE("conv2d with bf16_y and bf16_dx: y and dx the same values rounded to bf16, on every path") {
  std::vector<fusedp::Host> hosts{fusedp::Host{2, fusedp::HostPrecision::bf16_emulated}};
  if (fusedp::cpu_features().avx512_bf16) hosts.push_back(fusedp::Host{2, fusedp::HostPrecision::bf16}.with_bf16_tiles(false));
  if (fusedp::amx_usable()) hosts.push_back(fusedp::Host{2, fusedp::HostPrecision::bf16});
  std::vector<k::ConvGeometry> all(std::begin(geometries), std::end(geometries));
  all.push_back(geometry(32, 16, 16, 3, 1, 1, 32));  // the direct bf16 path (tiles or VDPBF16PS)
  all.push_back(geometry(32, 4, 4, 3, 1, 1, 32));    // and its samples side by side
  all.push_back(geometry(32, 9, 8, 3, 2, 1, 32));    // and stride 2
  for (const auto& host : hosts)
    for (const auto& g : all) {
      CAPTURE(std::string(fusedp::to_string(host.precision())));
      CAPTURE(host.bf16_tiles());
      CAPTURE(g.in_channels);
      CAPTURE(g.out_channels);
      CAPTURE(g.kernel);
      CAPTURE(g.stride);
      const std::size_t batch = 5, O = std::size_t(g.out_channels), K = g.patch();
      std::vector<float> w(O * K), b(O), x(batch * g.in_size()), dy(batch * g.out_size());
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(value(1, i));
      for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(value(2, i));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(value(3, i));
      for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = float(value(4, i));
      std::vector<float> scratch(2 * kh::ConvScratch{g}.per_thread());
      std::vector<float> y[2], dx[2];
      for (const bool bf16 : {false, true}) {
        std::vector<float> yb(batch * g.out_size()), z(yb.size()), dyb = dy, dxb(batch * g.in_size()), dw(O * K), db(O);
        // ReLU: its derivative (y > 0) is the same on the rounded y, so dz and dx agree too.
        using Epi = k::Epilogue<k::Relu>;
        kh::conv2d_forward<Epi>(host, g, batch, w.data(), b.data(), x.data(), yb.data(), z.data(), scratch.data(),
                                static_cast<const k::BatchNormFold<float>*>(nullptr), static_cast<const float*>(nullptr),
                                bf16);
        kh::conv2d_backward<Epi>(host, g, batch, w.data(), x.data(), yb.data(), z.data(), dyb.data(), dxb.data(), dw.data(),
                                 db.data(), scratch.data(), bf16);
        y[bf16] = yb;
        dx[bf16] = dxb;
      }
      std::size_t y_bad = 0, dx_bad = 0;
      for (std::size_t i = 0; i < y[0].size(); ++i) y_bad += fusedp::kernels::round_bf16(y[0][i]) != y[1][i];
      for (std::size_t i = 0; i < dx[0].size(); ++i) dx_bad += fusedp::kernels::round_bf16(dx[0][i]) != dx[1][i];
      CHECK(y_bad == 0);
      CHECK(dx_bad == 0);
    }
}

TEST_CASE("im2col_pairs: the pairs of im2col then pack_b, padding included, for vector and AMX panels") {
  namespace bf = kh::bf16;
  if (!bf::detail::vector_packing()) MESSAGE("this CPU packs without AVX-512: im2col_pairs is im2col then pack_b here");
  auto same = [](const k::ConvGeometry& g, auto shape) {
    using S = decltype(shape);
    CAPTURE(S::nr);
    CAPTURE(S::amx);
    CAPTURE(g.kernel);
    CAPTURE(g.stride);
    CAPTURE(g.pad);
    const kh::ConvScratch layout{g};
    std::vector<float> x(g.in_size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(value(9, i));
    std::vector<float> col(layout.col()), padded(layout.padded() + 1), col2(layout.col()), padded2(layout.padded() + 1);
    const std::size_t size = bf::packed_b_size<S>(g.patch(), g.out_pixels());
    std::vector<bf::Pair> want(size, 0xdeadbeefu), got(size, 0x7fc07fc0u);
    kh::im2col(g, x.data(), col.data(), g.out_pixels(), padded.data());
    bf::pack_b<S>(kh::row_major<float>(col.data(), g.out_pixels()), 0, g.patch(), 0, g.out_pixels(), want.data());
    kh::im2col_pairs<S>(g, x.data(), got.data(), col2.data(), padded2.data());
    CHECK(got == want);
  };
  for (const auto& g : geometries) {
    same(g, bf::AmxTile<4>{});
    same(g, bf::AmxTile<1>{});
    same(g, bf::tile_at<1>{});  // 8 x 3: panels of 48 columns
  }
}

TEST_CASE("conv2d at bf16: every tile shape's packed operands fit the regions of ConvScratch (AMX's padding included)") {
  // conv2d_forward and conv2d_backward put the bf16 pairs in scratch sized for fp32 panels; AMX pads k
  // to whole tiles of 16 pairs. Checked over every shape choose_tile can pick, tiles on and off.
  namespace bf = kh::bf16;
  std::size_t checked = 0;
  for (int c : {1, 2, 3, 5, 8, 16, 17, 33, 64})
    for (int kernel : {1, 3, 5})
      for (int h : {2, 4, 7, 16})
        for (int o : {1, 6, 15, 16, 17, 31, 32, 33, 64, 70}) {
          if (kernel > h + 2) continue;
          const auto g = geometry(c, h, h, kernel, 1, kernel / 2, o);
          const kh::ConvScratch layout{g};
          const std::size_t outs = std::size_t(o), patch = g.patch(), pixels = g.out_pixels();
          for (const bool tiles : {false, true}) {
            CAPTURE(c);
            CAPTURE(kernel);
            CAPTURE(h);
            CAPTURE(o);
            CAPTURE(tiles);
            bf::with_tile(bf::choose_tile(outs, pixels, patch, tiles), [&]<class S>() {
              CHECK(bf::packed_a_size<S>(outs, patch) <= layout.packed_weights());
              CHECK(bf::packed_b_size<S>(patch, pixels) <= layout.col());
            });
            bf::with_tile(bf::choose_tile(patch, pixels, outs, tiles), [&]<class S>() {
              CHECK(bf::packed_a_size<S>(patch, outs) <= layout.packed_weights());
              CHECK(bf::packed_b_size<S>(outs, pixels) <= layout.dz_panels());
            });
            ++checked;
          }
        }
  CHECK(checked > 1000);
}

TEST_CASE_TEMPLATE("conv2d on small planes over larger batches split unevenly over threads", T, float, double) {
  // 16 and 36 output pixels, as ResNet's last stages, and batches of 1, 21 and 37 samples.
  for (const auto& g : {geometry(8, 4, 4, 3, 1, 1, 40), geometry(6, 12, 12, 3, 2, 1, 36)})
    for (int threads = 1; threads <= 3; ++threads)
      for (std::size_t batch : {std::size_t(1), std::size_t(21), std::size_t(37)}) {
        check_conv<k::Epilogue<>, T>(g, batch, threads, false);
        check_conv<k::Epilogue<k::Tanh>, T>(g, batch, threads, threads == 2);
      }
}

TEST_CASE("conv2d at bf16 on small planes over larger batches: whole and partial sample groups") {
  // On AMX, planes of 32 pixels or fewer put 64 / P samples side by side in the forward and input
  // gradient (4 of 16 pixels, 2 of 25), inside the weight gradient's groups of 256 / P: batches of 21 and
  // 37 over 1-3 threads give whole groups, several a thread, partial ones at the end and dx chunks past
  // a group's first; a 1x1 conv copies its dx out of the product instead of col2im.
  std::vector<fusedp::HostPrecision> precisions{fusedp::HostPrecision::bf16_emulated};
  if (fusedp::cpu_features().avx512_bf16) precisions.push_back(fusedp::HostPrecision::bf16);
  for (const auto precision : precisions)
    for (const auto& g : {geometry(24, 4, 4, 3, 1, 1, 40), geometry(16, 5, 5, 3, 1, 1, 36), geometry(24, 4, 4, 1, 1, 0, 48)})
      for (int threads = 1; threads <= 3; ++threads)
        for (std::size_t batch : {std::size_t(21), std::size_t(37)}) {
          check_conv<k::Epilogue<>, float>(g, batch, threads, false, precision);
          check_conv<k::Epilogue<k::Tanh>, float>(g, batch, threads, threads == 2, precision);
        }
}

TEST_CASE("conv2d at the CIFAR-10 CNN's second layer (float, 2 threads)") {
  check_conv<k::Epilogue<k::Tanh>, float>(geometry(64, 16, 16, 3, 1, 1, 128), 3, 2, false);
  check_conv<k::Epilogue<k::Tanh>, float>(geometry(64, 16, 16, 3, 1, 1, 128), 2, 2, false,
                                          fusedp::HostPrecision::bf16_emulated);
}
