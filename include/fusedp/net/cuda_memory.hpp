#pragma once
// CudaMemory<Net, P>: the device memory of Model<Net, CudaSpace<P>> at a batch size, from the type, the
// batch and the device's SM count, before anything is allocated; and the largest batch that fits a
// budget. The Cuda counterpart of CostModel::host_memory and largest_host_batch (net/cost.hpp).
//
// What a model holds once a training step (or reserve) has run at batch B, the largest it has run, by
// MemoryUse's parts:
//   parameters, gradients   the flat buffers, Net::param_storage floats each
//   optimizer_state         state_slots x param_storage floats (allocated by the first step)
//   state                   the state buffer (BatchNorm's statistics), Net::state_storage floats
//   workspace               B x CudaWorkspace<Net, P>::workspace_elements_per_sample floats (every stage's
//                           output, saved values and the gradient buffers backward alternates between;
//                           net/cuda_plan.hpp says where they lie), the fused MLP
//                           groups' dz (B x CudaPlan::mlp_gradient_elements), the backward scratch (split
//                           GEMMs' partial sums, and a conv's dense dz where its backward forms one:
//                           Conv2d::forms_dense_dz; the most any stage asks for at any batch up to B on
//                           this SM count, rounded to 256 bytes; twice that with backward branches) and,
//                           with branches, a third
//                           gradient buffer (B x CudaWorkspace::gradient_elements) and the side stream's 64 KiB of
//                           split-K arrival counters (which stay once made, when branches are turned off)
//   staging                 a batch of inputs and targets copied from the host (B x input floats, B x
//                           max(4, 4 x outputs) target bytes), the loss's block sums and flags, the
//                           optimizer's step slot, where the parameters lie (CudaPlan::rest_runs and
//                           Net::weight_runs) and, with a guarded optimizer, the gradient statistics
//   loader                  with a DeviceLoader of batch B (at most the dataset's size) on the same
//                           device: its two device slots
//   pinned_host             the page-locked host end of the staging (not device memory)
// Model::memory_use() reports the same parts from the buffers it holds; tests/gpu/memory.cu holds the
// two to each other on a device.
//
// Under Parallel<Net, Cuda> each replica is such a model; what the reducer holds beside them (its bucket
// and communication buffers, NCCL's own) is not counted here.
//
// Not counted: the CUDA context (hundreds of MiB, already gone from CudaSpace::memory().free once the
// space exists), the space's 64 KiB of split-K arrival counters (likewise), the recorded step graphs,
// and what cudaMalloc rounds each allocation up to (a large allocation takes whole 2 MiB pages). Leave a
// margin for them: largest_batch(space.memory().free / 10 * 9, ...) for a model not built yet, or
// (model.memory_use().total() + free) / 10 * 9 for one that holds memory already, is a reasonable start.
// A model that evaluates or predicts a batch larger than it trains on grows to it, and then holds use() at
// that batch (with the training options: once it has trained, its branch memory grows with it).
// A reserve that ran out of memory may leave the scratch, the branch memory and the staging at the size
// it asked for (never smaller than what the model runs), until the model next grows or shrinks them.
// largest_batch scans the batches up to its answer: a few integer operations per stage and batch
// (measured at -O2: LeNet on 140 GiB, 621,378 samples, 20 ms; an 8-16-4 MLP, 134 million, 0.7 s).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/gradient.cuh"
#include "fusedp/kernels/cuda/loss.cuh"
#include "fusedp/net/cost.hpp"
#include "fusedp/net/cuda_groups.hpp"
#include "fusedp/net/cuda_plan.hpp"
#include "fusedp/net/sequential.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace fusedp {

/// How a Cuda model is used, as far as its memory depends on it (CudaMemory).
struct CudaMemoryOptions {
  std::size_t state_slots = 1;  ///< the optimizer's state slots (Opt::state_slots): Sgd 1, Adam/AdamW 2; 0 before a step
  bool training = true;         ///< training steps or reserve(); false: predict and evaluate alone
  bool branches = true;         ///< Model::use_backward_branches (on by default)
  bool guarded = false;         ///< a guarded optimizer (or gradient_stats()): the statistics buffers
  bool device_loader = false;   ///< a DeviceLoader of the same batch on the same device: its two slots
  std::size_t targets = 0;      ///< the loader's targets a sample: 0 for class labels, else regression floats
};

/// The device memory of Model<Net, CudaSpace<P>> (this header's top says what is counted).
/// @tparam Net a Sequential<...>
/// @tparam P the precision policy (precision::Tf32, Fp32 or Bf16): it decides the fused groups
template <Network Net, class P = precision::Tf32>
struct CudaMemory {
  using plan = CudaPlan<Net, P>;
  using groups = CudaGroups<Net, P>;

  /// The optimizer's step slot (Model writes each step's numbers there; a graph reads them).
  static constexpr std::size_t step_slot_bytes = 256;
  /// Target bytes a sample in the staging: a class label (int32) or one float per output.
  static constexpr std::size_t target_bytes =
      std::max(Net::output_shape::size * sizeof(float), sizeof(std::int32_t));
  /// The side stream's own split-K arrival counters (backward branches).
  static constexpr std::size_t side_stream_bytes = CudaSpace<>::arrival_counter_count * sizeof(unsigned);
  /// The largest batch a model takes: its indices stay below 2^31 in every tensor.
  static constexpr std::size_t batch_limit =
      ((std::size_t(1) << 31) - 1) / std::max(Net::gradient_elements, Net::input_shape::size);

  /// Floats of one half of the scratch that serve every batch up to `batch` on `sm_count` SMs: the most
  /// any stage asks for, rounded up to 256 bytes so that the second half (backward branches) is as
  /// aligned as the first.
  static std::size_t scratch_stride(int sm_count, std::size_t batch) {
    return round_up(groups::scratch_elements(sm_count, batch));
  }
  /// Whether backward of this model keeps the branch memory (a third gradient buffer and a second
  /// scratch half) when used so.
  static constexpr bool keeps_branch_memory(const CudaMemoryOptions& o) noexcept {
    return o.training && o.branches && groups::branches;
  }

  /// What a model on a device of `sm_count` SMs holds once it has run at `batch` samples (used as `o`
  /// says), in bytes by part; exactly the sizes of the buffers Model::memory_use() counts. Batch 0: a
  /// model that has not run yet (its parameters, gradients, state and fixed buffers).
  static MemoryUse use(std::size_t batch, int sm_count, const CudaMemoryOptions& o = {}) {
    return use_with_scratch(batch, batch == 0 ? 0 : scratch_stride(sm_count, batch), o);
  }

  /// The largest batch whose use() fits `budget_bytes` on a device of `sm_count` SMs, at most
  /// batch_limit (0 when not even one sample fits).
  static std::size_t largest_batch(std::size_t budget_bytes, int sm_count, const CudaMemoryOptions& o = {}) {
    std::size_t scratch = 0;  // the scratch need at every batch so far: scratch_stride without its rescan
    for (std::size_t b = 1; b <= batch_limit; ++b) {
      scratch = std::max(scratch, groups::scratch_elements_at(sm_count, b));
      if (use_with_scratch(b, round_up(scratch), o).total() > budget_bytes) return b - 1;
    }
    return batch_limit;
  }

 private:
  static constexpr std::size_t round_up(std::size_t floats) noexcept { return (floats + 63) / 64 * 64; }

  static MemoryUse use_with_scratch(std::size_t batch, std::size_t stride, const CudaMemoryOptions& o) {
    constexpr std::size_t f = sizeof(float), runs = sizeof(std::size_t);
    constexpr std::size_t in = Net::input_shape::size, out = Net::output_shape::size;
    const bool branch = keeps_branch_memory(o);
    MemoryUse m;
    m.parameters = Net::param_storage * f;
    m.gradients = Net::param_storage * f;
    m.optimizer_state = o.state_slots * Net::param_storage * f;
    m.state = Net::state_storage * f;
    m.workspace = (batch * (CudaWorkspace<Net, P>::workspace_elements_per_sample + plan::mlp_gradient_elements) +
                   (branch ? 2 : 1) * stride + (branch ? batch * CudaWorkspace<Net, P>::gradient_elements : 0)) *
                  f;
    if (branch && batch > 0) m.workspace += side_stream_bytes;
    // The loss's flag, the step slot and the parameter runs exist from the start; the rest from the
    // first batch on.
    m.staging = sizeof(int) + step_slot_bytes + (plan::rest_runs.size() + Net::weight_runs.size()) * runs;
    m.pinned_host = f + sizeof(int);
    if (batch > 0) {
      m.staging += batch * (in * f + target_bytes) + (1 + std::size_t(kernels::cuda::loss_blocks(batch))) * f +
                   sizeof(unsigned);
      m.pinned_host += batch * (in * f + target_bytes + out * f);
    }
    if (o.guarded) {
      using Stats = kernels::cuda::DeviceGradientStats;
      m.staging += (std::size_t(kernels::cuda::detail::stats_blocks) + 1) * sizeof(Stats);
      m.pinned_host += sizeof(Stats);
    }
    if (o.device_loader) m.loader = 2 * batch * (in + (o.targets == 0 ? 1 : o.targets)) * f;
    return m;
  }
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
