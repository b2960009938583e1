#pragma once
// Residual<Body..., Shortcut>: a residual block as one element of a flat Sequential. The body is a flat
// list of layers; the shortcut is IdentityShortcut or Projection<Layers...> (a flat list too: the 1x1
// conv with stride and the BatchNorm of a ResNet stage change). The block's output is
// body(x) + shortcut(x); the activation written after the block in the Sequential (ResNet's ReLU) rides
// in the epilogue of that add, as activations do behind any anchor. Where the body ends in a layer that
// takes the add (BatchNorm: adds_before_epilogue), the add and the activation run in that layer's own
// pass (fused_add), and in evaluation, where a conv folds that BatchNorm, in the conv's
// epilogue; otherwise in a pass of their own.
//
// Inside, body and shortcut are Sequentials of their own, so every shape, the parameter and state
// layouts and the stage plans come from the same code as the network's; a shape mismatch inside a
// block (body or projection) is reported with the block's index and the layer's inside it, before the
// inner Sequential is made (misfit). The block's parameters and state are the inner layouts one after
// the other (body, then shortcut), named as PyTorch names a module's children: by position, or by
// Named<>.
//
// Memory per sample: the body's and the shortcut's activations and the sum before the epilogue (the
// block's saved region; with fused_add without the body's last output, which is the block's, and
// without the sum unless the epilogue reads its input: saved_elements), and three gradient buffers in
// the network's backward work memory, which every block of the network shares (blocks run backward
// one after the other). A block inside a block is not supported: both would work in the same memory.
// On a Bf16 Cuda model the inner networks lie as InnerLayout says: a conv's or BatchNorm's output that
// the next inner stage reads in 16 bits is stored so, in half its region; saved_elements<In, Epi, P> is
// then the Cuda workspace's region for the block. The block's own input and output may be 16-bit too
// (cuda_reads_16bit, cuda_writes_16bit; the model's plan decides, net/cuda_plan.hpp). ResNet-18 at batch
// 128: 931 MiB -> 647 MiB.
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/exec/precision.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/layers/input.hpp"
#include "fusedp/layers/layer.hpp"
#include "fusedp/net/activation_storage.hpp"
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

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/pointwise.cuh"
#endif

namespace fusedp {

/// The shortcut of a block whose body keeps the shape: the block's input itself.
struct IdentityShortcut {
  static constexpr const char* name = "IdentityShortcut";
};

/// A shortcut that runs layers of its own on the block's input (torchvision's `downsample`).
/// @tparam Layers the layers, in order (Conv2d<Out, 1, Stride, 0, no_bias>, BatchNorm2d<>)
template <class... Layers>
struct Projection {
  static_assert(sizeof...(Layers) > 0, "Projection: give it at least one layer (or use IdentityShortcut)");
  static constexpr const char* name = "Projection";
  template <class In>
  using network = Sequential<Input<In::channels, In::height, In::width>, Layers...>;
};

/// Instantiated when a block's body and shortcut produce different shapes: the compiler prints
/// residual_shape_mismatch<body output, shortcut output>.
template <class BodyOut, class ShortcutOut>
struct residual_shape_mismatch {
  static_assert(sizeof(BodyOut) == 0,
                "fusedp::Residual: the body's output and the shortcut's output differ in shape; see "
                "residual_shape_mismatch<body output, shortcut output> (an IdentityShortcut keeps the "
                "input's shape: use a Projection when the body changes it)");
  static constexpr bool value = true;
};

namespace detail {

template <class S>
constexpr bool is_identity_shortcut() {
  return std::is_same_v<S, IdentityShortcut>;
}
template <class S, class In>
struct projection_of {
  using type = typename S::template network<In>;
};
template <class In>
struct projection_of<IdentityShortcut, In> {
  using type = void;
};

// The layers of a projection shortcut (found through Named<>, which derives from Projection).
template <class... Layers>
type_list<Layers...> projection_layers(const Projection<Layers...>*);

// The first misfit of a block: its body's at In, else (where the body fits) its projection's, at In too.
template <class BodyMisfit, class ShortcutMisfit>
struct block_misfit {
  static constexpr bool in_shortcut = BodyMisfit::index == 0 && ShortcutMisfit::index != 0;
  using which = std::conditional_t<in_shortcut, ShortcutMisfit, BodyMisfit>;
  static constexpr std::size_t index = which::index;
  using layer = typename which::layer;
  using expected = typename which::expected;
  using got = typename which::got;
};
template <class In, class List>
struct misfit_in;
template <class In, class... Layers>
struct misfit_in<In, type_list<Layers...>> {
  using type = first_misfit<0, In, Layers...>;
};
template <class S, class In>
struct shortcut_misfit {
  using type = first_misfit<0, In>;  // the identity (or not a shortcut, which Residual reports): nothing inside
};
template <class S, class In>
  requires requires { projection_layers(static_cast<const S*>(nullptr)); }
struct shortcut_misfit<S, In> {
  using type = typename misfit_in<In, decltype(projection_layers(static_cast<const S*>(nullptr)))>::type;
};

template <class S>
constexpr bool is_shortcut() {
  if constexpr (is_identity_shortcut<S>()) return true;
  else return requires { typename S::template network<Shape<1, 1, 1>>; };
}

// The inner networks of a block at input In. Shortcut: IdentityShortcut, Projection<...> or a
// Named<> projection (which derives from Projection, so network<In> is found through it).
template <class In, class... Body>
using body_network = Sequential<Input<In::channels, In::height, In::width>, Body...>;

template <class Net>
constexpr bool has_reshape() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return (... || (Net::template stage<I>::kind == LayerKind::reshape));
  }(std::make_index_sequence<Net::stage_count>{});
}

/// Where a block's inner network Net lies per sample on a Cuda model of precision P (void: on the Host,
/// Net's own layout), a Layout for stage_args. Under precision::Bf16 a stage's output is stored in 16
/// bits (kernels::BFloat16, half its region) where its layer writes it so (writes_16bit_output) and the
/// next stage, its only other reader, reads it so (reads_16bit_input): in a ResNet block every conv's
/// output and the first BatchNorm's. The last stage's output is the block's own (stored as Out, which
/// the model's plan chose) or feeds the block's add (stored as Out: a projection's output, which a
/// fused add reads in 16 bits, in half its region where LastHalf); the first stage reads the block's
/// input (In0) and the last stage's add is Add (the block's input with the identity, else the
/// projection's output). cuda_narrow_outputs = false keeps every output fp32.
template <class Net, class P, class In0 = float, class Out = float, class Add = float, bool LastHalf = false>
struct InnerLayout {
 private:
  static constexpr std::size_t n = Net::stage_count;
  template <std::size_t I>
  static constexpr bool narrow_at() {
    if constexpr (!std::is_same_v<P, precision::Bf16> || !cuda_narrow_outputs || I + 1 >= n) {
      return false;
    } else {
      using S = typename Net::template stage<I>;
      using R = typename Net::template stage<I + 1>;
      return S::kind == LayerKind::anchor && R::kind == LayerKind::anchor &&
             writes_16bit_output<typename S::layer, typename S::in, typename S::epilogue>() &&
             reads_16bit_input<typename R::layer, typename R::in>();
    }
  }

 public:
  /// Whether stage I's output is stored in 16 bits.
  static constexpr std::array<bool, n> narrow = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<bool, n>{narrow_at<I>()...};
  }(std::make_index_sequence<n>{});

 private:
  static constexpr auto layout_ = []<std::size_t... I>(std::index_sequence<I...>) {
    const std::array<std::size_t, n> out{
        (narrow[I] || (LastHalf && I + 1 == n) ? (Net::template stage<I>::out::size + 1) / 2 : 0)...};
    return resized_layout<Net>(out, std::array<std::size_t, n>{});
  }(std::make_index_sequence<n>{});

 public:
  static constexpr std::array<StagePlan, n> stage_plan = layout_.first;
  static constexpr std::size_t activation_elements = layout_.second;
  /// The elements stage I's output, input and add are stored in (stage_elements reads them).
  template <std::size_t I>
  using output_element = std::conditional_t<I + 1 == n, Out, std::conditional_t<narrow[I], kernels::BFloat16, float>>;
  template <std::size_t I>
  using input_element = std::conditional_t<I == 0, In0, output_element<(I > 0 ? I - 1 : 0)>>;
  template <std::size_t I>
  using add_element = std::conditional_t<I + 1 == n, Add, float>;
};
/// The identity shortcut's: nothing.
template <class P, class In0, class Out, class Add, bool LastHalf>
struct InnerLayout<void, P, In0, Out, Add, LastHalf> {
  static constexpr std::size_t activation_elements = 0;
};

/// Whether layer L takes StageArgs::add (adds_before_epilogue: BatchNorm). A function, not a requires-
/// expression inside a lambda that initializes a static member: nvcc's front end evaluated that one to
/// false where g++ found true (2026-12-07), so that the two compilers of one .cu file disagreed on a
/// block's plan, and on the kernels it instantiates.
template <class L>
constexpr bool adds_before_epilogue() {
  if constexpr (requires { L::adds_before_epilogue; }) return L::adds_before_epilogue;
  else return false;
}
/// Whether the last stage of Net is a layer that takes the add, with no epilogue of its own.
template <class Net>
constexpr bool last_stage_adds() {
  using Last = typename Net::template stage<Net::stage_count - 1>;
  return Last::kind == LayerKind::anchor && adds_before_epilogue<typename Last::layer>() && Last::epilogue::empty;
}

/// Whether the gradient between stages I - 1 and I of Net may be stored in 16 bits on Cuda: stage I writes
/// it so and stage I - 1, with its epilogue, reads it so (true for I = 0, which has none below it).
template <class Net, std::size_t I>
constexpr bool boundary_16bit_gradient() {
  if constexpr (I == 0) {
    return true;
  } else {
    using S = typename Net::template stage<I>;
    using R = typename Net::template stage<I - 1>;
    return writes_16bit_gradient<typename S::layer, typename S::in>() &&
           reads_16bit_gradient<typename R::layer, typename R::in, typename R::epilogue>();
  }
}
/// Whether every gradient between Net's stages may be stored in 16 bits.
template <class Net>
constexpr bool inner_16bit_gradients() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return (boundary_16bit_gradient<Net, I>() && ...);
  }(std::make_index_sequence<Net::stage_count>{});
}

/// The precision a space's inner layouts are made for: P on CudaSpace<P>, void on the Host.
template <class Space>
struct layout_precision {
  using type = void;
};
#if FUSEDP_HAS_CUDA
template <class P>
struct layout_precision<CudaSpace<P>> {
  using type = P;
};
#endif

// The block's own elementwise steps on each space.
// y and dx are stored as the block's bf16_y and bf16_dx say, rounded as they are written on both spaces:
// y by the add, or with the add fused by the body's last stage (its layer, or the inner binding after
// it); dx by the copy that finishes it (into_dx), which every backward ends with.
template <class Epi, class T>
void residual_add(const StageArgs<Host, T>& a, std::size_t n, const T* body, const T* shortcut, T* sum) {
  kernels::host::add_forward<Epi>(a.space, n, body, shortcut, sum, a.y, a.bf16_y);
}
template <class Epi, class T>
void residual_epilogue_backward(const StageArgs<Host, T>& a, std::size_t n, const T* sum) {
  kernels::host::epilogue_backward<Epi>(a.space, n, sum, a.y, a.dy);
}
// dst = src, or dst += src into the block's dx (`into_dx`); S, D: the elements of src and dst (Cuda).
template <class S = float, class D = float, class T>
void residual_copy(const StageArgs<Host, T>& a, std::size_t n, const T* src, T* dst, bool accumulate, bool into_dx) {
  static_assert(std::is_same_v<S, float> && std::is_same_v<D, float>, "Residual on the Host: gradients in T");
  kernels::host::copy_values(a.space, n, src, dst, accumulate, into_dx && a.bf16_dx);
}
#if FUSEDP_HAS_CUDA
template <class Epi, class T, class P>
void residual_add(const StageArgs<CudaSpace<P>, T>& a, std::size_t n, const T* body, const T* shortcut, T* sum) {
  kernels::cuda::add_forward<Epi>(a.space.stream(), n, body, shortcut, sum, a.y, a.bf16_y);
}
template <class Epi, class T, class P>
void residual_epilogue_backward(const StageArgs<CudaSpace<P>, T>& a, std::size_t n, const T* sum) {
  kernels::cuda::epilogue_backward<Epi>(a.space.stream(), n, sum, a.y, a.dy);
}
template <class S = float, class D = float, class T, class P>
void residual_copy(const StageArgs<CudaSpace<P>, T>& a, std::size_t n, const T* src, T* dst, bool accumulate,
                   bool into_dx) {
  kernels::cuda::copy_values<S, D>(a.space.stream(), n, reinterpret_cast<const S*>(src), reinterpret_cast<D*>(dst),
                                   accumulate, into_dx && a.bf16_dx);
}
#endif

// GEMM multiply-adds per sample of an inner network's stages.
template <class Net>
constexpr double inner_macs() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return (0.0 + ... +
            forward_macs_of<typename Net::template stage<I>::layer, typename Net::template stage<I>::in>());
  }(std::make_index_sequence<Net::stage_count>{});
}

/// Runs the stages of an inner network forward over memory `m` laid out as Layout (InnerLayout), from
/// input `x` (in evaluation folding as the model does, see stage_binding.hpp). With LastEpi, the last
/// stage writes `last_y` (`last_z` its values before LastEpi), adding `last_add` before it: the block's
/// output, stored as the block's a.bf16_y says (fp32 where it is the network's output).
template <Network Net, class Layout, class LastEpi = void, class Space, class T>
void run_forward(const StageArgs<Space, T>& a, const StageMemory<T>& m, const T* x, T* last_y = nullptr,
                 T* last_z = nullptr, const T* last_add = nullptr) {
  const auto args_of = [&]<std::size_t J>() {
    StageArgs<Space, T> s = stage_args<Net, J, Layout>(a.space, m, x, a.batch, a.training, a.scratch, a.seed,
                                                       a.step, a.index, a.sync, a.first_sample);
    if constexpr (!std::is_void_v<LastEpi> && J + 1 == Net::stage_count) {
      s.y = last_y;
      s.z = last_z;
      s.add = last_add;
      s.bf16_y = a.bf16_y;
    }
    return s;
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (forward_folding<Net, I, Space, T, LastEpi, Layout>(args_of, a.training), ...);
  }(std::make_index_sequence<Net::stage_count>{});
}

/// Runs an inner network (laid out as Layout) backward from `dy` (its output's gradient, may be
/// overwritten; stored as DY) to `dx` (its input's, skipped when null; stored as DX), alternating between
/// the buffers g0 and g1 in between (their gradients stored as G). With LastEpi, the last stage ran
/// forward with that epilogue into last_y (last_z its values before it): backward applies its derivative
/// there.
template <Network Net, class Layout, class LastEpi = void, class DY = float, class DX = float, class G = float,
          class Space, class T>
void run_backward(const StageArgs<Space, T>& a, const StageMemory<T>& m, const T* x, T* dy, T* dx, T* g0, T* g1,
                  T* last_y = nullptr, T* last_z = nullptr) {
  T* current = dy;
  [&]<std::size_t... R>(std::index_sequence<R...>) {
    (
        [&] {
          constexpr std::size_t I = Net::stage_count - 1 - R;
          using S = typename Net::template stage<I>;
          // Stage 0 with nothing to compute is skipped, unless it applies LastEpi's derivative to dy, which
          // the block's shortcut then reads (a body of one BatchNorm without parameters, first in the net).
          constexpr bool forms_dz = !std::is_void_v<LastEpi> && I == Net::stage_count - 1;
          if (I == 0 && !S::has_params && dx == nullptr && !forms_dz) return;
          StageArgs<Space, T> s = stage_args<Net, I, Layout>(a.space, m, x, a.batch, true, a.scratch, a.seed, a.step,
                                                             a.index, a.sync, a.first_sample);
          s.dy = current;
          s.dx = I == 0 ? dx : (current == g0 ? g1 : g0);
          using X = typename stage_elements<Layout, I>::input;
          using Y = typename stage_elements<Layout, I>::output;
          using SY = std::conditional_t<I + 1 == Net::stage_count, DY, G>;
          using SX = std::conditional_t<I == 0, DX, G>;
          if constexpr (forms_dz) {
            s.y = last_y;
            s.z = last_z;
            s.keeps_dz = true;  // the block's shortcut takes dz from dy
            stage_backward<S, LastEpi, X, Y, SY, SX>(s);
          } else {
            stage_backward<S, typename S::epilogue, X, Y, SY, SX>(s);
          }
          round_stored<typename S::layer>(a.space, s.dx, a.batch * S::in::size, s.bf16_dx);
          current = s.dx;
        }(),
        ...);
  }(std::make_index_sequence<Net::stage_count>{});
}

}  // namespace detail

/// A residual block: Residual<Body..., Shortcut>, the last element the shortcut.
/// @tparam Elements the body's layers, then IdentityShortcut or Projection<...> (possibly Named<>)
template <class... Elements>
struct Residual {
  static_assert(sizeof...(Elements) >= 2, "Residual<Body..., Shortcut>: give at least one body layer and a shortcut");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  static constexpr const char* name = "Residual";

 private:
  using elements = detail::type_list<Elements...>;
  static constexpr std::size_t body_size = sizeof...(Elements) - 1;
  using shortcut = typename detail::type_at<body_size, elements>::type;
  static constexpr bool identity = detail::is_identity_shortcut<shortcut>();

  template <class In, class Seq>
  struct body_of;
  template <class In, std::size_t... I>
  struct body_of<In, std::index_sequence<I...>> {
    using type = detail::body_network<In, typename detail::type_at<I, elements>::type...>;
  };

  template <class In, class Seq>
  struct misfit_of;
  template <class In, std::size_t... I>
  struct misfit_of<In, std::index_sequence<I...>> {
    using type = detail::block_misfit<detail::first_misfit<0, In, typename detail::type_at<I, elements>::type...>,
                                      typename detail::shortcut_misfit<shortcut, In>::type>;
  };

 public:
  /// The first layer that cannot take what it receives at block input In, the body's, else the
  /// projection's (index 0: none, else its index in the body or projection + 1; in_shortcut says
  /// which): Sequential reports it with the block's index (block_shape_mismatch,
  /// shortcut_shape_mismatch).
  template <class In>
  using misfit = typename misfit_of<In, std::make_index_sequence<body_size>>::type;

  /// The body and the shortcut at input In, as networks of their own (the identity: none).
  template <class In>
  using body = typename body_of<In, std::make_index_sequence<body_size>>::type;
  template <class In>
  using projection = typename detail::projection_of<shortcut, In>::type;
  /// Whether a Cuda model of precision P stores the projection's output in 16 bits (see body_layout).
  template <class In, class P>
  static constexpr bool narrow_shortcut() {
    if constexpr (identity || !std::is_same_v<P, precision::Bf16> || !cuda_narrow_outputs) {
      return false;
    } else {
      using Last = typename projection<In>::template stage<projection<In>::stage_count - 1>;
      return detail::last_stage_adds<body<In>>() && Last::kind == LayerKind::anchor &&
             writes_16bit_output<typename Last::layer, typename Last::in, typename Last::epilogue>();
    }
  }
  template <class In, class P>
  using shortcut_element = std::conditional_t<narrow_shortcut<In, P>(), kernels::BFloat16, float>;

  /// Where the body and the projection lie per sample on a Cuda model of precision P (void: the Host):
  /// detail::InnerLayout, Net's own layout but for 16-bit tensors under Bf16; X and Y the elements the
  /// block's input and output are stored in (the model's plan decides: cuda_reads_16bit,
  /// cuda_writes_16bit), which change no size.
  /// The projection's output is stored in 16 bits too (shortcut_element) where the body's last stage
  /// reads it as stored, in its fused add, and the projection's last layer writes 16 bits; the add of a
  /// pass of its own reads fp32.
  template <class In, class P = void, class X = float, class Y = float>
  using body_layout = detail::InnerLayout<body<In>, P, X, Y, std::conditional_t<identity, X, shortcut_element<In, P>>>;
  template <class In, class P = void, class X = float>
  using projection_layout =
      detail::InnerLayout<projection<In>, P, X, shortcut_element<In, P>, float, narrow_shortcut<In, P>()>;

 private:
  template <class In>
  static constexpr auto check_shapes() {
    using B = typename body<In>::output_shape;
    if constexpr (identity) {
      if constexpr (!std::is_same_v<B, In>) static_assert(residual_shape_mismatch<B, In>::value);
    } else {
      using P = typename projection<In>::output_shape;
      if constexpr (!std::is_same_v<B, P>) static_assert(residual_shape_mismatch<B, P>::value);
    }
    return B{};
  }
  static_assert(detail::is_shortcut<shortcut>(),
                "Residual<Body..., Shortcut>: the last element must be IdentityShortcut or Projection<...>");

  // Sizes of an inner network that may be absent (the identity shortcut).
  template <class In>
  static constexpr std::size_t shortcut_params() {
    if constexpr (identity) return 0;
    else return projection<In>::param_tensor_count;
  }
  template <class In>
  static constexpr std::size_t shortcut_states() {
    if constexpr (identity) return 0;
    else return projection<In>::state_tensor_count;
  }
  template <class In>
  static constexpr TensorName shortcut_key() {
    return detail::layer_key<shortcut>(body_size + 1);
  }

 public:
  template <class In>
  static constexpr bool accepts = true;  // what does not fit is reported inside (see above)
  template <class In>
  using expected = In;
  template <class In>
  using output = decltype(check_shapes<In>());

  template <class In>
  static constexpr auto params = [] {
    using B = body<In>;
    std::array<ParamSpec, B::param_tensor_count + shortcut_params<In>()> p{};
    std::size_t i = 0;
    auto add = [&](const ParamTensor& t, TensorName name) {
      p[i++] = ParamSpec{t.role, t.size, t.fan_in, t.rank, t.dims, name, t.constant, t.fill, t.normalization};
    };
    for (const ParamTensor& t : B::param_layout) add(t, t.name);
    if constexpr (!identity)
      for (const ParamTensor& t : projection<In>::param_layout) add(t, t.name.under(shortcut_key<In>()));
    return p;
  }();
  template <class In>
  static constexpr auto state = [] {
    using B = body<In>;
    std::array<StateSpec, B::state_tensor_count + shortcut_states<In>()> s{};
    std::size_t i = 0;
    auto add = [&](const StateTensor& t, TensorName name) {
      s[i++] = StateSpec{name, t.kind, t.size, t.rank, t.dims, t.fill};
    };
    for (const StateTensor& t : B::state_layout) add(t, t.name);
    if constexpr (!identity)
      for (const StateTensor& t : projection<In>::state_layout) add(t, t.name.under(shortcut_key<In>()));
    return s;
  }();

  /// Elements per sample of each of the three gradient buffers of backward.
  template <class In>
  static constexpr std::size_t gradient_elements = [] {
    std::size_t g = std::max({body<In>::gradient_elements, align_elements(In::size)});
    if constexpr (!identity) g = std::max(g, projection<In>::gradient_elements);
    return g;
  }();
  template <class In>
  static constexpr std::size_t backward_elements = 3 * gradient_elements<In>;
  template <class In>
  static constexpr std::size_t host_scratch = [] {
    if constexpr (identity) return body<In>::host_scratch_elements;
    else return std::max(body<In>::host_scratch_elements, projection<In>::host_scratch_elements);
  }();
  /// The fewest samples a training batch may hold: the most any inner layer asks for.
  template <class In>
  static constexpr std::size_t min_training_batch = [] {
    if constexpr (identity) return body<In>::min_training_batch;
    else return std::max(body<In>::min_training_batch, projection<In>::min_training_batch);
  }();
  /// The inner layers' GEMM multiply-adds per sample (the cost model's count).
  template <class In>
  static constexpr double forward_macs = [] {
    double m = detail::inner_macs<body<In>>();
    if constexpr (!identity) m += detail::inner_macs<projection<In>>();
    return m;
  }();
  template <class In>
  static constexpr std::uint64_t inner_fingerprint = [] {
    detail::Fnv1a f;
    f.word(body<In>::fingerprint);
    if constexpr (!identity) f.word(projection<In>::fingerprint);
    return f.h;
  }();

  /// Whether the body's last stage runs the add and the block's epilogue in its own pass: a layer
  /// that takes StageArgs::add (BatchNorm: ResNet's blocks), with nothing after it inside the body.
  template <class In>
  static constexpr bool fused_add = detail::last_stage_adds<body<In>>();
  /// The block stores y and dx as bf16 values itself on the Host too (residual_add, residual_copy).
  static constexpr bool host_rounds_stored = true;

  /// Under Bf16 a model may store the block's input in 16 bits where every reader inside takes it: the
  /// first layer of the body and of the projection, and with the identity the add, which a fused add
  /// reads as stored (BatchNorm's pass, or the conv's epilogue in evaluation) and a separate add does not;
  /// and its output where the body's last layer writes it, with the fused add (net/cuda_plan.hpp).
  template <class In>
  static constexpr bool cuda_reads_16bit = [] {
    using B = body<In>;
    bool r = reads_16bit_input<typename B::template stage<0>::layer, In>();
    if constexpr (identity) r = r && fused_add<In>;
    else r = r && reads_16bit_input<typename projection<In>::template stage<0>::layer, In>();
    return r;
  }();
  template <class In, class Epi>
  static constexpr bool cuda_writes_16bit = [] {
    using Last = typename body<In>::template stage<body<In>::stage_count - 1>;
    return fused_add<In> && writes_16bit_output<typename Last::layer, typename Last::in, Epi>();
  }();

  /// Under Bf16 the gradients inside the block, between its inner stages and the body's input gradient
  /// that the projection's is added to, are stored in 16 bits (inner_gradient_element) where every inner
  /// stage writes and reads them so and the add is fused (the bf16 values the model stores anyway). The
  /// block's own dy and dx may be 16-bit (the model's plan decides) where the layers that touch them take
  /// them so: dy the body's last layer (which overwrites it with dz, under the block's epilogue) and the
  /// projection's last, dx the body's first and the projection's first; the copies and adds between them
  /// are the block's own.
  template <class In>
  static constexpr bool gradients_16bit() {
    using B = body<In>;
    bool r = fused_add<In> && detail::inner_16bit_gradients<B>() &&
             writes_16bit_gradient<typename B::template stage<0>::layer, In>();
    if constexpr (!identity) r = r && detail::inner_16bit_gradients<projection<In>>();
    return r;
  }
  template <class In, class P>
  using inner_gradient_element =
      std::conditional_t<std::is_same_v<P, precision::Bf16> && cuda_narrow_outputs && gradients_16bit<In>(),
                         kernels::BFloat16, float>;
  /// Per-sample elements of each gradient buffer on a Cuda model of precision P (void: the Host): half
  /// where every gradient inside the block is 16-bit (inner_gradient_element).
  template <class In, class P = void>
  static constexpr std::size_t gradient_elements_on = [] {
    if constexpr (std::is_void_v<P>) return gradient_elements<In>;
    else if constexpr (sizeof(inner_gradient_element<In, P>) == 2) return align_elements((gradient_elements<In> + 1) / 2);
    else return gradient_elements<In>;
  }();
  template <class In, class P>
  static constexpr std::size_t cuda_backward_elements = 3 * gradient_elements_on<In, P>;
  template <class In, class Epi>
  static constexpr bool cuda_reads_16bit_gradient = [] {
    using Last = typename body<In>::template stage<body<In>::stage_count - 1>;
    bool r = fused_add<In> && reads_16bit_gradient<typename Last::layer, typename Last::in, Epi>();
    if constexpr (!identity) {
      using PLast = typename projection<In>::template stage<projection<In>::stage_count - 1>;
      r = r && reads_16bit_gradient<typename PLast::layer, typename PLast::in, typename PLast::epilogue>();
    }
    return r;
  }();
  template <class In>
  static constexpr bool cuda_writes_16bit_gradient = [] {
    bool r = fused_add<In> && writes_16bit_gradient<typename body<In>::template stage<0>::layer, In>();
    if constexpr (!identity) r = r && writes_16bit_gradient<typename projection<In>::template stage<0>::layer, In>();
    return r;
  }();

  /// Per-sample elements of the body's activations the block keeps (laid out as body_layout<In, P>). With
  /// fused_add the body's last stage writes the block's output (StageArgs::y of the block), never its
  /// own output region, which is the last part of the body's layout: that part is not reserved (its
  /// pointer, which nothing dereferences, points past the body's memory).
  template <class In, class P = void>
  static constexpr std::size_t body_saved = [] {
    using B = body<In>;
    using L = body_layout<In, P>;
    constexpr StagePlan last = L::stage_plan[B::stage_count - 1];
    using Last = typename B::template stage<B::stage_count - 1>;
    if constexpr (fused_add<In>) {
      static_assert(!last.aliases_input && !last.saves_z &&
                        last.out_offset + align_elements(Last::out::size) == L::activation_elements,
                    "Residual: a fused body's last output must be the end of its layout");
      return last.out_offset;
    } else {
      return L::activation_elements;
    }
  }();
  /// Per-sample elements forward leaves for backward when the block's epilogue (the activation after
  /// it) is Epi, on a Cuda model of precision P (void: the Host; the Cuda workspace asks for P, see
  /// net/cuda_plan.hpp): the body's and the projection's activations, and the sum before Epi where it
  /// is kept (always when the add has a pass of its own; with fused_add only when Epi needs its input).
  template <class In, class Epi, class P = void>
  static constexpr std::size_t saved_elements =
      body_saved<In, P> + projection_layout<In, P>::activation_elements +
      (fused_add<In> && !Epi::saves_input ? 0 : align_elements(output<In>::size));

  /// The block's own Cuda plan (net/layout_fingerprint.hpp) under P with its input stored as X and its
  /// output as Y: its fused add, which elements it takes, what it saves, and its inner layouts.
  template <class In, class Epi, class P, class X, class Y>
  static constexpr std::uint64_t cuda_plan_fingerprint = [] {
    detail::Fnv1a f;
    f.word(fused_add<In>);
    f.word(cuda_reads_16bit<In>);
    f.word(cuda_writes_16bit<In, Epi>);
    f.word(body_saved<In, P>);
    f.word(saved_elements<In, Epi, P>);
    f.word(sizeof(inner_gradient_element<In, P>));
    f.word(gradient_elements_on<In, P>);
    f.word(cuda_reads_16bit_gradient<In, Epi>);
    f.word(cuda_writes_16bit_gradient<In>);
    detail::hash_layout<body<In>, body_layout<In, P, X, Y>, P>(f);
    if constexpr (!identity) detail::hash_layout<projection<In>, projection_layout<In, P, X>, P>(f);
    return f.h;
  }();

  // Forward and backward are written once for both spaces: the inner stages run on their layers'
  // executors for the space, the add and copies on the space's elementwise kernels.
  // X, Y: the elements the block's input and output are stored in (cuda_reads_16bit, cuda_writes_16bit).
  template <class In, class Epi, class X = float, class Y = float, class T, class Space>
  static void forward(const StageArgs<Space, T>& a) {
    using P = typename detail::layout_precision<Space>::type;
    using BL = body_layout<In, P, X, Y>;
    using PL = projection_layout<In, P, X>;
    const Regions<In, T, P> r{a};
    if constexpr (fused_add<In>) {
      // The shortcut first, then the body, whose last stage adds it and applies the block's epilogue
      // into the block's output: one pass fewer over the block's output than a separate add.
      const T* shortcut_out = a.x;
      if constexpr (!identity) {
        detail::run_forward<projection<In>, PL>(a, r.side, a.x);
        shortcut_out = detail::stage_output<projection<In>, projection<In>::stage_count - 1, PL>(r.side.workspace,
                                                                                                a.x, a.batch);
      }
      // (In evaluation the conv before that BatchNorm runs it, the add and the epilogue.)
      detail::run_forward<body<In>, BL, Epi>(a, r.main, a.x, a.y, Epi::saves_input ? r.sum : nullptr, shortcut_out);
      return;
    }
    detail::run_forward<body<In>, BL>(a, r.main, a.x);
    const T* body_out = detail::stage_output<body<In>, body<In>::stage_count - 1, BL>(r.main.workspace, a.x, a.batch);
    const T* shortcut_out = a.x;
    if constexpr (!identity) {
      detail::run_forward<projection<In>, PL>(a, r.side, a.x);
      shortcut_out = detail::stage_output<projection<In>, projection<In>::stage_count - 1, PL>(r.side.workspace,
                                                                                              a.x, a.batch);
    }
    detail::residual_add<Epi>(a, a.batch * output<In>::size, body_out, shortcut_out, r.sum);
  }

  // DY, DX: the elements a.dy and a.dx are stored in (cuda_reads_16bit_gradient,
  // cuda_writes_16bit_gradient; only with fused_add).
  template <class In, class Epi, class X = float, class Y = float, class DY = float, class DX = float, class T,
            class Space>
  static void backward(const StageArgs<Space, T>& a) {
    using P = typename detail::layout_precision<Space>::type;
    using BL = body_layout<In, P, X, Y>;
    using PL = projection_layout<In, P, X>;
    const Regions<In, T, P> r{a};
    const std::size_t n_out = a.batch * output<In>::size;
    if constexpr (fused_add<In>) {
      // The body's last stage applies the epilogue's derivative to a.dy in place (the sum's gradient,
      // which the shortcut then takes). An identity's dx is the body's plus the sum's gradient.
      using G = inner_gradient_element<In, P>;
      T* z = Epi::saves_input ? r.sum : nullptr;
      if constexpr (identity) {
        detail::run_backward<body<In>, BL, Epi, DY, DX, G>(a, r.main, a.x, a.dy, a.dx, r.g[1], r.g[2], a.y, z);
        if (a.dx) detail::residual_copy<DY, DX>(a, n_out, a.dy, a.dx, true, true);
      } else {
        T* body_dx = a.dx ? r.g[0] : nullptr;
        detail::run_backward<body<In>, BL, Epi, DY, G, G>(a, r.main, a.x, a.dy, body_dx, r.g[1], r.g[2], a.y, z);
        detail::run_backward<projection<In>, PL, void, DY, DX, G>(a, r.side, a.x, a.dy, a.dx, r.g[1], r.g[2]);
        if (a.dx) detail::residual_copy<G, DX>(a, a.batch * In::size, body_dx, a.dx, true, true);
      }
      return;
    } else {
      static_assert(std::is_same_v<DY, float> && std::is_same_v<DX, float>,
                    "Residual: 16-bit gradients only with the add fused into the body's last stage");
    }
    detail::residual_epilogue_backward<Epi>(a, n_out, r.sum);  // a.dy: now the sum's gradient
    T* body_dx = a.dx ? r.g[0] : nullptr;
    if constexpr (identity) {
      if (a.dx) detail::residual_copy(a, n_out, a.dy, a.dx, false, false);
    } else {
      detail::residual_copy(a, n_out, a.dy, r.g[0], false, false);
      detail::run_backward<projection<In>, PL>(a, r.side, a.x, r.g[0], a.dx, r.g[1], r.g[2]);
    }
    detail::run_backward<body<In>, BL>(a, r.main, a.x, a.dy, body_dx, r.g[1], r.g[2]);
    if (a.dx) detail::residual_copy(a, a.batch * In::size, body_dx, a.dx, true, true);
  }

#if FUSEDP_HAS_CUDA
  /// Floats of Cuda workspace backward needs: the most any inner stage needs (they run one by one).
  template <class In>
  static std::size_t cuda_scratch(std::size_t batch, int sm_count) {
    std::size_t most = inner_cuda_scratch<body<In>>(batch, sm_count);
    if constexpr (!identity) most = std::max(most, inner_cuda_scratch<projection<In>>(batch, sm_count));
    return most;
  }
#endif

 private:
  static_assert(body_size > 0);

#if FUSEDP_HAS_CUDA
  template <class Net>
  static std::size_t inner_cuda_scratch(std::size_t batch, int sm_count) {
    std::size_t most = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            // Inner stages run as StageBinding runs a stage: their dz formed from dy, never received.
            using S = typename Net::template stage<I>;
            most = std::max(most, cuda_scratch_of<typename S::layer, typename S::in>(
                                      batch, sm_count,
                                      cuda_forms_dense_dz<typename S::layer, typename S::epilogue, false>()));
          }(),
          ...);
    }(std::make_index_sequence<Net::stage_count>{});
    return most;
  }
#endif

  // Where the block's inner networks work, from the stage's arguments (laid out for precision P: void on
  // the Host).
  template <class In, class T, class P>
  struct Regions {
    detail::StageMemory<T> main;  // the body's
    detail::StageMemory<T> side;  // the projection's
    T* sum;
    T* g[3];
    template <class Space>
    explicit Regions(const StageArgs<Space, T>& a) {
      static_assert(!detail::has_reshape<body<In>>(), "Residual: a block's body cannot hold Flatten");
      static_assert(body<In>::backward_elements == 0, "Residual: a block cannot hold another block");
      T* at = a.z;
      T* params = const_cast<T*>(a.w);
      main = {at, params, a.dw, a.state, nullptr};
      at += body_saved<In, P> * a.batch;
      if constexpr (!identity) {
        side = {at, params ? params + body<In>::param_storage : nullptr,
                a.dw ? a.dw + body<In>::param_storage : nullptr, a.state ? a.state + body<In>::state_storage : nullptr,
                nullptr};
        at += projection_layout<In, P>::activation_elements * a.batch;
      } else {
        side = {nullptr, nullptr, nullptr, nullptr, nullptr};
      }
      sum = at;  // reserved only where saved_elements says so (see there)
      // The gradient buffers: backward's work memory (null in forward, which does not use them).
      for (std::size_t i = 0; i < 3; ++i) g[i] = a.work ? a.work + i * gradient_elements_on<In, P> * a.batch : nullptr;
    }
  };
};

}  // namespace fusedp
