#pragma once
// What a model stores its activations and activation gradients in. Under precision::Bf16 they are
// bfloat16 values: every stage's output and every stage's input gradient, as written to the workspace,
// is rounded to nearest even; the network's input, its logits and their gradient stay fp32 (the loss
// and softmax run in fp32), and so do the master weights, gradients, optimizer state and what a stage
// saves for its own backward (pre-activations before an epilogue that needs them, a residual block's sum,
// BatchNorm statistics).
//
// Host: a Host at bf16 or bf16_emulated rounds in place after each stage (a float workspace holding
// bf16 values), the reference for the Cuda space's bf16 storage. Cuda: not yet; its Bf16 rounds the
// GEMM operands only, and the storage comes with 16-bit workspace memory (issue 17).
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/pointwise.hpp"

#include <cstddef>
#include <type_traits>

namespace fusedp {

/// Whether a model of scalar T on `space` stores its activations and their gradients as bf16 values.
template <class T, class Space>
[[nodiscard]] bool stores_bf16_activations(const Space& space) noexcept {
  if constexpr (std::is_same_v<Space, Host> && std::is_same_v<T, float>) return space.precision() != HostPrecision::fp32;
  else return false;
}

namespace detail {
/// Rounds n stored values at p to bf16 where stores_bf16_activations says so.
template <class T, class Space>
void round_stored(const Space& space, T* p, std::size_t n) {
  if constexpr (std::is_same_v<Space, Host> && std::is_same_v<T, float>)
    if (p != nullptr && stores_bf16_activations<T>(space)) kernels::host::round_to_bf16(space, n, p);
}
}  // namespace detail

}  // namespace fusedp
