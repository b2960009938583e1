// Bitwise resume on Host: 2 epochs straight and 1 epoch + save + resume (a new model, optimizer and
// loader, as a new process would make them) + 1 epoch give identical weights and identical metrics —
// with shuffling, crop and flip augmentation, prefetch, momentum, Adam's step count, and dropout,
// whose masks follow the model's step counter. Also mid-epoch, at the sampler position.
#include "fusedp/train/checkpoint.hpp"

#include "../data/temp_dir.hpp"

#include <doctest/doctest.h>
#include <fusedp/data/loader.hpp>
#include "../support/fusedp_core.hpp"

#include <optional>
#include <string>
#include <vector>

namespace {

namespace fp = fusedp;
namespace fd = fusedp::data;
namespace ft = fusedp::train;
using fusedp_test::TempDir;

using Net = fp::Sequential<fp::Input<1, 8, 8>, fp::Conv2d<4, 3>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Dropout<0.25f>, fp::Linear<16>, fp::ReLU, fp::Linear<10>>;
using Model = fp::Model<Net, fp::Host>;

constexpr std::uint64_t seed = 21;
constexpr std::size_t batch = 16;

fd::Dataset make_data(std::size_t n, std::uint64_t s) {
  std::vector<float> x(n * 64);
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < n; ++i) {
    y[i] = std::int32_t(fp::rng::uniform(s, 1, i) * 10);
    // a class-dependent blob plus noise, so the loss falls
    for (std::size_t p = 0; p < 64; ++p)
      x[i * 64 + p] = 0.5f * fp::rng::uniform(s, 2, i * 64 + p) + (p % 10 == std::size_t(y[i]) ? 0.5f : 0.0f);
  }
  return fd::make_dataset(std::move(x), std::move(y), 1, 8, 8, 10);
}

const fd::Dataset& train_data() {
  static const fd::Dataset d = make_data(100, 3);  // 7 batches, the last of 4
  return d;
}
const fd::Dataset& test_data() {
  static const fd::Dataset d = make_data(40, 4);
  return d;
}

fd::DataLoader train_loader(std::size_t prefetch) {
  return fd::DataLoader{train_data(), fd::DistributedSampler{train_data().count, 1, 0, {.shuffle = true, .seed = seed}},
                        {.batch = batch, .prefetch = prefetch, .augment = {.crop_padding = 1, .flip = true},
                         .normalize = {{0.45f}, {0.3f}}, .seed = seed}};
}

struct EpochMetrics {
  double train_loss = 0, test_loss = 0;
  std::size_t correct = 0;
  bool operator==(const EpochMetrics&) const = default;
};

// Trains `epoch` from `start` (up to `stop` batches), then evaluates.
template <class Opt>
EpochMetrics run_epoch(Model& model, Opt& opt, fd::DataLoader& loader, std::uint64_t epoch,
                       fd::EpochPosition start = {}, std::size_t stop = ~std::size_t(0)) {
  EpochMetrics m;
  loader.set_epoch(epoch, start);
  for (std::size_t b = 0; b < stop; ++b) {
    const auto batch_data = loader.next();
    if (!batch_data) break;
    m.train_loss += model.train_step(batch_data->images, batch_data->labels, fp::SoftmaxCrossEntropy{}, opt);
  }
  const fd::Dataset& t = test_data();
  const auto e = model.evaluate(std::span<const float>(t.images), std::span<const std::int32_t>(t.labels),
                                fp::SoftmaxCrossEntropy{});
  m.test_loss = e.loss;
  m.correct = fp::count_correct(e.outputs, std::span<const std::int32_t>(t.labels));
  return m;
}

ft::TrainingState state(std::uint64_t epochs_done, std::uint64_t batches_done) {
  ft::TrainingState s;
  s.epochs_done = epochs_done;
  s.batches_done = batches_done;
  s.samples_done = batches_done * batch;
  s.data_seed = seed;
  s.dataset_size = train_data().count;
  s.batch_size = batch;
  return s;
}

std::vector<float> params(const Model& m) { return {m.params().begin(), m.params().end()}; }

template <class Opt>
void check_resume(const Opt& options) {
  TempDir dir("fusedp_resume");
  const std::string ck = dir.file("ck");
  const fp::Host host{2};

  // 2 epochs straight
  Model straight{fp::seed(seed), host};
  Opt opt = options;
  auto loader = train_loader(1);
  const EpochMetrics s1 = run_epoch(straight, opt, loader, 1);
  const EpochMetrics s2 = run_epoch(straight, opt, loader, 2);
  CHECK(s2.train_loss < s1.train_loss);  // it learns

  SUBCASE("at an epoch boundary") {
    std::optional<EpochMetrics> r1;
    {
      Model first{fp::seed(seed), host};
      Opt o = options;
      auto l = train_loader(0);  // prefetch off this time: it must not matter
      r1 = run_epoch(first, o, l, 1);
      ft::save_checkpoint(ck, first, state(1, 0));
    }
    CHECK(*r1 == s1);
    const ft::TrainingState peek = ft::read_training_state(ck);
    Model resumed{fp::seed(peek.model_seed), host};
    Opt o = options;
    const ft::TrainingState st = ft::load_checkpoint(ck, resumed, o);
    auto l = train_loader(2);
    const EpochMetrics r2 = run_epoch(resumed, o, l, st.epochs_done + 1, {st.samples_done});
    CHECK(r2 == s2);
    CHECK(params(resumed) == params(straight));
    CHECK(resumed.steps() == straight.steps());
  }
  SUBCASE("in the middle of an epoch, at the sampler position") {
    {
      Model first{fp::seed(seed), host};
      Opt o = options;
      auto l = train_loader(1);
      (void)run_epoch(first, o, l, 1);
      (void)run_epoch(first, o, l, 2, {}, 3);  // 3 batches of epoch 2
      ft::save_checkpoint(ck, first, state(1, 3));
    }
    Model resumed{fp::seed(seed), host};
    Opt o = options;
    const ft::TrainingState st = ft::load_checkpoint(ck, resumed, o);
    CHECK(st.batches_done == 3);
    CHECK(st.samples_done == 3 * batch);
    auto l = train_loader(1);
    const EpochMetrics r2 = run_epoch(resumed, o, l, st.epochs_done + 1, {st.samples_done});
    CHECK(r2.test_loss == s2.test_loss);
    CHECK(r2.correct == s2.correct);
    CHECK(params(resumed) == params(straight));
  }
}

}  // namespace

TEST_CASE("bitwise resume with Sgd and momentum") { check_resume(fp::Sgd{{.lr = 0.05f, .momentum = 0.9f}}); }

TEST_CASE("bitwise resume with AdamW") { check_resume(fp::AdamW{{.lr = 0.003f}}); }
