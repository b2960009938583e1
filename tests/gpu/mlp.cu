// The fully fused MLP stage: which runs of layers the Cuda plan fuses (compile-time facts), the fused
// forward and backward kernels against a chain of Host Linear stages, and whole MLP models against the
// Host model in double.
#include "gpu_test.hpp"

#include <fusedp/kernels/cuda/mlp.cuh>
#include <fusedp/kernels/host/linear.hpp>
#include <fusedp/net/cuda_plan.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;
namespace kc = fusedp::kernels::cuda;
using namespace gpu_test;
using fp::CudaGroupKind;
using fp::kernels::Epilogue;

namespace {

using seed_networks::LeNet;
using seed_networks::CifarCnn;
using Mlp64 = seed_networks::Mlp<64>;
// widths that are not multiples of 16, a smooth activation (no sign flips to measure), and a first
// layer too wide to fuse, so the fused run must hand a gradient back to it
using Tail = fp::Sequential<fp::Input<300>, fp::Linear<100>, fp::Tanh, fp::Linear<50>, fp::Tanh, fp::Linear<37>,
                            fp::Sigmoid, fp::Linear<10>>;
// a run broken by a layer whose epilogue needs its input (GELU) and a Conv2d + MaxPool2d<3> (9 does
// not divide the tile rows) that stays unfused
using Mixed = fp::Sequential<fp::Input<2, 9, 9>, fp::Conv2d<4, 3>, fp::ReLU, fp::MaxPool2d<3>, fp::Flatten,
                             fp::Linear<20>, fp::ReLU, fp::Linear<20>, fp::GELU, fp::Linear<20>, fp::ReLU, fp::Linear<5>>;

template <class Plan, std::size_t N>
constexpr bool plan_is(const std::array<fp::CudaGroupInfo, N>& want) {
  if (Plan::group_count != N) return false;
  for (std::size_t i = 0; i < N; ++i)
    if (Plan::summary[i].kind != want[i].kind || Plan::summary[i].first != want[i].first ||
        Plan::summary[i].last != want[i].last)
      return false;
  return true;
}
constexpr auto stage = CudaGroupKind::stage, conv_maxpool = CudaGroupKind::conv_maxpool, mlp = CudaGroupKind::mlp;

// LeNet: stages 0 conv+ReLU, 1 pool, 2 conv+ReLU, 3 pool, 4 Flatten, 5 Linear<120> (400 inputs: too wide),
// 6 Linear<60>, 7 Linear<10>
static_assert(plan_is<fp::CudaPlan<LeNet, fp::precision::Tf32>>(std::array<fp::CudaGroupInfo, 5>{
    {{conv_maxpool, 0, 1}, {conv_maxpool, 2, 3}, {stage, 4, 4}, {stage, 5, 5}, {mlp, 6, 7}}}));
// fp32 and bf16 keep the Linear layers apart (the fused MLP is a TF32 kernel)
static_assert(plan_is<fp::CudaPlan<LeNet, fp::precision::Fp32>>(std::array<fp::CudaGroupInfo, 6>{
    {{conv_maxpool, 0, 1}, {conv_maxpool, 2, 3}, {stage, 4, 4}, {stage, 5, 5}, {stage, 6, 6}, {stage, 7, 7}}}));
static_assert(plan_is<fp::CudaPlan<CifarCnn, fp::precision::Tf32>>(std::array<fp::CudaGroupInfo, 5>{
    {{conv_maxpool, 0, 1}, {conv_maxpool, 2, 3}, {stage, 4, 4}, {stage, 5, 5}, {stage, 6, 6}}}));
static_assert(plan_is<fp::CudaPlan<Mlp64, fp::precision::Tf32>>(std::array<fp::CudaGroupInfo, 1>{{{mlp, 0, 5}}}));
static_assert(plan_is<fp::CudaPlan<Tail, fp::precision::Tf32>>(
    std::array<fp::CudaGroupInfo, 2>{{{stage, 0, 0}, {mlp, 1, 3}}}));
// Mixed: 0 conv, 1 pool<3> (not fused), 2 Flatten, 3 Linear+ReLU, 4 Linear+GELU (saves z), 5 Linear+ReLU,
// 6 Linear: the run 5-6 fuses; 3 alone does not
static_assert(plan_is<fp::CudaPlan<Mixed, fp::precision::Tf32>>(std::array<fp::CudaGroupInfo, 6>{
    {{stage, 0, 0}, {stage, 1, 1}, {stage, 2, 2}, {stage, 3, 3}, {stage, 4, 4}, {mlp, 5, 6}}}));
static_assert(fp::CudaPlan<Tail, fp::precision::Tf32>::mlp_gradient_elements ==
              fp::align_elements(50) + fp::align_elements(37) + fp::align_elements(10));

// Fused gradient boundaries: which groups receive their dz from the input-gradient GEMM of the group
// above (past a Flatten), and which group each one writes; count: a plain dx.
template <class Plan, std::size_t N>
constexpr bool dz_fusion_is(const std::array<bool, N>& receives, const std::array<std::size_t, N>& receiver) {
  if (Plan::group_count != N) return false;
  bool ok = true;
  [&]<std::size_t... G>(std::index_sequence<G...>) {
    ((ok = ok && Plan::template receives_dz<G> == receives[G] && Plan::template dz_receiver<G> == receiver[G]), ...);
  }(std::make_index_sequence<N>{});
  return ok;
}
// LeNet: conv2's dx unpools conv1's dz, Linear<120>'s dx unpools conv2's (through the Flatten), and the
// fused MLP's kernel writes Linear<120>'s ReLU'd dz.
static_assert(dz_fusion_is<fp::CudaPlan<LeNet, fp::precision::Tf32>>(std::array<bool, 5>{true, true, false, true, false},
                                                                    std::array<std::size_t, 5>{5, 0, 5, 1, 3}));
// fp32: the Linear layers apart, each one's dx is the ReLU'd dz of the one below.
static_assert(dz_fusion_is<fp::CudaPlan<LeNet, fp::precision::Fp32>>(
    std::array<bool, 6>{true, true, false, true, true, false}, std::array<std::size_t, 6>{6, 0, 6, 1, 3, 4}));
static_assert(dz_fusion_is<fp::CudaPlan<CifarCnn, fp::precision::Tf32>>(
    std::array<bool, 5>{true, true, false, true, false}, std::array<std::size_t, 5>{5, 0, 5, 1, 3}));
// Mixed: the conv's dz comes from a MaxPool2d<3> stage (no GEMM): unfused; Linear+ReLU takes its dz from
// Linear+GELU's dx, and Linear+GELU its own (through its saved z) from the MLP's kernel.
static_assert(dz_fusion_is<fp::CudaPlan<Mixed, fp::precision::Tf32>>(
    std::array<bool, 6>{false, false, false, true, true, false}, std::array<std::size_t, 6>{6, 6, 6, 6, 3, 4}));
static_assert(dz_fusion_is<fp::CudaPlan<Mlp64, fp::precision::Tf32>>(std::array<bool, 1>{false},
                                                                    std::array<std::size_t, 1>{1}));
// Tail: the MLP's kernel writes the first Linear's Tanh'd dz.
static_assert(dz_fusion_is<fp::CudaPlan<Tail, fp::precision::Tf32>>(std::array<bool, 2>{true, false},
                                                                   std::array<std::size_t, 2>{2, 0}));

// The fused kernels of Spec against Host Linear stages in double: forward from the same inputs;
// backward from the same saved outputs (the kernel's own y of each layer), so ReLU masks agree.
template <class Spec>
void check_fused_kernels(int batch, std::uint64_t stream) {
  constexpr int n = Spec::count;
  const fp::Cuda space{0};
  REQUIRE(kc::mlp_supported<Spec>(space));  // (fused_mlp() is on: nothing in this program turns it off)
  const fp::Host host{0};
  const auto x = random_values(std::size_t(batch) * Spec::in, stream);
  const auto dy = random_values(std::size_t(batch) * Spec::out, stream + 1);
  std::array<std::vector<float>, n> w, b;
  std::array<fp::DeviceBuffer<float>, n> wd, bd, yd, dzd, dwd, dbd;
  std::array<std::vector<double>, n> y_ref, dw_ref, db_ref;
  auto xd = upload(space, x), dyd = upload(space, dy);
  auto dxd = poisoned<float>(space, std::size_t(batch) * Spec::in);
  kc::MlpArgs<n> args{};
  args.batch = batch;
  args.x = xd.data();
  args.dy = dyd.data();
  args.dx = dxd.data();
  float* dw_ptr[n];
  float* db_ptr[n];
  [&]<std::size_t... L>(std::index_sequence<L...>) {
    (
        [&] {
          using Layer = typename Spec::template layer<L>;
          const float scale = 1.0f / float(Layer::in);
          w[L] = random_values(std::size_t(Layer::out) * Layer::in, stream + 10 + L, -3 * scale, 3 * scale);
          b[L] = random_values(std::size_t(Layer::out), stream + 20 + L, -0.5f, 0.5f);
          wd[L] = upload(space, w[L]);
          bd[L] = upload(space, b[L]);
          yd[L] = poisoned<float>(space, std::size_t(batch) * Layer::out);
          dzd[L] = poisoned<float>(space, std::size_t(batch) * Layer::out);
          dwd[L] = poisoned<float>(space, w[L].size());
          dbd[L] = poisoned<float>(space, b[L].size());
          args.w[L] = wd[L].data();
          args.b[L] = bd[L].data();
          args.y[L] = yd[L].data();
          args.dz[L] = dzd[L].data();
          dw_ptr[L] = dwd[L].data();
          db_ptr[L] = dbd[L].data();
        }(),
        ...);
  }(std::make_index_sequence<n>{});
  fp::DeviceBuffer<float> scratch(kc::mlp_backward_scratch<Spec>(batch, space.sm_count()) + 1);

  kc::mlp_forward<Spec>(space, args);
  std::array<std::vector<float>, n> y;
  std::vector<double> a(x.begin(), x.end());  // the reference chain's current activations
  [&]<std::size_t... L>(std::index_sequence<L...>) {
    (
        [&] {
          using Layer = typename Spec::template layer<L>;
          std::vector<double> wl(w[L].begin(), w[L].end()), bl(b[L].begin(), b[L].end());
          y_ref[L].resize(std::size_t(batch) * Layer::out);
          double* none = nullptr;
          fp::kernels::host::linear_forward<typename Layer::epilogue>(host, std::size_t(batch), Layer::in, Layer::out,
                                                                     wl.data(), bl.data(), a.data(), y_ref[L].data(),
                                                                     none);
          y[L] = download(space, yd[L]);
          FUSEDP_CHECK_CLOSE(y[L], y_ref[L], bound<fp::Cuda>(int(L) + 1), "forward y of layer " << L);
          a = y_ref[L];
        }(),
        ...);
  }(std::make_index_sequence<n>{});

  kc::mlp_backward<Spec>(space, args, dw_ptr, db_ptr, scratch.data());
  std::vector<double> g(dy.begin(), dy.end());  // gradient of the current layer's output
  [&]<std::size_t... R>(std::index_sequence<R...>) {
    (
        [&] {
          constexpr std::size_t L = n - 1 - R;
          using Layer = typename Spec::template layer<L>;
          std::vector<double> wl(w[L].begin(), w[L].end()), yl(y[L].begin(), y[L].end());
          std::vector<double> input;
          if constexpr (L == 0) input.assign(x.begin(), x.end());
          else input.assign(y[L - 1].begin(), y[L - 1].end());
          std::vector<double> dx(std::size_t(batch) * Layer::in);
          dw_ref[L].resize(w[L].size());
          db_ref[L].resize(b[L].size());
          double* none = nullptr;
          fp::kernels::host::linear_backward<typename Layer::epilogue>(host, std::size_t(batch), Layer::in, Layer::out,
                                                                      wl.data(), input.data(), yl.data(), none,
                                                                      g.data(), dx.data(), dw_ref[L].data(),
                                                                      db_ref[L].data());
          // layer L's gradients come through n - L GEMMs of the fused chain
          FUSEDP_CHECK_CLOSE(download(space, dwd[L]), dw_ref[L], bound<fp::Cuda>(n - int(L)), "dW of layer " << L);
          FUSEDP_CHECK_CLOSE(download(space, dbd[L]), db_ref[L], bound<fp::Cuda>(n - int(L)), "db of layer " << L);
          g = dx;
        }(),
        ...);
  }(std::make_index_sequence<n>{});
  FUSEDP_CHECK_CLOSE(download(space, dxd), g, bound<fp::Cuda>(n), "dx of the run's input");

  // The run's input gradient handed to the group below's sink (cuda_groups.hpp's dx_sink) instead of
  // stored: what that sink makes of the stored dx on the host, bit for bit (ReLU's derivative is 0 or 1,
  // so nothing is rounded differently). An activation below, then a conv whose 2 x 2 max-pool was fused
  // (planes of pp x pp pooled values from (2 pp + 1)^2 pixels: a row and a column no window covers).
  const std::vector<float> dx = download(space, dxd);
  const auto same_bits = [](const std::vector<float>& got, const std::vector<float>& want) {
    return got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
  };
  {
    const auto below = random_values(dx.size(), stream + 40);  // a ReLU's outputs: zeros and not
    std::vector<float> below_relu(below.size());
    for (std::size_t i = 0; i < below.size(); ++i) below_relu[i] = below[i] > 0 ? below[i] : 0.0f;
    auto below_d = upload(space, below_relu);
    auto dz_d = poisoned<float>(space, dx.size());
    using Sink = kc::ActivationSink<Epilogue<fp::kernels::Relu>>;
    kc::mlp_backward_to<Spec>(space, args, Sink{dz_d.data(), below_d.data(), nullptr}, dw_ptr, db_ptr, scratch.data());
    std::vector<float> want(dx.size());
    const Sink on_host{want.data(), below_relu.data(), nullptr};
    for (std::size_t i = 0; i < dx.size(); ++i) on_host.put(i, dx[i]);
    CHECK_MESSAGE(same_bits(download(space, dz_d), want), "the MLP's dx through an ActivationSink");
  }
  {
    constexpr int pp = Spec::in % 25 == 0 ? 5 : 4, planes = Spec::in / (pp * pp), o = 2 * pp + 1;
    static_assert(planes * pp * pp == Spec::in, "the test's pooled planes must tile the run's input");
    const auto pooled = random_values(dx.size(), stream + 41);
    std::vector<std::uint8_t> argmax(dx.size());
    for (std::size_t i = 0; i < argmax.size(); ++i) argmax[i] = std::uint8_t((i * 7 + 3) % 4);
    auto pooled_d = upload(space, pooled);
    auto argmax_d = upload(space, argmax);
    const std::size_t dense = std::size_t(batch) * planes * o * o;
    auto dz_d = poisoned<float>(space, dense);
    using Sink = kc::UnpoolSink<Epilogue<fp::kernels::Relu>, 2>;
    kc::mlp_backward_to<Spec>(space, args, Sink(dz_d.data(), pooled_d.data(), argmax_d.data(), o, o), dw_ptr, db_ptr,
                              scratch.data());
    std::vector<float> want(dense, std::numeric_limits<float>::quiet_NaN());
    const Sink on_host(want.data(), pooled.data(), argmax.data(), o, o);
    for (std::size_t i = 0; i < dx.size(); ++i) on_host.put(i, dx[i]);
    CHECK_MESSAGE(same_bits(download(space, dz_d), want), "the MLP's dx through an UnpoolSink (every pixel written)");
  }
}

using fp::kernels::Relu;
using fp::kernels::Sigmoid;
using fp::kernels::Tanh;

}  // namespace

TEST_CASE("the fused MLP kernels match a chain of Host Linear stages") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  SUBCASE("6 layers of 64, ReLU, batch 1000 (not a multiple of the 128-row blocks)") {
    using L = kc::MlpLayer<64, 64, Epilogue<Relu>>;
    check_fused_kernels<kc::MlpSpec<L, L, L, L, L, kc::MlpLayer<64, 64, Epilogue<>>>>(1000, 100);
  }
  SUBCASE("128 wide, batch 300") {
    using L = kc::MlpLayer<128, 128, Epilogue<Relu>>;
    check_fused_kernels<kc::MlpSpec<L, L, kc::MlpLayer<128, 128, Epilogue<>>>>(300, 200);
  }
  SUBCASE("widths 100 -> 50 -> 37 -> 10 (padded to 16s), Tanh and Sigmoid, batch 77") {
    check_fused_kernels<kc::MlpSpec<kc::MlpLayer<100, 50, Epilogue<Tanh>>, kc::MlpLayer<50, 37, Epilogue<Sigmoid>>,
                                    kc::MlpLayer<37, 10, Epilogue<>>>>(77, 300);
  }
}

TEST_CASE_TEMPLATE("MLP models match the Host model in double", Space, fp::Cuda, fp::CudaFp32) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  SUBCASE("a wide first layer feeding a fused run (Tanh, Sigmoid), cross-entropy, batch 333") {
    std::vector<std::int32_t> labels(333);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = std::int32_t((i * 7) % 10);
    compare_with_host_double<Space, Tail, fp::SoftmaxCrossEntropy>(333, labels, 4, false, 400);
  }
  SUBCASE("the 64-wide MLP of the benchmark, MSE, batch 2000: outputs") {
    // ReLU masks may flip under TF32, so only the forward (continuous in its inputs) gets the tight bound
    const std::size_t batch = 2000;
    const auto x = random_values(batch * 64, 500);
    fp::Model<Mlp64, fp::Host, double> ref{fp::seed(9), fp::Host{0}};
    std::vector<double> xd(x.begin(), x.end());
    const auto out_ref = ref.predict(std::span<const double>(xd));
    fp::Model<Mlp64, Space> m{fp::seed(9), make_space<Space>()};
    const auto out = m.predict(std::span<const float>(x));
    FUSEDP_CHECK_CLOSE(std::vector<float>(out.begin(), out.end()), out_ref, bound<Space>(6), "outputs");
  }
}
