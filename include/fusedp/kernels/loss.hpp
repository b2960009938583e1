#pragma once
// Loss math shared by both spaces: one pass per row computes the loss and its gradient.
#include "fusedp/core/config.hpp"

#include <cmath>
#include <cstddef>

namespace fusedp::kernels {

/// Softmax cross-entropy of one row against the target (1 - eps) onehot(label) + eps / classes
/// (PyTorch's label_smoothing eps; 0 gives -log softmax(logits)[label]); when dlogits is not null,
/// writes scale * (softmax(logits) - target) to it.
template <class T>
FUSEDP_HD T softmax_cross_entropy_row(const T* logits, int classes, int label, T* dlogits, T scale,
                                      T smoothing = T(0)) {
  using std::exp;
  using std::log;
  T m = logits[0];
  for (int c = 1; c < classes; ++c) m = logits[c] > m ? logits[c] : m;
  T s = T(0);
  for (int c = 0; c < classes; ++c) s += exp(logits[c] - m);
  // (x - max) - log(s) rather than log(s) + max - x: exact for large logits, as PyTorch does it.
  const T log_s = log(s);
  if (dlogits) {
    const T inv = T(1) / s;
    const T spread = smoothing / T(classes);
    for (int c = 0; c < classes; ++c) dlogits[c] = (exp(logits[c] - m) * inv - spread) * scale;
    dlogits[label] -= (T(1) - smoothing) * scale;
  }
  const T nll = log_s - (logits[label] - m);
  if (smoothing == T(0)) return nll;
  T mean_nll = T(0);  // mean over classes of -log softmax
  for (int c = 0; c < classes; ++c) mean_nll += log_s - (logits[c] - m);
  return (T(1) - smoothing) * nll + smoothing * mean_nll / T(classes);
}

/// Squared error of one value: returns (y - t)^2; when dy is not null writes scale * 2 (y - t) there.
template <class T>
FUSEDP_HD T squared_error_element(T y, T target, T* dy, T scale) {
  const T d = y - target;
  if (dy) *dy = scale * T(2) * d;
  return d * d;
}

/// Squared error of one row: returns sum (y - t)^2; when dy is not null writes scale * 2 (y - t).
template <class T>
FUSEDP_HD T squared_error_row(const T* y, const T* target, int n, T* dy, T scale) {
  T s = T(0);
  for (int i = 0; i < n; ++i) s += squared_error_element(y[i], target[i], dy ? dy + i : nullptr, scale);
  return s;
}

/// Index of the largest value of a row (the first one on ties).
template <class T>
FUSEDP_HD int argmax_row(const T* row, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

}  // namespace fusedp::kernels
