// SoftmaxCrossEntropy with label smoothing (PyTorch's CrossEntropyLoss(label_smoothing=eps)): the loss
// against a hand computation of (1 - eps) nll + eps mean_c(-log p_c), the gradient against central
// differences in double (tests/layers/gradient_check.hpp), and a bad eps refused before anything
// changes.
#include "../layers/gradient_check.hpp"

#include <cmath>
#include <vector>

namespace fp = fusedp;

TEST_CASE("label smoothing: the loss is PyTorch's") {
  const std::vector<double> logits{0.5, -1.0, 2.0, 0.0, 3.0, -0.5, 1.0, 0.25};  // 2 rows of 4
  const std::vector<std::int32_t> labels{2, 0};
  const double eps = double(0.2f);  // the option is a float
  double want = 0;
  for (std::size_t n = 0; n < 2; ++n) {
    const double* z = logits.data() + 4 * n;
    double s = 0;
    for (int c = 0; c < 4; ++c) s += std::exp(z[c]);
    double mean_nll = 0;
    for (int c = 0; c < 4; ++c) mean_nll += (std::log(s) - z[c]) / 4;
    want += ((1 - eps) * (std::log(s) - z[labels[n]]) + eps * mean_nll) / 2;
  }
  std::vector<double> d(8);
  const fp::SoftmaxCrossEntropy loss{.label_smoothing = float(eps)};
  const double got = loss(fp::Host{1}, 2, 4, logits.data(), labels.data(), d.data());
  CHECK(got == doctest::Approx(want).epsilon(1e-13));
  for (std::size_t n = 0; n < 2; ++n) {
    double row = 0;
    for (int c = 0; c < 4; ++c) row += d[4 * n + std::size_t(c)];
    CHECK(std::abs(row) < 1e-15);  // softmax and the smoothed target both sum to one
  }
  // eps 0 is the plain cross-entropy.
  const double plain = fp::SoftmaxCrossEntropy{}(fp::Host{1}, 2, 4, logits.data(), labels.data(), static_cast<double*>(nullptr));
  const double zero = fp::SoftmaxCrossEntropy{.label_smoothing = 0.0f}(fp::Host{1}, 2, 4, logits.data(),
                                                                        labels.data(), static_cast<double*>(nullptr));
  CHECK(plain == zero);
}

TEST_CASE("label smoothing: gradients against central differences") {
  using Net = fp::Sequential<fp::Input<5>, fp::Linear<6>, fp::Tanh, fp::Linear<4>>;
  gradcheck::check_threads<Net>(5, 51, fp::SoftmaxCrossEntropy{.label_smoothing = 0.3f});
}

TEST_CASE("label smoothing outside [0, 1] is refused before the model changes") {
  using Net = fp::Sequential<fp::Input<3>, fp::Linear<2>, fp::BatchNorm1d<>, fp::Linear<3>>;
  fp::Model<Net, fp::Host> model{fp::seed(2)};
  const std::vector<float> x{1, 2, 3, -1, 0, 1};
  const std::vector<std::int32_t> y{0, 2};
  const std::vector<float> stats(model.buffers().begin(), model.buffers().end());
  CHECK_THROWS_WITH_AS((void)model.compute_gradients(std::span<const float>(x), std::span<const std::int32_t>(y),
                                                     fp::SoftmaxCrossEntropy{.label_smoothing = 1.5f}),
                       doctest::Contains("label_smoothing must lie in [0, 1], got 1.5"), fp::InvalidArgument);
  CHECK(std::equal(stats.begin(), stats.end(), model.buffers().begin()));  // no forward ran
}
