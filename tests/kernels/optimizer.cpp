// kernels/optimizer.hpp's `identical`: whether two steps hold the same numbers bit for bit. A Cuda model
// skips rewriting its device copy of the step when the next one is identical, so a false "identical"
// would train with stale numbers: every field must count, and +0 and -0 must differ.
#include <doctest/doctest.h>

#include <fusedp/kernels/optimizer.hpp>

#include <limits>

namespace fk = fusedp::kernels;

TEST_CASE("identical SgdStep: equal when every field is, different when any one differs") {
  const fk::SgdStep<float> a{0.05f, 0.9f, 0.0f, 5e-4f, true, false, true};
  CHECK(fk::identical(a, a));
  auto differs = [&](auto change) {
    fk::SgdStep<float> b = a;
    change(b);
    return !fk::identical(a, b) && !fk::identical(b, a);
  };
  CHECK(differs([](auto& s) { s.lr = 0.04f; }));
  CHECK(differs([](auto& s) { s.momentum = 0.8f; }));
  CHECK(differs([](auto& s) { s.dampening = 0.1f; }));
  CHECK(differs([](auto& s) { s.weight_decay = 0.0f; }));
  CHECK(differs([](auto& s) { s.nesterov = false; }));
  CHECK(differs([](auto& s) { s.first = true; }));
  CHECK(differs([](auto& s) { s.decay_all = false; }));
  // Bits, not values: -0 is not +0; a NaN is identical to the same NaN.
  fk::SgdStep<float> zero = a, minus_zero = a;
  zero.dampening = 0.0f;
  minus_zero.dampening = -0.0f;
  CHECK_FALSE(fk::identical(zero, minus_zero));
  fk::SgdStep<float> nan = a;
  nan.lr = std::numeric_limits<float>::quiet_NaN();
  CHECK(fk::identical(nan, nan));
}

TEST_CASE("identical AdamStep and AnyStep: every field, and the kind") {
  const fk::AdamStep<float> a{1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, true, 0.1f, 0.001f, false};
  CHECK(fk::identical(a, a));
  auto differs = [&](auto change) {
    fk::AdamStep<float> b = a;
    change(b);
    return !fk::identical(a, b);
  };
  CHECK(differs([](auto& s) { s.lr = 2e-3f; }));
  CHECK(differs([](auto& s) { s.beta1 = 0.8f; }));
  CHECK(differs([](auto& s) { s.beta2 = 0.99f; }));
  CHECK(differs([](auto& s) { s.eps = 1e-7f; }));
  CHECK(differs([](auto& s) { s.weight_decay = 0.0f; }));
  CHECK(differs([](auto& s) { s.decoupled = false; }));
  CHECK(differs([](auto& s) { s.bias1 = 0.19f; }));  // the next step's bias corrections
  CHECK(differs([](auto& s) { s.bias2 = 0.002f; }));
  CHECK(differs([](auto& s) { s.decay_all = true; }));

  using Any = fk::AnyStep<float>;
  const fk::SgdStep<float> sgd{0.05f, 0.9f, 0.0f, 0.0f, false, false, true};
  CHECK(fk::identical(Any::of(a), Any::of(a)));
  CHECK(fk::identical(Any::of(sgd), Any::of(sgd)));
  CHECK_FALSE(fk::identical(Any::of(a), Any::of(sgd)));
  fk::AdamStep<float> next = a;
  next.bias1 = 0.19f;
  CHECK_FALSE(fk::identical(Any::of(a), Any::of(next)));
}
