#pragma once
// The dropout mask, shared by both spaces: element i is kept when its uniform draw is >= p.
#include "fusedp/core/config.hpp"
#include "fusedp/core/rng.hpp"

#include <cstdint>

namespace fusedp::kernels {

struct DropoutMask {
  float p;                // probability of dropping an element
  std::uint64_t seed;     // the model's seed
  std::uint64_t stream;   // distinct per layer and per step

  /// 0 for a dropped element, 1 / (1 - p) for a kept one.
  FUSEDP_HD float scale(std::uint64_t i) const {
    return rng::uniform(seed, stream, i) >= p ? 1.0f / (1.0f - p) : 0.0f;
  }
};

}  // namespace fusedp::kernels
