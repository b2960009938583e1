#pragma once
// Shared helpers of the gpu tests: skipping without a device, buffers on either space, poisoning,
// random inputs and the error measure with its bound per precision.
//
// Error measure: the normwise relative error ||got - want||_2 / ||want||_2 of a whole tensor, against
// a reference computed by the unfused Host kernels (in double where the test says so). Bounds, for a
// value that went through one GEMM: fp32 1e-5, tf32 5e-4, bf16 1e-2 (a single TF32 GEMM of random
// operands measures about 2.8e-4 in this norm, BF16 about 2.2e-3: operand rounding to 10 and 7
// mantissa bits). A value that went through d GEMMs in a chain (a deep network's first-layer gradient)
// is allowed d times the bound.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"

#include <fusedp/kernels/bf16.hpp>
#include <fusedp/net/cost.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace gpu_test {

namespace fp = fusedp;

/// Why the Cuda test cases of this process were skipped (empty: none was).
inline std::string& skip_reason() {
  static std::string why;
  return why;
}

/// True when there is no usable CUDA device (the test case then returns). The process prints one line
/// "fusedp-gpu-skip: <why>" at the end, so that ctest reports the test skipped
/// (SKIP_REGULAR_EXPRESSION), but only when nothing failed: the Host instances of a test body still
/// run on a machine without a GPU, and a failure there is a failure.
inline bool no_device() {
  if (fp::cuda_device_count() > 0) return false;
  const std::string why = fp::cuda_unavailable_reason();
  skip_reason() = why;
  MESSAGE("skipped: no CUDA device (" << why << ")");
  return true;
}

struct SkipReporter : doctest::IReporter {
  explicit SkipReporter(const doctest::ContextOptions&) {}
  void test_run_end(const doctest::TestRunStats& s) override {
    if (!skip_reason().empty() && s.numTestCasesFailed == 0 && s.numAssertsFailed == 0) {
      std::printf("fusedp-gpu-skip: %s; this test needs a CUDA device and its Cuda cases were skipped\n",
                  skip_reason().c_str());
      std::fflush(stdout);
    }
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
DOCTEST_REGISTER_LISTENER("fusedp_gpu_skip", 1, SkipReporter);

/// Returns from the test case when Space is a Cuda space and there is no device.
#define FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space)                      \
  do {                                                            \
    if constexpr (fp::is_cuda_space_v<Space>) {                   \
      if (gpu_test::no_device()) return;                          \
    }                                                             \
  } while (0)
#define FUSEDP_GPU_REQUIRE_DEVICE() \
  do {                              \
    if (gpu_test::no_device()) return; \
  } while (0)

/// Precision of a space: Host computes in plain fp32.
template <class Space>
struct precision_of {
  using type = fp::precision::Fp32;
};
template <class P>
struct precision_of<fp::CudaSpace<P>> {
  using type = P;
};

/// The error bound of one GEMM in precision P.
template <class P>
constexpr double gemm_bound() {
  if constexpr (std::is_same_v<P, fp::precision::Tf32>) return 5e-4;
  else if constexpr (std::is_same_v<P, fp::precision::Bf16>) return 1e-2;
  else return 1e-5;
}
/// The bound of space Space for a value `depth` GEMMs deep.
template <class Space>
constexpr double bound(int depth = 1) {
  return gemm_bound<typename precision_of<Space>::type>() * depth;
}

/// A seed for this run's random inputs: FUSEDP_TEST_SEED when set, else fresh each run (printed, so a
/// failure can be reproduced).
inline std::uint64_t run_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("FUSEDP_TEST_SEED")) return std::uint64_t(std::strtoull(s, nullptr, 10));
    std::random_device rd;
    return (std::uint64_t(rd()) << 32) ^ rd();
  }();
  static bool said = false;
  if (!said) {
    std::printf("gpu tests: random inputs from FUSEDP_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
    said = true;
  }
  return seed;
}

/// n values uniform in [lo, hi) from (run seed, stream): never zeros by construction of the tests.
inline std::vector<float> random_values(std::size_t n, std::uint64_t stream, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(n);
  const std::uint64_t seed = run_seed();
  for (std::size_t i = 0; i < n; ++i)
    v[i] = lo + (hi - lo) * fp::rng::uniform(seed, fp::rng::stream(fp::rng::Purpose::test, stream), i);
  return v;
}

/// v rounded to bf16 values in place, and the BFloat16 elements that hold them (a 16-bit workspace's).
inline std::vector<fp::kernels::BFloat16> stored_bf16(std::vector<float>& v) {
  std::vector<fp::kernels::BFloat16> h(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    h[i].bits = fp::kernels::to_bf16(v[i]);
    v[i] = fp::kernels::from_bf16(h[i].bits);
  }
  return h;
}

/// `batch` random class labels in [0, classes) from stream `stream`.
inline std::vector<std::int32_t> labels_for(std::size_t batch, std::size_t classes, std::uint64_t stream) {
  const auto u = random_values(batch, stream, 0.0f, 1.0f);
  std::vector<std::int32_t> l(batch);
  for (std::size_t i = 0; i < batch; ++i) l[i] = std::int32_t(std::size_t(u[i] * float(classes)) % classes);
  return l;
}

/// ||got - want|| / ||want||, infinite when got holds a NaN or an infinity (e.g. an unwritten poisoned
/// element) or the sizes differ.
template <class A, class B>
double relative_error(const A& got, const B& want) {
  if (std::size(got) != std::size(want)) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < std::size(got); ++i) {
    const double g = double(got[i]), w = double(want[i]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

#define FUSEDP_CHECK_CLOSE(got, want, tol, what)                                                         \
  do {                                                                                                 \
    const double fusedp_err_ = gpu_test::relative_error(got, want);                                   \
    CHECK_MESSAGE(fusedp_err_ <= (tol), what << ": relative error " << fusedp_err_ << " > bound " << (tol)); \
  } while (0)

// --- buffers on a space -----------------------------------------------------------------------------

/// Copies host values into a new buffer of the space.
template <class T>
fp::HostBuffer<T> upload(const fp::Host&, std::span<const T> values) {
  fp::HostBuffer<T> b(values.size());
  if (!values.empty()) std::memcpy(b.data(), values.data(), values.size_bytes());
  return b;
}
template <class T, class P>
fp::DeviceBuffer<T> upload(const fp::CudaSpace<P>& space, std::span<const T> values) {
  fp::DeviceBuffer<T> b(values.size());
  fp::copy_async(b.data(), values.data(), values.size(), space.stream());
  space.synchronize();
  return b;
}
template <class Space, class T>
auto upload(const Space& space, const std::vector<T>& values) {
  return upload(space, std::span<const T>(values));
}

/// A buffer of n values of the space, every byte 0xff: a NaN in every float, so an element a kernel
/// forgets to write shows up in relative_error.
template <class T>
fp::HostBuffer<T> poisoned(const fp::Host&, std::size_t n) {
  fp::HostBuffer<T> b(n);
  if (n) std::memset(static_cast<void*>(b.data()), 0xff, n * sizeof(T));
  return b;
}
template <class T, class P>
fp::DeviceBuffer<T> poisoned(const fp::CudaSpace<P>& space, std::size_t n) {
  fp::DeviceBuffer<T> b(n);
  if (n) FUSEDP_CUDA_CHECK(cudaMemsetAsync(b.data(), 0xff, n * sizeof(T), space.stream()));
  space.synchronize();
  return b;
}

/// The values of a buffer (or a span of the space's memory), on the host, after the space's queued
/// work is done.
template <class T>
std::vector<std::remove_const_t<T>> download(const fp::Host&, std::span<T> values) {
  return std::vector<std::remove_const_t<T>>(values.begin(), values.end());
}
template <class T, class P>
std::vector<std::remove_const_t<T>> download(const fp::CudaSpace<P>& space, std::span<T> values) {
  std::vector<std::remove_const_t<T>> v(values.size());
  space.synchronize();
  fp::copy_async(v.data(), values.data(), values.size(), space.stream());
  space.synchronize();
  return v;
}
template <class Space, class Buffer>
auto download(const Space& space, const Buffer& b) {
  return download(space, b.span());
}

/// A space to run on: Host with all cores, Cuda on device 0.
template <class Space>
Space make_space() {
  if constexpr (fp::is_cuda_space_v<Space>) return Space{0};
  else return Space{0};
}

// --- models -----------------------------------------------------------------------------------------

/// A model's parameters (or gradients) on the host, whatever its space.
template <class M>
std::vector<float> params_on_host(M& m) {
  if constexpr (fp::is_cuda_space_v<typename M::space_type>) {
    std::vector<float> v(M::network::param_storage);
    m.copy_params_to_host(v);
    return v;
  } else {
    return std::vector<float>(m.params().begin(), m.params().end());
  }
}
template <class M>
std::vector<float> grads_on_host(M& m) {
  if constexpr (fp::is_cuda_space_v<typename M::space_type>) {
    std::vector<float> v(M::network::param_storage);
    m.copy_grads_to_host(v);
    return v;
  } else {
    return std::vector<float>(m.grads().begin(), m.grads().end());
  }
}

/// A model's state buffer (BatchNorm's running and batch statistics) on the host, whatever its space.
template <class M>
std::vector<float> buffers_on_host(M& m) {
  if constexpr (fp::is_cuda_space_v<typename M::space_type>) {
    std::vector<float> v(M::network::state_storage);
    m.copy_buffers_to_host(v);
    return v;
  } else {
    return std::vector<float>(m.buffers().begin(), m.buffers().end());
  }
}

/// Bounds for a whole network compared with Host in double. `depth` is the number of GEMM layers:
/// outputs and the loss went through `depth` GEMMs, gradients through up to 2 x depth. With
/// `discrete` (ReLU, max-pooling), TF32 and BF16 rounding flips a small fraction of ReLU signs and
/// pooling winners, each moving a whole gradient element; gradients then get a bound that tolerates
/// flips (still far below the O(1) error of a wrong kernel): fp32 1e-3, TF32 0.15, BF16 0.3. TF32's
/// was 5e-2 until measured: LeNet on an H200 over 13 seeds gave 0.03 to 0.065 (5 of 13 above 0.05);
/// the exact fp32 path (CudaFp32) is what holds the kernels to 1e-3.
template <class Space>
double gradient_bound(int depth, bool discrete) {
  if (!discrete) return bound<Space>(2 * depth);
  using P = typename precision_of<Space>::type;
  if constexpr (std::is_same_v<P, fp::precision::Tf32>) return 0.15;
  else if constexpr (std::is_same_v<P, fp::precision::Bf16>) return 0.3;
  else return 1e-3;
}

/// What one draw of compare_with_host_double found out of bounds, one line per finding.
struct Findings {
  std::vector<std::string> failures;
  static std::string num(double v) {
    char s[32];
    std::snprintf(s, sizeof s, "%.3g", v);
    return s;
  }
  void check(double err, double tol, const std::string& what) {
    if (!(err <= tol)) failures.push_back(what + ": relative error " + num(err) + " > bound " + num(tol));
  }
};

/// One draw of compare_with_host_double: the inputs of `stream`, everything compared, nothing asserted.
template <class Space, class Net, class Loss, class Target>
Findings compare_draw(std::size_t batch, const std::vector<Target>& targets, int depth, bool discrete,
                      std::uint64_t stream, int steps) {
  Findings f;
  const auto x = random_values(batch * Net::input_shape::size, stream);
  const std::vector<double> xd(x.begin(), x.end());
  const std::vector<typename Loss::template target<double>> td(targets.begin(), targets.end());
  const std::vector<typename Loss::template target<float>> tf(targets.begin(), targets.end());
  fp::Model<Net, fp::Host, double> ref{fp::seed(5), fp::Host{0}};
  fp::Model<Net, Space> m{fp::seed(5), make_space<Space>()};
  f.check(relative_error(params_on_host(m), ref.params()), 1e-7, "initial parameters");

  const double loss_ref = ref.compute_gradients(std::span<const double>(xd), std::span(td), Loss{});
  const float loss = m.compute_gradients(std::span<const float>(x), std::span(tf), Loss{});
  f.check(std::abs(loss - loss_ref) / std::abs(loss_ref), bound<Space>(depth),
          "loss " + Findings::num(loss) + " vs " + Findings::num(loss_ref));
  const auto grads = grads_on_host(m);
  // A tensor whose exact gradient vanishes (the bias of a layer before BatchNorm, which the
  // normalization removes) is held to the scale of the whole gradient, not to its own rounding noise.
  double whole = 0;
  for (std::size_t t = 0; t < Net::param_layout.size(); ++t)
    for (double v : ref.grad(t)) whole += v * v;
  const double floor = 1e-3 * std::sqrt(whole);
  for (std::size_t t = 0; t < Net::param_layout.size(); ++t) {
    const auto& p = Net::param_layout[t];
    const auto r = ref.grad(t);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < p.size; ++i) {
      const double g = grads[p.offset + i];
      num += (g - r[i]) * (g - r[i]);
      den += r[i] * r[i];
    }
    const double err = std::isfinite(num) ? std::sqrt(num) / std::max(std::sqrt(den), floor) : INFINITY;
    f.check(err, gradient_bound<Space>(depth, discrete),
            "gradient of tensor " + std::to_string(t) + " (layer " + std::to_string(p.layer) + ")");
  }
  const auto out_ref = ref.predict(std::span<const double>(xd));
  const auto out = m.predict(std::span<const float>(x));
  f.check(relative_error(std::vector<float>(out.begin(), out.end()), out_ref), bound<Space>(depth), "outputs");

  const fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  fp::Sgd opt_ref = opt, opt_m = opt;
  for (int s = 0; s < steps; ++s) {
    (void)ref.train_step(std::span<const double>(xd), std::span(td), Loss{}, opt_ref);
    (void)m.train_step(std::span<const float>(x), std::span(tf), Loss{}, opt_m);
  }
  // each step moves the parameters by lr x gradient: the parameters' error is the gradients' error
  // scaled down by how little the parameters move
  if (steps > 0)
    f.check(relative_error(params_on_host(m), ref.params()), gradient_bound<Space>(depth, discrete),
            "parameters after " + std::to_string(steps) + " SGD steps");
  return f;
}

/// Model<Net, Space> against Model<Net, Host, double> from the same seed on the same batch: the loss,
/// the outputs and every gradient tensor after compute_gradients, then every parameter after `steps`
/// SGD steps with momentum.
///
/// With `discrete`, a draw can fail without a wrong kernel: a pre-activation within rounding of zero
/// (or two pooling candidates within rounding of each other) decides differently in float than in
/// double, and the whole element's gradient moves. Behind a BatchNorm that one element reaches its
/// whole channel (the mean's and variance's gradients), so a single flip measured 2e-3 to 5e-2 on
/// SmallResNet's tensors, in about 1 draw in 100 (Host fp32, seeds 100-300 and CI's 1080824009970170272).
/// Such a draw is reported and two fresh draws are made, which must both pass: a wrong kernel fails every
/// draw, a flip about 1 in 100, so the pair fails by chance about once in 10^4 runs.
template <class Space, class Net, class Loss, class Target>
void compare_with_host_double(std::size_t batch, const std::vector<Target>& targets, int depth, bool discrete,
                              std::uint64_t stream, int steps = 3) {
  Findings first = compare_draw<Space, Net, Loss>(batch, targets, depth, discrete, stream, steps);
  if (first.failures.empty()) return;
  if (!discrete) {
    for (const auto& s : first.failures) FAIL_CHECK(s);
    return;
  }
  std::string said;
  for (const auto& s : first.failures) said += "\n  " + s;
  MESSAGE("draw " << stream << " is off, as one ReLU or pooling decision flipped by rounding would make it; "
                  "two fresh draws must pass:" << said);
  for (std::uint64_t k = 1; k <= 2; ++k) {
    const Findings again = compare_draw<Space, Net, Loss>(batch, targets, depth, discrete, stream + k * 1000003, steps);
    for (const auto& s : again.failures) FAIL_CHECK("fresh draw " << stream + k * 1000003 << ": " << s);
  }
}

/// While it lives, every weight gradient a Cuda model forks onto its side stream first waits there about
/// 0.1 ms (kernels/cuda/branch_delay.cuh), with programmatic dependent launch off: on, the weight
/// gradient's blocks would be scheduled behind the delay and hold the SMs, and the model's stream could
/// not run ahead of them. A missing wait for a branch then changes bits.
struct HeldBranches {
  bool was = fp::kernels::cuda::dependent_launch();
  HeldBranches() {
    fp::kernels::cuda::set_dependent_launch(false);
    fp::kernels::cuda::set_branch_delay(200'000);
  }
  HeldBranches(const HeldBranches&) = delete;
  HeldBranches& operator=(const HeldBranches&) = delete;
  ~HeldBranches() {
    fp::kernels::cuda::set_branch_delay(0);
    fp::kernels::cuda::set_dependent_launch(was);
  }
};

/// The parts of two MemoryUse, compared one by one (a failure names the part).
inline void check_same(const fusedp::MemoryUse& got, const fusedp::MemoryUse& want) {
  CHECK(got.parameters == want.parameters);
  CHECK(got.gradients == want.gradients);
  CHECK(got.optimizer_state == want.optimizer_state);
  CHECK(got.state == want.state);
  CHECK(got.workspace == want.workspace);
  CHECK(got.loader == want.loader);
  CHECK(got.staging == want.staging);
  CHECK(got.reduction == want.reduction);
  CHECK(got.pinned_host == want.pinned_host);
}

}  // namespace gpu_test
