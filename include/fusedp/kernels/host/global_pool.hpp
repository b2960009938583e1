#pragma once
// Global average pooling on the Host: the mean of each (sample, channel) plane, and its backward.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"

#include <cstddef>

namespace fusedp::kernels::host {

/// y[n, c] = Epi(mean of x[n, c, :]) over `planes` = batch * channels planes of `plane` values.
template <class Epi, class T>
void global_avg_pool_forward(const Host& host, std::size_t planes, std::size_t plane, const T* x, T* y, T* z) {
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    for (std::size_t p = p0; p < p1; ++p) {
      T s = T(0);
      for (std::size_t i = 0; i < plane; ++i) s += x[p * plane + i];
      const T v = s / T(plane);
      if constexpr (Epi::saves_input) z[p] = v;
      y[p] = Epi::apply(v);
    }
  });
}

/// dx[n, c, :] = dz[n, c] / plane, dz = dy Epi'(z); dy is overwritten with dz.
template <class Epi, class T>
void global_avg_pool_backward(const Host& host, std::size_t planes, std::size_t plane, const T* y, const T* z, T* dy,
                              T* dx) {
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    for (std::size_t p = p0; p < p1; ++p) {
      if constexpr (!Epi::empty) dy[p] *= Epi::derivative(z ? z[p] : y[p], y[p]);
      const T d = dy[p] / T(plane);
      for (std::size_t i = 0; i < plane; ++i) dx[p * plane + i] = d;
    }
  });
}

}  // namespace fusedp::kernels::host
