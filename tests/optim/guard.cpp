// Guarded optimizers: clipping by global norm as torch.nn.utils.clip_grad_norm_, and the non-finite
// policies (Stop throws naming the step and tensor, Skip changes nothing), for one model and for every
// reduce policy of Parallel<> (all replicas take the same decision).
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <cmath>
#include <limits>
#include <vector>

namespace fp = fusedp;

namespace {
using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<3, 3>, fp::ReLU, fp::Flatten, fp::Linear<4>>;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
Batch batch_of(std::size_t n, std::uint64_t step, bool poison = false) {
  Batch b{std::vector<float>(n * Net::input_shape::size), std::vector<std::int32_t>(n)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(21, step, i) - 1;
  for (std::size_t i = 0; i < n; ++i) b.y[i] = std::int32_t(fp::rng::uniform(22, step, i) * 4);
  if (poison) b.x[b.x.size() - 1] = std::numeric_limits<float>::quiet_NaN();  // the last sample only
  return b;
}
std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }
}  // namespace

TEST_CASE("clip_grad_norm scales to max_norm / (norm + 1e-6), as PyTorch") {
  fp::Host host{2};
  std::vector<float> g{3, 0, 4, 0};
  const double norm = fp::clip_grad_norm(host, std::span<float>(g), 1.0);
  CHECK(norm == doctest::Approx(5.0));
  CHECK(g[0] == doctest::Approx(3.0 / (5.0 + 1e-6)).epsilon(1e-7));
  CHECK(g[2] == doctest::Approx(4.0 / (5.0 + 1e-6)).epsilon(1e-7));
  std::vector<float> small{0.3f, 0.4f};
  (void)fp::clip_grad_norm(host, std::span<float>(small), 1.0);  // norm 0.5 < 1: unchanged
  CHECK(small[0] == 0.3f);
}

TEST_CASE("Guarded clips the whole gradient before the update") {
  fp::Model<Net, fp::Host> plain{fp::seed(4), fp::Host{1}}, guarded{fp::seed(4), fp::Host{1}};
  const fp::Sgd sgd{{.lr = 0.1f}};
  const fp::Guarded<fp::Sgd> g{sgd, {.max_norm = 0.05f}};
  const Batch b = batch_of(8, 0);
  (void)plain.compute_gradients(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{});
  const double norm = fp::clip_grad_norm(plain.space(), plain.grads(), 0.05);
  REQUIRE(norm > 0.05);  // the test needs a gradient that is clipped
  plain.step(sgd);
  (void)guarded.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, g);
  for (std::size_t i = 0; i < Net::param_storage; ++i) CHECK(guarded.params()[i] == plain.params()[i]);
}

TEST_CASE("nonfinite::Stop throws naming the step and the first tensor; nothing changes") {
  fp::Model<Net, fp::Host> m{fp::seed(4), fp::Host{2}};
  const fp::Guarded<fp::Sgd, fp::nonfinite::Stop> opt{{{.lr = 0.1f, .momentum = 0.9f}}};
  const Batch good = batch_of(8, 0), bad = batch_of(8, 1, true);
  (void)m.train_step(std::span<const float>(good.x), std::span<const std::int32_t>(good.y), fp::SoftmaxCrossEntropy{}, opt);
  const auto params = copy(m.params());
  const auto state = copy(m.optimizer_state());
  CHECK_THROWS_WITH_AS(m.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y),
                                    fp::SoftmaxCrossEntropy{}, opt),
                       doctest::Contains("step 2: the gradient is not finite (NaN or infinity), first in '0.weight'"),
                       fp::NumericError);
  CHECK(copy(m.params()) == params);
  CHECK(copy(m.optimizer_state()) == state);
}

TEST_CASE("nonfinite::Skip leaves parameters and optimizer state unchanged and goes on") {
  fp::Model<Net, fp::Host> m{fp::seed(4), fp::Host{2}};
  const fp::Guarded<fp::Adam, fp::nonfinite::Skip> opt{{{.lr = 0.01f}}};
  const Batch good = batch_of(8, 0), bad = batch_of(8, 1, true);
  (void)m.train_step(std::span<const float>(good.x), std::span<const std::int32_t>(good.y), fp::SoftmaxCrossEntropy{}, opt);
  const auto params = copy(m.params());
  const auto state = copy(m.optimizer_state());
  const float loss = m.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y), fp::SoftmaxCrossEntropy{}, opt);
  CHECK(std::isnan(loss));
  CHECK(copy(m.params()) == params);
  CHECK(copy(m.optimizer_state()) == state);
  CHECK(m.skipped_steps() == 1);
  CHECK(m.optimizer_steps() == 1);
  (void)m.train_step(std::span<const float>(good.x), std::span<const std::int32_t>(good.y), fp::SoftmaxCrossEntropy{}, opt);
  CHECK(m.optimizer_steps() == 2);  // Adam's bias correction counts only the steps taken
  CHECK(copy(m.params()) != params);
}

TEST_CASE_TEMPLATE("every replica takes the same decision, whatever the reduce policy", P,
                   fp::Parallel<Net, fp::Host>, fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>,
                   fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>) {
  P dp{fp::replicas(3, 1), fp::seed(4)};
  const fp::Guarded<fp::Sgd, fp::nonfinite::Skip> skip{{{.lr = 0.1f, .momentum = 0.9f}}, {.max_norm = 1.0f}};
  const Batch good = batch_of(9, 0), bad = batch_of(9, 1, true);  // only the last replica sees the NaN
  (void)dp.train_step(std::span<const float>(good.x), std::span<const std::int32_t>(good.y), fp::SoftmaxCrossEntropy{}, skip);
  const auto params = copy(dp.model(0).params());
  (void)dp.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y), fp::SoftmaxCrossEntropy{}, skip);
  for (std::size_t r = 0; r < 3; ++r) CHECK(copy(dp.model(r).params()) == params);
  const fp::Guarded<fp::Sgd> stop{{{.lr = 0.1f}}};
  CHECK_THROWS_AS(dp.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y),
                                fp::SoftmaxCrossEntropy{}, stop),
                  fp::NumericError);
  for (std::size_t r = 0; r < 3; ++r) CHECK(copy(dp.model(r).params()) == params);
}

TEST_CASE_TEMPLATE("nonfinite::Stop under Parallel names the summed gradient's first tensor, whatever the policy", P,
                   fp::Parallel<Net, fp::Host>, fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>,
                   fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>) {
  // Only the last replica sees the NaN. Under ZeRO-1 each replica holds the sum of its own block only,
  // and under ReduceBroadcast only the root holds the sum: the message came from whichever replica
  // threw first, which named a tensor of its block, or no tensor. Many steps, for the race.
  const fp::Guarded<fp::Sgd> stop{{{.lr = 0.1f}}};
  const Batch bad = batch_of(9, 1, true);
  for (int attempt = 0; attempt < 12; ++attempt) {
    CAPTURE(attempt);
    P dp{fp::replicas(3, 1), fp::seed(4)};
    CHECK_THROWS_WITH_AS(dp.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y),
                                       fp::SoftmaxCrossEntropy{}, stop),
                         doctest::Contains("first in '0.weight'"), fp::NumericError);
  }
}
