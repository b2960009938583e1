// Under mpirun, the data-parallel workflow beyond one step:
//   workflow accumulate        ParallelOptions::accumulate 3 over the ranks equals one model on the
//                              whole batch (ZeRO-1 and AllReduce with Overlap)
//   workflow save DIR          a ZeRO-1 run (Adam, SyncBatchNorm) saves a checkpoint after 4 steps:
//                              the gathered optimizer state is the one a single model holds
//   workflow resume DIR        the checkpoint resumed at this run's world size (ctest pairs 2 -> 3
//                              and 3 -> 2 ranks) continues as one uninterrupted model does
// Each rank checks its own results and exits 1 on any failure.
#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/parallel/parallel.hpp>
#include <fusedp/train/parallel_checkpoint.hpp>

#include "mpi_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace ft = fusedp::train;
using mpi_test::check;
using test_support::relative_error;

namespace {

using Net = fp::Sequential<fp::Input<2, 8, 8>, fp::Conv2d<4, 3, 1, 1, false>, fp::BatchNorm2d<>, fp::ReLU,
                           fp::MaxPool2d<2>, fp::Flatten, fp::Linear<16>, fp::Tanh, fp::Linear<5>>;
// Accumulation: micro-batches have their own BatchNorm statistics, so that run has no BatchNorm.
using Plain = fp::Sequential<fp::Input<2, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                             fp::Linear<16>, fp::Tanh, fp::Linear<5>>;
constexpr std::size_t batch = 12;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
Batch batch_of(std::uint64_t step) {
  Batch b{std::vector<float>(batch * Net::input_shape::size), std::vector<std::int32_t>(batch)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(41, step, i) - 1;
  for (std::size_t i = 0; i < batch; ++i) b.y[i] = std::int32_t(fp::rng::uniform(42, step, i) * 5);
  return b;
}
template <class Trainer, class Opt>
void train(Trainer& t, Opt opt, std::uint64_t from, std::uint64_t to) {
  for (std::uint64_t s = from; s < to; ++s) {
    const Batch b = batch_of(s);
    (void)t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, opt);
  }
}

const fp::Adam adam{{.lr = 1e-3f}};
using Zero = fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<fp::Overlap, fp::Bucket<512>>, fp::batch_norm::Sync>;

}  // namespace

int main(int argc, char** argv) {
  fp::MpiWorld world;
  const int rank = world.rank();
  const std::string mode = argc > 1 ? argv[1] : "";
  const std::string dir = argc > 2 ? argv[2] : "";
  try {
    fp::Model<Net, fp::Host> one{fp::seed(9), fp::Host{1}};
    if (mode == "accumulate") {
      fp::Model<Plain, fp::Host> plain{fp::seed(9), fp::Host{1}};
      train(plain, adam, 0, 4);
      fp::Parallel<Plain, fp::Host, fp::reduce::ReduceScatter<fp::Overlap, fp::Bucket<512>>> zero{
          world, fp::seed(9), {.threads = 1, .accumulate = 3}};
      train(zero, adam, 0, 4);
      check(relative_error(zero.model().params(), plain.params()) <= 1e-5, rank, "ZeRO-1 with accumulate 3");
      fp::Parallel<Plain, fp::Host, fp::Overlap, fp::Bucket<256>> all{world, fp::seed(9), {.threads = 1, .accumulate = 3}};
      train(all, adam, 0, 4);
      check(relative_error(all.model().params(), plain.params()) <= 1e-5, rank, "AllReduce+Overlap with accumulate 3");
    } else if (mode == "save" && !dir.empty()) {
      train(one, adam, 0, 4);
      Zero zero{world, fp::seed(9), {.threads = 1}};
      train(zero, adam, 0, 4);
      const std::vector<float> gathered = zero.gather_optimizer_state();
      check(gathered.size() == one.optimizer_state().size() && relative_error(gathered, one.optimizer_state()) <= 1e-5,
            rank, "the gathered ZeRO-1 state is the one model's");
      ft::TrainingState s;
      s.batches_done = 4;
      s.world_size = std::uint64_t(world.size());
      ft::save_checkpoint(dir, zero, s);
      check(ft::read_training_state(dir).steps == 4, rank, "the checkpoint holds 4 steps");
    } else if (mode == "resume" && !dir.empty()) {
      train(one, adam, 0, 8);
      Zero zero{world, fp::seed(9), {.threads = 1}};
      {
        // The last rank cannot see the folder: every rank refuses, and none changes.
        const std::vector<float> before(zero.model().params().begin(), zero.model().params().end());
        const std::string where = rank + 1 == world.size() ? dir + "/not-here" : dir;
        bool refused = false;
        try {
          (void)ft::load_checkpoint(where, zero, adam);
        } catch (const fp::DataError&) {
          refused = true;
        }
        check(refused, rank, "a checkpoint one rank cannot read is refused on every rank");
        check(std::equal(before.begin(), before.end(), zero.model().params().begin()), rank,
              "and no rank's parameters changed");
      }
      const ft::TrainingState s = ft::load_checkpoint(dir, zero, adam);
      check(s.steps == 4 && zero.model().steps() == 4, rank, "resumed after 4 steps");
      const fp::parallel::Shard block = zero.zero_block(std::size_t(rank));
      check(zero.zero_optimizer_state().size() == fp::Adam::state_slots * block.count, rank,
            "this rank holds the state of its own block");
      train(zero, adam, 4, 8);
      check(relative_error(zero.model().params(), one.params()) <= 1e-5, rank,
            "resumed at " + std::to_string(world.size()) + " ranks from " + std::to_string(s.world_size) +
                ", the run continues as one model does");
      check(relative_error(zero.gather_optimizer_state(), one.optimizer_state()) <= 1e-5, rank,
            "and so does the optimizer state");
    } else {
      std::fprintf(stderr, "usage: workflow accumulate | save DIR | resume DIR\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
    return 1;
  }
  if (mpi_test::failures == 0) std::printf("rank %d: %s ok\n", rank, mode.c_str());
  return mpi_test::failures == 0 ? 0 : 1;
}
