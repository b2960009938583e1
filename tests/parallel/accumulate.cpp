// Gradient accumulation (ParallelOptions::accumulate, parallel/detail/accumulate.hpp): K micro-batches
// per replica and one reduction and update per step reproduce one model on the K-times-larger batch,
// for every reduce policy; under Deterministic bit for bit the one model that adds the same
// micro-batch gradients in the same order.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace fp = fusedp;
using test_support::relative_error;

namespace {

using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  std::span<const float> inputs() const { return x; }
  std::span<const std::int32_t> labels() const { return y; }
};

Batch batch_of(std::size_t size, std::uint64_t step) {
  Batch b{std::vector<float>(size * Net::input_shape::size), std::vector<std::int32_t>(size)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(21, step, i) - 1;
  for (std::size_t i = 0; i < size; ++i) b.y[i] = std::int32_t(fp::rng::uniform(22, step, i) * 5);
  return b;
}

const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};

// `steps` steps of a batch of `size` on `t`; returns the losses.
template <class Trainer, class Opt>
std::vector<float> train(Trainer& t, const Opt& opt, std::size_t size, int steps = 12) {
  std::vector<float> losses;
  Opt o = opt;
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    losses.push_back(t.train_step(b.inputs(), b.labels(), fp::SoftmaxCrossEntropy{}, o));
  }
  return losses;
}

template <class P, class Opt>
void check_matches_larger_batch(const char* name, const Opt& opt, int replicas, int micro, std::size_t size) {
  CAPTURE(name);
  CAPTURE(replicas);
  CAPTURE(micro);
  CAPTURE(size);
  fp::Model<Net, fp::Host> one{fp::seed(5), fp::Host{1}};
  const std::vector<float> expected = train(one, opt, size);
  P dp{fp::replicas(replicas, 1), fp::seed(5), {.accumulate = micro}};
  CHECK(dp.accumulate() == std::size_t(micro));
  const std::vector<float> losses = train(dp, opt, size);
  for (std::size_t s = 0; s < losses.size(); ++s) CHECK(std::abs(losses[s] - expected[s]) <= 1e-5 * std::abs(expected[s]));
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) CHECK(relative_error(dp.model(r).params(), one.params()) <= 1e-5);
}

// Dropout's masks are drawn per element of the step's global batch: replicas and micro-batches draw
// what one model on the whole batch draws (with the same mask over every shard's own samples, the
// parameters would part within a step).
using DropNet = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Dropout<0.3f>,
                               fp::MaxPool2d<2>, fp::Flatten, fp::Linear<24>, fp::Tanh, fp::Dropout<0.5f>,
                               fp::Linear<5>>;

template <class P>
void check_dropout_matches_one_model(const char* name, int replicas, int micro, std::size_t size) {
  CAPTURE(name);
  CAPTURE(replicas);
  CAPTURE(micro);
  fp::Model<DropNet, fp::Host> one{fp::seed(6), fp::Host{1}};
  const std::vector<float> expected = train(one, sgd, size, 6);
  P dp{fp::replicas(replicas, 1), fp::seed(6), {.accumulate = micro}};
  const std::vector<float> losses = train(dp, sgd, size, 6);
  for (std::size_t s = 0; s < losses.size(); ++s) CHECK(std::abs(losses[s] - expected[s]) <= 1e-5 * std::abs(expected[s]));
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) CHECK(relative_error(dp.model(r).params(), one.params()) <= 1e-5);
}

}  // namespace

TEST_CASE("Dropout under Parallel and accumulation draws the masks of one model on the global batch") {
  check_dropout_matches_one_model<fp::Parallel<DropNet, fp::Host>>("AllReduce", 2, 1, 24);
  check_dropout_matches_one_model<fp::Parallel<DropNet, fp::Host>>("AllReduce", 3, 2, 25);
  check_dropout_matches_one_model<fp::Parallel<DropNet, fp::Host>>("one replica", 1, 3, 24);
  check_dropout_matches_one_model<fp::Parallel<DropNet, fp::Host, fp::scatter::Sharded>>("Sharded", 2, 2, 24);
  // the masks differ from step to step and from one global position to the next
  fp::Model<DropNet, fp::Host> m{fp::seed(6), fp::Host{1}};
  const Batch b = batch_of(4, 0);
  const auto twice = std::vector<float>(b.x.begin(), b.x.begin() + std::ptrdiff_t(DropNet::input_shape::size));
  std::vector<float> same(2 * twice.size());
  std::copy(twice.begin(), twice.end(), same.begin());
  std::copy(twice.begin(), twice.end(), same.begin() + std::ptrdiff_t(twice.size()));
  const std::vector<std::int32_t> labels{1, 1};
  (void)m.compute_gradients(std::span<const float>(same), std::span<const std::int32_t>(labels), fp::SoftmaxCrossEntropy{});
  const std::vector<float> g0(m.grads().begin(), m.grads().end());
  // the same sample twice: its two copies get different masks, so the gradient differs from that of
  // the sample at position 0 alone, and from the same pair placed one sample later in the global batch
  (void)m.compute_gradients(std::span<const float>(same), std::span<const std::int32_t>(labels), fp::SoftmaxCrossEntropy{},
                            {}, 0, {}, 1);
  const std::vector<float> g1(m.grads().begin(), m.grads().end());
  CHECK(g0 != g1);
}

TEST_CASE("accumulate K: one update on the summed gradient of K micro-batches equals one model on the whole batch") {
  for (int micro : {2, 3}) {
    check_matches_larger_batch<fp::Parallel<Net, fp::Host>>("AllReduce", sgd, 2, micro, 24);
    check_matches_larger_batch<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>>("Overlap", sgd, 3, micro, 25);
    check_matches_larger_batch<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>>("ReduceBroadcast", sgd, 2,
                                                                                          micro, 24);
    check_matches_larger_batch<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<fp::Overlap, fp::Bucket<512>>>>(
        "ReduceScatter", fp::Adam{{.lr = 1e-3f}}, 3, micro, 24);
    check_matches_larger_batch<fp::Parallel<Net, fp::Host, fp::scatter::Sharded>>("Sharded", sgd, 2, micro, 24);
  }
  // One replica: accumulation without data parallelism.
  check_matches_larger_batch<fp::Parallel<Net, fp::Host>>("one replica", sgd, 1, 4, 24);
  // Shards smaller than K: one micro-batch per sample.
  check_matches_larger_batch<fp::Parallel<Net, fp::Host>>("shards of 2", sgd, 3, 4, 6);
}

TEST_CASE("accumulate K: a shard of one sample after larger ones adds no stale micro-batch sum") {
  // An epoch's last batch may leave a replica one sample: one micro-batch, whose gradient is the step's.
  // Steps of 24 samples (micro-batches summed in the replica's sum buffer), then of 3 (shards of 2 and 1).
  const auto check = [&]<class P>(const std::string& name, int replicas, int micro) {
    CAPTURE(name);
    fp::Model<Net, fp::Host> one{fp::seed(5), fp::Host{1}};
    P dp{fp::replicas(replicas, 1), fp::seed(5), {.accumulate = micro}};
    fp::Sgd o1 = sgd, o2 = sgd;
    for (std::size_t size : {24, 3, 24, 3}) {
      CAPTURE(size);
      const Batch b = batch_of(size, size);
      const float want = one.train_step(b.inputs(), b.labels(), fp::SoftmaxCrossEntropy{}, o1);
      const float got = dp.train_step(b.inputs(), b.labels(), fp::SoftmaxCrossEntropy{}, o2);
      CHECK(std::abs(got - want) <= 1e-5 * std::abs(want));
      for (std::size_t r = 0; r < dp.local_replicas(); ++r)
        CHECK(relative_error(dp.model(r).params(), one.params()) <= 1e-5);
    }
  };
  check.template operator()<fp::Parallel<Net, fp::Host>>("AllReduce", 2, 4);
  check.template operator()<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>>("Overlap", 2, 2);
  check.template operator()<fp::Parallel<Net, fp::Host>>("one replica", 1, 3);
}

TEST_CASE("accumulate K under Deterministic: bit for bit the micro-batch gradients added in order, then in rank order") {
  constexpr std::size_t size = 26, n = 2, micro = 3;
  using P = fp::Parallel<Net, fp::Host, fp::Deterministic, fp::Overlap, fp::Bucket<1024>>;
  P dp{fp::replicas(n, 1), fp::seed(5), {.accumulate = int(micro)}};
  P again{fp::replicas(n, 1), fp::seed(5), {.accumulate = int(micro)}};
  fp::Model<Net, fp::Host> one{fp::seed(5), fp::Host{1}};
  std::vector<float> sum(Net::param_storage), acc(Net::param_storage);
  for (int s = 0; s < 6; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    const float l1 = dp.train_step(b.inputs(), b.labels(), fp::SoftmaxCrossEntropy{}, sgd);
    const float l2 = again.train_step(b.inputs(), b.labels(), fp::SoftmaxCrossEntropy{}, sgd);
    CHECK(std::memcmp(&l1, &l2, sizeof l1) == 0);
    std::fill(sum.begin(), sum.end(), 0.0f);
    double loss_sum = 0;
    for (const auto& shard : fp::parallel::even_shards(size, n)) {
      const auto pieces = fp::parallel::even_shards(shard.count, micro);
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        const std::size_t at = shard.offset + pieces[k].offset;
        const std::span<const float> x = b.inputs().subspan(at * Net::input_shape::size,
                                                            pieces[k].count * Net::input_shape::size);
        const std::span<const std::int32_t> y = b.labels().subspan(at, pieces[k].count);
        loss_sum += double(one.compute_gradients(x, y, fp::SoftmaxCrossEntropy{}, {}, size)) * double(pieces[k].count);
        for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = k == 0 ? one.grads()[i] : acc[i] + one.grads()[i];
      }
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + acc[i];
    }
    std::copy(sum.begin(), sum.end(), one.grads().begin());
    one.step(sgd);
    CHECK(std::abs(double(l1) - loss_sum / double(size)) <= 1e-6 * std::abs(double(l1)));
  }
  for (std::size_t r = 0; r < n; ++r) {
    CHECK(std::memcmp(dp.model(r).params().data(), one.params().data(), Net::param_storage * sizeof(float)) == 0);
    CHECK(std::memcmp(dp.model(r).params().data(), again.model(r).params().data(),
                      Net::param_storage * sizeof(float)) == 0);
  }
}

TEST_CASE("accumulate with a BatchNorm over single values: micro-batches of two samples, shards of one refused") {
  // BatchNorm1d needs two samples a micro-batch: a shard of 5 with accumulate 4 runs 2 micro-batches
  // (3 and 2 samples), not 4 of which three hold one sample (which threw mid-step, after the first
  // micro-batch had moved the statistics).
  using Bn1d = fp::Sequential<fp::Input<2, 4, 4>, fp::Conv2d<3, 3, 1, 1>, fp::ReLU, fp::Flatten, fp::Linear<8>,
                              fp::BatchNorm1d<>, fp::ReLU, fp::Linear<5>>;
  static_assert(Bn1d::min_training_batch == 2);
  CHECK(fp::parallel::detail::micro_batch_count(5, 4, false, 2) == 2);
  CHECK(fp::parallel::detail::micro_batch_count(9, 4, false, 2) == 4);
  CHECK(fp::parallel::detail::micro_batch_count(3, 4, false, 2) == 1);
  CHECK(fp::parallel::detail::micro_batch_count(5, 4, false) == 4);
  using P = fp::Parallel<Bn1d, fp::Host, fp::batch_norm::Broadcast>;
  P dp{fp::replicas(2, 1), fp::seed(8), {.accumulate = 4}};
  fp::Sgd o = sgd;
  const auto step = [&](std::size_t size) {
    std::vector<float> x(size * Bn1d::input_shape::size);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(31, size, i) - 1;
    const std::vector<std::int32_t> y(size, 3);
    return dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, o);
  };
  CHECK(std::isfinite(step(16)));
  CHECK(std::isfinite(step(10)));  // shards of 5: micro-batches of 3 and 2
  CHECK(dp.model(0).steps() == 2);
  CHECK(std::memcmp(dp.model(0).params().data(), dp.model(1).params().data(), Bn1d::param_storage * sizeof(float)) == 0);
  // A shard of one sample (3 over 2 replicas) cannot train: refused before either replica starts.
  const std::vector<float> params(dp.model(0).params().begin(), dp.model(0).params().end());
  const std::vector<float> state(dp.model(1).buffers().begin(), dp.model(1).buffers().end());
  CHECK_THROWS_WITH_AS(step(3), doctest::Contains("a replica's shard of 1 sample(s)"), fp::InvalidArgument);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(std::equal(params.begin(), params.end(), dp.model(r).params().begin()));
    CHECK(std::equal(state.begin(), state.end(), dp.model(r).buffers().begin()));
  }
  CHECK(dp.model(0).steps() == 2);
}

TEST_CASE("accumulate: bad counts are refused with a message that names them") {
  CHECK_THROWS_WITH_AS((fp::Parallel<Net, fp::Host>{fp::replicas(2, 1), fp::seed(5), {.accumulate = 0}}),
                       doctest::Contains("accumulate must be >= 1, got 0"), fp::InvalidArgument);
  using BnNet = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Flatten,
                               fp::Linear<5>>;
  fp::Parallel<BnNet, fp::Host, fp::batch_norm::Sync> dp{fp::replicas(2, 1), fp::seed(5), {.accumulate = 4}};
  const std::vector<float> before(dp.model(0).params().begin(), dp.model(0).params().end());
  std::vector<float> x(6 * BnNet::input_shape::size, 0.5f);
  std::vector<std::int32_t> y(6, 1);
  CHECK_THROWS_WITH_AS(dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                     fp::SoftmaxCrossEntropy{}, sgd),
                       doctest::Contains("accumulate 4 with batch_norm::Sync needs at least 4 samples"),
                       fp::InvalidArgument);
  CHECK(std::equal(before.begin(), before.end(), dp.model(0).params().begin()));
  // 7 samples: shards of 4 and 3, the second one too small. Refused before either replica starts, so
  // neither's parameters nor BatchNorm statistics change (replica 0 used to run its first micro-batch).
  const std::vector<float> state_before(dp.model(0).buffers().begin(), dp.model(0).buffers().end());
  x.assign(7 * BnNet::input_shape::size, 0.25f);
  y.assign(7, 2);
  CHECK_THROWS_WITH_AS(dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                     fp::SoftmaxCrossEntropy{}, sgd),
                       doctest::Contains("accumulate 4 with batch_norm::Sync needs at least 4 samples"),
                       fp::InvalidArgument);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(std::equal(before.begin(), before.end(), dp.model(r).params().begin()));
    CHECK(std::equal(state_before.begin(), state_before.end(), dp.model(r).buffers().begin()));
  }
  // Sharded: each replica learns the others' counts from their sum, then all refuse together.
  fp::Parallel<BnNet, fp::Host, fp::scatter::Sharded, fp::batch_norm::Sync> sharded{fp::replicas(2, 1), fp::seed(5),
                                                                                    {.accumulate = 4}};
  const std::vector<float> sharded_state(sharded.model(1).buffers().begin(), sharded.model(1).buffers().end());
  CHECK_THROWS_WITH_AS(sharded.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                          fp::SoftmaxCrossEntropy{}, sgd),
                       doctest::Contains("the smallest has 3"), fp::InvalidArgument);
  for (std::size_t r = 0; r < 2; ++r)
    CHECK(std::equal(sharded_state.begin(), sharded_state.end(), sharded.model(r).buffers().begin()));
  // With enough samples per shard it trains, and both replicas stay equal.
  x.resize(8 * BnNet::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(23, 0, i) - 1;
  y.assign(8, 3);
  (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, sgd);
  CHECK(std::memcmp(dp.model(0).params().data(), dp.model(1).params().data(), BnNet::param_storage * sizeof(float)) ==
        0);
}
