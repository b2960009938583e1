#pragma once
// Which parameters an optimizer's weight decay applies to, chosen per optimizer (Sgd::Options::decay,
// Adam's): the groups are kinds of tensors that the network's type knows at compile time
// (Sequential::weight_runs), so no list of names is kept or matched at run time.
#include "fusedp/core/error.hpp"
#include "fusedp/kernels/optimizer.hpp"

namespace fusedp {

enum class Decay {
  all,      ///< every parameter tensor (PyTorch's default for one parameter group)
  weights,  ///< the weights of Conv2d and Linear only: no bias, no BatchNorm scale or shift (the
            ///< "no weight decay on bias and norm" group of ResNet and transformer recipes)
};

/// The option's name in messages and metrics.
constexpr const char* decay_name(Decay d) { return d == Decay::all ? "all" : "weights"; }

/// Decay::weights with a non-zero decay needs to know where the weights are (`runs` given).
inline void check_decay_runs(const char* optimizer, Decay decay, float weight_decay, const kernels::DecayRuns& runs) {
  require(decay == Decay::all || weight_decay == 0.0f || runs.given, optimizer,
          ": decay = Decay::weights needs the network's weight runs; step through Model or Parallel (or pass "
          "Net::weight_runs as kernels::DecayRuns)");
}

}  // namespace fusedp
