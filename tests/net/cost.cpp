// The compile-time cost model (include/fusedp/net/cost.hpp) against counts made by hand for the seed
// networks, and against the memory the Host model really allocates.
#include <doctest/doctest.h>

#include <fusedp/exec/host.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/global_avg_pool.hpp>
#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/models/resnet.hpp>
#include <fusedp/net/cost.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/optim/adam.hpp>
#include <fusedp/optim/sgd.hpp>

#include "../support/seed_networks.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fp = fusedp;

namespace {

using LeNet = seed_networks::LeNet;
using CifarCnn = seed_networks::CifarCnn;

// Multiply-adds of one forward pass, by hand (weights x output pixels):
//   LeNet:     conv1 6x1x5x5 over 24x24, conv2 16x6x3x3 over 10x10, 400x120, 120x60, 60x10
//   CIFAR CNN: conv1 64x3x3x3 over 32x32, conv2 128x64x3x3 over 16x16, 8192x1024, 1024x10
constexpr double lenet_macs[] = {150.0 * 576, 864.0 * 100, 400.0 * 120, 120.0 * 60, 60.0 * 10};
constexpr double cifar_macs[] = {1728.0 * 1024, 73728.0 * 256, 8192.0 * 1024, 1024.0 * 10};

template <class Net, std::size_t N>
void check_flops(const double (&macs)[N]) {
  using C = fp::CostModel<Net>;
  double forward = 0;
  for (double m : macs) forward += 2 * m;
  // Backward: weight gradient everywhere, input gradient everywhere but the first layer.
  const double backward = 2 * forward - 2 * macs[0];
  CHECK(C::forward_flops == forward);
  CHECK(C::backward_flops == backward);
  CHECK(C::train_flops == forward + backward);
  // Stage by stage: the GEMM stages carry them, in order; the others have none.
  std::size_t g = 0;
  for (const fp::StageCost& s : C::stages) {
    if (s.parameters == 0) {
      CHECK(s.forward_flops == 0);
      continue;
    }
    REQUIRE(g < N);
    CHECK(s.forward_flops == 2 * macs[g]);
    CHECK(s.backward_flops == (g == 0 ? 2 * macs[g] : 4 * macs[g]));
    ++g;
  }
  CHECK(g == N);
}

}  // namespace

TEST_CASE("model FLOPs from the type: LeNet and the CIFAR-10 CNN against hand counts") {
  check_flops<LeNet>(lenet_macs);
  check_flops<CifarCnn>(cifar_macs);
  // Whole steps: LeNet 1.2 MFLOP a sample, the CIFAR CNN 170.7 MFLOP; conv2's weight gradient at batch
  // 128 is the 4.8 GFLOP that benchmarks/RESULTS.md worked out by hand.
  static_assert(fp::CostModel<LeNet>::train_flops == 1'198'800.0);
  static_assert(fp::CostModel<CifarCnn>::train_flops == 170'717'184.0);
  CHECK(fp::CostModel<CifarCnn>::stages[2].backward_flops / 2 * 128 == doctest::Approx(4.83e9).epsilon(1e-3));
}

TEST_CASE("per-stage parameters and bytes") {
  using C = fp::CostModel<LeNet>;
  std::size_t params = 0;
  for (const fp::StageCost& s : C::stages) params += s.parameters;
  CHECK(params == LeNet::param_count);  // 57,026
  // conv1 + ReLU: reads the 1x28x28 image, writes 6x24x24 (ReLU needs only its output in backward).
  CHECK(C::stages[0].first_layer == 1);
  CHECK(C::stages[0].bytes_read == 784 * 4);
  CHECK(C::stages[0].bytes_written == 6 * 24 * 24 * 4);
  CHECK(std::string(C::stages[0].name) == "Conv2d");
  CHECK(std::string(C::stages[1].name) == "MaxPool2d");
  CHECK(C::parameter_bytes == LeNet::param_storage * 4);
}

namespace {
template <class Net, class Opt>
void check_memory(Opt opt, std::size_t batch, int threads) {
  CAPTURE(batch);
  CAPTURE(threads);
  fp::Model<Net, fp::Host> m{fp::seed(1), fp::Host{threads}};
  std::vector<float> x(batch * Net::input_shape::size, 0.25f);
  std::vector<std::int32_t> y(batch, 3);
  m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  const fp::MemoryUse predicted = fp::CostModel<Net>::host_memory(batch, std::size_t(threads), Opt::state_slots);
  const fp::MemoryUse allocated = m.memory_use();
  CHECK(allocated.parameters == predicted.parameters);
  CHECK(allocated.gradients == predicted.gradients);
  CHECK(allocated.optimizer_state == predicted.optimizer_state);
  CHECK(allocated.state == predicted.state);
  CHECK(allocated.state == Net::state_storage * sizeof(float));
  CHECK(allocated.workspace == predicted.workspace);
  CHECK(allocated.total() == predicted.total());
}
}  // namespace

TEST_CASE("host memory: the prediction is what the Host model allocates") {
  check_memory<LeNet>(fp::Sgd{{.lr = 0.01f, .momentum = 0.9f}}, 32, 1);
  check_memory<LeNet>(fp::Adam{{.lr = 1e-3f}}, 17, 2);
  check_memory<CifarCnn>(fp::Sgd{{.lr = 0.01f}}, 4, 2);
  // BatchNorm's state buffer and a residual block's backward work memory count too.
  using Small = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                               fp::models::BasicBlock<16, 2, true>, fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten,
                               fp::Linear<10>>;
  static_assert(Small::state_storage > 0);
  check_memory<Small>(fp::Sgd{{.lr = 0.01f, .momentum = 0.9f}}, 6, 2);
}

TEST_CASE("the largest batch that fits a budget") {
  using C = fp::CostModel<CifarCnn>;
  constexpr std::size_t budget = std::size_t(1) << 30;  // 1 GiB, Adam, 2 threads, a loader of 2 slots
  constexpr std::size_t b = C::largest_host_batch(budget, 2, 2, 2);
  static_assert(b > 0);
  CHECK(C::host_memory(b, 2, 2, 2).total() <= budget);
  CHECK(C::host_memory(b + 1, 2, 2, 2).total() > budget);
  // Not even the parameters fit: no batch.
  CHECK(C::largest_host_batch(C::parameter_bytes, 2, 2) == 0);
}
