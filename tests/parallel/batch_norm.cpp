// Parallel<> with BatchNorm (batch_norm::Broadcast): each replica normalizes with its own shard's
// statistics, as DDP does without SyncBatchNorm, so 2 replicas on a batch of 2B compute what two
// models on the two halves compute, gradients averaged; after every step every replica holds replica
// 0's running statistics. With batch_norm::Sync (SyncBatchNorm) N replicas compute what one model
// computes on the global batch. A policy is required (tests/compile_fail/parallel_batch_norm_policy.cpp).
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <cmath>
#include <vector>

namespace fp = fusedp;
using test_support::relative_error;

namespace {

using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                           fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                           fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;

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
    CHECK(relative_error(dp.model(0).params(), a.params()) <= 1e-5);
    CHECK(relative_error(dp.model(0).buffers(), a.buffers()) <= 1e-5);
    // Every replica holds the same running statistics, bit for bit.
    CHECK(std::equal(dp.model(0).buffers().begin(), dp.model(0).buffers().end(), dp.model(1).buffers().begin()));
  }
  // The statistics moved from their start (mean 0, variance 1) and the batches are counted.
  const auto& nbt = Net::state_layout[2];
  CHECK(dp.model(1).buffers()[nbt.offset] == 4.0f);
}

namespace {

// A BatchNorm1d after a Linear too: its shard of one sample is a valid part of a global batch.
using SyncNet = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                               fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>,
                                            fp::Projection<fp::Conv2d<4, 1, 1, 0, fp::no_bias>, fp::BatchNorm2d<>>>,
                               fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<5>, fp::BatchNorm1d<>, fp::ReLU,
                               fp::Linear<3>>;

// N replicas with batch_norm::Sync against one model on the whole batch: the same loss, the same
// reduced gradient, parameters and running statistics, step after step; the replicas' statistics
// equal bit for bit (the in-process sums are in rank order, so every replica gets the same bits).
template <int Replicas>
void check_sync(std::size_t batch, std::uint64_t seed) {
  constexpr std::size_t in = SyncNet::input_shape::size;
  fp::Parallel<SyncNet, fp::Host, fp::batch_norm::Sync> dp{fp::replicas(Replicas, 1), fp::seed(seed)};
  fp::Model<SyncNet, fp::Host> one{fp::seed(seed), fp::Host{1}};
  const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
  fp::Sgd o_dp = sgd, o_one = sgd;
  for (std::uint64_t step = 0; step < 3; ++step) {
    CAPTURE(step);
    std::vector<float> x(batch * in);
    std::vector<std::int32_t> y(batch);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(seed + 23, step, i) - 1;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(seed + 24, step, i) * 3);
    const std::span<const float> xs(x);
    const std::span<const std::int32_t> ys(y);
    const float loss = dp.train_step(xs, ys, fp::SoftmaxCrossEntropy{}, o_dp);
    const float l1 = one.compute_gradients(xs, ys, fp::SoftmaxCrossEntropy{});
    CHECK(loss == doctest::Approx(l1).epsilon(1e-5));
    for (int r = 0; r < Replicas; ++r) CHECK(relative_error(dp.model(std::size_t(r)).grads(), one.grads()) <= 1e-5);
    (void)one.step(o_one);
    CHECK(relative_error(dp.model(0).params(), one.params()) <= 1e-5);
    CHECK(relative_error(dp.model(0).buffers(), one.buffers()) <= 1e-5);
    for (int r = 1; r < Replicas; ++r) {
      const auto b0 = dp.model(0).buffers(), br = dp.model(std::size_t(r)).buffers();
      CHECK(std::equal(b0.begin(), b0.end(), br.begin()));
    }
  }
  // Evaluation with the running statistics: the same logits as the one model.
  std::vector<float> x(batch * in);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(seed + 25, 0, i);
  const std::span<const float> logits = one.predict(x);
  const std::vector<float> want(logits.begin(), logits.end());
  CHECK(relative_error(dp.model(Replicas - 1).predict(x), want) <= 1e-5);
}

}  // namespace

TEST_CASE("batch_norm::Sync: 2 replicas compute what one model computes on the global batch") {
  check_sync<2>(8, 3);
  check_sync<2>(5, 4);  // uneven shards (3 and 2): the counts are summed with the statistics
}

TEST_CASE("batch_norm::Sync: 3 replicas, shards of one sample for the BatchNorm1d") {
  check_sync<3>(7, 5);
  check_sync<3>(3, 6);
}

TEST_CASE("batch_norm::Sync differs from Broadcast: each shard's statistics are not the global ones") {
  // Guards against a Sync that silently does nothing: Broadcast's gradient on the same data differs.
  constexpr std::size_t batch = 8, in = SyncNet::input_shape::size;
  fp::Parallel<SyncNet, fp::Host, fp::batch_norm::Sync> sync{fp::replicas(2, 1), fp::seed(9)};
  fp::Parallel<SyncNet, fp::Host, fp::batch_norm::Broadcast> local{fp::replicas(2, 1), fp::seed(9)};
  std::vector<float> x(batch * in);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(41, 0, i) - 1;
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(42, 0, i) * 3);
  fp::Sgd a{{.lr = 0.1f}}, b{{.lr = 0.1f}};
  (void)sync.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, a);
  (void)local.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, b);
  CHECK(relative_error(sync.model(0).grads(), local.model(0).grads()) > 1e-3);
}
