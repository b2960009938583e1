// tests include/fusedp/optim/decay.hpp (Decay::weights), Sequential::weight_runs and
// kernels/optimizer.hpp's DecayRuns: weight decay on the Conv2d and Linear weights only. Three models
// from one seed take the same gradients each step: one decays everything, one nothing, one only the
// weights; the last must hold the first's values in the weight tensors and the second's everywhere
// else, bit for bit (the same per-element update runs with or without its decay), for Sgd (momentum,
// Nesterov), Adam and AdamW, on a network with BatchNorm, a residual block and biases. Then ZeRO-1
// (each replica updating its block of the flat buffer, the runs taken from the block's offset) against
// one model, and the message when the runs are missing.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"
#include <fusedp/optim/decay.hpp>
#include <fusedp/parallel/parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace fp = fusedp;

namespace {

using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                           fp::Residual<fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>,
                                        fp::Projection<fp::Conv2d<4, 1, 1, 0, fp::no_bias>, fp::BatchNorm2d<>>>,
                           fp::ReLU, fp::Conv2d<3, 3>, fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<5>,
                           fp::ReLU, fp::Linear<3>>;

// The tensors Decay::weights decays: the four convolutions' and two Linears' weights.
constexpr std::size_t weight_tensors() {
  std::size_t n = 0;
  for (const auto& t : Net::param_layout) n += t.gemm_weight() ? 1 : 0;
  return n;
}
static_assert(weight_tensors() == 6);
// conv, then [bn w, bn b], conv, [bn w, bn b], conv(projection), [bn w, bn b], conv+bias, linear+bias, linear+bias
static_assert(Net::weight_run_count == 6);

bool in_runs(std::size_t e) {
  for (std::size_t k = 0; k < Net::weight_run_count; ++k)
    if (Net::weight_runs[2 * k] <= e && e < Net::weight_runs[2 * k + 1]) return true;
  return false;
}

std::vector<float> batch_inputs(std::uint64_t step, std::size_t batch) {
  std::vector<float> x(batch * Net::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 3 * fp::rng::uniform(51, step, i) - 1;
  return x;
}
std::vector<std::int32_t> batch_labels(std::uint64_t step, std::size_t batch) {
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(52, step, i) * 3);
  return y;
}

template <class Opt>
void check_groups(Opt all, float decay) {
  Opt none = all, weights = all;
  all.options.weight_decay = decay;
  none.options.weight_decay = 0;
  weights.options.weight_decay = decay;
  weights.options.decay = fp::Decay::weights;
  fp::Model<Net, fp::Host> a{fp::seed(3), fp::Host{1}}, n{fp::seed(3), fp::Host{1}}, w{fp::seed(3), fp::Host{1}};
  for (std::uint64_t step = 0; step < 3; ++step) {
    const auto x = batch_inputs(step, 6);
    const auto y = batch_labels(step, 6);
    (void)w.compute_gradients(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{});
    // The same gradient for all three, whatever their parameters have become.
    std::copy(w.grads().begin(), w.grads().end(), a.grads().begin());
    std::copy(w.grads().begin(), w.grads().end(), n.grads().begin());
    (void)a.step(all);
    (void)n.step(none);
    (void)w.step(weights);
  }
  std::size_t decayed = 0, kept = 0;
  for (const fp::ParamTensor& t : Net::param_layout) {
    CAPTURE(t.name.c_str());
    const auto& want = t.gemm_weight() ? a : n;
    for (std::size_t e = t.offset; e < t.offset + t.size; ++e) {
      CHECK(in_runs(e) == t.gemm_weight());
      if (w.params()[e] != want.params()[e]) {
        FAIL_CHECK("element " << e - t.offset << ": " << w.params()[e] << " vs " << want.params()[e]);
        break;
      }
    }
    // The two references differ here, so the comparison could fail.
    const bool differ = !std::equal(a.params().begin() + std::ptrdiff_t(t.offset),
                                    a.params().begin() + std::ptrdiff_t(t.offset + t.size),
                                    n.params().begin() + std::ptrdiff_t(t.offset));
    (t.gemm_weight() ? decayed : kept) += differ ? 1 : 0;
  }
  CHECK(decayed == weight_tensors());
  CHECK(kept == Net::param_layout.size() - weight_tensors());
}

}  // namespace

TEST_CASE("Decay::weights decays Conv2d and Linear weights, not biases or BatchNorm, for every optimizer") {
  check_groups(fp::Sgd{{.lr = 0.1f, .momentum = 0.9f}}, 0.05f);
  check_groups(fp::Sgd{{.lr = 0.1f, .momentum = 0.9f, .nesterov = true}}, 0.05f);
  check_groups(fp::Adam{{.lr = 0.01f}}, 0.05f);
  check_groups(fp::AdamW{{.lr = 0.01f}}, 0.05f);
}

TEST_CASE("Decay::weights under ZeRO-1: each replica's block finds its weights from the block's offset") {
  constexpr std::size_t batch = 8;
  // 3 replicas: block boundaries fall inside tensors.
  fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>, fp::batch_norm::Sync> dp{fp::replicas(3, 1), fp::seed(4)};
  fp::Model<Net, fp::Host> one{fp::seed(4), fp::Host{1}};
  fp::Sgd o_dp{{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.05f, .decay = fp::Decay::weights}};
  fp::Sgd o_one = o_dp;
  for (std::uint64_t step = 0; step < 3; ++step) {
    const auto x = batch_inputs(step, batch);
    const auto y = batch_labels(step, batch);
    (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, o_dp);
    (void)one.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, o_one);
  }
  CHECK(test_support::relative_error(dp.model(1).params(), one.params()) <= 1e-5);
}

TEST_CASE("Decay::weights without the network's runs is an error that says how to call it") {
  fp::Sgd opt{{.lr = 0.1f, .weight_decay = 0.01f, .decay = fp::Decay::weights}};
  std::vector<float> p(4, 1.0f), g(4, 1.0f), state(4, 0.0f);
  CHECK_THROWS_WITH_AS(opt.step(fp::Host{1}, p.data(), g.data(), state.data(), p.size(), 1),
                       doctest::Contains("Decay::weights needs the network's weight runs"), fp::InvalidArgument);
  CHECK(p[0] == 1.0f);  // nothing changed
  // Without decay there is nothing to place, so no runs are needed.
  opt.options.weight_decay = 0;
  opt.step(fp::Host{1}, p.data(), g.data(), state.data(), p.size(), 1);
  CHECK(p[0] == doctest::Approx(0.9f));
}
