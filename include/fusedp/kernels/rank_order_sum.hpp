#pragma once
// The one way data-parallel gradients are added when the order must not depend on the communicator:
// replica by replica in rank order, from 0, each value and each partial sum rounded to bfloat16 with
// Compress. Shared by every communicator (in-process, MPI, NCCL), so N replicas give the same bits on
// every path and on both spaces.
#include "fusedp/core/config.hpp"
#include "fusedp/kernels/bf16.hpp"

#include <cstddef>
#include <cstdint>

namespace fusedp::kernels {

/// sum + value, the step of a sum in rank order (through bfloat16 when Bf16).
template <bool Bf16>
FUSEDP_HD FUSEDP_ALWAYS_INLINE float add_in_rank_order(float sum, float value) {
  if constexpr (Bf16) return round_bf16(sum + round_bf16(value));
  else return sum + value;
}

/// The sum of element i of `world` rows of n values (all[r * n + i]), in rank order: what the Host
/// loops and the Cuda kernel both compute per element.
template <bool Bf16>
FUSEDP_HD FUSEDP_ALWAYS_INLINE float sum_in_rank_order(const float* all, std::size_t n, int world, std::size_t i) {
  float s = 0;
  for (int r = 0; r < world; ++r) s = add_in_rank_order<Bf16>(s, all[std::size_t(r) * n + i]);
  return s;
}

namespace host {
/// out[i] = the rank-order sum of all[0 * n + i], all[1 * n + i], ... for i < n.
template <bool Bf16>
void sum_in_rank_order(const float* all, float* out, std::size_t n, int world) {
  for (std::size_t i = 0; i < n; ++i) out[i] = kernels::sum_in_rank_order<Bf16>(all, n, world, i);
}
inline void pack_bf16(const float* g, std::uint16_t* packed, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) packed[i] = to_bf16(g[i]);
}
inline void unpack_bf16(const std::uint16_t* packed, float* g, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) g[i] = from_bf16(packed[i]);
}
}  // namespace host

}  // namespace fusedp::kernels
