#pragma once
// StageBinding<Net, Space, T>: the workspace of one model and where each stage of Net's plan reads and
// writes in it (net/sequential.hpp places the regions per sample). Binds stage I to its input, output,
// saved pre-activation, parameters and gradients (StageArgs) and runs it forward or backward with the
// layer's executor for Space. Held by both models; the Cuda model adds its fused groups around it.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/trace.hpp"
#include "fusedp/layers/activation.hpp"
#include "fusedp/net/activation_storage.hpp"
#include "fusedp/net/parameter_store.hpp"
#include "fusedp/net/sequential.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp {

namespace detail {
/// Who runs stage S: its anchor layer, or PointwiseStage for a run of activations.
template <class S>
using stage_executor = std::conditional_t<S::kind == LayerKind::pointwise, PointwiseStage, typename S::layer>;

// Where stage I of Net reads and writes, in a workspace `ws` laid out per sample by Layout::stage_plan
// (Net's own, Sequential::stage_plan, unless a space lays it out otherwise: net/cuda_plan.hpp,
// CudaWorkspace) for `batch` samples, `x` the network's input. Shared by a model's binding and a
// block's inner networks (net/residual.hpp).
template <Network Net, std::size_t I, class Layout = Net, class T>
const T* stage_input(T* ws, const T* x, std::size_t batch);
template <Network Net, std::size_t I, class Layout = Net, class T>
T* stage_output(T* ws, const T* x, std::size_t batch) {
  if constexpr (Layout::stage_plan[I].aliases_input) return const_cast<T*>(stage_input<Net, I, Layout>(ws, x, batch));
  else return ws + Layout::stage_plan[I].out_offset * batch;
}
template <Network Net, std::size_t I, class Layout, class T>
const T* stage_input(T* ws, const T* x, std::size_t batch) {
  if constexpr (I == 0) return x;
  else return stage_output<Net, I - 1, Layout>(ws, x, batch);
}

/// The buffers one replica's stages work on: parameters, gradients and state (each the base of a
/// network's flat layout) and the per-sample workspace.
template <class T>
struct StageMemory {
  T* workspace;
  T* params;
  T* grads;
  T* state;
  T* work;  // backward's work memory (Net::backward_elements per sample)
};

/// Stage I's arguments (dy and dx left null; y and dx stored in bf16 where the space stores activations
/// so, activation_storage.hpp).
template <Network Net, std::size_t I, class Layout = Net, class Space, class T>
StageArgs<Space, T> stage_args(const Space& space, const StageMemory<T>& m, const T* x, std::size_t batch,
                               bool training, T* scratch, std::uint64_t seed, std::uint64_t step,
                               std::size_t index, ReplicaSum sync = {}, std::size_t first_sample = 0) {
  constexpr StagePlan p = Layout::stage_plan[I];
  using S = typename Net::template stage<I>;
  const bool bf16 = stores_bf16_activations<T>(space);
  return StageArgs<Space, T>{space,
                             batch,
                             stage_input<Net, I, Layout>(m.workspace, x, batch),
                             stage_output<Net, I, Layout>(m.workspace, x, batch),
                             p.saves_z ? m.workspace + p.z_offset * batch : nullptr,
                             S::has_params ? m.params + p.weight : nullptr,
                             S::has_params ? m.params + p.bias : nullptr,
                             nullptr,
                             nullptr,
                             S::has_params ? m.grads + p.weight : nullptr,
                             S::has_params ? m.grads + p.bias : nullptr,
                             scratch,
                             training,
                             seed,
                             step,
                             index,
                             p.has_state ? m.state + p.state : nullptr,
                             m.work,
                             training ? sync : ReplicaSum{},
                             first_sample,
                             nullptr,
                             nullptr,
                             {},
                             bf16,
                             bf16};
}

/// Whether, in evaluation (on either space), stage I of Net (a layer with folds_batch_norm and no
/// epilogue of its own) runs stage I + 1 (a BatchNorm) in its epilogue, so one pass writes the
/// BatchNorm's output and the BatchNorm's stage runs nothing.
template <Network Net, std::size_t I>
constexpr bool folds_next() {
  if constexpr (I + 1 >= Net::stage_count) {
    return false;
  } else {
    using S = typename Net::template stage<I>;
    using N = typename Net::template stage<I + 1>;
    if constexpr (S::kind == LayerKind::anchor && N::kind == LayerKind::anchor) {
      if constexpr (requires { S::layer::folds_batch_norm; } && requires { N::layer::folds_into_previous; })
        return S::layer::folds_batch_norm && N::layer::folds_into_previous && S::epilogue::empty;
      else
        return false;
    } else {
      return false;
    }
  }
}
/// Whether stage I ran in the epilogue of stage I - 1 (see folds_next).
template <Network Net, std::size_t I>
constexpr bool folded_into_previous() {
  if constexpr (I == 0) return false;
  else return folds_next<Net, I - 1>();
}

/// Stage J's epilogue, or LastEpi for the last stage when it is given (a block's body, whose last
/// stage applies the activation after the block).
template <Network Net, std::size_t J, class LastEpi>
using epilogue_at = std::conditional_t<!std::is_void_v<LastEpi> && J + 1 == Net::stage_count, LastEpi,
                                       typename Net::template stage<J>::epilogue>;

/// Whether stage J's output is the network's output: every stage after it is a reshape.
template <Network Net, std::size_t J>
constexpr bool is_network_output() {
  for (std::size_t k = J + 1; k < Net::stage_count; ++k)
    if (!Net::stage_plan[k].aliases_input) return false;
  return true;
}

/// The elements stage I's input, output and StageArgs::add are stored in under Layout: float, unless
/// the layout says otherwise (input_element<I>, output_element<I>, add_element<I>: a Bf16 Cuda model's
/// workspace, net/cuda_plan.hpp, and a residual block's inner networks, net/residual.hpp).
template <class Layout, std::size_t I>
struct add_element_of {
  using type = float;
};
template <class Layout, std::size_t I>
  requires requires { typename Layout::template add_element<I>; }
struct add_element_of<Layout, I> {
  using type = typename Layout::template add_element<I>;
};
/// The elements of stage I's output gradient (dy) and input gradient (dx) under Layout: float, unless the
/// layout says otherwise (dy_element<I>, dx_element<I>: a Bf16 Cuda model's workspace; a residual block
/// passes its inner networks' gradient elements to run_backward itself).
template <class Layout, std::size_t I>
struct gradient_elements_of {
  using dy = float;
  using dx = float;
};
template <class Layout, std::size_t I>
  requires requires { typename Layout::template dy_element<I>; }
struct gradient_elements_of<Layout, I> {
  using dy = typename Layout::template dy_element<I>;
  using dx = typename Layout::template dx_element<I>;
};
template <class Layout, std::size_t I>
struct stage_elements {
  using input = float;
  using output = float;
  using add = float;
  using dy = float;
  using dx = float;
};
template <class Layout, std::size_t I>
  requires requires { typename Layout::template output_element<I>; }
struct stage_elements<Layout, I> {
  using input = typename Layout::template input_element<I>;
  using output = typename Layout::template output_element<I>;
  using add = typename add_element_of<Layout, I>::type;
  using dy = typename gradient_elements_of<Layout, I>::dy;
  using dx = typename gradient_elements_of<Layout, I>::dx;
};

/// Stage S forward (backward) with epilogue Epi, its input stored as X, its output as Y and its add as
/// A: through its executor where all are float, else through its layer's Cuda overload that takes the
/// elements (only layers that declare they take 16-bit tensors are given them: reads_16bit_input,
/// writes_16bit_output).
template <class S, class Epi, class X, class Y, class A = float, class Space, class T>
void stage_forward(const StageArgs<Space, T>& a) {
  if constexpr (std::is_same_v<X, float> && std::is_same_v<Y, float> && std::is_same_v<A, float>)
    stage_executor<S>::template forward<typename S::in, Epi>(a);
  else if constexpr (std::is_same_v<A, float>)
    S::layer::template forward<typename S::in, Epi, X, Y>(a);
  else
    S::layer::template forward<typename S::in, Epi, X, Y, A>(a);
}
/// DY, DX: the elements of its output's and input's gradients (only layers that declare they take them in
/// 16 bits are given them: reads_16bit_gradient, writes_16bit_gradient).
template <class S, class Epi, class X, class Y, class DY = float, class DX = float, class Space, class T>
void stage_backward(const StageArgs<Space, T>& a) {
  constexpr bool wide_gradients = std::is_same_v<DY, float> && std::is_same_v<DX, float>;
  if constexpr (std::is_same_v<X, float> && std::is_same_v<Y, float> && wide_gradients)
    stage_executor<S>::template backward<typename S::in, Epi>(a);
  else if constexpr (wide_gradients)
    S::layer::template backward<typename S::in, Epi, X, Y>(a);
  else
    S::layer::template backward<typename S::in, Epi, X, Y, DY, DX>(a);
}

/// Runs stage I forward with args_of.template operator()<J>() as stage J's arguments and
/// epilogue_at<Net, I, LastEpi>; in evaluation, where folds_next says so, stage I + 1 runs in its
/// epilogue (into stage I + 1's output, with its `add`, its epilogue and its bf16_y), and a stage that
/// the one before ran runs nothing. What it wrote is stored in bf16 where its arguments' bf16_y says
/// so (activation_storage.hpp: the Cuda kernels round as they write, the Host here after them), in the
/// elements Layout stores it in (stage_elements).
template <Network Net, std::size_t I, class Space, class T, class LastEpi = void, class Layout = Net, class ArgsOf>
void forward_folding(const ArgsOf& args_of, bool training) {
  using S = typename Net::template stage<I>;
  using X = typename stage_elements<Layout, I>::input;
  if constexpr (folded_into_previous<Net, I>()) {
    if (!training) return;
  }
  if constexpr (folds_next<Net, I>()) {
    if (!training) {
      using N = typename Net::template stage<I + 1>;
      StageArgs<Space, T> a = args_of.template operator()<I>();
      const StageArgs<Space, T> next = args_of.template operator()<I + 1>();
      const kernels::BatchNormFold<T> fold = N::layer::template eval_fold<typename N::in>(next);
      a.y = next.y;
      a.z = nullptr;  // evaluation: nothing is saved for backward
      a.fold = &fold;
      a.add = next.add;
      a.bf16_y = next.bf16_y;
      using E = stage_elements<Layout, I + 1>;
      stage_forward<S, epilogue_at<Net, I + 1, LastEpi>, X, typename E::output, typename E::add>(a);
      round_stored<typename S::layer>(a.space, a.y, a.batch * N::out::size, a.bf16_y);
      return;
    }
  }
  const StageArgs<Space, T> a = args_of.template operator()<I>();
  using E = stage_elements<Layout, I>;
  stage_forward<S, epilogue_at<Net, I, LastEpi>, X, typename E::output, typename E::add>(a);
  if constexpr (!Net::stage_plan[I].aliases_input)
    round_stored<typename S::layer>(a.space, a.y, a.batch * S::out::size, a.bf16_y);
}
}  // namespace detail

/// The workspace of a model of Net on Space and the binding of every stage to it.
/// @tparam Net a Sequential<...>
/// @tparam Space the execution space whose memory holds the workspace
/// @tparam T the scalar type
/// @tparam Layout where the regions lie per sample: a type with Sequential's stage_plan,
///         activation_elements, gradient_elements and workspace_elements_per_sample (Net's own, or
///         CudaWorkspace<Net, P> on Cuda)
template <Network Net, class Space, class T, class Layout = Net>
class StageBinding {
 public:
  template <class U>
  using buffer = typename Space::template buffer<U>;
  using store_type = ParameterStore<Net, Space, T>;
  static constexpr std::size_t input_size = Net::input_shape::size;

  /// The number of samples in `values` input values; anything but a whole, non-zero number of samples
  /// throws InvalidArgument naming the sample shape.
  static std::size_t samples_in(std::size_t values) {
    require(values != 0 && values % input_size == 0, "Model: ", values,
            " input values are not a whole number of samples of ", input_size, " values (",
            Net::input_shape::channels, "x", Net::input_shape::height, "x", Net::input_shape::width, ")");
    return values / input_size;
  }

  /// Refuses, before anything runs, a training batch that a BatchNorm cannot normalize: fewer than
  /// Net::min_training_batch samples (one value a channel, BatchNorm1d) without SyncBatchNorm's sums
  /// (`synchronized`). Checked up front, so that no earlier layer's statistics change first.
  static void check_training_batch(std::size_t batch, bool synchronized) {
    using S = typename Net::template stage<Net::min_training_batch_stage>;
    require(synchronized || batch >= Net::min_training_batch, S::layer::name, " (layer ", S::first,
            "): training needs more than one value per channel, got a batch of ", batch, " (at least ",
            Net::min_training_batch, " samples)");
  }

  /// Makes room for batches up to `batch`, plus `tail_elements` after the per-sample regions (Host:
  /// the threads' scratch; Cuda: the fused MLP's gradients). Returns false when it already had room.
  bool reserve(std::size_t batch, std::size_t tail_elements) {
    if (batch <= capacity_) return false;
    workspace_ = buffer<T>(batch * Layout::workspace_elements_per_sample + tail_elements);
    capacity_ = batch;
    return true;
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Elements allocated (the per-sample regions of capacity() samples and the tail).
  [[nodiscard]] std::size_t allocated() const noexcept { return workspace_.size(); }
  [[nodiscard]] T* data() noexcept { return workspace_.data(); }
  /// What follows the per-sample regions of `capacity()` samples.
  [[nodiscard]] T* tail() noexcept { return workspace_.data() + capacity_ * Layout::workspace_elements_per_sample; }

  /// One of the two gradient buffers backward alternates between, (batch, widest activation).
  T* gradient_buffer(int which, std::size_t batch) {
    return workspace_.data() + batch * (Layout::activation_elements + std::size_t(which) * Layout::gradient_elements);
  }

  /// For the training passes until the returned guard ends: the sum over the replicas that SyncBatchNorm
  /// layers take their statistics over (empty: this batch alone), and where the batch begins in the
  /// step's global batch (per-sample randomness: Dropout).
  class SyncScope {
   public:
    SyncScope(StageBinding& b, ReplicaSum sync, std::size_t first_sample) : b_(b) {
      b_.sync_ = sync;
      b_.first_sample_ = first_sample;
    }
    SyncScope(const SyncScope&) = delete;
    SyncScope& operator=(const SyncScope&) = delete;
    ~SyncScope() {
      b_.sync_ = {};
      b_.first_sample_ = 0;
    }

   private:
    StageBinding& b_;
  };
  [[nodiscard]] SyncScope synchronized(ReplicaSum sync, std::size_t first_sample = 0) {
    return SyncScope(*this, sync, first_sample);
  }

  template <std::size_t I>
  T* output_of(const T* x, std::size_t batch) {
    return detail::stage_output<Net, I, Layout>(workspace_.data(), x, batch);
  }
  template <std::size_t I>
  const T* input_of(const T* x, std::size_t batch) {
    return detail::stage_input<Net, I, Layout>(workspace_.data(), x, batch);
  }

  /// Stage I's arguments for a batch `x` of `batch` samples. `scratch`: the stage's scratch memory. The
  /// network's output (the logits, for the loss) is stored in fp32 at every precision.
  template <std::size_t I>
  StageArgs<Space, T> args_of(const Space& space, store_type& store, const T* x, std::size_t batch, bool training,
                              T* scratch) {
    const detail::StageMemory<T> m{workspace_.data(), store.params().data(), store.grads().data(),
                                   store.buffers().data(),
                                   workspace_.data() + batch * (Layout::activation_elements + 2 * Layout::gradient_elements)};
    StageArgs<Space, T> a = detail::stage_args<Net, I, Layout>(space, m, x, batch, training, scratch, store.seed(),
                                                       store.steps(), Net::template stage<I>::first, sync_, first_sample_);
    if constexpr (detail::is_network_output<Net, I>()) a.bf16_y = false;
    return a;
  }

  /// Runs stage I forward (a reshape runs nothing: its output aliases its input). Traced as a forward
  /// span where the host clock times Space's work (exec/trace.hpp).
  template <std::size_t I>
  void forward_stage(const Space& space, store_type& store, const T* x, std::size_t batch, bool training, T* scratch) {
    using S = typename Net::template stage<I>;
    if constexpr (S::kind != LayerKind::reshape) {
      if constexpr (detail::folded_into_previous<Net, I>()) {
        if (!training) return;  // ran in the epilogue of stage I - 1
      }
      const auto span = trace::SpaceSpans<Space>::open(space, S::layer::name, trace::Kind::forward, std::int64_t(S::first));
      detail::forward_folding<Net, I, Space, T, void, Layout>(
          [&]<std::size_t J>() { return args_of<J>(space, store, x, batch, training, scratch); }, training);
    }
  }

  /// Whether stage I runs anything backward (stage 0 without parameters, and reshapes, do not).
  template <std::size_t I>
  static constexpr bool runs_backward =
      Net::template stage<I>::kind != LayerKind::reshape && (I > 0 || Net::template stage<I>::has_params);

  /// Runs stage I backward from gradient buffer `current` into the other one, which becomes current
  /// (where runs_backward<I>); then tells `on_stage_done(I)`. `update`: what its weight-gradient kernels
  /// apply (Cuda's fused optimizer, net/cuda_groups.hpp).
  template <std::size_t I, class StageDone>
  void backward_stage(const Space& space, store_type& store, const T* x, std::size_t batch, int& current,
                      StageDone& on_stage_done, T* scratch, const kernels::LayerUpdate<T>& update = {}) {
    backward_stage_between<I>(space, store, x, batch, gradient_buffer(current, batch),
                              gradient_buffer(1 - current, batch), on_stage_done, scratch, update);
    if constexpr (runs_backward<I>) current = 1 - current;
  }

  /// backward_stage from `dy` into `dx` (stage 0 writes none), gradient buffers the caller chose.
  template <std::size_t I, class StageDone>
  void backward_stage_between(const Space& space, store_type& store, const T* x, std::size_t batch, T* dy, T* dx,
                              StageDone& on_stage_done, T* scratch, const kernels::LayerUpdate<T>& update = {}) {
    using S = typename Net::template stage<I>;
    if constexpr (runs_backward<I>) {
      StageArgs<Space, T> a = args_of<I>(space, store, x, batch, true, scratch);
      a.update = update;
      a.dy = dy;
      a.dx = I > 0 ? dx : nullptr;
      {
        const auto span = trace::SpaceSpans<Space>::open(space, S::layer::name, trace::Kind::backward, std::int64_t(S::first));
        using E = detail::stage_elements<Layout, I>;
        detail::stage_backward<S, typename S::epilogue, typename E::input, typename E::output, typename E::dy,
                               typename E::dx>(a);
        detail::round_stored<typename S::layer>(space, a.dx, batch * S::in::size, a.bf16_dx);
      }
    }
    on_stage_done(I);
  }

 private:
  template <class S>
  using executor = detail::stage_executor<S>;

  buffer<T> workspace_;
  std::size_t capacity_ = 0;
  ReplicaSum sync_{};
  std::size_t first_sample_ = 0;
};

}  // namespace fusedp
