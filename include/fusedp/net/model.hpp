#pragma once
// Model<Net, Space, T>: one replica of a network on one execution space. Holds the network's parameters,
// gradients, optimizer state and counters (ParameterStore) and its workspace (StageBinding), both
// shared with the Cuda model, and runs the stages of the fusion plan forward and backward. After the
// first step at a batch size, a step allocates nothing.
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/trace.hpp"
#include "fusedp/kernels/host/gradient.hpp"
#include "fusedp/net/cost.hpp"
#include "fusedp/net/parameter_store.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/net/stage_binding.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedp {

/// The default stage hook of Model::compute_gradients: nothing to do.
struct NoStageHook {
  constexpr void operator()(std::size_t) const noexcept {}
};

/// What Model::evaluate returns: the mean loss of the batch and the network's outputs.
template <class T>
struct Evaluation {
  T loss;
  std::span<const T> outputs;  // (batch, output_size)
};

namespace detail {
/// The parts of MemoryUse a model's parameter store holds (parameters, gradients, optimizer state, the
/// state buffer), in bytes; each model adds its own workspace.
template <class Store>
MemoryUse store_memory(const Store& store) noexcept {
  MemoryUse m;
  m.parameters = store.params().size_bytes();
  m.gradients = store.grads().size_bytes();
  m.optimizer_state = store.optimizer_state().size_bytes();
  m.state = store.buffers().size_bytes();
  return m;
}
}  // namespace detail

/// A network with its parameters, gradients, optimizer state and workspace on one space.
/// @tparam Net a Sequential<...>
/// @tparam Space the execution space (Host; Cuda where compiled with nvcc)
/// @tparam T the scalar type (float; double for gradient checks)
template <Network Net, class Space, class T = float>
class Model {
 public:
  using network = Net;
  using space_type = Space;
  using value_type = T;
  template <class U>
  using buffer = typename Space::template buffer<U>;
  static constexpr std::size_t input_size = Net::input_shape::size;
  static constexpr std::size_t output_size = Net::output_shape::size;

  /// Parameters drawn from `seed` with PyTorch's default initialization.
  explicit Model(Seed seed = {}, Space space = Space{}) : space_(std::move(space)), store_(space_, seed.value) {
    if constexpr (std::is_same_v<Space, Host> && !std::is_same_v<T, float>)
      require(space_.precision() == HostPrecision::fp32, "Model<..., Host, T>: precision ", to_string(space_.precision()),
              " rounds float operands; a Model of another scalar type (double for gradient checks) needs an fp32 Host");
  }
  explicit Model(Space space, Seed seed = {}) : Model(seed, std::move(space)) {}

  /// Draws every weight and bias again from the seed (see ParameterStore::reset_parameters).
  void reset_parameters() { store_.reset_parameters(space_); }

  /// One training step: forward, loss, backward and the optimizer update. Returns the batch's loss.
  /// The batch size is inputs.size() / input_size. Bad input throws before anything changes.
  template <class Loss, class Opt>
  T train_step(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
               const Loss& loss, Opt& opt) {
    opt.validate();
    const trace::Scope span("step", trace::Kind::step, std::int64_t(store_.steps() + 1));
    const T l = compute_gradients(inputs, targets, loss);
    step(opt);
    return l;
  }

  /// Applies the optimizer to the current gradients (after compute_gradients, or after a data-parallel
  /// reduction has replaced them) and counts the step. A guarded optimizer (optim/guard.hpp) first
  /// checks the gradient: returns false when it skipped the update.
  template <class Opt>
  bool step(const Opt& opt) {
    opt.validate();
    const trace::Scope span("optimizer", trace::Kind::optimizer);
    if constexpr (requires { typename Opt::on_nonfinite; })
      return store_.apply_step(space_, opt,
                               opt.decide(kernels::host::gradient_stats(space_, store_.grads().data(), Net::param_storage),
                                          store_.steps() + 1, first_nonfinite_tensor()));
    else
      return store_.apply_step(space_, opt, 1.0);
  }

  /// Where the GEMM weights lie, for an optimizer's Decay::weights over the part of the flat buffer
  /// from `offset` (a ZeRO-1 block: Parallel updates it).
  [[nodiscard]] kernels::DecayRuns decay_runs(std::size_t offset = 0) const noexcept {
    return store_.decay_runs(offset);
  }

  /// Applies a decision taken elsewhere (a data-parallel guard that combined every replica's
  /// statistics): factor 0 skips the update, else the gradient is scaled by `factor` and the optimizer
  /// runs. Returns whether the update ran.
  template <class Opt>
  bool apply_step(const Opt& opt, double factor) {
    const trace::Scope span("optimizer", trace::Kind::optimizer);
    return store_.apply_step(space_, opt, factor);
  }

  /// The PyTorch name and layer of the first parameter tensor (in layer order) whose gradient holds a
  /// NaN or an infinity, or "no tensor" when all are finite.
  [[nodiscard]] std::string first_nonfinite_tensor() const {
    const std::span<const T> g = store_.grads();
    for (const ParamTensor& t : Net::param_layout)
      for (std::size_t i = 0; i < t.size; ++i)
        if (!std::isfinite(g[t.offset + i])) return param_tensor_label(t);
    return "no tensor";
  }

  /// The state of optimizer Opt (Opt::state_slots x param_storage values). Allocated, zeroed, the first
  /// time an optimizer of this type is used; a different optimizer type starts from fresh state.
  template <class Opt>
  std::span<T> optimizer_state() {
    return store_.template optimizer_state<Opt>(space_);
  }

  /// Forward in training mode, the loss and backward: grads() then holds the gradient of the mean
  /// loss. Parameters are not changed. `on_stage_done(i)` is called as soon as backward has finished
  /// stage i (stages finish in reverse order), so a data-parallel reducer can start on the gradients
  /// of that stage while backward continues. With `normalizer` N (0: the batch size), the gradient is
  /// that of the loss summed over this batch and divided by N: the share of this shard in the mean
  /// over a global batch of N samples, so that shards' gradients simply add up. With `sync` (Parallel
  /// with batch_norm::Sync) BatchNorm layers take their statistics over every replica's shard. With
  /// `first_sample` (where this batch begins in the step's global batch: a shard's or micro-batch's
  /// offset) per-sample randomness (Dropout masks) is that of one model running the global batch.
  /// Returns this batch's mean loss in every case.
  template <class Loss, class StageDone = NoStageHook>
  T compute_gradients(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                      const Loss& loss, StageDone&& on_stage_done = {}, std::size_t normalizer = 0,
                      ReplicaSum sync = {}, std::size_t first_sample = 0) {
    const std::size_t batch = binding_type::samples_in(inputs.size());
    Loss::validate(targets, batch, output_size);
    if constexpr (requires { loss.check_options(); }) loss.check_options();  // before anything changes
    binding_type::check_training_batch(batch, bool(sync));
    const auto scope = binding_.synchronized(sync, first_sample);
    forward_pass(inputs.data(), batch, true);
    T* dlogits = binding_.gradient_buffer(0, batch);
    trace::Scope loss_span("loss", trace::Kind::loss);
    const T l = loss(space_, batch, output_size, binding_.template output_of<last>(inputs.data(), batch),
                     targets.data(), dlogits);
    if (normalizer != 0 && normalizer != batch)
      detail::scale_in_space(space_, dlogits, batch * output_size, T(batch) / T(normalizer));
    loss_span.end();
    int current = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (binding_.template backward_stage<last - I>(space_, store_, inputs.data(), batch, current, on_stage_done,
                                                  scratch()),
       ...);
    }(std::make_index_sequence<Net::stage_count>{});
    return l;
  }

  /// Outputs (batch, output_size) in evaluation mode (dropout off). The view stays valid until the
  /// next call on this model.
  std::span<const T> predict(std::span<const T> inputs) {
    const std::size_t batch = binding_type::samples_in(inputs.size());
    forward_pass(inputs.data(), batch, false);
    return {binding_.template output_of<last>(inputs.data(), batch), batch * output_size};
  }

  /// The loss of a batch in evaluation mode, without gradients, and the outputs it came from (valid
  /// until the next call on this model).
  template <class Loss>
  Evaluation<T> evaluate(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                         const Loss& loss) {
    const std::size_t batch = binding_type::samples_in(inputs.size());
    Loss::validate(targets, batch, output_size);
    if constexpr (requires { loss.check_options(); }) loss.check_options();  // before anything changes
    const std::span<const T> out = predict(inputs);
    return {loss(space_, batch, output_size, out.data(), targets.data(), static_cast<T*>(nullptr)), out};
  }

  /// What this model has allocated, in bytes (net/cost.hpp predicts it from the type: CostModel::host_memory).
  [[nodiscard]] MemoryUse memory_use() const noexcept {
    MemoryUse m = detail::store_memory(store_);
    m.workspace = binding_.allocated() * sizeof(T);
    return m;
  }

  /// Allocates the workspace for batches up to `batch`, so that no later step allocates.
  void reserve(std::size_t batch) { binding_.reserve(batch, std::size_t(threads()) * Net::host_scratch_elements); }

  /// The flat parameter buffer (padding between tensors included; see Net::param_layout).
  [[nodiscard]] std::span<T> params() noexcept { return store_.params(); }
  [[nodiscard]] std::span<const T> params() const noexcept { return store_.params(); }
  /// The gradient twin of params(), set by the last compute_gradients or train_step.
  [[nodiscard]] std::span<T> grads() noexcept { return store_.grads(); }
  [[nodiscard]] std::span<const T> grads() const noexcept { return store_.grads(); }
  /// Parameter tensor `i` of Net::param_layout.
  [[nodiscard]] std::span<T> param(std::size_t i) { return store_.param(i); }
  [[nodiscard]] std::span<const T> grad(std::size_t i) const { return store_.grad(i); }
  /// Replaces the parameters with param_storage values.
  void load_params(std::span<const T> values) { store_.load_params(space_, values); }
  /// The state buffer (BatchNorm's running statistics, Net::state_layout): changed by training
  /// steps, read by predict and evaluate, never by the optimizer. Empty without such layers.
  [[nodiscard]] std::span<T> buffers() noexcept { return store_.buffers(); }
  [[nodiscard]] std::span<const T> buffers() const noexcept { return store_.buffers(); }
  /// Replaces the state buffer with state_storage values.
  void load_buffers(std::span<const T> values) { store_.load_buffers(space_, values); }
  /// Optimizer state (state_slots x param_storage values), empty before the first train_step.
  [[nodiscard]] std::span<const T> optimizer_state() const noexcept { return store_.optimizer_state(); }
  /// Name of the optimizer that owns the state (nullptr before the first step).
  [[nodiscard]] const char* optimizer_name() const noexcept { return store_.optimizer_name(); }

  [[nodiscard]] std::uint64_t seed() const noexcept { return store_.seed(); }
  /// Train steps taken so far (the step number also selects the dropout masks).
  [[nodiscard]] std::uint64_t steps() const noexcept { return store_.steps(); }
  /// Steps the current optimizer state has taken (Adam's bias correction counts them).
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return store_.optimizer_steps(); }
  /// Steps a guarded optimizer skipped (nonfinite::Skip).
  [[nodiscard]] std::uint64_t skipped_steps() const noexcept { return store_.skipped_steps(); }
  /// Restores the counters of a saved run (checkpoints): the next step is number `steps` + 1.
  void set_step_counters(std::uint64_t steps, std::uint64_t optimizer_steps) noexcept {
    store_.set_step_counters(steps, optimizer_steps);
  }
  /// Counts a step whose update was applied (or skipped) elsewhere: see ParameterStore::count_step.
  std::uint64_t count_step(bool updated) noexcept { return store_.count_step(updated); }
  /// Makes Opt this model's optimizer while its state lives elsewhere (ZeRO-1): see
  /// ParameterStore::adopt_optimizer.
  template <class Opt>
  bool adopt_optimizer() {
    return store_.template adopt_optimizer<Opt>(space_);
  }
  [[nodiscard]] const Space& space() const noexcept { return space_; }

 private:
  using binding_type = StageBinding<Net, Space, T>;
  static constexpr std::size_t last = Net::stage_count - 1;

  int threads() const {
    if constexpr (requires { space_.threads(); }) return space_.threads();
    else return 1;
  }
  T* scratch() { return binding_.tail(); }

  void forward_pass(const T* x, std::size_t batch, bool training) {
    reserve(batch);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (binding_.template forward_stage<I>(space_, store_, x, batch, training, scratch()), ...);
    }(std::make_index_sequence<Net::stage_count>{});
  }

  Space space_;
  ParameterStore<Net, Space, T> store_;
  binding_type binding_;
};

}  // namespace fusedp

// Model<Net, CudaSpace<P>, float>: the device specialization (compiled by nvcc only).
#include "fusedp/net/cuda_model.hpp"
