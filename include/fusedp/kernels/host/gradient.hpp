#pragma once
// Whole-gradient passes on the Host: the sum of squares with a finiteness check (for clipping by global
// norm and for catching NaN), and scaling.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"

#include <cmath>
#include <cstddef>
#include <array>

namespace fusedp::kernels::host {

/// Sum of squares (in double) and finiteness of a gradient, or of a part of it: parts combine by
/// adding, so ranks that each hold a part agree on the whole.
struct GradientStats {
  double sum_squares = 0;
  bool finite = true;
  GradientStats& operator+=(const GradientStats& o) {
    sum_squares += o.sum_squares;
    finite = finite && o.finite;
    return *this;
  }
  /// The global L2 norm.
  [[nodiscard]] double norm() const { return std::sqrt(sum_squares); }
};

template <class T>
GradientStats gradient_stats(const Host& host, const T* g, std::size_t n) {
  auto sum = [g](std::size_t i0, std::size_t i1) {
    double s = 0;
    for (std::size_t i = i0; i < i1; ++i) s += double(g[i]) * double(g[i]);
    return GradientStats{s, std::isfinite(s)};
  };
  constexpr std::size_t max_parts = 256;  // a step allocates nothing: the parts live on the stack
  if (std::size_t(host.threads()) > max_parts) return sum(0, n);
  std::array<GradientStats, max_parts> part{};
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int t) { part[std::size_t(t)] = sum(i0, i1); });
  GradientStats all;
  for (int t = 0; t < host.threads(); ++t) all += part[std::size_t(t)];  // in thread order: reproducible
  return all;
}

template <class T>
void scale_gradient(const Host& host, T* g, std::size_t n, T factor) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) g[i] *= factor;
  });
}

}  // namespace fusedp::kernels::host
