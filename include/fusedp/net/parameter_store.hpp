#pragma once
// ParameterStore<Net, Space, T>: what a model owns of its network's parameters on one space. The flat
// parameter buffer (Net::param_layout), its gradient twin, the optimizer's state, and the counters of
// the run (steps, optimizer steps, skipped steps), with the one way a step is applied or skipped. Held
// by both Model<Net, Host> and Model<Net, Cuda>; only where the memory lives differs (host memory, or
// device memory of a CudaSpace).
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/gradient.hpp"
#include "fusedp/kernels/optimizer.hpp"
#include "fusedp/net/sequential.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/gradient.cuh"
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

namespace fusedp {

namespace detail {
// The few operations on a space's memory that the store needs; everything else is the same code.
template <class Space, class T>
void copy_to_space(const Space& space, T* dst, const T* src, std::size_t n) {
  if constexpr (std::is_same_v<Space, Host>) {
    (void)space;
    std::copy(src, src + n, dst);
  }
#if FUSEDP_HAS_CUDA
  else {
    copy_async(dst, src, n, space.stream());
    space.synchronize();
  }
#endif
}
template <class Space, class T>
void scale_in_space(const Space& space, T* g, std::size_t n, T factor) {
  if constexpr (std::is_same_v<Space, Host>) kernels::host::scale_gradient(space, g, n, factor);
#if FUSEDP_HAS_CUDA
  else kernels::cuda::scale_gradient(space.stream(), g, n, factor);
#endif
}
// Waits for work queued on the space (nothing to wait for on Host: its calls return when done).
template <class Space>
void wait_for_space(const Space& space) {
  if constexpr (!std::is_same_v<Space, Host>) space.synchronize();
  else (void)space;
}
}  // namespace detail

/// The parameters, gradients, optimizer state and step counters of one replica of Net on Space.
/// @tparam Net a Sequential<...>
/// @tparam Space the execution space whose memory holds the buffers (Host, or a CudaSpace)
/// @tparam T the scalar type
template <Network Net, class Space, class T>
class ParameterStore {
 public:
  template <class U>
  using buffer = typename Space::template buffer<U>;

  /// Buffers on `space` (on Cuda its device must be the current one), parameters drawn from `seed`.
  ParameterStore(const Space& space, std::uint64_t seed)
      : seed_(seed),
        params_(Net::param_storage),
        grads_(Net::param_storage),
        buffers_(Net::state_storage),
        weight_runs_(Net::weight_runs.size()) {
    reset_parameters(space);
    reset_buffers(space);
    if constexpr (Net::weight_runs.size() > 0)
      detail::copy_to_space(space, weight_runs_.data(), Net::weight_runs.data(), Net::weight_runs.size());
  }

  /// Where the network's GEMM weights lie (Net::weight_runs), in this space's memory, for an
  /// optimizer's Decay::weights; `offset`: the first element of the part being updated (ZeRO-1).
  [[nodiscard]] kernels::DecayRuns decay_runs(std::size_t offset = 0) const noexcept {
    return {weight_runs_.data(), Net::weight_run_count, offset, true};
  }

  /// Draws every weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as PyTorch's Conv2d and
  /// Linear do by default. Element e of tensor t is a pure function of (seed, t, e), drawn on the host
  /// in double on every space, so models of one seed start identical on Host and Cuda.
  void reset_parameters(const Space& space) {
    HostBuffer<T> host(Net::param_storage);
    for (std::size_t t = 0; t < Net::param_layout.size(); ++t) {
      const ParamTensor& p = Net::param_layout[t];
      if (p.constant) {
        std::fill_n(host.data() + p.offset, p.size, T(p.fill));
        continue;
      }
      const double bound = 1.0 / std::sqrt(double(p.fan_in));
      const std::uint64_t stream = rng::stream(rng::Purpose::init, t);
      for (std::size_t e = 0; e < p.size; ++e)
        host[p.offset + e] = T((2.0 * rng::uniform(seed_, stream, e) - 1.0) * bound);
    }
    load_params(space, host.span());
  }

  /// Replaces the parameters with param_storage values from host memory.
  void load_params(const Space& space, std::span<const T> values) {
    require(values.size() == Net::param_storage, "Model::load_params: ", values.size(), " values for ",
            Net::param_storage, " parameters");
    detail::copy_to_space(space, params_.data(), values.data(), values.size());
  }

  /// Sets every tensor of the state buffer to its starting value (running mean 0, running variance
  /// 1, batches tracked 0), as a freshly built PyTorch module has them.
  void reset_buffers(const Space& space) {
    if constexpr (Net::state_storage > 0) {
      HostBuffer<T> host(Net::state_storage);
      std::fill_n(host.data(), Net::state_storage, T(0));
      for (const StateTensor& s : Net::state_layout) std::fill_n(host.data() + s.offset, s.size, T(s.fill));
      load_buffers(space, host.span());
    }
  }
  /// Replaces the state buffer with state_storage values from host memory.
  void load_buffers(const Space& space, std::span<const T> values) {
    require(values.size() == Net::state_storage, "Model::load_buffers: ", values.size(), " values for ",
            Net::state_storage, " state elements");
    if (!values.empty()) detail::copy_to_space(space, buffers_.data(), values.data(), values.size());
  }
  /// The state buffer: non-trainable tensors such as BatchNorm's running statistics
  /// (Net::state_layout); empty for a network without any.
  [[nodiscard]] std::span<T> buffers() noexcept { return buffers_.span(); }
  [[nodiscard]] std::span<const T> buffers() const noexcept { return buffers_.span(); }

  /// The flat parameter buffer (padding between tensors included; see Net::param_layout).
  [[nodiscard]] std::span<T> params() noexcept { return params_.span(); }
  [[nodiscard]] std::span<const T> params() const noexcept { return params_.span(); }
  /// The gradient twin of params().
  [[nodiscard]] std::span<T> grads() noexcept { return grads_.span(); }
  [[nodiscard]] std::span<const T> grads() const noexcept { return grads_.span(); }
  /// Parameter tensor `i` of Net::param_layout, and its gradient.
  [[nodiscard]] std::span<T> param(std::size_t i) {
    require(i < Net::param_layout.size(), "Model::param: tensor ", i, " of ", Net::param_layout.size());
    return params_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }
  [[nodiscard]] std::span<const T> grad(std::size_t i) const {
    require(i < Net::param_layout.size(), "Model::grad: tensor ", i, " of ", Net::param_layout.size());
    return grads_.span().subspan(Net::param_layout[i].offset, Net::param_layout[i].size);
  }

  /// The state of optimizer Opt (Opt::state_slots x param_storage values). Allocated, zeroed, the first
  /// time an optimizer of this type is used; a different optimizer type starts from fresh state.
  template <class Opt>
  std::span<T> optimizer_state(const Space& space) {
    if (state_owner_ == nullptr || std::strcmp(state_owner_, Opt::name) != 0) {
      detail::wait_for_space(space);  // nothing in flight may use the state that is freed
      state_ = buffer<T>(Opt::state_slots * Net::param_storage);
      state_owner_ = Opt::name;
      optimizer_steps_ = 0;
    } else if (state_.size() != Opt::state_slots * Net::param_storage) {
      state_ = buffer<T>(Opt::state_slots * Net::param_storage);  // adopted without state (ZeRO-1)
    }
    return state_.span();
  }
  /// Makes Opt the optimizer of these parameters while its state lives elsewhere (ZeRO-1 keeps the
  /// state of one block in Parallel): a new optimizer type frees the state held here and restarts the
  /// count of optimizer steps. Returns whether the optimizer changed.
  template <class Opt>
  bool adopt_optimizer(const Space& space) {
    if (state_owner_ != nullptr && std::strcmp(state_owner_, Opt::name) == 0) return false;
    detail::wait_for_space(space);
    state_ = buffer<T>();
    state_owner_ = Opt::name;
    optimizer_steps_ = 0;
    return true;
  }
  /// Optimizer state (state_slots x param_storage values), empty before the first step.
  [[nodiscard]] std::span<const T> optimizer_state() const noexcept { return state_.span(); }
  /// Name of the optimizer that owns the state (nullptr before the first step).
  [[nodiscard]] const char* optimizer_name() const noexcept { return state_owner_; }
  /// Bytes of the copy of Net::weight_runs in this space's memory (decay_runs reads it).
  [[nodiscard]] std::size_t weight_run_bytes() const noexcept { return weight_runs_.size() * sizeof(std::size_t); }

  /// Applies a decision on the current gradient: factor 0 skips the update (counted in skipped_steps),
  /// else the gradient is scaled by `factor` (when not 1) and the optimizer runs. Counts the step either
  /// way; returns whether the update ran.
  template <class Opt>
  bool apply_step(const Space& space, const Opt& opt, double factor) {
    if (factor == 0.0) {
      count_step(false);
      return false;
    }
    if (factor != 1.0) detail::scale_in_space(space, grads_.data(), Net::param_storage, T(factor));
    std::span<T> state = optimizer_state<Opt>(space);
    opt.step(space, params_.data(), grads_.data(), state.data(), Net::param_storage, optimizer_steps_ + 1,
             decay_runs());
    count_step(true);
    return true;
  }

  /// Counts one step whose update ran (`updated`) or was skipped, for a step applied elsewhere (a
  /// data-parallel root, or ZeRO-1's sharded update). Returns the optimizer step number now reached.
  std::uint64_t count_step(bool updated) noexcept {
    ++steps_;
    if (updated) ++optimizer_steps_;
    else ++skipped_steps_;
    return optimizer_steps_;
  }

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

  /// The name and layer of the parameter tensor holding flat element `index` ("'3.weight' (layer 4)"),
  /// or "no tensor" (an index past every tensor, or padding).
  [[nodiscard]] static std::string tensor_holding(unsigned long long index) {
    for (const ParamTensor& t : Net::param_layout)
      if (index >= t.offset && index < t.offset + t.size) return param_tensor_label(t);
    return "no tensor";
  }

 private:
  std::uint64_t seed_;
  buffer<T> params_;
  buffer<T> grads_;
  buffer<T> buffers_;
  buffer<std::size_t> weight_runs_;  // Net::weight_runs
  buffer<T> state_;
  const char* state_owner_ = nullptr;
  std::uint64_t optimizer_steps_ = 0;
  std::uint64_t steps_ = 0;
  std::uint64_t skipped_steps_ = 0;
};

}  // namespace fusedp
