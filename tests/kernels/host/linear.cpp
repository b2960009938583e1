// The Host linear kernels (include/fusedp/kernels/host/linear.hpp) against naive double-precision
// loops: y = Epi(x W^T + b) forward (W^T packed by in-register transposes, or a large W read in place
// as y^T = W x^T; the epilogue per tile),
// dz = dy * Epi', db, dW and dx backward, at sizes that are multiples of nothing and at the seed
// networks' sizes, for 1 to 3 threads (splits by rows and by columns).
#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/host/linear.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

namespace kh = fusedp::kernels::host;
namespace k = fusedp::kernels;

namespace {

using kernel_test::value;

template <class Epi, class T>
void check_linear(std::size_t batch, std::size_t in, std::size_t out, int threads) {
  CAPTURE(batch);
  CAPTURE(in);
  CAPTURE(out);
  CAPTURE(threads);
  const fusedp::Host host{threads};
  std::vector<T> w(out * in), b(out), x(batch * in), y(batch * out, T(7)), z(batch * out), dy(batch * out);
  std::vector<T> dx(batch * in, T(7)), dw(out * in, T(7)), db(out, T(7));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = T(value(1, i) / std::sqrt(double(in)));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = T(value(2, i));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(value(3, i));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = T(value(4, i));
  const std::vector<T> dy_in = dy;
  T* zp = Epi::saves_input ? z.data() : nullptr;
  kh::linear_forward<Epi>(host, batch, in, out, w.data(), b.data(), x.data(), y.data(), zp);
  kh::linear_backward<Epi>(host, batch, in, out, w.data(), x.data(), y.data(), zp, dy.data(), dx.data(), dw.data(),
                           db.data());
  const double tol = (sizeof(T) == 4 ? 2e-6 : 1e-13) * double(std::max(in, batch) + 8);
  std::size_t bad = 0;
  auto check = [&](double got, double ref, double mag) { bad += !(std::abs(got - ref) <= tol * (mag + 1.0)); };
  std::vector<double> dz(batch * out);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t o = 0; o < out; ++o) {
      double acc = double(b[o]), mag = std::abs(acc);
      for (std::size_t i = 0; i < in; ++i) {
        acc += double(x[n * in + i]) * double(w[o * in + i]);
        mag += std::abs(double(x[n * in + i]) * double(w[o * in + i]));
      }
      const double yr = Epi::apply(acc);
      check(double(y[n * out + o]), yr, mag);
      if constexpr (Epi::saves_input) check(double(z[n * out + o]), acc, mag);
      dz[n * out + o] = double(dy_in[n * out + o]) * Epi::derivative(acc, yr);
      check(double(dy[n * out + o]), dz[n * out + o], std::abs(dz[n * out + o]));
    }
  for (std::size_t o = 0; o < out; ++o) {
    double s = 0, mag = 0;
    for (std::size_t n = 0; n < batch; ++n) {
      s += dz[n * out + o];
      mag += std::abs(dz[n * out + o]);
    }
    check(double(db[o]), s, mag);
    for (std::size_t i = 0; i < in; ++i) {
      double g = 0, gm = 0;
      for (std::size_t n = 0; n < batch; ++n) {
        g += dz[n * out + o] * double(x[n * in + i]);
        gm += std::abs(dz[n * out + o] * double(x[n * in + i]));
      }
      check(double(dw[o * in + i]), g, gm);
    }
  }
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t i = 0; i < in; ++i) {
      double g = 0, gm = 0;
      for (std::size_t o = 0; o < out; ++o) {
        g += dz[n * out + o] * double(w[o * in + i]);
        gm += std::abs(dz[n * out + o] * double(w[o * in + i]));
      }
      check(double(dx[n * in + i]), g, gm);
    }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("linear forward and backward match a double reference", T, float, double) {
  for (int threads = 1; threads <= 3; ++threads) {
    check_linear<k::Epilogue<>, T>(5, 37, 13, threads);
    check_linear<k::Epilogue<k::Tanh>, T>(64, 400, 120, threads);  // LeNet's first linear
    check_linear<k::Epilogue<k::Gelu>, T>(33, 130, 71, threads);  // saves z
    check_linear<k::Epilogue<>, T>(64, 60, 10, threads);
    check_linear<k::Epilogue<k::Sigmoid>, T>(3, 1031, 257, threads);  // few rows: a split by columns
    check_linear<k::Epilogue<k::Relu>, T>(29, 700, 450, threads);     // W over 1 MiB: read in place
    check_linear<k::Epilogue<k::Gelu>, T>(29, 700, 450, threads);     // ... saving z
    check_linear<k::Epilogue<k::Gelu>, T>(260, 700, 450, threads);    // ... but not at a large batch
    // The paths the last cases are there for.
    CHECK(kh::linear_weights_in_place(29, 700, 450, sizeof(T), threads));
    CHECK_FALSE(kh::linear_weights_in_place(260, 700, 450, sizeof(T), threads));
  }
  CHECK_FALSE(kh::linear_weights_in_place(64, 400, 120, sizeof(T), 2));      // W fits L2
  CHECK_FALSE(kh::linear_weights_in_place(64, 32768, 10, sizeof(T), 2));     // too few rows to split
}

TEST_CASE("at precision bf16 a large linear layer keeps the bf16 GEMM (W is read in place in fp32 only)") {
  const fusedp::Host host{2, fusedp::HostPrecision::bf16_emulated};
  const std::size_t batch = 29, in = 700, out = 450;
  REQUIRE(kh::linear_weights_in_place(batch, in, out, sizeof(float), host.threads()));
  std::vector<float> w(out * in), b(out), x(batch * in), y(batch * out), ref(batch * out);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(value(1, i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(value(2, i));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(value(3, i));
  kh::linear_forward<k::Epilogue<>>(host, batch, in, out, w.data(), b.data(), x.data(), y.data(),
                                    static_cast<float*>(nullptr));
  kh::gemm_at_precision(host, batch, out, in, kh::row_major(x.data(), in), kh::MatrixRef<float>{w.data(), 1, in},
                        ref.data(), out, false);
  for (std::size_t n = 0; n < batch; ++n)
    for (std::size_t o = 0; o < out; ++o) ref[n * out + o] += b[o];
  CHECK(y == ref);
}
