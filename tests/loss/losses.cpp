// tests include/fusedp/loss/softmax_cross_entropy.hpp, loss/mse.hpp and kernels/loss.hpp: values and
// gradients against hand and double computations, argument checks that reject a bad batch before
// anything changes, and count_correct. Tolerance: 1e-14 relative in double, 1e-6 in float.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/core/rng.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/loss/mse.hpp>
#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/sequential.hpp>
#include <fusedp/optim/sgd.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace fp = fusedp;

namespace {
const fp::Host host{1};

// log(1 + e^-1 + e^-2): the cross-entropy of logits (1, 2, 3) at label 2.
constexpr double ce_123 = 0.40760596444438030;

double reference_ce(const std::vector<double>& logits, std::size_t classes, const std::vector<std::int32_t>& labels,
                    std::vector<double>* grad) {
  const std::size_t batch = labels.size();
  double total = 0;
  if (grad) grad->assign(logits.size(), 0.0);
  for (std::size_t n = 0; n < batch; ++n) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t c = 0; c < classes; ++c) m = std::max(m, logits[n * classes + c]);
    double s = 0;
    for (std::size_t c = 0; c < classes; ++c) s += std::exp(logits[n * classes + c] - m);
    total += m + std::log(s) - logits[n * classes + std::size_t(labels[n])];
    if (grad)
      for (std::size_t c = 0; c < classes; ++c)
        (*grad)[n * classes + c] =
            (std::exp(logits[n * classes + c] - m) / s - (c == std::size_t(labels[n]) ? 1.0 : 0.0)) / double(batch);
  }
  return total / double(batch);
}

bool close(double a, double b, double rel = 1e-14) { return std::abs(a - b) <= rel * std::max(std::abs(b), 1e-300); }
}  // namespace

TEST_CASE("SoftmaxCrossEntropy: a hand-computed row") {
  const std::vector<double> logits{1, 2, 3};
  const std::vector<std::int32_t> labels{2};
  std::vector<double> d(3);
  const double loss = fp::SoftmaxCrossEntropy{}(host, 1, 3, logits.data(), labels.data(), d.data());
  CHECK(close(loss, ce_123));
  // softmax(1, 2, 3) = e^(x - 3) / (1 + e^-1 + e^-2), minus one at the label.
  const double s = 1 + std::exp(-1.0) + std::exp(-2.0);
  CHECK(close(d[0], std::exp(-2.0) / s));
  CHECK(close(d[1], std::exp(-1.0) / s));
  CHECK(close(d[2], 1.0 / s - 1.0));
  CHECK(std::abs(d[0] + d[1] + d[2]) < 1e-15);
}

TEST_CASE("SoftmaxCrossEntropy: mean over a random batch and its gradient, double and float") {
  constexpr std::size_t batch = 7, classes = 5;
  std::vector<double> logits(batch * classes);
  std::vector<std::int32_t> labels(batch);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = 8.0 * fp::rng::uniform(11, 1, i) - 4.0;
  for (std::size_t n = 0; n < batch; ++n) labels[n] = std::int32_t(fp::rng::uniform(11, 2, n) * classes);
  std::vector<double> want_grad;
  const double want = reference_ce(logits, classes, labels, &want_grad);

  std::vector<double> d(logits.size());
  const double loss = fp::SoftmaxCrossEntropy{}(host, batch, classes, logits.data(), labels.data(), d.data());
  CHECK(close(loss, want));
  for (std::size_t i = 0; i < d.size(); ++i) CHECK(std::abs(d[i] - want_grad[i]) <= 1e-15);
  // Without a gradient buffer (evaluation) the value is the same.
  CHECK(fp::SoftmaxCrossEntropy{}(host, batch, classes, logits.data(), labels.data(), static_cast<double*>(nullptr)) ==
        loss);

  std::vector<float> lf(logits.begin(), logits.end()), df(d.size());
  const float lossf = fp::SoftmaxCrossEntropy{}(host, batch, classes, lf.data(), labels.data(), df.data());
  CHECK(lossf == doctest::Approx(want).epsilon(1e-6));
  for (std::size_t i = 0; i < d.size(); ++i) CHECK(std::abs(df[i] - want_grad[i]) <= 1e-6);
}

TEST_CASE("SoftmaxCrossEntropy is stable for large logits") {
  const std::vector<float> logits{1000.0f, 1001.0f, 999.0f, -1000.0f, -1001.0f, -999.0f};
  const std::vector<std::int32_t> labels{1, 2};
  std::vector<float> d(6);
  const float loss = fp::SoftmaxCrossEntropy{}(host, 2, 3, logits.data(), labels.data(), d.data());
  CHECK(std::isfinite(loss));
  CHECK(loss == doctest::Approx(ce_123).epsilon(1e-4));
  for (float v : d) CHECK(std::isfinite(v));
  CHECK(d[1] == doctest::Approx((1.0 / (1 + std::exp(-1.0) + std::exp(-2.0)) - 1.0) / 2).epsilon(1e-4));
}

// PyTorch computes log_softmax as (x - max) - log(sum exp(x - max)), which keeps full precision when
// the logits are large; forming log(sum) + max first and subtracting the logit afterwards loses the
// bits of max (in float, ulp(1001) = 6e-5, so the loss 0.4076 comes out as 0.40759).
TEST_CASE("SoftmaxCrossEntropy keeps float precision for large logits, as PyTorch") {
  const std::vector<float> logits{1000.0f, 1001.0f, 999.0f};
  const std::vector<std::int32_t> labels{1};
  std::vector<float> d(3);
  const float loss = fp::SoftmaxCrossEntropy{}(host, 1, 3, logits.data(), labels.data(), d.data());
  CHECK(loss == doctest::Approx(ce_123).epsilon(1e-6));
}

TEST_CASE("MSE: hand-computed mean and gradient") {
  // y - t = (1, -2, 0, 2): sum of squares 9 over 4 outputs; gradient 2 (y - t) / 4.
  const std::vector<double> y{1, 2, 3, 4}, t{0, 4, 3, 2};
  std::vector<double> d(4);
  const double loss = fp::MSE{}(host, 2, 2, y.data(), t.data(), d.data());
  CHECK(loss == 2.25);
  CHECK(d == std::vector<double>{0.5, -1.0, 0.0, 1.0});
  CHECK(fp::MSE{}(host, 2, 2, y.data(), t.data(), static_cast<double*>(nullptr)) == 2.25);
  const std::vector<float> yf{1, 2, 3, 4}, tf{0, 4, 3, 2};
  std::vector<float> df(4);
  CHECK(fp::MSE{}(host, 4, 1, yf.data(), tf.data(), df.data()) == 2.25f);
  CHECK(df == std::vector<float>{0.5f, -1.0f, 0.0f, 1.0f});
}

TEST_CASE("loss arguments are checked") {
  using SCE = fp::SoftmaxCrossEntropy;
  const std::vector<std::int32_t> good{0, 2, 1};
  CHECK_NOTHROW(SCE::validate(std::span<const std::int32_t>(good), 3, 3));
  const std::vector<std::int32_t> negative{0, -1, 1}, too_big{0, 3, 1};
  CHECK_THROWS_WITH_AS(SCE::validate(std::span<const std::int32_t>(negative), 3, 3),
                       doctest::Contains("label -1 at index 1"), fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(SCE::validate(std::span<const std::int32_t>(too_big), 3, 3), doctest::Contains("[0, 3)"),
                       fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(SCE::validate(std::span<const std::int32_t>(good), 4, 3), doctest::Contains("3 labels"),
                       fp::InvalidArgument);

  const std::vector<double> targets{0.0, 1.0, 2.0, 3.0};
  CHECK_NOTHROW(fp::MSE::validate(std::span<const double>(targets), 2, 2));
  CHECK_THROWS_AS(fp::MSE::validate(std::span<const double>(targets), 3, 2), fp::InvalidArgument);
  std::vector<double> bad = targets;
  bad[2] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(fp::MSE::validate(std::span<const double>(bad), 2, 2), doctest::Contains("target 2"),
                       fp::InvalidArgument);
  bad[2] = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(fp::MSE::validate(std::span<const double>(bad), 2, 2), fp::InvalidArgument);
}

TEST_CASE("count_correct counts rows whose first largest logit is the label") {
  const std::vector<float> logits{0.1f, 0.9f, 0.0f,    // argmax 1
                                  2.0f, 2.0f, 1.0f,    // tie: the first, 0
                                  -1.0f, -3.0f, -0.5f, // argmax 2
                                  5.0f, 4.0f, 3.0f};   // argmax 0
  const std::vector<std::int32_t> labels{1, 1, 2, 2};
  CHECK(fp::count_correct(std::span<const float>(logits), std::span<const std::int32_t>(labels)) == 2);
  const std::vector<std::int32_t> all{1, 0, 2, 0};
  CHECK(fp::count_correct(std::span<const float>(logits), std::span<const std::int32_t>(all)) == 4);
  const std::vector<std::int32_t> five{1, 0, 2, 0, 1};
  CHECK_THROWS_AS(fp::count_correct(std::span<const float>(logits), std::span<const std::int32_t>(five)),
                  fp::InvalidArgument);
  CHECK_THROWS_AS(fp::count_correct(std::span<const float>(logits), std::span<const std::int32_t>()),
                  fp::InvalidArgument);
}

namespace {
using Net = fp::Sequential<fp::Input<4>, fp::Linear<6>, fp::Tanh, fp::Linear<3>>;
using Model = fp::Model<Net, fp::Host, double>;
constexpr std::size_t batch = 5;

std::vector<double> inputs() {
  std::vector<double> x(batch * 4);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2.0 * fp::rng::uniform(13, 1, i) - 1.0;
  return x;
}
}  // namespace

TEST_CASE("through a Model: the loss is the loss of predict()'s logits, and the last bias gets dlogits") {
  Model model{fp::seed(13), fp::Host{2}};
  const std::vector<double> x = inputs();
  const std::vector<std::int32_t> labels{0, 2, 1, 1, 0};
  const auto out = model.predict(std::span<const double>(x));
  const std::vector<double> logits(out.begin(), out.end());
  std::vector<double> grad;
  const double want = reference_ce(logits, 3, labels, &grad);
  const auto eval = model.evaluate(std::span<const double>(x), std::span<const std::int32_t>(labels),
                                   fp::SoftmaxCrossEntropy{});
  CHECK(close(eval.loss, want, 1e-13));
  REQUIRE(eval.outputs.size() == logits.size());
  CHECK(std::equal(logits.begin(), logits.end(), eval.outputs.begin()));
  CHECK(close(model.compute_gradients(std::span<const double>(x), std::span<const std::int32_t>(labels),
                                      fp::SoftmaxCrossEntropy{}),
              want, 1e-13));
  // d loss / d bias of the last Linear = the sum over the batch of dlogits.
  const auto db = model.grad(3);
  for (std::size_t c = 0; c < 3; ++c) {
    double s = 0;
    for (std::size_t n = 0; n < batch; ++n) s += grad[n * 3 + c];
    CHECK(std::abs(db[c] - s) <= 1e-15);
  }

  std::vector<double> targets(batch * 3);
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = fp::rng::uniform(13, 2, i);
  double mse = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) mse += (logits[i] - targets[i]) * (logits[i] - targets[i]);
  mse /= double(targets.size());
  CHECK(close(model.evaluate(std::span<const double>(x), std::span<const double>(targets), fp::MSE{}).loss, mse,
              1e-13));
}

TEST_CASE("a bad batch throws InvalidArgument from train_step and changes nothing") {
  Model model{fp::seed(17), fp::Host{2}};
  const std::vector<double> x = inputs();
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  // One good step first, so that there is optimizer state and gradients to keep.
  const std::vector<std::int32_t> good{0, 1, 2, 0, 1};
  model.train_step(std::span<const double>(x), std::span<const std::int32_t>(good), fp::SoftmaxCrossEntropy{}, opt);
  const std::vector<double> params(model.params().begin(), model.params().end());
  const std::vector<double> grads(model.grads().begin(), model.grads().end());
  const std::vector<double> state(model.optimizer_state().begin(), model.optimizer_state().end());
  auto unchanged = [&] {
    CHECK(std::equal(params.begin(), params.end(), model.params().begin()));
    CHECK(std::equal(grads.begin(), grads.end(), model.grads().begin()));
    CHECK(std::equal(state.begin(), state.end(), model.optimizer_state().begin()));
    CHECK(model.steps() == 1);
  };
  auto step = [&](const std::vector<std::int32_t>& labels) {
    return model.train_step(std::span<const double>(x), std::span<const std::int32_t>(labels),
                            fp::SoftmaxCrossEntropy{}, opt);
  };
  CHECK_THROWS_AS(step({0, 1, 3, 0, 1}), fp::InvalidArgument);  // label == classes
  unchanged();
  CHECK_THROWS_AS(step({0, 1, 2, -1, 1}), fp::InvalidArgument);
  unchanged();
  CHECK_THROWS_WITH_AS(step({0, 1, 2, 0}), doctest::Contains("4 labels for a batch of 5"), fp::InvalidArgument);
  unchanged();
  CHECK_THROWS_AS(step({0, 1, 2, 0, 1, 2}), fp::InvalidArgument);
  unchanged();
  CHECK_THROWS_AS(model.compute_gradients(std::span<const double>(x), std::span<const std::int32_t>(good).first(3),
                                          fp::SoftmaxCrossEntropy{}),
                  fp::InvalidArgument);
  unchanged();
  std::vector<double> targets(batch * 3, 0.5);
  targets[7] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(model.train_step(std::span<const double>(x), std::span<const double>(targets), fp::MSE{}, opt),
                  fp::InvalidArgument);
  unchanged();
  targets.pop_back();
  CHECK_THROWS_AS(model.train_step(std::span<const double>(x), std::span<const double>(targets), fp::MSE{}, opt),
                  fp::InvalidArgument);
  unchanged();
  CHECK_THROWS_AS(model.evaluate(std::span<const double>(x), std::span<const std::int32_t>(good).first(2),
                                 fp::SoftmaxCrossEntropy{}),
                  fp::InvalidArgument);
  // And a good step still works afterwards.
  CHECK(std::isfinite(step(good)));
  CHECK(model.steps() == 2);
}
