// tests include/fusedp/net/model.hpp: initialization (seeded, PyTorch's bounds), predict, argument
// checks that leave the model unchanged, training progress on a fixed batch, and reproducibility.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/core/rng.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/sequential.hpp>
#include <fusedp/optim/sgd.hpp>

#include "../support/seed_networks.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fp = fusedp;

namespace {

using LeNet = seed_networks::LeNet;
using Model = fp::Model<LeNet, fp::Host>;
static_assert(Model::input_size == 784 && Model::output_size == 10);

constexpr std::size_t batch = 16;

std::vector<float> images(std::size_t n, std::uint64_t seed = 1) {
  std::vector<float> x(n * 784);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(seed, 100, i);
  return x;
}
std::vector<std::int32_t> labels(std::size_t n, std::uint64_t seed = 1) {
  std::vector<std::int32_t> l(n);
  for (std::size_t i = 0; i < n; ++i) l[i] = std::int32_t(fp::rng::uniform(seed, 101, i) * 10);
  return l;
}
std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }

}  // namespace

TEST_CASE("the same seed gives identical parameters; different seeds differ") {
  Model a{fp::seed(42), fp::Host{1}};
  Model b{fp::Host{2}, fp::seed(42)};  // either argument order; the thread count does not matter
  Model c{fp::seed(43), fp::Host{1}};
  CHECK(a.seed() == 42);
  CHECK(a.steps() == 0);
  REQUIRE(a.params().size() == LeNet::param_storage);
  CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin()));
  std::size_t same = 0;
  for (std::size_t i = 0; i < a.params().size(); ++i) same += a.params()[i] == c.params()[i];
  // Only the alignment padding (zero in both) may coincide.
  CHECK(same == LeNet::param_storage - LeNet::param_count);
  // reset_parameters draws the same values again.
  const std::vector<float> before = copy(a.params());
  std::fill(a.param(0).begin(), a.param(0).end(), 0.0f);
  a.reset_parameters();
  CHECK(std::equal(before.begin(), before.end(), a.params().begin()));
  // Gradients start at zero.
  CHECK(std::all_of(a.grads().begin(), a.grads().end(), [](float g) { return g == 0.0f; }));
}

TEST_CASE("initialization: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) per tensor, zero padding") {
  Model m{fp::seed(7), fp::Host{1}};
  std::vector<bool> used(LeNet::param_storage, false);
  for (std::size_t t = 0; t < LeNet::param_layout.size(); ++t) {
    CAPTURE(t);
    const auto& p = LeNet::param_layout[t];
    const double bound = 1.0 / std::sqrt(double(p.fan_in));
    const auto v = m.param(t);
    REQUIRE(v.size() == p.size);
    REQUIRE(v.data() == m.params().data() + p.offset);
    double lo = 1, hi = -1, sum = 0;
    for (float x : v) {
      lo = std::min(lo, double(x));
      hi = std::max(hi, double(x));
      sum += x;
    }
    CHECK(lo >= -bound);
    CHECK(hi <= bound);
    if (p.size >= 100) {
      // Spread over the range: the extremes are near the bounds, the mean near 0
      // (standard error bound / sqrt(3 n); 6 sigma).
      CHECK(hi > 0.9 * bound);
      CHECK(lo < -0.9 * bound);
      CHECK(std::abs(sum / double(p.size)) < 6 * bound / std::sqrt(3.0 * double(p.size)));
    }
    for (std::size_t e = 0; e < p.size; ++e) used[p.offset + e] = true;
  }
  for (std::size_t i = 0; i < used.size(); ++i)
    if (!used[i]) CHECK(m.params()[i] == 0.0f);
  CHECK_THROWS_AS((void)m.param(LeNet::param_tensor_count), fp::InvalidArgument);
  CHECK_THROWS_AS((void)m.grad(LeNet::param_tensor_count), fp::InvalidArgument);
}

TEST_CASE("predict: (batch, 10) finite outputs, the same per sample whatever the batch") {
  Model m{fp::seed(3), fp::Host{2}};
  const std::vector<float> x = images(7);
  const std::vector<float> all = copy(m.predict(std::span<const float>(x)));
  REQUIRE(all.size() == 7 * 10);
  CHECK(std::all_of(all.begin(), all.end(), [](float v) { return std::isfinite(v); }));
  const auto one = m.predict(std::span<const float>(x).subspan(784 * 4, 784));
  REQUIRE(one.size() == 10);
  for (std::size_t c = 0; c < 10; ++c) CHECK(one[c] == doctest::Approx(all[40 + c]).epsilon(1e-5));
  const auto three = m.predict(std::span<const float>(x).first(3 * 784));
  REQUIRE(three.size() == 30);
  for (std::size_t i = 0; i < 30; ++i) CHECK(three[i] == doctest::Approx(all[i]).epsilon(1e-5));
}

TEST_CASE("a wrong input size throws InvalidArgument naming the sizes") {
  Model m{fp::seed(3), fp::Host{1}};
  const std::vector<float> x(785, 0.5f);
  CHECK_THROWS_WITH_AS(m.predict(std::span<const float>(x)), doctest::Contains("785"), fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(m.predict(std::span<const float>(x)), doctest::Contains("784"), fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(m.predict(std::span<const float>(x)), doctest::Contains("1x28x28"), fp::InvalidArgument);
  CHECK_THROWS_AS(m.predict(std::span<const float>()), fp::InvalidArgument);
  CHECK_THROWS_AS(m.predict(std::span<const float>(x).first(783)), fp::InvalidArgument);
}

// Random images in [0, 1) with random labels: hard to fit, so the loss falls slowly but steadily.
// PyTorch 1.13 (same initial parameters, data and SGD settings) gives the same trajectory:
// 2.3069, 2.2782 (step 5), 2.1318 (step 20), 2.0080 (step 49).
TEST_CASE("train_step lowers the loss of a fixed batch over 50 steps") {
  Model m{fp::seed(42), fp::Host{2}};
  const std::vector<float> x = images(batch);
  const std::vector<std::int32_t> y = labels(batch);
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  const float initial =
      m.evaluate(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}).loss;
  CHECK(initial == doctest::Approx(std::log(10.0)).epsilon(0.05));  // near-uniform predictions at first
  std::vector<float> losses;
  for (int s = 0; s < 50; ++s)
    losses.push_back(m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                  fp::SoftmaxCrossEntropy{}, opt));
  CHECK(m.steps() == 50);
  CHECK(losses.front() == doctest::Approx(initial).epsilon(1e-5));  // step 1 reports the loss before it
  CHECK(std::all_of(losses.begin(), losses.end(), [](float l) { return std::isfinite(l); }));
  for (std::size_t s = 5; s < losses.size(); s += 5) {
    CAPTURE(s);
    CHECK(losses[s] < losses[s - 5]);
  }
  const float final_loss =
      m.evaluate(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}).loss;
  CHECK(final_loss < losses.back());
  CHECK(final_loss < initial - 0.2f);
}

TEST_CASE("two runs with the same seed and thread count are identical; 1 and 2 threads agree closely") {
  const std::vector<float> x = images(batch, 5);
  const std::vector<std::int32_t> y = labels(batch, 5);
  auto run = [&](int threads) {
    Model m{fp::seed(11), fp::Host{threads}};
    fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f}};
    std::vector<float> losses;
    for (int s = 0; s < 5; ++s)
      losses.push_back(m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                    fp::SoftmaxCrossEntropy{}, opt));
    std::vector<float> state = copy(m.optimizer_state());
    return std::tuple{losses, copy(m.params()), state};
  };
  const auto [l1, p1, s1] = run(2);
  const auto [l2, p2, s2] = run(2);
  CHECK(l1 == l2);
  CHECK(p1 == p2);
  CHECK(s1 == s2);
  const auto [l3, p3, s3] = run(1);
  for (std::size_t i = 0; i < l1.size(); ++i) CHECK(l3[i] == doctest::Approx(l1[i]).epsilon(1e-4));
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < p1.size(); ++i) {
    diff += double(p1[i] - p3[i]) * (p1[i] - p3[i]);
    norm += double(p1[i]) * p1[i];
  }
  CHECK(std::sqrt(diff) <= 1e-4 * std::sqrt(norm));
}

TEST_CASE("an exception leaves parameters, gradients, optimizer state and the step count unchanged") {
  Model m{fp::seed(19), fp::Host{2}};
  const std::vector<float> x = images(4, 9);
  const std::vector<std::int32_t> y = labels(4, 9);
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  const std::vector<float> params = copy(m.params()), grads = copy(m.grads()), state = copy(m.optimizer_state());
  auto unchanged = [&] {
    CHECK(std::equal(params.begin(), params.end(), m.params().begin()));
    CHECK(std::equal(grads.begin(), grads.end(), m.grads().begin()));
    CHECK(std::equal(state.begin(), state.end(), m.optimizer_state().begin()));
    CHECK(m.steps() == 1);
  };
  // Input size not a multiple of 784.
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x).first(3 * 784 + 5), std::span<const std::int32_t>(y),
                               fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  unchanged();
  // Three samples, four labels.
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x).first(3 * 784), std::span<const std::int32_t>(y),
                               fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  unchanged();
  // A label out of range.
  std::vector<std::int32_t> bad = y;
  bad[3] = 10;
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x), std::span<const std::int32_t>(bad),
                               fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  unchanged();
  // Invalid optimizer options.
  fp::Sgd negative{{.lr = -0.1f}};
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                               fp::SoftmaxCrossEntropy{}, negative),
                  fp::InvalidArgument);
  unchanged();
  fp::Sgd nesterov{{.lr = 0.1f, .nesterov = true}};
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                               fp::SoftmaxCrossEntropy{}, nesterov),
                  fp::InvalidArgument);
  unchanged();
}
