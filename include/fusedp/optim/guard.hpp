#pragma once
// Guarding an update: what happens when a gradient is NaN or infinite (a policy chosen at compile
// time), and clipping by global norm as torch.nn.utils.clip_grad_norm_ (L2, eps 1e-6).
//
//   fp::Guarded<fp::Sgd, fp::nonfinite::Skip> opt{{{.lr = 0.05f, .momentum = 0.9f}}, {.max_norm = 1.0f}};
//   model.train_step(x, y, fp::SoftmaxCrossEntropy{}, opt);   // a NaN step changes nothing
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/gradient.hpp"
#include "fusedp/kernels/optimizer.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fusedp {

/// What an update does with a gradient that is not finite.
namespace nonfinite {
/// Throw NumericError naming the step and the first layer whose gradient is not finite; nothing changes.
struct Stop {};
/// Leave parameters and optimizer state as they are and go on (the step is counted as skipped).
struct Skip {};
}  // namespace nonfinite

/// An optimizer whose updates are guarded: a gradient that is not finite is handled by OnNonFinite,
/// and with max_norm > 0 the gradient is first scaled so that its global L2 norm is at most max_norm.
/// @tparam Opt the optimizer (Sgd, Adam, AdamW)
/// @tparam OnNonFinite nonfinite::Stop (default) or nonfinite::Skip
template <class Opt, class OnNonFinite = nonfinite::Stop>
struct Guarded {
  static_assert(std::is_same_v<OnNonFinite, nonfinite::Stop> || std::is_same_v<OnNonFinite, nonfinite::Skip>,
                "fusedp::Guarded<Opt, OnNonFinite>: OnNonFinite is nonfinite::Stop or nonfinite::Skip");
  struct Options {
    float max_norm = 0.0f;  ///< 0: no clipping
  };
  Opt optimizer{};
  Options guard{};

  using on_nonfinite = OnNonFinite;
  static constexpr const char* name = Opt::name;  // the same state as the bare optimizer
  static constexpr std::size_t state_slots = Opt::state_slots;

  void validate() const {
    optimizer.validate();
    require(std::isfinite(guard.max_norm) && guard.max_norm >= 0, "Guarded: max_norm must be finite and >= 0, got ",
            guard.max_norm);
  }
  template <class Space, class T>
  void step(const Space& space, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t,
            const kernels::DecayRuns& runs = {}) const {
    optimizer.step(space, params, grads, state, n, t, runs);
  }

  /// Given the whole gradient's stats: the factor to scale the gradient by (1: none), or 0 to skip
  /// the update. Throws NumericError (naming `where`) under Stop.
  [[nodiscard]] double decide(const kernels::host::GradientStats& stats, std::uint64_t step, const std::string& where) const {
    if (!stats.finite) {
      if constexpr (std::is_same_v<OnNonFinite, nonfinite::Stop>)
        throw NumericError("step " + std::to_string(step) + ": the gradient is not finite (NaN or infinity), first in " +
                           where + "; parameters are unchanged");
      else return 0.0;
    }
    if (guard.max_norm > 0) {
      const double coef = double(guard.max_norm) / (stats.norm() + 1e-6);
      if (coef < 1.0) return coef;
    }
    return 1.0;
  }
};

/// Scales `grads` so that their global L2 norm is at most max_norm, as torch.nn.utils.clip_grad_norm_;
/// returns the norm before clipping.
template <class T>
double clip_grad_norm(const Host& host, std::span<T> grads, double max_norm) {
  const auto s = kernels::host::gradient_stats(host, grads.data(), grads.size());
  const double coef = max_norm / (s.norm() + 1e-6);
  if (s.finite && coef < 1.0) kernels::host::scale_gradient(host, grads.data(), grads.size(), T(coef));
  return s.norm();
}

}  // namespace fusedp
