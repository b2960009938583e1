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
//   - stages run as the groups of CudaPlan<Net, P> (net/cuda_plan.hpp): conv + max-pooling fused, runs
//     of narrow Linear layers as one fused MLP kernel.
// Parameters are initialized on the host with the same Philox numbers as on Host, then copied, so a
// Host and a Cuda model built from the same seed start identical.
//
// tests/gpu/ compare every piece against the Host model (and skip where there is no device); they
// passed on an H200 (benchmarks/RESULTS.md says which commit).
#include "fusedp/net/model.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/gradient.cuh"
#include "fusedp/kernels/cuda/loss.cuh"
#include "fusedp/kernels/cuda/mlp.cuh"
#include "fusedp/kernels/cuda/optimizer.cuh"
#include "fusedp/layers/activation.hpp"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/net/cuda_plan.hpp"
#include "fusedp/net/sequential.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedp {

namespace detail {
struct GraphExecDeleter {
  void operator()(cudaGraphExec_t g) const noexcept { cudaGraphExecDestroy(g); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
};

template <class L>
constexpr bool cuda_graph_safe() {
  if constexpr (requires { L::cuda_graph_safe; }) return L::cuda_graph_safe;
  else return true;
}

// The fused-MLP description of stages [First, First + sizeof...(L)) of Net.
template <class Net, std::size_t First, class Seq>
struct mlp_spec_of;
template <class Net, std::size_t First, std::size_t... L>
struct mlp_spec_of<Net, First, std::index_sequence<L...>> {
  using type = kernels::cuda::MlpSpec<kernels::cuda::MlpLayer<int(Net::template stage<First + L>::in::size),
                                                              int(Net::template stage<First + L>::out::size),
                                                              typename Net::template stage<First + L>::epilogue>...>;
};

// What a recorded graph depends on: replaying it is right only while all of these are unchanged.
struct GraphKey {
  std::size_t batch = 0;
  const void* inputs = nullptr;
  const void* targets = nullptr;
  const void* workspace = nullptr;
  const void* state = nullptr;
  const char* loss = nullptr;
  const char* optimizer = nullptr;
  bool operator==(const GraphKey&) const = default;
};
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

  /// Parameters drawn from `seed` with PyTorch's default initialization (the Host model's numbers).
  explicit Model(Seed seed = {}, space_type space = space_type{}) : space_(std::move(space)), seed_(seed.value) {
    space_.activate();  // every buffer below lives on the space's device
    params_ = buffer<T>(Net::param_storage);
    grads_ = buffer<T>(Net::param_storage);
    cudaEvent_t e = nullptr;
    FUSEDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    staged_.reset(e);
    status_ = buffer<int>(1);
    op_slot_ = buffer<unsigned char>(op_slot_bytes);
    loss_host_ = PinnedBuffer<float>(1);
    status_host_ = PinnedBuffer<int>(1);
    reset_parameters();
  }
  explicit Model(space_type space, Seed seed = {}) : Model(seed, std::move(space)) {}
  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  /// Waits for the model's queued work before its memory is freed.
  ~Model() {
    if (space_.stream() != nullptr) (void)cudaStreamSynchronize(space_.stream());
  }

  /// Draws every weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) on the host, exactly as the
  /// Host model does, and copies them to the device.
  void reset_parameters() {
    HostBuffer<T> host(Net::param_storage);
    for (std::size_t t = 0; t < Net::param_layout.size(); ++t) {
      const ParamTensor& p = Net::param_layout[t];
      const double bound = 1.0 / std::sqrt(double(p.fan_in));
      const std::uint64_t stream = rng::stream(rng::Purpose::init, t);
      for (std::size_t e = 0; e < p.size; ++e)
        host[p.offset + e] = T((2.0 * rng::uniform(seed_, stream, e) - 1.0) * bound);
    }
    load_params(host.span());
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
    opt.validate();
    const std::size_t batch = batch_of(inputs.size());
    Loss::validate(targets, batch, output_size);
    stage(inputs, targets, batch);
    run_step(inputs_.data(), targets_as<Loss>(), batch, loss, opt);
  }
  /// Queues one training step from device data and returns without waiting.
  template <class Loss, class Opt>
  void train_step_async(DeviceSpan<const T> inputs, DeviceSpan<const typename Loss::template target<T>> targets,
                        const Loss& loss, Opt& opt) {
    opt.validate();
    const std::size_t batch = batch_of(inputs.size);
    require(targets.size == batch * target_count<Loss>(), "Model: ", targets.size, " targets on the device for a batch of ",
            batch);
    reserve(batch);
    run_step(inputs.data, targets.data, batch, loss, opt);
  }

  /// The mean loss of the latest training step or compute_gradients (waits for it). Throws
  /// InvalidArgument when a label on the device was out of range.
  T last_loss() {
    require(loss_.size() > 0, "Model::last_loss: no training step or loss has run on this model yet");
    copy_async(loss_host_.data(), loss_value(), 1, space_.stream());
    copy_async(status_host_.data(), status_.data(), 1, space_.stream());
    space_.synchronize();
    if (status_host_[0] != 0) {
      FUSEDP_CUDA_CHECK(cudaMemsetAsync(status_.data(), 0, sizeof(int), space_.stream()));
      space_.synchronize();
      throw InvalidArgument("SoftmaxCrossEntropy: a label on the device is outside [0, " +
                            std::to_string(output_size) + ") (the step ran; its loss is NaN)");
    }
    return loss_host_[0];
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
      return apply_step(opt, opt.decide(kernels::host::GradientStats{s.sum_squares, s.finite()}, steps_ + 1,
                                        nonfinite_tensor_name(s.first_nonfinite)));
    } else {
      return apply_step(opt, 1.0);
    }
  }

  /// Applies a decision taken elsewhere (a data-parallel guard that combined every rank's statistics):
  /// factor 0 skips the update (counted in skipped_steps()), else the gradient is scaled by `factor`
  /// (when not 1) and the optimizer runs. Returns whether the update ran.
  template <class Opt>
  bool apply_step(const Opt& opt, double factor) {
    if (factor == 0.0) {
      ++steps_;
      ++skipped_steps_;
      return false;
    }
    if (factor != 1.0) kernels::cuda::scale_gradient(space_.stream(), grads_.data(), Net::param_storage, T(factor));
    std::span<T> state = optimizer_state<Opt>();
    ++optimizer_steps_;
    opt.step(space_, params_.data(), grads_.data(), state.data(), Net::param_storage, optimizer_steps_);
    ++steps_;
    return true;
  }

  /// The sum of squares and the first non-finite element of the whole gradient, measured on the device
  /// after the work queued so far (waits).
  kernels::cuda::DeviceGradientStats gradient_stats() {
    kernels::cuda::GradientStatsBuffer& b = stats_buffer();
    b.enqueue(space_.stream(), grads_.data(), Net::param_storage);
    b.copy_to_host(space_.stream());
    space_.synchronize();
    return b.host();
  }
  /// Device memory for gradient statistics on this model's device (allocated on first use).
  kernels::cuda::GradientStatsBuffer& stats_buffer() {
    if (!stats_.allocated()) {
      space_.activate();
      stats_ = kernels::cuda::GradientStatsBuffer(true);
    }
    return stats_;
  }

  /// The Host model's name for the tensor holding flat element `index` ("'3.weight' (layer 4)"), or
  /// "no tensor" (every element finite, or padding): the words of Model<Net, Host>::first_nonfinite_tensor.
  [[nodiscard]] static std::string nonfinite_tensor_name(unsigned long long index) {
    for (const ParamTensor& t : Net::param_layout)
      if (index >= t.offset && index < t.offset + t.size)
        return param_tensor_label(t);
    return "no tensor";
  }

  /// The state of optimizer Opt on the device (Opt::state_slots x param_storage values), allocated and
  /// zeroed the first time an optimizer of this type is used.
  template <class Opt>
  std::span<T> optimizer_state() {
    if (state_owner_ == nullptr || std::strcmp(state_owner_, Opt::name) != 0) {
      space_.synchronize();
      state_ = buffer<T>(Opt::state_slots * Net::param_storage);
      state_owner_ = Opt::name;
      optimizer_steps_ = 0;
    }
    return state_.span();
  }

  /// Forward in training mode, the loss and backward; grads() then holds the gradient of the mean
  /// loss. Returns the loss (waits). `on_stage_done(i)` is called when backward of stage i has been
  /// *queued* on the stream (stages in reverse order): work a reducer queues on the same stream after
  /// that sees the stage's gradients.
  template <class Loss, class StageDone = NoStageHook>
  T compute_gradients(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                      const Loss& loss, StageDone&& on_stage_done = {}) {
    const std::size_t batch = batch_of(inputs.size());
    Loss::validate(targets, batch, output_size);
    stage(inputs, targets, batch);
    queue_gradients(inputs_.data(), targets_as<Loss>(), batch, loss, on_stage_done);
    return last_loss();
  }

  // --- inference --------------------------------------------------------------------------------

  /// Outputs (batch, output_size) in evaluation mode, copied to host memory that stays valid until the
  /// next call on this model (waits).
  std::span<const T> predict(std::span<const T> inputs) {
    const std::size_t batch = batch_of(inputs.size());
    stage(inputs, std::span<const std::int32_t>{}, batch);
    forward_pass(inputs_.data(), batch, false);
    return outputs_to_host(batch);
  }
  /// Outputs (batch, output_size) on the device for inputs on the device (queued, not waited for).
  DeviceSpan<const T> predict(DeviceSpan<const T> inputs) {
    const std::size_t batch = batch_of(inputs.size);
    reserve(batch);
    forward_pass(inputs.data, batch, false);
    return {output_of<Net::stage_count - 1>(inputs.data, batch), batch * output_size};
  }

  /// The loss of a batch in evaluation mode and the outputs it came from (host memory, valid until the
  /// next call on this model).
  template <class Loss>
  Evaluation<T> evaluate(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                         const Loss& loss) {
    const std::size_t batch = batch_of(inputs.size());
    Loss::validate(targets, batch, output_size);
    stage(inputs, targets, batch);
    forward_pass(inputs_.data(), batch, false);
    enqueue_loss(loss, inputs_.data(), batch, targets_as<Loss>(), static_cast<T*>(nullptr));
    const T l = last_loss();
    return {l, outputs_to_host(batch)};
  }

  // --- memory -----------------------------------------------------------------------------------

  /// Allocates everything for batches up to `batch`, so that no later step allocates.
  void reserve(std::size_t batch) {
    if (batch <= capacity_) return;
    constexpr std::size_t widest = Net::gradient_elements > input_size ? Net::gradient_elements : input_size;
    require(batch * widest < (std::size_t(1) << 31), "Model on Cuda: a batch of ", batch,
            " needs indices beyond 2^31 (", widest, " values per sample in one tensor)");
    space_.synchronize();  // nothing in flight may use what is freed below
    drop_graphs();
    workspace_ = buffer<T>(batch * (Net::workspace_elements_per_sample + plan::mlp_gradient_elements));
    scratch_ = buffer<float>(scratch_elements(batch));
    loss_ = buffer<float>(1 + std::size_t(kernels::cuda::loss_blocks(batch)));
    inputs_ = buffer<T>(batch * input_size);
    targets_ = buffer<unsigned char>(batch * target_bytes);
    pinned_inputs_ = PinnedBuffer<T>(batch * input_size);
    pinned_targets_ = PinnedBuffer<unsigned char>(batch * target_bytes);
    outputs_host_ = PinnedBuffer<T>(batch * output_size);
    capacity_ = batch;
  }

  /// The flat parameter buffer on the device (padding included; see Net::param_layout).
  [[nodiscard]] std::span<T> params() noexcept { return params_.span(); }
  [[nodiscard]] std::span<const T> params() const noexcept { return params_.span(); }
  /// The gradient twin of params(), on the device.
  [[nodiscard]] std::span<T> grads() noexcept { return grads_.span(); }
  [[nodiscard]] std::span<const T> grads() const noexcept { return grads_.span(); }
  /// Parameter tensor `i` of Net::param_layout, on the device.
  [[nodiscard]] std::span<T> param(std::size_t i) {
    require(i < Net::param_layout.size(), "Model::param: tensor ", i, " of ", Net::param_layout.size());
    return params_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }
  [[nodiscard]] std::span<const T> grad(std::size_t i) const {
    require(i < Net::param_layout.size(), "Model::grad: tensor ", i, " of ", Net::param_layout.size());
    return grads_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }
  /// Optimizer state on the device (state_slots x param_storage values), empty before the first step.
  [[nodiscard]] std::span<const T> optimizer_state() const noexcept { return state_.span(); }
  [[nodiscard]] const char* optimizer_name() const noexcept { return state_owner_; }

  /// Copies the parameters (param_storage values) to host memory (waits).
  void copy_params_to_host(std::span<T> out) const { to_host(out, params_.data(), Net::param_storage, "copy_params_to_host"); }
  /// Copies the gradients (param_storage values) to host memory (waits).
  void copy_grads_to_host(std::span<T> out) const { to_host(out, grads_.data(), Net::param_storage, "copy_grads_to_host"); }
  /// Copies the optimizer state (optimizer_state().size() values) to host memory (waits).
  void copy_optimizer_state_to_host(std::span<T> out) const {
    to_host(out, state_.data(), state_.size(), "copy_optimizer_state_to_host");
  }
  /// Replaces the parameters with param_storage values from host memory (waits).
  void load_params(std::span<const T> values) {
    require(values.size() == Net::param_storage, "Model::load_params: ", values.size(), " values for ",
            Net::param_storage, " parameters");
    copy_async(params_.data(), values.data(), values.size(), space_.stream());
    space_.synchronize();
  }
  /// Replaces the optimizer state of Opt with values from host memory (waits).
  template <class Opt>
  void load_optimizer_state(std::span<const T> values) {
    std::span<T> state = optimizer_state<Opt>();
    require(values.size() == state.size(), "Model::load_optimizer_state: ", values.size(), " values for ",
            state.size());
    copy_async(state.data(), values.data(), values.size(), space_.stream());
    space_.synchronize();
  }

  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return optimizer_steps_; }
  /// Steps a guarded optimizer skipped (nonfinite::Skip).
  [[nodiscard]] std::uint64_t skipped_steps() const noexcept { return skipped_steps_; }
  void set_step_counters(std::uint64_t steps, std::uint64_t optimizer_steps) noexcept {
    steps_ = steps;
    optimizer_steps_ = optimizer_steps;
  }
  [[nodiscard]] const space_type& space() const noexcept { return space_; }

  /// Whether train steps are recorded and replayed as CUDA graphs (on by default; always off for a
  /// network whose layers are not graph-safe, such as Dropout).
  void use_graphs(bool on) noexcept {
    graphs_ = on && graph_safe;
    if (!graphs_) drop_graphs();
  }
  [[nodiscard]] bool uses_graphs() const noexcept { return graphs_; }
  /// Whether the latest train step was a graph replay (for tests and benchmarks).
  [[nodiscard]] bool last_step_replayed() const noexcept { return replayed_; }
  /// Why recording a graph failed, when it did (graphs are then off and steps launch directly).
  [[nodiscard]] const std::string& graph_failure() const noexcept { return graph_failure_; }

  /// Whether every stage of the network may be recorded in a CUDA graph.
  static constexpr bool graph_safe = []<std::size_t... I>(std::index_sequence<I...>) {
    return (detail::cuda_graph_safe<typename Net::template stage<I>::layer>() && ...);
  }(std::make_index_sequence<Net::stage_count>{});

 private:
  static constexpr std::size_t op_slot_bytes = 256;
  static constexpr std::size_t target_bytes =
      output_size * sizeof(T) > sizeof(std::int32_t) ? output_size * sizeof(T) : sizeof(std::int32_t);

  template <class S>
  using executor = std::conditional_t<S::kind == LayerKind::pointwise, PointwiseStage, typename S::layer>;

  std::size_t batch_of(std::size_t values) const {
    require(values != 0 && values % input_size == 0, "Model: ", values,
            " input values are not a whole number of samples of ", input_size, " values (",
            Net::input_shape::channels, "x", Net::input_shape::height, "x", Net::input_shape::width, ")");
    return values / input_size;
  }

  template <class Loss>
  static constexpr std::size_t target_count() {
    return std::is_same_v<typename Loss::template target<T>, std::int32_t> ? 1 : output_size;
  }
  template <class Loss>
  const typename Loss::template target<T>* targets_as() const {
    return reinterpret_cast<const typename Loss::template target<T>*>(targets_.data());
  }

  void to_host(std::span<T> out, const T* src, std::size_t n, const char* what) const {
    require(out.size() == n, "Model::", what, ": a span of ", out.size(), " values for ", n);
    copy_async(out.data(), src, n, space_.stream());
    space_.synchronize();
  }

  // Copies host inputs and targets to the device through pinned buffers. The previous copies must
  // have read the pinned buffers before they are overwritten.
  template <class Target>
  void stage(std::span<const T> inputs, std::span<const Target> targets, std::size_t batch) {
    reserve(batch);
    FUSEDP_CUDA_CHECK(cudaEventSynchronize(staged_.get()));
    std::memcpy(pinned_inputs_.data(), inputs.data(), inputs.size_bytes());
    copy_async(inputs_.data(), pinned_inputs_.data(), inputs.size(), space_.stream());
    if (!targets.empty()) {
      std::memcpy(pinned_targets_.data(), targets.data(), targets.size_bytes());
      copy_async(targets_.data(), pinned_targets_.data(), targets.size_bytes(), space_.stream());
    }
    FUSEDP_CUDA_CHECK(cudaEventRecord(staged_.get(), space_.stream()));
  }

  std::span<const T> outputs_to_host(std::size_t batch) {
    const std::size_t n = batch * output_size;
    copy_async(outputs_host_.data(), output_of<Net::stage_count - 1>(inputs_.data(), batch), n, space_.stream());
    space_.synchronize();
    return {outputs_host_.data(), n};
  }

  float* loss_value() { return loss_.data(); }

  template <class Loss>
  void enqueue_loss(const Loss& loss, const T* x, std::size_t batch, const typename Loss::template target<T>* targets,
                    T* dlogits) {
    static_assert(requires {
      loss.enqueue(space_, batch, output_size, static_cast<const T*>(nullptr), targets, dlogits,
                   kernels::cuda::LossOutput{});
    }, "fusedp::Model on Cuda: this loss has no Cuda implementation (an enqueue(CudaSpace, ...) member)");
    const kernels::cuda::LossOutput out{loss_.data(), loss_.data() + 1, status_.data()};
    loss.enqueue(space_, batch, output_size, output_of<Net::stage_count - 1>(x, batch), targets, dlogits, out);
  }

  // Forward in training mode, the loss with its gradient and backward, queued on the stream.
  template <class Loss, class StageDone>
  void queue_gradients(const T* x, const typename Loss::template target<T>* targets, std::size_t batch,
                       const Loss& loss, StageDone& on_stage_done) {
    forward_pass(x, batch, true);
    enqueue_loss(loss, x, batch, targets, gradient_buffer(0, batch));
    backward_pass(x, batch, on_stage_done);
  }

  template <class Loss, class Opt>
  void run_step(const T* x, const typename Loss::template target<T>* targets, std::size_t batch, const Loss& loss,
                Opt& opt) {
    if constexpr (requires { typename Opt::on_nonfinite; }) {
      // The update depends on the gradient's statistics, read on the host: launched directly.
      reserve(batch);
      replayed_ = false;
      NoStageHook none;
      queue_gradients(x, targets, batch, loss, none);
      (void)step(opt);
    } else {
      run_graphed_step(x, targets, batch, loss, opt);
    }
  }

  template <class Loss, class Opt>
  void run_graphed_step(const T* x, const typename Loss::template target<T>* targets, std::size_t batch,
                        const Loss& loss, Opt& opt) {
    static_assert(requires { opt.template update<T>(std::uint64_t(1)); },
                  "fusedp::Model on Cuda: this optimizer has no Cuda implementation (an update<T>(step) member)");
    using Op = decltype(opt.template update<T>(std::uint64_t(1)));
    static_assert(sizeof(Op) <= op_slot_bytes && std::is_trivially_copyable_v<Op>);
    reserve(batch);
    std::span<T> state = optimizer_state<Opt>();
    ++optimizer_steps_;
    Op* slot = reinterpret_cast<Op*>(op_slot_.data());
    kernels::cuda::set_value(space_.stream(), slot, opt.template update<T>(optimizer_steps_));

    auto body = [&] {
      NoStageHook none;
      queue_gradients(x, targets, batch, loss, none);
      kernels::cuda::apply_optimizer<int(Opt::state_slots)>(space_.stream(), params_.data(), grads_.data(),
                                                            state.data(), Net::param_storage, Op{}, slot);
    };
    const detail::GraphKey key{batch, x, targets, workspace_.data(), state.data(), Loss::name, Opt::name};
    replayed_ = false;
    if (!graphs_) {
      body();
      ++steps_;
      return;
    }
    // A step is recorded the second time its key is seen and replayed from then on. Two keys are kept,
    // so batches that alternate between two device buffers (DeviceLoader's slots) replay too.
    CachedGraph* entry = nullptr;
    for (CachedGraph& g : graphs_cache_)
      if (g.seen && g.key == key) entry = &g;
    if (entry == nullptr) {
      entry = &graphs_cache_[0];
      for (CachedGraph& g : graphs_cache_)
        if (g.last_used < entry->last_used) entry = &g;
      entry->exec.reset();
      entry->key = key;
      entry->seen = true;
      entry->last_used = ++graph_clock_;
      body();
      ++steps_;
      return;
    }
    entry->last_used = ++graph_clock_;
    if (!entry->exec) {
      try {
        entry->exec = record(body);
      } catch (const DeviceError& e) {
        // A step that cannot be recorded still runs, launched directly; the reason is kept.
        graph_failure_ = e.what();
        graphs_ = false;
        drop_graphs();
        body();
        ++steps_;
        return;
      }
    }
    FUSEDP_CUDA_CHECK(cudaGraphLaunch(entry->exec.get(), space_.stream()));
    replayed_ = true;  // the step ran as a graph (recorded just now, or before)
    ++steps_;
  }

  using GraphExec = std::unique_ptr<CUgraphExec_st, detail::GraphExecDeleter>;
  struct CachedGraph {
    detail::GraphKey key{};
    bool seen = false;           // the key has run once (directly)
    std::uint64_t last_used = 0;
    GraphExec exec;              // recorded on the key's second step
  };

  void drop_graphs() noexcept {
    for (CachedGraph& g : graphs_cache_) g = CachedGraph{};
  }

  // Records everything `body` queues on the stream as a graph (nothing runs while recording).
  template <class Body>
  GraphExec record(Body& body) {
    cudaGraph_t graph = nullptr;
    FUSEDP_CUDA_CHECK(cudaStreamBeginCapture(space_.stream(), cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      if (cudaStreamEndCapture(space_.stream(), &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    FUSEDP_CUDA_CHECK(cudaStreamEndCapture(space_.stream(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t code = cudaGraphInstantiateWithFlags(&exec, graph, 0);
    cudaGraphDestroy(graph);
    FUSEDP_CUDA_CHECK(code);
    return GraphExec(exec);
  }

  std::size_t scratch_elements(std::size_t batch) const {
    std::size_t most = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (
          [&] {
            using S = typename Net::template stage<I>;
            if constexpr (requires { S::layer::template cuda_scratch<typename S::in>(batch, space_); })
              most = std::max(most, S::layer::template cuda_scratch<typename S::in>(batch, space_));
          }(),
          ...);
    }(std::make_index_sequence<Net::stage_count>{});
    [&]<std::size_t... G>(std::index_sequence<G...>) {
      (
          [&] {
            using Gr = typename plan::template group<G>;
            if constexpr (Gr::kind == CudaGroupKind::mlp)
              most = std::max(most, kernels::cuda::mlp_backward_scratch<mlp_spec<Gr>>(int(batch), space_.sm_count()));
          }(),
          ...);
    }(std::make_index_sequence<plan::group_count>{});
    return most;
  }

  T* gradient_buffer(int which, std::size_t batch) {
    return workspace_.data() + batch * (Net::activation_elements + std::size_t(which) * Net::gradient_elements);
  }
  // Per-layer dz of a fused MLP group, after everything the Host plan places.
  T* mlp_gradients() { return workspace_.data() + capacity_ * Net::workspace_elements_per_sample; }

  template <std::size_t I>
  T* output_of(const T* x, std::size_t batch) {
    if constexpr (Net::stage_plan[I].aliases_input) return const_cast<T*>(input_of<I>(x, batch));
    else return workspace_.data() + Net::stage_plan[I].out_offset * batch;
  }
  template <std::size_t I>
  const T* input_of(const T* x, std::size_t batch) {
    if constexpr (I == 0) return x;
    else return output_of<I - 1>(x, batch);
  }
  // The argmax bytes of a fused conv + max-pool live in the conv's own output region, which the fused
  // kernel does not otherwise write (Out*OH*OW floats per sample hold Out*(OH/K)*(OW/K) bytes).
  template <std::size_t I>
  std::uint8_t* argmax_of(const T* x, std::size_t batch) {
    return reinterpret_cast<std::uint8_t*>(output_of<I>(x, batch));
  }

  template <std::size_t I>
  StageArgs<space_type, T> args_of(const T* x, std::size_t batch, bool training) {
    constexpr StagePlan p = Net::stage_plan[I];
    using S = typename Net::template stage<I>;
    return StageArgs<space_type, T>{space_,
                                    batch,
                                    input_of<I>(x, batch),
                                    output_of<I>(x, batch),
                                    p.saves_z ? workspace_.data() + p.z_offset * batch : nullptr,
                                    S::has_params ? params_.data() + p.weight : nullptr,
                                    S::has_params ? params_.data() + p.bias : nullptr,
                                    nullptr,
                                    nullptr,
                                    S::has_params ? grads_.data() + p.weight : nullptr,
                                    S::has_params ? grads_.data() + p.bias : nullptr,
                                    scratch_.data(),
                                    training,
                                    seed_,
                                    steps_,
                                    S::first};
  }

  template <class Gr>
  using mlp_spec = typename detail::mlp_spec_of<Net, Gr::first, std::make_index_sequence<Gr::last - Gr::first + 1>>::type;

  // --- forward ----------------------------------------------------------------------------------

  void forward_pass(const T* x, std::size_t batch, bool training) {
    [&]<std::size_t... G>(std::index_sequence<G...>) {
      (forward_group<typename plan::template group<G>>(x, batch, training), ...);
    }(std::make_index_sequence<plan::group_count>{});
  }

  template <std::size_t I>
  void forward_stage(const T* x, std::size_t batch, bool training) {
    using S = typename Net::template stage<I>;
    if constexpr (S::kind != LayerKind::reshape) {
      executor<S>::template forward<typename S::in, typename S::epilogue>(args_of<I>(x, batch, training));
    }
  }

  template <class Gr>
  void forward_group(const T* x, std::size_t batch, bool training) {
    if constexpr (Gr::kind == CudaGroupKind::stage) {
      forward_stage<Gr::first>(x, batch, training);
    } else if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
      using S = typename Net::template stage<Gr::first>;
      constexpr int k = detail::max_pool_window_of<typename Net::template stage<Gr::first + 1>::layer>;
      S::layer::template forward_maxpool<typename S::in, typename S::epilogue, k>(
          args_of<Gr::first>(x, batch, training), output_of<Gr::first + 1>(x, batch), argmax_of<Gr::first>(x, batch));
    } else {
      using Spec = mlp_spec<Gr>;
      if (!kernels::cuda::mlp_supported<Spec>(space_)) {
        [&]<std::size_t... L>(std::index_sequence<L...>) {
          (forward_stage<Gr::first + L>(x, batch, training), ...);
        }(std::make_index_sequence<Gr::last - Gr::first + 1>{});
        return;
      }
      kernels::cuda::mlp_forward<Spec>(space_, mlp_args<Gr>(x, batch, nullptr, nullptr));
    }
  }

  template <class Gr>
  kernels::cuda::MlpArgs<int(Gr::last - Gr::first + 1)> mlp_args(const T* x, std::size_t batch, const T* dy, T* dx) {
    constexpr int n = int(Gr::last - Gr::first + 1);
    kernels::cuda::MlpArgs<n> a{};
    a.batch = int(batch);
    a.x = input_of<Gr::first>(x, batch);
    a.dy = dy;
    a.dx = dx;
    std::size_t dz_offset = 0;
    [&]<std::size_t... L>(std::index_sequence<L...>) {
      (
          [&] {
            constexpr StagePlan p = Net::stage_plan[Gr::first + L];
            a.w[L] = params_.data() + p.weight;
            a.b[L] = params_.data() + p.bias;
            a.y[L] = output_of<Gr::first + L>(x, batch);
            a.dz[L] = mlp_gradients() + dz_offset * batch;
            dz_offset += align_elements(Net::template stage<Gr::first + L>::out::size);
          }(),
          ...);
    }(std::make_index_sequence<std::size_t(n)>{});
    return a;
  }

  // --- backward ---------------------------------------------------------------------------------

  template <class StageDone>
  void backward_pass(const T* x, std::size_t batch, StageDone& on_stage_done) {
    int current = 0;
    [&]<std::size_t... G>(std::index_sequence<G...>) {
      (backward_group<typename plan::template group<plan::group_count - 1 - G>>(x, batch, current, on_stage_done), ...);
    }(std::make_index_sequence<plan::group_count>{});
  }

  template <std::size_t I, class StageDone>
  void backward_stage(const T* x, std::size_t batch, int& current, StageDone& on_stage_done) {
    using S = typename Net::template stage<I>;
    if constexpr (S::kind != LayerKind::reshape && (I > 0 || S::has_params)) {
      StageArgs<space_type, T> a = args_of<I>(x, batch, true);
      a.dy = gradient_buffer(current, batch);
      a.dx = I > 0 ? gradient_buffer(1 - current, batch) : nullptr;
      executor<S>::template backward<typename S::in, typename S::epilogue>(a);
      current = 1 - current;
    }
    on_stage_done(I);
  }

  template <class Gr, class StageDone>
  void backward_group(const T* x, std::size_t batch, int& current, StageDone& on_stage_done) {
    if constexpr (Gr::kind == CudaGroupKind::stage) {
      backward_stage<Gr::first>(x, batch, current, on_stage_done);
    } else if constexpr (Gr::kind == CudaGroupKind::conv_maxpool) {
      using S = typename Net::template stage<Gr::first>;
      constexpr int k = detail::max_pool_window_of<typename Net::template stage<Gr::first + 1>::layer>;
      StageArgs<space_type, T> a = args_of<Gr::first>(x, batch, true);
      a.dx = Gr::first > 0 ? gradient_buffer(1 - current, batch) : nullptr;
      S::layer::template backward_maxpool<typename S::in, typename S::epilogue, k>(
          a, gradient_buffer(current, batch), output_of<Gr::first + 1>(x, batch), argmax_of<Gr::first>(x, batch));
      current = 1 - current;
      on_stage_done(Gr::first + 1);
      on_stage_done(Gr::first);
    } else {
      using Spec = mlp_spec<Gr>;
      constexpr std::size_t n = Gr::last - Gr::first + 1;
      if (!kernels::cuda::mlp_supported<Spec>(space_)) {
        [&]<std::size_t... L>(std::index_sequence<L...>) {
          (backward_stage<Gr::last - L>(x, batch, current, on_stage_done), ...);
        }(std::make_index_sequence<n>{});
        return;
      }
      T* dx = Gr::first > 0 ? gradient_buffer(1 - current, batch) : nullptr;
      const auto args = mlp_args<Gr>(x, batch, gradient_buffer(current, batch), dx);
      float* dw[n];
      float* db[n];
      [&]<std::size_t... L>(std::index_sequence<L...>) {
        ((dw[L] = grads_.data() + Net::stage_plan[Gr::first + L].weight,
          db[L] = grads_.data() + Net::stage_plan[Gr::first + L].bias),
         ...);
      }(std::make_index_sequence<n>{});
      kernels::cuda::mlp_backward<Spec>(space_, args, dw, db, scratch_.data());
      current = 1 - current;
      [&]<std::size_t... L>(std::index_sequence<L...>) {
        (on_stage_done(Gr::last - L), ...);
      }(std::make_index_sequence<n>{});
    }
  }

  space_type space_;
  std::uint64_t seed_;
  buffer<T> params_;
  buffer<T> grads_;
  buffer<T> state_;
  buffer<T> workspace_;
  buffer<float> scratch_;
  buffer<float> loss_;
  buffer<int> status_;
  buffer<unsigned char> op_slot_;
  buffer<T> inputs_;
  buffer<unsigned char> targets_;
  PinnedBuffer<T> pinned_inputs_;
  PinnedBuffer<unsigned char> pinned_targets_;
  PinnedBuffer<T> outputs_host_;
  PinnedBuffer<float> loss_host_;
  PinnedBuffer<int> status_host_;
  std::unique_ptr<CUevent_st, detail::EventDeleter> staged_;
  std::array<CachedGraph, 2> graphs_cache_{};
  std::uint64_t graph_clock_ = 0;
  bool graphs_ = graph_safe;
  bool replayed_ = false;
  std::string graph_failure_;
  std::size_t capacity_ = 0;
  const char* state_owner_ = nullptr;
  std::uint64_t optimizer_steps_ = 0;
  std::uint64_t steps_ = 0;
  std::uint64_t skipped_steps_ = 0;
  kernels::cuda::GradientStatsBuffer stats_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
