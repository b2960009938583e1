#pragma once
// The Cuda side of the fusion plan: Sequential's stages (an anchor and its epilogue) regrouped, at
// compile time, into the kernels that run them on a device. Three kinds of group:
//
//   stage         one stage of the plan, run by its layer's Cuda overloads (a GEMM with bias and
//                 activation in the epilogue, a pooling kernel, a pointwise kernel, ...)
//   conv_maxpool  Conv2d (+ activation) followed by MaxPool2d<K> with stride K and no activation of
//                 its own, when the conv's epilogue needs only its output in backward and K*K divides
//                 the conv GEMM's block rows (K = 1, 2, 4, 8): one implicit GEMM whose epilogue writes
//                 only the pooled values and a one-byte argmax per window. Otherwise (K = 3, stride
//                 != K, average pooling, ...) the pooling is a kernel of its own.
//   mlp           a maximal run of at least two consecutive Linear stages whose input and output
//                 widths are all <= 128 and whose epilogues need only their outputs (ReLU, LeakyReLU
//                 with positive slope, Tanh, Sigmoid, none), under precision::Tf32: one fused kernel
//                 forward and one backward (kernels/cuda/mlp.cuh). Where the device cannot run it
//                 (before sm_80, too little shared memory) the model runs the same stages one by one.
//
// The grouping depends only on the network and the precision, so it is a type: tests static_assert
// it, and each group's kernels are instantiated once per network.
//
// Fused gradient boundaries (issue 17): a group that needs its output gradient transformed before its
// GEMMs (a conv + max-pool: unpooled through the argmax; a Conv2d or Linear stage with an activation:
// times Epi') receives it already transformed when the group above it (past any Flatten, which moves
// no memory) is a Conv2d or Linear stage, a conv + max-pool or a fused MLP: that group's input-gradient
// GEMM (the MLP's backward kernel) writes it through a sink (kernels/cuda/gradient_sink.cuh), and no
// pass of its own runs (receives_dz, dz_receiver). -DFUSEDP_CUDA_FUSED_GRADIENTS=0 turns this off
// (every group forms its own dz, as before), for measuring what it gives (benchmarks/gpu:
// train_step_gpu_unfused); like every option that changes the plan, it must be the same in every
// translation unit of a program.
//
// 16-bit stage outputs (issue 17): under precision::Bf16 a group's output is a bf16 value; where every
// reader of it can read 16 bits, it is stored so (kernels::BFloat16), in a region of half the bytes
// (CudaWorkspace). That is
//   - a group that receives its dz through a sink (so its own backward never reads its output: the
//     derivative is taken in the sink, which reads the element) and whose reader, the group above past
//     any Flatten, is a Conv2d or Linear stage or a conv + max-pool (GEMM operands, which widen as they
//     load). In the CIFAR-10 CNN: both pooled outputs and fc1's;
//   - a stage whose layer writes its output in 16 bits and reads it so in its backward, read by a layer
//     that reads its input so (layers declare both: cuda_writes_16bit, cuda_reads_16bit; Conv2d without an
//     epilogue, BatchNorm, Residual). In ResNet-18: the stem conv's and BatchNorm's outputs and every
//     block's but the last, which average pooling reads.
// (output_element, input_element; CudaGroups passes them to the layers, CudaWorkspace to StageBinding,
// which runs each stage, a BatchNorm folded into a conv in evaluation included, with them; a block's
// inner tensors: net/residual.hpp.) -DFUSEDP_CUDA_NARROW_OUTPUTS=0
// keeps every output in fp32 elements (the same values), for measuring what it gives
// (benchmarks/gpu: train_step_gpu_wide); like FUSEDP_CUDA_FUSED_GRADIENTS, the same in every
// translation unit of a program.
//
// The workspace (CudaWorkspace, StageBinding's layout on Cuda): Sequential's per-sample layout, shared
// with the Host model, less what the groups above never write: the conv's output region of a conv +
// max-pool holds only the argmax bytes, a 16-bit output takes half its fp32 region, and a residual
// block's saved region is what its inner layouts need (net/residual.hpp: 16-bit tensors inside blocks
// under Bf16; with its 16-bit outputs between stages ResNet-18 keeps 610,304 of 1,229,328 activation
// floats a sample less). In the CIFAR-10
// CNN that is 92,160 of 254,992 floats a sample in TF32 (36%), 104,960 in BF16; in LeNet 4,720 of
// 13,440 (35%) and 5,440. Each gradient buffer holds the widest tensor backward writes into it, in
// the element it is written in: under Bf16, where the widest is a dense dz or an input gradient in 16
// bits (CudaWorkspace::dx_element: where the layers on both sides declare it, cuda_writes_16bit_gradient
// and cuda_reads_16bit_gradient), half Net's buffer (the CIFAR-10 CNN's conv1 dz: 32,768 floats a
// sample of 65,536, twice; LeNet 1,728 of 3,456; ResNet-18 a block's input gradient, 32,768 of 65,536).
#include "fusedp/core/config.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/activation.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/pool_op.hpp"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/layers/layer.hpp"
#include "fusedp/layers/linear.hpp"
#include "fusedp/layers/pooling.hpp"
#include "fusedp/net/layout_fingerprint.hpp"
#include "fusedp/net/region_layout.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/net/stage_binding.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef FUSEDP_CUDA_FUSED_GRADIENTS
#define FUSEDP_CUDA_FUSED_GRADIENTS 1
#endif


namespace fusedp {

/// Whether the Cuda plan fuses gradient boundaries (FUSEDP_CUDA_FUSED_GRADIENTS, default 1).
inline constexpr bool cuda_fused_gradients = FUSEDP_CUDA_FUSED_GRADIENTS != 0;

enum class CudaGroupKind { stage, conv_maxpool, mlp };

/// A group of the Cuda plan: stages [First, Last] of a Sequential run as one unit.
template <CudaGroupKind Kind, std::size_t First, std::size_t Last>
struct CudaGroup {
  static constexpr CudaGroupKind kind = Kind;
  static constexpr std::size_t first = First;
  static constexpr std::size_t last = Last;
};

/// The widest layer a fused MLP stage takes.
inline constexpr int cuda_mlp_max_width = 128;
/// Rows of a conv GEMM block tile that a fused pooling window must divide (the smallest BM of the
/// tiles in kernels/cuda/gemm.cuh).
inline constexpr int cuda_conv_tile_rows = 64;

namespace detail {

// is_conv2d, is_linear (layers/conv2d.hpp, layers/linear.hpp) and max_pool_window_of
// (layers/pooling.hpp) tell the layers apart, Named ones included.
template <class Net, std::size_t I>
constexpr bool fuses_conv_maxpool() {
  if constexpr (I + 1 >= Net::stage_count) {
    return false;
  } else {
    using S = typename Net::template stage<I>;
    using Next = typename Net::template stage<I + 1>;
    if constexpr (!is_conv2d<typename S::layer>::value || S::epilogue::saves_input) {
      return false;
    } else {
      constexpr int k = max_pool_window_of<typename Next::layer>;
      if constexpr (k == 0) return false;
      else return Next::epilogue::empty && cuda_conv_tile_rows % (k * k) == 0 && k * k <= 256;
    }
  }
}

template <class Net, class P, std::size_t I>
constexpr bool mlp_member() {
  if constexpr (I >= Net::stage_count || !std::is_same_v<P, precision::Tf32>) {
    return false;
  } else {
    using S = typename Net::template stage<I>;
    if constexpr (!is_linear<typename S::layer>::value) return false;
    else
      return S::in::size <= std::size_t(cuda_mlp_max_width) && S::out::size <= std::size_t(cuda_mlp_max_width) &&
             !S::epilogue::saves_input;
  }
}

// The last stage of the MLP run that starts at I.
template <class Net, class P, std::size_t I>
constexpr std::size_t mlp_run_end() {
  if constexpr (mlp_member<Net, P, I + 1>()) return mlp_run_end<Net, P, I + 1>();
  else return I;
}

template <class Net, class P, std::size_t I, class Groups, bool Done = (I >= Net::stage_count)>
struct make_cuda_groups {
  using type = Groups;
};
template <class Net, class P, std::size_t I, class... Gs>
struct make_cuda_groups<Net, P, I, type_list<Gs...>, false> {
  static constexpr bool mlp = mlp_member<Net, P, I>() && mlp_run_end<Net, P, I>() > I;
  static constexpr bool pool = !mlp && fuses_conv_maxpool<Net, I>();
  static constexpr std::size_t last = mlp ? mlp_run_end<Net, P, I>() : pool ? I + 1 : I;
  static constexpr CudaGroupKind kind = mlp ? CudaGroupKind::mlp : pool ? CudaGroupKind::conv_maxpool : CudaGroupKind::stage;
  using type = typename make_cuda_groups<Net, P, last + 1, type_list<Gs..., CudaGroup<kind, I, last>>>::type;
};

}  // namespace detail

/// What one group covers, for tests and for printing a plan.
struct CudaGroupInfo {
  CudaGroupKind kind;
  std::size_t first, last;
};

namespace detail {
template <class Net, std::size_t First, std::size_t... L>
constexpr std::size_t mlp_dz_sum(std::index_sequence<L...>) {
  return (std::size_t(0) + ... + align_elements(Net::template stage<First + L>::out::size));
}
template <class Net, class Gr>
constexpr std::size_t mlp_dz_elements() {
  if constexpr (Gr::kind == CudaGroupKind::mlp)
    return mlp_dz_sum<Net, Gr::first>(std::make_index_sequence<Gr::last - Gr::first + 1>{});
  else
    return 0;
}
// A group that is only a reshape (Flatten): backward moves nothing through it.
template <class Net, class Gr>
constexpr bool reshape_group() {
  if constexpr (Gr::kind == CudaGroupKind::stage) return Net::template stage<Gr::first>::kind == LayerKind::reshape;
  else return false;
}
// A group whose input-gradient GEMM can hand its values to a sink: a Conv2d or Linear stage, a conv +
// max-pool, a fused MLP (its kernel's input gradient; where the device cannot run it, its first Linear's).
template <class Net, class Gr>
constexpr bool dx_through_sink() {
  if constexpr (Gr::kind == CudaGroupKind::conv_maxpool || Gr::kind == CudaGroupKind::mlp) {
    return true;
  } else if constexpr (Gr::kind == CudaGroupKind::stage) {
    using L = typename Net::template stage<Gr::first>::layer;
    return is_conv2d<L>::value || is_linear<L>::value;
  } else {
    return false;
  }
}
// A group whose backward would transform its output gradient first: a conv + max-pool, or a Conv2d or
// Linear stage with an activation (without one, dy is dz already).
template <class Net, class Gr>
constexpr bool transforms_dy() {
  if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
    return true;
  } else if constexpr (Gr::kind == CudaGroupKind::stage) {
    using S = typename Net::template stage<Gr::first>;
    return (is_conv2d<typename S::layer>::value || is_linear<typename S::layer>::value) && !S::epilogue::empty;
  } else {
    return false;
  }
}
// A group whose weight-gradient GEMMs apply the optimizer to its layers' weights and biases (in a
// training step that asks for it): a Conv2d or Linear stage, a conv + max-pool, a fused MLP (each
// layer's GEMM after the fused backward kernel, or stage by stage where the device cannot run it). The
// layers inside a block (Residual) are not groups: their tensors take the pass over the rest.
template <class Net, class Gr>
constexpr bool updates_in_gemm() {
  if constexpr (Gr::kind == CudaGroupKind::mlp) {
    return true;
  } else {
    using L = typename Net::template stage<Gr::first>::layer;
    return is_conv2d<L>::value || is_linear<L>::value;
  }
}
// Whether group Gr's layer can store its output in 16 bits (a stage whose layer says so with its
// epilogue: writes_16bit_output), and read its input so (reads_16bit_input; a conv + max-pool reads it
// through GEMM operands). The fused MLP reads and writes fp32.
template <class Net, class Gr>
constexpr bool group_writes_16bit() {
  if constexpr (Gr::kind != CudaGroupKind::stage) {
    return false;
  } else {
    using S = typename Net::template stage<Gr::first>;
    if constexpr (S::kind != LayerKind::anchor) return false;
    else return writes_16bit_output<typename S::layer, typename S::in, typename S::epilogue>();
  }
}
template <class Net, class Gr>
constexpr bool group_reads_16bit() {
  if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
    return true;
  } else if constexpr (Gr::kind == CudaGroupKind::stage) {
    using S = typename Net::template stage<Gr::first>;
    if constexpr (S::kind != LayerKind::anchor) return false;
    else return reads_16bit_input<typename S::layer, typename S::in>();
  } else {
    return false;
  }
}
// Floats a sample stage S's backward works in on a Cuda model of precision P: what its layer says
// (cuda_backward_elements<In, P>: a residual block's 16-bit gradient buffers), else Net's.
template <class S, class P>
constexpr std::size_t cuda_backward_elements() {
  if constexpr (requires { S::layer::template cuda_backward_elements<typename S::in, P>; })
    return S::layer::template cuda_backward_elements<typename S::in, P>;
  else
    return backward_elements_of<typename S::layer, typename S::in>();
}
// Floats a sample stage S saves for backward on Cuda under P where its layer says how many
// (saved_elements<In, Epi, P>: a residual block whose inner networks store 16-bit tensors), else 0 (as
// many as on the Host, Sequential's).
template <class S, class P>
constexpr std::size_t cuda_saved_elements() {
  if constexpr (requires { S::layer::template saved_elements<typename S::in, typename S::epilogue, P>; })
    return S::layer::template saved_elements<typename S::in, typename S::epilogue, P>;
  else
    return 0;
}
inline constexpr std::size_t no_tensor = ~std::size_t(0);
// The offset of layer `layer`'s GEMM weight (weight) or of its other tensor, its bias; no_tensor if none.
template <class Net>
constexpr std::size_t layer_tensor_offset(std::size_t layer, bool weight) {
  for (const ParamTensor& t : Net::param_layout)
    if (t.layer == layer && t.gemm_weight() == weight) return t.offset;
  return no_tensor;
}
template <class Net, class Groups>
struct plan_facts;
template <class Net, class... Gs>
struct plan_facts<Net, type_list<Gs...>> {
  static constexpr std::size_t count = sizeof...(Gs);
  // Per stage: whether its layer's tensors are updated in their GEMMs (the conv of a conv + max-pool,
  // every Linear of an MLP group), and the layer's index (ParamTensor::layer).
  static constexpr std::array<bool, Net::stage_count> stage_updates = [] {
    std::array<bool, Net::stage_count> r{};
    (
        [&] {
          if constexpr (updates_in_gemm<Net, Gs>()) {
            r[Gs::first] = true;
            if constexpr (Gs::kind == CudaGroupKind::mlp)
              for (std::size_t j = Gs::first; j <= Gs::last; ++j) r[j] = true;
          }
        }(),
        ...);
    return r;
  }();
  static constexpr auto stage_layer = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<std::size_t, sizeof...(I)>{Net::template stage<I>::first...};
  }(std::make_index_sequence<Net::stage_count>{});
  static constexpr bool tensor_updated(const ParamTensor& t) {
    for (std::size_t i = 0; i < Net::stage_count; ++i)
      if (stage_updates[i] && stage_layer[i] == t.layer) return true;
    return false;
  }
  // The tensors updated in their GEMMs, [begin, end) pairs in layout order; the other tensors as runs
  // (adjacent ones merged) for the pass over the rest. Padding is in neither: it holds zeros, which
  // every update keeps.
  static constexpr std::size_t updated_count = [] {
    std::size_t n = 0;
    for (const ParamTensor& t : Net::param_layout) n += tensor_updated(t);
    return n;
  }();
  static constexpr std::array<std::size_t, 2 * updated_count> updated = [] {
    std::array<std::size_t, 2 * updated_count> r{};
    std::size_t k = 0;
    for (const ParamTensor& t : Net::param_layout)
      if (tensor_updated(t)) {
        r[k++] = t.offset;
        r[k++] = t.offset + t.size;
      }
    return r;
  }();
  static constexpr std::size_t rest_count = [] {
    std::size_t n = 0, end = no_tensor;
    for (const ParamTensor& t : Net::param_layout)
      if (!tensor_updated(t)) {
        n += t.offset != end;
        end = t.offset + t.size;
      }
    return n;
  }();
  // rest[0, 2 * rest_count): the runs' bounds; rest[2 * rest_count, 3 * rest_count + 1): the elements
  // before each run, then the total (kernels::ElementRuns).
  static constexpr std::array<std::size_t, 3 * rest_count + 1> rest = [] {
    std::array<std::size_t, 3 * rest_count + 1> r{};
    std::size_t n = 0, total = 0;
    for (const ParamTensor& t : Net::param_layout) {
      if (tensor_updated(t)) continue;
      if (n > 0 && r[2 * n - 1] == t.offset) {
        r[2 * n - 1] += t.size;
      } else {
        r[2 * n] = t.offset;
        r[2 * n + 1] = t.offset + t.size;
        r[2 * rest_count + n] = total;
        ++n;
      }
      total += t.size;
    }
    r[3 * rest_count] = total;
    return r;
  }();
  static constexpr std::array<bool, count> updates{updates_in_gemm<Net, Gs>()...};
  static constexpr std::array<CudaGroupInfo, count> summary{CudaGroupInfo{Gs::kind, Gs::first, Gs::last}...};
  static constexpr std::size_t mlp_gradient_elements = std::max({std::size_t(0), mlp_dz_elements<Net, Gs>()...});
  static constexpr std::array<bool, count> reshape{reshape_group<Net, Gs>()...};
  static constexpr std::array<bool, count> sink{dx_through_sink<Net, Gs>()...};
  static constexpr std::array<bool, count> transforms{transforms_dy<Net, Gs>()...};
  // above[g]: the first group after g that is not a reshape (the one that reads g's output), else count;
  // feeder[g]: the last group before g that is not a reshape (whose output g reads), else count (g reads
  // the network's input).
  static constexpr std::array<std::size_t, count> above = [] {
    std::array<std::size_t, count> r{};
    for (std::size_t g = 0; g < count; ++g) {
      std::size_t a = g + 1;
      while (a < count && reshape[a]) ++a;
      r[g] = a;
    }
    return r;
  }();
  static constexpr std::array<std::size_t, count> feeder = [] {
    std::array<std::size_t, count> r{};
    for (std::size_t g = 0; g < count; ++g) {
      std::size_t b = g;
      while (b > 0 && reshape[b - 1]) --b;
      r[g] = b > 0 ? b - 1 : count;
    }
    return r;
  }();
  // receives[g]: the first group after g that is not a reshape writes g's dz through a sink.
  static constexpr std::array<bool, count> receives = [] {
    std::array<bool, count> r{};
    for (std::size_t g = 0; g < count; ++g)
      r[g] = cuda_fused_gradients && transforms[g] && above[g] < count && sink[above[g]];
    return r;
  }();
  static constexpr std::array<bool, count> writes16{group_writes_16bit<Net, Gs>()...};
  static constexpr std::array<bool, count> reads16{group_reads_16bit<Net, Gs>()...};
  // narrow[g]: g's output may be stored in 16 bits (under Bf16), where either
  //   - g receives its dz (so only a sink reads its output in backward), and the group above reads it
  //     through GEMM operands only: a Conv2d or Linear stage or a conv + max-pool (not a fused MLP, which
  //     reads fp32; one that folds a BatchNorm in evaluation too, since the binding runs the fold with the
  //     workspace's elements); or
  //   - g's layer writes its output in 16 bits and reads it so in backward, and the group above reads its
  //     input so (writes16, reads16: a conv without epilogue, a BatchNorm, a residual block, read by a
  //     conv, a BatchNorm or a block; ResNet-18's stem and blocks).
  static constexpr std::array<bool, count> narrow = [] {
    std::array<bool, count> r{};
    for (std::size_t g = 0; g < count; ++g) {
      const bool received = receives[g] && summary[above[g]].kind != CudaGroupKind::mlp;
      const bool declared = writes16[g] && above[g] < count && reads16[above[g]];
      r[g] = cuda_narrow_outputs && (received || declared);
    }
    return r;
  }();
  static constexpr std::array<bool, count> narrow_input = [] {
    std::array<bool, count> r{};
    for (std::size_t g = 0; g < count; ++g) r[g] = feeder[g] != count && narrow[feeder[g]];
    return r;
  }();
  // receiver[g]: the group whose dz g's input gradient writes (g writes through a sink, and the last
  // group before it that is not a reshape receives), else count.
  static constexpr std::array<std::size_t, count> receiver = [] {
    std::array<std::size_t, count> r{};
    for (std::size_t g = 0; g < count; ++g)
      r[g] = sink[g] && feeder[g] != count && receives[feeder[g]] ? feeder[g] : count;
    return r;
  }();
};
}  // namespace detail

/// The Cuda plan of network Net under precision P.
/// @tparam Net a Sequential<...>
/// @tparam P precision::Tf32, Fp32 or Bf16
template <class Net, class P>
struct CudaPlan {
  using groups = typename detail::make_cuda_groups<Net, P, 0, detail::type_list<>>::type;
  template <std::size_t G>
  using group = typename detail::type_at<G, groups>::type;
  static constexpr std::size_t group_count = groups::size;
  /// Every group's kind and stages, in order.
  static constexpr auto summary = detail::plan_facts<Net, groups>::summary;
  /// Elements per sample of the extra workspace the MLP groups need: each layer's dz, kept between
  /// the fused backward kernel and the weight-gradient GEMMs (the largest group's sum).
  static constexpr std::size_t mlp_gradient_elements = detail::plan_facts<Net, groups>::mlp_gradient_elements;
  /// Whether group G receives its dz from the input-gradient GEMM of the group above it (written through
  /// the sink its kind calls for: an UnpoolSink for a conv + max-pool, an ActivationSink for a Conv2d or
  /// Linear with an activation), so that its backward reads dz stored and runs no pass of its own.
  template <std::size_t G>
  static constexpr bool receives_dz = detail::plan_facts<Net, groups>::receives[G];
  /// The group whose dz the input-gradient GEMM of group G writes, or group_count when G stores its
  /// input gradient plainly.
  template <std::size_t G>
  static constexpr std::size_t dz_receiver = detail::plan_facts<Net, groups>::receiver[G];

  /// Whether group G stores its output in 16 bits (kernels::BFloat16): under precision::Bf16, where it
  /// receives its dz and the group above reads it only through GEMM operands, or where its layer and the
  /// one above declare 16-bit kernels (the header's comment).
  template <std::size_t G>
  static constexpr bool narrow_output =
      std::is_same_v<P, precision::Bf16> && detail::plan_facts<Net, groups>::narrow[G];
  /// The element group G's output is stored in: BFloat16 where narrow_output, else float.
  template <std::size_t G>
  using output_element = std::conditional_t<narrow_output<G>, kernels::BFloat16, float>;
  /// The element group G's input is stored in: the output element of the group below it (past any
  /// Flatten), float for the network's input.
  template <std::size_t G>
  using input_element = std::conditional_t<std::is_same_v<P, precision::Bf16> &&
                                               detail::plan_facts<Net, groups>::narrow_input[G],
                                           kernels::BFloat16, float>;

  /// Fused optimizer (issue 17): whether group G's weight-gradient GEMMs apply the optimizer to its
  /// layers' weights and biases when the training step asks for it (a Conv2d or Linear stage, a
  /// conv + max-pool, a fused MLP); what they leave (the tensors inside blocks, BatchNorm's) is
  /// updated by one pass over the rest.
  template <std::size_t G>
  static constexpr bool updates_in_gemm = detail::plan_facts<Net, groups>::updates[G];
  /// Whether stage I's layer is one whose tensors are so updated.
  template <std::size_t I>
  static constexpr bool stage_updates_in_gemm = detail::plan_facts<Net, groups>::stage_updates[I];
  /// Where stage I's weight and bias lie (the bias: detail::no_tensor when the layer has none).
  template <std::size_t I>
  static constexpr std::size_t weight_offset =
      detail::layer_tensor_offset<Net>(detail::plan_facts<Net, groups>::stage_layer[I], true);
  template <std::size_t I>
  static constexpr std::size_t bias_offset =
      detail::layer_tensor_offset<Net>(detail::plan_facts<Net, groups>::stage_layer[I], false);
  /// The tensors so updated: [begin, end) offsets of the flat parameter buffer, in order.
  static constexpr auto updated_tensors = detail::plan_facts<Net, groups>::updated;
  /// The other tensors, as runs of the flat buffer (adjacent tensors merged; padding, which holds zeros
  /// that every update keeps, left out) laid out as kernels::ElementRuns: rest_run_count pairs of
  /// bounds, then rest_run_count + 1 prefix counts (the last one the total). Empty for a network whose
  /// every tensor is updated in its GEMM: then no separate pass runs at all.
  static constexpr std::size_t rest_run_count = detail::plan_facts<Net, groups>::rest_count;
  static constexpr auto rest_runs = detail::plan_facts<Net, groups>::rest;
  /// Elements the pass over the rest updates.
  static constexpr std::size_t rest_elements = rest_runs[3 * rest_run_count];

  // A layer updated in its GEMMs has one GEMM weight (which Decay::weights decays) and at most a bias
  // (which it does not): the two targets CudaGroups gives its backward.
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    auto ok = [](bool updates, std::size_t layer) {
      if (!updates) return true;
      std::size_t weights = 0, others = 0;
      for (const ParamTensor& t : Net::param_layout)
        if (t.layer == layer) (t.gemm_weight() ? weights : others) += 1;
      return weights == 1 && others <= 1;
    };
    return (ok(detail::plan_facts<Net, groups>::stage_updates[I], detail::plan_facts<Net, groups>::stage_layer[I]) &&
            ...);
  }(std::make_index_sequence<Net::stage_count>{}),
                "CudaPlan: a layer updated in its GEMMs must hold one Conv2d or Linear weight and at most a bias");
};

/// The per-sample workspace of a Cuda model of Net under P (StageBinding's Layout): Sequential's own
/// layout, its regions in the same order, two kinds of them smaller (the header's comment):
///   - the conv's output region of a conv + max-pool group holds only the one-byte argmax of each
///     window, since the fused kernel writes the pooled values to the pooling's region and nothing to
///     the conv's: a quarter of the pooled values' floats, where Sequential keeps the conv's whole output
///     (K^2 x 4 times as many bytes);
///   - a group's output stored in 16 bits (CudaPlan::narrow_output): half its floats.
/// Each gradient buffer holds the widest tensor backward writes into one, in its element: the loss
/// gradient (fp32), and each group's input gradient as the group below reads it (fp32 values, in 16 bits
/// where dx_element says, or the dz a sink writes: a conv + max-pool's dense one, in 16 bits where
/// received_dz_element says). Net's buffers hold its widest activation, though the network's input never
/// gets a gradient and a fused conv + max-pool's dense gradient is either never written or, under Bf16
/// past a ReLU, written in 16 bits. A residual block saves what its inner layouts need
/// (Residual::saved_elements<In, Epi, P>: 16-bit tensors inside blocks under Bf16) and works in what its
/// gradients need (Residual::cuda_backward_elements<In, P>: half, where they are 16-bit). Everything
/// else (other saved values) keeps Net's sizes.
/// @tparam Net a Sequential<...>
/// @tparam P precision::Tf32, Fp32 or Bf16
template <class Net, class P>
struct CudaWorkspace {
 private:
  using plan = CudaPlan<Net, P>;
  // Per stage: whether its input gradient is stored in 16 bits (under Bf16): stage I (not the first, not a
  // reshape) writes it so and the stage that reads it (the last before I that is not a reshape) reads it
  // so (writes_16bit_gradient, reads_16bit_gradient: ResNet's BatchNorms, blocks and convs without
  // epilogue), both in groups of a stage of their own, at a boundary where no sink writes a dz.
  static constexpr std::array<bool, Net::stage_count> narrow_dx_ = [] {
    using facts = detail::plan_facts<Net, typename plan::groups>;
    constexpr std::size_t n = Net::stage_count;
    std::array<bool, n> r{};
    if (!std::is_same_v<P, precision::Bf16> || !cuda_narrow_outputs) return r;
    const std::array<bool, n> writes = []<std::size_t... I>(std::index_sequence<I...>) {
      return std::array<bool, n>{
          writes_16bit_gradient<typename Net::template stage<I>::layer, typename Net::template stage<I>::in>()...};
    }(std::make_index_sequence<n>{});
    const std::array<bool, n> reads = []<std::size_t... I>(std::index_sequence<I...>) {
      return std::array<bool, n>{reads_16bit_gradient<typename Net::template stage<I>::layer,
                                                      typename Net::template stage<I>::in,
                                                      typename Net::template stage<I>::epilogue>()...};
    }(std::make_index_sequence<n>{});
    std::array<std::size_t, n> group_of{};
    for (std::size_t g = 0; g < plan::group_count; ++g)
      for (std::size_t i = plan::summary[g].first; i <= plan::summary[g].last; ++i) group_of[i] = g;
    for (std::size_t i = 1; i < n; ++i) {
      if (Net::stage_plan[i].aliases_input) continue;
      std::size_t j = i - 1;
      while (j > 0 && Net::stage_plan[j].aliases_input) --j;
      const std::size_t gi = group_of[i], gj = group_of[j];
      const bool own = plan::summary[gi].kind == CudaGroupKind::stage && plan::summary[gj].kind == CudaGroupKind::stage;
      const bool sunk = facts::receiver[gi] != plan::group_count || facts::receives[gj];
      r[i] = !Net::stage_plan[j].aliases_input && own && !sunk && writes[i] && reads[j];
    }
    return r;
  }();
  // dy of stage I: the input gradient of the first stage after it that is not a reshape (fp32 for the
  // last: the loss's gradient).
  static constexpr std::array<bool, Net::stage_count> narrow_dy_ = [] {
    std::array<bool, Net::stage_count> r{};
    for (std::size_t i = 0; i < Net::stage_count; ++i) {
      std::size_t k = i + 1;
      while (k < Net::stage_count && Net::stage_plan[k].aliases_input) ++k;
      r[i] = k < Net::stage_count && narrow_dx_[k];
    }
    return r;
  }();
  // Floats a sample of the input gradient group G writes into a gradient buffer (0 where it writes none:
  // the first stage's, or a Flatten's, which runs no backward). Through the sink of the group below that
  // receives its dz (CudaPlan::dz_receiver): that group's dz, dense before a fused max-pool, in its
  // element; else the first stage's input gradient in fp32 elements. A fused MLP the device cannot run
  // runs layer by layer, each layer's input gradient plainly.
  template <std::size_t G>
  static constexpr std::size_t written_floats() {
    using Gr = typename plan::template group<G>;
    using First = typename Net::template stage<Gr::first>;
    std::size_t most = 0;
    if constexpr (Gr::first > 0 && First::kind != LayerKind::reshape) {
      constexpr std::size_t r = plan::template dz_receiver<G>;
      if constexpr (r == plan::group_count) {
        most = narrow_dx_[Gr::first] ? (First::in::size + 1) / 2 : First::in::size;
      } else {
        using Below = typename Net::template stage<plan::template group<r>::first>;
        constexpr bool half = sizeof(kernels::received_dz_element<P, typename Below::epilogue>) == 2;
        most = half ? (Below::out::size + 1) / 2 : Below::out::size;
      }
    }
    if constexpr (Gr::kind == CudaGroupKind::mlp)
      [&]<std::size_t... L>(std::index_sequence<L...>) {
        ((most = std::max(most, Net::template stage<Gr::first + 1 + L>::in::size)), ...);
      }(std::make_index_sequence<Gr::last - Gr::first>{});
    return most;
  }
  static constexpr std::size_t gradient_floats_ = []<std::size_t... G>(std::index_sequence<G...>) {
    return align_elements(std::max({Net::output_shape::size, written_floats<G>()...}));
  }(std::make_index_sequence<plan::group_count>{});
  static constexpr auto layout_ = [] {
    using facts = detail::plan_facts<Net, typename plan::groups>;
    constexpr std::size_t n = Net::stage_count;
    constexpr std::array<std::size_t, n> out_size = []<std::size_t... I>(std::index_sequence<I...>) {
      return std::array<std::size_t, n>{Net::template stage<I>::out::size...};
    }(std::make_index_sequence<n>{});
    // Floats per sample that stage I's output region needs here, where it differs from Net's (else 0).
    std::array<std::size_t, n> smaller{};
    for (std::size_t g = 0; g < plan::group_count; ++g) {
      const CudaGroupInfo& info = plan::summary[g];
      if (info.kind == CudaGroupKind::conv_maxpool) smaller[info.first] = (out_size[info.first + 1] + 3) / 4;
      if (std::is_same_v<P, precision::Bf16> && facts::narrow[g]) smaller[info.last] = (out_size[info.last] + 1) / 2;
    }
    // A layer that saves less on Cuda says so (a residual block whose inner networks store 16-bit tensors).
    const std::array<std::size_t, n> saved = []<std::size_t... I>(std::index_sequence<I...>) {
      return std::array<std::size_t, n>{detail::cuda_saved_elements<typename Net::template stage<I>, P>()...};
    }(std::make_index_sequence<n>{});
    return detail::resized_layout<Net>(smaller, saved);
  }();

 public:
  /// Where each stage's output and saved values lie, per sample (Sequential::stage_plan's fields).
  static constexpr std::array<StagePlan, Net::stage_count> stage_plan = layout_.first;
  static constexpr std::size_t activation_elements = layout_.second;
  /// Floats a sample of each gradient buffer (at most Net's: see above).
  static constexpr std::size_t gradient_elements = gradient_floats_;
  static_assert(gradient_elements <= Net::gradient_elements, "CudaWorkspace: a gradient buffer wider than Net's");
  /// Floats a sample of backward's work memory: the most any stage asks for on Cuda (a residual block whose
  /// gradients are 16-bit: half its buffers, Residual::cuda_backward_elements), else Net's.
  static constexpr std::size_t backward_elements = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::max({std::size_t(0), detail::cuda_backward_elements<typename Net::template stage<I>, P>()...});
  }(std::make_index_sequence<Net::stage_count>{});
  static_assert(backward_elements <= Net::backward_elements, "CudaWorkspace: more work memory than Net's");
  static constexpr std::size_t workspace_elements_per_sample =
      activation_elements + 2 * gradient_elements + backward_elements;

 private:
  // Per stage: whether its output is stored in 16 bits (the last stage of a group with narrow_output),
  // and whether its input is (the output of the last stage before it that is not a reshape).
  static constexpr std::array<bool, Net::stage_count> narrow_out_ = [] {
    std::array<bool, Net::stage_count> r{};
    for (std::size_t g = 0; g < plan::group_count; ++g)
      r[plan::summary[g].last] = std::is_same_v<P, precision::Bf16> && detail::plan_facts<Net, typename plan::groups>::narrow[g];
    return r;
  }();
  static constexpr std::array<bool, Net::stage_count> narrow_in_ = [] {
    std::array<bool, Net::stage_count> r{};
    for (std::size_t i = 1; i < Net::stage_count; ++i) {
      std::size_t j = i - 1;
      while (j > 0 && Net::stage_plan[j].aliases_input) --j;
      r[i] = !Net::stage_plan[j].aliases_input && narrow_out_[j];
    }
    return r;
  }();

 public:
  /// The elements stage I's output and input are stored in (StageBinding runs the stages with them:
  /// stage_elements): BFloat16 where CudaPlan::output_element and input_element say so for its group.
  template <std::size_t I>
  using output_element = std::conditional_t<narrow_out_[I], kernels::BFloat16, float>;
  template <std::size_t I>
  using input_element = std::conditional_t<narrow_in_[I], kernels::BFloat16, float>;
  /// The elements stage I's output gradient (dy) and input gradient (dx) are stored in: BFloat16 where the
  /// stages on both sides take them so (see narrow_dx_), else float.
  template <std::size_t I>
  using dy_element = std::conditional_t<narrow_dy_[I], kernels::BFloat16, float>;
  template <std::size_t I>
  using dx_element = std::conditional_t<narrow_dx_[I], kernels::BFloat16, float>;
};

/// A 64-bit digest of everything CudaPlan<Net, P> and CudaWorkspace<Net, P> decide: the groups and their
/// facts, the fused update's tensors, the workspace's regions and elements, and each layer's own plan
/// (net/layout_fingerprint.hpp). Device code and host code of one .cu file compute it separately (nvcc's
/// front end for the device, the host compiler for the host); the Cuda model compares the two when it is
/// built (kernels/cuda/device_constant.cuh), so that a disagreement between them is an error that says
/// so, not kernels that run one plan over memory laid out by the other.
/// @tparam Net a Sequential<...>
/// @tparam P precision::Tf32, Fp32 or Bf16
template <class Net, class P>
struct CudaPlanFingerprint {
  static constexpr std::uint64_t value = [] {
    using plan = CudaPlan<Net, P>;
    using facts = detail::plan_facts<Net, typename plan::groups>;
    detail::Fnv1a f;
    f.word(Net::fingerprint);
    f.word(std::is_same_v<P, precision::Bf16> ? 2 : std::is_same_v<P, precision::Fp32> ? 1 : 0);
    f.word(cuda_fused_gradients);
    f.word(cuda_narrow_outputs);
    f.word(plan::group_count);
    for (std::size_t g = 0; g < plan::group_count; ++g) {
      f.word(std::size_t(facts::summary[g].kind));
      f.word(facts::summary[g].first);
      f.word(facts::summary[g].last);
      for (const bool b : {facts::updates[g], facts::reshape[g], facts::sink[g], facts::transforms[g],
                           facts::receives[g], facts::writes16[g], facts::reads16[g], facts::narrow[g],
                           facts::narrow_input[g]})
        f.word(b);
      f.word(facts::above[g]);
      f.word(facts::feeder[g]);
      f.word(facts::receiver[g]);
    }
    for (std::size_t i = 0; i < Net::stage_count; ++i) {
      f.word(facts::stage_updates[i]);
      f.word(facts::stage_layer[i]);
    }
    f.word(plan::mlp_gradient_elements);
    for (const std::size_t v : plan::updated_tensors) f.word(v);
    for (const std::size_t v : plan::rest_runs) f.word(v);
    using W = CudaWorkspace<Net, P>;
    detail::hash_layout<Net, W, P>(f);
    f.word(W::gradient_elements);
    f.word(W::backward_elements);
    return f.h;
  }();
};

}  // namespace fusedp
