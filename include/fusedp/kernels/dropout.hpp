#pragma once
// The dropout mask, shared by both spaces: element i of a batch is kept when the uniform draw of
// element first + i of the step's global batch is >= p, so that a shard (a replica's, a micro-batch's)
// draws what one model running the whole global batch would.
#include "fusedp/core/config.hpp"
#include "fusedp/core/rng.hpp"

#include <cstdint>

namespace fusedp::kernels {

struct DropoutMask {
  float p;                // probability of dropping an element
  std::uint64_t seed;     // the model's seed
  std::uint64_t stream;   // distinct per layer and per step
  std::uint64_t first = 0;  // the batch's first element in the step's global batch

  /// 0 for a dropped element, 1 / (1 - p) for a kept one.
  FUSEDP_HD float scale(std::uint64_t i) const {
    return rng::uniform(seed, stream, first + i) >= p ? 1.0f / (1.0f - p) : 0.0f;
  }
};

}  // namespace fusedp::kernels
