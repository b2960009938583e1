// Under mpirun: a network with BatchNorm and a residual block in Parallel<..., batch_norm::Broadcast>.
// Each rank normalizes with its own shard's statistics (as DDP without SyncBatchNorm), so the step is
// the sum of per-shard gradients (each shard's share of the global mean); after every step every
// rank holds rank 0's running statistics. Checked against models run on the shards in one process.
// Then batch_norm::Sync (SyncBatchNorm over MPI): every rank computes what one model computes on the
// global batch, checked against that model.
#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <cmath>
#include <string>
#include <vector>

namespace fp = fusedp;
using test_support::relative_error;
using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                           fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                           fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;
constexpr std::size_t in = Net::input_shape::size;
constexpr std::size_t batch = 13;  // uneven over 2 and 3 ranks

void sync_batch_norm(const fp::MpiWorld& world) {
  using P = fp::Parallel<Net, fp::Host, fp::batch_norm::Sync>;
  P dp{world, fp::seed(7), {.threads = 1}};
  fp::Model<Net, fp::Host> one{fp::seed(7), fp::Host{1}};
  const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
  fp::Sgd o_dp = sgd, o_one = sgd;
  for (std::uint64_t step = 0; step < 4; ++step) {
    std::vector<float> x(batch * in);
    std::vector<std::int32_t> y(batch);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(33, step, i) - 1;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(34, step, i) * 3);
    const float loss =
        dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, o_dp);
    const float l1 = one.compute_gradients(std::span<const float>(x), std::span<const std::int32_t>(y),
                                           fp::SoftmaxCrossEntropy{});
    const double g = relative_error(dp.model().grads(), one.grads());
    (void)one.step(o_one);
    const double p = relative_error(dp.model().params(), one.params());
    const double b = relative_error(dp.model().buffers(), one.buffers());
    const std::string at = " at step " + std::to_string(step) + ": ";
    mpi_test::check(std::abs(loss - l1) <= 1e-5f * std::abs(l1), world.rank(), "Sync: loss" + at + std::to_string(loss));
    mpi_test::check(g <= 1e-5, world.rank(), "Sync: gradient differs from one model's" + at + std::to_string(g));
    mpi_test::check(p <= 1e-5, world.rank(), "Sync: parameters differ" + at + std::to_string(p));
    mpi_test::check(b <= 1e-5, world.rank(), "Sync: running statistics differ" + at + std::to_string(b));
  }
  if (world.rank() == 0)
    std::printf("batch_norm::Sync: %d ranks compute one model's gradient and statistics on the global batch\n",
                world.size());
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  try {
    using P = fp::Parallel<Net, fp::Host, fp::batch_norm::Broadcast>;
    P dp{world, fp::seed(world.rank() == 0 ? 4 : 50 + std::uint64_t(world.rank())), {.threads = 1}};
    // The reference, on every rank: one model per shard, the shards' gradients summed.
    const auto shards = fp::parallel::even_shards(batch, world.size());
    std::vector<fp::Model<Net, fp::Host>> ref;
    for (int r = 0; r < world.size(); ++r) ref.emplace_back(fp::seed(4), fp::Host{1});
    const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
    fp::Sgd o_dp = sgd, o_ref = sgd;
    std::vector<float> sum(Net::param_storage);
    for (std::uint64_t step = 0; step < 6; ++step) {
      std::vector<float> x(batch * in);
      std::vector<std::int32_t> y(batch);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(31, step, i) - 1;
      for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(32, step, i) * 3);
      (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, o_dp);
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (std::size_t r = 0; r < shards.size(); ++r) {
        (void)ref[r].compute_gradients(std::span<const float>(x).subspan(shards[r].offset * in, shards[r].count * in),
                                       std::span<const std::int32_t>(y).subspan(shards[r].offset, shards[r].count),
                                       fp::SoftmaxCrossEntropy{}, {}, batch);
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += ref[r].grads()[i];
      }
      std::copy(sum.begin(), sum.end(), ref[0].grads().begin());
      (void)ref[0].step(o_ref);
      for (std::size_t r = 1; r < ref.size(); ++r) {
        ref[r].load_params(ref[0].params());
        ref[r].load_buffers(ref[0].buffers());
      }
      const double p = relative_error(dp.model().params(), ref[0].params());
      const double b = relative_error(dp.model().buffers(), ref[0].buffers());
      mpi_test::check(p <= 1e-5, world.rank(), "parameters at step " + std::to_string(step) + " differ by " + std::to_string(p));
      mpi_test::check(b <= 1e-5, world.rank(),
                      "running statistics at step " + std::to_string(step) + " are not rank 0's: " + std::to_string(b));
    }
    if (world.rank() == 0)
      std::printf("batch_norm::Broadcast: %d ranks hold rank 0's running statistics and one model's parameters\n",
                  world.size());
    sync_batch_norm(world);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    return 1;
  }
  return mpi_test::failures == 0 ? 0 : 1;
}
