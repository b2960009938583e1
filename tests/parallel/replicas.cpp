// Parallel<> with replicas in one process: N replicas with per-replica batch B/N reproduce one replica
// with batch B, for every reduce policy and knob; Deterministic is bitwise reproducible and equal to
// one model accumulating the same shard gradients in replica order.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace fp = fusedp;
using test_support::relative_error;

namespace {

using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};

Batch batch_of(std::size_t size, std::uint64_t step) {
  Batch b{std::vector<float>(size * Net::input_shape::size), std::vector<std::int32_t>(size)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(11, step, i) - 1;
  for (std::size_t i = 0; i < size; ++i) b.y[i] = std::int32_t(fp::rng::uniform(12, step, i) * 5);
  return b;
}

// 20 steps of batch `size`; returns the losses.
template <class Trainer, class Opt>
std::vector<float> train(Trainer& t, Opt opt, std::size_t size, int steps = 20) {
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    losses.push_back(t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y),
                                  fp::SoftmaxCrossEntropy{}, opt));
  }
  return losses;
}

struct Reference {
  fp::Model<Net, fp::Host> model{fp::seed(3), fp::Host{1}};
  std::vector<float> losses;
  template <class Opt>
  explicit Reference(Opt opt, std::size_t size) {
    losses = train(model, opt, size);
  }
};

template <class P, class Opt>
void check_matches(const char* name, Opt opt, int replicas, std::size_t size, double tolerance,
                   float lr_scale = 1.0f) {
  CAPTURE(name);
  CAPTURE(replicas);
  const Reference ref(opt, size);
  P dp{fp::replicas(replicas, 1), fp::seed(3)};
  Opt scaled = opt;
  scaled.options.lr /= lr_scale;
  const std::vector<float> losses = train(dp, scaled, size);
  for (std::size_t s = 0; s < losses.size(); ++s) CHECK(std::abs(losses[s] - ref.losses[s]) <= tolerance * std::abs(ref.losses[s]));
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) CHECK(relative_error(dp.model(r).params(), ref.model.params()) <= tolerance);
}

const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};

}  // namespace

TEST_CASE("N replicas reproduce one replica with the global batch, for every reduce policy") {
  for (int n : {2, 3}) {
    check_matches<fp::Parallel<Net, fp::Host>>("AllReduce", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::reduce::AllReduce<fp::Bucket<512>>>>("Bucket", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>>("Bucket+Overlap", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>>("ReduceBroadcast", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>>("ReduceScatter", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<fp::Overlap, fp::Bucket<256>>>>(
        "ReduceScatter+Overlap", sgd, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host, fp::Deterministic>>("Deterministic", sgd, n, 24, 1e-5);
    // Adam is not linear in the gradient: a wrong scale would show.
    check_matches<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>>("ReduceScatter+Adam",
                                                                            fp::Adam{{.lr = 1e-3f}}, n, 24, 1e-5);
    check_matches<fp::Parallel<Net, fp::Host>>("AllReduce+AdamW", fp::AdamW{{.lr = 1e-3f}}, n, 24, 1e-5);
  }
}

TEST_CASE("Sum adds the replicas' mean-loss gradients: plain SGD with lr / N matches the average") {
  check_matches<fp::Parallel<Net, fp::Host, fp::Sum>>("Sum", fp::Sgd{{.lr = 0.1f}}, 3, 24, 1e-5, 3.0f);
}

TEST_CASE("Compress<bf16> stays within the bfloat16 bound") {
  // bf16 keeps 8 significant bits (relative rounding 2^-9 per value); over 20 momentum steps the
  // parameters drift from the float reduction by well under 1e-2 relative.
  check_matches<fp::Parallel<Net, fp::Host, fp::Compress<fp::bf16>>>("Compress", sgd, 3, 24, 1e-2);
}

TEST_CASE("uneven shards and Weighted are weighted by their sample counts") {
  check_matches<fp::Parallel<Net, fp::Host>>("uneven 25 over 3", sgd, 3, 25, 1e-5);
  const Reference ref(sgd, 24);
  fp::Parallel<Net, fp::Host, fp::scatter::Weighted> dp{fp::replicas(3, 1), fp::seed(3)};
  const double w[] = {1, 2, 3};
  dp.set_weights(w);
  const auto losses = train(dp, sgd, 24);
  CHECK(std::abs(losses.back() - ref.losses.back()) <= 1e-5 * ref.losses.back());
  CHECK(relative_error(dp.model(1).params(), ref.model.params()) <= 1e-5);
}

TEST_CASE("Weighted shards for any finite weights: huge, tiny, equal") {
  const auto counts = [](std::size_t batch, std::vector<double> w) {
    std::vector<std::size_t> c;
    std::size_t at = 0;
    for (const fp::parallel::Shard& s : fp::parallel::weighted_shards(batch, w)) {
      CHECK(s.offset == at);
      at += s.count;
      c.push_back(s.count);
    }
    CHECK(at == batch);
    return c;
  };
  // The sum of the weights overflowed to infinity: the shards came out of NaN.
  CHECK(counts(4, {1e308, 1e308}) == std::vector<std::size_t>{2, 2});
  CHECK(counts(10, {1e308, 1e308, 1e308}) == std::vector<std::size_t>{4, 3, 3});
  CHECK(counts(10, {1.7e308, 1e-300}) == std::vector<std::size_t>{9, 1});
  CHECK(counts(24, {1, 2, 3}) == std::vector<std::size_t>{5, 8, 11});  // one each, then 3.5, 7, 10.5 of 21
}

TEST_CASE("Deterministic: bitwise equal to one model accumulating the shard gradients in replica order") {
  constexpr std::size_t size = 25, n = 3;
  fp::Parallel<Net, fp::Host, fp::Deterministic, fp::Overlap, fp::Bucket<1024>> dp{fp::replicas(n, 1), fp::seed(3)};
  fp::Parallel<Net, fp::Host, fp::Deterministic, fp::Overlap, fp::Bucket<1024>> again{fp::replicas(n, 1), fp::seed(3)};
  fp::Model<Net, fp::Host> one{fp::seed(3), fp::Host{1}};
  std::vector<float> sum(Net::param_storage);
  for (int s = 0; s < 10; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    const float l1 = dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, sgd);
    const float l2 = again.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, sgd);
    CHECK(std::memcmp(&l1, &l2, sizeof l1) == 0);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (const auto& shard : fp::parallel::even_shards(size, n)) {
      const std::span<const float> x(b.x.data() + shard.offset * Net::input_shape::size, shard.count * Net::input_shape::size);
      const std::span<const std::int32_t> y(b.y.data() + shard.offset, shard.count);
      (void)one.compute_gradients(x, y, fp::SoftmaxCrossEntropy{}, {}, size);  // share of the global mean
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + one.grads()[i];
    }
    std::copy(sum.begin(), sum.end(), one.grads().begin());
    one.step(sgd);
  }
  for (std::size_t r = 0; r < n; ++r) {
    CHECK(std::memcmp(dp.model(r).params().data(), one.params().data(), Net::param_storage * sizeof(float)) == 0);
    CHECK(std::memcmp(dp.model(r).params().data(), again.model(r).params().data(), Net::param_storage * sizeof(float)) == 0);
  }
}

TEST_CASE("bad input: a clear error, and nothing changes") {
  CHECK_THROWS_AS((fp::Parallel<Net, fp::Host>{fp::replicas(0)}), fp::InvalidArgument);
  fp::Parallel<Net, fp::Host> dp{fp::replicas(4, 1), fp::seed(3)};
  const std::vector<float> before(dp.model(0).params().begin(), dp.model(0).params().end());
  const Batch small = batch_of(3, 0);
  CHECK_THROWS_WITH_AS(dp.train_step(std::span<const float>(small.x), std::span<const std::int32_t>(small.y),
                                     fp::SoftmaxCrossEntropy{}, sgd),
                       doctest::Contains("smaller than the 4 replicas"), fp::InvalidArgument);
  Batch bad = batch_of(8, 0);
  bad.y[5] = 7;
  CHECK_THROWS_AS(dp.train_step(std::span<const float>(bad.x), std::span<const std::int32_t>(bad.y),
                                fp::SoftmaxCrossEntropy{}, sgd),
                  fp::InvalidArgument);
  CHECK(std::equal(before.begin(), before.end(), dp.model(0).params().begin()));
  fp::Parallel<Net, fp::Host, fp::scatter::Weighted> w{fp::replicas(2, 1)};
  const double wrong[] = {1, -1};
  CHECK_THROWS_AS(w.set_weights(wrong), fp::InvalidArgument);
}

TEST_CASE("evaluation counts every sample once and matches one model") {
  fp::Parallel<Net, fp::Host> dp{fp::replicas(3, 1), fp::seed(3)};
  fp::Model<Net, fp::Host> one{fp::seed(3), fp::Host{1}};
  const Batch b = batch_of(17, 99);
  const auto g = dp.evaluate(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{});
  const auto e = one.evaluate(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{});
  CHECK(g.count == 17);
  CHECK(g.loss() == doctest::Approx(e.loss).epsilon(1e-6));
  CHECK(g.correct == fp::count_correct(e.outputs, std::span<const std::int32_t>(b.y)));
}

namespace {
// SoftmaxCrossEntropy, except that the replica whose shard has `fail_at` samples throws: one replica
// fails while the others go on into the step's collectives.
struct FailingLoss : fp::SoftmaxCrossEntropy {
  std::size_t fail_at;
  template <class T>
  T operator()(const fp::Host& h, std::size_t batch, std::size_t classes, const T* logits, const std::int32_t* labels,
               T* dlogits) const {
    if (batch == fail_at && dlogits != nullptr) throw std::runtime_error("the loss of one replica failed");
    return fp::SoftmaxCrossEntropy::operator()(h, batch, classes, logits, labels, dlogits);
  }
};

template <class P>
void check_one_replica_fails() {
  P dp{fp::replicas(3, 1), fp::seed(3)};
  const Batch b = batch_of(10, 0);  // shards of 4, 3 and 3 samples
  const Batch even = batch_of(9, 1);
  // Replicas 1 and 2 fail; replica 0 waits for them in its first collective and must be released.
  CHECK_THROWS_WITH(dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), FailingLoss{{}, 3},
                                  sgd),
                    "the loss of one replica failed");
  // Replica 0 alone fails; the others are released, and the original error is the one reported.
  CHECK_THROWS_WITH(dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), FailingLoss{{}, 4},
                                  sgd),
                    "the loss of one replica failed");
  // The group is usable again: a normal step runs on every replica and keeps them equal.
  const float l = dp.train_step(std::span<const float>(even.x), std::span<const std::int32_t>(even.y),
                                fp::SoftmaxCrossEntropy{}, sgd);
  CHECK(std::isfinite(l));
  for (std::size_t r = 1; r < dp.local_replicas(); ++r)
    CHECK(std::equal(dp.model(0).params().begin(), dp.model(0).params().end(), dp.model(r).params().begin()));
}
}  // namespace

TEST_CASE("a replica that fails during a step makes the step throw its error on the caller, never hang") {
  check_one_replica_fails<fp::Parallel<Net, fp::Host>>();
  check_one_replica_fails<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<256>>>();
  check_one_replica_fails<fp::Parallel<Net, fp::Host, fp::Deterministic, fp::reduce::ReduceScatter<>>>();
  check_one_replica_fails<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>>();
}
