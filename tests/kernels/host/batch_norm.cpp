// tests include/fusedp/kernels/host/batch_norm.hpp: backward without keep_dz, under ReLU, forms dz as it
// reads dy instead of storing it (kernels/host/batch_norm.hpp: gates_relu); its dx, dgamma and dbeta are
// the bits of the stored path, and dy is left as it was. (The gradients themselves are checked against
// central differences in double through the layers: tests/layers/gradients_norm.cpp, tests/net/residual.cpp.)
#include <doctest/doctest.h>

#include "test_values.hpp"

#include <fusedp/core/shape.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/exec/replica_sum.hpp>
#include <fusedp/kernels/activation.hpp>
#include <fusedp/kernels/host/batch_norm.hpp>

#include <cstddef>
#include <cstring>
#include <vector>

namespace fp = fusedp;
namespace k = fusedp::kernels;
namespace kh = fusedp::kernels::host;

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One replica: the sums stay as they are, but the synchronized phases run.
void sum_over_one(void*, double*, std::size_t, void*) {}

// Forward in training, then backward twice from the same dy: keep_dz and not. Checks the bits and
// what each leaves in dy; returns how many dz differ from dy (ReLU's zeros), so a caller can ask that
// the mask was not empty.
template <class Epi>
std::size_t check_backward(const fp::Host& host, const kh::BatchNormGeometry& g, bool sync, bool bf16) {
  const std::size_t n = g.batch * g.channels * g.plane, C = g.channels;
  const k::BatchNormState s{C, fp::align_elements(C), fp::align_elements(1)};
  std::vector<float> x(n), y(n), z(n), gamma(C), beta(C), state(4 * s.aligned + s.scalar, 0.0f), dy(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = float(2.0 * kernel_test::value(1, i) + 0.3);
    dy[i] = float(kernel_test::value(2, i));
  }
  for (std::size_t c = 0; c < C; ++c) {
    gamma[c] = float(1.0 + 0.5 * kernel_test::value(3, c));
    beta[c] = float(0.4 * kernel_test::value(4, c));
  }
  const fp::ReplicaSum one{nullptr, sync ? &sum_over_one : nullptr};
  std::vector<double> sums(k::batch_norm_sync_doubles(C));
  float* saved = Epi::saves_input ? z.data() : nullptr;
  kh::batch_norm_forward<Epi>(host, g, s, true, 0.1, 1e-5, gamma.data(), beta.data(), state.data(), x.data(),
                              y.data(), saved, one, sums.data(), static_cast<const float*>(nullptr), bf16);
  struct Result {
    std::vector<float> dy, dx, dgamma, dbeta;
  };
  auto backward = [&](bool keep_dz) {
    Result r{dy, std::vector<float>(n), std::vector<float>(C), std::vector<float>(C)};
    kh::batch_norm_backward<Epi>(host, g, s, gamma.data(), state.data(), x.data(), y.data(), saved, r.dy.data(),
                                 r.dx.data(), r.dgamma.data(), r.dbeta.data(), one, sums.data(), bf16, keep_dz);
    return r;
  };
  const Result kept = backward(true), formed = backward(false);
  CHECK(same_bits(formed.dx, kept.dx));
  CHECK(same_bits(formed.dgamma, kept.dgamma));
  CHECK(same_bits(formed.dbeta, kept.dbeta));
  // Under ReLU dy is left as it was; elsewhere it holds dz either way.
  CHECK(same_bits(formed.dy, kh::detail::gates_relu<Epi> ? dy : kept.dy));
  std::size_t masked = 0;
  for (std::size_t i = 0; i < n; ++i) masked += kept.dy[i] != dy[i];
  return masked;
}

}  // namespace

TEST_CASE("BatchNorm backward under ReLU forms dz as it reads dy, with the bits of dz stored") {
  for (int threads = 1; threads <= 3; ++threads)
    for (const kh::BatchNormGeometry g : {kh::BatchNormGeometry{5, 3, 33}, kh::BatchNormGeometry{4, 2, 1},
                                          kh::BatchNormGeometry{3, 5, 7}, kh::BatchNormGeometry{2, 4, 64}})
      for (bool sync : {false, true})
        for (bool bf16 : {false, true}) {
          CAPTURE(threads);
          CAPTURE(g.batch);
          CAPTURE(g.plane);
          CAPTURE(sync);
          CAPTURE(bf16);
          const fp::Host host{threads};
          // ReLU zeroes dz where gamma xhat + beta <= 0, about half of it here.
          CHECK(check_backward<k::Epilogue<k::Relu>>(host, g, sync, bf16) > 0);
          // The epilogues whose dz is stored into dy anyway: none, and one that needs its input.
          CHECK(check_backward<k::Epilogue<>>(host, g, sync, bf16) == 0);
          check_backward<k::Epilogue<k::Tanh, k::Gelu>>(host, g, sync, bf16);
        }
}
