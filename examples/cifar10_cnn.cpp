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

int run(const Options& o, const std::optional<fp::train::TrainingState>& resumed, const example::Launch& launch,
        std::uint64_t agree_on) {
  const example::TrainFlags& f = o.train;
  const std::pair<fd::Dataset, fd::Dataset> sets = example::cifar10_or_synthetic(o.data, o.synthetic, f.seed);
  const fd::Dataset& train = sets.first;
  const fd::Dataset& test = sets.second;
  const auto [mean, stddev] = fd::channel_mean_std(train);
  const fd::Normalization normalize{mean, stddev};
  const fd::Augment augment = o.augment ? fd::Augment{.crop_padding = 4, .flip = true} : fd::Augment{};

  fd::DataLoader train_loader{train, launch.train_sampler(train.count, f.seed),
                              {.batch = example::step_batch(f), .augment = augment, .normalize = normalize, .seed = f.seed}};
  fd::DataLoader test_loader{test, launch.eval_sampler(test.count), {.batch = 500, .normalize = normalize}};

  example::with_trainer<CifarCnn>(launch, f, agree_on, [&](auto& trainer, int threads) {
    fp::Sgd opt = example::sgd_of(f, o.momentum);
    if (launch.root())
      std::printf("fusedp %s: CIFAR-10 CNN (%zu parameters) on %s, %zu train / %zu test images, %s, %s, %d "
                  "process(es) x %d replica(s), %s\n",
                  FUSEDP_VERSION_STRING, CifarCnn::param_count, o.synthetic > 0 ? "synthetic data" : o.data.c_str(),
                  train.count, test.count, o.augment ? "crop+flip augmentation" : "no augmentation",
                  example::optimizer_text(f, "SGD", o.momentum).c_str(), launch.world(), o.train.replicas,
                  example::where(f, threads).c_str());
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
  example::add_sgd_flags(app, o.train, o.momentum);
  app.add_flag("!--no-augment", o.augment, "turn off random crop and flip");
  return example::run_main("cifar10_cnn", app, argc, argv, [&] {
    const example::Launch launch;
    const auto resumed = example::resume_state(app, o.train);
    return run(o, resumed, launch, example::flags_hash(argc, argv));
  });
}
