// Gradient checks in double for Conv2d (include/fusedp/layers/conv2d.hpp, kernels/host/conv2d.hpp):
// several kernel sizes, strides and paddings over sizes that are multiples of nothing, plain and with
// fused epilogues (one activation, chains that save the pre-activation, GELU which needs its input).
// A conv after another layer has its input gradient (col2im, or the direct path of a 1x1 kernel)
// checked through the earlier layer's weight gradient. Tolerances: see gradient_check.hpp.
#include "gradient_check.hpp"

namespace fp = fusedp;
namespace k = fusedp::kernels;

TEST_CASE("Conv2d 3x3 with no epilogue over Input<3,7,9>") {
  using Net = fp::Sequential<fp::Input<3, 7, 9>, fp::Conv2d<4, 3>, fp::Flatten, fp::Linear<5>>;
  static_assert(std::is_same_v<Net::stage<0>::epilogue, k::Epilogue<>>);
  static_assert(Net::stage_plan[0].saves_z == false);
  gradcheck::check_threads<Net>(3, 11);
}

TEST_CASE("Conv2d stride 2, pad 1 after a conv: its input gradient reaches the first conv") {
  // 9x11 -> 8x10 -> (8+2-3)/2+1 = 4, (10+2-3)/2+1 = 5
  using Net = fp::Sequential<fp::Input<2, 9, 11>, fp::Conv2d<3, 2>, fp::Sigmoid, fp::Conv2d<4, 3, 2, 1>, fp::ReLU,
                             fp::Flatten, fp::Linear<4>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<4, 4, 5>>);
  gradcheck::check_threads<Net>(3, 12, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("Conv2d stride 2, pad 1 first, then a 2x2 conv with Tanh (Input<3,7,9>)") {
  using Net = fp::Sequential<fp::Input<3, 7, 9>, fp::Conv2d<4, 3, 2, 1>, fp::ReLU, fp::Conv2d<3, 2>, fp::Tanh,
                             fp::Flatten, fp::Linear<4>>;
  static_assert(std::is_same_v<Net::stage<0>::out, fp::Shape<4, 4, 5>>);
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 3, 4>>);
  gradcheck::check_threads<Net>(3, 13, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("1x1 convs (the direct path, also for the input gradient) and a 5x5 'same' conv with GELU") {
  using Net = fp::Sequential<fp::Input<2, 6, 7>, fp::Conv2d<3, 1>, fp::GELU, fp::Conv2d<4, 1>, fp::Tanh,
                             fp::Conv2d<2, 5, 1, 2>, fp::GELU, fp::Flatten, fp::Linear<3>>;
  static_assert(Net::stage_plan[0].saves_z);  // GELU reads its input
  static_assert(!Net::stage_plan[1].saves_z);  // Tanh reads its output
  static_assert(std::is_same_v<Net::stage<2>::out, fp::Shape<2, 6, 7>>);
  gradcheck::check_threads<Net>(3, 14);
}

TEST_CASE("activation chains in a conv epilogue save the pre-activation") {
  // 8x7 -> 6x5 -> (6-3)/2+1 = 2, (5-3)/2+1 = 2
  using Net = fp::Sequential<fp::Input<2, 8, 7>, fp::Conv2d<3, 3>, fp::ReLU, fp::Tanh, fp::Conv2d<2, 3, 2, 0>,
                             fp::Sigmoid, fp::GELU, fp::Flatten, fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<0>::epilogue, k::Epilogue<k::Relu, k::Tanh>>);
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Sigmoid, k::Gelu>>);
  static_assert(Net::stage<0>::last == 3 && Net::stage<1>::first == 4 && Net::stage<1>::last == 6);
  static_assert(Net::stage_plan[0].saves_z && Net::stage_plan[1].saves_z);
  gradcheck::check_threads<Net>(3, 15, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("Conv2d kernel 4, stride 3, pad 2 after a conv with LeakyReLU") {
  // 10x8 -> 9x7 -> (9+4-4)/3+1 = 4, (7+4-4)/3+1 = 3
  using Net = fp::Sequential<fp::Input<1, 10, 8>, fp::Conv2d<2, 2>, fp::LeakyReLU<>, fp::Conv2d<3, 4, 3, 2>,
                             fp::Flatten, fp::Linear<2>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 4, 3>>);
  gradcheck::check_threads<Net>(3, 16);
}

TEST_CASE("a batch that does not split evenly over the threads") {
  using Net = fp::Sequential<fp::Input<3, 7, 9>, fp::Conv2d<2, 3, 1, 1>, fp::Tanh, fp::Conv2d<3, 3, 2>, fp::ReLU,
                             fp::Flatten, fp::Linear<3>>;
  gradcheck::check_threads<Net>(5, 17, fp::SoftmaxCrossEntropy{});
  gradcheck::check<Net, fp::SoftmaxCrossEntropy>(1, 1, 18);
}
