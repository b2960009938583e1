// The kernels without a GEMM against the Host reference: pooling stages that are not fused (overlapping
// windows, average pooling, an activation after the pool), activation-only stages, dropout, the losses
// and the optimizers. Same test body for Host and Cuda; these kernels do not depend on the GEMM
// precision, so Cuda runs in fp32 and the bound is 1e-5 (the only differences are the last bits of
// exp, erf and tanh, and the order of the loss sum).
#include "gpu_test.hpp"

#include <cstdint>
#include <type_traits>
#include <vector>

namespace fp = fusedp;
using namespace gpu_test;
using fp::kernels::Epilogue;
using fp::kernels::Gelu;
using fp::kernels::Relu;
using fp::kernels::Tanh;

namespace {

constexpr double tight = 1e-5;

// A stage without parameters (pooling, activations, dropout) forward and backward on Space against
// Host in double fed the same inputs.
template <class Space, class Executor, class In, class Epi, class Out>
void check_plain_stage(std::size_t batch, std::uint64_t stream, bool training = true) {
  // A pointwise stage keeps its input instead of z (the model never gives it a z).
  constexpr bool saves_z = Epi::saves_input && !std::is_same_v<Executor, fp::PointwiseStage>;
  const std::size_t nx = batch * In::size, ny = batch * Out::size;
  const auto x = random_values(nx, stream), dy = random_values(ny, stream + 1);
  const fp::Host host{0};
  std::vector<double> xd(x.begin(), x.end()), dyd(dy.begin(), dy.end()), y_ref(ny), z_ref(ny), dx_ref(nx);
  fp::StageArgs<fp::Host, double> r{host,    batch,   xd.data(), y_ref.data(), saves_z ? z_ref.data() : nullptr,
                                    nullptr, nullptr, dyd.data(), dx_ref.data(), nullptr,
                                    nullptr, nullptr, training,  42,           7,
                                    3};
  Executor::template forward<In, Epi>(r);
  Executor::template backward<In, Epi>(r);

  const Space space = make_space<Space>();
  auto xs = upload(space, x), dys = upload(space, dy);
  auto ys = poisoned<float>(space, ny), zs = poisoned<float>(space, saves_z ? ny : 0),
       dxs = poisoned<float>(space, nx);
  fp::StageArgs<Space, float> a{space,   batch,   xs.data(),  ys.data(),  saves_z ? zs.data() : nullptr,
                                nullptr, nullptr, dys.data(), dxs.data(), nullptr,
                                nullptr, nullptr, training,   42,         7,
                                3};
  Executor::template forward<In, Epi>(a);
  FUSEDP_CHECK_CLOSE(download(space, ys), y_ref, tight, "y");
  if constexpr (saves_z) FUSEDP_CHECK_CLOSE(download(space, zs), z_ref, tight, "z");
  Executor::template backward<In, Epi>(a);
  FUSEDP_CHECK_CLOSE(download(space, dxs), dx_ref, tight, "dx");
}

// The mean loss and its gradient on Space.
template <class Space, class Loss, class Target>
float run_loss(const Space& space, const Loss& loss, std::size_t batch, std::size_t outputs, const std::vector<float>& y,
               const std::vector<Target>& targets, std::vector<float>& dy) {
  auto ys = upload(space, y);
  auto ts = upload(space, targets);
  auto dys = poisoned<float>(space, batch * outputs);
  float value = 0;
  if constexpr (fp::is_cuda_space_v<Space>) {
    // Twice on one result: the last block of the first launch must have reset the arrival count, or
    // the second launch's total would be taken early (or never) and differ.
    fp::kernels::cuda::LossResult result;
    result.allocate(batch);
    loss.enqueue(space, batch, outputs, ys.data(), ts.data(), dys.data(), result.output());
    value = result.read(space.stream(), Loss::name, outputs);
    loss.enqueue(space, batch, outputs, ys.data(), ts.data(), dys.data(), result.output());
    CHECK(result.read(space.stream(), Loss::name, outputs) == value);
  } else {
    value = loss(space, batch, outputs, ys.data(), ts.data(), dys.data());
  }
  dy = download(space, dys);
  return value;
}

template <class Space, class Opt>
void check_optimizer(const Opt& opt, std::uint64_t stream) {
  constexpr std::size_t n = 10007;
  const auto p0 = random_values(n, stream);
  std::vector<float> p_ref = p0, state_ref(Opt::state_slots * n, 0.0f);
  const fp::Host host{0};
  const Space space = make_space<Space>();
  auto ps = upload(space, p0);
  auto state = upload(space, std::vector<float>(Opt::state_slots * n, 0.0f));
  for (std::uint64_t t = 1; t <= 3; ++t) {
    const auto g = random_values(n, stream + t);
    opt.step(host, p_ref.data(), g.data(), state_ref.data(), n, t);
    auto gs = upload(space, g);
    opt.step(space, ps.data(), gs.data(), state.data(), n, t);
  }
  FUSEDP_CHECK_CLOSE(download(space, ps), p_ref, 1e-6, "parameters after 3 steps");
  FUSEDP_CHECK_CLOSE(download(space, state), state_ref, 1e-6, "optimizer state after 3 steps");
}

}  // namespace

#define FUSEDP_PLAIN_SPACES fp::Host, fp::CudaFp32

TEST_CASE_TEMPLATE("pooling stages that are not fused match the Host reference", Space, FUSEDP_PLAIN_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  using In = fp::Shape<5, 13, 11>;
  SUBCASE("MaxPool2d<3, 2> (overlapping windows), then ReLU") {
    using L = fp::MaxPool2d<3, 2>;
    check_plain_stage<Space, L, In, Epilogue<Relu>, L::output<In>>(7, 10);
  }
  SUBCASE("AvgPool2d<2>, then Tanh") {
    using L = fp::AvgPool2d<2>;
    check_plain_stage<Space, L, In, Epilogue<Tanh>, L::output<In>>(7, 20);
  }
  SUBCASE("MaxPool2d<2>, then GELU (saves z)") {
    using L = fp::MaxPool2d<2>;
    check_plain_stage<Space, L, In, Epilogue<Gelu>, L::output<In>>(3, 30);
  }
}

TEST_CASE_TEMPLATE("activation-only stages and dropout match the Host reference", Space, FUSEDP_PLAIN_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  using In = fp::Shape<37, 1, 1>;
  SUBCASE("GELU") { check_plain_stage<Space, fp::PointwiseStage, In, Epilogue<Gelu>, In>(301, 40); }
  SUBCASE("ReLU then Tanh") { check_plain_stage<Space, fp::PointwiseStage, In, Epilogue<Relu, Tanh>, In>(301, 50); }
  SUBCASE("Dropout(0.3), training") { check_plain_stage<Space, fp::Dropout<0.3f>, In, Epilogue<>, In>(301, 60, true); }
  SUBCASE("Dropout(0.3), evaluation") { check_plain_stage<Space, fp::Dropout<0.3f>, In, Epilogue<>, In>(301, 70, false); }
}

TEST_CASE_TEMPLATE("losses match the Host reference", Space, FUSEDP_PLAIN_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  const Space space = make_space<Space>();
  const fp::Host host{0};
  for (auto [batch, classes] : {std::pair<std::size_t, std::size_t>{300, 10}, {5, 37}, {513, 3}}) {
    CAPTURE(batch);
    CAPTURE(classes);
    // logits spread wide, so some rows are nearly one-hot: the max-subtraction path matters
    const auto logits = random_values(batch * classes, 80 + batch, -20.0f, 20.0f);
    std::vector<std::int32_t> labels(batch);
    const auto u = random_values(batch, 90 + batch, 0.0f, 1.0f);
    for (std::size_t i = 0; i < batch; ++i) labels[i] = std::int32_t(u[i] * float(classes)) % std::int32_t(classes);
    std::vector<double> ld(logits.begin(), logits.end()), d_ref(logits.size());
    const double ref = fp::SoftmaxCrossEntropy{}(host, batch, classes, ld.data(), labels.data(), d_ref.data());
    std::vector<float> d;
    const float got = run_loss(space, fp::SoftmaxCrossEntropy{}, batch, classes, logits, labels, d);
    CHECK(std::abs(got - ref) <= tight * std::abs(ref));
    FUSEDP_CHECK_CLOSE(d, d_ref, tight, "dlogits");
  }
  {
    const std::size_t batch = 300, outputs = 7;
    const auto y = random_values(batch * outputs, 100), t = random_values(batch * outputs, 101);
    std::vector<double> yd(y.begin(), y.end()), td(t.begin(), t.end()), d_ref(y.size());
    const double ref = fp::MSE{}(host, batch, outputs, yd.data(), td.data(), d_ref.data());
    std::vector<float> d;
    const float got = run_loss(space, fp::MSE{}, batch, outputs, y, t, d);
    CHECK(std::abs(got - ref) <= tight * std::abs(ref));
    FUSEDP_CHECK_CLOSE(d, d_ref, tight, "MSE gradient");
  }
}

TEST_CASE_TEMPLATE("optimizers match the Host reference over the flat buffer", Space, FUSEDP_PLAIN_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  check_optimizer<Space>(fp::Sgd{{.lr = 0.05f}}, 200);
  check_optimizer<Space>(fp::Sgd{{.lr = 0.05f, .momentum = 0.9f, .nesterov = true}}, 210);
  check_optimizer<Space>(fp::Sgd{{.lr = 0.05f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f}}, 220);
  check_optimizer<Space>(fp::Adam{{.lr = 1e-2f, .weight_decay = 1e-3f}}, 230);
  check_optimizer<Space>(fp::AdamW{{.lr = 1e-2f}}, 240);
}
