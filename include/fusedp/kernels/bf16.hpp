#pragma once
// bfloat16 conversions shared by both spaces: the upper 16 bits of a float, rounded to nearest even.
#include "fusedp/core/config.hpp"

#include <cstdint>
#include <cstring>

namespace fusedp::kernels {

FUSEDP_HD inline std::uint16_t to_bf16(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return std::uint16_t((u >> 16) | 0x0040u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

FUSEDP_HD inline float from_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// A bfloat16 value as memory holds it (the upper 16 bits of a float): the element of a 16-bit
/// activation workspace. A distinct type, so that an operand's element type says how to read it.
struct BFloat16 {
  std::uint16_t bits;
};
static_assert(sizeof(BFloat16) == 2, "BFloat16: two bytes");

/// The value of a stored element as a float (exact for both).
FUSEDP_HD inline float to_float(float x) { return x; }
FUSEDP_HD inline float to_float(BFloat16 x) { return from_bf16(x.bits); }

/// x rounded to the nearest bfloat16 value.
FUSEDP_HD inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

/// v as an activation store keeps it: rounded to bf16 where the model stores its activations in bf16
/// (net/activation_storage.hpp), else v itself. How every Cuda kernel writes a stage's output or input
/// gradient.
FUSEDP_HD inline float stored_value(float v, bool bf16) { return bf16 ? round_bf16(v) : v; }

/// v stored as an element E: itself, or its bf16 bits (rounded to nearest even; exact for a bf16 value,
/// so a stored_value written in 16 bits reads back as the same value).
FUSEDP_HD inline void store_element(float* p, float v) { *p = v; }
FUSEDP_HD inline void store_element(BFloat16* p, float v) { p->bits = to_bf16(v); }

}  // namespace fusedp::kernels
