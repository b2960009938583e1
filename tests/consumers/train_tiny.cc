// The program every consumer project builds: trains a small network on a fixed synthetic batch
// for a few steps and exits non-zero unless the loss falls. Only <fusedp/fusedp.hpp> is included,
// as a user would.
#include <fusedp/fusedp.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <span>

namespace fp = fusedp;

using Tiny = fp::Sequential<fp::Input<4>, fp::Linear<16>, fp::ReLU, fp::Linear<3>>;
static_assert(Tiny::param_count == 4 * 16 + 16 + 16 * 3 + 3);

int main() {
  constexpr std::size_t batch = 12;
  std::array<float, batch * 4> x{};  // (batch, 4)
  std::array<std::int32_t, batch> y{};
  for (std::size_t i = 0; i < batch; ++i) {
    y[i] = std::int32_t(i % 3);
    for (std::size_t f = 0; f < 4; ++f) {
      // class c lights feature c, plus a fixed pattern of noise
      x[i * 4 + f] = (f == std::size_t(y[i]) ? 1.0f : 0.0f) + 0.1f * float((i * 7 + f * 3) % 5) - 0.2f;
    }
  }

  fp::Model<Tiny, fp::Host> model{fp::seed(7)};
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  float first = 0.0f;
  float last = 0.0f;
  for (int step = 0; step < 20; ++step) {
    last = model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{},
                            opt);
    if (step == 0) first = last;
  }
  const bool fell = last < 0.5f * first;
  std::printf("fusedp %s: loss %.4f -> %.4f (%s)\n", FUSEDP_VERSION_STRING, double(first), double(last),
              fell ? "falls" : "DOES NOT FALL");
  return fell ? 0 : 1;
}
