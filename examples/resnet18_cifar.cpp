// resnet18_cifar: trains ResNet-18 (the CIFAR form: 3x3 stem, no max-pool, 11.2 M parameters, torchvision's
// tensor names) on CIFAR-10, the network of the data-parallel benchmarks after the tutorial ones: SGD with
// Nesterov momentum and weight decay, a cosine schedule with warm-up, label smoothing, random crop and
// flip. BatchNorm's running statistics are saved with the weights and, with several replicas or ranks,
// copied from rank 0 to every replica after each step (batch_norm::Broadcast, as DDP does; a Parallel
// with batch_norm::Sync takes SyncBatchNorm statistics over every replica's shard instead).
//
//   resnet18_cifar --data ~/cifar-10-batches-bin --epochs 30 --metrics r18.jsonl --checkpoint ckpt
//   resnet18_cifar --synthetic 512 --epochs 1 --batch 64       # speed run, no download
//   resnet18_cifar --synthetic 4096 --device cuda --batch 256  # on a GPU
//   mpirun -np 2 resnet18_cifar --data ... --device cuda       # DDP style, one GPU per rank
//
// The weights file of a checkpoint (ckpt/model.safetensors) loads into the equivalent torchvision model
// with load_state_dict(strict=True) (see tests/torch/checkpoint_torch.py for that model).
#include "common.hpp"

#include <fusedp/data/cifar.hpp>
#include <fusedp/models/resnet.hpp>

#include <string>

namespace fp = fusedp;
namespace fd = fusedp::data;

using ResNet18 = fp::models::ResNet18Cifar<10>;
static_assert(ResNet18::param_count == 11'173'962);

// Values of BatchNorm's running statistics (what checkpoints save beside the parameters).
constexpr std::size_t running_statistics = [] {
  std::size_t n = 0;
  for (const fp::StateTensor& t : ResNet18::state_layout) n += t.kind == fp::StateKind::buffer ? t.size : 0;
  return n;
}();

struct Options {
  std::string data;
  std::size_t synthetic = 0;
  float momentum = 0.9f;
  float label_smoothing = 0.0f;
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

  example::with_trainer<ResNet18>(launch, f, agree_on, [&](auto& trainer, int threads) {
    fp::Sgd opt = example::sgd_of(f, o.momentum);
    if (launch.root())
      std::printf("fusedp %s: ResNet-18 (%zu parameters, %zu running statistics) on %s, %zu train / %zu test "
                  "images, %s, %s, %d process(es) x %d replica(s), %s\n",
                  FUSEDP_VERSION_STRING, ResNet18::param_count, running_statistics,
                  o.synthetic > 0 ? "synthetic data" : o.data.c_str(), train.count, test.count,
                  o.augment ? "crop+flip augmentation" : "no augmentation",
                  example::optimizer_text(f, "SGD", o.momentum).c_str(), launch.world(), o.train.replicas,
                  example::where(f, threads).c_str());
    example::fit(trainer, opt, fp::SoftmaxCrossEntropy{.label_smoothing = o.label_smoothing}, train_loader,
                 test_loader, f, resumed, launch);
  });
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Train ResNet-18 on CIFAR-10 with fusedp on the CPU or a GPU"};
  Options o;
  o.train.epochs = 30;
  o.train.batch = 128;
  o.train.lr = 0.1f;
  o.train.schedule = "cosine";
  o.train.warmup = 100;
  o.train.weight_decay = 5e-4f;
  o.train.nesterov = true;
  app.add_option("--data", o.data, "folder with data_batch_1..5.bin and test_batch.bin (or cifar-10-batches-bin in it)");
  app.add_option("--synthetic", o.synthetic, "train on N random images instead (speed runs; no download)")
      ->check(CLI::Range(std::size_t(1), std::size_t(1) << 24));
  example::add_training_flags(app, o.train);
  example::add_sgd_flags(app, o.train, o.momentum);
  app.add_option("--label-smoothing", o.label_smoothing, "the cross-entropy's label smoothing")
      ->check(CLI::Range(0.0f, 1.0f))
      ->capture_default_str();
  app.add_flag("!--no-augment", o.augment, "turn off random crop and flip");
  return example::run_main("resnet18_cifar", app, argc, argv, [&] {
    const example::Launch launch;
    const auto resumed = example::resume_state(app, o.train);
    return run(o, resumed, launch, example::flags_hash(argc, argv));
  });
}
