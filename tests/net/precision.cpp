// tests the Host's precision policy on whole networks (exec/host.hpp's HostPrecision, the GEMMs of
// kernels/host/gemm_bf16.hpp through the conv and linear layers, and the bf16 storage of activations,
// net/activation_storage.hpp): networks at bf16 against the same networks in double, with the bounds
// measured here; every stored activation and activation gradient a bf16 value, the logits not; fp32
// untouched by the bf16 code; a double Model refuses a bf16 Host.
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include "../support/relative_error.hpp"

#include <cmath>
#include <cstdint>
#include <fusedp/kernels/bf16.hpp>
#include <string>
#include <span>
#include <vector>

namespace fp = fusedp;

namespace {

// A conv with more output channels than the direct path takes (a GEMM), pooling, and two Linear layers:
// every GEMM of the network runs at the Host's precision.
using Net = fp::Sequential<fp::Input<3, 10, 10>, fp::Conv2d<40, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                           fp::Conv2d<36, 3>, fp::Tanh, fp::Flatten, fp::Linear<24>, fp::ReLU, fp::Linear<5>>;
constexpr std::size_t batch = 6;

// A network with BatchNorm (folded into its conv in evaluation), a residual block with a projection,
// average pooling and a Flatten before the classifier.
using BlockNet = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU,
                                fp::Residual<fp::Conv2d<12, 3, 2, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<12, 3, 1, 1>,
                                             fp::BatchNorm2d<>, fp::Projection<fp::Conv2d<12, 1, 2, 0>, fp::BatchNorm2d<>>>,
                                fp::ReLU, fp::AvgPool2d<2>, fp::Flatten, fp::Linear<6>, fp::GELU, fp::Linear<3>>;

// ResNet's shapes in small, for the paths a Host takes at bf16: 3x3 convs with 32 channels on a 16-wide
// plane straight from the padded grid (the first block's; on AMX tiles or by VDPBF16PS), strided blocks
// onto 8 x 8 and 4 x 4 (im2col, and on 4 x 4 the samples side by side), projections, BatchNorm adding the
// shortcut.
using WideNet = fp::Sequential<
    fp::Input<3, 16, 16>, fp::Conv2d<32, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU,
    fp::Residual<fp::Conv2d<32, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<32, 3, 1, 1>, fp::BatchNorm2d<>,
                 fp::IdentityShortcut>,
    fp::ReLU,
    fp::Residual<fp::Conv2d<64, 3, 2, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<64, 3, 1, 1>, fp::BatchNorm2d<>,
                 fp::Projection<fp::Conv2d<64, 1, 2, 0>, fp::BatchNorm2d<>>>,
    fp::ReLU,
    fp::Residual<fp::Conv2d<64, 3, 2, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<64, 3, 1, 1>, fp::BatchNorm2d<>,
                 fp::Projection<fp::Conv2d<64, 1, 2, 0>, fp::BatchNorm2d<>>>,
    fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<5>>;

struct Result {
  double loss;
  std::vector<double> logits, grads;
};

template <class Network, class T>
Result run(const fp::Host& host) {
  fp::Model<Network, fp::Host, T> model{fp::seed(3), host};
  std::vector<T> x(batch * Network::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(2 * fp::rng::uniform(17, 0, i) - 1);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % Network::output_shape::size);
  Result r;
  r.loss = double(model.compute_gradients(std::span<const T>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}));
  r.grads.assign(model.grads().begin(), model.grads().end());
  const auto out = model.predict(std::span<const T>(x));
  r.logits.assign(out.begin(), out.end());
  return r;
}

double rel(const std::vector<double>& got, const std::vector<double>& want) {
  const std::vector<float> g(got.begin(), got.end());
  const std::vector<float> w(want.begin(), want.end());
  return test_support::relative_error(g, w);
}

// Bounds on the relative errors of a network at bf16 against the same network in double.
struct Bounds {
  double logits, grads, loss;
};

template <class Network>
void check_against_double(const char* name, Bounds bound) {
  CAPTURE(name);
  const Result ref = run<Network, double>(fp::Host{2});
  const Result fp32 = run<Network, float>(fp::Host{2});
  // The emulation, VDPBF16PS, and AMX tiles where the CPU has them.
  std::vector<fp::Host> hosts{fp::Host{2, fp::HostPrecision::bf16_emulated}};
  if (fp::cpu_features().avx512_bf16) hosts.push_back(fp::Host{2, fp::HostPrecision::bf16}.with_bf16_tiles(false));
  if (fp::amx_usable()) hosts.push_back(fp::Host{2, fp::HostPrecision::bf16});
  for (const auto& host : hosts) {
    const auto precision = host.precision();
    CAPTURE(std::string(fp::to_string(precision)));
    CAPTURE(host.bf16_tiles());
    const Result bf = run<Network, float>(host);
    const double e_logits = rel(bf.logits, ref.logits), e_grads = rel(bf.grads, ref.grads);
    const double e_loss = std::abs(bf.loss - ref.loss) / std::abs(ref.loss);
    MESSAGE(std::string(name) << ", " << std::string(fp::to_string(precision)) << std::string(host.bf16_tiles() ? " (AMX)" : "") << ": relative error of logits " << e_logits << ", gradients "
                 << e_grads << ", loss " << e_loss << " (fp32: " << rel(fp32.logits, ref.logits) << ", "
                 << rel(fp32.grads, ref.grads) << ")");
    CHECK(e_logits < bound.logits);
    CHECK(e_grads < bound.grads);
    CHECK(e_loss < bound.loss);
    // And the operands were rounded: fp32 is hundreds of times closer.
    CHECK(rel(fp32.logits, ref.logits) * 50 < e_logits);
    CHECK(rel(fp32.grads, ref.grads) * 50 < e_grads);
  }
}

}  // namespace

TEST_CASE("a network at precision bf16 against the double model: within the measured bound, not fp32's") {
  // bf16 keeps 8 bits of mantissa (2^-9 = 2.0e-3 per rounded operand or stored value), and a gradient
  // goes through several rounded GEMMs and stored gradients. Measured (emulation; a Xeon's AVX-512 BF16
  // gives the same bits where no conv runs directly), the bounds about three times these:
  //   conv/pool/tanh/linear: logits 2.1e-3, gradients 1.3e-2 with fp32 storage, 1.6e-2 with bf16
  //   storage, loss 4.6e-5 (the forward's stored values are the GEMMs' rounded operands either way);
  check_against_double<Net>("conv, pool, tanh, linear", {6e-3, 5e-2, 2e-4});
  //   batch norm, residual block, average pool, GELU: logits 3.7e-4 (3.4e-4 with fp32 storage; the
  //   logits come from evaluation, BatchNorm's running statistics after one step), gradients 1.6e-2
  //   (2.5e-2), loss 4.6e-4 (2.0e-4).
  check_against_double<BlockNet>("batch norm, residual block, avg pool, GELU", {1.5e-3, 6e-2, 1.5e-3});
  //   ResNet in small (WideNet; at bf16 its first block's convs straight from the grid): logits 5.9e-4
  //   (AMX 7.3e-4, VDPBF16PS 6.8e-4), gradients 0.13 (AMX 0.14, VDPBF16PS 0.14), loss 4.6e-4
  //   (AMX 7.0e-5, VDPBF16PS 2.3e-6). The gradients' error is large
  //   because backward through five BatchNorms in training subtracts each channel's means of dz and dz
  //   xhat, over 96 values a channel in the last block (6 samples of 4 x 4): rounding errors of the stored
  //   gradients survive the cancellation (fp32: 3.0e-6).
  check_against_double<WideNet>("ResNet in small: direct convs, samples side by side", {2.5e-3, 0.4, 2e-3});
}

namespace {

// Whether every one of n values is a bfloat16 value (its low 16 bits zero).
bool all_bf16(const float* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (fp::kernels::round_bf16(p[i]) != p[i] && !std::isnan(p[i])) return false;
  return true;
}

// What check_stored counts: stored tensors checked, and those holding values other than bf16 ones.
struct StoredCheck {
  int outputs = 0, outputs_fp32 = 0;      // the stages' outputs
  int gradients = 0, gradients_fp32 = 0;  // the stages' input gradients
  int inner = 0, inner_fp32 = 0;          // inside residual blocks: the body's outputs, its input gradient
  bool logits_bf16 = true;
  bool input_unchanged = true;
};

template <class T, class In>
concept ResidualAt = requires { typename T::template body<In>; T::template fused_add<In>; };

// Runs Net's stages forward (and in training backward) on `host` through the StageBinding the models
// hold, and checks what they stored: each stage's output (in evaluation, with its folds), each stage's
// input gradient, and in a residual block the body's outputs (in the block's saved region) and the
// body's input gradient (backward's first work buffer, just after the block's backward).
template <class Net>
StoredCheck check_stored(const fp::Host& host, bool training) {
  constexpr std::size_t n = 5;
  fp::ParameterStore<Net, fp::Host, float> store(host, 7);
  fp::StageBinding<Net, fp::Host, float> binding;
  binding.reserve(n, std::size_t(host.threads()) * Net::host_scratch_elements);
  std::vector<float> x(n * Net::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(2 * fp::rng::uniform(23, 0, i) - 1);
  const std::vector<float> x0 = x;
  StoredCheck c;
  const auto count = [](int& all, int& fp32, const float* p, std::size_t values) {
    ++all;
    fp32 += all_bf16(p, values) ? 0 : 1;
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          binding.template forward_stage<I>(host, store, x.data(), n, training, binding.tail());
          using S = typename Net::template stage<I>;
          if constexpr (!Net::stage_plan[I].aliases_input) {
            if (!training && fp::detail::folds_next<Net, I>()) return;  // stage I + 1's output, checked there
            const float* y = binding.template output_of<I>(x.data(), n);
            if (fp::detail::is_network_output<Net, I>()) c.logits_bf16 = all_bf16(y, n * S::out::size);
            else count(c.outputs, c.outputs_fp32, y, n * S::out::size);
            if constexpr (ResidualAt<typename S::layer, typename S::in>) {
              using L = typename S::layer;
              using B = typename L::template body<typename S::in>;
              if (!training) return;  // evaluation folds the body's BatchNorms: not every region is written
              const float* body = binding.data() + Net::stage_plan[I].z_offset * n;
              [&]<std::size_t... J>(std::index_sequence<J...>) {
                (
                    [&] {
                      // With fused_add the last stage writes the block's output, checked above.
                      if constexpr (J + 1 < B::stage_count || !L::template fused_add<typename S::in>)
                        count(c.inner, c.inner_fp32, body + B::stage_plan[J].out_offset * n,
                              n * B::template stage<J>::out::size);
                    }(),
                    ...);
              }(std::make_index_sequence<B::stage_count>{});
            }
          }
        }(),
        ...);
  }(std::make_index_sequence<Net::stage_count>{});
  if (training) {
    float* dlogits = binding.gradient_buffer(0, n);
    for (std::size_t i = 0; i < n * Net::output_shape::size; ++i) dlogits[i] = float(fp::rng::uniform(29, 0, i) - 0.5);
    int current = 0;
    fp::NoStageHook done;
    [&]<std::size_t... R>(std::index_sequence<R...>) {
      (
          [&] {
            constexpr std::size_t I = Net::stage_count - 1 - R;
            using S = typename Net::template stage<I>;
            const int before = current;
            binding.template backward_stage<I>(host, store, x.data(), n, current, done, binding.tail());
            if (I == 0 || current == before) return;
            count(c.gradients, c.gradients_fp32, binding.gradient_buffer(current, n), n * S::in::size);
            if constexpr (ResidualAt<typename S::layer, typename S::in>) {
              // The body's dx, before the shortcut's is added, is in the first work buffer, except in an
              // identity block with a fused add, whose body writes the block's dx directly.
              using L = typename S::layer;
              constexpr bool identity = std::is_void_v<typename L::template projection<typename S::in>>;
              if constexpr (!(identity && L::template fused_add<typename S::in>)) {
                const float* work = binding.data() + n * (Net::activation_elements + 2 * Net::gradient_elements);
                count(c.inner, c.inner_fp32, work, n * S::in::size);
              }
            }
          }(),
          ...);
    }(std::make_index_sequence<Net::stage_count>{});
  }
  c.input_unchanged = x == x0;
  return c;
}

// The network's output is a residual block's (BatchNorm adds the identity shortcut), then a Flatten:
// the logits are the block's output.
using BlockOutputNet = fp::Sequential<fp::Input<4, 5, 5>, fp::Conv2d<4, 1>, fp::ReLU,
                                      fp::Residual<fp::Conv2d<4, 3, 1, 1>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                                      fp::Flatten>;
// An identity block whose add is a pass of its own (its body ends in a conv).
using SeparateAddNet = fp::Sequential<fp::Input<4, 5, 5>, fp::Conv2d<4, 1>,
                                      fp::Residual<fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                                   fp::IdentityShortcut>,
                                      fp::ReLU, fp::Flatten, fp::Linear<3>>;

template <class Net>
void check_storage(const char* name, bool has_block) {
  CAPTURE(name);
  // The emulation, VDPBF16PS and AMX tiles where the CPU has them (the direct convs, samples side by side).
  std::vector<fp::Host> hosts{fp::Host{2, fp::HostPrecision::bf16_emulated}};
  if (fp::cpu_features().avx512_bf16) hosts.push_back(fp::Host{2, fp::HostPrecision::bf16}.with_bf16_tiles(false));
  if (fp::amx_usable()) hosts.push_back(fp::Host{2, fp::HostPrecision::bf16});
  for (const auto& host : hosts) {
    for (const bool training : {true, false}) {
      CAPTURE(training);
      CAPTURE(host.bf16_tiles());
      const StoredCheck bf = check_stored<Net>(host, training);
      CHECK(bf.outputs_fp32 == 0);
      CHECK(bf.gradients_fp32 == 0);
      CHECK(bf.inner_fp32 == 0);
      CHECK_FALSE(bf.logits_bf16);  // the logits stay fp32, for the loss
      CHECK(bf.input_unchanged);
      // At fp32 nothing is rounded: the same check finds fp32 values in every tensor.
      const StoredCheck f = check_stored<Net>(fp::Host{2}, training);
      CHECK(f.outputs_fp32 == f.outputs);
      CHECK(f.gradients_fp32 == f.gradients);
      CHECK(f.inner_fp32 == f.inner);
      CHECK(bf.outputs == f.outputs);
      CHECK(bf.gradients == f.gradients);
      CHECK((bf.gradients > 0) == training);
      CHECK((bf.inner > 0) == (has_block && training));
    }
  }
}

}  // namespace

TEST_CASE("a bf16 Host stores every activation and activation gradient as a bf16 value, the logits in fp32") {
  check_storage<Net>("conv, pool, tanh, linear", false);
  check_storage<BlockNet>("batch norm, residual block, avg pool, GELU", true);
  check_storage<BlockOutputNet>("a residual block's output as the logits", true);
  check_storage<SeparateAddNet>("an identity block with an add of its own", true);
  check_storage<WideNet>("ResNet in small: direct convs, samples side by side", true);
}

TEST_CASE("the hardware and the emulated bf16 GEMMs train a network to the same bits") {
  if (!fp::cpu_features().avx512_bf16) {
    MESSAGE("this CPU has no AVX-512 BF16: only the emulation runs here");
    return;
  }
  // VDPBF16PS, on a network whose convs take the GEMMs (Net's: 3 and 40 channels): the direct 3x3 convs
  // and the AMX tiles add a row's products in another order (their bounds: check_against_double).
  const Result hw = run<Net, float>(fp::Host{2, fp::HostPrecision::bf16}.with_bf16_tiles(false));
  const Result em = run<Net, float>(fp::Host{2, fp::HostPrecision::bf16_emulated});
  CHECK(hw.loss == em.loss);
  CHECK(hw.logits == em.logits);
  CHECK(hw.grads == em.grads);
  if (fp::amx_usable()) {
    // The default bf16 Host here runs its products on the tiles, whose sums round differently
    // somewhere in the network (and stay within check_against_double's bounds).
    const Result tiles = run<Net, float>(fp::Host{2, fp::HostPrecision::bf16});
    CHECK(tiles.grads != em.grads);
  }
}

TEST_CASE("a Model of double needs an fp32 Host") {
  CHECK_THROWS_WITH_AS((fp::Model<Net, fp::Host, double>{fp::seed(1), fp::Host{1, fp::HostPrecision::bf16_emulated}}),
                       doctest::Contains("needs an fp32 Host"), fp::InvalidArgument);
}
