// tests the Host's precision policy on whole networks (exec/host.hpp's HostPrecision, the GEMMs of
// kernels/host/gemm_bf16.hpp through the conv and linear layers): a network at bf16 against the same
// network in double, with the bound measured here; fp32 untouched by the bf16 code; a double Model
// refuses a bf16 Host.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <span>
#include <vector>

namespace fp = fusedp;

namespace {

// A conv with more output channels than the direct path takes (a GEMM), pooling, and two Linear layers:
// every GEMM of the network runs at the Host's precision.
using Net = fp::Sequential<fp::Input<3, 10, 10>, fp::Conv2d<40, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                           fp::Conv2d<36, 3>, fp::Tanh, fp::Flatten, fp::Linear<24>, fp::ReLU, fp::Linear<5>>;
constexpr std::size_t batch = 6;

struct Result {
  double loss;
  std::vector<double> logits, grads;
};

template <class T>
Result run(const fp::Host& host) {
  fp::Model<Net, fp::Host, T> model{fp::seed(3), host};
  std::vector<T> x(batch * Net::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(2 * fp::rng::uniform(17, 0, i) - 1);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % 5);
  Result r;
  r.loss = double(model.compute_gradients(std::span<const T>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}));
  r.grads.assign(model.grads().begin(), model.grads().end());
  const auto out = model.predict(std::span<const T>(x));
  r.logits.assign(out.begin(), out.end());
  return r;
}

double rel(const std::vector<double>& got, const std::vector<double>& want) {
  const std::vector<float> g(got.begin(), got.end());
  const std::vector<float> w(want.begin(), want.end());
  return test_support::relative_error(g, w);
}

}  // namespace

TEST_CASE("a network at precision bf16 against the double model: within the measured bound, not fp32's") {
  const Result ref = run<double>(fp::Host{2});
  const Result fp32 = run<float>(fp::Host{2});
  std::vector<fp::HostPrecision> precisions{fp::HostPrecision::bf16_emulated};
  if (fp::cpu_features().avx512_bf16) precisions.push_back(fp::HostPrecision::bf16);
  for (const auto precision : precisions) {
    CAPTURE(std::string(fp::to_string(precision)));
    const Result bf = run<float>(fp::Host{2, precision});
    const double e_logits = rel(bf.logits, ref.logits), e_grads = rel(bf.grads, ref.grads);
    const double e_loss = std::abs(bf.loss - ref.loss) / std::abs(ref.loss);
    MESSAGE(std::string(fp::to_string(precision)) << ": relative error of logits " << e_logits << ", gradients " << e_grads
                                     << ", loss " << e_loss << " (fp32: " << rel(fp32.logits, ref.logits) << ", "
                                     << rel(fp32.grads, ref.grads) << ")");
    // Measured on this network (Xeon, AVX-512 BF16 and its emulation alike, the same bits): logits
    // 2.1e-3, gradients 1.3e-2, loss 4.6e-5; bf16 keeps 8 bits of mantissa (2^-9 = 2.0e-3 per rounded
    // operand, and a gradient goes through several rounded GEMMs). Bounds: about three times those.
    CHECK(e_logits < 6e-3);
    CHECK(e_grads < 4e-2);
    CHECK(e_loss < 2e-4);
    // And the operands were rounded: fp32 is hundreds of times closer.
    CHECK(rel(fp32.logits, ref.logits) * 50 < e_logits);
    CHECK(rel(fp32.grads, ref.grads) * 50 < e_grads);
  }
}

TEST_CASE("the hardware and the emulated bf16 GEMMs train a network to the same bits") {
  if (!fp::cpu_features().avx512_bf16) {
    MESSAGE("this CPU has no AVX-512 BF16: only the emulation runs here");
    return;
  }
  const Result hw = run<float>(fp::Host{2, fp::HostPrecision::bf16});
  const Result em = run<float>(fp::Host{2, fp::HostPrecision::bf16_emulated});
  CHECK(hw.loss == em.loss);
  CHECK(hw.logits == em.logits);
  CHECK(hw.grads == em.grads);
}

TEST_CASE("a Model of double needs an fp32 Host") {
  CHECK_THROWS_WITH_AS((fp::Model<Net, fp::Host, double>{fp::seed(1), fp::Host{1, fp::HostPrecision::bf16_emulated}}),
                       doctest::Contains("needs an fp32 Host"), fp::InvalidArgument);
}
