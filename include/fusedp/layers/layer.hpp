#pragma once
// What a layer is: a plain struct that maps an input Shape to an output Shape, declares its parameter
// tensors, and runs forward and backward on a space. The contract is the Layer concept below.
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/optimizer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/replica_sum.hpp"

#include <array>
#include <cstddef>
#include <cstdint>

namespace fusedp {

/// How a layer takes part in the fusion plan.
enum class LayerKind {
  input,      ///< Input<C,H,W>: the first layer, only a shape
  anchor,     ///< an op that starts a stage: Conv2d, Linear, pooling, Dropout
  pointwise,  ///< an activation: rides in the epilogue of the anchor before it
  reshape,    ///< Flatten: changes the shape, not the memory
};

enum class ParamRole { weight, bias };

/// A tensor's PyTorch state_dict key, or a part of one ("weight", "bn1", "layer2.0.downsample.1"),
/// built at compile time. Longer names than `capacity` are a compile error where they are made.
struct TensorName {
  static constexpr std::size_t capacity = 63;
  std::array<char, capacity + 1> text{};
  std::size_t size = 0;

  constexpr TensorName() = default;
  constexpr TensorName(const char* s) { append(s); }  // NOLINT: names are written as literals
  constexpr TensorName& append(const char* s) {
    for (; *s; ++s) push(*s);
    return *this;
  }
  constexpr TensorName& append(const TensorName& n) {
    for (std::size_t i = 0; i < n.size; ++i) push(n.text[i]);
    return *this;
  }
  constexpr TensorName& append_number(std::size_t v) {
    char digits[20]{};
    int k = 0;
    do digits[k++] = char('0' + v % 10);
    while ((v /= 10) != 0);
    while (k > 0) push(digits[--k]);
    return *this;
  }
  /// "prefix.name" (just the name when the prefix is empty).
  [[nodiscard]] constexpr TensorName under(const TensorName& prefix) const {
    TensorName r = prefix;
    if (r.size != 0) r.push('.');
    return r.append(*this);
  }
  [[nodiscard]] constexpr bool empty() const { return size == 0; }
  [[nodiscard]] constexpr const char* c_str() const { return text.data(); }
  friend constexpr bool operator==(const TensorName& a, const TensorName& b) {
    if (a.size != b.size) return false;
    for (std::size_t i = 0; i < a.size; ++i)
      if (a.text[i] != b.text[i]) return false;
    return true;
  }

 private:
  constexpr void push(char c) {
    if (size == capacity) throw "fusedp: a tensor name is longer than TensorName::capacity characters";
    text[size++] = c;
  }
};

/// One parameter tensor of a layer, with its PyTorch shape (so weights map one to one onto torch).
/// `name` is its key inside the layer; empty means the role's ("weight", "bias").
struct ParamSpec {
  ParamRole role;
  std::size_t size;
  std::size_t fan_in;  // PyTorch's default init draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  int rank;
  std::array<int, 4> dims;
  TensorName name{};
  /// Set when the tensor is not drawn from U(-1/sqrt(fan_in), ...) but filled with `fill`
  /// (BatchNorm: weight 1, bias 0).
  bool constant = false;
  float fill = 0.0f;
  /// A normalization layer's scale or shift (BatchNorm): not a GEMM weight, so Decay::weights skips it.
  bool normalization = false;
};

/// Where a layer's non-trainable tensors stand in a network's state buffer (beside the parameters,
/// never in the gradient buffer, never touched by an optimizer).
enum class StateKind {
  buffer,     ///< a PyTorch buffer (running_mean): saved in checkpoints, made equal across replicas
  transient,  ///< values forward leaves for backward (a batch's mean): neither saved nor synchronized
};

/// One non-trainable tensor of a layer, in the state buffer. Starts at `fill`.
struct StateSpec {
  TensorName name;
  StateKind kind;
  std::size_t size;
  int rank;  // 0: a scalar (num_batches_tracked)
  std::array<int, 4> dims;
  float fill = 0.0f;
};

class CudaSideStream;  // exec/cuda_branch.hpp (nvcc only)

/// Everything a stage needs in one pass on one space. Forward reads x, w, b and writes y (and z, the
/// values before the epilogue, when the epilogue saves them); backward reads x, y, z, w, dy and writes
/// dx (null for the first stage), dw, db. dy may be overwritten; with keeps_dz it must be, with dz.
template <class Space, class T>
struct StageArgs {
  const Space& space;
  std::size_t batch;
  const T* x;
  T* y;
  T* z;
  const T* w;
  const T* b;
  T* dy;
  T* dx;
  T* dw;
  T* db;
  T* scratch;          // this stage's share of per-thread scratch (Host) or workspace (Cuda)
  bool training;
  std::uint64_t seed;  // the model's seed
  std::uint64_t step;  // the optimizer step, for per-step randomness (dropout)
  std::size_t index;   // the layer's index in the network
  T* state = nullptr;  // the layer's tensors in the state buffer (StateSpec order), when it has any
  T* work = nullptr;   // backward only: the network's shared per-sample work memory (backward_elements)
  ReplicaSum sync{};   // training under Parallel<..., batch_norm::Sync>: sums over every replica's shard
  std::size_t first_sample = 0;  // the batch's first sample in the step's global batch (a shard's offset)
  const T* add = nullptr;  // forward: values added before the epilogue (a residual block's shortcut), or null;
                           // only for layers with adds_before_epilogue, or with `fold`
  const kernels::BatchNormFold<T>* fold = nullptr;  // evaluation: the BatchNorm after this layer, run in
                                                    // its epilogue (layers with folds_batch_norm; see stage_binding.hpp)
  kernels::LayerUpdate<T> update{};  // backward on Cuda: when active, the weight gradient's GEMM also applies
                                     // the optimizer to the weight and bias (net/cuda_plan.hpp: updates_in_gemm)
  bool bf16_y = false;   // forward: y is stored as bf16 values (net/activation_storage.hpp; Cuda kernels round
                         // as they write it, the Host binding after the stage)
  bool bf16_dx = false;  // backward: likewise dx
  const CudaSideStream* weight_branch = nullptr;  // backward on Cuda: when set, the weight-gradient GEMM runs
                                                  // on this side stream (exec/cuda_branch.hpp), which the
                                                  // caller joins (net/backward_cursor.hpp)
  bool keeps_dz = false;  // backward: dy must hold dz (the gradient before the epilogue) afterwards, as the
                          // last stage of a residual block's body leaves it for the shortcut (net/residual.hpp);
                          // elsewhere a layer may leave dy as it was (the Host's BatchNorm under ReLU does)
};

namespace detail {
template <class L>
concept HasParams = requires { L::template params<Shape<1, 1, 1>>; };
}  // namespace detail

/// The layer contract.
///   kind, name                       how it joins the fusion plan, and how messages name it
///   accepts<In>                      whether it can take an input of shape In
///   expected<In>                     the nearest input shape it accepts (for the error message)
///   output<In>                       its output shape (only instantiated when accepts<In>)
///   params<In> (optional)            its parameter tensors, in PyTorch's order
///   state<In> (optional)             its non-trainable tensors (StateSpec), in PyTorch's order
///   saved_elements<In> (optional)    per-sample memory forward leaves for backward (the z region);
///                                    or saved_elements<In, Epi>, given the epilogue after it
///   forward_macs<In> (optional)      GEMM multiply-adds per sample (forward_macs_of has the default)
///   cuda_scratch<In>(batch, sm_count) (optional)  floats of Cuda workspace its kernels need at exactly
///                                    this batch on a device of sm_count SMs (cuda_scratch_of); with a
///                                    third argument, dense_dz (forms_dense_dz<Epi, DzIn, Kp>, optional:
///                                    whether its backward forms a dense dz first, per stage)
///   forward/backward (anchors)       per space, with StageArgs; on Cuda its kernels store y (forward)
///                                    and dx (backward) as bf16 values where bf16_y / bf16_dx say so
///                                    (kernels::stored_value; the Host binding rounds after the stage)
///   host_rounds_stored (optional)    true: its Host kernels do so too, each run as they write it (the
///                                    binding then rounds nothing after it: net/activation_storage.hpp)
///   cuda_reads_16bit<In>, cuda_writes_16bit<In, Epi> (optional)  its Cuda forward and backward take
///                                    <In, Epi, X, Y>: the input (X) and, with epilogue Epi, the output
///                                    (Y) stored as kernels::BFloat16 (reads_16bit_input,
///                                    writes_16bit_output; the Bf16 Cuda layouts use them: between
///                                    stages net/cuda_plan.hpp, inside blocks net/residual.hpp)
///   cuda_reads_16bit_gradient<In, Epi>, cuda_writes_16bit_gradient<In> (optional)  its Cuda backward
///                                    takes <In, Epi, X, Y, DY, DX>: its output's gradient (DY, which
///                                    it may overwrite with dz: then only where Epi's derivative is a
///                                    mask) and its input's (DX) stored as kernels::BFloat16, the bf16
///                                    values the model stores there anyway (reads_16bit_gradient,
///                                    writes_16bit_gradient)
template <class L>
concept Layer = requires {
  { L::kind } -> std::convertible_to<LayerKind>;
  { L::name } -> std::convertible_to<const char*>;
};

/// Parameter tensors of layer L at input shape In (none for a layer without params<>).
template <class L, class In>
constexpr auto params_of() {
  if constexpr (requires { L::template params<In>; }) return L::template params<In>;
  else return std::array<ParamSpec, 0>{};
}

/// State tensors of layer L at input shape In (none for a layer without state<>).
template <class L, class In>
constexpr auto state_of() {
  if constexpr (requires { L::template state<In>; }) return L::template state<In>;
  else return std::array<StateSpec, 0>{};
}

/// Per-sample elements a layer keeps from forward for backward beyond its output, when it says
/// (a Residual block's inner activations, which depend on the epilogue Epi after it); by default its
/// pre-epilogue values when the epilogue needs them. -1: the default.
template <class L, class In, class Epi>
constexpr long saved_elements_of() {
  if constexpr (requires { L::template saved_elements<In, Epi>; }) return long(L::template saved_elements<In, Epi>);
  else if constexpr (requires { L::template saved_elements<In>; }) return long(L::template saved_elements<In>);
  else return -1;
}

/// Whether layer L's Cuda kernels read its input (of shape In) stored in 16 bits, in forward and backward
/// (where the layer says so: cuda_reads_16bit).
template <class L, class In>
constexpr bool reads_16bit_input() {
  if constexpr (requires { L::template cuda_reads_16bit<In>; }) return L::template cuda_reads_16bit<In>;
  else return false;
}
/// Whether layer L at input In with epilogue Epi can store its output in 16 bits on Cuda: its forward
/// writes it so and its backward reads it so, where it reads it at all (where the layer says so:
/// cuda_writes_16bit).
template <class L, class In, class Epi>
constexpr bool writes_16bit_output() {
  if constexpr (requires { L::template cuda_writes_16bit<In, Epi>; }) return L::template cuda_writes_16bit<In, Epi>;
  else return false;
}

/// Whether layer L at input In with epilogue Epi can read the gradient of its output stored in 16 bits on
/// Cuda (where the layer says so: cuda_reads_16bit_gradient).
template <class L, class In, class Epi>
constexpr bool reads_16bit_gradient() {
  if constexpr (requires { L::template cuda_reads_16bit_gradient<In, Epi>; })
    return L::template cuda_reads_16bit_gradient<In, Epi>;
  else
    return false;
}
/// Whether layer L at input In can write the gradient of its input in 16 bits on Cuda (where the layer
/// says so: cuda_writes_16bit_gradient).
template <class L, class In>
constexpr bool writes_16bit_gradient() {
  if constexpr (requires { L::template cuda_writes_16bit_gradient<In>; })
    return L::template cuda_writes_16bit_gradient<In>;
  else
    return false;
}

/// Per-sample elements a layer's backward works in and forgets (a Residual block's gradient buffers):
/// one region for all stages of a network, the largest any stage asks for.
template <class L, class In>
constexpr std::size_t backward_elements_of() {
  if constexpr (requires { L::template backward_elements<In>; }) return L::template backward_elements<In>;
  else return 0;
}

/// Whether layer L's Cuda backward, as a stage with epilogue Epi, forms a dense dz in its scratch first:
/// where L says (Conv2d::forms_dense_dz: DzIn, its dz written by the stage above; Kp, the window of a
/// MaxPool2d fused after it, 0 for none), else true (its cuda_scratch takes no such argument).
template <class L, class Epi, bool DzIn, int Kp = 0>
constexpr bool cuda_forms_dense_dz() {
  if constexpr (requires { L::template forms_dense_dz<Epi, DzIn, Kp>; }) return L::template forms_dense_dz<Epi, DzIn, Kp>;
  else return true;
}

/// Floats of Cuda workspace layer L at input In needs at exactly `batch` samples on a device of
/// `sm_count` SMs (0 for a layer without cuda_scratch<>); `dense_dz`: cuda_forms_dense_dz of the stage
/// (a layer whose cuda_scratch takes it). Not monotonic in the batch where a split-K plan depends on it:
/// net/cuda_groups.hpp reserves the most over every batch up to its largest.
template <class L, class In>
std::size_t cuda_scratch_of(std::size_t batch, int sm_count, bool dense_dz = true) {
  if constexpr (requires { L::template cuda_scratch<In>(batch, sm_count, dense_dz); })
    return L::template cuda_scratch<In>(batch, sm_count, dense_dz);
  else if constexpr (requires { L::template cuda_scratch<In>(batch, sm_count); })
    return L::template cuda_scratch<In>(batch, sm_count);
  else
    return 0;
}

/// Multiply-adds of layer L's forward for one sample at input In, as utilization counts them (the
/// GEMMs only): what it declares (forward_macs<In>; BatchNorm 0, a block its layers' sum), else its
/// first parameter tensor's size times its output pixels (Conv2d, Linear), else 0.
template <class L, class In>
constexpr double forward_macs_of() {
  if constexpr (requires { L::template forward_macs<In>; }) {
    return L::template forward_macs<In>;
  } else {
    constexpr auto p = params_of<L, In>();
    if constexpr (p.size() == 0) {
      return 0.0;
    } else {
      using Out = typename L::template output<In>;
      return double(p[0].size) * double(Out::height) * double(Out::width);
    }
  }
}

/// Per-thread Host scratch of layer L at input In, in elements.
template <class L, class In>
constexpr std::size_t host_scratch_of() {
  if constexpr (requires { L::template host_scratch<In>; }) return L::template host_scratch<In>;
  else return 0;
}

/// The fewest samples a training batch of layer L at input In may hold (L::min_training_batch<In>, else 1).
template <class L, class In>
constexpr std::size_t min_training_batch_of() {
  if constexpr (requires { L::template min_training_batch<In>; }) return L::template min_training_batch<In>;
  else return 1;
}

}  // namespace fusedp
