// lenet_mnist: trains the LeNet of PyTorch's multi-GPU tutorial on Fashion-MNIST (or any folder of
// MNIST-format IDX files) on the CPU or a GPU, reports progress, evaluates on the test set after each
// epoch.
//
//   lenet_mnist                          # Debian's Fashion-MNIST, 2 epochs
//   lenet_mnist --device cuda            # on GPU 0 (a build with CUDA)
//   lenet_mnist --data ~/mnist --epochs 5 --metrics run.jsonl
//   lenet_mnist --epochs 10 --checkpoint ckpt          # save after every epoch
//   lenet_mnist --epochs 20 --resume ckpt --checkpoint ckpt   # continue from epoch 11
//   lenet_mnist --replicas 2                               # DataParallel style: 2 replicas, one process
//   mpirun -np 2 lenet_mnist                               # DDP style: one replica per rank
#include "common.hpp"

#include <fusedp/data/idx.hpp>

namespace fp = fusedp;
namespace fd = fusedp::data;

// conv 5x5 1->6, pool 2, conv 3x3 6->16, pool 2, linear 400->120->60->10, ReLU between.
using LeNet = fp::Sequential<fp::Input<1, 28, 28>,
                             fp::Conv2d<6, 5>, fp::ReLU, fp::MaxPool2d<2>,
                             fp::Conv2d<16, 3>, fp::ReLU, fp::MaxPool2d<2>,
                             fp::Flatten,
                             fp::Linear<120>, fp::ReLU, fp::Linear<60>, fp::ReLU, fp::Linear<10>>;
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::param_count == 57'026);

struct Options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  float momentum = 0.9f;
  example::TrainFlags train;  // 2 epochs, batch 64, lr 0.05, seed 42
};

int run(const Options& o, const std::optional<fp::train::TrainingState>& resumed, const example::Launch& launch,
        std::uint64_t agree_on) {
  const auto train = example::with_flag("--data", [&] { return fd::load_mnist(o.data, fd::Split::train); });
  const auto test = example::with_flag("--data", [&] { return fd::load_mnist(o.data, fd::Split::test); });
  fp::require(train.height == 28 && train.width == 28 && train.channels == 1, o.data,
              ": LeNet needs 1x28x28 images, the files hold ", train.channels, "x", train.height, "x", train.width);
  // One mean and deviation over all training pixels, applied to both splits.
  const auto [mean, stddev] = fd::mean_std(train);
  const fd::Normalization normalize{{mean}, {stddev}};

  const example::TrainFlags& f = o.train;
  fd::DataLoader train_loader{train, launch.train_sampler(train.count, f.seed),
                              {.batch = example::step_batch(f), .normalize = normalize, .seed = f.seed}};
  fd::DataLoader test_loader{test, launch.eval_sampler(test.count), {.batch = 1000, .normalize = normalize}};

  example::with_trainer<LeNet>(launch, f, agree_on, [&](auto& trainer, int threads) {
    fp::Sgd opt = example::sgd_of(f, o.momentum);
    if (launch.root())
      std::printf("fusedp %s: LeNet (%zu parameters) on %s, %zu train / %zu test images, %s, %d process(es) x %d "
                  "replica(s), %s\n",
                  FUSEDP_VERSION_STRING, LeNet::param_count, o.data.c_str(), train.count, test.count,
                  example::optimizer_text(f, "SGD", o.momentum).c_str(), launch.world(), o.train.replicas,
                  example::where(f, threads).c_str());
    example::fit(trainer, opt, fp::SoftmaxCrossEntropy{}, train_loader, test_loader, f, resumed, launch);
  });
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Train LeNet on Fashion-MNIST (or any MNIST-format folder) with fusedp on the CPU"};
  Options o;
  app.add_option("--data", o.data, "folder with {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]")
      ->capture_default_str();
  example::add_training_flags(app, o.train);
  example::add_sgd_flags(app, o.train, o.momentum);
  return example::run_main("lenet_mnist", app, argc, argv, [&] {
    const example::Launch launch;
    const auto resumed = example::resume_state(app, o.train);
    return run(o, resumed, launch, example::flags_hash(argc, argv));
  });
}
