#pragma once
// Sequential<Input<C,H,W>, L...>: a network as a flat list of layer types. From it the compiler derives
// every shape (a mismatch is a static_assert naming the layer index and both shapes), the flat
// parameter layout with constexpr offsets, the fusion plan (stages: an anchor op and the pointwise ops
// in its epilogue) and the per-sample workspace plan.
#include "fusedp/core/shape.hpp"
#include "fusedp/kernels/activation.hpp"
#include "fusedp/layers/layer.hpp"

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedp {

/// Instantiated only when layer `Index` (Input is layer 0) of a Sequential cannot take its input: the
/// compiler prints shape_mismatch<index, layer, expected input shape, actual input shape>.
template <std::size_t Index, class Layer, class Expected, class Got>
struct shape_mismatch {
  static_assert(sizeof(Got) == 0,
                "fusedp::Sequential: a layer cannot take the shape it receives; see "
                "shape_mismatch<layer index, layer, expected input shape, actual input shape> in this message");
  static constexpr bool value = true;
};

/// Instantiated only when layer `LayerIndex` of the body of the block at `BlockIndex` (counted as in
/// the block's tensor names: the body's first layer is 0) cannot take its input: the compiler prints
/// block_shape_mismatch<block index, layer index in the block, layer, expected input shape, actual input shape>.
template <std::size_t BlockIndex, std::size_t LayerIndex, class Layer, class Expected, class Got>
struct block_shape_mismatch {
  static_assert(sizeof(Got) == 0,
                "fusedp::Residual: a layer inside a block cannot take the shape it receives; see "
                "block_shape_mismatch<block index, layer index in the block, layer, expected input shape, "
                "actual input shape> in this message");
  static constexpr bool value = true;
};

/// Instantiated only when layer `LayerIndex` of the projection shortcut of the block at `BlockIndex`
/// (counted as in the projection's tensor names, torchvision's `downsample.0`: its first layer is 0)
/// cannot take the block's input: the compiler prints
/// shortcut_shape_mismatch<block index, layer index in the shortcut, layer, expected input shape, actual input shape>.
template <std::size_t BlockIndex, std::size_t LayerIndex, class Layer, class Expected, class Got>
struct shortcut_shape_mismatch {
  static_assert(sizeof(Got) == 0,
                "fusedp::Residual: a layer of a block's projection shortcut cannot take the shape it receives; see "
                "shortcut_shape_mismatch<block index, layer index in the shortcut, layer, expected input shape, "
                "actual input shape> in this message");
  static constexpr bool value = true;
};

namespace detail {

template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

template <std::size_t I, class List>
struct type_at;
template <std::size_t I, class T, class... Ts>
struct type_at<I, type_list<T, Ts...>> : type_at<I - 1, type_list<Ts...>> {};
template <class T, class... Ts>
struct type_at<0, type_list<T, Ts...>> {
  using type = T;
};

/// A layer placed in a network: its index, its input and output shapes, its parameter tensors.
template <std::size_t Index, class L, class In, class Out>
struct Bound {
  static constexpr std::size_t index = Index;
  using layer = L;
  using in = In;
  using out = Out;
  static constexpr auto params = params_of<L, In>();
  static constexpr auto state = state_of<L, In>();
};

template <class L, class In, bool Ok>
struct output_if {
  using type = In;  // keeps inference going after a reported error, so only one error shows
};
template <class L, class In>
struct output_if<L, In, true> {
  using type = typename L::template output<In>;
};

// Stands in for an element that is not a layer, after its error, so no further errors follow.
struct Placeholder {
  static constexpr LayerKind kind = LayerKind::reshape;
  static constexpr const char* name = "(not a layer)";
};

template <class In>
struct input_shape_of {
  using type = Shape<1, 1, 1>;  // not an Input: reported by Sequential's static_assert
};
template <class In>
  requires requires { typename In::shape; }
struct input_shape_of<In> {
  using type = typename In::shape;
};

template <class In>
constexpr bool is_input_layer() {
  if constexpr (Layer<In>) return In::kind == LayerKind::input;
  else return false;
}

// Whether L is a layer that may follow Input; anything else is reported once, by bind_checked.
template <class L>
constexpr bool placeable() {
  if constexpr (Layer<L>) return L::kind != LayerKind::input;
  else return false;
}

template <class L, class In, bool Placeable = placeable<L>()>
struct accepts_input : std::true_type {};  // not a layer: already reported, keep the errors to one
template <class L, class In>
struct accepts_input<L, In, true> : std::bool_constant<L::template accepts<In>> {};

template <std::size_t I, class L, class In, bool Ok>
struct report_mismatch : std::true_type {};
template <std::size_t I, class L, class In>
struct report_mismatch<I, L, In, false> : shape_mismatch<I, L, typename L::template expected<In>, In> {};

// The first layer of a list that cannot take what it receives, walked from In without instantiating
// anything that would report it: index 0 and void types when every layer fits (a block's body).
template <std::size_t J, class In, class... Ls>
struct first_misfit {
  static constexpr std::size_t index = 0;
  using layer = void;
  using expected = void;
  using got = void;
};
template <class L, class In, bool Misfit>
struct expected_if {
  using type = void;
};
template <class L, class In>
struct expected_if<L, In, true> {
  using type = typename L::template expected<In>;
};
template <std::size_t J, class In, class L, class... Ls>
struct first_misfit<J, In, L, Ls...> {
  static constexpr bool ok = !placeable<L>() || accepts_input<L, In>::value;
  using next = first_misfit<J + 1, typename output_if<L, In, ok && placeable<L>()>::type, Ls...>;
  static constexpr std::size_t index = ok ? next::index : J + 1;  // + 1: 0 says "none"
  using layer = std::conditional_t<ok, typename next::layer, L>;
  using expected = std::conditional_t<ok, typename next::expected, typename expected_if<L, In, !ok>::type>;
  using got = std::conditional_t<ok, typename next::got, In>;
};

// A block (an element with misfit<In>, see net/residual.hpp) whose body or projection does not fit:
// reported with the block's index and the inner layer's. M: the block's misfit at its input
// (M::in_shortcut: the layer is the projection's).
template <class M>
constexpr bool misfit_in_shortcut() {
  if constexpr (requires { M::in_shortcut; }) return M::in_shortcut;
  else return false;
}
template <std::size_t I, class M, bool Misfit = (M::index != 0), bool Shortcut = misfit_in_shortcut<M>()>
struct report_block_mismatch : std::true_type {};
template <std::size_t I, class M>
struct report_block_mismatch<I, M, true, false>
    : block_shape_mismatch<I, M::index - 1, typename M::layer, typename M::expected, typename M::got> {};
template <std::size_t I, class M>
struct report_block_mismatch<I, M, true, true>
    : shortcut_shape_mismatch<I, M::index - 1, typename M::layer, typename M::expected, typename M::got> {};

template <class L, class In>
struct misfit_of {
  using type = first_misfit<0, In>;  // not a block: nothing inside
};
template <class L, class In>
  requires requires { typename L::template misfit<In>; }
struct misfit_of<L, In> {
  using type = typename L::template misfit<In>;
};

template <std::size_t I, class L, class In>
struct bind_checked {
  static_assert(Layer<L>, "fusedp::Sequential: every element after Input must be a layer (see the Layer concept)");
  static_assert(!Layer<L> || placeable<L>(), "fusedp::Sequential: Input<C,H,W> may only be the first layer");
  using misfit = typename misfit_of<L, In>::type;
  static constexpr bool inside = misfit::index != 0;  // a block whose body does not fit: reported as such
  static_assert(report_block_mismatch<I, misfit>::value);
  static constexpr bool ok = !inside && accepts_input<L, In>::value;
  static_assert(report_mismatch<I, L, In, ok || inside>::value);
  using type = Bound<I, std::conditional_t<placeable<L>() && !inside, L, Placeholder>, In,
                     typename output_if<L, In, ok && placeable<L>()>::type>;
};

template <std::size_t I, class In, class Done, class... Ls>
struct infer {
  using type = Done;
  using out = In;
};
template <std::size_t I, class In, class... Done, class L, class... Ls>
struct infer<I, In, type_list<Done...>, L, Ls...> {
  using bound = typename bind_checked<I, L, In>::type;
  using next = infer<I + 1, typename bound::out, type_list<Done..., bound>, Ls...>;
  using type = typename next::type;
  using out = typename next::out;
};

/// One stage of the fusion plan: an anchor layer (or a run of activations) and its epilogue, covering
/// layers [first, last].
template <class Anchor, class Epi, std::size_t Last>
struct Stage {
  using bound = Anchor;
  using layer = typename Anchor::layer;
  using in = typename Anchor::in;
  using out = typename Anchor::out;
  using epilogue = Epi;
  static constexpr LayerKind kind = layer::kind;
  static constexpr std::size_t first = Anchor::index;
  static constexpr std::size_t last = Last;
  static constexpr bool has_params = Anchor::params.size() > 0;
};

// Takes the activations at the front of Rest (when Enabled) into an epilogue.
template <bool Enabled, class Ops, class Rest>
struct take_pointwise {
  using ops = Ops;
  using rest = Rest;
};
template <class... Ops, class B, class... Bs>
  requires(B::layer::kind == LayerKind::pointwise)
struct take_pointwise<true, type_list<Ops...>, type_list<B, Bs...>>
    : take_pointwise<true, type_list<Ops..., typename B::layer::op>, type_list<Bs...>> {};

template <class Ops>
struct epilogue_of;
template <class... Ops>
struct epilogue_of<type_list<Ops...>> {
  using type = kernels::Epilogue<Ops...>;
};

template <class L>
constexpr bool absorbs_epilogue() {
  if constexpr (L::kind == LayerKind::pointwise) return true;
  else if constexpr (L::kind == LayerKind::anchor) return L::absorbs_epilogue;
  else return false;
}

template <class L>
struct first_ops {
  using type = type_list<>;
};
template <class L>
  requires(L::kind == LayerKind::pointwise)
struct first_ops<L> {
  using type = type_list<typename L::op>;
};

template <class Stages, class Rest>
struct make_plan {
  using type = Stages;
};
template <class... S, class B, class... Bs>
struct make_plan<type_list<S...>, type_list<B, Bs...>> {
  using own = typename first_ops<typename B::layer>::type;
  using taken = take_pointwise<absorbs_epilogue<typename B::layer>(), own, type_list<Bs...>>;
  using stage = Stage<B, typename epilogue_of<typename taken::ops>::type, B::index + taken::ops::size - own::size>;
  using type = typename make_plan<type_list<S..., stage>, typename taken::rest>::type;
};

}  // namespace detail

namespace detail {
// FNV-1a, 64-bit: a stable hash that needs nothing but constexpr arithmetic.
struct Fnv1a {
  std::uint64_t h = 0xcbf29ce484222325ull;
  constexpr void byte(std::uint8_t b) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  constexpr void word(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) byte(std::uint8_t(v >> (8 * i)));
  }
  constexpr void text(const char* s) {
    for (; *s; ++s) byte(std::uint8_t(*s));
    byte(0);
  }
};

template <class L, class In>
constexpr void hash_attributes(Fnv1a& f) {
  if constexpr (requires { L::attributes; })
    for (auto a : L::attributes) f.word(std::uint64_t(a));
  if constexpr (requires { L::template inner_fingerprint<In>; }) f.word(L::template inner_fingerprint<In>);
}
}  // namespace detail

/// One parameter tensor in the flat buffer of a network.
struct ParamTensor {
  std::size_t layer;   // index in the Sequential (Input is 0); PyTorch's nn.Sequential index is layer - 1
  ParamRole role;
  std::size_t offset;  // in elements, aligned to align_elements_count
  std::size_t size;
  std::size_t fan_in;
  int rank;
  std::array<int, 4> dims;
  TensorName name;     // PyTorch's state_dict key ("0.weight", "layer1.0.conv1.weight")
  bool constant = false;  // filled with `fill` at initialization instead of drawn (BatchNorm)
  float fill = 0.0f;
  bool normalization = false;  // a normalization layer's scale or shift
  /// A GEMM weight (Conv2d, Linear): what weight decay applies to under Decay::weights.
  [[nodiscard]] constexpr bool gemm_weight() const { return role == ParamRole::weight && !normalization; }
};

/// One non-trainable tensor in the state buffer of a network (BatchNorm's running statistics).
struct StateTensor {
  std::size_t layer;
  TensorName name;     // PyTorch's key ("1.running_mean", "layer1.0.bn1.num_batches_tracked")
  StateKind kind;
  std::size_t offset;  // in elements of the state buffer, aligned
  std::size_t size;
  int rank;
  std::array<int, 4> dims;
  float fill;
};

/// How errors name a parameter tensor: its PyTorch name and its layer, e.g. "'0.weight' (layer 1)".
inline std::string param_tensor_label(const ParamTensor& t) {
  std::string s = "'";
  s += t.name.c_str();
  s += "' (layer ";
  s += std::to_string(t.layer);
  s += ")";
  return s;
}

namespace detail {
/// The key of layer L at `index` in its list: its Named<> name, else its position after Input
/// (PyTorch's nn.Sequential index).
template <class L>
constexpr TensorName layer_key(std::size_t index) {
  if constexpr (requires { L::torch_name; }) return TensorName(L::torch_name);
  else return TensorName{}.append_number(index - 1);
}
constexpr TensorName param_key(const ParamSpec& p) {
  if (!p.name.empty()) return p.name;
  return TensorName(p.role == ParamRole::weight ? "weight" : "bias");
}
}  // namespace detail

/// Where a stage's tensors live: offsets in elements per sample (multiply by the batch size).
struct StagePlan {
  bool aliases_input;       // Flatten: the output is the input's memory
  std::size_t out_offset;   // y
  bool saves_z;             // the epilogue needs its input in backward
  std::size_t z_offset;
  std::size_t weight = 0;   // offsets in the flat parameter buffer (when the stage has parameters):
  std::size_t bias = 0;     // its first weight and its first bias
  std::size_t state = 0;    // offset of the anchor's first tensor in the state buffer
  bool has_state = false;
};

/// A network: Input<C,H,W> followed by layers, flat. Everything below is a compile-time fact.
/// @tparam In the Input<C,H,W> layer
/// @tparam Layers the layers, in order
template <class In, class... Layers>
struct Sequential {
  static_assert(detail::is_input_layer<In>(), "fusedp::Sequential: the first layer must be Input<C, H, W>");
  static_assert(sizeof...(Layers) > 0, "fusedp::Sequential: a network needs at least one layer after Input");

  using input_shape = typename detail::input_shape_of<In>::type;
  using bound_layers = typename detail::infer<1, input_shape, detail::type_list<>, Layers...>::type;
  using output_shape = typename detail::infer<1, input_shape, detail::type_list<>, Layers...>::out;
  using stages = typename detail::make_plan<detail::type_list<>, bound_layers>::type;
  template <std::size_t I>
  using stage = typename detail::type_at<I, stages>::type;

  static constexpr std::size_t layer_count = sizeof...(Layers) + 1;
  static constexpr std::size_t stage_count = stages::size;

 private:
  template <class F, std::size_t... I>
  static constexpr void for_layers(F&& f, std::index_sequence<I...>) {
    (f(typename detail::type_at<I, bound_layers>::type{}), ...);
  }
  template <class F>
  static constexpr void for_each_layer(F&& f) {
    for_layers(f, std::make_index_sequence<bound_layers::size>{});
  }

  static constexpr std::size_t count_tensors() {
    std::size_t n = 0;
    for_each_layer([&](auto b) { n += decltype(b)::params.size(); });
    return n;
  }

 public:
  static constexpr std::size_t param_tensor_count = count_tensors();

  /// Every parameter tensor in layer order, weight before bias, each at an aligned offset.
  static constexpr std::array<ParamTensor, param_tensor_count> param_layout = [] {
    std::array<ParamTensor, param_tensor_count> t{};
    std::size_t i = 0, offset = 0;
    for_each_layer([&](auto b) {
      for (const ParamSpec& p : decltype(b)::params) {
        using B = decltype(b);
        t[i++] = ParamTensor{B::index,
                             p.role,
                             offset,
                             p.size,
                             p.fan_in,
                             p.rank,
                             p.dims,
                             detail::param_key(p).under(detail::layer_key<typename B::layer>(B::index)),
                             p.constant,
                             p.fill,
                             p.normalization};
        offset += align_elements(p.size);
      }
    });
    return t;
  }();

  static constexpr std::size_t count_weight_runs() {
    std::size_t n = 0;
    for (std::size_t i = 0; i < param_tensor_count; ++i)
      if (param_layout[i].gemm_weight() && (i == 0 || !param_layout[i - 1].gemm_weight())) ++n;
    return n;
  }
  static constexpr std::size_t weight_run_count = count_weight_runs();
  /// Where the GEMM weights (Conv2d, Linear) lie in the flat buffer: weight_run_count runs [begin, end)
  /// as pairs of element offsets, in order, adjacent weights merged (the padding between them included).
  /// Decay::weights decays these and nothing else.
  static constexpr std::array<std::size_t, 2 * weight_run_count> weight_runs = [] {
    std::array<std::size_t, 2 * weight_run_count> r{};
    std::size_t k = 0;
    for (std::size_t i = 0; i < param_tensor_count; ++i) {
      const ParamTensor& p = param_layout[i];
      if (!p.gemm_weight()) continue;
      if (i == 0 || !param_layout[i - 1].gemm_weight()) r[2 * k++] = p.offset;
      r[2 * k - 1] = p.offset + p.size;
    }
    return r;
  }();

  static constexpr std::size_t count_state() {
    std::size_t n = 0;
    for_each_layer([&](auto b) { n += decltype(b)::state.size(); });
    return n;
  }
  static constexpr std::size_t state_tensor_count = count_state();

  /// Every non-trainable tensor (BatchNorm's running statistics, and what forward leaves for
  /// backward) in layer order, each at an aligned offset of the state buffer.
  static constexpr std::array<StateTensor, state_tensor_count> state_layout = [] {
    std::array<StateTensor, state_tensor_count> t{};
    std::size_t i = 0, offset = 0;
    for_each_layer([&](auto b) {
      using B = decltype(b);
      for (const StateSpec& s : B::state) {
        t[i++] = StateTensor{B::index, s.name.under(detail::layer_key<typename B::layer>(B::index)),
                             s.kind,   offset,
                             s.size,   s.rank,
                             s.dims,   s.fill};
        offset += align_elements(s.size);
      }
    });
    return t;
  }();
  /// Elements of the state buffer (0 for a network without BatchNorm).
  static constexpr std::size_t state_storage = [] {
    std::size_t n = 0;
    for (const auto& t : state_layout) n = t.offset + align_elements(t.size);
    return n;
  }();

  /// Number of trainable scalars (as PyTorch counts them).
  static constexpr std::size_t param_count = [] {
    std::size_t n = 0;
    for (const auto& t : param_layout) n += t.size;
    return n;
  }();

  /// Elements of the flat parameter buffer, padding included.
  static constexpr std::size_t param_storage = [] {
    std::size_t n = 0;
    for (const auto& t : param_layout) n = t.offset + align_elements(t.size);
    return n;
  }();

 private:
  template <std::size_t... I>
  static constexpr auto make_stage_plan(std::index_sequence<I...>) {
    std::array<StagePlan, stage_count> plan{};
    std::size_t offset = 0;
    auto place = [&](auto stage_tag, StagePlan& p) {
      using S = decltype(stage_tag);
      p.aliases_input = S::kind == LayerKind::reshape;
      if (!p.aliases_input) {
        p.out_offset = offset;
        offset += align_elements(S::out::size);
      }
      constexpr long saved = saved_elements_of<typename S::layer, typename S::in, typename S::epilogue>();
      p.saves_z = saved >= 0 ? saved > 0 : S::epilogue::saves_input && S::kind != LayerKind::pointwise;
      if (p.saves_z) {
        p.z_offset = offset;
        offset += align_elements(saved >= 0 ? std::size_t(saved) : S::out::size);
      }
      bool weight = false, bias = false;
      for (const auto& t : param_layout) {
        if (t.layer != S::first) continue;
        bool& seen = t.role == ParamRole::weight ? weight : bias;
        if (!seen) (t.role == ParamRole::weight ? p.weight : p.bias) = t.offset;
        seen = true;
      }
      for (const auto& t : state_layout)
        if (t.layer == S::first && !p.has_state) {
          p.state = t.offset;
          p.has_state = true;
        }
    };
    (place(stage<I>{}, plan[I]), ...);
    return std::pair{plan, offset};
  }
  static constexpr auto plan_and_size_ = make_stage_plan(std::make_index_sequence<stage_count>{});

  template <std::size_t... I>
  static constexpr std::size_t max_activation(std::index_sequence<I...>) {
    std::size_t m = align_elements(input_shape::size);
    ((m = std::max(m, align_elements(stage<I>::out::size))), ...);
    return m;
  }
  template <std::size_t... I>
  static constexpr std::size_t max_backward(std::index_sequence<I...>) {
    std::size_t m = 0;
    ((m = std::max(m, backward_elements_of<typename stage<I>::layer, typename stage<I>::in>())), ...);
    return m;
  }
  template <std::size_t... I>
  static constexpr std::size_t max_scratch(std::index_sequence<I...>) {
    std::size_t m = 0;
    ((m = std::max(m, host_scratch_of<typename stage<I>::layer, typename stage<I>::in>())), ...);
    return m;
  }
  // The fewest samples a training batch may hold, and the first stage that asks for that many.
  template <std::size_t... I>
  static constexpr std::pair<std::size_t, std::size_t> max_min_batch(std::index_sequence<I...>) {
    std::pair<std::size_t, std::size_t> m{1, 0};
    ((min_training_batch_of<typename stage<I>::layer, typename stage<I>::in>() > m.first
          ? (m = {min_training_batch_of<typename stage<I>::layer, typename stage<I>::in>(), I}, 0)
          : 0),
     ...);
    return m;
  }

 public:
  /// Where each stage's output (and saved pre-epilogue values) live, per sample.
  static constexpr std::array<StagePlan, stage_count> stage_plan = plan_and_size_.first;
  /// Elements per sample for all stage outputs and saved tensors.
  static constexpr std::size_t activation_elements = plan_and_size_.second;
  /// Elements per sample of each of the two gradient buffers that backward alternates between.
  static constexpr std::size_t gradient_elements = max_activation(std::make_index_sequence<stage_count>{});
  /// Elements per sample of the work memory that stages use during their backward only.
  static constexpr std::size_t backward_elements = max_backward(std::make_index_sequence<stage_count>{});
  /// Elements of Host scratch per thread (im2col matrices and private weight gradients).
  static constexpr std::size_t host_scratch_elements = max_scratch(std::make_index_sequence<stage_count>{});
  /// The fewest samples a training batch may hold without SyncBatchNorm: 2 where a BatchNorm, at any
  /// depth, gets one value a channel and sample (BatchNorm1d); else 1.
  static constexpr std::size_t min_training_batch = max_min_batch(std::make_index_sequence<stage_count>{}).first;
  /// The first stage that asks for min_training_batch samples (0 where none asks for more than one).
  static constexpr std::size_t min_training_batch_stage = max_min_batch(std::make_index_sequence<stage_count>{}).second;
  /// A hash of everything that defines the network: each layer's name, numeric attributes (kernel,
  /// stride, padding, slopes, probabilities), input and output shapes, and the parameter layout. The
  /// same on every compiler and machine; checkpoints and data-parallel ranks compare it.
  static constexpr std::uint64_t fingerprint = [] {
    detail::Fnv1a f;
    f.text("fusedp::Sequential");
    f.word(input_shape::channels);
    f.word(input_shape::height);
    f.word(input_shape::width);
    for_each_layer([&](auto b) {
      using B = decltype(b);
      f.word(B::index);
      f.text(B::layer::name);
      detail::hash_attributes<typename B::layer, typename B::in>(f);
      f.word(B::out::channels);
      f.word(B::out::height);
      f.word(B::out::width);
    });
    for (const auto& t : param_layout) {
      f.word(t.layer);
      f.word(std::uint64_t(t.role));
      f.word(t.offset);
      f.word(t.size);
    }
    // (networks without state hash as they did before the state buffer existed)
    for (const auto& t : state_layout) {
      f.word(t.layer);
      f.word(std::uint64_t(t.kind));
      f.word(t.offset);
      f.word(t.size);
    }
    return f.h;
  }();

  /// Workspace elements per sample in all.
  static constexpr std::size_t workspace_elements_per_sample =
      activation_elements + 2 * gradient_elements + backward_elements;
};

template <class T>
struct is_sequential : std::false_type {};
template <class... L>
struct is_sequential<Sequential<L...>> : std::true_type {};

/// A type that is some Sequential<...>.
template <class N>
concept Network = is_sequential<N>::value;

}  // namespace fusedp
