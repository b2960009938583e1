#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A number is a pure function of
// (seed, stream, index), so Host and Cuda, any thread count and any launch shape draw the same values,
// and a value is recomputed instead of stored (dropout masks in backward).
#include "fusedp/core/config.hpp"

#include <cstdint>

namespace fusedp {

/// Seed of a model, a sampler or an augmentation: `fp::seed(42)`.
struct Seed {
  std::uint64_t value = 0;
};
constexpr Seed seed(std::uint64_t v) { return Seed{v}; }

namespace rng {

struct Block {
  std::uint32_t v[4];
};

FUSEDP_HD constexpr void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t p = std::uint64_t(a) * b;
  hi = std::uint32_t(p >> 32);
  lo = std::uint32_t(p);
}

/// Philox4x32 with 10 rounds: four 32-bit outputs from a 128-bit counter and a 64-bit key.
FUSEDP_HD constexpr Block philox4x32(Block ctr, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  constexpr std::uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    std::uint32_t hi0 = 0, lo0 = 0, hi1 = 0, lo1 = 0;
    mulhilo(m0, ctr.v[0], hi0, lo0);
    mulhilo(m1, ctr.v[2], hi1, lo1);
    ctr = Block{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += w0;
    k1 += w1;
  }
  return ctr;
}

/// Four 32-bit random words for element block `index` of `stream` under `seed`.
FUSEDP_HD constexpr Block bits(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return philox4x32(Block{{std::uint32_t(index), std::uint32_t(index >> 32), std::uint32_t(stream),
                           std::uint32_t(stream >> 32)}},
                    std::uint32_t(seed), std::uint32_t(seed >> 32));
}

/// Uniform float in [0, 1) with 24 random bits: exactly representable, identical on every device.
FUSEDP_HD constexpr float to_unit_float(std::uint32_t x) { return float(x >> 8) * (1.0f / 16777216.0f); }

/// The `i`-th uniform float in [0, 1) of `stream` under `seed`.
FUSEDP_HD constexpr float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t i) {
  return to_unit_float(bits(seed, stream, i / 4).v[i % 4]);
}

/// Streams: the upper bits tell what the numbers are for, so uses never overlap.
enum class Purpose : std::uint64_t { init = 1, dropout = 2, data = 3, sampler = 4, test = 5 };
FUSEDP_HD constexpr std::uint64_t stream(Purpose p, std::uint64_t sub) {
  return (std::uint64_t(p) << 56) ^ sub;
}

}  // namespace rng
}  // namespace fusedp
