// Parallel<> with BatchNorm (batch_norm::Broadcast): each replica normalizes with its own shard's
// statistics, as DDP does without SyncBatchNorm, so 2 replicas on a batch of 2B compute what two
// models on the two halves compute, gradients averaged; after every step every replica holds replica
// 0's running statistics. The policy is required (tests/compile_fail/parallel_batch_norm_policy.cpp).
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <cmath>
#include <vector>

namespace fp = fusedp;

namespace {

using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                           fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                           fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;

double relative(std::span<const float> a, std::span<const float> b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  return n == 0 ? std::sqrt(d) : std::sqrt(d / n);
}

}  // namespace

TEST_CASE("2 replicas with batch_norm::Broadcast: local batch statistics, replica 0's running statistics") {
  constexpr std::size_t half = 4, in = Net::input_shape::size;
  fp::Parallel<Net, fp::Host, fp::batch_norm::Broadcast> dp{fp::replicas(2, 1), fp::seed(8)};
  // The reference: two models on the two halves, their gradients averaged by hand, one update.
  fp::Model<Net, fp::Host> a{fp::seed(8), fp::Host{1}}, b{fp::seed(8), fp::Host{1}};
  const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
  fp::Sgd o_dp = sgd, o_a = sgd;
  for (std::uint64_t step = 0; step < 4; ++step) {
    std::vector<float> x(2 * half * in);
    std::vector<std::int32_t> y(2 * half);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(21, step, i) - 1;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(22, step, i) * 3);
    const std::span<const float> xs(x);
    const std::span<const std::int32_t> ys(y);
    const float loss = dp.train_step(xs, ys, fp::SoftmaxCrossEntropy{}, o_dp);
    const float la = a.compute_gradients(xs.first(half * in), ys.first(half), fp::SoftmaxCrossEntropy{});
    const float lb = b.compute_gradients(xs.subspan(half * in), ys.subspan(half), fp::SoftmaxCrossEntropy{});
    CHECK(loss == doctest::Approx(0.5 * (la + lb)).epsilon(1e-5));
    for (std::size_t i = 0; i < Net::param_storage; ++i) a.grads()[i] = 0.5f * (a.grads()[i] + b.grads()[i]);
    (void)a.step(o_a);
    b.load_params(a.params());
    b.load_buffers(a.buffers());  // what Broadcast does: replica 0's statistics everywhere
    CHECK(relative(dp.model(0).params(), a.params()) <= 1e-5);
    CHECK(relative(dp.model(0).buffers(), a.buffers()) <= 1e-5);
    // Every replica holds the same running statistics, bit for bit.
    CHECK(std::equal(dp.model(0).buffers().begin(), dp.model(0).buffers().end(), dp.model(1).buffers().begin()));
  }
  // The statistics moved from their start (mean 0, variance 1) and the batches are counted.
  const auto& nbt = Net::state_layout[2];
  CHECK(dp.model(1).buffers()[nbt.offset] == 4.0f);
}
