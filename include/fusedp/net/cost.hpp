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
//   per step    the fused minimum of a training step's memory traffic (step_traffic_floor): what a
//               step moves if every kernel reads what it needs and writes what it produces once, fused
//               at every boundary the design has (below)
//
// Model FLOPs count the GEMMs only, as utilization figures do (PaLM's MFU): pooling, activations and
// the loss are memory-bound and are counted in bytes, not FLOPs.
//
// The traffic floor (issue 17 measures a step's DRAM bytes against it). Nothing stays in a cache from
// one kernel to the next (a profiler's per-kernel bytes count the same way), and the step is fused at
// every boundary: a Conv2d or Linear runs with its bias and activation in its epilogue, and a
// MaxPool2d<K> with stride K after a conv whose activation needs only its output is fused into it (the
// pooled value and a 1-byte argmax saved; for every K, where the Cuda plan fuses K = 1, 2, 4 and 8:
// net/cuda_plan.hpp); each input-gradient GEMM writes the gradient of the stage
// below already masked by its activation (reading its saved output, or its saved pre-activation z) and at
// pooled size; the two GEMMs of a stage's backward (one for the first stage, which has no input
// gradient) each read that gradient (and the argmax); the optimizer runs inside the weight-gradient
// GEMMs. Parameters, gradients and optimizer state are fp32; the activations between stages take
// `activation_bytes` each (4, or 2 where they are stored in 16 bits); the input, the logits and a saved
// z stay fp32. Then, per step of B samples:
//   parameters   each value read by the forward GEMM and by the update, which also reads its state and
//                writes the value, its state and its gradient (the gradient is API after a step):
//                (4 + 2 x state slots) x 4 bytes; and every GEMM weight but the first stage's read again
//                by the input-gradient GEMM: 4 bytes
//   input        read by the first stage's forward and weight gradient: 2 x 4 bytes a value
//   activations  a tensor of n values between two stages: written, read by the next forward, read by the
//                next weight gradient, its gradient written, and read by the producer's r backward GEMMs
//                (r = 2, or 1 for the first stage): (4 + r) n a; plus the mask, n a where the activation
//                reads its output (none without an activation; a saved z is written and read, 8n); plus
//                the argmax after a pooling, written and read r times: (1 + r) n
//   logits       the last stage's n outputs, fp32: written, read by the loss, their gradient written and
//                read r times, (3 + r) 4n, with the mask as above
// The model covers networks of Conv2d and Linear stages with their activations, MaxPool2d<K> with
// stride K after a conv, and Flatten (LeNet, the CIFAR-10 CNN, MLPs): has_traffic_floor says whether Net
// is one, and traffic_unmodeled_layer names the first layer that is not. benchmarks/RESULTS.md
// (session 21) works the CIFAR-10 CNN and LeNet out by hand; tests/net/cost.cpp holds this to it.
#include "fusedp/core/config.hpp"
#include "fusedp/layers/conv2d.hpp"
#include "fusedp/layers/layer.hpp"
#include "fusedp/layers/linear.hpp"
#include "fusedp/layers/pooling.hpp"
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
  std::size_t staging = 0;    // Cuda: a batch's inputs and targets copied from the host, the loss and step
                              // buffers (net/cuda_memory.hpp); 0 on Host
  std::size_t reduction = 0;  // a Parallel<Net, Cuda> replica: the micro-batches' gradient sum and the
                              // channel's scratch (parallel/replica_memory.hpp); 0 for a model alone
  /// The memory of the space, in bytes. Page-locked host memory is not in it.
  [[nodiscard]] constexpr std::size_t total() const {
    return parameters + gradients + optimizer_state + state + workspace + loader + staging + reduction;
  }
  /// Cuda: page-locked host memory beside it (the host end of the staging), not in total().
  std::size_t pinned_host = 0;
};

/// The fused minimum of one training step's memory traffic, in bytes, by part (CostModel's header).
struct StepTraffic {
  std::size_t parameters = 0;   // parameters, their gradients and the optimizer's state
  std::size_t input = 0;        // the batch's input
  std::size_t activations = 0;  // the tensors between stages, their gradients, masks, argmax bytes
  std::size_t logits = 0;       // the last stage's output and its gradient
  [[nodiscard]] constexpr std::size_t total() const { return parameters + input + activations + logits; }
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

  // The traffic model's view of one stage, and of the units it groups them into (a GEMM stage, with the
  // max-pooling fused after a conv).
  struct TrafficStage {
    std::size_t layer;    // its anchor's index in the network
    bool reshape;         // Flatten
    bool gemm;            // Conv2d or Linear
    bool conv;
    bool square_max_pool;  // MaxPool2d<K> with stride K
    bool plain;           // no activation in its epilogue
    bool saves_z;         // its activation reads the pre-activation values
    std::size_t out;      // output values per sample
    std::size_t weights;  // values of its GEMM weight
  };
  template <std::size_t I>
  static constexpr TrafficStage traffic_stage() {
    using S = typename Net::template stage<I>;
    using L = typename S::layer;
    TrafficStage t{S::first, S::kind == LayerKind::reshape, false, detail::is_conv2d<L>::value,
                   detail::max_pool_window_of<L> != 0, S::epilogue::empty, S::epilogue::saves_input, S::out::size, 0};
    t.gemm = t.conv || detail::is_linear<L>::value;
    for (const ParamTensor& p : Net::param_layout)
      if (p.layer == S::first && p.gemm_weight()) t.weights += p.size;
    return t;
  }
  struct TrafficUnit {
    std::size_t out = 0;  // values per sample it hands on (pooled where pooled)
    bool pooled = false, plain = true, saves_z = false;
    std::size_t z = 0;    // saved pre-activation values per sample
  };
  struct TrafficPlan {
    std::array<TrafficUnit, Net::stage_count> units{};
    std::size_t count = 0;
    std::size_t unmodeled_layer = 0;  // 0: every stage is in the model
    std::size_t first_weights = 0;    // the first unit's GEMM weight values
    std::size_t weights = 0;          // every unit's
  };
  static constexpr TrafficPlan traffic_plan = []<std::size_t... I>(std::index_sequence<I...>) {
    const std::array<TrafficStage, sizeof...(I)> st{traffic_stage<I>()...};
    TrafficPlan p;
    bool after_conv = false;  // the stage before this one is a conv unit that a pooling may join
    for (const TrafficStage& t : st) {
      if (t.reshape) {
        after_conv = false;
        continue;
      }
      if (t.gemm) {
        TrafficUnit& u = p.units[p.count++];
        u = TrafficUnit{t.out, false, t.plain, t.saves_z, t.saves_z ? t.out : 0};
        (p.count == 1 ? p.first_weights : p.weights) += t.weights;
        after_conv = t.conv && !t.saves_z;
      } else if (t.square_max_pool && t.plain && after_conv) {
        TrafficUnit& u = p.units[p.count - 1];
        u.pooled = true;
        u.out = t.out;
        after_conv = false;
      } else {
        p.unmodeled_layer = t.layer;
        break;
      }
    }
    if (p.count == 0 && p.unmodeled_layer == 0) p.unmodeled_layer = st[0].layer;
    p.weights += p.first_weights;
    return p;
  }(std::make_index_sequence<Net::stage_count>{});

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

  /// Whether step_traffic_floor covers Net (Conv2d and Linear stages with their activations, MaxPool2d<K>
  /// with stride K after a conv, Flatten), and else the index of its first layer that it does not (the
  /// anchor of that stage; Input is layer 0).
  static constexpr bool has_traffic_floor = traffic_plan.unmodeled_layer == 0;
  static constexpr std::size_t traffic_unmodeled_layer = traffic_plan.unmodeled_layer;

  /// The fused minimum of the memory traffic of one training step of `batch` samples with an optimizer of
  /// `state_slots` slots (Sgd without momentum 0, with momentum 1, Adam 2) and activations stored in
  /// `activation_bytes` each (4; 2 where they are stored in 16 bits, as Cuda does under precision::Bf16),
  /// by part; the header says how it is counted. Only for a network has_traffic_floor covers.
  static constexpr StepTraffic step_traffic_floor(std::size_t batch, std::size_t state_slots,
                                                  std::size_t activation_bytes = 4) {
    static_assert(has_traffic_floor,
                  "CostModel::step_traffic_floor: the traffic model covers Conv2d and Linear stages with their "
                  "activations, MaxPool2d<K> with stride K after a conv, and Flatten; "
                  "CostModel<Net>::traffic_unmodeled_layer is the first layer of Net that it does not");
    constexpr std::size_t f = sizeof(float);
    const TrafficPlan& p = traffic_plan;
    StepTraffic t;
    t.parameters = Net::param_count * (4 + 2 * state_slots) * f + (p.weights - p.first_weights) * f;
    t.input = 2 * Net::input_shape::size * f * batch;
    for (std::size_t i = 0; i < p.count; ++i) {
      const TrafficUnit& u = p.units[i];
      const std::size_t r = i == 0 ? 1 : 2;               // the backward GEMMs that read its gradient
      const bool last = i + 1 == p.count;
      const std::size_t a = last ? f : activation_bytes;  // the logits stay fp32 for the loss
      std::size_t bytes = u.out * a * ((last ? 3 : 4) + r);
      if (u.saves_z) bytes += 2 * u.z * f;
      else if (!u.plain) bytes += u.out * a;
      if (u.pooled) bytes += (1 + r) * u.out;
      (last ? t.logits : t.activations) += bytes * batch;
    }
    return t;
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
