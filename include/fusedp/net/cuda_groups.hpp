#pragma once
// CudaGroups<Net, P>: how the groups of CudaPlan<Net, P> (net/cuda_plan.hpp) run on one device over a model's
// parameter store and stage binding: a plain stage through its layer's Cuda overloads (the StageBinding the
// Host model uses; a Conv2d or Linear whose input or output is stored in 16 bits calls them directly, with
// the elements), conv + max-pooling as one fused kernel writing the pooled values and a one-byte argmax, a
// run of narrow Linear layers as one fused MLP kernel forward and one backward (or stage by stage where the
// device cannot run it). Where CudaPlan says a group receives its dz from the group above, that group's
// input-gradient GEMM writes it through the sink dx_sink makes, and the group reads it stored. With an active
// `update` (a training step's fused optimizer) the weight-gradient GEMMs of the groups
// CudaPlan::updates_in_gemm names also apply the optimizer to their layers' weights and biases. Under
// precision::Bf16 every group stores its output and input gradient as bf16 values
// (net/activation_storage.hpp), the fused conv + max-pool and the sinks included, and the outputs
// CudaPlan::narrow_output names in 16 bits (each group's layers told the elements of their input and output:
// CudaPlan::input_element, output_element; a plain stage group runs through the binding, which takes them
// from CudaWorkspace::input_element, output_element); the fused MLP runs only under Tf32. With a side stream, each
// Conv2d and Linear group (alone or with its fused max-pooling) but the first layer runs its weight-gradient
// GEMM on it, beside the next group's backward, over three gradient buffers and two scratch halves
// (net/backward_cursor.hpp). Layers inside a Residual block, and those of an MLP group run layer by layer
// (but its first Linear), run in order. Made on the fly by Model<Net, Cuda> for each pass; it owns nothing.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_branch.hpp"
#include "fusedp/kernels/cuda/gradient_sink.cuh"
#include "fusedp/kernels/cuda/mlp.cuh"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/net/backward_cursor.hpp"
#include "fusedp/net/cuda_plan.hpp"
#include "fusedp/net/parameter_store.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/net/stage_binding.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace fusedp {

namespace detail {
// The fused-MLP description of stages [First, First + sizeof...(L)) of Net.
template <class Net, std::size_t First, class Seq>
struct mlp_spec_of;
template <class Net, std::size_t First, std::size_t... L>
struct mlp_spec_of<Net, First, std::index_sequence<L...>> {
  using type = kernels::cuda::MlpSpec<kernels::cuda::MlpLayer<int(Net::template stage<First + L>::in::size),
                                                              int(Net::template stage<First + L>::out::size),
                                                              typename Net::template stage<First + L>::epilogue>...>;
};
}  // namespace detail

/// The groups of Net's Cuda plan, bound to one model's memory.
/// @tparam Net a Sequential<...>
/// @tparam P the precision policy of the space
template <Network Net, class P>
struct CudaGroups {
  using T = float;
  using space_type = CudaSpace<P>;
  using plan = CudaPlan<Net, P>;
  /// The workspace binding of a Cuda model: Net's stages over the Cuda layout (CudaWorkspace).
  using binding_type = StageBinding<Net, space_type, T, CudaWorkspace<Net, P>>;
  template <class Gr>
  using mlp_spec = typename detail::mlp_spec_of<Net, Gr::first, std::make_index_sequence<Gr::last - Gr::first + 1>>::type;

  const space_type& space;
  ParameterStore<Net, space_type, T>& store;
  binding_type& binding;
  T* scratch;
  /// When active, at the flat buffers' start: the groups plan::updates_in_gemm names apply the
  /// optimizer to their layers' weights and biases in their weight-gradient GEMMs (backward of a
  /// training step; the caller then updates plan::rest_runs).
  kernels::UpdateTarget<T> update{};
  /// When set: backward forks each Conv2d's and Linear's weight gradient onto it, using
  /// `third_gradients` ((batch, CudaWorkspace::gradient_elements) floats) and the scratch as two halves of
  /// `scratch_stride` floats.
  const CudaSideStream* side = nullptr;
  T* third_gradients = nullptr;
  std::size_t scratch_stride = 0;

  // The model's stream waits for the side stream's marks (BackwardCursor's Side).
  struct SideJoin {
    const CudaSideStream* side;
    cudaStream_t main;
    void mark(int slot) const { side->mark(slot); }
    void join(int slot) const { side->join(slot, main); }
  };
  template <class StageDone>
  using cursor_type = BackwardCursor<T, SideJoin, StageDone>;

  /// Scratch floats the stages and fused groups need at exactly `batch` samples on a device of
  /// `sm_count` SMs (the largest of them).
  static std::size_t scratch_elements_at(int sm_count, std::size_t batch) {
    return [&]<std::size_t... G>(std::index_sequence<G...>) {
      return std::max({std::size_t(0), group_scratch<G>(sm_count, batch)...});
    }(std::make_index_sequence<plan::group_count>{});
  }
  /// Scratch floats group G needs at exactly `batch` samples: the most its stages ask for (each told
  /// whether it forms a dense dz), or its fused MLP kernel.
  template <std::size_t G>
  static std::size_t group_scratch(int sm_count, std::size_t batch) {
    using Gr = typename plan::template group<G>;
    std::size_t most = [&]<std::size_t... L>(std::index_sequence<L...>) {
      return std::max({std::size_t(0),
                       cuda_scratch_of<typename Net::template stage<Gr::first + L>::layer,
                                       typename Net::template stage<Gr::first + L>::in>(
                           batch, sm_count, forms_dense_dz<G, Gr::first + L>())...});
    }(std::make_index_sequence<Gr::last - Gr::first + 1>{});
    if constexpr (Gr::kind == CudaGroupKind::mlp)
      most = std::max(most, kernels::cuda::mlp_backward_scratch<mlp_spec<Gr>>(int(batch), sm_count));
    return most;
  }
  /// Whether stage I of group G forms a dense dz in its backward (cuda_forms_dense_dz) as backward_group
  /// runs it: a stage group's conv with the group's dz received where receives_dz says (through
  /// backward_stage_to, or StageBinding where it is not received), a conv + max-pool group's conv with
  /// the pooling (backward_maxpool_to); every other stage as StageBinding runs it, its dz not received.
  template <std::size_t G, std::size_t I>
  static constexpr bool forms_dense_dz() {
    using Gr = typename plan::template group<G>;
    using S = typename Net::template stage<I>;
    if constexpr (Gr::kind == CudaGroupKind::conv_maxpool && I == Gr::first)
      return cuda_forms_dense_dz<typename S::layer, typename S::epilogue, plan::template receives_dz<G>,
                                 detail::max_pool_window_of<typename Net::template stage<I + 1>::layer>>();
    else if constexpr (Gr::kind == CudaGroupKind::stage)
      return cuda_forms_dense_dz<typename S::layer, typename S::epilogue, plan::template receives_dz<G>>();
    else
      return cuda_forms_dense_dz<typename S::layer, typename S::epilogue, false>();
  }
  /// Scratch floats that serve every batch from 1 to `batch`: the most scratch_elements_at asks for
  /// over them. The need is not monotonic in the batch: a split-K plan gives fewer rows more splits
  /// (a Linear 4096 -> 1024 on 132 SMs asks for more at batch 60 than at 100), so a model that
  /// reserved for its largest batch must still fit an epoch's smaller last one. A few integer
  /// operations a stage and batch, once per reserve.
  static std::size_t scratch_elements(int sm_count, std::size_t batch) {
    std::size_t most = 0;
    for (std::size_t b = 1; b <= batch; ++b) most = std::max(most, scratch_elements_at(sm_count, b));
    return most;
  }

  // Per-layer dz of a fused MLP group, after everything the Host plan places.
  T* mlp_gradients() { return binding.tail(); }
  // The argmax bytes of a fused conv + max-pool live in the conv's own output region, which the fused
  // kernel does not otherwise write: CudaWorkspace sizes it for Out*(OH/K)*(OW/K) bytes a sample.
  template <std::size_t I>
  std::uint8_t* argmax_of(const T* x, std::size_t batch) {
    return reinterpret_cast<std::uint8_t*>(binding.template output_of<I>(x, batch));
  }
  template <std::size_t I>
  StageArgs<space_type, T> args_of(const T* x, std::size_t batch, bool training) {
    return binding.template args_of<I>(space, store, x, batch, training, scratch);
  }
  // The updates stage I's weight-gradient GEMMs apply (none unless the plan updates it there).
  template <std::size_t I>
  kernels::LayerUpdate<T> layer_update() const {
    if constexpr (plan::template stage_updates_in_gemm<I>) {
      constexpr std::size_t b = plan::template bias_offset<I>;
      return {update.at(plan::template weight_offset<I>, true),
              b == detail::no_tensor ? kernels::UpdateTarget<T>{} : update.at(b, false)};
    } else {
      return {};
    }
  }
  // Stage I's arguments for its backward as the cursor's current step: its scratch, the updates its
  // GEMMs apply and the side stream its weight gradient takes (branched<I>).
  template <std::size_t I, class Cursor>
  StageArgs<space_type, T> backward_args_of(const T* x, std::size_t batch, Cursor& cur) {
    StageArgs<space_type, T> a = args_of<I>(x, batch, true);
    a.scratch = cur.scratch();
    a.update = layer_update<I>();
    if (branched<I>(cur)) {
      cur.will_fork();
      a.weight_branch = side;
    }
    return a;
  }
  // Whether stage I's weight gradient forks onto the side stream: where there is one and a stage
  // below runs backward, beside which it would run. The first stage's has none below (on the model's
  // stream it runs beside the weight gradient the step before forked, where on the side stream it would
  // queue behind it), nor has a Linear whose only stages below are a Flatten and an Input.
  template <std::size_t I, class Cursor>
  static bool branched(const Cursor& cur) {
    return backward_below<I> && cur.side() != nullptr;
  }
  template <std::size_t I>
  static constexpr bool backward_below = []<std::size_t... J>(std::index_sequence<J...>) {
    return (false || ... || binding_type::template runs_backward<J>);
  }(std::make_index_sequence<I>{});
  // Whether group G may fork: a Conv2d or Linear through its layer's backward_to (alone, with its
  // max-pooling, or the first Linear of an MLP group run layer by layer) with a stage below it that runs
  // backward.
  template <std::size_t G>
  static constexpr bool group_branches = [] {
    using Gr = typename plan::template group<G>;
    constexpr bool fused = plan::template receives_dz<G> || plan::template dz_receiver<G> != plan::group_count;
    constexpr bool through_backward_to = Gr::kind != CudaGroupKind::stage || fused || plan::template updates_in_gemm<G>;
    return through_backward_to && backward_below<Gr::first>;
  }();
  /// Whether backward forks any weight gradient when given a side stream (a Model reserves the third
  /// gradient buffer and the second scratch half only then).
  static constexpr bool branches = []<std::size_t... G>(std::index_sequence<G...>) {
    return (false || ... || group_branches<G>);
  }(std::make_index_sequence<plan::group_count>{});

  /// Runs every group forward.
  void forward(const T* x, std::size_t batch, bool training) {
    [&]<std::size_t... G>(std::index_sequence<G...>) {
      (forward_group<G>(x, batch, training), ...);
    }(std::make_index_sequence<plan::group_count>{});
  }

  template <std::size_t... I>
  void forward_stages(const T* x, std::size_t batch, bool training, std::index_sequence<I...>) {
    (binding.template forward_stage<I>(space, store, x, batch, training, scratch), ...);
  }

  // Whether group G's layer reads or writes an element other than float (CudaPlan::input_element,
  // output_element). A Flatten reads none: its output is its input.
  template <std::size_t G>
  static constexpr bool narrow_group =
      Net::template stage<plan::template group<G>::first>::kind != LayerKind::reshape &&
      (!std::is_same_v<typename plan::template input_element<G>, float> ||
       !std::is_same_v<typename plan::template output_element<G>, float>);

  template <std::size_t G>
  void forward_group(const T* x, std::size_t batch, bool training) {
    using Gr = typename plan::template group<G>;
    using X = typename plan::template input_element<G>;
    using Y = typename plan::template output_element<G>;
    if constexpr (Gr::kind == CudaGroupKind::stage) {
      // With a 16-bit input or output too: the binding runs each stage with the elements the workspace
      // stores its tensors in (CudaWorkspace::input_element, output_element; in evaluation also where it
      // folds a BatchNorm).
      static_assert(std::is_same_v<X, typename CudaWorkspace<Net, P>::template input_element<Gr::first>> &&
                    std::is_same_v<Y, typename CudaWorkspace<Net, P>::template output_element<Gr::first>>);
      forward_stages(x, batch, training, std::index_sequence<Gr::first>{});
    } else if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
      using S = typename Net::template stage<Gr::first>;
      constexpr int k = detail::max_pool_window_of<typename Net::template stage<Gr::first + 1>::layer>;
      const auto span = trace::SpaceSpans<space_type>::open(space, S::layer::name, trace::Kind::forward, S::first);
      // The conv's own bf16_y (its output is never the network's): the maximum of bf16 values is one,
      // also where the pooled values are the logits, as on the Host.
      S::layer::template forward_maxpool<typename S::in, typename S::epilogue, k, X, Y>(
          args_of<Gr::first>(x, batch, training), binding.template output_of<Gr::first + 1>(x, batch),
          argmax_of<Gr::first>(x, batch));
    } else {
      static_assert(!narrow_group<G>, "CudaGroups: the fused MLP reads and writes fp32");
      static_assert(std::is_same_v<P, precision::Tf32>, "CudaGroups: the fused MLP stores fp32 activations");
      if (!kernels::cuda::mlp_supported<mlp_spec<Gr>>(space)) {
        [&]<std::size_t... L>(std::index_sequence<L...>) {
          forward_stages(x, batch, training, std::index_sequence<Gr::first + L...>{});
        }(std::make_index_sequence<Gr::last - Gr::first + 1>{});
        return;
      }
      const auto span = trace::SpaceSpans<space_type>::open(space, "MLP", trace::Kind::forward,
                                                            Net::template stage<Gr::first>::first);
      kernels::cuda::mlp_forward<mlp_spec<Gr>>(space, mlp_args<Gr>(x, batch, nullptr, nullptr));
    }
  }

  template <class Gr>
  kernels::cuda::MlpArgs<int(Gr::last - Gr::first + 1)> mlp_args(const T* x, std::size_t batch, const T* dy, T* dx) {
    constexpr int n = int(Gr::last - Gr::first + 1);
    kernels::cuda::MlpArgs<n> a{};
    a.batch = int(batch);
    a.x = binding.template input_of<Gr::first>(x, batch);
    a.dy = dy;
    a.dx = dx;
    std::size_t dz_offset = 0;
    T* params = store.params().data();
    [&]<std::size_t... L>(std::index_sequence<L...>) {
      (
          [&] {
            constexpr StagePlan p = Net::stage_plan[Gr::first + L];
            a.w[L] = params + p.weight;
            a.b[L] = params + p.bias;
            a.y[L] = binding.template output_of<Gr::first + L>(x, batch);
            a.dz[L] = mlp_gradients() + dz_offset * batch;
            dz_offset += align_elements(Net::template stage<Gr::first + L>::out::size);
          }(),
          ...);
    }(std::make_index_sequence<std::size_t(n)>{});
    return a;
  }

  /// Runs every group backward, last first, from the loss gradient in gradient buffer 0; tells
  /// `on_stage_done(i)` when stage i's gradients are queued on the model's stream (after the side
  /// stream's part of them: BackwardCursor).
  template <class StageDone>
  void backward(const T* x, std::size_t batch, StageDone& on_stage_done) {
    const SideJoin join{side, space.stream()};
    cursor_type<StageDone> cur({binding.gradient_buffer(0, batch), binding.gradient_buffer(1, batch), third_gradients},
                               scratch, scratch_stride, side != nullptr ? &join : nullptr, on_stage_done);
    [&]<std::size_t... G>(std::index_sequence<G...>) {
      (backward_group<plan::group_count - 1 - G>(x, batch, cur), ...);
    }(std::make_index_sequence<plan::group_count>{});
    cur.finish();
  }

  /// Where the input gradient of group G goes (into `dx`, the gradient buffer the group below reads):
  /// the sink of the group below when it receives its dz from G (CudaPlan::dz_receiver), else dx itself;
  /// `bf16`: the input gradient is stored in bf16 (the sink rounds it before it forms dz). The sink
  /// stores dz as the element the group below reads (kernels::cuda::received_dz_element), and reads that
  /// group's output as the element it is stored in (CudaPlan::output_element).
  template <std::size_t G>
  auto dx_sink(const T* x, std::size_t batch, T* dx, bool bf16) {
    constexpr std::size_t r = plan::template dz_receiver<G>;
    if constexpr (r == plan::group_count) {
      // In the element the workspace stores it in (16 bits where the stage below reads it so).
      using E = typename CudaWorkspace<Net, P>::template dx_element<plan::template group<G>::first>;
      return kernels::cuda::StoreSinkOf<E>{reinterpret_cast<E*>(dx), bf16};
    } else {
      static_assert(plan::template group<G>::first > 0, "CudaGroups: a group below the first one");
      using Below = typename plan::template group<r>;
      using S = typename Net::template stage<Below::first>;
      using E = kernels::cuda::received_dz_element<P, typename S::epilogue>;
      // A 16-bit dz holds exactly what the sink computes only from a gradient it rounded to bf16.
      if constexpr (std::is_same_v<E, kernels::BFloat16>)
        if (!bf16) throw std::logic_error("CudaGroups: a 16-bit dz from an input gradient not stored in bf16");
      using Y = typename plan::template output_element<r>;
      E* const dz = reinterpret_cast<E*>(dx);
      if constexpr (Below::kind == CudaGroupKind::conv_maxpool) {
        constexpr int k = detail::max_pool_window_of<typename Net::template stage<Below::first + 1>::layer>;
        return kernels::cuda::UnpoolSink<typename S::epilogue, k, E, Y>(
            dz, reinterpret_cast<const Y*>(binding.template output_of<Below::first + 1>(x, batch)),
            argmax_of<Below::first>(x, batch), int(S::out::height), int(S::out::width), bf16);
      } else {
        const StageArgs<space_type, T> below = args_of<Below::first>(x, batch, true);
        return kernels::cuda::ActivationSink<typename S::epilogue, E, Y>{dz, reinterpret_cast<const Y*>(below.y),
                                                                          below.z, bf16};
      }
    }
  }

  // Stages I... in order, each as StageBinding runs it, all on the model's stream.
  template <class Cursor, std::size_t... I>
  void backward_stages(const T* x, std::size_t batch, Cursor& cur, std::index_sequence<I...>) {
    (
        [&] {
          binding.template backward_stage_between<I>(space, store, x, batch, cur.dy(), cur.dx(), cur, cur.scratch(),
                                                     layer_update<I>());
          if constexpr (binding_type::template runs_backward<I>) cur.step_done();
        }(),
        ...);
  }
  // After stage I's Conv2d or Linear step: branched when its weight gradient went to the side stream.
  template <std::size_t I, class Cursor>
  static void gemm_step_done(Cursor& cur) {
    if (branched<I>(cur)) cur.step_branched();
    else cur.step_done();
  }

  // Stage I (a Conv2d or Linear of group G) backward as StageBinding::backward_stage does it, through its
  // layer's backward_to: its input gradient into G's sink (dx_sink), its dz read stored when Receives.
  template <std::size_t G, std::size_t I, bool Receives, class Cursor>
  void backward_stage_to(const T* x, std::size_t batch, Cursor& cur) {
    using S = typename Net::template stage<I>;
    StageArgs<space_type, T> a = backward_args_of<I>(x, batch, cur);
    a.dy = cur.dy();
    a.dx = I > 0 ? cur.dx() : nullptr;
    {
      const auto span = trace::SpaceSpans<space_type>::open(space, S::layer::name, trace::Kind::backward, S::first);
      using X = typename plan::template input_element<G>;
      using Y = typename plan::template output_element<G>;
      using DY = typename CudaWorkspace<Net, P>::template dy_element<I>;  // a conv's dz, in 16 bits
      if constexpr (std::is_same_v<DY, float>)
        S::layer::template backward_to<typename S::in, typename S::epilogue, Receives, X, Y>(
            a, dx_sink<G>(x, batch, a.dx, a.bf16_dx));
      else
        S::layer::template backward_to<typename S::in, typename S::epilogue, Receives, X, Y, DY>(
            a, dx_sink<G>(x, batch, a.dx, a.bf16_dx));
    }
    gemm_step_done<I>(cur);
    cur(I);
  }

  template <std::size_t G, class Cursor>
  void backward_group(const T* x, std::size_t batch, Cursor& cur) {
    using Gr = typename plan::template group<G>;
    constexpr bool fused = plan::template receives_dz<G> || plan::template dz_receiver<G> != plan::group_count;
    if constexpr (Gr::kind == CudaGroupKind::stage && (fused || plan::template updates_in_gemm<G>)) {
      // A Conv2d or Linear (at a fused boundary, or updating its weight in its GEMM when asked): as
      // StageBinding::backward_stage, through backward_to.
      backward_stage_to<G, Gr::first, plan::template receives_dz<G>>(x, batch, cur);
    } else if constexpr (Gr::kind == CudaGroupKind::stage) {
      // (A BatchNorm or a block with 16-bit tensors: the binding runs it with the workspace's elements.)
      backward_stages(x, batch, cur, std::index_sequence<Gr::first>{});
    } else if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
      using S = typename Net::template stage<Gr::first>;
      constexpr int k = detail::max_pool_window_of<typename Net::template stage<Gr::first + 1>::layer>;
      StageArgs<space_type, T> a = backward_args_of<Gr::first>(x, batch, cur);
      a.dx = Gr::first > 0 ? cur.dx() : nullptr;
      {
        // With receives_dz, the cursor's dy holds the conv's dense dz, not the pooled gradient.
        const auto span = trace::SpaceSpans<space_type>::open(space, S::layer::name, trace::Kind::backward, S::first);
        S::layer::template backward_maxpool_to<typename S::in, typename S::epilogue, k, plan::template receives_dz<G>,
                                               typename plan::template input_element<G>,
                                               typename plan::template output_element<G>>(
            a, cur.dy(), binding.template output_of<Gr::first + 1>(x, batch), argmax_of<Gr::first>(x, batch),
            dx_sink<G>(x, batch, a.dx, a.bf16_dx));
      }
      gemm_step_done<Gr::first>(cur);
      cur(Gr::first + 1);
      cur(Gr::first);
    } else {
      constexpr std::size_t n = Gr::last - Gr::first + 1;
      if (!kernels::cuda::mlp_supported<mlp_spec<Gr>>(space)) {
        // Layer by layer, the first Linear writing the input gradient where the kernel would have.
        [&]<std::size_t... L>(std::index_sequence<L...>) {
          backward_stages(x, batch, cur, std::index_sequence<Gr::last - L...>{});
        }(std::make_index_sequence<n - 1>{});
        backward_stage_to<G, Gr::first, false>(x, batch, cur);
        return;
      }
      T* dx = Gr::first > 0 ? cur.dx() : nullptr;
      const auto args = mlp_args<Gr>(x, batch, cur.dy(), dx);
      float* dw[n];
      float* db[n];
      kernels::LayerUpdate<T> updates[n];
      T* grads = store.grads().data();
      [&]<std::size_t... L>(std::index_sequence<L...>) {
        ((dw[L] = grads + Net::stage_plan[Gr::first + L].weight, db[L] = grads + Net::stage_plan[Gr::first + L].bias,
          updates[L] = layer_update<Gr::first + L>()),
         ...);
      }(std::make_index_sequence<n>{});
      {
        const auto span = trace::SpaceSpans<space_type>::open(space, "MLP", trace::Kind::backward,
                                                              Net::template stage<Gr::first>::first);
        kernels::cuda::mlp_backward_to<mlp_spec<Gr>>(space, args,
                                                     dx_sink<G>(x, batch, dx, args_of<Gr::first>(x, batch, true).bf16_dx),
                                                     dw, db, cur.scratch(), updates);
      }
      cur.step_done();
      [&]<std::size_t... L>(std::index_sequence<L...>) {
        (cur(Gr::last - L), ...);
      }(std::make_index_sequence<n>{});
    }
  }
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
