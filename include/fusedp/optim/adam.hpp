#pragma once
// Adam and AdamW (torch.optim.Adam and AdamW, without amsgrad) in one pass over the flat buffer.
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
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

namespace detail {
template <bool Decoupled>
struct AdamFamily {
  struct Options {
    float lr = 0.001f;
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float eps = 1e-8f;
    float weight_decay = Decoupled ? 0.01f : 0.0f;
    Decay decay = Decay::all;  ///< which parameters weight_decay applies to
  };
  Options options;

  static constexpr const char* name = Decoupled ? "AdamW" : "Adam";
  /// First and second moment per parameter.
  static constexpr std::size_t state_slots = 2;

  void validate() const {
    require(std::isfinite(options.lr) && options.lr >= 0, name, ": lr must be finite and >= 0, got ", options.lr);
    require(options.beta1 >= 0 && options.beta1 < 1, name, ": beta1 must be in [0, 1), got ", options.beta1);
    require(options.beta2 >= 0 && options.beta2 < 1, name, ": beta2 must be in [0, 1), got ", options.beta2);
    require(options.eps > 0, name, ": eps must be > 0, got ", options.eps);
    require(options.weight_decay >= 0, name, ": weight_decay must be >= 0, got ", options.weight_decay);
  }

  /// The per-element update of step t (1-based).
  template <class T>
  [[nodiscard]] kernels::AdamStep<T> update(std::uint64_t t) const {
    using std::pow;
    return {T(options.lr),
            T(options.beta1),
            T(options.beta2),
            T(options.eps),
            T(options.weight_decay),
            Decoupled,
            T(1) - pow(T(options.beta1), T(t)),
            T(1) - pow(T(options.beta2), T(t)),
            options.decay == Decay::all};
  }

  /// Updates n parameters (moments m then v in `state`, `stride` elements apart; 0: n); `runs` as
  /// Sgd's. A part of a larger buffer passes that buffer's slot stride.
  template <class T>
  void step(const Host& host, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t,
            const kernels::DecayRuns& runs = {}, std::size_t stride = 0) const {
    check_runs(runs);
    const kernels::AdamStep<T> op = update<T>(t);
    T* m = state;
    T* v = state + (stride != 0 ? stride : n);
    host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
      kernels::apply_with_decay(op, runs, i0, i1, [&](const kernels::AdamStep<T>& o, std::size_t j0, std::size_t j1) {
        for (std::size_t i = j0; i < j1; ++i) o(params[i], grads[i], m[i], v[i]);
      });
    });
  }

#if FUSEDP_HAS_CUDA
  /// One fused kernel over n device parameters (moments m then v in `state`, `stride` apart; 0: n),
  /// queued on the space's stream (`runs` in device memory).
  template <class T, class P>
  void step(const CudaSpace<P>& space, T* params, const T* grads, T* state, std::size_t n, std::uint64_t t,
            const kernels::DecayRuns& runs = {}, std::size_t stride = 0) const {
    check_runs(runs);
    kernels::cuda::apply_optimizer<2>(space.stream(), params, grads, state, n, update<T>(t), nullptr, runs, stride);
  }
#endif

  void check_runs(const kernels::DecayRuns& runs) const {
    check_decay_runs(name, options.decay, options.weight_decay, runs);
  }
};
}  // namespace detail

/// Adam with L2 weight decay added to the gradient: `fp::Adam opt{{.lr = 1e-3f}}`.
using Adam = detail::AdamFamily<false>;
/// AdamW: weight decay applied to the weights, decoupled from the gradient.
using AdamW = detail::AdamFamily<true>;

}  // namespace fusedp
