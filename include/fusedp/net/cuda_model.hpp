#pragma once
// Model<Net, CudaSpace<P>, float>: one replica of a network on one GPU. The same API as the Host model
// where it can be, with these differences:
//   - params(), grads(), param(i), grad(i) and optimizer_state() are spans of *device* memory; copy
//     them with copy_params_to_host / load_params / copy_grads_to_host / copy_optimizer_state_to_host.
//   - inputs and targets may be host spans (copied through pinned buffers, targets checked first) or
//     DeviceSpans of data already on the device (labels then checked by the loss kernel, reported when
//     the loss is read).
//   - train_step returns the loss (one synchronization per step); train_step_async queues the step and
//     returns at once, last_loss() reads the loss of the latest step when wanted.
//   - the training step (forward, loss, backward, optimizer) is recorded as a CUDA graph on the second
//     step with the same batch size, buffers, loss and optimizer, and replayed from then on (two such
//     graphs are kept, so batches alternating between a DeviceLoader's two slots replay): a replay
//     allocates nothing and synchronizes nothing. Networks with Dropout launch directly (its mask
//     depends on the step number, which a graph would freeze).
//   - a guarded optimizer (optim/guard.hpp) measures the gradient on the device and reads one 16-byte
//     result per step to decide (clip, skip or throw, as on Host); such steps launch directly, never as
//     a graph, since the update depends on that read.
//   - every call makes the model's device current while it runs and then gives the caller's device back
//     (CudaDeviceScope), so models on several devices can be driven from one thread in any order; the
//     constructor leaves the model's device current, as constructing its CudaSpace does.
//   - stages run as the groups of CudaPlan<Net, P> (net/cuda_plan.hpp): conv + max-pooling fused, runs
//     of narrow Linear layers as one fused MLP kernel.
//   - backward runs the weight-gradient GEMM of each Conv2d and Linear group but the first on a second
//     stream, beside the next layer's input gradient (in a recorded graph: concurrent branches; see
//     net/cuda_groups.hpp); use_backward_branches(false) runs them in order and spares the third
//     gradient buffer and second scratch this needs (reserved by the first training pass).
//   - a train step with Sgd or Adam/AdamW applies the update to each group's Conv2d and Linear weights
//     and biases where their weight-gradient GEMMs finish the gradients, then one pass over the rest
//     (none when nothing is left); use_fused_update(false) runs one pass over everything instead.
// What it shares with the Host model is written once: the parameters, gradients, optimizer state,
// counters and the step decision (net/parameter_store.hpp), and the workspace with every stage's
// binding (net/stage_binding.hpp); the fused groups run through net/cuda_groups.hpp. Its own pieces
// live where they belong: pinned staging of host data
// (exec/cuda_staging.hpp), the graph cache (exec/cuda_graph.hpp), the loss result
// (kernels/cuda/loss.cuh), gradient statistics (kernels/cuda/gradient.cuh).
// Parameters are initialized on the host with the same Philox numbers as on Host, then copied, so a
// Host and a Cuda model built from the same seed start identical.
//
// tests/gpu/ compare every piece against the Host model (and skip where there is no device); they
// passed on an H200 (benchmarks/RESULTS.md says which commit).
#include "fusedp/net/model.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_branch.hpp"
#include "fusedp/exec/cuda_graph.hpp"
#include "fusedp/exec/cuda_staging.hpp"
#include "fusedp/kernels/cuda/device_constant.cuh"
#include "fusedp/kernels/cuda/gradient.cuh"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/cuda/loss.cuh"
#include "fusedp/kernels/cuda/optimizer.cuh"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/net/cuda_groups.hpp"
#include "fusedp/net/cuda_memory.hpp"
#include "fusedp/net/cuda_plan.hpp"
#include "fusedp/net/parameter_store.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/net/stage_binding.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedp {

namespace detail {
template <class L>
constexpr bool cuda_graph_safe() {
  if constexpr (requires { L::cuda_graph_safe; }) return L::cuda_graph_safe;
  else return true;
}

// A loss's options as the recorded loss kernel holds them (its launch arguments: SoftmaxCrossEntropy's
// label_smoothing), byte for byte.
using LossOptions = std::array<unsigned char, 16>;
template <class Loss>
LossOptions loss_options(const Loss& loss) {
  static_assert(std::is_trivially_copyable_v<Loss> && sizeof(Loss) <= sizeof(LossOptions),
                "fusedp::Model on Cuda: a loss recorded in a step graph must be trivially copyable, of at most "
                "16 bytes (its options are part of the graph's key)");
  LossOptions bytes{};
  if constexpr (!std::is_empty_v<Loss>) std::memcpy(bytes.data(), &loss, sizeof(Loss));
  return bytes;
}

// What a recorded training step depends on: replaying it is right only while all of these are unchanged.
struct StepGraphKey {
  std::size_t batch = 0;
  const void* inputs = nullptr;
  const void* targets = nullptr;
  const void* workspace = nullptr;
  const void* state = nullptr;
  const char* loss = nullptr;
  LossOptions loss_options{};
  const char* optimizer = nullptr;
  bool fused_update = false;
  bool dependent_launch = false;  // kernels::cuda::dependent_launch() when it was recorded
  bool fused_mlp = false;         // kernels::cuda::fused_mlp() when it was recorded
  bool branches = false;          // Model::uses_backward_branches() when it was recorded
  long long branch_delay = 0;     // kernels::cuda::branch_delay() when it was recorded (tests)
  bool operator==(const StepGraphKey&) const = default;
};

// One address per type written to a model's step slot (Model::write_op_slot); not const, so that no
// linker folds two of them into one address.
template <class V>
inline char op_slot_tag = 0;

template <class P>
CudaSpace<P> activated(CudaSpace<P> space) {
  space.activate();  // every buffer of the model lives on the space's device
  return space;
}
}  // namespace detail

/// A network on one CUDA device (see the top of this header for how it differs from Model<Net, Host>).
/// @tparam Net a Sequential<...>
/// @tparam P the precision policy of the space (precision::Tf32, Fp32, Bf16)
/// @tparam T the scalar type; float only
template <Network Net, class P, class T>
class Model<Net, CudaSpace<P>, T> {
  static_assert(std::is_same_v<T, float>, "fusedp::Model on Cuda: the scalar type must be float");

 public:
  using network = Net;
  using space_type = CudaSpace<P>;
  using value_type = T;
  template <class U>
  using buffer = DeviceBuffer<U>;
  using plan = CudaPlan<Net, P>;
  static constexpr std::size_t input_size = Net::input_shape::size;
  static constexpr std::size_t output_size = Net::output_shape::size;

  /// Whether every stage of the network may be recorded in a CUDA graph.
  static constexpr bool graph_safe = []<std::size_t... I>(std::index_sequence<I...>) {
    return (detail::cuda_graph_safe<typename Net::template stage<I>::layer>() && ...);
  }(std::make_index_sequence<Net::stage_count>{});

  /// Parameters drawn from `seed` with PyTorch's default initialization (the Host model's numbers).
  explicit Model(Seed seed = {}, space_type space = space_type{})
      : space_(detail::activated(std::move(space))), store_(space_, seed.value), op_slot_(op_slot_bytes),
        rest_runs_(plan::rest_runs.size()) {
    check_device_plan();
    detail::copy_to_space(space_, rest_runs_.data(), plan::rest_runs.data(), plan::rest_runs.size());
  }
  explicit Model(space_type space, Seed seed = {}) : Model(seed, std::move(space)) {}
  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  /// Waits for the model's queued work before its memory is freed.
  ~Model() {
    if (space_.stream() != nullptr) (void)cudaStreamSynchronize(space_.stream());
    if (side_.ready()) (void)cudaStreamSynchronize(side_.stream());  // joined unless backward threw midway
  }

  /// Draws every weight and bias again from the seed, exactly as the Host model does, on the host.
  void reset_parameters() {
    const CudaDeviceScope device = space_.enter();
    store_.reset_parameters(space_);
  }

  // --- training ---------------------------------------------------------------------------------

  /// One training step from host data; returns the batch's mean loss (waits for the step).
  template <class Loss, class Opt>
  T train_step(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
               const Loss& loss, Opt& opt) {
    train_step_async(inputs, targets, loss, opt);
    return last_loss();
  }
  /// One training step from data already on the device; returns the mean loss (waits for the step).
  template <class Loss, class Opt>
  T train_step(DeviceSpan<const T> inputs, DeviceSpan<const typename Loss::template target<T>> targets,
               const Loss& loss, Opt& opt) {
    train_step_async(inputs, targets, loss, opt);
    return last_loss();
  }
  /// Queues one training step from host data and returns without waiting (the host data has been
  /// copied when this returns). Bad input throws before anything is queued.
  template <class Loss, class Opt>
  void train_step_async(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                        const Loss& loss, Opt& opt) {
    const CudaDeviceScope device = space_.enter();
    opt.validate();
    const std::size_t batch = binding_type::samples_in(inputs.size());
    Loss::validate(targets, batch, output_size);
    if constexpr (requires { loss.check_options(); }) loss.check_options();  // before anything changes
    binding_type::check_training_batch(batch, false);
    stage(inputs, targets, batch);
    run_step(staging_.inputs(), staged_targets<Loss>(), batch, loss, opt);
  }
  /// Queues one training step from device data and returns without waiting.
  template <class Loss, class Opt>
  void train_step_async(DeviceSpan<const T> inputs, DeviceSpan<const typename Loss::template target<T>> targets,
                        const Loss& loss, Opt& opt) {
    const CudaDeviceScope device = space_.enter();
    opt.validate();
    const std::size_t batch = binding_type::samples_in(inputs.size);
    require(targets.size == batch * target_count<Loss>(), "Model: ", targets.size, " targets on the device for a batch of ",
            batch);
    binding_type::check_training_batch(batch, false);
    reserve(batch);
    run_step(inputs.data, targets.data, batch, loss, opt);
  }

  /// The mean loss of the latest training step or compute_gradients (waits for it). Throws
  /// InvalidArgument naming the loss when a label on the device was out of range.
  T last_loss() {
    require(loss_.allocated() && last_loss_name_ != nullptr,
            "Model::last_loss: no training step or loss has run on this model yet");
    const CudaDeviceScope device = space_.enter();
    return loss_.read(space_.stream(), last_loss_name_, output_size);
  }

  /// Applies the optimizer to the current gradients and counts the step (queued, not waited for). A
  /// guarded optimizer first checks the gradient on the device (waits for one scalar read) and decides
  /// as on Host: returns false when it skipped the update; Stop throws NumericError naming the step and
  /// the first tensor that is not finite, with nothing changed.
  template <class Opt>
  bool step(const Opt& opt) {
    opt.validate();
    if constexpr (requires { typename Opt::on_nonfinite; }) {
      const kernels::cuda::DeviceGradientStats s = gradient_stats();
      return apply_step(opt, opt.decide(kernels::host::GradientStats{s.sum_squares, s.finite()}, steps() + 1,
                                        nonfinite_tensor_name(s.first_nonfinite)));
    } else {
      return apply_step(opt, 1.0);
    }
  }

  /// Where the GEMM weights lie, for an optimizer's Decay::weights over the part of the flat buffer
  /// from `offset` (a ZeRO-1 block: Parallel updates it).
  [[nodiscard]] kernels::DecayRuns decay_runs(std::size_t offset = 0) const noexcept {
    return store_.decay_runs(offset);
  }

  /// Applies a decision taken elsewhere (a data-parallel guard that combined every rank's statistics):
  /// factor 0 skips the update (counted in skipped_steps()), else the gradient is scaled by `factor`
  /// (when not 1) and the optimizer runs. Returns whether the update ran.
  template <class Opt>
  bool apply_step(const Opt& opt, double factor) {
    const CudaDeviceScope device = space_.enter();
    const auto span = trace::SpaceSpans<space_type>::open(space_, "optimizer", trace::Kind::optimizer);
    return store_.apply_step(space_, opt, factor);
  }

  /// The sum of squares and the first non-finite element of the whole gradient, measured on the device
  /// after the work queued so far (waits).
  kernels::cuda::DeviceGradientStats gradient_stats() {
    const CudaDeviceScope device = space_.enter();
    kernels::cuda::GradientStatsBuffer& b = stats_buffer();
    b.enqueue(space_.stream(), store_.grads().data(), Net::param_storage);
    b.copy_to_host(space_.stream());
    space_.synchronize();
    return b.host();
  }
  /// Device memory for gradient statistics on this model's device (allocated on first use).
  kernels::cuda::GradientStatsBuffer& stats_buffer() {
    if (!stats_.allocated()) {
      const CudaDeviceScope device = space_.enter();
      stats_ = kernels::cuda::GradientStatsBuffer(true);
    }
    return stats_;
  }

  /// The Host model's name for the tensor holding flat element `index` ("'3.weight' (layer 4)"), or
  /// "no tensor" (every element finite, or padding): the words of Model<Net, Host>::first_nonfinite_tensor.
  [[nodiscard]] static std::string nonfinite_tensor_name(unsigned long long index) {
    return ParameterStore<Net, space_type, T>::tensor_holding(index);
  }

  /// The state of optimizer Opt on the device (Opt::state_slots x param_storage values), allocated and
  /// zeroed the first time an optimizer of this type is used.
  template <class Opt>
  std::span<T> optimizer_state() {
    const CudaDeviceScope device = space_.enter();
    return store_.template optimizer_state<Opt>(space_);
  }

  /// Forward in training mode, the loss and backward; grads() then holds the gradient of the mean
  /// loss. Returns the loss (waits). `on_stage_done(i)` is called when backward of stage i has been
  /// *queued* on the stream (stages in reverse order): work a reducer queues on the same stream after
  /// that sees the stage's gradients. With `normalizer` N (0: the batch size) the gradient is this
  /// batch's share of the mean over N samples, as on Host; `sync` and `first_sample` as on Host
  /// (SyncBatchNorm; Dropout masks of the global batch).
  template <class Loss, class StageDone = NoStageHook>
  T compute_gradients(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                      const Loss& loss, StageDone&& on_stage_done = {}, std::size_t normalizer = 0,
                      ReplicaSum sync = {}, std::size_t first_sample = 0) {
    const CudaDeviceScope device = space_.enter();
    const std::size_t batch = binding_type::samples_in(inputs.size());
    Loss::validate(targets, batch, output_size);
    if constexpr (requires { loss.check_options(); }) loss.check_options();  // before anything changes
    binding_type::check_training_batch(batch, bool(sync));
    const auto scope = binding_.synchronized(sync, first_sample);
    stage(inputs, targets, batch);
    queue_gradients(staging_.inputs(), staged_targets<Loss>(), batch, loss, on_stage_done, normalizer);
    return last_loss();
  }

  // --- inference --------------------------------------------------------------------------------

  /// Outputs (batch, output_size) in evaluation mode, copied to host memory that stays valid until the
  /// next call on this model (waits).
  std::span<const T> predict(std::span<const T> inputs) {
    const CudaDeviceScope device = space_.enter();
    const std::size_t batch = binding_type::samples_in(inputs.size());
    stage(inputs, std::span<const std::int32_t>{}, batch, false);
    forward_pass(staging_.inputs(), batch, false);
    return outputs_to_host(batch);
  }
  /// Outputs (batch, output_size) on the device for inputs on the device (queued, not waited for).
  DeviceSpan<const T> predict(DeviceSpan<const T> inputs) {
    const CudaDeviceScope device = space_.enter();
    const std::size_t batch = binding_type::samples_in(inputs.size);
    reserve_for(batch, false);
    forward_pass(inputs.data, batch, false);
    return {binding_.template output_of<last>(inputs.data, batch), batch * output_size};
  }

  /// The loss of a batch in evaluation mode and the outputs it came from (host memory, valid until the
  /// next call on this model).
  template <class Loss>
  Evaluation<T> evaluate(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                         const Loss& loss) {
    const CudaDeviceScope device = space_.enter();
    const std::size_t batch = binding_type::samples_in(inputs.size());
    Loss::validate(targets, batch, output_size);
    if constexpr (requires { loss.check_options(); }) loss.check_options();  // before anything changes
    stage(inputs, targets, batch, false);
    forward_pass(staging_.inputs(), batch, false);
    enqueue_loss(loss, staging_.inputs(), batch, staged_targets<Loss>(), static_cast<T*>(nullptr));
    const T l = last_loss();
    return {l, outputs_to_host(batch)};
  }

  // --- memory -----------------------------------------------------------------------------------

  /// What this model holds on its device (and in pinned host memory), in bytes by part: CudaMemory<Net,
  /// P>::use predicts it from the type, the batch and the SM count (net/cuda_memory.hpp).
  [[nodiscard]] MemoryUse memory_use() const noexcept {
    MemoryUse m = detail::store_memory(store_);
    m.workspace = binding_.allocated() * sizeof(T) + scratch_.size_bytes() + branch_gradients_.size_bytes() +
                  side_.device_bytes();
    m.staging = staging_.device_bytes() + loss_.device_bytes() + stats_.device_bytes() + op_slot_.size_bytes() +
                rest_runs_.size_bytes() + store_.weight_run_bytes();
    m.pinned_host = staging_.pinned_bytes() + loss_.pinned_bytes() + stats_.pinned_bytes();
    return m;
  }

  /// Allocates everything for batches up to `batch`, so that no later step allocates: with backward
  /// branches on (use_backward_branches) also their third gradient buffer ((batch,
  /// CudaWorkspace::gradient_elements) floats) and second scratch half. predict and evaluate alone reserve
  /// neither.
  void reserve(std::size_t batch) {
    const CudaDeviceScope device = space_.enter();
    reserve_for(batch, true);
  }

  // Device memory: the views below are of the device's buffers (copy_*_to_host reads them).
  /// The flat parameter buffer (padding included; see Net::param_layout) and its gradient twin.
  [[nodiscard]] std::span<T> params() noexcept { return store_.params(); }
  [[nodiscard]] std::span<T> grads() noexcept { return store_.grads(); }
  [[nodiscard]] std::span<const T> params() const noexcept { return store_.params(); }
  [[nodiscard]] std::span<const T> grads() const noexcept { return store_.grads(); }
  /// Parameter tensor `i` of Net::param_layout, and its gradient.
  [[nodiscard]] std::span<T> param(std::size_t i) { return store_.param(i); }
  [[nodiscard]] std::span<const T> grad(std::size_t i) const { return store_.grad(i); }
  /// Optimizer state (state_slots x param_storage values), empty before the first step, and its owner.
  [[nodiscard]] std::span<const T> optimizer_state() const noexcept { return store_.optimizer_state(); }
  [[nodiscard]] const char* optimizer_name() const noexcept { return store_.optimizer_name(); }

  /// Copies the parameters (param_storage values) to host memory (waits).
  void copy_params_to_host(std::span<T> out) const { to_host(out, store_.params(), "copy_params_to_host"); }
  /// Copies the gradients (param_storage values) to host memory (waits).
  void copy_grads_to_host(std::span<T> out) const { to_host(out, store_.grads(), "copy_grads_to_host"); }
  /// Copies the optimizer state (optimizer_state().size() values) to host memory (waits).
  void copy_optimizer_state_to_host(std::span<T> out) const {
    to_host(out, store_.optimizer_state(), "copy_optimizer_state_to_host");
  }
  /// Replaces the parameters with param_storage values from host memory (waits).
  void load_params(std::span<const T> values) {
    const CudaDeviceScope device = space_.enter();
    store_.load_params(space_, values);
  }
  /// The state buffer (BatchNorm's running statistics) in device memory, and its host copies (wait).
  [[nodiscard]] std::span<T> buffers() noexcept { return store_.buffers(); }
  [[nodiscard]] std::span<const T> buffers() const noexcept { return store_.buffers(); }
  void copy_buffers_to_host(std::span<T> out) const { to_host(out, store_.buffers(), "copy_buffers_to_host"); }
  void load_buffers(std::span<const T> values) {
    const CudaDeviceScope device = space_.enter();
    store_.load_buffers(space_, values);
  }
  /// Replaces the optimizer state of Opt with values from host memory (waits).
  template <class Opt>
  void load_optimizer_state(std::span<const T> values) {
    const CudaDeviceScope device = space_.enter();
    std::span<T> state = optimizer_state<Opt>();
    require(values.size() == state.size(), "Model::load_optimizer_state: ", values.size(), " values for ",
            state.size());
    detail::copy_to_space(space_, state.data(), values.data(), values.size());
  }

  [[nodiscard]] std::uint64_t seed() const noexcept { return store_.seed(); }
  [[nodiscard]] std::uint64_t steps() const noexcept { return store_.steps(); }
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return store_.optimizer_steps(); }
  /// Steps a guarded optimizer skipped (nonfinite::Skip).
  [[nodiscard]] std::uint64_t skipped_steps() const noexcept { return store_.skipped_steps(); }
  void set_step_counters(std::uint64_t steps, std::uint64_t optimizer_steps) noexcept {
    store_.set_step_counters(steps, optimizer_steps);
  }
  /// Counts a step whose update was applied (or skipped) elsewhere: see ParameterStore::count_step.
  std::uint64_t count_step(bool updated) noexcept { return store_.count_step(updated); }
  /// Makes Opt this model's optimizer while its state lives elsewhere (ZeRO-1): see
  /// ParameterStore::adopt_optimizer.
  template <class Opt>
  bool adopt_optimizer() {
    const CudaDeviceScope device = space_.enter();
    return store_.template adopt_optimizer<Opt>(space_);
  }
  [[nodiscard]] const space_type& space() const noexcept { return space_; }

  /// Whether train steps are recorded and replayed as CUDA graphs (on by default; always off for a
  /// network whose layers are not graph-safe, such as Dropout).
  void use_graphs(bool on) noexcept { graphs_.set_enabled(on && graph_safe); }
  [[nodiscard]] bool uses_graphs() const noexcept { return graphs_.enabled(); }
  /// Whether train steps apply the optimizer to the Conv2d and Linear weights and biases inside their
  /// weight-gradient GEMMs (on by default; CudaPlan::updates_in_gemm says which), leaving one pass over
  /// the other parameters (none when there are none: LeNet, the CIFAR-10 CNN), instead of one pass over
  /// all of them after backward. Either way gives the same bits. Only for Sgd and Adam/AdamW without a
  /// guard, in train_step; compute_gradients + step and Parallel run the separate pass.
  void use_fused_update(bool on) noexcept { fused_update_ = on; }
  [[nodiscard]] bool uses_fused_update() const noexcept { return fused_update_; }
  /// Whether backward runs each Conv2d's and Linear's weight-gradient GEMM on a second stream beside
  /// the next layer's backward (on by default; net/backward_cursor.hpp). It needs a third gradient
  /// buffer ((batch, CudaWorkspace::gradient_elements) floats) and twice the scratch, allocated by the next
  /// reserve (or step) after it is turned on and freed by the next reserve that grows after it is
  /// turned off. Either way gives the same bits.
  void use_backward_branches(bool on) noexcept { branches_ = on; }
  [[nodiscard]] bool uses_backward_branches() const noexcept { return branches_; }
  /// Whether the latest train step was a graph replay (for tests and benchmarks).
  [[nodiscard]] bool last_step_replayed() const noexcept { return replayed_; }
  /// Why recording a graph failed, when it did (graphs are then off and steps launch directly).
  [[nodiscard]] const std::string& graph_failure() const noexcept { return graphs_.failure(); }
  /// Why the step graphs are recorded with every launch plain, when they are: the error of a recording
  /// with programmatic dependent launches ("" otherwise; the graphs replay either way, exec/cuda_graph.hpp).
  [[nodiscard]] const std::string& graph_plain_reason() const noexcept { return graphs_.plain_reason(); }

 private:
  using binding_type = typename CudaGroups<Net, P>::binding_type;
  static constexpr std::size_t last = Net::stage_count - 1;
  using memory = CudaMemory<Net, P>;
  static constexpr std::size_t op_slot_bytes = memory::step_slot_bytes;
  static constexpr std::size_t target_bytes = memory::target_bytes;

  template <class Loss>
  static constexpr std::size_t target_count() {
    return std::is_same_v<typename Loss::template target<T>, std::int32_t> ? 1 : output_size;
  }
  template <class Loss>
  const typename Loss::template target<T>* staged_targets() const {
    return staging_.template targets<typename Loss::template target<T>>();
  }

  void to_host(std::span<T> out, std::span<const T> src, const char* what) const {
    require(out.size() == src.size(), "Model::", what, ": a span of ", out.size(), " values for ", src.size());
    const CudaDeviceScope device = space_.enter();
    copy_async(out.data(), src.data(), src.size(), space_.stream());
    space_.synchronize();
  }

  template <class Target>
  void stage(std::span<const T> inputs, std::span<const Target> targets, std::size_t batch, bool backward = true) {
    reserve_for(batch, backward);
    staging_.stage(inputs, targets, space_.stream());
  }

  std::span<const T> outputs_to_host(std::size_t batch) {
    return staging_.to_host(binding_.template output_of<last>(staging_.inputs(), batch), batch * output_size,
                            space_.stream());
  }

  template <class Loss>
  void enqueue_loss(const Loss& loss, const T* x, std::size_t batch, const typename Loss::template target<T>* targets,
                    T* dlogits) {
    static_assert(requires {
      loss.enqueue(space_, batch, output_size, static_cast<const T*>(nullptr), targets, dlogits,
                   kernels::cuda::LossOutput{});
    }, "fusedp::Model on Cuda: this loss has no Cuda implementation (an enqueue(CudaSpace, ...) member)");
    const auto span = trace::SpaceSpans<space_type>::open(space_, "loss", trace::Kind::loss);
    loss.enqueue(space_, batch, output_size, binding_.template output_of<last>(x, batch), targets, dlogits,
                 loss_.output());
    last_loss_name_ = Loss::name;
  }

  // Forward in training mode, the loss with its gradient (scaled to the share of `normalizer`
  // samples, as on Host) and backward, queued on the stream.
  // An active `update`: the weight-gradient GEMMs apply the optimizer to their weights (CudaGroups::update).
  template <class Loss, class StageDone>
  void queue_gradients(const T* x, const typename Loss::template target<T>* targets, std::size_t batch,
                       const Loss& loss, StageDone& on_stage_done, std::size_t normalizer = 0,
                       const kernels::UpdateTarget<T>& update = {}) {
    forward_pass(x, batch, true);
    T* dlogits = binding_.gradient_buffer(0, batch);
    enqueue_loss(loss, x, batch, targets, dlogits);
    if (normalizer != 0 && normalizer != batch)
      kernels::cuda::scale_gradient(space_.stream(), dlogits, batch * output_size, T(batch) / T(normalizer));
    backward_pass(x, batch, on_stage_done, update);
  }

  template <class Loss, class Opt>
  void run_step(const T* x, const typename Loss::template target<T>* targets, std::size_t batch, const Loss& loss,
                Opt& opt) {
    NoStageHook none;
    replayed_ = false;
    // A replayed graph runs no host code: the step's own span, outside the graph, is what it records.
    const auto span = trace::SpaceSpans<space_type>::open(space_, "step", trace::Kind::step,
                                                          std::int64_t(store_.steps() + 1));
    if constexpr (requires { typename Opt::on_nonfinite; }) {
      // The update depends on the gradient's statistics, read on the host: launched directly.
      queue_gradients(x, targets, batch, loss, none);
      (void)step(opt);
    } else {
      static_assert(requires { opt.template update<T>(std::uint64_t(1)); },
                    "fusedp::Model on Cuda: this optimizer has no Cuda implementation (an update<T>(step) member)");
      using Op = decltype(opt.template update<T>(std::uint64_t(1)));
      using Any = kernels::AnyStep<T>;
      static_assert(sizeof(Op) <= op_slot_bytes && std::is_trivially_copyable_v<Op>);
      static_assert(sizeof(Any) <= op_slot_bytes && std::is_trivially_copyable_v<Any>);
      std::span<T> state = optimizer_state<Opt>();
      const Op op = opt.template update<T>(store_.optimizer_steps() + 1);
      // The step's numbers travel in a device slot written before the launch, so one recorded graph
      // serves every step. Fused, the slot holds them as an AnyStep, which the GEMMs' epilogues read.
      constexpr bool fusable = Any::template holds<Op> && plan::updated_tensors.size() > 0;
      const bool fused = fusable && fused_update_;
      if constexpr (fusable) {
        if (fused) write_op_slot(Any::of(op));
      }
      if (!fused) write_op_slot(op);
      const detail::StepGraphKey key{batch,
                                     x,
                                     targets,
                                     binding_.data(),
                                     state.data(),
                                     Loss::name,
                                     detail::loss_options(loss),
                                     Opt::name,
                                     fused,
                                     kernels::cuda::dependent_launch(),
                                     kernels::cuda::fused_mlp(),
                                     branching(),
                                     kernels::cuda::branch_delay()};
      replayed_ = graphs_.run(space_.stream(), key, [&] {
        if (fused) {
          const kernels::UpdateTarget<T> whole{reinterpret_cast<const Any*>(op_slot_.data()), store_.params().data(),
                                               state.data(), Net::param_storage};
          queue_gradients(x, targets, batch, loss, none, 0, whole);
          if constexpr (plan::rest_run_count > 0) {
            const auto update = trace::SpaceSpans<space_type>::open(space_, "optimizer", trace::Kind::optimizer);
            kernels::cuda::apply_optimizer_rest(space_.stream(), whole, store_.grads().data(), rest_runs(),
                                                store_.decay_runs());
          }
        } else {
          queue_gradients(x, targets, batch, loss, none);
          const auto update = trace::SpaceSpans<space_type>::open(space_, "optimizer", trace::Kind::optimizer);
          kernels::cuda::apply_optimizer<int(Opt::state_slots)>(
              space_.stream(), store_.params().data(), store_.grads().data(), state.data(), Net::param_storage, Op{},
              reinterpret_cast<const Op*>(op_slot_.data()), store_.decay_runs());
        }
      });
      store_.count_step(true);
    }
  }

  // Writes the step's numbers to the device slot, unless the slot already holds these very numbers in
  // this representation (kernels::identical): SGD at a constant learning rate writes them on the first
  // two steps only, and its later steps launch one kernel fewer.
  template <class V>
  void write_op_slot(const V& v) {
    if constexpr (requires { kernels::identical(v, v); }) {
      if (op_slot_type_ == &detail::op_slot_tag<V>) {
        V last;
        std::memcpy(static_cast<void*>(&last), op_slot_host_.data(), sizeof(V));
        if (kernels::identical(last, v)) return;
      }
    }
    kernels::cuda::set_value(space_.stream(), reinterpret_cast<V*>(op_slot_.data()), v);
    std::memcpy(op_slot_host_.data(), static_cast<const void*>(&v), sizeof(V));
    op_slot_type_ = &detail::op_slot_tag<V>;
  }

  // The device code's plan against the host code's (net/cuda_plan.hpp: CudaPlanFingerprint): both were
  // evaluated from the same headers by different compilers, and the kernels assume they agree.
  void check_device_plan() {
    constexpr std::uint64_t host = CudaPlanFingerprint<Net, P>::value;
    const std::uint64_t device = kernels::cuda::device_constant<CudaPlanFingerprint<Net, P>>(space_.stream());
    require<Error>(device == host, "fusedp::Model on Cuda: the device code of this translation unit planned the network ",
                   "differently from its host code (plan fingerprints ", device, " on the device, ", host,
                   " on the host): nvcc's front end and the host compiler evaluated a compile-time fact differently. ",
                   "Please report it with both compilers' versions (tests/plan_agreement/ compares them on the ",
                   "library's own networks)");
  }

  // Its callers hold the model's device scope (space_.enter()): what it allocates lies on that device.
  // reserve, with backward's branch memory when branches are on and `backward` (a training pass
  // follows) or it is there already; the scratch is reallocated with it (twice its stride, then). The
  // scratch, the third buffer and the side stream are allocated first and committed together.
  void reserve_for(std::size_t batch, bool backward) {
    const bool branch_memory = backward && branches_ && CudaGroups<Net, P>::branches;
    const std::size_t capacity = std::max(batch, binding_.capacity());
    const bool branch_room = !branch_memory || (side_.ready() && branch_capacity_ >= capacity);
    if (batch <= binding_.capacity() && branch_room) return;
    constexpr std::size_t widest = Net::gradient_elements > input_size ? Net::gradient_elements : input_size;
    require(capacity <= memory::batch_limit, "Model on Cuda: a batch of ", capacity, " needs indices beyond 2^31 (",
            widest, " values per sample in one tensor; at most ", memory::batch_limit, " samples)");
    space_.synchronize();  // nothing in flight may use what is freed below
    if (side_.ready()) side_.synchronize();
    graphs_.clear();
    const std::size_t stride = memory::scratch_stride(space_.sm_count(), capacity);
    const bool halves = branches_ && CudaGroups<Net, P>::branches && (backward || branch_capacity_ > 0);
    try {
      buffer<float> scratch(halves ? 2 * stride : stride);
      buffer<float> third = halves ? buffer<float>(capacity * CudaWorkspace<Net, P>::gradient_elements) : buffer<float>();
      CudaSideStream side = halves && !side_.ready() ? CudaSideStream::make() : CudaSideStream();
      // The scratch and the branch memory, sized for `capacity`, are committed before the binding grows
      // to it: a later allocation that throws leaves them larger than needed, never smaller.
      scratch_ = std::move(scratch);
      scratch_stride_ = stride;
      branch_gradients_ = std::move(third);
      branch_capacity_ = halves ? capacity : 0;
      if (side.ready()) side_ = std::move(side);
      if (batch > binding_.capacity()) {
        loss_.allocate(capacity);
        staging_.allocate(capacity * input_size, capacity * target_bytes, capacity * output_size);
        binding_.reserve(capacity, capacity * plan::mlp_gradient_elements);
      }
    } catch (const DeviceError& e) {
      // The device is out of memory (not the pinned host memory of cudaMallocHost, nor a stream or an
      // event): say what the model needs in all at this batch and how to find one that fits.
      if (e.code() != int(cudaErrorMemoryAllocation) || !e.call().starts_with("cudaMalloc(")) throw;
      const std::size_t slots = Net::param_storage == 0 ? 0 : store_.optimizer_state().size() / Net::param_storage;
      const CudaMemoryOptions o{.state_slots = slots, .training = halves, .branches = halves, .guarded = stats_.allocated()};
      throw DeviceError(e.call(), e.code(),
                        detail::concat(e.message(), "; the model needs ",
                                       memory::use(capacity, space_.sm_count(), o).total() >> 20,
                                       " MiB in all at a batch of ", capacity,
                                       slots == 0 ? " before its optimizer's state" : "",
                                       " (fusedp::CudaMemory<Net, P>::use; CudaMemory::largest_batch finds the "
                                       "largest batch that fits a budget)"),
                        e.rank());
    }
  }

  // How the plan's groups run over this model's store, workspace and scratch (net/cuda_groups.hpp).
  CudaGroups<Net, P> groups(const kernels::UpdateTarget<T>& update = {}) {
    if (!branching()) return {space_, store_, binding_, scratch_.data(), update};
    return {space_, store_, binding_, scratch_.data(), update, &side_, branch_gradients_.data(), scratch_stride_};
  }
  // Whether this backward branches: on, and reserved for (reserve runs before every pass; it reserves
  // only where CudaGroups::branches).
  [[nodiscard]] bool branching() const noexcept { return branches_ && side_.ready() && branch_capacity_ > 0; }
  void forward_pass(const T* x, std::size_t batch, bool training) { groups().forward(x, batch, training); }
  template <class StageDone>
  void backward_pass(const T* x, std::size_t batch, StageDone& on_stage_done,
                     const kernels::UpdateTarget<T>& update = {}) {
    groups(update).backward(x, batch, on_stage_done);
  }
  // The parameters the GEMMs do not update, in device memory (CudaPlan::rest_runs); their count from the
  // plan, since the host sizes the pass's launch.
  [[nodiscard]] kernels::ElementRuns rest_runs() const noexcept {
    const std::size_t* r = rest_runs_.data();
    return {r, r + 2 * plan::rest_run_count, plan::rest_run_count, plan::rest_elements};
  }

  space_type space_;
  ParameterStore<Net, space_type, T> store_;
  binding_type binding_;
  buffer<float> scratch_;  // one half of scratch_stride_ floats, two with backward branches
  std::size_t scratch_stride_ = 0;
  bool branches_ = true;
  CudaSideStream side_;             // made by the first reserve with branches on
  buffer<float> branch_gradients_;  // the third gradient buffer of branched backward
  std::size_t branch_capacity_ = 0;  // samples branch_gradients_ holds
  buffer<unsigned char> op_slot_;  // the optimizer's numbers of the next step (a graph reads them)
  std::array<unsigned char, op_slot_bytes> op_slot_host_{};  // what op_slot_ holds (write_op_slot)
  const void* op_slot_type_ = nullptr;                       // and as which type (detail::op_slot_tag)
  buffer<std::size_t> rest_runs_;  // CudaPlan::rest_runs
  bool fused_update_ = true;
  kernels::cuda::LossResult loss_;
  const char* last_loss_name_ = nullptr;
  HostStaging<T> staging_;
  GraphCache<detail::StepGraphKey, 2> graphs_{graph_safe};
  bool replayed_ = false;
  kernels::cuda::GradientStatsBuffer stats_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
