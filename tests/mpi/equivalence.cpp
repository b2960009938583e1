// Under mpirun: one replica per rank reproduces one model trained on the global batch, for every
// reduce policy and knob (20 steps; losses and parameters within 1e-5 relative, Compress<bf16>
// within 1e-2); Sharded with uneven shards; Deterministic bitwise equal to accumulating the shard
// gradients in rank order; the fused update (each bucket updated as its reduction completes, the
// started ones after the wait) bitwise equal to the one pass after the last reduction.
#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace fp = fusedp;
using test_support::relative_error;
using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;
constexpr std::size_t in = Net::input_shape::size;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
Batch batch_of(std::size_t size, std::uint64_t step) {
  Batch b{std::vector<float>(size * in), std::vector<std::int32_t>(size)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(11, step, i) - 1;
  for (std::size_t i = 0; i < size; ++i) b.y[i] = std::int32_t(fp::rng::uniform(12, step, i) * 5);
  return b;
}

const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
constexpr std::size_t batch = 25;  // uneven over 2 and 3 ranks
constexpr int steps = 20;

struct Reference {
  fp::Model<Net, fp::Host> model{fp::seed(3), fp::Host{1}};
  std::vector<float> losses;
  Reference() {
    for (int s = 0; s < steps; ++s) {
      const Batch b = batch_of(batch, std::uint64_t(s));
      losses.push_back(model.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y),
                                        fp::SoftmaxCrossEntropy{}, sgd));
    }
  }
};

template <class P>
void check_policy(const fp::MpiWorld& world, const Reference& ref, const char* name, double tolerance) {
  // Ranks other than 0 start from other seeds: the start-up broadcast must make them equal.
  P dp{world, fp::seed(world.rank() == 0 ? 3 : 100 + std::uint64_t(world.rank())), {.threads = 1}};
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(batch, std::uint64_t(s));
    float loss = 0;
    if constexpr (P::sharded) {
      // Each rank passes only its own slice: rank r gets a different number of samples.
      const auto shard = fp::parallel::even_shards(batch, world.size())[std::size_t(world.rank())];
      loss = dp.train_step(std::span<const float>(b.x).subspan(shard.offset * in, shard.count * in),
                           std::span<const std::int32_t>(b.y).subspan(shard.offset, shard.count),
                           fp::SoftmaxCrossEntropy{}, sgd);
    } else {
      loss = dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, sgd);
    }
    mpi_test::check(std::abs(loss - ref.losses[std::size_t(s)]) <= tolerance * ref.losses[std::size_t(s)], world.rank(),
                    std::string(name) + ": loss at step " + std::to_string(s));
  }
  const double rel = relative_error(dp.model().params(), ref.model.params());
  mpi_test::check(rel <= tolerance, world.rank(), std::string(name) + ": parameters differ by " + std::to_string(rel));
  if (world.rank() == 0) std::printf("%-28s parameters within %.2e of one model with the global batch\n", name, rel);
}

void check_deterministic(const fp::MpiWorld& world) {
  using P = fp::Parallel<Net, fp::Host, fp::Deterministic, fp::Overlap, fp::Bucket<1024>>;
  P dp{world, fp::seed(3), {.threads = 1}};
  fp::Model<Net, fp::Host> one{fp::seed(3), fp::Host{1}};
  std::vector<float> sum(Net::param_storage);
  const auto shards = fp::parallel::even_shards(batch, world.size());
  for (int s = 0; s < 10; ++s) {
    const Batch b = batch_of(batch, std::uint64_t(s));
    (void)dp.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, sgd);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (const auto& shard : shards) {
      (void)one.compute_gradients(std::span<const float>(b.x).subspan(shard.offset * in, shard.count * in),
                                  std::span<const std::int32_t>(b.y).subspan(shard.offset, shard.count),
                                  fp::SoftmaxCrossEntropy{}, {}, batch);  // share of the global mean
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + one.grads()[i];
    }
    std::copy(sum.begin(), sum.end(), one.grads().begin());
    one.step(sgd);
  }
  const bool same = std::memcmp(dp.model().params().data(), one.params().data(), Net::param_storage * sizeof(float)) == 0;
  mpi_test::check(same, world.rank(), "Deterministic: not bitwise equal to accumulating shard gradients in rank order");
  if (world.rank() == 0 && same) std::printf("%-28s bitwise equal to accumulation in rank order\n", "Deterministic");
}

// Parallel's fused update against the one pass (use_fused_update(false)), bit for bit: with Overlap
// the buckets' MPI reductions are started during backward, and each is updated once it is complete.
template <class P, class Opt>
void check_fused_update(const fp::MpiWorld& world, const char* name, const Opt& opt) {
  P fused{world, fp::seed(4), {.threads = 1}};
  P separate{world, fp::seed(4), {.threads = 1}};
  separate.use_fused_update(false);
  Opt a = opt, b = opt;
  bool same = true;
  for (int s = 0; s < 6; ++s) {
    const Batch x = batch_of(batch, std::uint64_t(s));
    const float la = fused.train_step(std::span<const float>(x.x), std::span<const std::int32_t>(x.y),
                                      fp::SoftmaxCrossEntropy{}, a);
    const float lb = separate.train_step(std::span<const float>(x.x), std::span<const std::int32_t>(x.y),
                                         fp::SoftmaxCrossEntropy{}, b);
    same = same && std::memcmp(&la, &lb, sizeof la) == 0;
  }
  const auto& f = fused.model();
  const auto& g = separate.model();
  same = same && std::memcmp(f.params().data(), g.params().data(), f.params().size_bytes()) == 0;
  same = same && f.optimizer_state().size() == g.optimizer_state().size() &&
         std::memcmp(f.optimizer_state().data(), g.optimizer_state().data(), f.optimizer_state().size_bytes()) == 0;
  mpi_test::check(same, world.rank(), std::string(name) + ": the fused update differs from the one pass");
  if (world.rank() == 0 && same) std::printf("%-28s fused update bitwise equal to the one pass\n", name);
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  try {
    const Reference ref;
    check_policy<fp::Parallel<Net, fp::Host>>(world, ref, "AllReduce", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::reduce::AllReduce<fp::Bucket<512>, fp::Overlap>>>(world, ref, "Bucket+Overlap", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>>>(world, ref, "ReduceBroadcast", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>>(world, ref, "ReduceScatter (ZeRO-1)", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<fp::Deterministic>>>(world, ref, "ReduceScatter+Deterministic", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::scatter::Sharded, fp::Overlap>>(world, ref, "Sharded (uneven)+Overlap", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::Deterministic>>(world, ref, "Deterministic", 1e-5);
    check_policy<fp::Parallel<Net, fp::Host, fp::Compress<fp::bf16>>>(world, ref, "Compress<bf16>", 1e-2);
    check_deterministic(world);
    using Overlapped = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>>;
    check_fused_update<Overlapped>(world, "fused update, Overlap", fp::AdamW{{.lr = 1e-2f, .decay = fp::Decay::weights}});
    check_fused_update<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<512>, fp::Deterministic>>(
        world, "fused update, Deterministic", sgd);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    return 1;
  }
  return mpi_test::failures == 0 ? 0 : 1;
}
