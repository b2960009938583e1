// Tests of include/fusedp/train/parallel_checkpoint.hpp: a data-parallel run saved and resumed, for
// every reduce policy; ZeRO-1's sharded optimizer state gathered into the files one Model writes and
// re-sharded on load, at the same and at another number of replicas; a failed save that throws and
// leaves the previous checkpoint intact.
#include "fusedp/train/parallel_checkpoint.hpp"

#include "../data/temp_dir.hpp"
#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fp = fusedp;
namespace ft = fusedp::train;
using fusedp_test::TempDir;
using test_support::relative_error;

// No bias before BatchNorm: its gradient is rounding noise, which Adam would turn into steps of +-lr.
using Net = fp::Sequential<fp::Input<2, 8, 8>, fp::Conv2d<4, 3, 1, 1, false>, fp::BatchNorm2d<>, fp::ReLU, fp::MaxPool2d<2>,
                           fp::Flatten, fp::Linear<16>, fp::Tanh, fp::Linear<5>>;
constexpr std::size_t batch = 12;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
Batch batch_of(std::uint64_t step) {
  Batch b{std::vector<float>(batch * Net::input_shape::size), std::vector<std::int32_t>(batch)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(31, step, i) - 1;
  for (std::size_t i = 0; i < batch; ++i) b.y[i] = std::int32_t(fp::rng::uniform(32, step, i) * 5);
  return b;
}

// Steps [from, to) of the run.
template <class Trainer, class Opt>
void train(Trainer& t, const Opt& opt, std::uint64_t from, std::uint64_t to) {
  Opt o = opt;
  for (std::uint64_t s = from; s < to; ++s) {
    const Batch b = batch_of(s);
    (void)t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o);
  }
}

ft::TrainingState state_after(std::uint64_t steps) {
  ft::TrainingState s;
  s.epochs_done = 1;
  s.batches_done = steps;
  s.batch_size = batch;
  return s;
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Saves a run of P with `n` replicas after 4 steps, resumes it into a fresh P, and checks that 4 more
// steps give the bits of the uninterrupted run.
template <class P, class Opt>
void check_round_trip(const char* name, const Opt& opt, int n) {
  CAPTURE(name);
  TempDir dir;
  const std::string ck = (dir.path / "ck").string();
  P run{fp::replicas(n, 1), fp::seed(9)};
  train(run, opt, 0, 4);
  ft::save_checkpoint(ck, run, state_after(4));
  train(run, opt, 4, 8);

  P resumed{fp::replicas(n, 1), fp::seed(9)};
  const ft::TrainingState s = ft::load_checkpoint(ck, resumed, opt);
  CHECK(s.steps == 4);
  CHECK(s.batches_done == 4);
  CHECK(resumed.model(n - 1).steps() == 4);
  train(resumed, opt, 4, 8);
  for (int r = 0; r < n; ++r) {
    CHECK(same_bits(resumed.model(std::size_t(r)).params(), run.model(std::size_t(r)).params()));
    CHECK(same_bits(resumed.model(std::size_t(r)).buffers(), run.model(std::size_t(r)).buffers()));
  }
  CHECK(same_bits(resumed.gather_optimizer_state(), run.gather_optimizer_state()));
}

const fp::Sgd sgd{{.lr = 0.05f, .momentum = 0.9f}};
const fp::Adam adam{{.lr = 1e-3f}};

}  // namespace

TEST_CASE("a Parallel resumes bit for bit, for every reduce policy") {
  check_round_trip<fp::Parallel<Net, fp::Host, fp::batch_norm::Broadcast>>("AllReduce", sgd, 2);
  check_round_trip<fp::Parallel<Net, fp::Host, fp::reduce::ReduceBroadcast<>, fp::batch_norm::Broadcast>>(
      "ReduceBroadcast", adam, 2);
  check_round_trip<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>, fp::batch_norm::Broadcast>>(
      "ReduceScatter", adam, 3);
  check_round_trip<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<fp::Overlap, fp::Bucket<256>>,
                                fp::Deterministic, fp::batch_norm::Sync>>("ReduceScatter+Deterministic+Sync", sgd, 2);
}

TEST_CASE("ZeRO-1: the gathered optimizer state is the one a single model holds, and it re-shards at another world size") {
  using Zero = fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>, fp::batch_norm::Sync>;
  using All = fp::Parallel<Net, fp::Host, fp::batch_norm::Sync>;
  TempDir dir;
  const std::string ck = (dir.path / "zero").string();
  Zero three{fp::replicas(3, 1), fp::seed(9)};
  CHECK(three.gather_optimizer_state().empty());  // before the first step
  train(three, adam, 0, 4);
  fp::Model<Net, fp::Host> one{fp::seed(9), fp::Host{1}};
  train(one, adam, 0, 4);
  const std::vector<float> gathered = three.gather_optimizer_state();
  REQUIRE(gathered.size() == one.optimizer_state().size());
  CHECK(relative_error(gathered, one.optimizer_state()) <= 1e-5);
  ft::save_checkpoint(ck, three, state_after(4));
  train(three, adam, 4, 8);

  // The files are those of one model: a Model loads them and continues as the run did.
  fp::Model<Net, fp::Host> model{fp::seed(9), fp::Host{1}};
  (void)ft::load_checkpoint(ck, model, adam);
  CHECK(same_bits(model.optimizer_state(), gathered));
  train(model, adam, 4, 8);
  CHECK(relative_error(model.params(), three.model(0).params()) <= 1e-5);

  // Two replicas with ZeRO, and two with AllReduce, continue the three-replica run.
  Zero two{fp::replicas(2, 1), fp::seed(9)};
  (void)ft::load_checkpoint(ck, two, adam);
  CHECK(same_bits(two.gather_optimizer_state(), gathered));
  CHECK(two.zero_optimizer_state(1).size() == fp::Adam::state_slots * two.zero_block(1).count);
  train(two, adam, 4, 8);
  CHECK(relative_error(two.model(1).params(), three.model(0).params()) <= 1e-5);
  All all{fp::replicas(2, 1), fp::seed(9)};
  (void)ft::load_checkpoint(ck, all, adam);
  train(all, adam, 4, 8);
  CHECK(relative_error(all.model(0).params(), three.model(0).params()) <= 1e-5);

  // And a one-model checkpoint starts a ZeRO run of three.
  const std::string from_model = (dir.path / "model").string();
  ft::save_checkpoint(from_model, model, state_after(8));
  Zero again{fp::replicas(3, 1), fp::seed(9)};
  (void)ft::load_checkpoint(from_model, again, adam);
  CHECK(same_bits(again.gather_optimizer_state(), model.optimizer_state()));
  CHECK(again.model(2).optimizer_steps() == model.optimizer_steps());
}

TEST_CASE("a failed save of a Parallel throws and leaves the previous checkpoint; a bad checkpoint changes no replica") {
  using P = fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>, fp::batch_norm::Sync>;
  TempDir dir;
  const std::string ck = (dir.path / "ck").string();
  P run{fp::replicas(2, 1), fp::seed(9)};
  train(run, sgd, 0, 2);
  ft::save_checkpoint(ck, run, state_after(2));
  const std::string blocker = (dir.path / "file").string();
  { std::FILE* f = std::fopen(blocker.c_str(), "w"); REQUIRE(f); std::fclose(f); }
  CHECK_THROWS_WITH_AS(ft::save_checkpoint(blocker, run, state_after(3)), doctest::Contains("cannot create"),
                       fp::DataError);
  CHECK(ft::read_training_state(ck).steps == 2);

  // Another seed, another optimizer: refused before any replica changes.
  P other{fp::replicas(2, 1), fp::seed(10)};
  const std::vector<float> before(other.model(1).params().begin(), other.model(1).params().end());
  CHECK_THROWS_WITH_AS((void)ft::load_checkpoint(ck, other, sgd), doctest::Contains("model seed 9"), fp::DataError);
  P same{fp::replicas(2, 1), fp::seed(9)};
  CHECK_THROWS_WITH_AS((void)ft::load_checkpoint(ck, same, adam), doctest::Contains("optimizer Sgd"), fp::DataError);
  CHECK(same_bits(other.model(1).params(), before));
  CHECK(same.gather_optimizer_state().empty());
}
