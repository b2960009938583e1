// tests include/fusedp/optim/adam.hpp (and kernels/optimizer.hpp's AdamStep): Adam with bias
// correction, Adam with L2 weight decay and AdamW's decoupled decay, three steps on three parameters
// against values computed with torch.optim.Adam/AdamW's rules in 40-digit arithmetic (mpmath).
// lr 0.125, betas (0.5, 0.75), eps 2^-20 are exact in float. Tolerance: 1e-15 relative (a few ulps).
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/core/rng.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/loss/mse.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/sequential.hpp>
#include <fusedp/optim/adam.hpp>
#include <fusedp/optim/sgd.hpp>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace fp = fusedp;

namespace {

using Triple = std::array<double, 3>;
constexpr Triple p0{1.0, -2.0, 0.5};
constexpr std::array<Triple, 3> gradients{{{1.0, -2.0, 0.5}, {0.5, 1.0, -1.0}, {-0.25, 0.5, 2.0}}};
constexpr float eps = 1.0f / 1048576.0f;  // 2^-20

// Adam and AdamW derive from a base that holds `options`, so `fp::Adam{{.lr = ...}}` (the form Sgd takes)
// does not compile; the test sets the options after construction (see the last test case).
template <class Opt>
Opt with_options(typename Opt::Options o) {
  Opt opt;
  opt.options = o;
  return opt;
}

bool close(double a, double b, double rel = 1e-15) { return std::abs(a - b) <= rel * std::abs(b); }

template <class Opt>
void run(const Opt& opt, const std::array<Triple, 3>& expected, const std::array<Triple, 3>* first_moment = nullptr,
         const std::array<Triple, 3>* second_moment = nullptr, int threads = 1) {
  const fp::Host host{threads};
  Triple p = p0;
  std::array<double, 6> state{};  // m then v
  for (std::uint64_t t = 1; t <= 3; ++t) {
    CAPTURE(t);
    opt.step(host, p.data(), gradients[t - 1].data(), state.data(), 3, t);
    for (std::size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(close(p[i], expected[t - 1][i]));
      if (first_moment) CHECK(close(state[i], (*first_moment)[t - 1][i]));
      if (second_moment) CHECK(close(state[3 + i], (*second_moment)[t - 1][i]));
    }
  }
}

}  // namespace

TEST_CASE("Adam: the first steps with a constant gradient move by lr / (1 + eps / |g|)") {
  // With bias correction, m_hat = g and v_hat = g^2 while g is constant: each step is lr g/(|g| + eps).
  const auto opt = with_options<fp::Adam>({.lr = 0.125f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = eps});
  const fp::Host host{1};
  std::array<double, 2> p{1.0, 1.0};
  const std::array<double, 2> g{4.0, -0.5};
  std::array<double, 4> state{};
  for (std::uint64_t t = 1; t <= 3; ++t) opt.step(host, p.data(), g.data(), state.data(), 2, t);
  CHECK(close(p[0], 1.0 - 3 * 0.125 * 4.0 / (4.0 + double(eps)), 1e-14));
  CHECK(close(p[1], 1.0 + 3 * 0.125 * 0.5 / (0.5 + double(eps)), 1e-14));
}

TEST_CASE("Adam with bias correction") {
  const std::array<Triple, 3> params{{{0.87500011920917586, -1.8750000596046164, 0.37500023841812436},
                                      {0.76476062032548027, -1.8750000596046164, 0.45087227291316267},
                                      {0.73463469049915009, -1.9051260136657436, 0.37105741703789812}}};
  const std::array<Triple, 3> m{{{0.5, -1.0, 0.25}, {0.5, 0.0, -0.375}, {0.125, 0.25, 0.8125}}};
  const std::array<Triple, 3> v{{{0.25, 1.0, 0.0625}, {0.25, 1.0, 0.296875}, {0.203125, 0.8125, 1.22265625}}};
  const auto opt = with_options<fp::Adam>({.lr = 0.125f, .beta1 = 0.5f, .beta2 = 0.75f, .eps = eps});
  run(opt, params, &m, &v);
  run(opt, params, &m, &v, 2);
}

TEST_CASE("Adam with L2 weight decay adds weight_decay * p to the gradient") {
  const std::array<Triple, 3> params{{{0.87500009536735888, -1.8750000476836976, 0.37500019073457224},
                                      {0.76099918515124144, -1.8394574512136934, 0.43700823300735955},
                                      {0.70199772123701855, -1.8215002666157344, 0.35137279564940938}}};
  // Step 1: g + 0.25 p = (1.25, -2.5, 0.625), m = 0.5 of that.
  const std::array<Triple, 3> m{{{0.625, -1.25, 0.3125},
                                 {0.67187501192091986, -0.3593750059604622, -0.29687497615817847},
                                 {0.30606240410436511, -0.15961968438194278, 0.90618854104683071}}};
  run(with_options<fp::Adam>({.lr = 0.125f, .beta1 = 0.5f, .beta2 = 0.75f, .eps = eps, .weight_decay = 0.25f}),
      params, &m);
}

TEST_CASE("AdamW decays the weights, not the gradient") {
  // Step 1: p = 1 * (1 - 0.125 * 0.25) = 0.96875, then the Adam step of 0.125 / (1 + eps).
  const std::array<Triple, 3> params{{{0.84375011920917586, -1.8125000596046164, 0.35937523841812436},
                                      {0.70714342910019353, -1.7558594327419721, 0.42401679671259628},
                                      {0.6549192671144823, -1.7311147795299127, 0.3309514159400631}}};
  // The moments are those of plain Adam: the decay never enters them.
  const std::array<Triple, 3> m{{{0.5, -1.0, 0.25}, {0.5, 0.0, -0.375}, {0.125, 0.25, 0.8125}}};
  const std::array<Triple, 3> v{{{0.25, 1.0, 0.0625}, {0.25, 1.0, 0.296875}, {0.203125, 0.8125, 1.22265625}}};
  run(with_options<fp::AdamW>({.lr = 0.125f, .beta1 = 0.5f, .beta2 = 0.75f, .eps = eps, .weight_decay = 0.25f}),
      params, &m, &v);
}

TEST_CASE("defaults are PyTorch's") {
  const fp::Adam adam;
  CHECK(adam.options.lr == 0.001f);
  CHECK(adam.options.beta1 == 0.9f);
  CHECK(adam.options.beta2 == 0.999f);
  CHECK(adam.options.eps == 1e-8f);
  CHECK(adam.options.weight_decay == 0.0f);
  const fp::AdamW adamw;
  CHECK(adamw.options.weight_decay == 0.01f);
  CHECK(fp::Adam::state_slots == 2);
  CHECK(std::string(fp::Adam::name) == "Adam");
  CHECK(std::string(fp::AdamW::name) == "AdamW");
}

TEST_CASE("invalid Adam and AdamW options throw InvalidArgument") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(with_options<fp::Adam>({.lr = -1e-3f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.lr = nan}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.beta1 = 1.0f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.beta1 = -0.1f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.beta2 = 1.0f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.beta2 = 1.5f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.eps = 0.0f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::Adam>({.weight_decay = -0.1f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::AdamW>({.weight_decay = -0.1f}).validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(with_options<fp::AdamW>({.beta1 = nan}).validate(), fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(with_options<fp::AdamW>({.eps = -1.0f}).validate(), doctest::Contains("AdamW"),
                       fp::InvalidArgument);
  CHECK_NOTHROW(fp::Adam{}.validate());
  CHECK_NOTHROW(fp::AdamW{}.validate());
  CHECK_NOTHROW(with_options<fp::Adam>({.beta1 = 0.0f}).validate());
}

TEST_CASE("Model: train_step counts Adam's steps from 1, and a new optimizer type starts fresh state") {
  using Net = fp::Sequential<fp::Input<3>, fp::Linear<2>>;
  using Model = fp::Model<Net, fp::Host, double>;
  Model model{fp::seed(9), fp::Host{1}};
  std::vector<double> x(4 * 3), t(4 * 2);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2.0 * fp::rng::uniform(9, 1, i) - 1.0;
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = 2.0 * fp::rng::uniform(9, 2, i) - 1.0;
  const std::span<const double> xs(x), ts(t);
  CHECK(model.optimizer_state().empty());

  // First Adam step: every parameter with a non-zero gradient moves by lr g / (|g| + eps).
  auto expect_first_adam_step = [&](auto opt) {
    // A second model with the current parameters gives the gradient of this step.
    const std::vector<double> before(model.params().begin(), model.params().end());
    Model probe{fp::seed(9), fp::Host{1}};
    std::copy(before.begin(), before.end(), probe.params().begin());
    probe.compute_gradients(xs, ts, fp::MSE{});
    model.train_step(xs, ts, fp::MSE{}, opt);
    REQUIRE(model.optimizer_state().size() == 2 * Net::param_storage);
    for (const auto& pt : Net::param_layout)
      for (std::size_t e = 0; e < pt.size; ++e) {
        const double g = probe.grads()[pt.offset + e];
        const double want = before[pt.offset + e] - 0.125 * g / (std::abs(g) + double(eps));
        CHECK(close(model.params()[pt.offset + e], want, 1e-14));
      }
  };
  expect_first_adam_step(with_options<fp::Adam>({.lr = 0.125f, .eps = eps}));
  // Two SGD steps, then Adam again: its moments start from zero and t from 1.
  fp::Sgd sgd{{.lr = 0.01f, .momentum = 0.9f}};
  model.train_step(xs, ts, fp::MSE{}, sgd);
  CHECK(model.optimizer_state().size() == Net::param_storage);
  model.train_step(xs, ts, fp::MSE{}, sgd);
  expect_first_adam_step(with_options<fp::Adam>({.lr = 0.125f, .eps = eps}));
  CHECK(model.steps() == 4);
}

template <class Opt>
concept takes_options_like_sgd = requires { Opt{{.lr = 0.5f}}; };

// fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}} is the documented form (DESIGN.md); Adam and AdamW
// should take their options the same way.
TEST_CASE("Adam and AdamW take their options in braces, like Sgd") {
  CHECK(takes_options_like_sgd<fp::Sgd>);
  CHECK(takes_options_like_sgd<fp::Adam>);
  CHECK(takes_options_like_sgd<fp::AdamW>);
}
