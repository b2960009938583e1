// tests include/fusedp/net/cuda_plan.hpp where g++ alone can: the Cuda plan is a compile-time fact of
// the network type, so it is checked here without nvcc (tests/gpu/mlp.cu holds the seed networks'
// plans; this file what naming layers must not change, and which weights a training step updates in
// their gradients' GEMMs).
#include <doctest/doctest.h>

#include <fusedp/kernels/optimizer.hpp>
#include <fusedp/layers/named.hpp>
#include <fusedp/models/resnet.hpp>
#include <fusedp/net/cuda_plan.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;

namespace {

inline constexpr char conv1[] = "conv1";
inline constexpr char pool1[] = "pool1";
inline constexpr char conv2[] = "conv2";
inline constexpr char pool2[] = "pool2";
inline constexpr char fc1[] = "fc1";
inline constexpr char fc2[] = "fc2";
inline constexpr char fc3[] = "fc3";

// LeNet with every layer that has parameters or a window under a name (checkpoint keys as a PyTorch
// module with named children would have them).
using NamedLeNet =
    fp::Sequential<fp::Input<1, 28, 28>, fp::Named<conv1, fp::Conv2d<6, 5>>, fp::ReLU, fp::Named<pool1, fp::MaxPool2d<2>>,
                   fp::Named<conv2, fp::Conv2d<16, 3>>, fp::ReLU, fp::Named<pool2, fp::MaxPool2d<2>>, fp::Flatten,
                   fp::Named<fc1, fp::Linear<120>>, fp::ReLU, fp::Named<fc2, fp::Linear<60>>, fp::ReLU,
                   fp::Named<fc3, fp::Linear<10>>>;

// Whether two plans have the same groups (kind, first and last stage) and the same fused gradient
// boundaries.
template <class A, class B>
constexpr bool same_plan() {
  if (A::group_count != B::group_count) return false;
  for (std::size_t i = 0; i < A::group_count; ++i)
    if (A::summary[i].kind != B::summary[i].kind || A::summary[i].first != B::summary[i].first ||
        A::summary[i].last != B::summary[i].last)
      return false;
  return [&]<std::size_t... G>(std::index_sequence<G...>) {
    return ((A::template receives_dz<G> == B::template receives_dz<G> &&
             A::template dz_receiver<G> == B::template dz_receiver<G>) && ...);
  }(std::make_index_sequence<A::group_count>{});
}

template <class P>
using Named = fp::CudaPlan<NamedLeNet, P>;
template <class P>
using Plain = fp::CudaPlan<seed_networks::LeNet, P>;

// Before Named was seen through, a named conv lost its max-pool fusion and a named Linear run its
// fused MLP and every fused gradient boundary.
static_assert(same_plan<Named<fp::precision::Tf32>, Plain<fp::precision::Tf32>>());
static_assert(same_plan<Named<fp::precision::Fp32>, Plain<fp::precision::Fp32>>());
static_assert(Named<fp::precision::Tf32>::summary[0].kind == fp::CudaGroupKind::conv_maxpool);
static_assert(Named<fp::precision::Tf32>::summary[4].kind == fp::CudaGroupKind::mlp);

}  // namespace

TEST_CASE("a named layer is planned on Cuda as the layer itself") {
  CHECK(same_plan<Named<fp::precision::Tf32>, Plain<fp::precision::Tf32>>());
  CHECK(same_plan<Named<fp::precision::Fp32>, Plain<fp::precision::Fp32>>());
  CHECK(Named<fp::precision::Tf32>::receives_dz<0>);
  CHECK(Named<fp::precision::Tf32>::receives_dz<1>);
}

namespace {

// The weights updated in their GEMMs and the rest runs partition the flat buffer: in order, each run
// non-empty, the rest's prefix counts right, every updated run exactly one Conv2d or Linear weight.
template <class Plan, class Net>
constexpr bool partitions_the_buffer() {
  const std::size_t u = Plan::updated_weights.size() / 2, r = Plan::rest_run_count;
  std::size_t at = 0, ui = 0, ri = 0, before = 0;
  while (ui < u || ri < r) {
    if (ui < u && Plan::updated_weights[2 * ui] == at) {
      bool one_weight = false;
      for (const fusedp::ParamTensor& t : Net::param_layout)
        one_weight = one_weight || (t.offset == at && t.size == Plan::updated_weights[2 * ui + 1] - at && t.gemm_weight());
      if (!one_weight) return false;
      at = Plan::updated_weights[2 * ui++ + 1];
    } else if (ri < r && Plan::rest_runs[2 * ri] == at && Plan::rest_runs[2 * ri + 1] > at) {
      if (Plan::rest_runs[2 * r + ri] != before) return false;
      before += Plan::rest_runs[2 * ri + 1] - at;
      at = Plan::rest_runs[2 * ri++ + 1];
    } else {
      return false;  // a gap, an overlap or an empty run
    }
  }
  return at == Net::param_storage && Plan::rest_runs[3 * r] == before && Plan::rest_elements == before;
}

// The parameter names (PyTorch keys) of the weights updated in their GEMMs.
template <class Plan, class Net>
std::vector<std::string> updated_names() {
  std::vector<std::string> names;
  for (std::size_t k = 0; k < Plan::updated_weights.size() / 2; ++k)
    for (const fusedp::ParamTensor& t : Net::param_layout)
      if (t.offset == Plan::updated_weights[2 * k]) names.push_back(t.name.c_str());
  return names;
}

using seed_networks::CifarCnn;
using seed_networks::LeNet;
using ResNet = fp::models::ResNet18Cifar<10>;
static_assert(partitions_the_buffer<Plain<fp::precision::Tf32>, LeNet>());
static_assert(partitions_the_buffer<Plain<fp::precision::Fp32>, LeNet>());
static_assert(partitions_the_buffer<fp::CudaPlan<CifarCnn, fp::precision::Tf32>, CifarCnn>());
static_assert(partitions_the_buffer<fp::CudaPlan<ResNet, fp::precision::Tf32>, ResNet>());

}  // namespace

TEST_CASE("which weights a Cuda training step updates in their gradients' GEMMs") {
  // LeNet in TF32: the two convs (each fused with its pooling) and the Linear 400 -> 120; the last two
  // Linear layers form the fused MLP, whose kernels compute their own weight gradients, so the pass
  // over the rest updates them.
  CHECK(updated_names<Plain<fp::precision::Tf32>, LeNet>() ==
        std::vector<std::string>{"0.weight", "3.weight", "7.weight"});
  CHECK(Plain<fp::precision::Tf32>::updates_weight<0>);
  CHECK_FALSE(Plain<fp::precision::Tf32>::updates_weight<2>);  // Flatten
  CHECK_FALSE(Plain<fp::precision::Tf32>::updates_weight<4>);  // the MLP group
  // In FP32 there is no fused MLP: every weight, so the rest is the biases and the padding.
  CHECK(updated_names<Plain<fp::precision::Fp32>, LeNet>() ==
        std::vector<std::string>{"0.weight", "3.weight", "7.weight", "9.weight", "11.weight"});
  std::size_t biases = 0;
  for (const fp::ParamTensor& t : LeNet::param_layout) biases += t.gemm_weight() ? 0 : t.size;
  CHECK(Plain<fp::precision::Fp32>::rest_elements >= biases);
  CHECK(Plain<fp::precision::Fp32>::rest_elements < biases + 5 * fp::align_elements_count);
  // Named layers are the same layers.
  CHECK(updated_names<Named<fp::precision::Tf32>, NamedLeNet>() ==
        std::vector<std::string>{"conv1.weight", "conv2.weight", "fc1.weight"});
  // ResNet-18: the stem and the classifier; the blocks' weights take the pass over the rest.
  CHECK(updated_names<fp::CudaPlan<ResNet, fp::precision::Tf32>, ResNet>() ==
        std::vector<std::string>{"conv1.weight", "fc.weight"});
}

TEST_CASE("ElementRuns numbers the rest of the buffer consecutively") {
  using Plan = Plain<fp::precision::Tf32>;
  const fp::kernels::ElementRuns rest{Plan::rest_runs.data(), Plan::rest_runs.data() + 2 * Plan::rest_run_count,
                                      Plan::rest_run_count};
  std::vector<int> covered(LeNet::param_storage, 0);
  for (std::size_t k = 0; k < Plan::updated_weights.size() / 2; ++k)
    for (std::size_t i = Plan::updated_weights[2 * k]; i < Plan::updated_weights[2 * k + 1]; ++i) ++covered[i];
  REQUIRE(rest.size() == Plan::rest_elements);
  std::size_t previous = 0;
  for (std::size_t j = 0; j < rest.size(); ++j) {
    const std::size_t i = rest.index(j);
    REQUIRE(i < covered.size());
    if (j > 0) REQUIRE(i > previous);  // in order
    previous = i;
    ++covered[i];
  }
  for (std::size_t i = 0; i < covered.size(); ++i) {
    CAPTURE(i);
    REQUIRE(covered[i] == 1);  // every element by the GEMMs or by the rest, once
  }

  // Runs with gaps, of one element, and at the buffer's end.
  const std::size_t bounds[] = {0, 3, 5, 6, 10, 14};
  const std::size_t prefix[] = {0, 3, 4, 8};
  const fp::kernels::ElementRuns runs{bounds, prefix, 3};
  std::vector<std::size_t> got;
  for (std::size_t j = 0; j < runs.size(); ++j) got.push_back(runs.index(j));
  CHECK(got == std::vector<std::size_t>{0, 1, 2, 5, 10, 11, 12, 13});
  CHECK(fp::kernels::ElementRuns{}.size() == 0);
}
