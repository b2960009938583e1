// tests the Cuda space's bf16 activation storage (net/activation_storage.hpp) through the groups a Cuda
// model runs (net/cuda_groups.hpp): under precision::Bf16 every stage's output and every input gradient
// the groups store is a bf16 value (the fused conv + max-pooling and the gradient sinks included), the
// logits are not, what stages save for their own backward keeps fp32 values, and the input is
// untouched; under Fp32 the same tensors hold fp32 values. The Host's twin is tests/net/precision.cpp
// (which also looks inside residual blocks, through the same code); that the values are the fp32 path's
// rounded (the epilogues, the sinks, the pooling's winners) is tests/gpu/emulation.cu's, on the CPU.
// A dz a sink writes into a ReLU stage is stored in 16 bits under Bf16 (received_dz_element): read so.
// The group outputs the plan narrows (CudaPlan::narrow_output) are stored in 16 bits: read so, and
// their region's second half (where fp32 values would have gone) is left as the poison it held.
#include "gpu_test.hpp"

#include <fusedp/kernels/bf16.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace fp = fusedp;
using gpu_test::random_values;

namespace {

// The networks of tests/net/precision.cpp: conv + ReLU + max-pooling (one fused group on Cuda), a conv
// with Tanh, Linear layers; BatchNorm, a residual block with a projection, average pooling, GELU; a block's
// output as the logits; an identity block whose add is a pass of its own.
using Net = fp::Sequential<fp::Input<3, 10, 10>, fp::Conv2d<40, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>,
                           fp::Conv2d<36, 3>, fp::Tanh, fp::Flatten, fp::Linear<24>, fp::ReLU, fp::Linear<5>>;
using BlockNet = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1>, fp::BatchNorm2d<>, fp::ReLU,
                                fp::Residual<fp::Conv2d<12, 3, 2, 1>, fp::BatchNorm2d<>, fp::ReLU, fp::Conv2d<12, 3, 1, 1>,
                                             fp::BatchNorm2d<>, fp::Projection<fp::Conv2d<12, 1, 2, 0>, fp::BatchNorm2d<>>>,
                                fp::ReLU, fp::AvgPool2d<2>, fp::Flatten, fp::Linear<6>, fp::GELU, fp::Linear<3>>;
using BlockOutputNet = fp::Sequential<fp::Input<4, 5, 5>, fp::Conv2d<4, 1>, fp::ReLU,
                                      fp::Residual<fp::Conv2d<4, 3, 1, 1>, fp::BatchNorm2d<>, fp::IdentityShortcut>,
                                      fp::Flatten>;
using SeparateAddNet = fp::Sequential<fp::Input<4, 5, 5>, fp::Conv2d<4, 1>,
                                      fp::Residual<fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                                   fp::IdentityShortcut>,
                                      fp::ReLU, fp::Flatten, fp::Linear<3>>;
// The stages the others leave out: a max-pooling of its own (3 x 3 windows do not fuse), Dropout, an
// activation no anchor takes (a pointwise stage), global average pooling with an activation.
using TailNet = fp::Sequential<fp::Input<3, 12, 12>, fp::Conv2d<8, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<3>,
                               fp::Dropout<0.25f>, fp::Tanh, fp::GlobalAvgPool2d, fp::Sigmoid, fp::Flatten,
                               fp::Linear<4>>;
// A conv + ReLU whose output (16-bit: it receives its dz) a conv reads that folds the BatchNorm after it
// in evaluation; that conv's output is 16-bit too (the BatchNorm reads it so).
using FoldingReader = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                     fp::BatchNorm2d<>, fp::ReLU, fp::Flatten, fp::Linear<6>, fp::Tanh, fp::Linear<3>>;
// A fused conv + max-pooling whose pooled values are the logits (their gradient, dlogits, is fp32).
using PooledOutputNet = fp::Sequential<fp::Input<2, 8, 8>, fp::Conv2d<6, 3, 1, 1>, fp::ReLU, fp::Conv2d<4, 3, 1, 1>,
                                       fp::ReLU, fp::MaxPool2d<2>, fp::Flatten>;

std::size_t count_non_bf16(const std::vector<float>& v, std::size_t at, std::size_t n) {
  std::size_t bad = 0;
  for (std::size_t i = at; i < at + n; ++i)
    if (fp::kernels::round_bf16(v[i]) != v[i] && !std::isnan(v[i])) ++bad;
  return bad;
}

struct StoredCheck {
  int outputs = 0, outputs_fp32 = 0;      // the stages' outputs
  int saved = 0, saved_fp32 = 0;          // what stages save for their own backward (z regions, blocks aside)
  int gradients = 0, gradients_fp32 = 0;  // the input gradients the groups store
  int gradients_16bit = 0;                // of which dz stored in 16 bits by a sink
  int dx_16bit = 0;                       // of which input gradients stored in 16 bits (dx_element)
  int dz_16bit_wrong = 0;                 // of those, with zeros where the mask does not put them
  int outputs_16bit = 0;                  // stage outputs stored in 16 bits (narrow_output)
  int outputs_16bit_wrong = 0;            // of those, with a NaN or with the region's second half written
  int argmax_regions = 0;                 // the conv regions of fused conv + max-poolings (argmax bytes)
  int argmax_wrong = 0;                   // of those, with a byte outside the window or past the bytes written
  bool logits_bf16 = true;
  bool input_unchanged = true;
};

// Whether stage I's output region holds a fused conv + max-pooling's argmax bytes instead.
template <class Plan, std::size_t I>
constexpr bool holds_argmax() {
  return []<std::size_t... G>(std::index_sequence<G...>) {
    return (false || ... ||
            (Plan::template group<G>::kind == fp::CudaGroupKind::conv_maxpool && Plan::template group<G>::first == I));
  }(std::make_index_sequence<Plan::group_count>{});
}

// Whether stage I's output is a group's output the plan stores in 16 bits.
template <class Plan, std::size_t I>
constexpr bool narrow_stage() {
  return []<std::size_t... G>(std::index_sequence<G...>) {
    return (false || ... || (Plan::template group<G>::last == I && Plan::template narrow_output<G>));
  }(std::make_index_sequence<Plan::group_count>{});
}

// `values` stage outputs at float offset `at` of the downloaded workspace `ws`, stored as 16-bit elements
// in the region's first half.
std::vector<float> narrow_values(const std::vector<float>& ws, std::size_t at, std::size_t values) {
  std::vector<fp::kernels::BFloat16> h(values);
  std::memcpy(h.data(), ws.data() + at, values * sizeof(fp::kernels::BFloat16));
  std::vector<float> out(values);
  for (std::size_t i = 0; i < values; ++i) out[i] = fp::kernels::to_float(h[i]);
  return out;
}

template <class L, class In>
concept ResidualAt = requires { typename L::template body<In>; };

using fp::kernels::derivative_is_mask;  // dz = dy * Epi' of a bf16 dy is a bf16 value: what a sink stores

// Net's groups on a device of precision P, forward (and in training backward, group by group), and
// what they stored: every stage output (in evaluation with its folds; not the conv of a fused conv +
// max-pooling, whose region holds the argmax bytes), every input gradient a group leaves for the group
// below (unless that group receives a dz whose activation derivative is not a mask: its values are
// dz, not the stored gradient: that a sink rounds before it multiplies is tests/gpu/emulation.cu's).
template <class Net, class P>
StoredCheck check_stored(bool training) {
  using Space = fp::CudaSpace<P>;
  using Groups = fp::CudaGroups<Net, P>;
  using plan = typename Groups::plan;
  using Layout = fp::CudaWorkspace<Net, P>;  // where the Cuda model's regions lie
  constexpr std::size_t n = 5;
  const Space space = gpu_test::make_space<Space>();
  fp::ParameterStore<Net, Space, float> store(space, 7);
  typename Groups::binding_type binding;
  binding.reserve(n, n * plan::mlp_gradient_elements);
  fp::DeviceBuffer<float> scratch(std::max<std::size_t>(Groups::scratch_elements(space.sm_count(), n), 1));
  const std::vector<float> x0 = random_values(n * Net::input_shape::size, 23);
  auto x = gpu_test::upload(space, x0);
  Groups groups{space, store, binding, scratch.data()};
  StoredCheck c;
  const auto workspace = [&] { return gpu_test::download(space, std::span<float>(binding.data(), binding.allocated())); };
  // Every byte 0xff (a NaN in either width), so that what no kernel wrote shows.
  FUSEDP_CUDA_CHECK(cudaMemsetAsync(binding.data(), 0xff, binding.allocated() * sizeof(float), space.stream()));
  groups.forward(x.data(), n, training);
  {
    const std::vector<float> ws = workspace();
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using S = typename Net::template stage<I>;
            if constexpr (!Layout::stage_plan[I].aliases_input) {
              if (!training && fp::detail::folds_next<Net, I>()) return;  // stage I + 1's output, checked there
              if constexpr (holds_argmax<plan, I>()) {
                // One byte a window, its winner's place in it; after n x pooled bytes the region (sized
                // for them alone by CudaWorkspace) still holds the poison.
                using Pool = typename Net::template stage<I + 1>;
                constexpr std::size_t pooled = Pool::out::size;
                constexpr std::size_t k = fp::detail::max_pool_window_of<typename Pool::layer>;
                constexpr std::size_t region = fp::align_elements((pooled + 3) / 4);
                const auto* bytes = reinterpret_cast<const unsigned char*>(ws.data() + Layout::stage_plan[I].out_offset * n);
                std::size_t wrong = 0;
                for (std::size_t i = 0; i < n * pooled; ++i) wrong += bytes[i] < k * k ? 0 : 1;
                for (std::size_t i = n * pooled; i < region * n * sizeof(float); ++i) wrong += bytes[i] == 0xff ? 0 : 1;
                ++c.argmax_regions;
                c.argmax_wrong += wrong == 0 ? 0 : 1;
                return;
              }
              const std::size_t at = Layout::stage_plan[I].out_offset * n, values = n * S::out::size;
              if constexpr (narrow_stage<plan, I>()) {
                ++c.outputs;
                ++c.outputs_16bit;
                const std::vector<float> v = narrow_values(ws, at, values);
                const bool nan = std::any_of(v.begin(), v.end(), [](float e) { return std::isnan(e); });
                // The region is half the floats (CudaWorkspace), what its alignment adds beyond the
                // 16-bit elements still poison.
                constexpr std::size_t region = fp::align_elements((S::out::size + 1) / 2);
                static_assert([] {
                  constexpr std::size_t start = Layout::stage_plan[I].out_offset;
                  std::size_t end = Layout::activation_elements;
                  for (const auto& p : Layout::stage_plan) {
                    if (!p.aliases_input && p.out_offset > start) end = std::min(end, p.out_offset);
                    if (p.saves_z && p.z_offset > start) end = std::min(end, p.z_offset);
                  }
                  return end - start == region;
                }(), "the Cuda layout gives a 16-bit output half its floats");
                bool untouched = true;
                for (std::size_t i = at + (values + 1) / 2; i < at + region * n; ++i) {
                  std::uint32_t bits = 0;
                  std::memcpy(&bits, &ws[i], sizeof bits);
                  untouched = untouched && bits == 0xffffffffu;
                }
                c.outputs_16bit_wrong += nan || !untouched ? 1 : 0;
              } else if (fp::detail::is_network_output<Net, I>()) {
                c.logits_bf16 = count_non_bf16(ws, at, values) == 0;
              } else {
                ++c.outputs;
                c.outputs_fp32 += count_non_bf16(ws, at, values) == 0 ? 0 : 1;
              }
              // (A residual block's region holds its body's stored outputs, bf16 values: not checked here.)
              if constexpr (Layout::stage_plan[I].saves_z && !ResidualAt<typename S::layer, typename S::in>) {
                if (training) {
                  // The region runs to the next one the plan places (per sample).
                  constexpr std::size_t z = Layout::stage_plan[I].z_offset;
                  constexpr std::size_t z_end = [] {
                    std::size_t end = Layout::activation_elements;
                    for (const auto& p : Layout::stage_plan) {
                      if (!p.aliases_input && p.out_offset > z) end = std::min(end, p.out_offset);
                      if (p.saves_z && p.z_offset > z) end = std::min(end, p.z_offset);
                    }
                    return end;
                  }();
                  ++c.saved;
                  c.saved_fp32 += count_non_bf16(ws, z * n, (z_end - z) * n) == 0 ? 0 : 1;
                }
              }
            }
          }(),
          ...);
    }(std::make_index_sequence<Net::stage_count>{});
  }
  if (training) {
    const std::vector<float> dlogits = random_values(n * Net::output_shape::size, 29, -0.5f, 0.5f);
    fp::copy_async(binding.gradient_buffer(0, n), dlogits.data(), dlogits.size(), space.stream());
    fp::NoStageHook done;
    // In order, as a model with use_backward_branches(false) runs it (the gradient buffers alternate).
    typename Groups::template cursor_type<fp::NoStageHook> cur(
        {binding.gradient_buffer(0, n), binding.gradient_buffer(1, n), nullptr}, scratch.data(), 0, nullptr, done);
    [&]<std::size_t... R>(std::index_sequence<R...>) {
      (
          [&] {
            constexpr std::size_t G = plan::group_count - 1 - R;
            using Gr = typename plan::template group<G>;
            const std::size_t before = cur.steps();
            groups.template backward_group<G>(x.data(), n, cur);
            if constexpr (Gr::first > 0) {
              constexpr std::size_t r = plan::template dz_receiver<G>;
              if constexpr (r != plan::group_count) {
                using Below = typename Net::template stage<plan::template group<r>::first>;
                if constexpr (!derivative_is_mask<typename Below::epilogue>) return;
              }
              if (cur.steps() == before) return;
              // The input gradient of the group's first stage, (n, its input size), or the dense dz of a conv
              // + max-pooling below that received it.
              std::size_t values = n * Net::template stage<Gr::first>::in::size;
              if constexpr (r != plan::group_count) {
                using Below = typename plan::template group<r>;
                if constexpr (Below::kind == fp::CudaGroupKind::conv_maxpool)
                  values = n * Net::template stage<Below::first>::out::size;
              }
              // A sink stores a dz that is a bf16 value in 16 bits (received_dz_element).
              const std::vector<float> g = [&] {
                if constexpr (r != plan::group_count) {
                  using Below = typename Net::template stage<plan::template group<r>::first>;
                  using E = fp::kernels::cuda::received_dz_element<P, typename Below::epilogue>;
                  if constexpr (std::is_same_v<E, fp::kernels::BFloat16>) {
                    ++c.gradients_16bit;
                    const auto h = gpu_test::download(
                        space, std::span<const E>(reinterpret_cast<const E*>(cur.dy()), values));
                    std::vector<float> out(h.size());
                    for (std::size_t i = 0; i < h.size(); ++i) out[i] = fp::kernels::to_float(h[i]);
                    // Read in the wrong element, a ReLU's dz would not be zero exactly where its mask is.
                    using BelowGroup = typename plan::template group<r>;
                    std::size_t nonzero = 0;
                    for (float v : out) nonzero += v != 0.0f ? 1 : 0;
                    if constexpr (BelowGroup::kind == fp::CudaGroupKind::conv_maxpool) {
                      // Nonzero only at a window's winner.
                      constexpr std::size_t k = fp::detail::max_pool_window_of<
                          typename Net::template stage<BelowGroup::first + 1>::layer>;
                      c.dz_16bit_wrong += nonzero > 0 && nonzero <= values / (k * k) ? 0 : 1;
                    } else {
                      // The output of the stage below, as it is stored (in 16 bits where the plan narrows it).
                      constexpr std::size_t below_at = Layout::stage_plan[BelowGroup::first].out_offset;
                      const std::vector<float> ws = workspace();
                      const std::vector<float> y =
                          narrow_stage<plan, BelowGroup::first>()
                              ? narrow_values(ws, below_at * n, values)
                              : std::vector<float>(ws.begin() + below_at * n, ws.begin() + below_at * n + values);
                      std::size_t off_mask = 0, on = 0;
                      for (std::size_t i = 0; i < values; ++i) {
                        off_mask += y[i] <= 0.0f && out[i] != 0.0f ? 1 : 0;
                        on += y[i] > 0.0f ? 1 : 0;
                      }
                      c.dz_16bit_wrong += off_mask == 0 && nonzero * 10 >= on * 9 && on > 0 ? 0 : 1;
                    }
                    return out;
                  }
                }
                // A plain input gradient in the element the workspace stores it in (CudaWorkspace::dx_element).
                using DX = typename Layout::template dx_element<Gr::first>;
                if constexpr (std::is_same_v<DX, fp::kernels::BFloat16>) {
                  ++c.dx_16bit;
                  const auto h =
                      gpu_test::download(space, std::span<const DX>(reinterpret_cast<const DX*>(cur.dy()), values));
                  std::vector<float> out(h.size());
                  for (std::size_t i = 0; i < h.size(); ++i) out[i] = fp::kernels::to_float(h[i]);
                  return out;
                }
                return gpu_test::download(space, std::span<float>(cur.dy(), values));
              }();
              ++c.gradients;
              c.gradients_fp32 += count_non_bf16(g, 0, g.size()) == 0 ? 0 : 1;
            }
          }(),
          ...);
    }(std::make_index_sequence<plan::group_count>{});
    cur.finish();
  }
  c.input_unchanged = gpu_test::download(space, x) == x0;
  return c;
}

// What a network's check should find besides: input gradients checked (false where every one feeds a
// stage whose activation derivative is not a mask), saved regions, logits that are not bf16 values (a
// max-pooling's output is the maximum of stored values: bf16 ones).
struct Expect {
  bool gradients = true;
  bool dz_16bit = false;  // a sink stores a dz in 16 bits (into a ReLU conv, conv + pool or Linear)
  int narrow = 0;         // stage outputs stored in 16 bits under Bf16 (CudaPlan::narrow_output)
  int narrow_folded = 0;  // of those, a conv's that folds the BatchNorm after it in evaluation (which
                          // writes the BatchNorm's output instead)
  int argmax = 0;         // fused conv + max-poolings (their conv regions hold argmax bytes)
  int dx_16bit = 0;       // group input gradients stored in 16 bits under Bf16 (CudaWorkspace::dx_element)
  bool saves = false;
  bool fp32_logits = true;
};

template <class Net>
void check_storage(const char* name, Expect expect) {
  CAPTURE(name);
  for (const bool training : {true, false}) {
    CAPTURE(training);
    const StoredCheck bf = check_stored<Net, fp::precision::Bf16>(training);
    CHECK(bf.outputs_fp32 == 0);
    CHECK(bf.gradients_fp32 == 0);
    CHECK(bf.saved_fp32 == bf.saved);
    CHECK(bf.logits_bf16 == !expect.fp32_logits);  // the logits are not rounded, for the loss
    CHECK(bf.input_unchanged);
    // At fp32 nothing is rounded: the same check finds fp32 values in every tensor.
    const StoredCheck f = check_stored<Net, fp::precision::Fp32>(training);
    CHECK(f.outputs_fp32 == f.outputs);
    CHECK(f.gradients_fp32 == f.gradients);
    CHECK(bf.outputs == f.outputs);  // the same tensors at both precisions (the plans group alike)
    CHECK(bf.gradients == f.gradients);
    CHECK(f.gradients_16bit == 0);  // only a Bf16 model stores dz in 16 bits
    CHECK(f.dx_16bit == 0);
    CHECK(bf.dx_16bit == (training && fp::cuda_narrow_outputs ? expect.dx_16bit : 0));
    CHECK(bf.dz_16bit_wrong == 0);
    // The regions the NaN and poison checks ran on: the plan's narrowed outputs.
    CHECK(bf.outputs_16bit ==
          (fp::cuda_narrow_outputs ? expect.narrow - (training ? 0 : expect.narrow_folded) : 0));
    CHECK(bf.outputs_16bit_wrong == 0);
    CHECK(bf.argmax_regions == expect.argmax);
    CHECK(bf.argmax_wrong == 0);
    CHECK(f.argmax_wrong == 0);
    CHECK((bf.gradients_16bit > 0) == (training && expect.dz_16bit));
    CHECK(bf.outputs > 0);
    CHECK((bf.saved > 0) == (training && expect.saves));
    CHECK((bf.gradients > 0) == (training && expect.gradients));
  }
}

}  // namespace

TEST_CASE("a Bf16 Cuda model stores every activation and activation gradient as a bf16 value, the logits in fp32") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  // Narrowed: in Net the pooled values, the Tanh conv's output and the ReLU Linear's; in BlockNet the
  // stem conv's and its BatchNorm's (which the block reads in 16 bits) and the GELU Linear's; in
  // PooledOutputNet the first conv's.
  check_storage<Net>("conv + pool fused, tanh, linear", {.dz_16bit = true, .narrow = 3, .argmax = 1});
  // BlockNet's BatchNorm's and block's input gradients are 16-bit (the stem conv, and the BatchNorm past
  // its ReLU, read them so).
  check_storage<BlockNet>("batch norm, residual block, avg pool, GELU",
                          {.narrow = 3, .narrow_folded = 1, .dx_16bit = 2, .saves = true});
  // Both convs (the first receives its dz; the second is read by the BatchNorm, which it folds in
  // evaluation, where the first is read by a conv that folds) and the Tanh Linear's; the BatchNorm's input
  // gradient, which the second conv reads.
  check_storage<FoldingReader>("a 16-bit conv output read by a conv that folds a BatchNorm",
                               {.dz_16bit = true, .narrow = 3, .narrow_folded = 1, .dx_16bit = 1});
  check_storage<BlockOutputNet>("a residual block's output as the logits", {});
  check_storage<SeparateAddNet>("an identity block with an add of its own", {});
  check_storage<TailNet>("max-pooling alone, dropout, a pointwise stage, global average pooling", {});
  check_storage<PooledOutputNet>("a fused conv + max-pooling as the logits",
                                 {.dz_16bit = true, .narrow = 1, .argmax = 1, .fp32_logits = false});
}
