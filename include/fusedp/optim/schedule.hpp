#pragma once
// Learning-rate schedules: functions of the step number that give the rate for that step.
#include "fusedp/core/error.hpp"

#include <cmath>
#include <cstdint>

namespace fusedp {

/// lr * gamma^(step / step_size), as torch.optim.lr_scheduler.StepLR (stepped per optimizer step).
struct StepLR {
  float base_lr;
  std::uint64_t step_size;
  float gamma = 0.1f;

  [[nodiscard]] float operator()(std::uint64_t step) const {
    require(step_size > 0, "StepLR: step_size must be > 0");
    return base_lr * std::pow(gamma, float(step / step_size));
  }
};

/// Linear warm-up over `warmup` steps (step s < warmup gets base_lr * (s + 1) / warmup, so step 0 is
/// never zero), then a cosine decay from base_lr at step `warmup` to min_lr at `total`; min_lr after.
struct CosineWarmup {
  float base_lr;
  std::uint64_t warmup;
  std::uint64_t total;
  float min_lr = 0.0f;

  [[nodiscard]] float operator()(std::uint64_t step) const {
    require(total > warmup, "CosineWarmup: total (", total, ") must exceed warmup (", warmup, ")");
    if (step < warmup) return base_lr * float(step + 1) / float(warmup);
    if (step >= total) return min_lr;
    const double progress = double(step - warmup) / double(total - warmup);
    return float(min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(3.14159265358979323846 * progress)));
  }
};

}  // namespace fusedp
