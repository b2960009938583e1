// tests include/fusedp/optim/sgd.hpp (and kernels/optimizer.hpp's SgdStep): three steps on three
// parameters against values computed by hand with torch.optim.SGD's rules. Every option and value is a
// dyadic fraction, so the expected values are exact in double and checked with ==.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/core/rng.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/loss/mse.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/sequential.hpp>
#include <fusedp/optim/sgd.hpp>

#include <array>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

namespace fp = fusedp;

namespace {

using Triple = std::array<double, 3>;
constexpr Triple p0{1.0, -2.0, 0.5};
constexpr std::array<Triple, 3> gradients{{{1.0, -2.0, 0.5}, {0.5, 1.0, -1.0}, {-0.25, 0.5, 2.0}}};

struct Expected {
  std::array<Triple, 3> params;  // after steps 1, 2, 3
  std::array<Triple, 3> buffer;  // momentum buffer after steps 1, 2, 3 (unused without momentum)
};

void run(const fp::Sgd& opt, const Expected& e, bool has_momentum, int threads = 1) {
  const fp::Host host{threads};
  Triple p = p0, state{0, 0, 0};
  for (std::uint64_t t = 1; t <= 3; ++t) {
    CAPTURE(t);
    opt.step(host, p.data(), gradients[t - 1].data(), state.data(), 3, t);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(p[std::size_t(i)] == e.params[t - 1][std::size_t(i)]);
      if (has_momentum) CHECK(state[std::size_t(i)] == e.buffer[t - 1][std::size_t(i)]);
    }
  }
}

}  // namespace

TEST_CASE("plain SGD: p -= lr * g") {
  // lr 0.5: p0 = 1 -> 1 - 0.5*1 = 0.5 -> 0.5 - 0.5*0.5 = 0.25 -> 0.25 + 0.5*0.25 = 0.375
  run(fp::Sgd{{.lr = 0.5f}},
      {{{{0.5, -1.0, 0.25}, {0.25, -1.5, 0.75}, {0.375, -1.75, -0.25}}}, {}}, false);
}

TEST_CASE("SGD with momentum: the first step's buffer is the gradient itself (as PyTorch)") {
  // momentum 0.5, lr 0.5, p0 = 1: buf = 1, p = 0.5; buf = 0.5*1 + 0.5 = 1, p = 0;
  // buf = 0.5*1 - 0.25 = 0.25, p = -0.125
  run(fp::Sgd{{.lr = 0.5f, .momentum = 0.5f}},
      {{{{0.5, -1.0, 0.25}, {0.0, -1.0, 0.625}, {-0.125, -1.25, -0.1875}}},
       {{{1.0, -2.0, 0.5}, {1.0, 0.0, -0.75}, {0.25, 0.5, 1.625}}}},
      true);
}

TEST_CASE("SGD with momentum and dampening: dampening spares the first step") {
  // momentum 0.75, dampening 0.25: buf1 = g1; buf = 0.75 buf + 0.75 g afterwards.
  run(fp::Sgd{{.lr = 0.5f, .momentum = 0.75f, .dampening = 0.25f}},
      {{{{0.5, -1.0, 0.25}, {-0.0625, -0.625, 0.4375}, {-0.390625, -0.53125, -0.171875}}},
       {{{1.0, -2.0, 0.5}, {1.125, -0.75, -0.375}, {0.65625, -0.1875, 1.21875}}}},
      true);
}

TEST_CASE("SGD with Nesterov momentum: p -= lr * (g + momentum * buf)") {
  // lr 0.25, momentum 0.5, p0 = 1: buf = 1, p = 1 - 0.25 * (1 + 0.5) = 0.625
  run(fp::Sgd{{.lr = 0.25f, .momentum = 0.5f, .nesterov = true}},
      {{{{0.625, -1.25, 0.3125}, {0.375, -1.5, 0.65625}, {0.40625, -1.6875, -0.046875}}},
       {{{1.0, -2.0, 0.5}, {1.0, 0.0, -0.75}, {0.25, 0.5, 1.625}}}},
      true);
}

TEST_CASE("SGD with weight decay: g += weight_decay * p") {
  // lr 0.5, weight decay 0.125, p0 = 1: p = 1 - 0.5 * (1 + 0.125) = 0.4375
  run(fp::Sgd{{.lr = 0.5f, .weight_decay = 0.125f}},
      {{{{0.4375, -0.875, 0.21875},
         {0.16015625, -1.3203125, 0.705078125},
         {0.275146484375, -1.48779296875, -0.3389892578125}}},
       {}},
      false);
}

TEST_CASE("SGD with weight decay, momentum and Nesterov together, on 1 and 3 threads") {
  // The decayed gradient enters the buffer: buf1 = 1 + 0.25*1 = 1.25.
  const Expected e{{{{0.53125, -1.0625, 0.265625},
                     {0.2158203125, -1.181640625, 0.57666015625},
                     {0.210723876953125, -1.22613525390625, -0.1885833740234375}}},
                   {{{1.25, -2.5, 0.625},
                     {1.2578125, -0.515625, -0.62109375},
                     {0.432861328125, -0.05322265625, 1.8336181640625}}}};
  const fp::Sgd opt{{.lr = 0.25f, .momentum = 0.5f, .weight_decay = 0.25f, .nesterov = true}};
  run(opt, e, true, 1);
  run(opt, e, true, 3);
}

TEST_CASE("SGD in float gives the same dyadic values") {
  const fp::Host host{1};
  const fp::Sgd opt{{.lr = 0.5f, .momentum = 0.5f}};
  std::array<float, 3> p{1.0f, -2.0f, 0.5f}, buf{};
  for (std::uint64_t t = 1; t <= 3; ++t) {
    const std::array<float, 3> g{float(gradients[t - 1][0]), float(gradients[t - 1][1]), float(gradients[t - 1][2])};
    opt.step(host, p.data(), g.data(), buf.data(), 3, t);
  }
  CHECK(p[0] == -0.125f);
  CHECK(p[1] == -1.25f);
  CHECK(p[2] == -0.1875f);
}

TEST_CASE("SGD over many parameters is the same on 1, 2 and 4 threads") {
  constexpr std::size_t n = 10'007;
  std::vector<double> g(n), p1(n), s1(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = 2.0 * fp::rng::uniform(7, 1, i) - 1.0;
    p1[i] = 2.0 * fp::rng::uniform(7, 2, i) - 1.0;
  }
  std::vector<double> p2 = p1, s2 = s1, p4 = p1, s4 = s1;
  const fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f}};
  for (std::uint64_t t = 1; t <= 3; ++t) {
    opt.step(fp::Host{1}, p1.data(), g.data(), s1.data(), n, t);
    opt.step(fp::Host{2}, p2.data(), g.data(), s2.data(), n, t);
    opt.step(fp::Host{4}, p4.data(), g.data(), s4.data(), n, t);
  }
  CHECK(p1 == p2);
  CHECK(p1 == p4);
  CHECK(s1 == s4);
}

TEST_CASE("invalid SGD options throw InvalidArgument") {
  const double inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(fp::Sgd{{.lr = -0.1f}}.validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(fp::Sgd{{.lr = float(inf)}}.validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(fp::Sgd{{.lr = float(nan)}}.validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(fp::Sgd{{.momentum = -0.5f}}.validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(fp::Sgd{{.weight_decay = -1e-4f}}.validate(), fp::InvalidArgument);
  CHECK_THROWS_AS(fp::Sgd{{.nesterov = true}}.validate(), fp::InvalidArgument);  // no momentum
  CHECK_THROWS_AS((fp::Sgd{{.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}}.validate()),
                  fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(fp::Sgd{{.lr = -2.0f}}.validate(), doctest::Contains("lr"), fp::InvalidArgument);
  CHECK_NOTHROW(fp::Sgd{}.validate());
  CHECK_NOTHROW(fp::Sgd{{.lr = 0.0f}}.validate());
  CHECK_NOTHROW((fp::Sgd{{.lr = 0.1f, .momentum = 0.9f, .nesterov = true}}.validate()));
  CHECK(fp::Sgd::state_slots == 1);
  CHECK(fp::Sgd{}.options.lr == 0.01f);
  CHECK(fp::Sgd{}.options.momentum == 0.0f);
}

// Model::train_step = compute_gradients + one SGD step over the flat buffer, the momentum buffer kept
// across steps and started from the gradient on the model's first step.
TEST_CASE("Model::train_step applies SGD with momentum exactly as the rule over the flat buffer") {
  using Net = fp::Sequential<fp::Input<4>, fp::Linear<5>, fp::Tanh, fp::Linear<3>>;
  using Model = fp::Model<Net, fp::Host, double>;
  Model trained{fp::seed(3), fp::Host{2}};
  Model reference{fp::seed(3), fp::Host{2}};
  std::vector<double> x(8 * 4), t(8 * 3);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2.0 * fp::rng::uniform(5, 1, i) - 1.0;
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = 2.0 * fp::rng::uniform(5, 2, i) - 1.0;
  fp::Sgd opt{{.lr = 0.25f, .momentum = 0.5f, .dampening = 0.25f, .weight_decay = 0.125f}};
  std::vector<double> buf(Net::param_storage, 0.0);
  for (int step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const double loss_ref =
        reference.compute_gradients(std::span<const double>(x), std::span<const double>(t), fp::MSE{});
    const double loss = trained.train_step(std::span<const double>(x), std::span<const double>(t), fp::MSE{}, opt);
    CHECK(loss == loss_ref);
    const auto p = reference.params();
    const auto g = reference.grads();
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double d = g[i] + 0.125 * p[i];
      buf[i] = step == 1 ? d : 0.5 * buf[i] + 0.75 * d;
      p[i] -= 0.25 * buf[i];
    }
    bool same = true;
    for (std::size_t i = 0; i < p.size(); ++i) same = same && trained.params()[i] == p[i];
    CHECK(same);
    CHECK(trained.steps() == std::uint64_t(step));
    REQUIRE(trained.optimizer_state().size() == Net::param_storage);
    bool same_state = true;
    for (std::size_t i = 0; i < buf.size(); ++i) same_state = same_state && trained.optimizer_state()[i] == buf[i];
    CHECK(same_state);
  }
  // Padding in the flat buffer stays zero: it has zero gradient and zero weight.
  for (std::size_t i = Net::param_layout[0].size; i < Net::param_layout[1].offset; ++i)
    CHECK(trained.params()[i] == 0.0);
}

TEST_CASE("the Host's range loop (flags fixed per range, vectorized) gives the per-element update's bits") {
  // Every combination of the four branches, on lengths around a vector's width and fresh random data.
  for (int combo = 0; combo < 16; ++combo)
    for (std::size_t n : {1u, 15u, 16u, 17u, 1000u}) {
      fusedp::kernels::SgdStep<float> op{0.05f, (combo & 1) ? 0.9f : 0.0f, (combo & 8) ? 0.0f : 0.25f,
                                         (combo & 2) ? 1e-3f : 0.0f, (combo & 4) != 0 && (combo & 1) && (combo & 8),
                                         (combo & 8) != 0};
      CAPTURE(combo);
      CAPTURE(n);
      std::vector<float> p(n), g(n), b(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = 2 * float(fusedp::rng::uniform(11, std::uint64_t(combo), i)) - 1;
        g[i] = 2 * float(fusedp::rng::uniform(12, std::uint64_t(combo), i)) - 1;
        b[i] = 2 * float(fusedp::rng::uniform(13, std::uint64_t(combo), i)) - 1;
      }
      std::vector<float> p_ref = p, b_ref = b;
      for (std::size_t i = 0; i < n; ++i) op(p_ref[i], g[i], b_ref[i]);
      fusedp::kernels::host::sgd_range(op, p.data(), g.data(), b.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(std::bit_cast<std::uint32_t>(p[i]) == std::bit_cast<std::uint32_t>(p_ref[i]));
        CHECK(std::bit_cast<std::uint32_t>(b[i]) == std::bit_cast<std::uint32_t>(b_ref[i]));
      }
    }
}
