#pragma once
// CostModel<Net, T>: what a network costs, from its type alone, before anything runs.
//
//   per stage   the FLOPs of forward and of backward for one sample (2 x the multiply-adds of its GEMM:
//               weights x output pixels for Conv2d and Linear; backward is the input gradient, which
//               the first stage does not compute, plus the weight gradient), the parameters it holds,
//               and the bytes its forward reads and writes per sample
//   per sample  the model FLOPs of a training step, the activation memory, the workspace
//   per step    the memory of Model<Net, Host, T> at batch B (parameters, gradients, optimizer state,
//               workspace with every thread's scratch, a DataLoader's slots), exactly what it
//               allocates (tests/net/cost.cpp holds it to the buffers' sizes), and the largest batch
//               that fits a memory budget
//
// Model FLOPs count the GEMMs only, as utilization figures do (PaLM's MFU): pooling, activations and
// the loss are memory-bound and are counted in bytes, not FLOPs.
#include "fusedp/core/config.hpp"
#include "fusedp/layers/layer.hpp"
#include "fusedp/net/sequential.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace fusedp {

/// What one stage of the fusion plan costs for one sample.
struct StageCost {
  std::size_t first_layer;     // index of its anchor layer in the network (as errors name layers)
  const char* name;            // the anchor layer's name ("Conv2d", "Linear", "MaxPool2d", ...)
  double forward_flops;        // 2 x multiply-adds of the forward GEMM (0 without parameters)
  double backward_flops;       // the input gradient (none for the first stage) and the weight gradient
  std::size_t parameters;      // parameter values the stage holds (weights and biases)
  std::size_t bytes_read;      // forward: the input activation, per sample
  std::size_t bytes_written;   // forward: the output and the saved pre-activation, per sample
};

/// Memory of one replica, in bytes.
struct MemoryUse {
  std::size_t parameters = 0;
  std::size_t gradients = 0;
  std::size_t optimizer_state = 0;
  std::size_t state = 0;      // the state buffer: BatchNorm's running and batch statistics
  std::size_t workspace = 0;  // activations, gradient buffers, saved values, scratch
  std::size_t loader = 0;     // the data loader's batch slots
  [[nodiscard]] constexpr std::size_t total() const {
    return parameters + gradients + optimizer_state + state + workspace + loader;
  }
};

/// The compile-time cost of network Net with scalars of type T.
/// @tparam Net a Sequential<...>
/// @tparam T the scalar type of activations and parameters
template <Network Net, class T = float>
struct CostModel {
 private:
  template <std::size_t I>
  static constexpr StageCost stage_cost() {
    using S = typename Net::template stage<I>;
    StageCost c{S::first, S::layer::name, 0, 0, 0, 0, 0};
    if constexpr (S::kind != LayerKind::reshape) {
      c.bytes_read = S::in::size * sizeof(T);
      c.bytes_written = (S::out::size + (Net::stage_plan[I].saves_z ? S::out::size : 0)) * sizeof(T);
    }
    if constexpr (S::has_params) {
      constexpr auto params = S::bound::params;
      for (const ParamSpec& p : params) c.parameters += p.size;
      // Each weight meets each output pixel once: Conv2d's OIHW weights slide over OH x OW, Linear's
      // (Out, In) weights over one (layers/layer.hpp, forward_macs_of; BatchNorm counts none).
      const double macs = forward_macs_of<typename S::layer, typename S::in>();
      c.forward_flops = 2 * macs;
      c.backward_flops = (I > 0 ? 2 * macs : 0.0) + 2 * macs;
    }
    return c;
  }
  template <std::size_t... I>
  static constexpr std::array<StageCost, sizeof...(I)> all_stages(std::index_sequence<I...>) {
    return {stage_cost<I>()...};
  }

 public:
  /// Every stage's cost, in the order of Net::stage_plan.
  static constexpr std::array<StageCost, Net::stage_count> stages =
      all_stages(std::make_index_sequence<Net::stage_count>{});

  /// Model FLOPs of one sample: forward, backward, and a whole training step.
  static constexpr double forward_flops = [] {
    double f = 0;
    for (const StageCost& s : stages) f += s.forward_flops;
    return f;
  }();
  static constexpr double backward_flops = [] {
    double f = 0;
    for (const StageCost& s : stages) f += s.backward_flops;
    return f;
  }();
  static constexpr double train_flops = forward_flops + backward_flops;

  /// The flat parameter buffer (padding between tensors included); the gradient buffer is its twin.
  static constexpr std::size_t parameter_bytes = Net::param_storage * sizeof(T);
  /// Forward activations a training step keeps for backward, per sample.
  static constexpr std::size_t activation_bytes = Net::activation_elements * sizeof(T);
  /// The whole per-sample workspace: activations and the two gradient buffers backward alternates between.
  static constexpr std::size_t workspace_bytes_per_sample = Net::workspace_elements_per_sample * sizeof(T);
  /// One thread's Host scratch (the largest any stage needs).
  static constexpr std::size_t host_scratch_bytes_per_thread = Net::host_scratch_elements * sizeof(T);
  /// One sample as a DataLoader slot holds it: the input and a class label (int32) or `targets` values.
  static constexpr std::size_t loader_bytes_per_sample(std::size_t targets = 0) {
    return Net::input_shape::size * sizeof(float) + (targets == 0 ? sizeof(std::int32_t) : targets * sizeof(float));
  }

  /// What Model<Net, Host, T> allocates for batches of `batch` samples with `threads` Host threads and
  /// an optimizer of `state_slots` slots (Sgd with momentum 1, Adam 2), and a DataLoader with
  /// `loader_slots` batch slots (its prefetch + 1; 0: no loader).
  static constexpr MemoryUse host_memory(std::size_t batch, std::size_t threads, std::size_t state_slots,
                                         std::size_t loader_slots = 0) {
    MemoryUse m;
    m.parameters = parameter_bytes;
    m.gradients = parameter_bytes;
    m.optimizer_state = state_slots * parameter_bytes;
    m.state = Net::state_storage * sizeof(T);
    m.workspace = batch * workspace_bytes_per_sample + threads * host_scratch_bytes_per_thread;
    m.loader = loader_slots * batch * loader_bytes_per_sample();
    return m;
  }

  /// The largest batch whose host_memory fits `budget_bytes` (0 when not even one sample fits).
  static constexpr std::size_t largest_host_batch(std::size_t budget_bytes, std::size_t threads,
                                                  std::size_t state_slots, std::size_t loader_slots = 0) {
    const MemoryUse fixed = host_memory(0, threads, state_slots, loader_slots);
    if (fixed.total() >= budget_bytes) return 0;
    const std::size_t per_sample = workspace_bytes_per_sample + loader_slots * loader_bytes_per_sample();
    return (budget_bytes - fixed.total()) / per_sample;
  }
};

}  // namespace fusedp
