// Trains a tiny network for a few steps on a fixed batch; fails unless the loss falls.
#include <fusedp/fusedp.hpp>

#include <array>
#include <cstdio>
#include <span>

namespace fp = fusedp;

int main() {
  using Net = fp::Sequential<fp::Input<2>, fp::Linear<8>, fp::Tanh, fp::Linear<1>>;
  const std::array<float, 8> x{0, 0, 0, 1, 1, 0, 1, 1};  // (4, 2)
  const std::array<float, 4> y{0, 1, 1, 0};               // XOR
  fp::Model<Net, fp::Host> model{fp::seed(1)};
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  float first = 0.0f;
  float last = 0.0f;
  for (int step = 0; step < 50; ++step) {
    last = model.train_step(std::span<const float>(x), std::span<const float>(y), fp::MSE{}, opt);
    if (step == 0) first = last;
  }
  std::printf("fusedp %s from Conan: MSE %.4f -> %.4f\n", FUSEDP_VERSION_STRING, double(first), double(last));
  return last < first ? 0 : 1;
}
