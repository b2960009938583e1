#pragma once
// Per-element optimizer updates shared by both spaces, with PyTorch's semantics (torch.optim.SGD,
// Adam, AdamW). One fused pass over the flat parameter buffer applies them.
#include "fusedp/core/config.hpp"

#include <cmath>

namespace fusedp::kernels {

template <class T>
struct SgdStep {
  T lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first;  // PyTorch starts the momentum buffer as the first gradient itself

  FUSEDP_HD void operator()(T& p, T g, T& buf) const {
    if (weight_decay != T(0)) g += weight_decay * p;
    if (momentum != T(0)) {
      buf = first ? g : momentum * buf + (T(1) - dampening) * g;
      g = nesterov ? g + momentum * buf : buf;
    }
    p -= lr * g;
  }
};

template <class T>
struct AdamStep {
  T lr, beta1, beta2, eps, weight_decay;
  bool decoupled;   // AdamW: decay the weights, not the gradient
  T bias1, bias2;   // 1 - beta^t for the step t being taken

  FUSEDP_HD void operator()(T& p, T g, T& m, T& v) const {
    using std::sqrt;
    if (decoupled) p *= T(1) - lr * weight_decay;
    else if (weight_decay != T(0)) g += weight_decay * p;
    m = beta1 * m + (T(1) - beta1) * g;
    v = beta2 * v + (T(1) - beta2) * g * g;
    const T denom = sqrt(v) / sqrt(bias2) + eps;
    p -= (lr / bias1) * m / denom;
  }
};

}  // namespace fusedp::kernels
