// tests include/fusedp/net/cuda_plan.hpp where g++ alone can: the Cuda plan is a compile-time fact of
// the network type, so it is checked here without nvcc (tests/gpu/mlp.cu holds the seed networks'
// plans; this file what naming layers must not change, and which weights a training step updates in
// their gradients' GEMMs).
#include <doctest/doctest.h>

#include <fusedp/kernels/bf16.hpp>
#include <fusedp/kernels/optimizer.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/batch_norm.hpp>
#include <fusedp/layers/dropout.hpp>
#include <fusedp/layers/named.hpp>
#include <fusedp/models/resnet.hpp>
#include <fusedp/net/cuda_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
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
  // fc1 (Linear<120> + ReLU) receives its dz from the fused MLP's kernel (fc2, fc3).
  CHECK(Named<fp::precision::Tf32>::summary[3].kind == fp::CudaGroupKind::stage);
  CHECK(Named<fp::precision::Tf32>::receives_dz<3>);
  CHECK(Named<fp::precision::Tf32>::dz_receiver<4> == 3);
  CHECK_FALSE(Named<fp::precision::Tf32>::receives_dz<4>);
}

namespace {

// The tensors updated in their GEMMs and the rest runs cover every parameter tensor exactly once and
// nothing else (padding stays out: it holds zeros, which every update keeps): each updated pair is one
// tensor; each rest run a sequence of adjacent tensors; both in order; the rest's prefix counts right.
template <class Plan, class Net>
constexpr bool partitions_the_tensors() {
  const std::size_t u = Plan::updated_tensors.size() / 2, r = Plan::rest_run_count;
  std::size_t ui = 0, ri = 0, in_rest = 0, rest_end = 0;
  for (const fusedp::ParamTensor& t : Net::param_layout) {
    if (ui < u && Plan::updated_tensors[2 * ui] == t.offset) {
      if (Plan::updated_tensors[2 * ui + 1] != t.offset + t.size) return false;
      ++ui;
    } else if (rest_end == t.offset && ri > 0) {  // continues the current rest run
      rest_end += t.size;
      in_rest += t.size;
      if (Plan::rest_runs[2 * ri - 1] < rest_end) return false;
    } else if (ri < r && Plan::rest_runs[2 * ri] == t.offset) {  // starts the next one
      if (ri > 0 && Plan::rest_runs[2 * ri - 1] != rest_end) return false;
      if (Plan::rest_runs[2 * r + ri] != in_rest) return false;
      rest_end = t.offset + t.size;
      in_rest += t.size;
      ++ri;
    } else {
      return false;  // a tensor in neither
    }
  }
  return ui == u && ri == r && (r == 0 || Plan::rest_runs[2 * r - 1] == rest_end) &&
         Plan::rest_runs[3 * r] == in_rest && Plan::rest_elements == in_rest;
}

// The parameter names (PyTorch keys) of the tensors updated in their GEMMs.
template <class Plan, class Net>
std::vector<std::string> updated_names() {
  std::vector<std::string> names;
  for (std::size_t k = 0; k < Plan::updated_tensors.size() / 2; ++k)
    for (const fusedp::ParamTensor& t : Net::param_layout)
      if (t.offset == Plan::updated_tensors[2 * k]) names.push_back(t.name.c_str());
  return names;
}

using seed_networks::CifarCnn;
using seed_networks::LeNet;
using ResNet = fp::models::ResNet18Cifar<10>;
static_assert(partitions_the_tensors<Plain<fp::precision::Tf32>, LeNet>());
static_assert(partitions_the_tensors<Plain<fp::precision::Fp32>, LeNet>());
static_assert(partitions_the_tensors<fp::CudaPlan<CifarCnn, fp::precision::Tf32>, CifarCnn>());
static_assert(partitions_the_tensors<fp::CudaPlan<ResNet, fp::precision::Tf32>, ResNet>());
static_assert(partitions_the_tensors<fp::CudaPlan<ResNet, fp::precision::Bf16>, ResNet>());

}  // namespace

TEST_CASE("which tensors a Cuda training step updates in their gradients' GEMMs") {
  // LeNet and the CIFAR-10 CNN: every tensor (the convs with their pooling, the Linear 400 -> 120, the
  // fused MLP's layers), so no separate optimizer pass runs at all.
  const std::vector<std::string> lenet{"0.weight", "0.bias", "3.weight", "3.bias", "7.weight",
                                       "7.bias",   "9.weight", "9.bias", "11.weight", "11.bias"};
  CHECK(updated_names<Plain<fp::precision::Tf32>, LeNet>() == lenet);
  CHECK(updated_names<Plain<fp::precision::Fp32>, LeNet>() == lenet);  // no MLP group: Linear stages
  CHECK(Plain<fp::precision::Tf32>::rest_run_count == 0);
  CHECK(fp::CudaPlan<CifarCnn, fp::precision::Tf32>::rest_run_count == 0);
  CHECK(Plain<fp::precision::Tf32>::updates_in_gemm<0>);        // conv + max-pool
  CHECK_FALSE(Plain<fp::precision::Tf32>::updates_in_gemm<2>);  // Flatten
  CHECK(Plain<fp::precision::Tf32>::updates_in_gemm<4>);        // the MLP group
  CHECK(Plain<fp::precision::Tf32>::stage_updates_in_gemm<6>);  // a Linear inside it
  CHECK_FALSE(Plain<fp::precision::Tf32>::stage_updates_in_gemm<1>);  // the max-pool fused into conv1
  // Each layer's weight decays under Decay::weights, its bias does not: where the targets point.
  CHECK(Plain<fp::precision::Tf32>::weight_offset<0> == LeNet::param_layout[0].offset);
  CHECK(Plain<fp::precision::Tf32>::bias_offset<0> == LeNet::param_layout[1].offset);
  CHECK(Plain<fp::precision::Tf32>::weight_offset<7> == LeNet::param_layout[8].offset);  // Linear<10>
  // Named layers are the same layers.
  CHECK(updated_names<Named<fp::precision::Tf32>, NamedLeNet>().front() == "conv1.weight");
  CHECK(updated_names<Named<fp::precision::Tf32>, NamedLeNet>().back() == "fc3.bias");
  // ResNet-18: the stem conv (no bias) and the classifier; the blocks and every BatchNorm take the
  // pass over the rest.
  using RPlan = fp::CudaPlan<ResNet, fp::precision::Tf32>;
  CHECK(updated_names<RPlan, ResNet>() == std::vector<std::string>{"conv1.weight", "fc.weight", "fc.bias"});
  CHECK(RPlan::bias_offset<0> == fp::detail::no_tensor);
  CHECK(RPlan::rest_elements == ResNet::param_count - 64 * 3 * 3 * 3 - 512 * 10 - 10);
}

TEST_CASE("ElementRuns numbers the rest of the tensors consecutively") {
  using Plan = fp::CudaPlan<ResNet, fp::precision::Tf32>;
  const fp::kernels::ElementRuns rest{Plan::rest_runs.data(), Plan::rest_runs.data() + 2 * Plan::rest_run_count,
                                      Plan::rest_run_count, Plan::rest_elements};
  static_assert(Plan::rest_runs[3 * Plan::rest_run_count] == Plan::rest_elements);  // the prefix's total
  std::vector<int> covered(ResNet::param_storage, 0);
  for (std::size_t k = 0; k < Plan::updated_tensors.size() / 2; ++k)
    for (std::size_t i = Plan::updated_tensors[2 * k]; i < Plan::updated_tensors[2 * k + 1]; ++i) ++covered[i];
  REQUIRE(rest.size() == Plan::rest_elements);
  std::size_t previous = 0;
  bool inside = true, ordered = true;  // (one check each: 11 million assertions are slow under sanitizers)
  for (std::size_t j = 0; j < rest.size() && inside; ++j) {
    const std::size_t i = rest.index(j);
    inside = i < covered.size();
    ordered = ordered && (j == 0 || i > previous);
    previous = i;
    if (inside) ++covered[i];
  }
  CHECK(inside);
  CHECK(ordered);
  std::vector<int> tensor(ResNet::param_storage, 0);
  for (const fp::ParamTensor& t : ResNet::param_layout)
    for (std::size_t i = t.offset; i < t.offset + t.size; ++i) tensor[i] = 1;
  CHECK(covered == tensor);  // every tensor element once (by the GEMMs or by the rest), no padding

  // Runs with gaps, of one element, and at the buffer's end.
  const std::size_t bounds[] = {0, 3, 5, 6, 10, 14};
  const std::size_t prefix[] = {0, 3, 4, 8};
  const fp::kernels::ElementRuns runs{bounds, prefix, 3, 8};
  std::vector<std::size_t> got;
  for (std::size_t j = 0; j < runs.size(); ++j) got.push_back(runs.index(j));
  CHECK(got == std::vector<std::size_t>{0, 1, 2, 5, 10, 11, 12, 13});
  CHECK(fp::kernels::ElementRuns{}.size() == 0);
  // The host sizes the pass's launch from size(), and a model's arrays are device memory, which the host
  // cannot read (CudaModel::rest_runs): size() reads neither array.
  CHECK(fp::kernels::ElementRuns{nullptr, nullptr, 3, 8}.size() == 8);
}

namespace {

// `s` with 'b' for a 16-bit element, as the build plans it: all 'f' under -DFUSEDP_CUDA_NARROW_OUTPUTS=0.
std::string narrowed(std::string s) {
  if (!fp::cuda_narrow_outputs) std::replace(s.begin(), s.end(), 'b', 'f');
  return s;
}

// The elements of every group's output and input under a plan, as 'b' (BFloat16) or 'f' (float).
template <class Plan>
std::string output_elements() {
  return [&]<std::size_t... G>(std::index_sequence<G...>) {
    return std::string{(std::is_same_v<typename Plan::template output_element<G>, fp::kernels::BFloat16> ? 'b' : 'f')...};
  }(std::make_index_sequence<Plan::group_count>{});
}
template <class Plan>
std::string input_elements() {
  return [&]<std::size_t... G>(std::index_sequence<G...>) {
    return std::string{(std::is_same_v<typename Plan::template input_element<G>, fp::kernels::BFloat16> ? 'b' : 'f')...};
  }(std::make_index_sequence<Plan::group_count>{});
}

// A conv whose reader (the next conv) runs the BatchNorm after it in its epilogue in evaluation; a Tanh
// conv, a Linear read by Dropout, a Linear that saves its input (GELU).
using FoldingReader = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                     fp::BatchNorm2d<>, fp::ReLU, fp::Flatten, fp::Linear<6>, fp::Tanh, fp::Linear<3>>;
using TanhAndDropout = fp::Sequential<fp::Input<2, 6, 6>, fp::Conv2d<3, 3>, fp::Tanh, fp::Flatten, fp::Linear<8>,
                                      fp::ReLU, fp::Dropout<0.25f>, fp::Linear<5>, fp::GELU, fp::Linear<2>>;

}  // namespace

TEST_CASE("which group outputs a Bf16 Cuda plan stores in 16 bits") {
  using fp::precision::Bf16;
  // CIFAR-10 CNN: conv1 + pool, conv2 + pool, Flatten, fc1 + ReLU, fc2. Both pooled outputs and fc1's are
  // read only by the GEMMs above them and by the sinks that write their dz; the logits stay fp32.
  using Cifar = fp::CudaPlan<CifarCnn, Bf16>;
  CHECK(output_elements<Cifar>() == narrowed("bbfbf"));
  CHECK(input_elements<Cifar>() == narrowed("fbbbb"));  // the Flatten reads conv2's pooled values too (it moves nothing)
  CHECK(Cifar::narrow_output<0> == fp::cuda_narrow_outputs);
  CHECK_FALSE(Cifar::narrow_output<4>);
  // Only Bf16 narrows.
  CHECK(output_elements<fp::CudaPlan<CifarCnn, fp::precision::Tf32>>() == "fffff");
  CHECK(input_elements<fp::CudaPlan<CifarCnn, fp::precision::Fp32>>() == "fffff");
  // LeNet (no fused MLP under Bf16): conv1 + pool, conv2 + pool, Flatten, fc1, fc2, fc3.
  CHECK(output_elements<Plain<Bf16>>() == narrowed("bbfbbf"));
  CHECK(input_elements<Plain<Bf16>>() == narrowed("fbbbbb"));
  CHECK(output_elements<Plain<fp::precision::Tf32>>() == "fffff");  // fc2 and fc3 one fused MLP
  // conv1's reader folds a BatchNorm in evaluation (a conv with no epilogue before BatchNorm2d), which
  // the binding runs with the workspace's elements: conv1's output is narrowed (it receives its dz), and
  // so is conv2's, which the BatchNorm reads in 16 bits; the BatchNorm's is not (a Linear reads it).
  // Groups: conv1, conv2, BatchNorm, Flatten, fc1 + Tanh, fc2.
  using Folding = fp::CudaPlan<FoldingReader, Bf16>;
  REQUIRE(Folding::group_count == 6);
  CHECK(Folding::receives_dz<0>);
  CHECK(output_elements<Folding>() == narrowed("bbffbf"));
  CHECK(input_elements<Folding>() == narrowed("fbbffb"));
  // A Tanh conv's output is narrowed (the sink reads the stored y for the derivative), and so is a
  // Linear's that saves its input (GELU: z stays fp32). The Linear read by Dropout is not. Groups: conv +
  // Tanh, Flatten, fc1 + ReLU, Dropout, fc2 + GELU, fc3.
  using Dropping = fp::CudaPlan<TanhAndDropout, Bf16>;
  REQUIRE(Dropping::group_count == 6);
  CHECK(output_elements<Dropping>() == narrowed("bfffbf"));
  CHECK(input_elements<Dropping>() == narrowed("fbbffb"));
}

namespace {

// Whether Layout places every stage's output (and saved values) of Net in disjoint regions, in Net's
// order, each at least `need(i)` floats per sample (saved values: `saved(i)`, where that is not 0, else
// Net's size), within activation_elements.
template <class Net, class Layout, class Need, class Saved>
constexpr bool places_disjoint(Need need, Saved saved) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < Net::stage_count; ++i) {
    const fp::StagePlan& p = Layout::stage_plan[i];
    const fp::StagePlan& q = Net::stage_plan[i];
    if (p.aliases_input != q.aliases_input || p.saves_z != q.saves_z || p.weight != q.weight || p.bias != q.bias ||
        p.state != q.state || p.has_state != q.has_state)
      return false;
    if (!p.aliases_input) {
      if (p.out_offset < at || p.out_offset % fp::align_elements_count != 0) return false;
      at = p.out_offset + need(i);
    }
    if (p.saves_z) {
      if (p.z_offset < at) return false;
      std::size_t end = Net::activation_elements;  // Net's saved region runs to the next region Net places
      for (const fp::StagePlan& r : Net::stage_plan) {
        if (!r.aliases_input && r.out_offset > q.z_offset) end = std::min(end, r.out_offset);
        if (r.saves_z && r.z_offset > q.z_offset) end = std::min(end, r.z_offset);
      }
      at = p.z_offset + (saved(i) != 0 ? saved(i) : end - q.z_offset);
    }
  }
  return at <= Layout::activation_elements &&
         Layout::workspace_elements_per_sample ==
             Layout::activation_elements + 2 * Layout::gradient_elements + Layout::backward_elements;
}
template <class Net, class Layout, class Need>
constexpr bool places_disjoint(Need need) {
  return places_disjoint<Net, Layout>(need, [](std::size_t) { return std::size_t(0); });
}

template <class Net, class P>
using Workspace = fp::CudaWorkspace<Net, P>;

// The groups whose output Plan stores in 16 bits.
template <class Plan>
std::vector<std::size_t> narrowed_groups() {
  std::vector<std::size_t> r;
  [&]<std::size_t... G>(std::index_sequence<G...>) {
    ((Plan::template narrow_output<G> ? r.push_back(G) : void()), ...);
  }(std::make_index_sequence<Plan::group_count>{});
  return r;
}

// What the Cuda kernels store in each stage's output region, in floats a sample: the outputs, but a
// fused conv + max-pool's conv only its argmax bytes (one a window of the pooled output) and a 16-bit
// output half its values' floats. As a callable for places_disjoint.
template <class Net, class P>
constexpr auto cuda_needs() {
  using plan = fp::CudaPlan<Net, P>;
  std::array<std::size_t, Net::stage_count> need = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<std::size_t, Net::stage_count>{Net::template stage<I>::out::size...};
  }(std::make_index_sequence<Net::stage_count>{});
  const auto full = need;
  [&]<std::size_t... G>(std::index_sequence<G...>) {
    (((plan::template group<G>::kind == fp::CudaGroupKind::conv_maxpool
           ? need[plan::template group<G>::first] = (full[plan::template group<G>::first + 1] + 3) / 4
           : 0),
      (plan::template narrow_output<G> ? need[plan::template group<G>::last] = (full[plan::template group<G>::last] + 1) / 2
                                        : 0)),
     ...);
  }(std::make_index_sequence<plan::group_count>{});
  return [need](std::size_t i) { return need[i]; };
}

// Odd planes: a 4 x 4 max-pool over 13 x 14 conv outputs leaves a row and two columns uncovered; the
// GELU Linear saves its pre-activation (a z region) right after its output.
using OddPool = fp::Sequential<fp::Input<2, 13, 14>, fp::Conv2d<5, 3, 1, 1>, fp::Tanh, fp::MaxPool2d<4>,
                               fp::Conv2d<3, 1>, fp::ReLU, fp::Flatten, fp::Linear<7>, fp::GELU, fp::Linear<3>>;

}  // namespace

TEST_CASE("the Cuda workspace keeps only the argmax bytes of a fused conv + max-pool and halves 16-bit outputs") {
  using LeNet = seed_networks::LeNet;
  using fp::precision::Bf16;
  using fp::precision::Fp32;
  using fp::precision::Tf32;
  // LeNet per sample: conv1's 6 x 24 x 24 outputs become the 6 x 12 x 12 argmax bytes (216 floats, 224
  // aligned), conv2's 16 x 10 x 10 the 16 x 5 x 5 bytes (100, 112 aligned); the rest as Net places them
  // (864 + 400 + 128 + 64 + 16).
  CHECK(LeNet::activation_elements == 6528);
  CHECK(Workspace<LeNet, Tf32>::activation_elements == 224 + 864 + 112 + 400 + 128 + 64 + 16);
  CHECK(Workspace<LeNet, Tf32>::workspace_elements_per_sample == 1808 + 2 * 3456);
  CHECK(Workspace<LeNet, Fp32>::workspace_elements_per_sample == 1808 + 2 * 3456);
  // Under Bf16 pool1, pool2, fc1 and fc2 are narrowed (no fused MLP): half the floats, aligned.
  CHECK(Workspace<LeNet, Bf16>::activation_elements ==
        (fp::cuda_narrow_outputs ? 224 + 432 + 112 + 208 + 64 + 32 + 16 : 1808));
  // The CIFAR-10 CNN: 65,536 and 32,768 conv floats become 4,096 and 2,048; under Bf16 pool1, pool2
  // and fc1 halve too.
  CHECK(Workspace<CifarCnn, Tf32>::activation_elements == 4096 + 16384 + 2048 + 8192 + 1024 + 16);
  CHECK(Workspace<CifarCnn, Bf16>::activation_elements ==
        (fp::cuda_narrow_outputs ? 4096 + 8192 + 2048 + 4096 + 512 + 16 : 31760));
  CHECK(CifarCnn::workspace_elements_per_sample - Workspace<CifarCnn, Tf32>::workspace_elements_per_sample == 92160);
  CHECK(Workspace<CifarCnn, Tf32>::gradient_elements == CifarCnn::gradient_elements);

  // Every region disjoint and large enough for what the Cuda kernels store in it.
  static_assert(places_disjoint<LeNet, Workspace<LeNet, Tf32>>(cuda_needs<LeNet, Tf32>()));
  static_assert(places_disjoint<LeNet, Workspace<LeNet, Bf16>>(cuda_needs<LeNet, Bf16>()));
  static_assert(places_disjoint<CifarCnn, Workspace<CifarCnn, Tf32>>(cuda_needs<CifarCnn, Tf32>()));
  static_assert(places_disjoint<CifarCnn, Workspace<CifarCnn, Bf16>>(cuda_needs<CifarCnn, Bf16>()));
  static_assert(places_disjoint<OddPool, Workspace<OddPool, Bf16>>(cuda_needs<OddPool, Bf16>()));
  // ResNet-18 has no conv + max-pool group and no 16-bit group output: in TF32 Net's own layout.
  static_assert(places_disjoint<ResNet, Workspace<ResNet, Tf32>>(cuda_needs<ResNet, Tf32>()));
  CHECK(Workspace<ResNet, Tf32>::activation_elements == ResNet::activation_elements);
  CHECK(Workspace<ResNet, Tf32>::workspace_elements_per_sample == ResNet::workspace_elements_per_sample);
  // Under Bf16 each block keeps its convs' outputs and its first BatchNorm's in 16 bits (net/residual.hpp:
  // InnerLayout), and a projection its conv's and its BatchNorm's (which bn2's fused add reads as stored):
  // a block of O x H x W outputs saves 3 x OHW / 2 floats a sample, a projection adds 2 x OHW / 2. By
  // hand: layer1's blocks 3 x 32,768, layer2.0 3 x 16,384 + 2 x 16,384, layer2.1 3 x 16,384, ...
  static_assert(ResNet::stage_count == 13);
  constexpr auto saved = [](std::size_t i) {
    constexpr std::array<std::size_t, 13> block{0, 0, 98304, 98304, 81920, 49152, 40960, 24576, 20480, 12288, 0, 0, 0};
    return fp::cuda_narrow_outputs ? block[i] : 0;
  };
  static_assert(places_disjoint<ResNet, Workspace<ResNet, Bf16>>(cuda_needs<ResNet, Bf16>(), saved));
  // On the Host the same blocks and projections save twice as much (2 x 65,536 a block in layer1 saved,
  // ...): 425,984 floats a sample. Between the stages the stem conv's and
  // BatchNorm's outputs and every block's but the last (which average pooling reads) are 16-bit too:
  // 4 x 32,768 + 2 x 16,384 + 2 x 8,192 + 4,096 = 184,320 floats a sample less.
  CHECK(narrowed_groups<fp::CudaPlan<ResNet, Bf16>>() ==
        (fp::cuda_narrow_outputs ? std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8} : std::vector<std::size_t>{}));
  CHECK(ResNet::activation_elements - Workspace<ResNet, Bf16>::activation_elements ==
        (fp::cuda_narrow_outputs ? 425984u + 184320u : 0u));
}

namespace {
// Logits wider than every gradient below them: the loss gradient is the widest tensor written.
using WideLogits = fp::Sequential<fp::Input<4, 1, 1>, fp::Linear<100>>;
// Under Tf32 one fused MLP group, which a device that cannot run it runs layer by layer: the second
// Linear then writes the first one's input gradient plainly.
using SmallMlp = fp::Sequential<fp::Input<4, 1, 1>, fp::Linear<128>, fp::ReLU, fp::Linear<8>>;
}  // namespace

TEST_CASE("a Cuda gradient buffer holds the widest tensor backward writes into it, in its element") {
  using LeNet = seed_networks::LeNet;
  using fp::precision::Bf16;
  using fp::precision::Fp32;
  using fp::precision::Tf32;
  constexpr bool fused = fp::cuda_fused_gradients;
  // The CIFAR-10 CNN: the widest is conv1's dense dz (64 x 32 x 32), which conv2's input-gradient GEMM
  // writes through an UnpoolSink: fp32 in TF32 (Net's 65,536 floats), 16 bits past its ReLU under Bf16
  // (32,768 floats). Without fused gradients each group writes its plain input gradient, the widest
  // conv2's (pool1's 64 x 16 x 16).
  CHECK(Workspace<CifarCnn, Tf32>::gradient_elements == (fused ? 65536 : 16384));
  CHECK(Workspace<CifarCnn, Bf16>::gradient_elements == (fused ? 32768 : 16384));
  CHECK(Workspace<CifarCnn, Bf16>::workspace_elements_per_sample ==
        Workspace<CifarCnn, Bf16>::activation_elements + 2 * (fused ? 32768 : 16384));
  // LeNet: conv1's 6 x 24 x 24 dense dz (3,456 floats; 1,728 in 16 bits); unfused, conv2's input
  // gradient (6 x 12 x 12).
  CHECK(Workspace<LeNet, Tf32>::gradient_elements == (fused ? 3456 : 864));
  CHECK(Workspace<LeNet, Fp32>::gradient_elements == (fused ? 3456 : 864));
  CHECK(Workspace<LeNet, Bf16>::gradient_elements == (fused ? 1728 : 864));
  // A Tanh conv's dz is no bf16 value, so fp32 under Bf16 too (3 x 4 x 4); the network's input
  // (2 x 6 x 6, Net's widest activation) never gets a gradient.
  CHECK(TanhAndDropout::gradient_elements == 80);
  CHECK(Workspace<TanhAndDropout, Bf16>::gradient_elements == 48);
  CHECK(Workspace<TanhAndDropout, Tf32>::gradient_elements == 48);
  // ResNet-18: a block's input gradient, 64 x 32 x 32, which under Bf16 the blocks, the stem's BatchNorm
  // and its conv take in 16 bits (the next test case).
  CHECK(Workspace<ResNet, Tf32>::gradient_elements == 65536);
  CHECK(Workspace<ResNet, Bf16>::gradient_elements == (fp::cuda_narrow_outputs ? 32768 : 65536));
  // So do the three gradient buffers of a layer1 block's backward, which hold every gradient inside it.
  CHECK(ResNet::backward_elements == 3 * 65536);
  CHECK(Workspace<ResNet, Tf32>::backward_elements == 3 * 65536);
  CHECK(Workspace<ResNet, Bf16>::backward_elements == (fp::cuda_narrow_outputs ? 3 * 32768 : 3 * 65536));
  // The loss gradient: 100 logits, 112 floats aligned; the Linear below it writes nothing (stage 0).
  CHECK(Workspace<WideLogits, Bf16>::gradient_elements == 112);
  CHECK(Workspace<WideLogits, Tf32>::workspace_elements_per_sample ==
        WideLogits::activation_elements + 2 * 112 + WideLogits::backward_elements);
  // The fused MLP's layer-by-layer fallback: 128 floats under Tf32. Under Bf16 (no fused MLP) the second
  // Linear writes the first one's dz through an ActivationSink past a ReLU: 16 bits.
  REQUIRE(fp::CudaPlan<SmallMlp, Tf32>::summary[0].kind == fp::CudaGroupKind::mlp);
  CHECK(Workspace<SmallMlp, Tf32>::gradient_elements == 128);
  CHECK(Workspace<SmallMlp, Bf16>::gradient_elements == (fused ? 64 : 128));
}

namespace {
// The stages whose input gradient (dx) Workspace stores in 16 bits, and those whose output gradient (dy).
template <class Net, class W>
std::pair<std::string, std::string> gradient_elements_of() {
  std::string dx, dy;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((dx += sizeof(typename W::template dx_element<I>) == 2 ? 'h' : 'f',
      dy += sizeof(typename W::template dy_element<I>) == 2 ? 'h' : 'f'),
     ...);
  }(std::make_index_sequence<Net::stage_count>{});
  return {dx, dy};
}
// A BatchNorm whose epilogue's derivative is no mask (Tanh: its dz, written over dy, is no bf16 value),
// a conv with an epilogue (its dy is read with the derivative), a block whose add is a pass of its own.
using MixedNorms = fp::Sequential<
    fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::Tanh, fp::Conv2d<8, 3, 1, 1>,
    fp::ReLU, fp::Conv2d<8, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
    fp::Residual<fp::Conv2d<8, 3, 1, 1>, fp::ReLU, fp::Conv2d<8, 3, 1, 1>, fp::IdentityShortcut>,
    fp::Conv2d<8, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<4>>;
}  // namespace

TEST_CASE("a Bf16 Cuda workspace stores a gradient in 16 bits where the stages on both sides take it so") {
  using fp::precision::Bf16;
  using fp::precision::Tf32;
  const auto [dx, dy] = gradient_elements_of<ResNet, Workspace<ResNet, Bf16>>();
  if (!fp::cuda_narrow_outputs) {
    CHECK(dx == std::string(13, 'f'));
    return;
  }
  // ResNet-18: bn1's and every block's input gradient (read by conv1, bn1 past its ReLU, the block
  // before); not average pooling's (no 16-bit kernel), nor the classifier's, nor the loss's.
  CHECK(dx == "fhhhhhhhhhfff");
  CHECK(dy == "hhhhhhhhhffff");
  CHECK(gradient_elements_of<ResNet, Workspace<ResNet, Tf32>>().first == std::string(13, 'f'));
  // Stages: 0 conv, 1 bn + Tanh, 2 conv + ReLU, 3 conv, 4 bn + ReLU, 5 block (a separate add), 6 conv,
  // 7 bn, 8 pooling, 9 flatten, 10 linear. 16-bit: the BatchNorms' input gradients, which the convs
  // without an epilogue below them read (1, 4, 7). Not: conv 2's (the Tanh BatchNorm's dz, written over
  // its dy, is no bf16 value), conv 3's (a sink writes conv 2's dz), the block's and conv 6's (the block
  // takes none in 16 bits with a separate add), pooling's and the Linear's (no 16-bit kernels).
  const auto [mdx, mdy] = gradient_elements_of<MixedNorms, Workspace<MixedNorms, Bf16>>();
  CHECK(mdx == "fhffhffhfff");
  CHECK(mdy == "hffhffhffff");
}
