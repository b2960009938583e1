#pragma once
// Sgd: stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as
// torch.optim.SGD, in one pass over the flat parameter buffer. With `.decay = Decay::weights` the
// decay applies to Conv2d and Linear weights only, as torch.optim.SGD given two parameter groups
// (the rest with weight_decay 0).
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/optimizer.hpp"
#include "fusedp/kernels/optimizer.hpp"
#include "fusedp/optim/decay.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/optimizer.cuh"
#endif

namespace fusedp {

struct Sgd {
  struct Options {
    float lr = 0.01f;
    float momentum = 0.0f;
    float dampening = 0.0f;
    float weight_decay = 0.0f;
    bool nesterov = false;
    Decay decay = Decay::all;  ///< which parameters weight_decay applies to
  };
  Options options;

  static constexpr const char* name = "Sgd";
  /// Values of optimizer state per parameter (the momentum buffer).
  static constexpr std::size_t state_slots = 1;

  void validate() const {
    require(std::isfinite(options.lr) && options.lr >= 0, "Sgd: lr must be finite and >= 0, got ", options.lr);
    require(options.momentum >= 0, "Sgd: momentum must be >= 0, got ", options.momentum);
    require(options.weight_decay >= 0, "Sgd: weight_decay must be >= 0, got ", options.weight_decay);
    require(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
            "Sgd: nesterov needs momentum > 0 and dampening 0");
  }

  /// The per-element update of step t (1-based).
  template <class T>
  [[nodiscard]] kernels::SgdStep<T> update(std::uint64_t t) const {
    return {T(options.lr),           T(options.momentum), T(options.dampening), T(options.weight_decay),
            options.nesterov,        t == 1,              options.decay == Decay::all};
  }

  /// Updates n parameters; `state` holds n values; t is the 1-based number of this step; `runs` where
  /// the network's weights lie (needed by Decay::weights; Model and Parallel pass them). `stride`:
  /// elements between state slots (one slot here, so unused; Adam's takes it).
  template <class T>
  void step(const Host& host, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t,
            const kernels::DecayRuns& runs = {}, [[maybe_unused]] std::size_t stride = 0) const {
    check_runs(runs);
    const kernels::SgdStep<T> op = update<T>(t);
    host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
      kernels::apply_with_decay(op, runs, i0, i1, [&](const kernels::SgdStep<T>& o, std::size_t j0, std::size_t j1) {
        kernels::host::sgd_range(o, params + j0, grads + j0, state + j0, j1 - j0);
      });
    });
  }

#if FUSEDP_HAS_CUDA
  /// One fused kernel over n device parameters, queued on the space's stream (`runs` in device memory).
  template <class T, class P>
  void step(const CudaSpace<P>& space, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t,
            const kernels::DecayRuns& runs = {}, [[maybe_unused]] std::size_t stride = 0) const {
    check_runs(runs);
    kernels::cuda::apply_optimizer<1>(space.stream(), params, grads, state, n, update<T>(t), nullptr, runs);
  }
#endif

  void check_runs(const kernels::DecayRuns& runs) const {
    check_decay_runs(name, options.decay, options.weight_decay, runs);
  }
};

}  // namespace fusedp
