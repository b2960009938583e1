// Parallel's fused update (parallel/detail/bucket_update.hpp): with AllReduce each replica updates a
// bucket's parameters as soon as that bucket's sum is final. The parameters, optimizer state, gradients
// and losses are those of the one pass after the last reduction (use_fused_update(false)), bit for bit,
// for SGD (momentum, Nesterov, weight decay on the weights only), Adam and AdamW, with and without
// Overlap, under Deterministic, Compress<bf16>, accumulation, and a network with BatchNorm (Sync) and a
// residual block, two threads a replica and a change of optimizer; with Overlap the updates really run
// during backward (the trace says where); an optimizer's first step (which creates its state) is one
// pass, so a step that throws on bad input still changes nothing.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace fp = fusedp;

namespace {

using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;
using BlockNet = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                                fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                                fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<5>>;

template <class N>
struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  Batch(std::size_t size, std::uint64_t step) : x(size * N::input_shape::size), y(size) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(31, step, i) - 1;
    for (std::size_t i = 0; i < size; ++i) y[i] = std::int32_t(fp::rng::uniform(32, step, i) * 5);
  }
};

bool same_bits(std::span<const float> a, std::span<const float> b) {
  // memcmp never sees an empty span's null pointer (a replica without optimizer state).
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

// One traced step of `dp`: its loss, replica 0's optimizer spans, and whether the first of them began
// before replica 0's last backward span ended.
struct Traced {
  float loss = 0;
  std::size_t updates = 0;
  bool during_backward = false;
};
template <class P, class N, class Opt>
Traced traced_step(P& dp, const Batch<N>& batch, Opt& opt) {
  fp::trace::Recorder recorder;
  Traced t;
  {
    const fp::trace::Session session(recorder);
    t.loss = dp.train_step(std::span<const float>(batch.x), std::span<const std::int32_t>(batch.y),
                           fp::SoftmaxCrossEntropy{}, opt);
  }
  std::size_t updates = 0;
  std::int64_t first_update = 0, backward_end = 0;
  for (const fp::trace::Span& s : recorder.spans()) {
    if (s.lane != 0) continue;
    if (s.kind == fp::trace::Kind::optimizer) {
      ++updates;
      if (first_update == 0 || s.begin_ns < first_update) first_update = s.begin_ns;
    }
    if (s.kind == fp::trace::Kind::backward) backward_end = std::max(backward_end, s.end_ns);
  }
  REQUIRE(backward_end > 0);
  t.updates = updates;
  t.during_backward = first_update < backward_end;
  return t;
}

// `steps` steps of two Parallels of policy P, one with the fused update (the default) and one without:
// every replica's parameters, gradients and optimizer state, and the losses, bit for bit. The last
// step is traced: where `fused` (the fused update applies), replica 0 updates once per bucket, else once.
template <class P, class Opt>
void check_same_bits(const char* name, Opt opt, int replicas, bool fused, fp::ParallelOptions options = {},
                     int threads = 1, int steps = 5) {
  using N = typename P::model_type::network;
  const std::string label = name;
  CAPTURE(label);
  CAPTURE(replicas);
  P with{fp::replicas(replicas, threads), fp::seed(5), options};
  P separate{fp::replicas(replicas, threads), fp::seed(5), options};
  CHECK(with.uses_fused_update());
  separate.use_fused_update(false);
  Opt a = opt, b = opt;
  for (int s = 0; s < steps; ++s) {
    const Batch<N> batch(std::size_t(6 * replicas), std::uint64_t(s));
    const std::span<const float> x(batch.x);
    const std::span<const std::int32_t> y(batch.y);
    float la = 0;
    if (s + 1 < steps) {
      la = with.train_step(x, y, fp::SoftmaxCrossEntropy{}, a);
    } else {
      const Traced t = traced_step(with, batch, a);
      const std::size_t buckets = fp::parallel::bucket_plan<N>(P::bucket_bytes(options)).size();
      CHECK(t.updates == (fused ? buckets : 1));
      if (!fused) CHECK_FALSE(t.during_backward);
      la = t.loss;
    }
    const float lb = separate.train_step(x, y, fp::SoftmaxCrossEntropy{}, b);
    CHECK(std::memcmp(&la, &lb, sizeof la) == 0);
  }
  for (std::size_t r = 0; r < with.local_replicas(); ++r) {
    CAPTURE(r);
    const auto& f = with.model(r);
    const auto& g = separate.model(r);
    CHECK(same_bits(f.params(), g.params()));
    CHECK(same_bits(f.grads(), g.grads()));
    CHECK(same_bits(f.optimizer_state(), g.optimizer_state()));
    if (P::reduce_kind == fp::parallel::detail::ReduceKind::all_reduce)
      CHECK(f.optimizer_state().size() == Opt::state_slots * N::param_storage);
    CHECK(f.steps() == g.steps());
    CHECK(f.optimizer_steps() == g.optimizer_steps());
    // The update really ran: the parameters moved from the seed's.
    const fp::Model<N, fp::Host> start{fp::seed(5), fp::Host{1}};
    CHECK_FALSE(same_bits(f.params(), start.params()));
  }
}

const fp::Sgd sgd{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-3f, .nesterov = true, .decay = fp::Decay::weights}};
const fp::Adam adam{{.lr = 1e-2f, .weight_decay = 1e-3f}};
const fp::AdamW adamw{{.lr = 1e-2f, .weight_decay = 0.05f, .decay = fp::Decay::weights}};

}  // namespace

TEST_CASE("fused update: bit for bit the one pass, for every optimizer and AllReduce knob") {
  using Whole = fp::Parallel<Net, fp::Host>;
  using Buckets = fp::Parallel<Net, fp::Host, fp::reduce::AllReduce<fp::Bucket<512>>>;
  using Overlapped = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>;
  using Deterministic = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>, fp::Deterministic>;
  using Compressed = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>, fp::Compress<fp::bf16>>;
  static_assert(fp::parallel::BucketPlan<Net, 512>::count >= 3, "the test needs several buckets");
  for (int n : {2, 3}) {
    check_same_bits<Whole>("AllReduce, one bucket, sgd", sgd, n, true);
    check_same_bits<Buckets>("Bucket<512>, sgd", sgd, n, true);
    check_same_bits<Overlapped>("Overlap, sgd", sgd, n, true);
    check_same_bits<Overlapped>("Overlap, adam", adam, n, true);
    check_same_bits<Overlapped>("Overlap, adamw", adamw, n, true);
    check_same_bits<Deterministic>("Deterministic, adamw", adamw, n, true);
    check_same_bits<Compressed>("Compress<bf16>, sgd", sgd, n, true);
    check_same_bits<Overlapped>("Overlap, accumulate 2, adam", adam, n, true, {.accumulate = 2});
    check_same_bits<Whole>("bucket_bytes 700 at run time, sgd", sgd, n, true, {.bucket_bytes = 700});
  }
  // Two threads per replica: a bucket's update is split between them at offsets inside the bucket.
  check_same_bits<Overlapped>("Overlap, adamw, 2 threads a replica", adamw, 2, true, {}, 2);
}

TEST_CASE("fused update: BatchNorm (Sync) and a residual block, bit for bit the one pass") {
  using P = fp::Parallel<BlockNet, fp::Host, fp::batch_norm::Sync, fp::Overlap, fp::Bucket<256>>;
  static_assert(fp::parallel::BucketPlan<BlockNet, 256>::count >= 3, "the test needs several buckets");
  check_same_bits<P>("BatchNorm + Residual, sgd", sgd, 2, true);
  check_same_bits<P>("BatchNorm + Residual, adamw", adamw, 2, true);
}

TEST_CASE("fused update: with Overlap the buckets are updated during backward, from the optimizer's second step") {
  using P = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>;
  constexpr std::size_t buckets = fp::parallel::BucketPlan<Net, 512>::count;
  for (bool fused : {true, false}) {
    CAPTURE(fused);
    P dp{fp::replicas(2, 1), fp::seed(5)};
    dp.use_fused_update(fused);
    fp::Sgd opt = sgd;
    const Batch<Net> batch(12, 0);
    // The first step creates the optimizer state: one pass.
    const Traced first = traced_step(dp, batch, opt);
    CHECK(first.updates == 1);
    CHECK_FALSE(first.during_backward);
    const Traced second = traced_step(dp, batch, opt);
    CHECK(second.updates == (fused ? buckets : 1));
    CHECK(second.during_backward == fused);
    // Another optimizer replaces the state: its first step is one pass again, its second by bucket.
    fp::Adam other = adam;
    CHECK(traced_step(dp, batch, other).updates == 1);
    CHECK(traced_step(dp, batch, other).updates == (fused ? buckets : 1));
  }
}

TEST_CASE("fused update: a change of optimizer mid-run gives the one pass's bits") {
  using P = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>;
  P with{fp::replicas(2, 1), fp::seed(6)}, separate{fp::replicas(2, 1), fp::seed(6)};
  separate.use_fused_update(false);
  fp::Sgd s1 = sgd, s2 = sgd;
  fp::AdamW a1 = adamw, a2 = adamw;
  for (int s = 0; s < 6; ++s) {
    const Batch<Net> batch(12, std::uint64_t(s));
    const std::span<const float> x(batch.x);
    const std::span<const std::int32_t> y(batch.y);
    if (s < 3) {
      (void)with.train_step(x, y, fp::SoftmaxCrossEntropy{}, s1);
      (void)separate.train_step(x, y, fp::SoftmaxCrossEntropy{}, s2);
    } else {
      (void)with.train_step(x, y, fp::SoftmaxCrossEntropy{}, a1);
      (void)separate.train_step(x, y, fp::SoftmaxCrossEntropy{}, a2);
    }
  }
  CHECK(with.model().optimizer_steps() == 3);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(same_bits(with.model(r).params(), separate.model(r).params()));
    CHECK(same_bits(with.model(r).optimizer_state(), separate.model(r).optimizer_state()));
  }
}

TEST_CASE("fused update: a bad loss option throws before the optimizer state is touched") {
  using P = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>;
  P dp{fp::replicas(2, 1), fp::seed(6)};
  fp::Sgd opt = sgd;
  const Batch<Net> batch(12, 0);
  const std::span<const float> x(batch.x);
  const std::span<const std::int32_t> y(batch.y);
  for (int s = 0; s < 2; ++s) (void)dp.train_step(x, y, fp::SoftmaxCrossEntropy{}, opt);
  const std::vector<float> params(dp.model().params().begin(), dp.model().params().end());
  const std::vector<float> state(dp.model().optimizer_state().begin(), dp.model().optimizer_state().end());
  fp::Adam other = adam;
  CHECK_THROWS_AS(dp.train_step(x, y, fp::SoftmaxCrossEntropy{.label_smoothing = 2.0f}, other), fp::InvalidArgument);
  CHECK(std::strcmp(dp.model().optimizer_name(), "Sgd") == 0);
  CHECK(same_bits(params, dp.model().params()));
  CHECK(same_bits(state, dp.model().optimizer_state()));
}

TEST_CASE("fused update: not for ReduceBroadcast, ReduceScatter or a Guarded optimizer, which still train") {
  using Guarded = fp::Guarded<fp::Sgd, fp::nonfinite::Skip>;
  const Guarded guarded{sgd, {.max_norm = 0.5f}};
  check_same_bits<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>>("Guarded, clipping", guarded, 2, false);
  check_same_bits<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>>("ReduceBroadcast, sgd", sgd, 2, false);
  static_assert(!fp::parallel::detail::updates_buckets<fp::parallel::Policy<fp::Host, fp::reduce::ReduceBroadcast<>>, fp::Sgd>);
  static_assert(!fp::parallel::detail::updates_buckets<fp::parallel::Policy<fp::Host, fp::reduce::ReduceScatter<>>, fp::Sgd>);
  static_assert(!fp::parallel::detail::updates_buckets<fp::parallel::Policy<fp::Host>, Guarded>);
  static_assert(fp::parallel::detail::updates_buckets<fp::parallel::Policy<fp::Host>, fp::AdamW>);
}
