// A short training run on real data: LeNet on Fashion-MNIST for one epoch must reach a test accuracy
// that only a working forward, backward, loss and optimizer reach (chance is 10%; PyTorch's CPU
// build reaches about 85% after one epoch of this recipe).
#include <doctest/doctest.h>

#include <fusedp/data/batches.hpp>
#include <fusedp/data/idx.hpp>
#include "../support/fusedp_core.hpp"

#include "../support/seed_networks.hpp"

#include <cstdlib>
#include <filesystem>
#include <vector>

namespace fp = fusedp;

using LeNet = seed_networks::LeNet;

TEST_CASE("LeNet learns Fashion-MNIST in one epoch") {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir)) {
    // CI installs the dataset; there its absence is a failure, elsewhere a skip.
    REQUIRE_MESSAGE(std::getenv("CI") == nullptr, dir << " is missing (apt-get install dataset-fashion-mnist)");
    MESSAGE("skipped: " << dir << " is missing (apt-get install dataset-fashion-mnist)");
    return;
  }
  auto train = fp::data::load_mnist(dir, fp::data::Split::train);
  auto test = fp::data::load_mnist(dir, fp::data::Split::test);
  const auto [mean, stddev] = fp::data::mean_std(train);
  fp::data::normalize(train, mean, stddev);
  fp::data::normalize(test, mean, stddev);

  fp::Model<LeNet, fp::Host> model{fp::seed(42), fp::Host{2}};
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  constexpr std::size_t batch = 64, sample = 784;
  std::vector<float> x(batch * sample);
  std::vector<std::int32_t> y(batch);
  const auto order = fp::data::permutation(train.count, 42, 1);
  double first_losses = 0, last_losses = 0;
  const std::size_t steps = train.count / batch;
  for (std::size_t s = 0; s < steps; ++s) {
    fp::data::gather<float>(train.images, train.labels, sample, std::span(order).subspan(s * batch, batch), x, y);
    const float loss = model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                        fp::SoftmaxCrossEntropy{}, opt);
    REQUIRE(std::isfinite(loss));
    if (s < 50) first_losses += loss;
    if (s >= steps - 50) last_losses += loss;
  }
  CHECK(last_losses < 0.5 * first_losses);

  std::size_t correct = 0;
  for (std::size_t first = 0; first < test.count; first += 1000) {
    const std::span<const float> tx(test.images.data() + first * sample, 1000 * sample);
    const std::span<const std::int32_t> ty(test.labels.data() + first, 1000);
    correct += fp::count_correct(model.predict(tx), ty);
  }
  const double accuracy = double(correct) / double(test.count);
  MESSAGE("test accuracy after one epoch: " << accuracy);
  CHECK(accuracy > 0.82);
}
