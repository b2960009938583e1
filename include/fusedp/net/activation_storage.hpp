#pragma once
// What a model stores its activations and activation gradients in. Under precision::Bf16 they are
// bfloat16 values: every stage's output and every stage's input gradient, as written to the workspace,
// is rounded to nearest even; the network's input, its logits and their gradient stay fp32 (the loss
// and softmax run in fp32), and so do the master weights, gradients, optimizer state and what a stage
// saves for its own backward (pre-activations before an epilogue that needs them, a residual block's sum,
// BatchNorm statistics).
//
// Who decides and who rounds: the stage binding (net/stage_binding.hpp, and a residual block's inner
// networks) sets StageArgs::bf16_y and bf16_dx from stores_bf16_activations, false for the network's
// output. Cuda kernels round as they write (kernels::stored_value in every store of a stage's output or
// input gradient: GEMM epilogues, gradient sinks, the pooling, BatchNorm and elementwise kernels), so
// the memory is float but holds bf16 values; a Host at bf16 or bf16_emulated rounds in place after
// each stage (round_stored), the reference the Cuda space is checked against, except where the layer's
// Host kernels round each run as they write it (host_rounds_stored: Conv2d and BatchNorm, whose
// passes of their own were 8% of a ResNet-18 bf16 step). Where every reader can
// take 16 bits, the Cuda space stores the same values in 16-bit elements (kernels::BFloat16), half the
// bytes and the same bits (issue 17):
//   - the dz a gradient sink writes into a stage whose activation derivative is a mask (ReLU, none):
//     kernels::cuda::received_dz_element;
//   - a group's output that only the GEMMs of the group above and the sink that writes its dz read
//     (CudaPlan::narrow_output: in the CIFAR-10 CNN both pooled outputs and fc1's);
//   - an output whose layer writes it in 16 bits and whose reader reads it so (layers declare it:
//     cuda_writes_16bit, cuda_reads_16bit; Conv2d without an epilogue, BatchNorm, Residual), between
//     stages (CudaPlan::narrow_output) and inside a residual block (net/residual.hpp, InnerLayout): in
//     ResNet-18 every activation but the last block's output (and a projection's output, which the
//     block's fused add reads as stored);
//   - an input gradient whose layer writes it in 16 bits and whose reader reads it so (layers declare
//     it: cuda_writes_16bit_gradient, cuda_reads_16bit_gradient; Conv2d, BatchNorm where the epilogue's
//     derivative is a mask, which keeps the dz it writes over dy a bf16 value, Residual with a fused
//     add), between stages (CudaWorkspace::dx_element, dy_element) and inside a residual block
//     (Residual::inner_gradient_element): in ResNet-18 every gradient between its stem and its last
//     block.
// The Cuda workspace gives these half their regions (a block's saved region is its inner layouts'),
// and sizes each gradient buffer for the widest tensor written into it in its element (CudaWorkspace:
// under Bf16 the CIFAR-10 CNN's buffers hold conv1's dense dz in 16 bits, ResNet-18's a block's input
// gradient, half Net's size). The rest (pooling, dropout and elementwise kernels' tensors and
// gradients, what a separate add reads, a dz formed by backward itself) keeps bf16 values in fp32
// elements. A block whose every inner gradient is 16-bit gets gradient buffers of half Net's size
// (Residual::cuda_backward_elements).
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/exec/precision.hpp"
#include "fusedp/kernels/host/pointwise.hpp"

#include <cstddef>
#include <type_traits>

#ifndef FUSEDP_CUDA_NARROW_OUTPUTS
#define FUSEDP_CUDA_NARROW_OUTPUTS 1
#endif

namespace fusedp {

/// Whether a Bf16 Cuda model stores tensors (activations and their gradients) in 16-bit elements where
/// every reader takes them (FUSEDP_CUDA_NARROW_OUTPUTS, default 1; 0 keeps bf16 values in fp32 elements,
/// for measuring what the 16-bit elements give). Like every option that changes a layout, the same in every translation unit.
inline constexpr bool cuda_narrow_outputs = FUSEDP_CUDA_NARROW_OUTPUTS != 0;

/// Whether a model of scalar T on `space` stores its activations and their gradients as bf16 values.
template <class T, class Space>
[[nodiscard]] bool stores_bf16_activations(const Space& space) noexcept {
  if constexpr (std::is_same_v<Space, Host> && std::is_same_v<T, float>) {
    return space.precision() != HostPrecision::fp32;
  } else {
#if FUSEDP_HAS_CUDA
    if constexpr (std::is_same_v<Space, CudaSpace<precision::Bf16>> && std::is_same_v<T, float>) return true;
#endif
    return false;
  }
}

/// Whether layer L's Host kernels store y and dx as bf16 values themselves (Layer contract:
/// host_rounds_stored): Conv2d and BatchNorm round each run as they write it, while it is in cache.
template <class L>
inline constexpr bool host_rounds_stored = [] {
  if constexpr (requires { L::host_rounds_stored; }) return bool(L::host_rounds_stored);
  else return false;
}();

namespace detail {
/// Finishes the stores of a stage of layer L that wrote n values at p with `bf16` (StageArgs::bf16_y or
/// bf16_dx): the Host rounds them in place, unless L's kernels did (host_rounds_stored); the Cuda
/// kernels rounded them as they wrote.
template <class L, class T, class Space>
void round_stored(const Space& space, T* p, std::size_t n, bool bf16) {
  if constexpr (std::is_same_v<Space, Host> && std::is_same_v<T, float> && !host_rounds_stored<L>)
    if (p != nullptr && bf16) kernels::host::round_to_bf16(space, n, p);
}
}  // namespace detail

}  // namespace fusedp
