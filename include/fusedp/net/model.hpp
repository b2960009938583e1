#pragma once
// Model<Net, Space, T>: one replica of a network on one execution space. Owns the flat parameter
// buffer, its gradient twin, the optimizer state and the workspace; runs the stages of the fusion plan
// forward and backward. After the first step at a batch size, a step allocates nothing.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/layers/activation.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/kernels/host/gradient.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
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
  explicit Model(Seed seed = {}, Space space = Space{})
      : space_(std::move(space)), seed_(seed.value), params_(Net::param_storage), grads_(Net::param_storage) {
    reset_parameters();
  }
  explicit Model(Space space, Seed seed = {}) : Model(seed, std::move(space)) {}

  /// Draws every weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as PyTorch's Conv2d and
  /// Linear do by default. Element e of tensor t is a pure function of (seed, t, e).
  void reset_parameters() {
    for (std::size_t t = 0; t < Net::param_layout.size(); ++t) {
      const ParamTensor& p = Net::param_layout[t];
      const double bound = 1.0 / std::sqrt(double(p.fan_in));
      const std::uint64_t stream = rng::stream(rng::Purpose::init, t);
      for (std::size_t e = 0; e < p.size; ++e)
        params_[p.offset + e] = T((2.0 * rng::uniform(seed_, stream, e) - 1.0) * bound);
    }
  }

  /// One training step: forward, loss, backward and the optimizer update. Returns the batch's loss.
  /// The batch size is inputs.size() / input_size. Bad input throws before anything changes.
  template <class Loss, class Opt>
  T train_step(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
               const Loss& loss, Opt& opt) {
    opt.validate();
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
    if constexpr (requires { typename Opt::on_nonfinite; }) {
      const double factor = opt.decide(kernels::host::gradient_stats(space_, grads_.data(), Net::param_storage), steps_ + 1,
                                       first_nonfinite_tensor());
      if (factor == 0.0) {
        ++steps_;
        ++skipped_steps_;
        return false;
      }
      if (factor != 1.0) kernels::host::scale_gradient(space_, grads_.data(), Net::param_storage, T(factor));
    }
    std::span<T> state = optimizer_state<Opt>();
    ++optimizer_steps_;
    opt.step(space_, params_.data(), grads_.data(), state.data(), Net::param_storage, optimizer_steps_);
    ++steps_;
    return true;
  }

  /// The PyTorch name and layer of the first parameter tensor (in layer order) whose gradient holds a
  /// NaN or an infinity, or "no tensor" when all are finite.
  [[nodiscard]] std::string first_nonfinite_tensor() const {
    for (const ParamTensor& t : Net::param_layout)
      for (std::size_t i = 0; i < t.size; ++i)
        if (!std::isfinite(grads_[t.offset + i]))
          return param_tensor_label(t);
    return "no tensor";
  }

  /// The state of optimizer Opt (Opt::state_slots x param_storage values). Allocated, zeroed, the first
  /// time an optimizer of this type is used; a different optimizer type starts from fresh state.
  template <class Opt>
  std::span<T> optimizer_state() {
    if (state_owner_ == nullptr || std::strcmp(state_owner_, Opt::name) != 0) {
      state_ = buffer<T>(Opt::state_slots * Net::param_storage);
      state_owner_ = Opt::name;
      optimizer_steps_ = 0;
    }
    return state_.span();
  }

  /// Forward in training mode, the loss and backward: grads() then holds the gradient of the mean
  /// loss. Parameters are not changed. `on_stage_done(i)` is called as soon as backward has finished
  /// stage i (stages finish in reverse order), so a data-parallel reducer can start on the gradients
  /// of that stage while backward continues. With `normalizer` N (0: the batch size), the gradient is
  /// that of the loss summed over this batch and divided by N: the share of this shard in the mean
  /// over a global batch of N samples, so that shards' gradients simply add up. Returns this
  /// batch's mean loss in every case.
  template <class Loss, class StageDone = NoStageHook>
  T compute_gradients(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                      const Loss& loss, StageDone&& on_stage_done = {}, std::size_t normalizer = 0) {
    const std::size_t batch = batch_of(inputs);
    Loss::validate(targets, batch, output_size);
    forward_pass(inputs.data(), batch, true);
    T* dlogits = gradient_buffer(0, batch);
    const T l = loss(space_, batch, output_size, output_of<Net::stage_count - 1>(inputs.data(), batch),
                     targets.data(), dlogits);
    if (normalizer != 0 && normalizer != batch) {
      const T share = T(batch) / T(normalizer);
      for (std::size_t i = 0; i < batch * output_size; ++i) dlogits[i] *= share;
    }
    backward_pass(inputs.data(), batch, on_stage_done);
    return l;
  }

  /// Outputs (batch, output_size) in evaluation mode (dropout off). The view stays valid until the
  /// next call on this model.
  std::span<const T> predict(std::span<const T> inputs) {
    const std::size_t batch = batch_of(inputs);
    forward_pass(inputs.data(), batch, false);
    return {output_of<Net::stage_count - 1>(inputs.data(), batch), batch * output_size};
  }

  /// The loss of a batch in evaluation mode, without gradients, and the outputs it came from (valid
  /// until the next call on this model).
  template <class Loss>
  Evaluation<T> evaluate(std::span<const T> inputs, std::span<const typename Loss::template target<T>> targets,
                         const Loss& loss) {
    const std::size_t batch = batch_of(inputs);
    Loss::validate(targets, batch, output_size);
    const std::span<const T> out = predict(inputs);
    return {loss(space_, batch, output_size, out.data(), targets.data(), static_cast<T*>(nullptr)), out};
  }

  /// Allocates the workspace for batches up to `batch`, so that no later step allocates.
  void reserve(std::size_t batch) {
    if (batch <= capacity_) return;
    workspace_ = buffer<T>(batch * Net::workspace_elements_per_sample +
                           std::size_t(threads()) * Net::host_scratch_elements);
    capacity_ = batch;
  }

  /// The flat parameter buffer (padding between tensors included; see Net::param_layout).
  [[nodiscard]] std::span<T> params() noexcept { return params_.span(); }
  [[nodiscard]] std::span<const T> params() const noexcept { return params_.span(); }
  /// The gradient twin of params(), set by the last compute_gradients or train_step.
  [[nodiscard]] std::span<T> grads() noexcept { return grads_.span(); }
  [[nodiscard]] std::span<const T> grads() const noexcept { return grads_.span(); }
  /// Parameter tensor `i` of Net::param_layout.
  [[nodiscard]] std::span<T> param(std::size_t i) {
    require(i < Net::param_layout.size(), "Model::param: tensor ", i, " of ", Net::param_layout.size());
    return params_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }
  [[nodiscard]] std::span<const T> grad(std::size_t i) const {
    require(i < Net::param_layout.size(), "Model::grad: tensor ", i, " of ", Net::param_layout.size());
    return grads_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }
  /// Optimizer state (state_slots x param_storage values), empty before the first train_step.
  [[nodiscard]] std::span<const T> optimizer_state() const noexcept { return state_.span(); }
  /// Name of the optimizer that owns the state (nullptr before the first step).
  [[nodiscard]] const char* optimizer_name() const noexcept { return state_owner_; }

  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  /// Train steps taken so far (the step number also selects the dropout masks).
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }
  /// Steps the current optimizer state has taken (Adam's bias correction counts them).
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return optimizer_steps_; }
  /// Steps a guarded optimizer skipped (nonfinite::Skip).
  [[nodiscard]] std::uint64_t skipped_steps() const noexcept { return skipped_steps_; }
  /// Restores the counters of a saved run (checkpoints): the next step is number `steps` + 1.
  void set_step_counters(std::uint64_t steps, std::uint64_t optimizer_steps) noexcept {
    steps_ = steps;
    optimizer_steps_ = optimizer_steps;
  }
  [[nodiscard]] const Space& space() const noexcept { return space_; }

 private:
  int threads() const {
    if constexpr (requires { space_.threads(); }) return space_.threads();
    else return 1;
  }

  std::size_t batch_of(std::span<const T> inputs) const {
    require(!inputs.empty() && inputs.size() % input_size == 0, "Model: ", inputs.size(),
            " input values are not a whole number of samples of ", input_size, " values (",
            Net::input_shape::channels, "x", Net::input_shape::height, "x", Net::input_shape::width, ")");
    return inputs.size() / input_size;
  }

  T* gradient_buffer(int which, std::size_t batch) {
    return workspace_.data() + batch * (Net::activation_elements + std::size_t(which) * Net::gradient_elements);
  }
  T* scratch() { return workspace_.data() + capacity_ * Net::workspace_elements_per_sample; }

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

  template <std::size_t I>
  StageArgs<Space, T> args_of(const T* x, std::size_t batch, bool training) {
    constexpr StagePlan p = Net::stage_plan[I];
    using S = typename Net::template stage<I>;
    return StageArgs<Space, T>{space_,
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
                               scratch(),
                               training,
                               seed_,
                               steps_,
                               S::first};
  }

  template <class S>
  using executor = std::conditional_t<S::kind == LayerKind::pointwise, PointwiseStage, typename S::layer>;

  void forward_pass(const T* x, std::size_t batch, bool training) {
    reserve(batch);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (forward_stage<I>(x, batch, training), ...);
    }(std::make_index_sequence<Net::stage_count>{});
  }
  template <std::size_t I>
  void forward_stage(const T* x, std::size_t batch, bool training) {
    using S = typename Net::template stage<I>;
    if constexpr (S::kind != LayerKind::reshape)
      executor<S>::template forward<typename S::in, typename S::epilogue>(args_of<I>(x, batch, training));
  }

  // Stages run in reverse; the gradient alternates between two buffers (a reshape keeps it in place).
  template <class StageDone>
  void backward_pass(const T* x, std::size_t batch, StageDone& on_stage_done) {
    int current = 0;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (backward_stage<Net::stage_count - 1 - I>(x, batch, current, on_stage_done), ...);
    }(std::make_index_sequence<Net::stage_count>{});
  }
  template <std::size_t I, class StageDone>
  void backward_stage(const T* x, std::size_t batch, int& current, StageDone& on_stage_done) {
    using S = typename Net::template stage<I>;
    if constexpr (S::kind != LayerKind::reshape && (I > 0 || S::has_params)) {
      StageArgs<Space, T> a = args_of<I>(x, batch, true);
      a.dy = gradient_buffer(current, batch);
      a.dx = I > 0 ? gradient_buffer(1 - current, batch) : nullptr;
      executor<S>::template backward<typename S::in, typename S::epilogue>(a);
      current = 1 - current;
    }
    on_stage_done(I);
  }

  Space space_;
  std::uint64_t seed_;
  buffer<T> params_;
  buffer<T> grads_;
  buffer<T> state_;
  buffer<T> workspace_;
  std::size_t capacity_ = 0;
  const char* state_owner_ = nullptr;
  std::uint64_t optimizer_steps_ = 0;
  std::uint64_t steps_ = 0;
  std::uint64_t skipped_steps_ = 0;
};

}  // namespace fusedp

// Model<Net, CudaSpace<P>, float>: the device specialization (compiled by nvcc only).
#include "fusedp/net/cuda_model.hpp"
