#pragma once
// Stand-alone pointwise stages on the Host: an activation chain that no anchor absorbed, and dropout.
#include "fusedp/core/config.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/dropout.hpp"

#include <cstddef>

namespace fusedp::kernels::host {

/// y = Epi(x) elementwise over n values.
template <class Epi, class T>
void pointwise_forward(const Host& host, std::size_t n, const T* x, T* y) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) y[i] = Epi::apply(x[i]);
  });
}

/// dx = dy * Epi'(x).
template <class Epi, class T>
void pointwise_backward(const Host& host, std::size_t n, const T* x, const T* y, const T* dy, T* dx) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) dx[i] = dy[i] * Epi::derivative(x[i], y[i]);
  });
}

/// y = x * keep / (1 - p) in training, y = x otherwise. The mask is a function of (seed, stream, i),
/// so backward recomputes it instead of storing it.
template <class T>
void dropout_forward(const Host& host, std::size_t n, const DropoutMask& mask, bool training, const T* x, T* y) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) y[i] = training ? x[i] * T(mask.scale(i)) : x[i];
  });
}

template <class T>
void dropout_backward(const Host& host, std::size_t n, const DropoutMask& mask, const T* dy, T* dx) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) dx[i] = dy[i] * T(mask.scale(i));
  });
}

}  // namespace fusedp::kernels::host
