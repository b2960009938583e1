// Checkpoints of a Model<Net, Cuda> (train/checkpoint.hpp): saved on the device and resumed there, a
// run continues bit for bit; the same files load into a Host model (the same parameters) and a Host
// checkpoint loads into a Cuda model.
#include "gpu_test.hpp"

#include <fusedp/train/checkpoint.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace ft = fusedp::train;
using namespace gpu_test;

namespace {

using Small = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                             fp::Linear<32>, fp::ReLU, fp::Linear<10>>;

std::string temp_dir(const char* name) {
  const auto dir = std::filesystem::temp_directory_path() / (std::string("fusedp_gpu_ckpt_") + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

struct Batches {
  std::vector<std::vector<float>> x;
  std::vector<std::vector<std::int32_t>> y;
};

Batches batches(int n, std::size_t batch) {
  Batches b;
  for (int i = 0; i < n; ++i) {
    b.x.push_back(random_values(batch * 192, 100 + std::uint64_t(i)));
    b.y.push_back(labels_for(batch, 10, 200 + std::uint64_t(i)));
  }
  return b;
}

template <class M, class Opt>
void train(M& m, Opt& opt, const Batches& b, int from, int to) {
  for (int i = from; i < to; ++i)
    (void)m.train_step(std::span<const float>(b.x[std::size_t(i)]), std::span<const std::int32_t>(b.y[std::size_t(i)]),
                       fp::SoftmaxCrossEntropy{}, opt);
}

}  // namespace

TEST_CASE_TEMPLATE("a Cuda run saved and resumed continues bit for bit", Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const Batches data = batches(12, 24);
  const std::string dir = temp_dir("resume");
  fp::Model<Small, Space> straight{fp::seed(6), make_space<Space>()};
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}};
  train(straight, o1, data, 0, 12);

  fp::Sgd o2{{.lr = 0.05f, .momentum = 0.9f}};
  {
    fp::Model<Small, Space> first{fp::seed(6), make_space<Space>()};
    train(first, o2, data, 0, 5);
    ft::TrainingState s;
    s.epochs_done = 1;
    ft::save_checkpoint(dir, first, s);
  }
  fp::Model<Small, Space> resumed{fp::seed(6), make_space<Space>()};
  fp::Sgd o3{{.lr = 0.05f, .momentum = 0.9f}};
  const ft::TrainingState s = ft::load_checkpoint(dir, resumed, o3);
  CHECK(s.epochs_done == 1);
  CHECK(resumed.steps() == 5);
  train(resumed, o3, data, 5, 12);
  CHECK(params_on_host(resumed) == params_on_host(straight));
  std::filesystem::remove_all(dir);
}

TEST_CASE("Cuda and Host models read each other's checkpoints") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const Batches data = batches(4, 16);
  const std::string dir = temp_dir("cross");
  fp::Model<Small, fp::Cuda> gpu{fp::seed(7), fp::Cuda{0}};
  fp::Adam adam{{.lr = 1e-3f}};
  train(gpu, adam, data, 0, 4);
  ft::save_checkpoint(dir, gpu, ft::TrainingState{});

  fp::Model<Small, fp::Host> cpu{fp::seed(7), fp::Host{1}};
  fp::Adam adam_cpu{{.lr = 1e-3f}};
  (void)ft::load_checkpoint(dir, cpu, adam_cpu);
  CHECK(params_on_host(cpu) == params_on_host(gpu));
  std::vector<float> state(gpu.optimizer_state().size());
  gpu.copy_optimizer_state_to_host(state);
  CHECK(std::vector<float>(cpu.optimizer_state().begin(), cpu.optimizer_state().end()) == state);

  // and back: a Host checkpoint into a fresh Cuda model
  train(cpu, adam_cpu, data, 0, 2);
  ft::save_weights(dir + "/host.safetensors", cpu);
  fp::Model<Small, fp::Cuda> back{fp::seed(1), fp::Cuda{0}};
  ft::load_weights(dir + "/host.safetensors", back);
  CHECK(params_on_host(back) == params_on_host(cpu));
  std::filesystem::remove_all(dir);
}
