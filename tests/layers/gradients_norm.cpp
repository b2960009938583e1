// Gradient checks in double for BatchNorm2d, BatchNorm1d (layers/batch_norm.hpp), Conv2d without
// bias and GlobalAvgPool2d: every parameter gradient of a small network in training mode (the batch's
// statistics, which every sample's gradient goes through) against central differences. A BatchNorm's
// input gradient is checked through the weight gradient of the conv or Linear before it. Tolerances:
// see gradient_check.hpp.
#include "gradient_check.hpp"

namespace fp = fusedp;
namespace k = fusedp::kernels;

TEST_CASE("BatchNorm2d after a conv without bias, ReLU in its epilogue") {
  using Net = fp::Sequential<fp::Input<2, 6, 5>, fp::Conv2d<3, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                             fp::Flatten, fp::Linear<4>>;
  static_assert(Net::param_layout[0].size == 3 * 2 * 9 && Net::param_tensor_count == 5);  // no conv bias
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Relu>>);
  static_assert(Net::state_tensor_count == 5);
  gradcheck::check_threads<Net>(4, 31, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("BatchNorm2d with an activation chain that saves its input, and another BatchNorm after it") {
  // (A conv bias right before a BatchNorm has a gradient of exactly zero in exact arithmetic, the
  // batch mean removes it, so only rounding noise that differs between thread counts: no_bias.)
  using Net = fp::Sequential<fp::Input<3, 4, 4>, fp::Conv2d<4, 2, 1, 0, fp::no_bias>, fp::BatchNorm2d<0.3, 1e-3>,
                             fp::Tanh, fp::GELU,
                             fp::BatchNorm2d<>, fp::Flatten, fp::Linear<3>>;
  static_assert(Net::stage_plan[1].saves_z);
  gradcheck::check_threads<Net>(3, 32);
}

TEST_CASE("BatchNorm2d without affine parameters, first after Input") {
  // No parameters in the BatchNorm: its backward still feeds the conv after it, whose weight
  // gradient is checked; and the first stage computes no input gradient.
  using Net = fp::Sequential<fp::Input<2, 5, 5>, fp::BatchNorm2d<0.1, 1e-5, false>, fp::Conv2d<3, 3>, fp::Sigmoid,
                             fp::BatchNorm2d<>, fp::Flatten, fp::Linear<2>>;
  static_assert(Net::param_tensor_count == 6);
  gradcheck::check_threads<Net>(3, 33);
}

TEST_CASE("BatchNorm1d between Linear layers") {
  // (An activation between each Linear and its BatchNorm: a Linear bias right before a BatchNorm has
  // an exactly zero gradient, whose rounding noise differs between thread counts.)
  using Net = fp::Sequential<fp::Input<6>, fp::Linear<5>, fp::Tanh, fp::BatchNorm1d<>, fp::LeakyReLU<0.1f>,
                             fp::Linear<4>, fp::Sigmoid, fp::BatchNorm1d<>, fp::Linear<3>>;
  gradcheck::check_threads<Net>(5, 34, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("GlobalAvgPool2d after a conv, with ReLU in its epilogue") {
  using Net = fp::Sequential<fp::Input<2, 5, 4>, fp::Conv2d<3, 2>, fp::GlobalAvgPool2d, fp::ReLU, fp::Flatten,
                             fp::Linear<2>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 1, 1>>);
  gradcheck::check_threads<Net>(3, 35);
}
