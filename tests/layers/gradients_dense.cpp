// Gradient checks in double for Linear, the activations (ReLU, LeakyReLU, Tanh, Sigmoid, GELU), Flatten
// and Dropout: activations in Linear epilogues, chains of two, stand-alone activation stages (first in
// the network, after Flatten, after Dropout), and Dropout in training mode (its mask is fixed for a
// fixed step, so finite differences see the same mask as backward). Every activation sits after a
// Linear or Conv2d, so its derivative reaches that layer's weight gradient. Tolerances: see
// gradient_check.hpp.
#include "gradient_check.hpp"

#include <fusedp/optim/sgd.hpp>

namespace fp = fusedp;
namespace k = fusedp::kernels;

TEST_CASE("Linear with each activation in its epilogue") {
  using Net = fp::Sequential<fp::Input<7>, fp::Linear<6>, fp::ReLU, fp::Linear<5>, fp::LeakyReLU<0.1f>,
                             fp::Linear<4>, fp::Tanh, fp::Linear<6>, fp::Sigmoid, fp::Linear<5>, fp::GELU,
                             fp::Linear<3>>;
  static_assert(Net::stage_count == 6);
  static_assert(std::is_same_v<Net::stage<4>::epilogue, k::Epilogue<k::Gelu>>);
  static_assert(Net::stage_plan[4].saves_z && !Net::stage_plan[0].saves_z && !Net::stage_plan[3].saves_z);
  gradcheck::check_threads<Net>(4, 31);
  gradcheck::check_threads<Net, fp::SoftmaxCrossEntropy>(3, 32);
}

TEST_CASE("chains of two activations after Linear, and LeakyReLU with zero or negative slope") {
  using Net = fp::Sequential<fp::Input<6>, fp::Linear<5>, fp::Tanh, fp::Sigmoid, fp::Linear<6>, fp::GELU,
                             fp::ReLU, fp::Linear<5>, fp::LeakyReLU<-0.5f>, fp::Linear<4>, fp::LeakyReLU<0.0f>,
                             fp::Linear<3>>;
  static_assert(std::is_same_v<Net::stage<0>::epilogue, k::Epilogue<k::Tanh, k::Sigmoid>>);
  static_assert(std::is_same_v<Net::stage<1>::epilogue, k::Epilogue<k::Gelu, k::Relu>>);
  // A slope <= 0 cannot tell the sign of x from y: the input is saved.
  static_assert(!k::LeakyRelu<-0.5f>::from_output && !k::LeakyRelu<0.0f>::from_output);
  static_assert(Net::stage_plan[2].saves_z && Net::stage_plan[3].saves_z);
  gradcheck::check_threads<Net>(3, 33);
}

TEST_CASE("stand-alone activation stages after Flatten (a chain, then GELU alone)") {
  using Net = fp::Sequential<fp::Input<2, 3, 4>, fp::Conv2d<3, 2>, fp::Flatten, fp::ReLU, fp::Tanh, fp::Linear<5>,
                             fp::Flatten, fp::GELU, fp::Linear<3>>;
  static_assert(Net::stage_count == 7);
  static_assert(Net::stage<1>::kind == fp::LayerKind::reshape);
  static_assert(Net::stage<2>::kind == fp::LayerKind::pointwise);
  static_assert(std::is_same_v<Net::stage<2>::epilogue, k::Epilogue<k::Relu, k::Tanh>>);
  static_assert(Net::stage<2>::first == 3 && Net::stage<2>::last == 4);
  static_assert(Net::stage<5>::kind == fp::LayerKind::pointwise);
  static_assert(std::is_same_v<Net::stage<5>::epilogue, k::Epilogue<k::Gelu>>);
  static_assert(!Net::stage_plan[2].saves_z && !Net::stage_plan[5].saves_z);  // the stage input is kept
  static_assert(Net::stage<0>::epilogue::empty);
  gradcheck::check_threads<Net>(3, 34, fp::SoftmaxCrossEntropy{});
}

TEST_CASE("activations first in the network") {
  SUBCASE("Tanh first, then Linear") {
    using Net = fp::Sequential<fp::Input<6>, fp::Tanh, fp::Linear<4>, fp::ReLU, fp::Linear<3>>;
    static_assert(Net::stage<0>::kind == fp::LayerKind::pointwise);
    gradcheck::check_threads<Net>(3, 35);
  }
  SUBCASE("Sigmoid, GELU first, then Conv2d") {
    using Net = fp::Sequential<fp::Input<2, 4, 5>, fp::Sigmoid, fp::GELU, fp::Conv2d<3, 3>, fp::Flatten,
                               fp::Linear<3>>;
    static_assert(std::is_same_v<Net::stage<0>::epilogue, k::Epilogue<k::Sigmoid, k::Gelu>>);
    gradcheck::check_threads<Net>(3, 36);
  }
}

TEST_CASE("a single Linear, and Linear on a (C,1,1) input") {
  gradcheck::check_threads<fp::Sequential<fp::Input<5>, fp::Linear<3>>>(2, 37);
  gradcheck::check_threads<fp::Sequential<fp::Input<4, 1, 1>, fp::Linear<7>, fp::Sigmoid, fp::Linear<2>>,
                           fp::SoftmaxCrossEntropy>(5, 38);
}

TEST_CASE("Dropout in training mode: after a conv, after Linear, followed by activations") {
  using Net = fp::Sequential<fp::Input<3, 6, 5>, fp::Conv2d<4, 3>, fp::Dropout<0.4f>, fp::ReLU, fp::Flatten,
                             fp::Linear<6>, fp::Dropout<0.5f>, fp::Tanh, fp::Linear<3>>;
  static_assert(Net::stage<1>::kind == fp::LayerKind::anchor);  // Dropout takes no epilogue
  static_assert(Net::stage<2>::kind == fp::LayerKind::pointwise);
  gradcheck::check_threads<Net>(3, 41);
  gradcheck::check_threads<Net, fp::SoftmaxCrossEntropy>(4, 42);
}

TEST_CASE("Dropout first: the weight gradient of the Linear after it sees the dropped inputs") {
  using Net = fp::Sequential<fp::Input<10>, fp::Dropout<0.3f>, fp::Linear<4>, fp::GELU, fp::Linear<2>>;
  gradcheck::check_threads<Net>(3, 43);
}

// Input<N>, Dropout<P>, Linear<1> with MSE and batch 1: dL/db = 2 (y - t) and dL/dW_j = dL/db * x_j * m_j
// where m_j is 0 or 1/(1-P). So the gradients expose the training-mode forward exactly.
TEST_CASE("Dropout drops about P, scales the rest by 1/(1-P), changes its mask each step, and is the "
          "identity in evaluation") {
  constexpr int n = 2000;
  using Net = fp::Sequential<fp::Input<n>, fp::Dropout<0.3f>, fp::Linear<1>>;
  fp::Model<Net, fp::Host, double> model{fp::seed(44), fp::Host{2}};
  const std::vector<double> x = gradcheck::uniform_values(n, 44, 1, 0.5, 1.5);  // never zero
  const std::vector<double> t{0.25};
  const double scale = double(1.0f / (1.0f - 0.3f));

  auto masks = [&] {
    const double loss = model.compute_gradients(std::span<const double>(x), std::span<const double>(t), fp::MSE{});
    const double db = model.grad(1)[0];
    const auto dw = model.grad(0);
    const auto w = model.param(0);
    const double y = t[0] + db / 2;
    CHECK(std::abs(loss - (y - t[0]) * (y - t[0])) <= 1e-12);
    std::vector<bool> kept(n);
    double forward = model.param(1)[0];
    int zeros = 0;
    bool scaled = true;
    for (int j = 0; j < n; ++j) {
      kept[j] = dw[j] != 0.0;
      zeros += !kept[j];
      if (kept[j]) {
        scaled = scaled && std::abs(dw[j] - db * x[j] * scale) <= 1e-12 * std::abs(db * x[j] * scale);
        forward += w[j] * x[j] * scale;
      }
    }
    CHECK(scaled);
    // The forward pass used the same mask as backward.
    CHECK(std::abs(forward - y) <= 1e-10);
    // Binomial(2000, 0.3): mean 600, standard deviation 20.5; 5 sigma.
    CHECK(zeros > 600 - 103);
    CHECK(zeros < 600 + 103);
    return kept;
  };
  const std::vector<bool> first = masks();
  CHECK(masks() == first);  // same step: same mask

  fp::Sgd frozen{{.lr = 0.0f}};
  model.train_step(std::span<const double>(x), std::span<const double>(t), fp::MSE{}, frozen);
  const std::vector<bool> second = masks();
  CHECK(second != first);

  // Evaluation: no dropout at all.
  const auto out = model.predict(std::span<const double>(x));
  REQUIRE(out.size() == 1);
  double expected = model.param(1)[0];
  for (int j = 0; j < n; ++j) expected += model.param(0)[j] * x[j];
  CHECK(std::abs(out[0] - expected) <= 1e-12);
}

TEST_CASE("Dropout<0> keeps everything") {
  using Net = fp::Sequential<fp::Input<6>, fp::Linear<5>, fp::Dropout<0.0f>, fp::Sigmoid, fp::Linear<2>>;
  gradcheck::check_threads<Net>(3, 45);
}
