// tests include/fusedp/optim/schedule.hpp: StepLR and CosineWarmup at chosen steps, and their argument
// checks.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/optim/schedule.hpp>

#include <cmath>

namespace fp = fusedp;

TEST_CASE("StepLR: lr * gamma^(step / step_size)") {
  const fp::StepLR s{0.5f, 3, 0.5f};
  CHECK(s(0) == 0.5f);
  CHECK(s(1) == 0.5f);
  CHECK(s(2) == 0.5f);
  CHECK(s(3) == 0.25f);
  CHECK(s(5) == 0.25f);
  CHECK(s(6) == 0.125f);
  CHECK(s(30) == doctest::Approx(0.5 / 1024).epsilon(1e-6));
  const fp::StepLR d{0.1f, 30};  // gamma defaults to 0.1 as in PyTorch
  CHECK(d(29) == doctest::Approx(0.1).epsilon(1e-6));
  CHECK(d(30) == doctest::Approx(0.01).epsilon(1e-6));
  CHECK(d(65) == doctest::Approx(0.001).epsilon(1e-5));
}

TEST_CASE("StepLR with step_size 0 throws") {
  const fp::StepLR s{0.1f, 0};
  CHECK_THROWS_AS((void)s(0), fp::InvalidArgument);
}

TEST_CASE("CosineWarmup: linear warm-up, cosine decay to min_lr, then min_lr") {
  const fp::CosineWarmup s{1.0f, 2, 10, 0.1f};
  // Warm-up: base * (step + 1) / warmup.
  CHECK(s(0) == doctest::Approx(0.5).epsilon(1e-7));
  CHECK(s(1) == doctest::Approx(1.0).epsilon(1e-7));
  // Decay over steps [2, 10): progress (step - 2) / 8.
  CHECK(s(2) == doctest::Approx(1.0).epsilon(1e-7));
  CHECK(s(4) == doctest::Approx(0.1 + 0.45 * (1 + std::cos(M_PI * 0.25))).epsilon(1e-6));
  CHECK(s(6) == doctest::Approx(0.55).epsilon(1e-6));
  CHECK(s(9) == doctest::Approx(0.1 + 0.45 * (1 + std::cos(M_PI * 7 / 8))).epsilon(1e-6));
  CHECK(s(10) == 0.1f);
  CHECK(s(1000) == 0.1f);
  // Monotone non-increasing after the warm-up.
  for (std::uint64_t t = 2; t < 12; ++t) CHECK(s(t + 1) <= s(t));
}

TEST_CASE("CosineWarmup without warm-up and with min_lr 0") {
  const fp::CosineWarmup s{0.2f, 0, 4};
  CHECK(s(0) == doctest::Approx(0.2).epsilon(1e-7));
  CHECK(s(2) == doctest::Approx(0.1).epsilon(1e-6));
  CHECK(s(4) == 0.0f);
}

TEST_CASE("CosineWarmup needs total > warmup") {
  CHECK_THROWS_AS((void)fp::CosineWarmup({1.0f, 5, 5})(0), fp::InvalidArgument);
  CHECK_THROWS_AS((void)fp::CosineWarmup({1.0f, 6, 5})(3), fp::InvalidArgument);
}
