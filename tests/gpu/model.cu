// Whole models on Cuda against the Host model: a smooth CNN (Tanh, average pooling, GELU, a fused MLP
// tail) where every gradient has a tight bound, LeNet (ReLU, fused conv + max-pooling) with bounds that
// tolerate the few ReLU signs and pooling winners that TF32 and BF16 rounding flip, and a non-square
// CNN whose backward runs the fused gradient boundaries (gradient_sink.cuh); CUDA-graph replay
// against direct launches (bit for bit); the optimizer fused into the weight gradients against its
// separate pass (bit for bit); programmatic dependent launch against plain launches (bit for bit);
// backward's concurrent weight gradients against the serial order (bit for bit); a
// learning rate changed between replayed steps;
// asynchronous steps; parameter transfer; bad input. One test
// body for every space where it makes sense (Host runs it too, as a check of the harness).
#include "gpu_test.hpp"

#include "../support/seed_networks.hpp"

#include <fusedp/exec/trace.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace fp = fusedp;
using namespace gpu_test;

namespace {

using Smooth = fp::Sequential<fp::Input<3, 12, 12>, fp::Conv2d<8, 3, 1, 1>, fp::Tanh, fp::AvgPool2d<2>,
                              fp::Conv2d<12, 3>, fp::GELU, fp::Flatten, fp::Linear<40>, fp::Tanh, fp::Linear<30>,
                              fp::Sigmoid, fp::Linear<10>>;
using LeNet = seed_networks::LeNet;
// Fused gradient boundaries on a non-square plane: conv2's dx writes conv1's dz times ReLU'
// (ActivationSink), the Linear's dx unpools conv2's dz through the argmax (UnpoolSink), with the 9th row
// of conv2's 9 x 12 output left uncovered by the 2 x 2 windows.
using Oblong = fp::Sequential<fp::Input<2, 11, 14>, fp::Conv2d<6, 3, 1, 1>, fp::ReLU, fp::Conv2d<8, 3>, fp::ReLU,
                              fp::MaxPool2d<2>, fp::Flatten, fp::Linear<10>>;
// A fused MLP right after a conv + max-pool: the MLP's backward kernel unpools conv2's dz (UnpoolSink),
// with the 5th row of conv2's 5 x 8 output left uncovered.
using PooledMlp = fp::Sequential<fp::Input<2, 7, 10>, fp::Conv2d<6, 3, 1, 1>, fp::ReLU, fp::Conv2d<8, 3>, fp::ReLU,
                                 fp::MaxPool2d<2>, fp::Flatten, fp::Linear<32>, fp::ReLU, fp::Linear<10>>;
using PooledMlpPlan = fp::CudaPlan<PooledMlp, fp::precision::Tf32>;
static_assert(PooledMlpPlan::group_count == 4 && PooledMlpPlan::summary[1].kind == fp::CudaGroupKind::conv_maxpool &&
              PooledMlpPlan::summary[3].kind == fp::CudaGroupKind::mlp && PooledMlpPlan::receives_dz<1> &&
              PooledMlpPlan::dz_receiver<3> == 1);
using Mlp = fp::Sequential<fp::Input<64>, fp::Linear<64>, fp::ReLU, fp::Linear<64>, fp::ReLU, fp::Linear<64>, fp::ReLU,
                           fp::Linear<64>>;

// Dropout's mask depends on the step, which a recorded graph would freeze: such models launch directly.
using WithDropout = fp::Sequential<fp::Input<20>, fp::Linear<30>, fp::ReLU, fp::Dropout<0.2f>, fp::Linear<5>>;
static_assert(!fp::Model<WithDropout, fp::Cuda>::graph_safe);
static_assert(fp::Model<LeNet, fp::Cuda>::graph_safe && fp::Model<Mlp, fp::CudaBf16>::graph_safe);

}  // namespace

#define FUSEDP_ALL_SPACES fp::Host, fp::CudaFp32, fp::Cuda, fp::CudaBf16

TEST_CASE_TEMPLATE("a smooth CNN matches the Host model in double", Space, FUSEDP_ALL_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, Smooth, fp::SoftmaxCrossEntropy>(45, labels_for(45, 10, 1), 5, false, 10);
}

TEST_CASE_TEMPLATE("LeNet matches the Host model in double", Space, FUSEDP_ALL_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, LeNet, fp::SoftmaxCrossEntropy>(70, labels_for(70, 10, 2), 5, true, 20);
}

TEST_CASE("LeNet with its MLP group run layer by layer (as where the fused kernels cannot run) matches the Host model "
          "in double") {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(fp::Cuda);
  // An sm_86 or sm_89 lacks the shared memory for LeNet's 128-wide fused run: this is its path, with fc2's
  // input gradient written through fc1's sink.
  struct Restore {
    ~Restore() { fp::kernels::cuda::set_fused_mlp(true); }
  } restore;
  fp::kernels::cuda::set_fused_mlp(false);
  REQUIRE_FALSE(fp::kernels::cuda::fused_mlp());
  compare_with_host_double<fp::Cuda, LeNet, fp::SoftmaxCrossEntropy>(70, labels_for(70, 10, 2), 5, true, 20);
}

TEST_CASE_TEMPLATE("a non-square CNN with fused gradient boundaries matches the Host model in double", Space,
                   FUSEDP_ALL_SPACES) {
  static_assert(fp::CudaPlan<Oblong, fp::precision::Tf32>::receives_dz<0> &&
                fp::CudaPlan<Oblong, fp::precision::Tf32>::receives_dz<1>);
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, Oblong, fp::SoftmaxCrossEntropy>(37, labels_for(37, 10, 3), 5, true, 20);
}

TEST_CASE("a fused MLP that unpools the conv + max-pool below it matches the Host model in double") {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(fp::Cuda);
  compare_with_host_double<fp::Cuda, PooledMlp, fp::SoftmaxCrossEntropy>(41, labels_for(41, 10, 4), 5, true, 20);
}

TEST_CASE_TEMPLATE("a graph replay computes exactly what direct launches compute", Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  SUBCASE("LeNet, SGD with momentum") {
    const std::size_t batch = 50;
    const auto x = random_values(batch * 784, 30);
    const auto y = labels_for(batch, 10, 31);
    fp::Model<LeNet, Space> graphed{fp::seed(3), make_space<Space>()}, direct{fp::seed(3), make_space<Space>()};
    direct.use_graphs(false);
    CHECK(graphed.uses_graphs());
    fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1;
    for (int s = 0; s < 5; ++s) {
      const float a = graphed.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
      const float b = direct.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
      CHECK(a == b);
      CHECK(graphed.last_step_replayed() == (s >= 1));  // the second step records, then replays
      CHECK_FALSE(direct.last_step_replayed());
    }
    CHECK(graphed.graph_failure().empty());
    CHECK(params_on_host(graphed) == params_on_host(direct));
  }
  SUBCASE("a fused MLP, Adam, MSE, targets on the device") {
    const Space space = make_space<Space>();
    const std::size_t batch = 1000;
    const auto x = random_values(batch * 64, 40), t = random_values(batch * 64, 41);
    auto xd = upload(space, x), td = upload(space, t);
    const fp::DeviceSpan<const float> xs{xd.data(), xd.size()}, ts{td.data(), td.size()};
    fp::Model<Mlp, Space> graphed{fp::seed(4), space}, direct{fp::seed(4), space};
    direct.use_graphs(false);
    fp::Adam o1{{.lr = 1e-3f}}, o2 = o1;
    for (int s = 0; s < 4; ++s) {
      graphed.train_step_async(xs, ts, fp::MSE{}, o1);
      direct.train_step_async(xs, ts, fp::MSE{}, o2);
    }
    CHECK(graphed.last_loss() == direct.last_loss());
    CHECK(params_on_host(graphed) == params_on_host(direct));
    std::vector<float> s1(graphed.optimizer_state().size()), s2(s1.size());
    graphed.copy_optimizer_state_to_host(s1);
    direct.copy_optimizer_state_to_host(s2);
    CHECK(s1 == s2);
  }
}

// Two models' parameters, gradients and optimizer state, bit for bit.
template <class Model>
void check_same_state(Model& a, Model& b) {
  CHECK(params_on_host(a) == params_on_host(b));
  std::vector<float> g1(a.grads().size()), g2(g1.size()), s1(a.optimizer_state().size()), s2(s1.size());
  a.copy_grads_to_host(g1);
  b.copy_grads_to_host(g2);
  CHECK(g1 == g2);
  a.copy_optimizer_state_to_host(s1);
  b.copy_optimizer_state_to_host(s2);
  CHECK(s1 == s2);
}

// Issue 17: the optimizer applied by the weight-gradient GEMMs (every tensor of these networks, so no
// pass over the rest runs; tests/gpu/residual.cu has one that does) against the separate pass over every
// parameter, bit for bit: parameters, gradients and optimizer state after several steps (graphs on, so
// the replayed step reads the AnyStep slot), for SGD with Nesterov momentum and decay on the weights
// only (not the biases), and AdamW.
template <class Net, class Space, class Opt>
void check_fused_update(std::size_t batch, Opt opt, std::uint64_t stream) {
  const auto x = random_values(batch * Net::input_shape::size, stream);
  const auto y = labels_for(batch, Net::output_shape::size, stream + 1);
  fp::Model<Net, Space> fused{fp::seed(5), make_space<Space>()}, separate{fp::seed(5), make_space<Space>()};
  separate.use_fused_update(false);
  CHECK(fused.uses_fused_update());
  Opt o1 = opt, o2 = opt;
  for (int s = 0; s < 4; ++s) {
    const float a = fused.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    const float b = separate.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
    CHECK(a == b);
  }
  CHECK(fused.last_step_replayed());
  check_same_state(fused, separate);
}

TEST_CASE_TEMPLATE("weights updated in their gradients' GEMMs match the separate optimizer pass bit for bit", Space,
                   fp::CudaFp32, fp::Cuda, fp::CudaBf16) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Sgd sgd{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 5e-4f, .nesterov = true, .decay = fp::Decay::weights}};
  const fp::AdamW adamw{{.lr = 1e-3f, .weight_decay = 1e-2f}};
  check_fused_update<LeNet, Space>(50, sgd, 60);
  check_fused_update<Oblong, Space>(33, adamw, 62);
  check_fused_update<seed_networks::CifarCnn, Space>(64, sgd, 64);
}

// Issue 17: programmatic dependent launch (kernels/cuda/launch.cuh) lets each kernel be scheduled while
// the one before it finishes; every kernel waits for its predecessor first, so the results are the bits
// of plain launches: LeNet and the CIFAR-10 CNN, recorded graphs and direct launches, parameters,
// gradients and momentum after several steps. On a device before sm_90 both run plain launches.
template <class Net, class Space>
void check_dependent_launch(std::size_t batch, bool graphs, std::uint64_t stream) {
  struct Restore {
    bool was = fp::kernels::cuda::dependent_launch();
    ~Restore() { fp::kernels::cuda::set_dependent_launch(was); }
  } restore;
  const auto x = random_values(batch * Net::input_shape::size, stream);
  const auto y = labels_for(batch, Net::output_shape::size, stream + 1);
  fp::Model<Net, Space> pdl{fp::seed(6), make_space<Space>()}, plain{fp::seed(6), make_space<Space>()};
  pdl.use_graphs(graphs);
  plain.use_graphs(graphs);
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1;
  for (int s = 0; s < 4; ++s) {
    fp::kernels::cuda::set_dependent_launch(true);
    const float a = pdl.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    fp::kernels::cuda::set_dependent_launch(false);
    const float b = plain.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
    CHECK(a == b);
  }
  // Then steps queued back to back (graph replays one after another, nothing read in between): the
  // loss kernel's arrival count and every wait chained across steps.
  for (int s = 0; s < 3; ++s) {
    fp::kernels::cuda::set_dependent_launch(true);
    pdl.train_step_async(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    fp::kernels::cuda::set_dependent_launch(false);
    plain.train_step_async(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
  }
  CHECK(pdl.last_loss() == plain.last_loss());
  CHECK(pdl.last_step_replayed() == graphs);
  // A driver that refuses to record a programmatic edge makes the graphs plain (exec/cuda_graph.hpp):
  // then the graphed comparison above was plain against plain, and this says so.
  if (!pdl.graph_plain_reason().empty()) MESSAGE("graphs recorded plain, after: ", pdl.graph_plain_reason());
  check_same_state(pdl, plain);
}

TEST_CASE_TEMPLATE("programmatic dependent launch gives the bits of plain launches", Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  namespace kc = fp::kernels::cuda;
  const int arch = make_space<Space>().architecture();
  const bool was = kc::dependent_launch();
  kc::set_dependent_launch(true);
  const bool dependent = kc::launches_dependently<kc::detail::scale_gradient_kernel<float>>();
  kc::set_dependent_launch(was);
  MESSAGE("device sm_", arch, dependent ? ": dependent launches in use" : ": plain launches on both sides");
  // Built for sm_90 or later (check.sh builds for the device it runs on) and run on such a device, the
  // kernels' images hold the prologue: the comparison below is PDL against plain launches, not plain
  // against plain.
  bool built_for_90 = false;
  for (const char* a = fp::detail::built_architectures; *a != '\0';) {
    char* end = nullptr;
    const long v = std::strtol(a, &end, 10);
    built_for_90 = built_for_90 || v >= 900;
    a = (end == a) ? a + 1 : end;
  }
  if (arch >= 90 && built_for_90) CHECK(dependent);
  for (const bool graphs : {true, false}) {
    CAPTURE(graphs);
    check_dependent_launch<LeNet, Space>(64, graphs, 70);
    check_dependent_launch<seed_networks::CifarCnn, Space>(32, graphs, 72);
  }
}

// Runs without a device: a PlainLaunchScope decides before the kernel's image is asked for (which needs one).
TEST_CASE("a PlainLaunchScope makes its own thread's launches plain while it lives") {
  namespace kc = fp::kernels::cuda;
  struct Restore {
    bool was = kc::dependent_launch();
    ~Restore() { kc::set_dependent_launch(was); }
  } restore;
  kc::set_dependent_launch(true);
  CHECK_FALSE(fp::plain_launches_here());
  {
    const fp::PlainLaunchScope plain;
    CHECK(fp::plain_launches_here());
    CHECK_FALSE(kc::launches_dependently<kc::detail::scale_gradient_kernel<float>>());
    {
      const fp::PlainLaunchScope nested;
      CHECK(fp::plain_launches_here());
    }
    CHECK(fp::plain_launches_here());
    bool elsewhere = true;
    std::thread([&] { elsewhere = fp::plain_launches_here(); }).join();
    CHECK_FALSE(elsewhere);  // another thread (a Parallel replica's) keeps its dependent launches
  }
  CHECK_FALSE(fp::plain_launches_here());
  CHECK(kc::dependent_launch());
}

// Issue 17: backward's weight-gradient GEMMs on a second stream beside the next layer's input gradient
// (net/backward_cursor.hpp; concurrent branches of the recorded graph) against the serial order, bit for
// bit: the same kernels with the same operands and the same split order, only concurrent. A third model
// holds every forked weight gradient back ~0.1 ms (gpu_test::HeldBranches), so that a missing wait would
// let the model's stream overwrite what it reads, and change bits. Parameters, gradients, momentum and
// losses after steps one at a time and queued back to back; then compute_gradients, whose stage hook (a
// reducer's) must hear of every stage once, last first, when that stage's gradients are final on the
// model's stream (the hook queues a copy there, as a reducer queues its all-reduce). Launched directly
// under a trace, the weight gradients must show on the side stream's lane: branches really forked.
// tests/net/backward_cursor.cpp checks the cursor's joins against a model of two streams on the CPU.
template <class Net, class Space>
void check_backward_branches(std::size_t batch, bool graphs, std::uint64_t stream) {
  static_assert(fp::CudaGroups<Net, typename Space::precision>::branches);
  const auto x = random_values(batch * Net::input_shape::size, stream);
  const auto y = labels_for(batch, Net::output_shape::size, stream + 1);
  fp::Model<Net, Space> branched{fp::seed(8), make_space<Space>()}, serial{fp::seed(8), make_space<Space>()},
      delayed{fp::seed(8), make_space<Space>()};
  for (auto* m : {&branched, &serial, &delayed}) m->use_graphs(graphs);
  serial.use_backward_branches(false);
  CHECK(branched.uses_backward_branches());
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1, o3 = o1;
  const fp::SoftmaxCrossEntropy loss{};
  const auto xs = std::span<const float>(x);
  const auto ys = std::span(y);
  for (int s = 0; s < 4; ++s) {
    float a = 0;
    if (s == 0 && !graphs) {
      fp::trace::Recorder r;
      {
        const fp::trace::Session on(r);
        a = branched.train_step(xs, ys, loss, o1);
      }
      const auto spans = r.spans();
      CHECK(std::count_if(spans.begin(), spans.end(),
                          [](const fp::trace::Span& sp) { return sp.lane >= fp::trace::branch_lane; }) > 0);
    } else {
      a = branched.train_step(xs, ys, loss, o1);
    }
    const float b = serial.train_step(xs, ys, loss, o2);
    float c = 0;
    {
      const HeldBranches held;
      c = delayed.train_step(xs, ys, loss, o3);
    }
    CHECK(a == b);
    CHECK(c == b);
  }
  for (int s = 0; s < 3; ++s) {
    branched.train_step_async(xs, ys, loss, o1);
    serial.train_step_async(xs, ys, loss, o2);
    const HeldBranches held;
    delayed.train_step_async(xs, ys, loss, o3);
  }
  CHECK(branched.last_loss() == serial.last_loss());
  CHECK(delayed.last_loss() == serial.last_loss());
  CHECK(branched.last_step_replayed() == graphs);
  check_same_state(branched, serial);
  check_same_state(delayed, serial);
  // Every split-K GEMM's last block sets the counters it used back to zero (exec/cuda.hpp): a later GEMM
  // on the stream that found one left over would add up its parts too early.
  for (auto* m : {&branched, &serial, &delayed}) {
    const fp::ArrivalCounters counters = m->space().arrival_counters();
    const auto left = gpu_test::download(m->space(), std::span<const unsigned>(counters.data, counters.count));
    CHECK(std::count(left.begin(), left.end(), 0u) == std::ptrdiff_t(left.size()));
  }

  // Each stage's gradients as the model's stream holds them when the hook hears of the stage.
  const std::size_t n = Net::param_storage;
  std::vector<fp::DeviceBuffer<float>> seen;
  for (std::size_t i = 0; i < Net::stage_count; ++i) seen.emplace_back(n);
  std::vector<std::size_t> heard;
  float l1 = 0;
  {
    const HeldBranches held;
    l1 = delayed.compute_gradients(xs, ys, loss, [&](std::size_t stage) {
      if (heard.size() < seen.size())
        fp::copy_async(seen[heard.size()].data(), delayed.grads().data(), n, delayed.space().stream());
      heard.push_back(stage);
    });
  }
  const float l2 = serial.compute_gradients(xs, ys, loss);
  CHECK(l1 == l2);
  REQUIRE(heard.size() == Net::stage_count);
  const std::vector<float> final_grads = grads_on_host(serial);
  constexpr auto layer_of = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<std::size_t, sizeof...(I)>{Net::template stage<I>::first...};
  }(std::make_index_sequence<Net::stage_count>{});
  for (std::size_t k = 0; k < heard.size(); ++k) {
    CHECK(heard[k] == Net::stage_count - 1 - k);
    const std::vector<float> g = download(delayed.space(), std::span<float>(seen[k].data(), n));
    for (const auto& t : Net::param_layout) {
      if (t.layer != layer_of[heard[k]]) continue;
      CAPTURE(t.name.c_str());
      CHECK(std::equal(g.begin() + std::ptrdiff_t(t.offset), g.begin() + std::ptrdiff_t(t.offset + t.size),
                       final_grads.begin() + std::ptrdiff_t(t.offset)));
    }
  }
  check_same_state(delayed, serial);

  // Turned off and on again between replayed steps: a graph of its own each way, the same bits.
  branched.use_backward_branches(false);
  (void)branched.train_step(xs, ys, loss, o1);
  branched.use_backward_branches(true);
  (void)branched.train_step(xs, ys, loss, o1);
  (void)serial.train_step(xs, ys, loss, o2);
  (void)serial.train_step(xs, ys, loss, o2);
  check_same_state(branched, serial);
}

// The branch memory's reservations (Model::reserve_for): predict first, then training at that batch
// (the scratch regrown with two halves, the third buffer added); a smaller batch after reserve(B);
// branches off while a larger predict grows the model (the third buffer freed), then on again. Each
// trains as the serial order does.
template <class Net, class Space>
void check_branch_reservations(std::uint64_t stream) {
  const auto data = [&](std::size_t batch, std::uint64_t k) {
    return std::pair{random_values(batch * Net::input_shape::size, stream + k),
                     labels_for(batch, Net::output_shape::size, stream + k + 1)};
  };
  fp::Model<Net, Space> m{fp::seed(3), make_space<Space>()}, serial{fp::seed(3), make_space<Space>()};
  serial.use_backward_branches(false);
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1;
  const fp::SoftmaxCrossEntropy loss{};
  const auto step_both = [&](std::size_t batch, std::uint64_t k) {
    const auto [x, y] = data(batch, k);
    const HeldBranches held;
    const float a = m.train_step(std::span<const float>(x), std::span(y), loss, o1);
    const float b = serial.train_step(std::span<const float>(x), std::span(y), loss, o2);
    CHECK(a == b);
  };
  {
    const auto [x, y] = data(12, 10);
    (void)m.predict(std::span<const float>(x));
  }
  step_both(12, 20);
  step_both(12, 30);
  m.reserve(40);
  step_both(9, 40);
  m.use_backward_branches(false);
  {
    const auto [x, y] = data(64, 50);
    (void)m.predict(std::span<const float>(x));
  }
  step_both(20, 60);
  m.use_backward_branches(true);
  step_both(20, 70);
  step_both(64, 80);
  check_same_state(m, serial);
}

TEST_CASE_TEMPLATE("backward's concurrent weight gradients give the bits of the serial order", Space, fp::CudaFp32,
                   fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  for (const bool graphs : {true, false}) {
    CAPTURE(graphs);
    check_backward_branches<LeNet, Space>(64, graphs, 90);
    check_backward_branches<seed_networks::CifarCnn, Space>(32, graphs, 92);
    check_backward_branches<Oblong, Space>(9, graphs, 94);
    check_backward_branches<PooledMlp, Space>(7, graphs, 96);
    check_backward_branches<Smooth, Space>(5, graphs, 98);
  }
  check_branch_reservations<LeNet, Space>(100);
}

// The step's numbers are written to the device only when they change (Model::write_op_slot): with a
// constant learning rate the replayed graph reads the slot written two steps earlier; a changed one must
// still arrive. lr 0 leaves the parameters where they are (SGD: p -= lr * g); back at 0.05 they move.
TEST_CASE_TEMPLATE("a learning rate changed between replayed steps takes effect at once", Space, fp::CudaFp32,
                   fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const std::size_t batch = 32;
  const auto x = random_values(batch * 784, 80);
  const auto y = labels_for(batch, 10, 81);
  for (const bool fused : {true, false}) {
    CAPTURE(fused);
    fp::Model<LeNet, Space> m{fp::seed(9), make_space<Space>()};
    m.use_fused_update(fused);
    fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
    auto step = [&] { (void)m.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, opt); };
    for (int s = 0; s < 4; ++s) step();
    CHECK(m.last_step_replayed());
    opt.options.lr = 0.0f;
    const auto before = params_on_host(m);
    step();
    step();
    CHECK(params_on_host(m) == before);
    opt.options.lr = 0.05f;
    step();
    CHECK(params_on_host(m) != before);
    CHECK(m.last_step_replayed());
  }
}

// The loss kernel takes its options as launch arguments, which a recorded graph keeps: a changed
// label_smoothing must record the step again (StepGraphKey::loss_options), or the replay trains with the
// old one. Compared with a model that records no graph, loss and parameters bit for bit at every step.
TEST_CASE("a loss option changed between replayed steps takes effect at once") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const std::size_t batch = 32;
  const auto x = random_values(batch * 784, 82);
  const auto y = labels_for(batch, 10, 83);
  fp::Model<LeNet, fp::Cuda> graphed{fp::seed(9), fp::Cuda{0}}, direct{fp::seed(9), fp::Cuda{0}};
  direct.use_graphs(false);
  fp::Sgd og{{.lr = 0.05f, .momentum = 0.9f}}, od = og;
  for (const float smoothing : {0.1f, 0.1f, 0.1f, 0.0f, 0.0f, 0.3f}) {
    CAPTURE(smoothing);
    const fp::SoftmaxCrossEntropy loss{smoothing};
    const float a = graphed.train_step(std::span<const float>(x), std::span(y), loss, og);
    const float b = direct.train_step(std::span<const float>(x), std::span(y), loss, od);
    CHECK(a == b);
    CHECK(params_on_host(graphed) == params_on_host(direct));
  }
  CHECK(graphed.last_step_replayed() == false);  // the last step's option was new: recorded, not replayed
}

TEST_CASE("asynchronous steps and the deferred loss give what train_step gives") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const std::size_t batch = 64;
  const auto x = random_values(batch * 784, 50);
  const auto y = labels_for(batch, 10, 51);
  fp::Model<LeNet, fp::Cuda> a{fp::seed(6), fp::Cuda{0}}, b{fp::seed(6), fp::Cuda{0}};
  fp::Sgd oa{{.lr = 0.05f}}, ob = oa;
  float last = 0;
  for (int s = 0; s < 3; ++s) {
    a.train_step_async(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, oa);
    last = b.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, ob);
  }
  CHECK(a.last_loss() == last);
  CHECK(a.steps() == 3);
  CHECK(a.optimizer_steps() == 3);
}

TEST_CASE("parameters move between Host and Cuda models unchanged") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Model<LeNet, fp::Host> host{fp::seed(7), fp::Host{0}};
  fp::Model<LeNet, fp::CudaFp32> dev{fp::seed(8), fp::CudaFp32{0}};
  CHECK(params_on_host(dev) != std::vector<float>(host.params().begin(), host.params().end()));
  dev.load_params(host.params());
  CHECK(params_on_host(dev) == std::vector<float>(host.params().begin(), host.params().end()));
  const auto x = random_values(33 * 784, 60);
  const auto h = host.predict(std::span<const float>(x));
  const std::vector<float> hv(h.begin(), h.end());
  const auto d = dev.predict(std::span<const float>(x));
  FUSEDP_CHECK_CLOSE(std::vector<float>(d.begin(), d.end()), hv, bound<fp::CudaFp32>(5), "predictions");
  // a smaller batch after a larger one reuses the workspace
  dev.reserve(100);
  const auto d2 = dev.predict(std::span<const float>(x.data(), 10 * 784));
  FUSEDP_CHECK_CLOSE(std::vector<float>(d2.begin(), d2.end()), std::vector<float>(hv.begin(), hv.begin() + 100),
                     bound<fp::CudaFp32>(5), "predictions of the first 10");
  const auto labels = labels_for(33, 10, 61);
  const auto ev = dev.evaluate(std::span<const float>(x), std::span(labels), fp::SoftmaxCrossEntropy{});
  CHECK(std::isfinite(ev.loss));
  CHECK(ev.outputs.size() == 330);
}

// Every call of a Cuda model makes its device current and gives the caller's back (CudaDeviceScope), so
// models on two devices driven from one thread in any order compute what each computes alone, and the
// caller's current device is what the caller set. Before, a model made its device current only when it
// allocated: the second model's first step left device 1 current, and the first model's next launch went
// to a stream of another device. Needs two devices; skipped with one.
TEST_CASE("models on two devices driven from one thread compute what each computes alone") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  if (fp::cuda_device_count() < 2) {
    MESSAGE("skipped: needs 2 CUDA devices, " << fp::cuda_device_count() << " visible");
    return;
  }
  const std::size_t batch = 50;
  const auto x = random_values(batch * 784, 70);
  const auto y = labels_for(batch, 10, 71);
  const auto current = [] {
    int d = -1;
    REQUIRE(cudaGetDevice(&d) == cudaSuccess);
    return d;
  };
  const auto step = [&](auto& model, fp::Sgd& opt) {
    return model.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, opt);
  };
  const fp::Sgd sgd{{.lr = 0.05f, .momentum = 0.9f}};
  fp::Model<LeNet, fp::CudaFp32> alone{fp::seed(6), fp::CudaFp32{1}};
  fp::Sgd o_alone = sgd, o0 = sgd, o1 = sgd;
  std::vector<float> alone_losses;
  for (int s = 0; s < 4; ++s) alone_losses.push_back(step(alone, o_alone));
  fp::Model<LeNet, fp::CudaFp32> on0{fp::seed(6), fp::CudaFp32{0}}, on1{fp::seed(6), fp::CudaFp32{1}};
  for (int s = 0; s < 4; ++s) {
    const int caller = s % 2;  // the device the caller made current, each of the two in turn
    REQUIRE(cudaSetDevice(caller) == cudaSuccess);
    (void)step(on0, o0);
    CHECK(current() == caller);
    CHECK(step(on1, o1) == alone_losses[std::size_t(s)]);
    CHECK(current() == caller);
  }
  CHECK(on0.last_step_replayed());
  CHECK(on1.last_step_replayed());
  CHECK(params_on_host(on1) == params_on_host(alone));
  // Devices of one kind plan the same splits, so device 0's model has the same bits too.
  if (on0.space().sm_count() == on1.space().sm_count() && on0.space().architecture() == on1.space().architecture())
    CHECK(params_on_host(on0) == params_on_host(alone));
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  const auto p0 = on0.predict(std::span<const float>(x));
  const std::vector<float> v0(p0.begin(), p0.end());
  CHECK(current() == 1);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  const auto p1 = on1.predict(std::span<const float>(x));
  CHECK(current() == 0);
  CHECK(v0.size() == batch * 10);
  CHECK(std::all_of(v0.begin(), v0.end(), [](float v) { return std::isfinite(v); }));
  CHECK(std::all_of(p1.begin(), p1.end(), [](float v) { return std::isfinite(v); }));
}

TEST_CASE("bad input is refused with a clear error and changes nothing") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  fp::Model<LeNet, fp::Cuda> m{fp::seed(9), fp::Cuda{0}};
  fp::Sgd opt{{.lr = 0.1f}};
  const std::size_t batch = 16;
  const auto x = random_values(batch * 784, 70);
  auto y = labels_for(batch, 10, 71);
  const auto before = params_on_host(m);

  y[5] = 10;  // outside [0, 10)
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x), std::span(std::as_const(y)), fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  CHECK_THROWS_AS(m.train_step(std::span<const float>(x.data(), x.size() - 1), std::span(std::as_const(y)),
                               fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  CHECK(params_on_host(m) == before);
  CHECK(m.steps() == 0);

  // labels already on the device are checked by the loss kernel and reported when the loss is read
  const fp::Cuda space = m.space();
  auto xd = upload(space, x);
  auto yd = upload(space, y);
  CHECK_THROWS_AS(m.train_step(fp::DeviceSpan<const float>{xd.data(), xd.size()},
                               fp::DeviceSpan<const std::int32_t>{yd.data(), yd.size()}, fp::SoftmaxCrossEntropy{}, opt),
                  fp::InvalidArgument);
  // and the model still trains afterwards
  y[5] = 3;
  const float l = m.train_step(std::span<const float>(x), std::span(std::as_const(y)), fp::SoftmaxCrossEntropy{}, opt);
  CHECK(std::isfinite(l));
}
