// Gradient checks in double for MaxPool2d and AvgPool2d (include/fusedp/layers/pooling.hpp,
// kernels/host/pool.hpp): window equal to the stride, stride smaller than the window (overlapping),
// floor mode leaving rows and columns unused, pooling first, pooling after pooling, and pooling with
// fused epilogues. Each pooling layer sits after a conv (or another pooling after a conv), so its
// input gradient is checked through the conv's weight gradient. Random inputs leave no ties in a max
// window. Tolerances: see gradient_check.hpp.
#include "gradient_check.hpp"

namespace fp = fusedp;
namespace k = fusedp::kernels;

TEST_CASE("MaxPool2d<2> after a conv") {
  using Net = fp::Sequential<fp::Input<2, 9, 11>, fp::Conv2d<3, 2>, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<4>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 4, 5>>);
  gradcheck::check_threads<Net>(3, 21);
}

TEST_CASE("MaxPool2d<3,2>: overlapping windows, floor mode drops the last row, ReLU in its epilogue") {
  // 12x11 -> 10x9 -> (10-3)/2+1 = 4, (9-3)/2+1 = 4
  using Net = fp::Sequential<fp::Input<2, 12, 11>, fp::Conv2d<3, 3>, fp::MaxPool2d<3, 2>, fp::ReLU, fp::Flatten,
                             fp::Linear<4>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 4, 4>>);
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Relu>>);
  gradcheck::check_threads<Net>(3, 22, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("MaxPool2d<2,1> with an activation chain in its epilogue (saved pooled values)") {
  using Net = fp::Sequential<fp::Input<1, 7, 6>, fp::Conv2d<2, 2>, fp::Tanh, fp::MaxPool2d<2, 1>, fp::Sigmoid,
                             fp::GELU, fp::Flatten, fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<2, 5, 4>>);
  static_assert(Net::stage_plan[1].saves_z);
  gradcheck::check_threads<Net>(3, 23);
}

TEST_CASE("AvgPool2d<2> with Tanh, odd sizes") {
  // 9x8 -> 8x7 -> 4x3
  using Net = fp::Sequential<fp::Input<2, 9, 8>, fp::Conv2d<3, 2>, fp::AvgPool2d<2>, fp::Tanh, fp::Flatten,
                             fp::Linear<4>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<3, 4, 3>>);
  gradcheck::check_threads<Net>(3, 24);
}

TEST_CASE("AvgPool2d<3,2> with GELU (saves its input)") {
  // 11x10 -> 9x8 -> 4x3
  using Net = fp::Sequential<fp::Input<2, 11, 10>, fp::Conv2d<2, 3>, fp::ReLU, fp::AvgPool2d<3, 2>, fp::GELU,
                             fp::Flatten, fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<1>::out, fp::Shape<2, 4, 3>>);
  static_assert(Net::stage_plan[1].saves_z);
  gradcheck::check_threads<Net>(3, 25, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("pooling first, and AvgPool2d<3,1> after a conv") {
  // 12x14 -> 6x7 -> 4x5 -> 2x3
  using Net = fp::Sequential<fp::Input<2, 12, 14>, fp::MaxPool2d<2>, fp::Conv2d<3, 3>, fp::AvgPool2d<3, 1>,
                             fp::Flatten, fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<2>::out, fp::Shape<3, 2, 3>>);
  gradcheck::check_threads<Net>(3, 26);
}

TEST_CASE("pooling after pooling") {
  // 10x10 -> 8x8 -> 4x4 -> 2x2
  using Net = fp::Sequential<fp::Input<1, 10, 10>, fp::Conv2d<2, 3>, fp::MaxPool2d<2>, fp::AvgPool2d<2>,
                             fp::Flatten, fp::Linear<3>>;
  gradcheck::check_threads<Net>(3, 27);
}

TEST_CASE("a small LeNet in double with cross-entropy") {
  // 12x12 -> 10x10 -> 5x5 -> 4x4 -> 2x2
  using Net = fp::Sequential<fp::Input<1, 12, 12>, fp::Conv2d<3, 3>, fp::ReLU, fp::MaxPool2d<2>, fp::Conv2d<4, 2>,
                             fp::ReLU, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<8>, fp::ReLU, fp::Linear<3>>;
  gradcheck::check_threads<Net>(4, 28, fp::SoftmaxCrossEntropy{});
}
