// Tests of include/fusedp/parallel/bucket_plan.hpp: the plan at run time is the compile-time plan, its
// buckets tile the flat buffer in the order backward completes them, and a Parallel given
// ParallelOptions::bucket_bytes reduces exactly as one built with the Bucket<bytes> policy.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <cstring>
#include <vector>

namespace fp = fusedp;

namespace {
using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;

template <std::size_t Bytes>
void check_same_plan() {
  CAPTURE(Bytes);
  using Plan = fp::parallel::BucketPlan<Net, Bytes>;
  const std::vector<fp::parallel::GradientBucket> runtime = fp::parallel::bucket_plan<Net>(Bytes);
  REQUIRE(runtime.size() == Plan::count);
  std::size_t end = runtime.empty() ? 0 : runtime.front().end;
  for (std::size_t b = 0; b < runtime.size(); ++b) {
    CHECK(runtime[b].begin == Plan::buckets[b].begin);
    CHECK(runtime[b].end == Plan::buckets[b].end);
    CHECK(runtime[b].ready_after == Plan::buckets[b].ready_after);
    CHECK(runtime[b].end == end);  // contiguous, from the last layers down
    end = runtime[b].begin;
    if (b > 0) CHECK(runtime[b].ready_after <= runtime[b - 1].ready_after);
  }
  CHECK(end == 0);
}
}  // namespace

TEST_CASE("the run-time bucket plan is the compile-time one and tiles the buffer") {
  check_same_plan<0>();
  check_same_plan<256>();
  check_same_plan<1024>();
  check_same_plan<4096>();
  CHECK(fp::parallel::bucket_plan<Net>(0).size() == 1);
  CHECK(fp::parallel::bucket_plan<Net>(256).size() > 3);
}

TEST_CASE("ParallelOptions::bucket_bytes reduces as the Bucket<bytes> policy does, bit for bit") {
  fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>> policy{fp::replicas(3, 1), fp::seed(4)};
  fp::Parallel<Net, fp::Host, fp::Overlap> option{fp::replicas(3, 1), fp::seed(4), {.bucket_bytes = 512}};
  fp::Parallel<Net, fp::Host, fp::Overlap> whole{fp::replicas(3, 1), fp::seed(4)};
  fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
  std::vector<float> x(24 * Net::input_shape::size);
  std::vector<std::int32_t> y(24);
  for (int s = 0; s < 5; ++s) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(51, std::uint64_t(s), i) - 1;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(52, std::uint64_t(s), i) * 5);
    const std::span<const float> xs(x);
    const std::span<const std::int32_t> ys(y);
    (void)policy.train_step(xs, ys, fp::SoftmaxCrossEntropy{}, sgd);
    (void)option.train_step(xs, ys, fp::SoftmaxCrossEntropy{}, sgd);
    (void)whole.train_step(xs, ys, fp::SoftmaxCrossEntropy{}, sgd);
  }
  CHECK(std::memcmp(policy.model(2).params().data(), option.model(2).params().data(),
                    Net::param_storage * sizeof(float)) == 0);
  // One bucket reduces in another order of messages but the same sums: equal within rounding.
  double diff = 0;
  for (std::size_t i = 0; i < Net::param_storage; ++i)
    diff = std::max(diff, double(std::abs(policy.model(0).params()[i] - whole.model(0).params()[i])));
  CHECK(diff <= 1e-5);
}
