#pragma once
// One fused pass over the flat parameter buffer applying a per-element update shared with Host
// (kernels/optimizer.hpp: SgdStep, AdamStep). The update's scalars (learning rate, Adam's bias
// corrections, whether this is the first step) change every step, so a CUDA graph cannot bake them in
// as kernel arguments: the graph-safe form reads them from device memory, written by a one-thread
// kernel launched outside the graph before each replay. When the weight-gradient GEMMs apply the
// update to the weights (issue 17), apply_optimizer_rest updates what they left.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/optimizer.hpp"

#include <cstddef>
#include <type_traits>

namespace fusedp::kernels::cuda {

namespace detail {
template <class Op>
__global__ void set_value_kernel(Op* dst, Op value) {
  kernel_prologue();
  *dst = value;
}

// Slots: optimizer state values per parameter (1: Sgd's momentum; 2: Adam's moments, m then v,
// `stride` elements apart: n for a whole buffer, the whole buffer's size for a part of it).
// Under Decay::weights (op.decay_all false) each element finds whether it decays in the network's
// runs (a binary search over a few dozen bounds, in cache; the pass stays memory-bound).
template <int Slots, class Op, class T>
__global__ void optimizer_kernel(T* params, const T* grads, T* state, std::size_t n, std::size_t stride, Op by_value,
                                 const Op* from_device, DecayRuns runs) {
  kernel_prologue();
  const Op op = from_device ? *from_device : by_value;
  const Op plain = without_decay(op);
  for (std::size_t i = grid_index(); i < n; i += grid_stride()) {
    const Op& o = op.decay_all || runs.decays(i) ? op : plain;
    if constexpr (Slots == 1) o(params[i], grads[i], state[i]);
    else o(params[i], grads[i], state[i], state[stride + i]);
  }
}
// The pass over the parameters whose weight-gradient GEMMs did not apply the update (BatchNorm's, the
// layers' inside blocks): element j of `rest` is parameter rest.index(j), updated as optimizer_kernel
// would (the same operator() of the same step, decayed where `runs` say).
template <class T>
__global__ void optimizer_rest_kernel(UpdateTarget<T> whole, const T* grads, ElementRuns rest, DecayRuns runs) {
  kernel_prologue();
  const AnyStep<T> s = whole.load();
  const bool all = s.decays_all();
  const std::size_t n = rest.size();
  for (std::size_t j = grid_index(); j < n; j += grid_stride()) {
    const std::size_t i = rest.index(j);
    UpdateTarget<T> t = whole;
    t.decays = all || runs.decays(i);
    t.apply(s, i, grads[i]);
  }
}
}  // namespace detail

/// Copies `value` to device memory `dst` on `stream` (a kernel argument is copied at launch, so the
/// host value may change as soon as this returns).
template <class Op>
void set_value(cudaStream_t stream, Op* dst, const Op& value) {
  launch<detail::set_value_kernel<Op>>("set_value_kernel", 1, 1, 0, stream, dst, value);
}

/// Applies `op` to n parameters; `state` holds Slots slots of n values, `stride` apart (0: n; a part of
/// a larger buffer passes that buffer's size). When `from_device` is not null the op is read from there
/// (graph replays), else `op` is used.
template <int Slots, class Op, class T>
void apply_optimizer(cudaStream_t stream, T* params, const T* grads, T* state, std::size_t n, const Op& op,
                     const std::type_identity_t<Op>* from_device = nullptr, const DecayRuns& runs = {},
                     std::size_t stride = 0) {
  if (n == 0) return;
  launch<detail::optimizer_kernel<Slots, Op, T>>("optimizer_kernel", elementwise_blocks(n), elementwise_threads, 0,
                                                 stream, params, grads, state, n, stride != 0 ? stride : n, op,
                                                 from_device, runs);
}

/// The update of the parameters `rest` names: what remains of the optimizer's pass when the
/// weight-gradient GEMMs applied it to the other tensors. `whole`: the step (device memory), the whole
/// parameter and state buffers and the state's slot stride; `runs` where the GEMM weights lie.
template <class T>
void apply_optimizer_rest(cudaStream_t stream, const UpdateTarget<T>& whole, const T* grads, const ElementRuns& rest,
                          const DecayRuns& runs) {
  const std::size_t n = rest.size();
  if (n == 0) return;
  launch<detail::optimizer_rest_kernel<T>>("optimizer_rest_kernel", elementwise_blocks(n), elementwise_threads, 0,
                                           stream, whole, grads, rest, runs);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
