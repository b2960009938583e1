// cifar10_cnn: trains the CNN of PyTorch's second multi-GPU tutorial on CIFAR-10 on the CPU or a GPU
// (--device cuda), with the usual augmentation (random crop with 4 pixels of padding, horizontal flip)
// and per-channel normalization, evaluating on the test batch after each epoch.
//
//   cifar10_cnn --data ~/cifar-10-batches-bin --epochs 10 --metrics cifar.jsonl --checkpoint ckpt
//   cifar10_cnn --synthetic 2048 --epochs 1     # speed run on random images, no download
//
// The data: https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz (162 MB), extracted anywhere.
#include "common.hpp"

#include <fusedp/data/cifar.hpp>

namespace fp = fusedp;
namespace fd = fusedp::data;

using CifarCnn = fp::Sequential<fp::Input<3, 32, 32>,
                                fp::Conv2d<64, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                                fp::Conv2d<128, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                                fp::Flatten,
                                fp::Linear<1024>, fp::ReLU, fp::Linear<10>>;
static_assert(CifarCnn::output_shape::size == 10);

struct Options {
  std::string data;
  std::size_t synthetic = 0;
  float momentum = 0.9f;
  bool augment = true;
  example::TrainFlags train;
};

// `n` random 3x32x32 images whose colour leans towards their class, so a speed run also learns.
fd::Dataset synthetic(std::size_t n, std::uint64_t seed, std::uint64_t split) {
  constexpr std::size_t plane = 32 * 32;
  std::vector<float> x(n * 3 * plane);
  std::vector<std::int32_t> y(n);
  const std::uint64_t stream = fp::rng::stream(fp::rng::Purpose::data, (std::uint64_t(1) << 40) | split);
  for (std::size_t i = 0; i < n; ++i) {
    y[i] = std::int32_t(fp::rng::uniform(seed, stream, i) * 10);
    for (std::size_t c = 0; c < 3; ++c) {
      const float tint = float((std::size_t(y[i]) >> c) & 1) * 0.3f;
      for (std::size_t p = 0; p < plane; ++p)
        x[(i * 3 + c) * plane + p] = 0.7f * fp::rng::uniform(seed, stream + 1, (i * 3 + c) * plane + p) + tint;
    }
  }
  return fd::make_dataset(std::move(x), std::move(y), 3, 32, 32, 10, "synthetic data");
}

int run(const Options& o, const std::optional<fp::train::TrainingState>& resumed, const example::Launch& launch,
        std::uint64_t agree_on) {
  const example::TrainFlags& f = o.train;
  if (!o.data.empty() && o.synthetic > 0) throw fp::InvalidArgument("give --data DIR or --synthetic N, not both");
  if (o.data.empty() && o.synthetic == 0)
    throw fp::InvalidArgument(std::string("no CIFAR-10 data: pass --data DIR, a folder with the binary batches "
                                          "data_batch_1.bin .. data_batch_5.bin and test_batch.bin (download ") +
                              fd::cifar10_url + " and extract it), or --synthetic N to time training on N random images");
  fd::Dataset train, test;
  if (o.synthetic > 0) {
    train = synthetic(o.synthetic, f.seed, 0);
    test = synthetic(std::max<std::size_t>(o.synthetic / 5, 1), f.seed, 1);
  } else {
    train = example::with_flag("--data", [&] { return fd::load_cifar10(o.data, fd::Split::train); });
    test = example::with_flag("--data", [&] { return fd::load_cifar10(o.data, fd::Split::test); });
  }
  // torchvision's recipe: Normalize with the training set's per-channel mean and deviation.
  const auto [mean, stddev] = fd::channel_mean_std(train);
  const fd::Normalization normalize{mean, stddev};
  const fd::Augment augment = o.augment ? fd::Augment{.crop_padding = 4, .flip = true} : fd::Augment{};

  fd::DataLoader train_loader{train, launch.train_sampler(train.count, f.seed),
                              {.batch = std::size_t(f.batch), .augment = augment, .normalize = normalize, .seed = f.seed}};
  fd::DataLoader test_loader{test, launch.eval_sampler(test.count), {.batch = 500, .normalize = normalize}};

  example::with_trainer<CifarCnn>(launch, f, agree_on, [&](auto& trainer, int threads) {
    fp::Sgd opt{{.lr = f.lr, .momentum = o.momentum}};
    if (launch.root())
      std::printf("fusedp %s: CIFAR-10 CNN (%zu parameters) on %s, %zu train / %zu test images, %s, %d process(es) x "
                  "%d replica(s), %s\n",
                  FUSEDP_VERSION_STRING, CifarCnn::param_count, o.synthetic > 0 ? "synthetic data" : o.data.c_str(),
                  train.count, test.count, o.augment ? "crop+flip augmentation" : "no augmentation", launch.world(),
                  o.train.replicas, example::where(f, threads).c_str());
    example::fit(trainer, opt, fp::SoftmaxCrossEntropy{}, train_loader, test_loader, f, resumed, launch);
  });
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Train the CIFAR-10 CNN of PyTorch's multi-GPU tutorial with fusedp on the CPU"};
  Options o;
  o.train.epochs = 10;
  o.train.batch = 128;
  o.train.lr = 0.01f;
  app.add_option("--data", o.data, "folder with data_batch_1..5.bin and test_batch.bin (or cifar-10-batches-bin in it)");
  app.add_option("--synthetic", o.synthetic, "train on N random images instead (speed runs; no download)")
      ->check(CLI::Range(std::size_t(1), std::size_t(1) << 24));
  example::add_training_flags(app, o.train);
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::Range(0.0f, 0.999999f))->capture_default_str();
  app.add_flag("!--no-augment", o.augment, "turn off random crop and flip");
  return example::run_main("cifar10_cnn", app, argc, argv, [&] {
    const example::Launch launch;
    const auto resumed = example::resume_state(app, o.train);
    return run(o, resumed, launch, example::flags_hash(argc, argv));
  });
}
