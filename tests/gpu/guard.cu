// Guarded optimizers on the Cuda space (tests/optim/guard.cpp is the Host twin): the gradient's
// statistics measured on the device equal the Host's; clipping matches clip_grad_norm applied on the
// host; nonfinite::Stop throws naming the step and the first tensor, exactly as Host words it, with
// nothing changed; nonfinite::Skip leaves parameters and optimizer state unchanged and counts the skip;
// and Parallel<Net, Cuda> under every reduce policy takes the same decision on every replica.
#include "gpu_test.hpp"

#include <fusedp/parallel/parallel.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#if !FUSEDP_HAS_NCCL
#error "tests/gpu/guard.cu needs <nccl.h> (tests/CMakeLists.txt builds it only where NCCL::NCCL exists)"
#endif

namespace fp = fusedp;
using namespace gpu_test;

namespace {
using Net = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<3, 3>, fp::ReLU, fp::Flatten, fp::Linear<4>>;
using Gpu = fp::CudaFp32;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
// The Host test's batches (tests/optim/guard.cpp); `poison` puts a NaN in the last sample only.
Batch batch_of(std::size_t n, std::uint64_t step, bool poison = false) {
  Batch b{std::vector<float>(n * Net::input_shape::size), std::vector<std::int32_t>(n)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(21, step, i) - 1;
  for (std::size_t i = 0; i < n; ++i) b.y[i] = std::int32_t(fp::rng::uniform(22, step, i) * 4);
  if (poison) b.x[b.x.size() - 1] = std::numeric_limits<float>::quiet_NaN();
  return b;
}
template <class Trainer, class Opt>
float step_on(Trainer& t, const Batch& b, const Opt& opt) {
  Opt o = opt;
  return t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, o);
}
template <class M>
std::vector<float> state_on_host(M& m) {
  std::vector<float> v(m.optimizer_state().size());
  m.copy_optimizer_state_to_host(v);
  return v;
}
std::vector<float> device_to_host(std::span<const float> d) {
  std::vector<float> v(d.size());
  FUSEDP_CUDA_CHECK(cudaMemcpy(v.data(), d.data(), d.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}
const std::string host_words = "the gradient is not finite (NaN or infinity), first in '0.weight' (layer 1)";
}  // namespace

TEST_CASE("Cuda gradient statistics equal the Host's on the same gradient") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Model<Net, Gpu> m{fp::seed(4), Gpu{0}};
  const Batch b = batch_of(8, 0);
  (void)m.compute_gradients(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{});
  const std::vector<float> g = grads_on_host(m);
  const auto want = fp::kernels::host::gradient_stats(fp::Host{1}, g.data(), g.size());
  const auto got = m.gradient_stats();
  CHECK(got.finite());
  CHECK(got.sum_squares == doctest::Approx(want.sum_squares).epsilon(1e-12));
  CHECK(m.gradient_stats().sum_squares == got.sum_squares);  // a fixed order: the same bits again

  // A NaN and an infinity planted in the flat buffer: the first one is found, whatever the grid.
  std::vector<float> poisoned = g;
  const fp::ParamTensor& bias = Net::param_layout[1];  // '0.bias'
  const fp::ParamTensor& last = Net::param_layout.back();
  poisoned[last.offset + 1] = std::numeric_limits<float>::infinity();
  poisoned[bias.offset + 2] = std::numeric_limits<float>::quiet_NaN();
  fp::copy_async(m.grads().data(), poisoned.data(), poisoned.size(), m.space().stream());
  const auto bad = m.gradient_stats();
  CHECK(!bad.finite());
  CHECK(bad.first_nonfinite == bias.offset + 2);
  CHECK(decltype(m)::nonfinite_tensor_name(bad.first_nonfinite) == "'0.bias' (layer 1)");
}

TEST_CASE("Guarded clips the whole gradient on Cuda as clip_grad_norm does on the host") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Sgd sgd{{.lr = 0.1f, .momentum = 0.9f}};
  const fp::Guarded<fp::Sgd> clipped{sgd, {.max_norm = 0.05f}};
  fp::Model<Net, Gpu> guarded{fp::seed(4), Gpu{0}}, by_hand{fp::seed(4), Gpu{0}};
  fp::Model<Net, fp::Host> host{fp::seed(4), fp::Host{1}};
  for (std::uint64_t s = 0; s < 5; ++s) {
    const Batch b = batch_of(8, s);
    (void)step_on(guarded, b, clipped);
    (void)step_on(host, b, clipped);
    // The reference: the same gradient clipped on the host by clip_grad_norm, then the bare update.
    (void)by_hand.compute_gradients(std::span<const float>(b.x), std::span<const std::int32_t>(b.y),
                                    fp::SoftmaxCrossEntropy{});
    std::vector<float> g = grads_on_host(by_hand);
    const double norm = fp::clip_grad_norm(fp::Host{1}, std::span<float>(g), 0.05);
    if (s == 0) REQUIRE(norm > 0.05);  // the test needs gradients that are clipped
    fp::copy_async(by_hand.grads().data(), g.data(), g.size(), by_hand.space().stream());
    by_hand.step(sgd);
  }
  // The norms differ only in the order of a double sum: the same float factor, in practice the same bits.
  CHECK(relative_error(params_on_host(guarded), params_on_host(by_hand)) < 1e-6);
  // Against the Host model: fp32 kernels in another summation order, 5 steps.
  CHECK(relative_error(params_on_host(guarded), params_on_host(host)) < 1e-4);
  CHECK(guarded.optimizer_steps() == 5);
  CHECK(guarded.skipped_steps() == 0);
}

TEST_CASE("nonfinite::Stop on Cuda throws naming the step and the first tensor; nothing changes") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Model<Net, Gpu> m{fp::seed(4), Gpu{0}};
  const fp::Guarded<fp::Sgd, fp::nonfinite::Stop> opt{{{.lr = 0.1f, .momentum = 0.9f}}};
  const Batch good = batch_of(8, 0), bad = batch_of(8, 1, true);
  (void)step_on(m, good, opt);
  const auto params = params_on_host(m);
  const auto state = state_on_host(m);
  std::string message;
  try {
    (void)step_on(m, bad, opt);
  } catch (const fp::NumericError& e) {
    message = e.what();
  }
  MESSAGE(message);
  CHECK(message.find("step 2: " + host_words + "; parameters are unchanged") != std::string::npos);
  CHECK(params_on_host(m) == params);
  CHECK(state_on_host(m) == state);
  CHECK(m.optimizer_steps() == 1);
  // The Host model words it the same way.
  fp::Model<Net, fp::Host> host{fp::seed(4), fp::Host{1}};
  (void)step_on(host, good, opt);
  std::string host_message;
  try {
    (void)step_on(host, bad, opt);
  } catch (const fp::NumericError& e) {
    host_message = e.what();
  }
  CHECK(message == host_message);
}

TEST_CASE("nonfinite::Skip on Cuda leaves parameters and optimizer state unchanged and goes on") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Model<Net, Gpu> m{fp::seed(4), Gpu{0}};
  const fp::Guarded<fp::Adam, fp::nonfinite::Skip> opt{{{.lr = 0.01f}}};
  const Batch good = batch_of(8, 0), bad = batch_of(8, 1, true);
  (void)step_on(m, good, opt);
  const auto params = params_on_host(m);
  const auto state = state_on_host(m);
  const float loss = step_on(m, bad, opt);
  CHECK(std::isnan(loss));
  CHECK(params_on_host(m) == params);
  CHECK(state_on_host(m) == state);
  CHECK(m.skipped_steps() == 1);
  CHECK(m.optimizer_steps() == 1);
  CHECK(m.steps() == 2);
  (void)step_on(m, good, opt);
  CHECK(m.optimizer_steps() == 2);  // Adam's bias correction counts only the steps taken
  CHECK(params_on_host(m) != params);
}

TEST_CASE_TEMPLATE("Parallel on Cuda, world size 1: a guarded step equals the guarded model's, whatever the reduce "
                   "policy",
                   DP, fp::Parallel<Net, Gpu>, fp::Parallel<Net, Gpu, fp::reduce::ReduceBroadcast<>>,
                   fp::Parallel<Net, Gpu, fp::reduce::ReduceScatter<>>,
                   fp::Parallel<Net, Gpu, fp::reduce::AllReduce<fp::Bucket<256>, fp::Overlap>>) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Guarded<fp::Sgd, fp::nonfinite::Skip> skip{{{.lr = 0.1f, .momentum = 0.9f}}, {.max_norm = 0.05f}};
  fp::Model<Net, Gpu> single{fp::seed(4), Gpu{0}};
  DP dp{fp::replicas(1), fp::seed(4)};
  for (std::uint64_t s = 0; s < 4; ++s) {
    const Batch b = batch_of(8, s, s == 2);
    const float want = step_on(single, b, skip), got = step_on(dp, b, skip);
    if (s == 2) CHECK(std::isnan(got));
    else CHECK(got == want);
    // The stats are taken over the same elements with the same grid: clipping is bit for bit.
    CHECK(params_on_host(dp.model()) == params_on_host(single));
  }
  CHECK(dp.model().steps() == 4);
  CHECK(dp.model().optimizer_steps() == 3);
  CHECK(dp.model().skipped_steps() == 1);
  CHECK(single.skipped_steps() == 1);

  const auto params = params_on_host(dp.model());
  const fp::Guarded<fp::Sgd> stop{{{.lr = 0.1f}}};
  std::string message;
  try {
    (void)step_on(dp, batch_of(8, 7, true), stop);
  } catch (const fp::NumericError& e) {
    message = e.what();
  }
  MESSAGE(message);
  CHECK(message.find("step 5: " + host_words) != std::string::npos);
  CHECK(params_on_host(dp.model()) == params);
}

TEST_CASE("Parallel on Cuda: ReduceScatter's skipped step leaves its sharded optimizer state unchanged") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Parallel<Net, Gpu, fp::reduce::ReduceScatter<>> dp{fp::replicas(1), fp::seed(4)};
  const fp::Guarded<fp::Adam, fp::nonfinite::Skip> opt{{{.lr = 0.01f}}};
  (void)step_on(dp, batch_of(8, 0), opt);
  const auto params = params_on_host(dp.model());
  const auto state = device_to_host(dp.zero_optimizer_state());
  CHECK(state.size() == 2 * Net::param_storage);
  (void)step_on(dp, batch_of(8, 1, true), opt);
  CHECK(params_on_host(dp.model()) == params);
  CHECK(device_to_host(dp.zero_optimizer_state()) == state);
  CHECK(dp.model().optimizer_steps() == 1);
  CHECK(dp.model().skipped_steps() == 1);
}

TEST_CASE_TEMPLATE("Parallel on Cuda, 2 devices: every replica takes the same decision", DP, fp::Parallel<Net, Gpu>,
                   fp::Parallel<Net, Gpu, fp::reduce::ReduceBroadcast<>>,
                   fp::Parallel<Net, Gpu, fp::reduce::ReduceScatter<>>) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  if (fp::cuda_device_count() < 2) {
    MESSAGE("skipped: needs 2 CUDA devices, " << fp::cuda_device_count() << " visible");
    return;
  }
  DP dp{fp::replicas(2), fp::seed(4)};
  const fp::Guarded<fp::Sgd, fp::nonfinite::Skip> skip{{{.lr = 0.1f, .momentum = 0.9f}}, {.max_norm = 1.0f}};
  const Batch good = batch_of(9, 0), bad = batch_of(9, 1, true);  // only the last replica sees the NaN
  (void)step_on(dp, good, skip);
  const auto params = params_on_host(dp.model(0));
  CHECK(params_on_host(dp.model(1)) == params);
  (void)step_on(dp, bad, skip);
  for (std::size_t r = 0; r < 2; ++r) CHECK(params_on_host(dp.model(r)) == params);
  const fp::Guarded<fp::Sgd> stop{{{.lr = 0.1f}}};
  CHECK_THROWS_AS(step_on(dp, bad, stop), fp::NumericError);
  for (std::size_t r = 0; r < 2; ++r) CHECK(params_on_host(dp.model(r)) == params);
}
