// A training run on Cuda whose loss curve tracks Host's: LeNet from the same seed on the same batches,
// SGD with momentum, 400 steps of 64. TF32 rounding makes the two trajectories drift apart step by step
// (as any two runs of a chaotic optimization do), so the curves are compared window by window, and the
// test accuracy at the end must agree.
//
// Data: Fashion-MNIST from FUSEDP_FASHION_MNIST_DIR, else Debian's /usr/share/datasets/fashion-mnist;
// where neither exists (a GPU machine without network), a synthetic 10-class set of 28x28 images
// (class prototypes plus noise), said so in the output.
#include "gpu_test.hpp"

#include <fusedp/data/batches.hpp>
#include <fusedp/data/dataset.hpp>
#include <fusedp/data/idx.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;
using namespace gpu_test;

namespace {

using seed_networks::LeNet;

struct Data {
  std::vector<float> train_x, test_x;
  std::vector<std::int32_t> train_y, test_y;
  std::string source;
};

std::string fashion_mnist_dir() {
  if (const char* d = std::getenv("FUSEDP_FASHION_MNIST_DIR")) return d;
  return "/usr/share/datasets/fashion-mnist";
}

// Each class a blocky random prototype (7x7-pixel cells on or off); a sample is its prototype scaled,
// plus uniform noise strong enough that LeNet needs a few hundred steps (Host: loss about 0.2 and 97%
// accuracy after 400 steps).
Data synthetic(std::size_t train, std::size_t test) {
  constexpr std::size_t px = 784;
  std::vector<float> proto(10 * px);
  for (std::size_t c = 0; c < 10; ++c)
    for (std::size_t i = 0; i < px; ++i) {
      const std::size_t y = i / 28, x = i % 28;
      const float a = fp::rng::uniform(1, fp::rng::stream(fp::rng::Purpose::test, 900 + c), (y / 7) * 4 + x / 7);
      proto[c * px + i] = a > 0.5f ? 1.0f : 0.0f;
    }
  Data d;
  d.source = "synthetic data (class prototypes plus noise; Fashion-MNIST not found)";
  auto fill = [&](std::size_t n, std::uint64_t stream, std::vector<float>& xs, std::vector<std::int32_t>& ys) {
    xs.resize(n * px);
    ys.resize(n);
    for (std::size_t s = 0; s < n; ++s) {
      const auto c = std::size_t(fp::rng::uniform(2, stream, s) * 10.0f) % 10;
      const float scale = 0.5f + fp::rng::uniform(3, stream, s);
      ys[s] = std::int32_t(c);
      for (std::size_t i = 0; i < px; ++i)
        xs[s * px + i] = scale * proto[c * px + i] + 12.0f * (fp::rng::uniform(4, stream, s * px + i) - 0.5f);
    }
  };
  fill(train, fp::rng::stream(fp::rng::Purpose::test, 950), d.train_x, d.train_y);
  fill(test, fp::rng::stream(fp::rng::Purpose::test, 951), d.test_x, d.test_y);
  // normalized as the real data is (mean 0, standard deviation 1 over the training pixels)
  double sum = 0, sq = 0;
  for (float v : d.train_x) {
    sum += v;
    sq += double(v) * v;
  }
  const double mean = sum / double(d.train_x.size());
  const double sd = std::sqrt(sq / double(d.train_x.size()) - mean * mean);
  for (auto* xs : {&d.train_x, &d.test_x})
    for (float& v : *xs) v = float((v - mean) / sd);
  return d;
}

Data load(std::size_t train, std::size_t test) {
  const std::string dir = fashion_mnist_dir();
  if (!std::filesystem::exists(dir)) return synthetic(train, test);
  auto tr = fp::data::load_mnist(dir, fp::data::Split::train);
  auto te = fp::data::load_mnist(dir, fp::data::Split::test);
  const auto [mean, stddev] = fp::data::mean_std(tr);
  fp::data::normalize(tr, mean, stddev);
  fp::data::normalize(te, mean, stddev);
  Data d;
  d.source = "Fashion-MNIST from " + dir;
  const auto order = fp::data::permutation(tr.count, 42, 1);
  d.train_x.resize(train * 784);
  d.train_y.resize(train);
  fp::data::gather<float>(tr.images, tr.labels, 784, std::span(order).subspan(0, train), d.train_x, d.train_y);
  d.test_x.assign(te.images.begin(), te.images.begin() + std::ptrdiff_t(test * 784));
  d.test_y.assign(te.labels.begin(), te.labels.begin() + std::ptrdiff_t(test));
  return d;
}

template <class M>
double accuracy(M& m, const Data& d) {
  const auto out = m.predict(std::span<const float>(d.test_x));
  return double(fp::count_correct(out, std::span<const std::int32_t>(d.test_y))) / double(d.test_y.size());
}

}  // namespace

TEST_CASE("LeNet trains on Cuda (TF32) as on Host: loss curves and accuracy agree") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  constexpr std::size_t batch = 64, steps = 400, window = 50;
  const Data d = load(batch * steps, 2000);
  MESSAGE("data: " << d.source);

  fp::Model<LeNet, fp::Host> host{fp::seed(42), fp::Host{0}};
  fp::Model<LeNet, fp::Cuda> dev{fp::seed(42), fp::Cuda{0}};
  fp::Sgd oh{{.lr = 0.05f, .momentum = 0.9f}}, od = oh;
  std::vector<double> lh(steps), ld(steps);
  for (std::size_t s = 0; s < steps; ++s) {
    const std::span<const float> x(d.train_x.data() + s * batch * 784, batch * 784);
    const std::span<const std::int32_t> y(d.train_y.data() + s * batch, batch);
    lh[s] = host.train_step(x, y, fp::SoftmaxCrossEntropy{}, oh);
    ld[s] = dev.train_step(x, y, fp::SoftmaxCrossEntropy{}, od);
    REQUIRE(std::isfinite(ld[s]));
  }
  // the first step starts from identical parameters and data: only rounding separates the losses
  CHECK(std::abs(ld[0] - lh[0]) <= 5e-3 * lh[0]);
  for (std::size_t w = 0; w < steps / window; ++w) {
    double mh = 0, md = 0;
    for (std::size_t s = w * window; s < (w + 1) * window; ++s) {
      mh += lh[s] / window;
      md += ld[s] / window;
    }
    MESSAGE("steps " << w * window << "-" << (w + 1) * window - 1 << ": mean loss Host " << mh << ", Cuda " << md);
    CHECK(std::abs(md - mh) <= 0.1 + 0.15 * mh);
  }
  const double ah = accuracy(host, d), ad = accuracy(dev, d);
  MESSAGE("test accuracy after " << steps << " steps: Host " << ah << ", Cuda " << ad);
  CHECK(ad > 0.7);
  CHECK(std::abs(ad - ah) <= 0.03);
}
