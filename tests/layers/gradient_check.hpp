#pragma once
// Finite-difference gradient checks in double, shared by tests/layers/gradients_*.cpp.
//
// A layer's gradient is checked inside a small network: every parameter gradient that
// Model::compute_gradients produces is compared with a central difference of the loss. The input
// gradient of a layer has no public API; it is covered by placing the layer after a Linear or Conv2d,
// whose weight gradient is then made from it.
//
// Tolerance (stated once for all files): with h = 1e-6 the truncation error of a central difference
// is h^2/6 |L'''| ~ 1e-13, and the rounding error about eps_double * |L| / h ~ 1e-10 for |L| ~ 1. A
// gradient passes when |numeric - analytic| <= 1e-6 * max(|numeric|, |analytic|) + 1e-8 (the absolute
// term only matters for gradients below 1e-2, where rounding dominates). Each tensor must also agree
// as a whole: ||numeric - analytic|| <= 1e-7 ||analytic|| + 1e-9.
#include <doctest/doctest.h>

#include <fusedp/core/rng.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/conv2d.hpp>
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/flatten.hpp>
#include <fusedp/layers/global_avg_pool.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>
#include <fusedp/layers/named.hpp>
#include <fusedp/layers/pooling.hpp>
#include <fusedp/loss/mse.hpp>
#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/net/model.hpp>
#include <fusedp/net/residual.hpp>
#include <fusedp/net/sequential.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <type_traits>
#include <vector>

namespace gradcheck {

inline constexpr double h = 1e-6;
inline constexpr double rel_tol = 1e-6;
inline constexpr double abs_tol = 1e-8;
inline constexpr double norm_rel_tol = 1e-7;
inline constexpr double norm_abs_tol = 1e-9;
// Every element of every tensor of the networks in these files is checked (the largest has 700). A
// tensor larger than this would be checked at an evenly spaced subset, first and last included.
inline constexpr std::size_t max_checked_per_tensor = 2048;

/// n values uniform in [lo, hi), a pure function of (seed, sub, i).
inline std::vector<double> uniform_values(std::size_t n, std::uint64_t seed, std::uint64_t sub, double lo = -1.0,
                                          double hi = 1.0) {
  std::vector<double> v(n);
  const std::uint64_t stream = fusedp::rng::stream(fusedp::rng::Purpose::test, sub);
  for (std::size_t i = 0; i < n; ++i) v[i] = lo + (hi - lo) * double(fusedp::rng::uniform(seed, stream, i));
  return v;
}

template <class Loss>
auto make_targets(std::size_t batch, std::size_t outputs, std::uint64_t seed) {
  if constexpr (std::is_same_v<Loss, fusedp::SoftmaxCrossEntropy>) {
    std::vector<std::int32_t> labels(batch);
    const auto u = uniform_values(batch, seed, 2, 0.0, 1.0);
    for (std::size_t n = 0; n < batch; ++n) labels[n] = std::int32_t(u[n] * double(outputs)) % std::int32_t(outputs);
    return labels;
  } else {
    return uniform_values(batch * outputs, seed, 3);
  }
}

/// What one check produced, for comparing runs (thread counts).
struct Result {
  double loss;
  std::vector<double> grads;  // the whole gradient twin, padding included
};

inline bool verbose() { return std::getenv("FUSEDP_GRADCHECK_VERBOSE") != nullptr; }

/// Checks every parameter gradient of Net (on Host with `threads` threads, in double) against central
/// differences, for a batch of `batch` random inputs in [-1, 1) and random targets.
template <class Net, class Loss = fusedp::MSE>
Result check(int threads, std::size_t batch, std::uint64_t seed, const Loss& loss = {}) {
  using Model = fusedp::Model<Net, fusedp::Host, double>;
  Model model{fusedp::seed(seed), fusedp::Host{threads}};
  const std::vector<double> x = uniform_values(batch * Model::input_size, seed, 1);
  const auto targets = make_targets<Loss>(batch, Model::output_size, seed);
  const std::span<const double> xs{x};
  const std::span<const typename Loss::template target<double>> ts{targets};

  Result r;
  r.loss = model.compute_gradients(xs, ts, loss);
  REQUIRE(std::isfinite(r.loss));
  r.grads.assign(model.grads().begin(), model.grads().end());

  // Padding between tensors in the gradient twin stays zero.
  {
    std::vector<bool> used(Net::param_storage, false);
    for (const auto& t : Net::param_layout)
      for (std::size_t e = 0; e < t.size; ++e) used[t.offset + e] = true;
    bool padding_zero = true;
    for (std::size_t i = 0; i < Net::param_storage; ++i) padding_zero = padding_zero && (used[i] || r.grads[i] == 0.0);
    CHECK(padding_zero);
  }

  for (std::size_t t = 0; t < Net::param_layout.size(); ++t) {
    const fusedp::ParamTensor& p = Net::param_layout[t];
    CAPTURE(t);
    CAPTURE(p.layer);
    const std::span<double> values = model.param(t);
    std::vector<std::size_t> elements;
    if (p.size <= max_checked_per_tensor) {
      for (std::size_t e = 0; e < p.size; ++e) elements.push_back(e);
    } else {
      for (std::size_t k = 0; k < max_checked_per_tensor; ++k)
        elements.push_back(k * (p.size - 1) / (max_checked_per_tensor - 1));
    }
    double diff_sq = 0, ana_sq = 0, worst_rel = 0, worst_abs = 0;
    for (const std::size_t e : elements) {
      const double original = values[e];
      values[e] = original + h;
      const double up = model.compute_gradients(xs, ts, loss);
      values[e] = original - h;
      const double down = model.compute_gradients(xs, ts, loss);
      values[e] = original;
      const double numeric = (up - down) / (2 * h);
      const double analytic = r.grads[p.offset + e];
      const double err = std::abs(numeric - analytic);
      const double scale = std::max(std::abs(numeric), std::abs(analytic));
      diff_sq += err * err;
      ana_sq += analytic * analytic;
      worst_abs = std::max(worst_abs, err);
      if (scale > 1e-3) worst_rel = std::max(worst_rel, err / scale);
      if (!(err <= rel_tol * scale + abs_tol)) {
        CAPTURE(e);
        CAPTURE(numeric);
        CAPTURE(analytic);
        CHECK(err <= rel_tol * scale + abs_tol);
      }
    }
    CHECK(std::sqrt(diff_sq) <= norm_rel_tol * std::sqrt(ana_sq) + norm_abs_tol);
    // A gradient that is zero everywhere would pass trivially; every tensor of these networks has
    // a non-zero gradient.
    CHECK(ana_sq > 0.0);
    if (verbose())
      std::printf("  tensor %zu (layer %zu, %zu values, %zu checked): |g| %.3e, max abs err %.3e, max rel err %.3e\n",
                  t, p.layer, p.size, elements.size(), std::sqrt(ana_sq), worst_abs, worst_rel);
  }
  // The analytic gradient was computed from the unperturbed parameters; computing it again gives
  // the same values (compute_gradients leaves parameters and dropout masks alone).
  const double again = model.compute_gradients(xs, ts, loss);
  CHECK(again == r.loss);
  bool same = true;
  for (std::size_t i = 0; i < r.grads.size(); ++i) same = same && model.grads()[i] == r.grads[i];
  CHECK(same);
  return r;
}

/// Runs check() with 1 and 2 threads and compares the two: the loss and gradients agree to rounding
/// (the order of the per-thread partial sums of conv weight gradients differs).
template <class Net, class Loss = fusedp::MSE>
void check_threads(std::size_t batch, std::uint64_t seed, const Loss& loss = {}) {
  if (verbose()) std::printf("threads 1, batch %zu, seed %llu\n", batch, (unsigned long long)seed);
  const Result one = check<Net, Loss>(1, batch, seed, loss);
  if (verbose()) std::printf("threads 2\n");
  const Result two = check<Net, Loss>(2, batch, seed, loss);
  CHECK(std::abs(one.loss - two.loss) <= 1e-14 * std::abs(one.loss) + 1e-300);
  REQUIRE(one.grads.size() == two.grads.size());
  double worst = 0;
  for (std::size_t i = 0; i < one.grads.size(); ++i) {
    const double d = std::abs(one.grads[i] - two.grads[i]);
    const double s = std::max(std::abs(one.grads[i]), std::abs(two.grads[i]));
    worst = std::max(worst, d / (s + 1e-12));
  }
  CHECK(worst <= 1e-11);
}

}  // namespace gradcheck
