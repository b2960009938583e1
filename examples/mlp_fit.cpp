// mlp_fit: fits a small image — a function of (x, y) in [-1, 1]^2 — with a narrow MLP, the kind of
// network tiny-cuda-nn fuses into one kernel (fusedp fuses consecutive Linear+activation layers of
// width <= 128 into one stage on Cuda). MSE loss, Adam; the test error is measured on the full pixel
// grid and falls epoch after epoch. --image writes the target and the fit side by side as a PGM.
//
//   mlp_fit --epochs 30 --image fit.pgm
#include "common.hpp"

#include <cmath>
#include <fstream>
#include <numbers>

namespace fp = fusedp;
namespace fd = fusedp::data;

using Mlp = fp::Sequential<fp::Input<2>,
                           fp::Linear<64>, fp::ReLU,
                           fp::Linear<64>, fp::ReLU,
                           fp::Linear<64>, fp::ReLU,
                           fp::Linear<1>>;
static_assert(Mlp::param_count == 2 * 64 + 64 + 2 * (64 * 64 + 64) + 64 + 1);

struct Options {
  std::size_t samples = 16384;
  std::size_t side = 64;
  std::string image;
  example::TrainFlags train;
};

// The image: rings around the centre, brighter towards the top left, in [0, 1].
float target(float x, float y) {
  const float r = std::sqrt(x * x + y * y);
  return 0.5f + 0.35f * std::cos(3.0f * std::numbers::pi_v<float> * r) + 0.15f * (y - x) / 2.0f;
}

// `n` points drawn uniformly in [-1, 1]^2 (training), or the side x side pixel centres (test).
fd::Dataset points(std::size_t n, std::uint64_t seed) {
  std::vector<float> xy(2 * n), t(n);
  const std::uint64_t stream = fp::rng::stream(fp::rng::Purpose::data, std::uint64_t(1) << 41);
  for (std::size_t i = 0; i < n; ++i) {
    xy[2 * i] = 2 * fp::rng::uniform(seed, stream, 2 * i) - 1;
    xy[2 * i + 1] = 2 * fp::rng::uniform(seed, stream, 2 * i + 1) - 1;
    t[i] = target(xy[2 * i], xy[2 * i + 1]);
  }
  return fd::make_regression_dataset(std::move(xy), std::move(t), 2, 1, "training points");
}
fd::Dataset grid(std::size_t side) {
  std::vector<float> xy(2 * side * side), t(side * side);
  for (std::size_t r = 0; r < side; ++r)
    for (std::size_t c = 0; c < side; ++c) {
      const std::size_t i = r * side + c;
      xy[2 * i] = (2 * float(c) + 1) / float(side) - 1;
      xy[2 * i + 1] = 1 - (2 * float(r) + 1) / float(side);
      t[i] = target(xy[2 * i], xy[2 * i + 1]);
    }
  return fd::make_regression_dataset(std::move(xy), std::move(t), 2, 1, "pixel grid");
}

template <class Model>
void write_pgm(const std::string& path, Model& model, const fd::Dataset& g, std::size_t side) {
  const auto fit = model.predict(std::span<const float>(g.images));
  std::vector<std::uint8_t> bytes;
  const std::string head = "P5\n" + std::to_string(2 * side) + " " + std::to_string(side) + "\n255\n";
  bytes.assign(head.begin(), head.end());
  auto grey = [](float v) { return std::uint8_t(std::lround(std::clamp(v, 0.0f, 1.0f) * 255)); };
  for (std::size_t r = 0; r < side; ++r) {
    for (std::size_t c = 0; c < side; ++c) bytes.push_back(grey(g.targets[r * side + c]));
    for (std::size_t c = 0; c < side; ++c) bytes.push_back(grey(fit[r * side + c]));
  }
  example::with_flag("--image", [&] { fp::train::write_file_atomically(path, bytes); });
  std::printf("wrote %s: target (left) and fit (right), %zux%zu each\n", path.c_str(), side, side);
}

int run(const Options& o, const std::optional<fp::train::TrainingState>& resumed, const example::Launch& launch,
        std::uint64_t agree_on) {
  const example::TrainFlags& f = o.train;
  const fd::Dataset train = points(o.samples, f.seed);
  const fd::Dataset test = grid(o.side);
  fd::DataLoader train_loader{train, launch.train_sampler(train.count, f.seed), {.batch = example::step_batch(f), .seed = f.seed}};
  fd::DataLoader test_loader{test, launch.eval_sampler(test.count), {.batch = 4096}};

  example::with_trainer<Mlp>(launch, f, agree_on, [&](auto& trainer, int threads) {
    fp::Adam opt = example::adam_of(f);
    if (launch.root())
      std::printf("fusedp %s: MLP 2-64-64-64-1 (%zu parameters) fitting a %zux%zu image from %zu random points, "
                  "MSE + Adam, %d process(es) x %d replica(s), %s\n",
                  FUSEDP_VERSION_STRING, Mlp::param_count, o.side, o.side, train.count, launch.world(),
                  o.train.replicas, example::where(f, threads).c_str());
    example::fit(trainer, opt, fp::MSE{}, train_loader, test_loader, f, resumed, launch);
    if (!o.image.empty() && launch.root()) write_pgm(o.image, example::model_of(trainer), test, o.side);
  });
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Fit a small image with a fused MLP (MSE, Adam) with fusedp on the CPU"};
  Options o;
  o.train.epochs = 30;
  o.train.batch = 128;
  o.train.lr = 0.002f;
  o.train.decay = "all";  // Adam's weight decay (0 by default) on every parameter, as PyTorch
  app.add_option("--samples", o.samples, "random training points per epoch")
      ->check(CLI::Range(std::size_t(1), std::size_t(1) << 26))
      ->capture_default_str();
  app.add_option("--side", o.side, "pixels per side of the test grid (and of --image)")
      ->check(CLI::Range(std::size_t(2), std::size_t(4096)))
      ->capture_default_str();
  app.add_option("--image", o.image, "write target and fit side by side to this PGM file");
  example::add_training_flags(app, o.train);
  return example::run_main("mlp_fit", app, argc, argv, [&] {
    const example::Launch launch;
    const auto resumed = example::resume_state(app, o.train);
    return run(o, resumed, launch, example::flags_hash(argc, argv));
  });
}
