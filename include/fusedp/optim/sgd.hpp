#pragma once
// Sgd: stochastic gradient descent with momentum, dampening, Nesterov and weight decay, as
// torch.optim.SGD, in one pass over the flat parameter buffer.
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/optimizer.hpp"

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

  /// Updates n parameters; `state` holds n values; t is the 1-based number of this step.
  template <class T>
  void step(const Host& host, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t) const {
    const kernels::SgdStep<T> op{T(options.lr), T(options.momentum), T(options.dampening), T(options.weight_decay),
                                 options.nesterov, t == 1};
    host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
      for (std::size_t i = i0; i < i1; ++i) op(params[i], grads[i], state[i]);
    });
  }

#if FUSEDP_HAS_CUDA
  /// The per-element update of step t (1-based), exactly as step() above builds it.
  template <class T>
  [[nodiscard]] kernels::SgdStep<T> update(std::uint64_t t) const {
    return {T(options.lr), T(options.momentum), T(options.dampening), T(options.weight_decay), options.nesterov,
            t == 1};
  }
  /// One fused kernel over n device parameters, queued on the space's stream.
  template <class T, class P>
  void step(const CudaSpace<P>& space, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t) const {
    kernels::cuda::apply_optimizer<1>(space.stream(), params, grads, state, n, update<T>(t));
  }
#endif
};

}  // namespace fusedp
