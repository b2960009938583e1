// Residual<Body..., Shortcut> (net/residual.hpp) and the ResNet-18 type (models/resnet.hpp): shapes,
// layouts and names as compile-time facts; every parameter gradient of blocks with an identity and
// with a projection shortcut against central differences in double (gradient_check.hpp); the
// training and evaluation modes of BatchNorm inside a block. The whole ResNet-18 is held against
// PyTorch in tests/torch (cross_check.py --net resnet18, checkpoint_torch.py --net resnet18).
#include "../layers/gradient_check.hpp"

#include <fusedp/models/resnet.hpp>
#include <fusedp/optim/sgd.hpp>

#include <cstring>
#include <string_view>

namespace fp = fusedp;
namespace k = fusedp::kernels;

namespace {
constexpr char down[] = "down";
constexpr bool named(const fp::TensorName& n, std::string_view s) { return std::string_view(n.c_str()) == s; }
}  // namespace

TEST_CASE("ResNet-18 (CIFAR form): parameters, buffers and torchvision's names") {
  using R = fp::models::ResNet18Cifar<10>;
  static_assert(R::param_count == 11'173'962);
  static_assert(std::is_same_v<R::output_shape, fp::Shape<10, 1, 1>>);
  static_assert(R::param_tensor_count == 62);
  static_assert(named(R::param_layout[0].name, "conv1.weight"));
  static_assert(named(R::param_layout[3].name, "layer1.0.conv1.weight"));
  static_assert(named(R::param_layout[61].name, "fc.bias"));
  // 20 BatchNorms, 3 buffers each (and 2 transient tensors that checkpoints leave out)
  static_assert(R::state_tensor_count == 100);
  std::size_t buffers = 0, running = 0;
  bool downsample = false;
  for (const auto& s : R::state_layout) {
    if (s.kind != fp::StateKind::buffer) continue;
    ++buffers;
    if (std::strstr(s.name.c_str(), "running_")) running += s.size;
    downsample = downsample || std::string_view(s.name.c_str()) == "layer2.0.downsample.1.num_batches_tracked";
  }
  CHECK(buffers == 60);
  CHECK(running == 2 * 4800);  // mean and variance over 64 + 4 x 64 + 5 x 128 + 5 x 256 + 5 x 512 channels
  CHECK(downsample);
  // The plan: each block is one stage with the ReLU after it in its epilogue.
  static_assert(R::stage_count == 13);
  static_assert(std::is_same_v<R::stage<3>::epilogue, k::Epilogue<k::Relu>>);
}

TEST_CASE("Residual with an identity shortcut: gradients, ReLU after the add") {
  using Net = fp::Sequential<fp::Input<2, 5, 5>, fp::Conv2d<3, 3, 1, 1>, fp::ReLU,
                             fp::Residual<fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                                          fp::Conv2d<3, 3, 1, 1>, fp::IdentityShortcut>,
                             fp::ReLU, fp::Flatten, fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 5, 5>>);
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Relu>>);
  static_assert(named(Net::param_layout[2].name, "2.0.weight"));  // block 2, its layer 0
  static_assert(named(Net::param_layout[5].name, "2.3.weight"));
  gradcheck::check_threads<Net>(3, 41, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("Residual with a projection shortcut, first after Input, no activation after it") {
  using Net = fp::Sequential<
      fp::Input<2, 6, 6>,
      fp::Residual<fp::Conv2d<4, 3, 2, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::Tanh,
                   fp::Named<down, fp::Projection<fp::Conv2d<4, 1, 2, 0, fp::no_bias>, fp::BatchNorm2d<>>>>,
      fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<2>>;
  static_assert(std::is_same_v<Net::stage<0>::out, fp::Shape<4, 3, 3>>);
  static_assert(named(Net::param_layout[3].name, "0.down.0.weight"));
  static_assert(named(Net::state_layout[5].name, "0.down.1.running_mean"));
  gradcheck::check_threads<Net>(3, 42);
}

TEST_CASE("a block whose body is one BatchNorm without parameters, first after Input: the shortcut's dz") {
  // Its body's only stage has no parameters and no input gradient to compute, yet its backward forms
  // the sum's gradient (under the ReLU after the block) that the projection then takes.
  using Net = fp::Sequential<fp::Input<2, 5, 5>,
                             fp::Residual<fp::BatchNorm2d<0.1, 1e-5, false>, fp::Projection<fp::Conv2d<2, 1, 1, 0>>>,
                             fp::ReLU, fp::Flatten, fp::Linear<3>>;
  static_assert(Net::param_tensor_count == 4);  // the projection's weight and bias, the Linear's
  gradcheck::check_threads<Net>(3, 47, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("torchvision's BasicBlock, projection then identity, as in ResNet's stages") {
  using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                             fp::models::BasicBlock<4, 2, true>, fp::ReLU, fp::models::BasicBlock<4, 1, false>,
                             fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;
  gradcheck::check_threads<Net>(3, 43, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("a block ending in BatchNorm adds in its normalizing pass: GELU after it reads the saved sum") {
  using Net = fp::Sequential<fp::Input<2, 5, 5>, fp::Conv2d<3, 3, 1, 1>, fp::ReLU,
                             fp::Residual<fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                                          fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                             fp::GELU, fp::Flatten, fp::Linear<3>>;
  static_assert(Net::stage<1>::layer::fused_add<fp::Shape<3, 5, 5>>);
  static_assert(Net::stage<1>::epilogue::saves_input);
  gradcheck::check_threads<Net>(3, 44, fp::SoftmaxCrossEntropy{});
}

namespace {
// BatchNorm2d that runs in passes of its own: its blocks add in a separate pass, and evaluation does
// not fold it into the conv before it.
struct SeparateNorm : fp::BatchNorm2d<> {
  static constexpr bool adds_before_epilogue = false;
  static constexpr bool folds_into_previous = false;
};

// Three training steps and an evaluation of Net and of Unfused (the same network with SeparateNorm)
// from the same seed: every value bit for bit.
template <class Net, class Unfused>
void check_fused_add_is_exact() {
  static_assert(Net::param_count == Unfused::param_count);
  fp::Model<Net, fp::Host> fused{fp::seed(8), fp::Host{2}};
  fp::Model<Unfused, fp::Host> separate{fp::seed(8), fp::Host{2}};
  const std::size_t batch = 5;
  const std::vector<double> xd = gradcheck::uniform_values(batch * Net::input_shape::size, 10, 1, -1.5, 1.5);
  const std::vector<float> x(xd.begin(), xd.end());
  const std::vector<std::int32_t> y{0, 2, 1, 1, 0};
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  for (int step = 0; step < 3; ++step) {
    const float a = fused.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
    const float b = separate.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
    CHECK(a == b);
  }
  CHECK(std::equal(fused.params().begin(), fused.params().end(), separate.params().begin()));
  CHECK(std::equal(fused.buffers().begin(), fused.buffers().end(), separate.buffers().begin()));
  const auto pa = fused.predict(x);
  const auto pb = separate.predict(x);
  CHECK(std::equal(pa.begin(), pa.end(), pb.begin()));
}
}  // namespace

TEST_CASE("the add in BatchNorm's pass and BatchNorm folded into the conv in evaluation give the bits of "
          "separate passes, identity and projection") {
  using Fused = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                               fp::models::BasicBlock<4, 2, true>, fp::ReLU, fp::models::BasicBlock<4, 1, false>,
                               fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;
  using Separate = fp::Sequential<
      fp::Input<2, 6, 6>, fp::Conv2d<3, 3, 1, 1, fp::no_bias>, SeparateNorm, fp::ReLU,
      fp::Residual<fp::Conv2d<4, 3, 2, 1, fp::no_bias>, SeparateNorm, fp::ReLU, fp::Conv2d<4, 3, 1, 1, fp::no_bias>,
                   SeparateNorm, fp::Projection<fp::Conv2d<4, 1, 2, 0, fp::no_bias>, SeparateNorm>>,
      fp::ReLU,
      fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, SeparateNorm, fp::ReLU, fp::Conv2d<4, 3, 1, 1, fp::no_bias>,
                   SeparateNorm, fp::IdentityShortcut>,
      fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<3>>;
  static_assert(Fused::stage<3>::layer::fused_add<Fused::stage<3>::in>);
  static_assert(!Separate::stage<3>::layer::fused_add<Separate::stage<3>::in>);
  static_assert(fp::detail::folds_next<Fused, 0>());
  static_assert(!fp::detail::folds_next<Separate, 0>());
  // A fused block keeps neither its body's last output (BatchNorm writes the block's) nor the sum
  // before the ReLU after it (ReLU's derivative reads its output): two regions of the block's output
  // size fewer per block than separate passes need, every other region the same.
  static_assert(Separate::activation_elements - Fused::activation_elements == 2 * 2 * fp::align_elements(4 * 3 * 3));
  check_fused_add_is_exact<Fused, Separate>();
}

TEST_CASE("BatchNorm modes: a training step normalizes with the batch and updates the running statistics; "
          "predict uses them") {
  using Net = fp::Sequential<fp::Input<2, 3, 3>, fp::BatchNorm2d<0.25>, fp::Flatten, fp::Linear<2>>;
  fp::Model<Net, fp::Host, double> model{fp::seed(5), fp::Host{2}};
  const std::size_t batch = 4;
  const std::vector<double> x = gradcheck::uniform_values(batch * 18, 9, 1, -2.0, 3.0);
  const std::vector<std::int32_t> y{0, 1, 1, 0};
  const auto& rm = Net::state_layout[0];
  const auto& rv = Net::state_layout[1];
  const auto& nbt = Net::state_layout[2];
  REQUIRE(named(rm.name, "0.running_mean"));
  CHECK(model.buffers()[rv.offset] == 1.0);  // PyTorch's starting values
  CHECK(model.buffers()[rm.offset] == 0.0);

  // Evaluation before any step: running mean 0, variance 1, so the BatchNorm is x / sqrt(1 + eps).
  const std::vector<double> before(model.predict(x).begin(), model.predict(x).end());
  (void)model.compute_gradients(std::span<const double>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{});
  for (std::size_t c = 0; c < 2; ++c) {
    double mean = 0, sq = 0;
    for (std::size_t n = 0; n < batch; ++n)
      for (std::size_t i = 0; i < 9; ++i) mean += x[(n * 2 + c) * 9 + i];
    mean /= 36;
    for (std::size_t n = 0; n < batch; ++n)
      for (std::size_t i = 0; i < 9; ++i) sq += (x[(n * 2 + c) * 9 + i] - mean) * (x[(n * 2 + c) * 9 + i] - mean);
    CHECK(model.buffers()[rm.offset + c] == doctest::Approx(0.25 * mean).epsilon(1e-14));
    CHECK(model.buffers()[rv.offset + c] == doctest::Approx(0.75 + 0.25 * sq / 35).epsilon(1e-14));  // unbiased
  }
  CHECK(model.buffers()[nbt.offset] == 1.0);
  // The parameters did not move, but the statistics did: predict now gives other outputs.
  const std::vector<double> after(model.predict(x).begin(), model.predict(x).end());
  CHECK(after != before);
  // Evaluation does not touch the statistics.
  const std::vector<double> stats(model.buffers().begin(), model.buffers().end());
  (void)model.predict(x);
  CHECK(std::equal(stats.begin(), stats.end(), model.buffers().begin()));
}

TEST_CASE("BatchNorm in training needs more than one value per channel") {
  using Net = fp::Sequential<fp::Input<3>, fp::Linear<2>, fp::BatchNorm1d<>, fp::Linear<2>>;
  fp::Model<Net, fp::Host> model{fp::seed(1)};
  const std::vector<float> x{0.5f, -1.0f, 2.0f};
  const std::vector<std::int32_t> y{1};
  CHECK_THROWS_WITH_AS(
      (void)model.compute_gradients(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}),
      doctest::Contains("BatchNorm1d (layer 2): training needs more than one value per channel"), fp::InvalidArgument);
  CHECK(model.predict(x).size() == 2);  // evaluation mode takes a batch of one
  static_assert(Net::min_training_batch == 2 && Net::min_training_batch_stage == 1);
  // Refused before any layer runs: a BatchNorm2d before the BatchNorm1d keeps its statistics, and so
  // does a block's BatchNorm1d (a Residual asks for what its inner layers ask for).
  using Deep = fp::Sequential<fp::Input<2, 3, 3>, fp::Conv2d<3, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Flatten,
                              fp::Residual<fp::Linear<27>, fp::BatchNorm1d<>, fp::IdentityShortcut>, fp::Linear<2>>;
  static_assert(Deep::min_training_batch == 2 && Deep::min_training_batch_stage == 3);
  fp::Model<Deep, fp::Host> deep{fp::seed(2)};
  const std::vector<float> one(Deep::input_shape::size, 0.75f);
  const std::vector<float> stats(deep.buffers().begin(), deep.buffers().end());
  CHECK_THROWS_WITH_AS(
      (void)deep.compute_gradients(std::span<const float>(one), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}),
      doctest::Contains("Residual (layer 5): training needs more than one value per channel, got a batch of 1"),
      fp::InvalidArgument);
  CHECK(std::equal(stats.begin(), stats.end(), deep.buffers().begin()));
  // Two samples train.
  std::vector<float> two(2 * Deep::input_shape::size);
  for (std::size_t i = 0; i < two.size(); ++i) two[i] = 2 * fp::rng::uniform(4, 0, i) - 1;
  const std::vector<std::int32_t> y2{0, 1};
  (void)deep.compute_gradients(std::span<const float>(two), std::span<const std::int32_t>(y2), fp::SoftmaxCrossEntropy{});
  CHECK(!std::equal(stats.begin(), stats.end(), deep.buffers().begin()));
}

TEST_CASE("the cost model counts ResNet-18's convolutions and Linear, not its BatchNorms") {
  using R = fp::models::ResNet18Cifar<10>;
  // torchvision's count for the CIFAR form: 0.556 G multiply-adds per 32x32 image.
  constexpr double macs = fp::CostModel<R>::forward_flops / 2;
  static_assert(macs > 0.555e9 && macs < 0.557e9);
  CHECK(fp::CostModel<R>::stages[1].forward_flops == 0.0);  // bn1
  // A train step: forward, and the input and weight gradients of every stage but the first.
  constexpr double stem = 2.0 * 64 * 3 * 9 * 32 * 32;
  CHECK(fp::CostModel<R>::train_flops == doctest::Approx(3 * fp::CostModel<R>::forward_flops - stem));
}

TEST_CASE("a block's inner networks on a Bf16 Cuda model store their convs' and inner BatchNorms' outputs in "
          "16 bits") {
  using fp::precision::Bf16;
  using fp::precision::Tf32;
  using In = fp::Shape<64, 32, 32>;
  using Block = fp::models::BasicBlock<128, 2, true>;
  using Body = Block::body_layout<In, Bf16>;
  using Side = Block::projection_layout<In, Bf16>;
  constexpr bool on = fp::cuda_narrow_outputs;
  // conv1, bn1 + ReLU, conv2 in 16 bits; bn2, which writes the block's output (with the add), in fp32.
  static_assert(Body::narrow == std::array<bool, 4>{on, on, on, false});
  static_assert(std::is_same_v<Body::output_element<0>, std::conditional_t<on, k::BFloat16, float>>);
  static_assert(std::is_same_v<Body::input_element<0>, float>);  // the block's input, written outside
  static_assert(std::is_same_v<Body::input_element<1>, Body::output_element<0>>);
  static_assert(std::is_same_v<Body::input_element<3>, Body::output_element<2>>);
  static_assert(std::is_same_v<Body::output_element<3>, float>);
  // Each 16-bit region half of the 128 x 16 x 16 floats: conv1 at 0, bn1 at 16,384, conv2 at 32,768.
  static_assert(Body::stage_plan[1].out_offset == (on ? 16384 : 32768));
  static_assert(Body::stage_plan[3].out_offset == (on ? 49152 : 98304));
  static_assert(Block::body_saved<In, Bf16> == (on ? 49152 : 98304));
  static_assert(Block::body_saved<In> == 98304);
  // The projection's conv in 16 bits, and its BatchNorm's output, which bn2's fused add reads as stored:
  // each half of its 32,768 floats.
  static_assert(Side::narrow == std::array<bool, 2>{on, false});
  static_assert(std::is_same_v<Side::output_element<1>, std::conditional_t<on, k::BFloat16, float>>);
  static_assert(std::is_same_v<Body::add_element<3>, Side::output_element<1>>);
  static_assert(Side::stage_plan[1].out_offset == (on ? 16384 : 32768));
  static_assert(Side::activation_elements == (on ? 16384 + 16384 : 65536));
  static_assert(Block::saved_elements<In, k::Epilogue<k::Relu>, Bf16> == (on ? 81920 : 163840));
  static_assert(Block::saved_elements<In, k::Epilogue<k::Relu>> == 163840);
  // Its gradients too: between the inner stages (every one writes and reads them in 16 bits), and the
  // block's own dy (read by bn2 past the block's ReLU and by the projection's BatchNorm) and dx (written
  // by conv1 and the projection's conv).
  static_assert(std::is_same_v<Block::inner_gradient_element<In, Bf16>, std::conditional_t<on, k::BFloat16, float>>);
  static_assert(std::is_same_v<Block::inner_gradient_element<In, Tf32>, float>);
  static_assert(Block::cuda_reads_16bit_gradient<In, k::Epilogue<k::Relu>> && Block::cuda_writes_16bit_gradient<In>);
  static_assert(!Block::cuda_reads_16bit_gradient<In, k::Epilogue<k::Tanh>>);  // bn2's dz is no bf16 value
  // Under TF32 and on the Host: Net's own layouts, nothing narrowed.
  static_assert(Block::body_layout<In, Tf32>::narrow == std::array<bool, 4>{});
  static_assert(Block::saved_elements<In, k::Epilogue<k::Relu>, Tf32> == Block::saved_elements<In, k::Epilogue<k::Relu>>);
  static_assert(Block::body_layout<In>::activation_elements == Block::body<In>::activation_elements);

  // A conv with an activation of its own keeps its output in fp32 (its backward reads it for the
  // derivative); the identity has no layout.
  using Plain = fp::Residual<fp::Conv2d<8, 3, 1, 1>, fp::ReLU, fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>,
                             fp::IdentityShortcut>;
  using S = fp::Shape<8, 6, 6>;
  static_assert(Plain::body_layout<S, Bf16>::narrow == std::array<bool, 3>{false, on, false});
  static_assert(Plain::projection_layout<S, Bf16>::activation_elements == 0);

  // A projection whose add is a pass of its own (the body ends in a conv) keeps its output in fp32: the
  // separate add reads fp32.
  using Separate = fp::Residual<fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<8, 3, 2, 1>,
                                fp::Projection<fp::Conv2d<8, 1, 2, 0>, fp::BatchNorm2d<>>>;
  using SS = Separate::projection_layout<S, Bf16>;
  static_assert(!Separate::fused_add<S>);
  static_assert(std::is_same_v<SS::output_element<1>, float>);
  static_assert(SS::activation_elements == (on ? 48 + 80 : 80 + 80));
  // Nor does it take its gradients in 16 bits (the separate add's pass reads and writes fp32).
  static_assert(std::is_same_v<Separate::inner_gradient_element<S, Bf16>, float>);
  static_assert(!Separate::cuda_reads_16bit_gradient<S, k::Epilogue<k::Relu>> &&
                !Separate::cuda_writes_16bit_gradient<S>);  // 72 floats each (36 in 16 bits), 16-aligned
}
