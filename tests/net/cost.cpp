// The compile-time cost model (include/fusedp/net/cost.hpp) against counts made by hand for the seed
// networks, and against the memory the Host model really allocates.
#include <doctest/doctest.h>

#include <fusedp/exec/host.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/dropout.hpp>
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

// The traffic floor against benchmarks/RESULTS.md's hand arithmetic (session 21), term by term, for
// batches of 128 with SGD and momentum (one state slot): activations in fp32 (a = 4) and in 16 bits.
TEST_CASE("the traffic floor of a step: the CIFAR-10 CNN and LeNet against the hand count") {
  using C = fp::CostModel<CifarCnn>;
  static_assert(C::has_traffic_floor && C::traffic_unmodeled_layer == 0);
  constexpr std::size_t b = 128;
  // Parameters: 8,475,530 values x (forward read + update reading p, m and writing p, m, g) x 4 bytes,
  // plus every weight but conv1's (73,728 + 8,388,608 + 10,240) read by an input-gradient GEMM.
  const std::size_t cifar_params = 8'475'530 * 6 * 4 + (73'728 + 8'388'608 + 10'240) * 4;
  for (const std::size_t a : {4, 2}) {
    CAPTURE(a);
    const fp::StepTraffic t = C::step_traffic_floor(b, 1, a);
    CHECK(t.parameters == cifar_params);
    CHECK(t.input == 2 * 3 * 32 * 32 * 4 * b);
    // conv1 pooled (n = 64x16x16, the first stage: 6n a + 2n argmax bytes), conv2 pooled (n = 128x8x8:
    // 7n a + 3n), fc1's 1,024 outputs (7n a).
    CHECK(t.activations == ((6 * a + 2) * 16'384 + (7 * a + 3) * 8'192 + 7 * a * 1'024) * b);
    CHECK(t.logits == 200 * b);  // 10 fp32 logits: written, read by the loss, gradient written, read twice
  }
  // The step's totals as RESULTS.md states them: 331.2 MB in fp32, 289.5 MB with 16-bit activations.
  CHECK(C::step_traffic_floor(b, 1).total() == 331'176'176);
  CHECK(C::step_traffic_floor(b, 1, 2).total() == 289'495'280);
  // Adam's second slot: two more fp32 values per parameter, read and written.
  CHECK(C::step_traffic_floor(b, 2).parameters - C::step_traffic_floor(b, 1).parameters == 8'475'530 * 2 * 4);
  CHECK(C::step_traffic_floor(b, 0).parameters == cifar_params - 8'475'530 * 2 * 4);

  // LeNet: 57,026 parameters (every weight but conv1's 150 read by an input-gradient GEMM); conv1
  // pooled 6x12x12 (first), conv2 pooled 16x5x5, 120 and 60 outputs, 10 logits; 46,376 bytes a sample
  // for the activations, input and logits: 7.5 MB a step.
  using L = fp::CostModel<LeNet>;
  static_assert(L::has_traffic_floor);
  const fp::StepTraffic l = L::step_traffic_floor(b, 1);
  CHECK(l.parameters == 57'026 * 24 + (57'026 - 150 - 6 - 16 - 120 - 60 - 10) * 4);
  CHECK(l.input + l.activations + l.logits == 46'376 * b);
  CHECK(l.activations == (26 * 864 + 31 * 400 + 28 * 120 + 28 * 60) * b);
  CHECK(l.total() == 7'531'408);
  // Linear in the batch for the rest, constant in it for the parameters.
  CHECK(L::step_traffic_floor(2 * b, 1).total() - l.parameters == 2 * (l.total() - l.parameters));
}

TEST_CASE("the traffic floor: activations without a mask, with a saved pre-activation, behind a Flatten") {
  // A GELU conv saves z (fp32: written by forward, read for the derivative), so its pooling would not fuse;
  // a Linear without an activation reads no mask; a Flatten first moves nothing.
  using Gelu = fp::Sequential<fp::Input<2, 8, 8>, fp::Conv2d<4, 3>, fp::GELU, fp::Flatten, fp::Linear<6>,
                              fp::Linear<5>>;
  using G = fp::CostModel<Gelu>;
  static_assert(G::has_traffic_floor);
  const fp::StepTraffic g = G::step_traffic_floor(3, 1, 2);
  // conv (n = 4x6x6 = 144, first): 5n x 2 + 8n for z; the plain Linear<6>: 6n x 2.
  CHECK(g.activations == (5 * 144 * 2 + 8 * 144 + 6 * 6 * 2) * 3);
  CHECK(g.logits == 5 * 5 * 4 * 3);
  CHECK(g.input == 2 * 128 * 4 * 3);
  // 981 parameters (conv 72 + 4, Linear 864 + 6 and 30 + 5); the two Linear weights read by input gradients.
  CHECK(g.parameters == 981 * 24 + (864 + 30) * 4);
  // A Sigmoid on the logits reads them for its derivative: one more fp32 read.
  using Flat = fp::Sequential<fp::Input<1, 4, 4>, fp::Flatten, fp::Linear<8>, fp::ReLU, fp::Linear<3>, fp::Sigmoid>;
  static_assert(fp::CostModel<Flat>::has_traffic_floor);
  const fp::StepTraffic f = fp::CostModel<Flat>::step_traffic_floor(2, 0);
  CHECK(f.activations == 6 * 8 * 4 * 2);  // the first stage: 5n a and the ReLU's mask
  CHECK(f.logits == 6 * 3 * 4 * 2);
  CHECK(f.parameters == (16 * 8 + 8 + 8 * 3 + 3) * 16 + 8 * 3 * 4);
}

TEST_CASE("the traffic floor names the first layer outside its model") {
  // Input is layer 0. ResNet-18's stem BatchNorm is layer 2.
  static_assert(fp::CostModel<fp::models::ResNet18Cifar<10>>::traffic_unmodeled_layer == 2);
  static_assert(!fp::CostModel<fp::models::ResNet18Cifar<10>>::has_traffic_floor);
  // A max-pooling whose stride is not its window (layer 3), one after a GELU conv, which saves its
  // pre-activation (layer 3), average pooling (layer 3) and Dropout (layer 4) stay outside; a
  // max-pooling with stride K after a ReLU conv, a plain conv, and a Flatten are inside.
  using Overlap = fp::Sequential<fp::Input<1, 9, 9>, fp::Conv2d<2, 3>, fp::ReLU, fp::MaxPool2d<3, 2>, fp::Flatten,
                                 fp::Linear<4>>;
  using AfterGelu = fp::Sequential<fp::Input<1, 9, 9>, fp::Conv2d<2, 3>, fp::GELU, fp::MaxPool2d<2>, fp::Flatten,
                                   fp::Linear<4>>;
  using Average = fp::Sequential<fp::Input<1, 9, 9>, fp::Conv2d<2, 3>, fp::ReLU, fp::AvgPool2d<2>, fp::Flatten,
                                 fp::Linear<4>>;
  using Drop = fp::Sequential<fp::Input<1, 9, 9>, fp::Conv2d<2, 3>, fp::ReLU, fp::Flatten, fp::Dropout<0.5f>,
                              fp::Linear<4>>;
  using Plain = fp::Sequential<fp::Input<1, 9, 9>, fp::Conv2d<2, 3>, fp::MaxPool2d<3>, fp::Flatten, fp::Linear<4>>;
  static_assert(fp::CostModel<Overlap>::traffic_unmodeled_layer == 3);
  static_assert(fp::CostModel<AfterGelu>::traffic_unmodeled_layer == 3);
  static_assert(fp::CostModel<Average>::traffic_unmodeled_layer == 3);
  static_assert(fp::CostModel<Drop>::traffic_unmodeled_layer == 4);
  static_assert(fp::CostModel<Plain>::has_traffic_floor);
  // The plain conv's 2x7x7 output pools 3x3 to 2x2x2 (first stage: 5n a, no mask, 2n argmax bytes).
  CHECK(fp::CostModel<Plain>::step_traffic_floor(1, 1).activations == 5 * 8 * 4 + 2 * 8);
  CHECK(!fp::CostModel<Overlap>::has_traffic_floor);
}
