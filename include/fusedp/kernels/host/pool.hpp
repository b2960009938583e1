#pragma once
// Max and average pooling on the Host (NCHW, floor mode, no padding), threads over (sample, channel)
// planes. Max pooling saves nothing: backward finds the window's maximum again in the saved input,
// taking the first maximum in scan order as PyTorch does.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/conv2d.hpp"

#include <algorithm>
#include <cstddef>

namespace fusedp::kernels::host {

enum class PoolOp { max, average };

namespace detail {
template <PoolOp Op, class T>
FUSEDP_ALWAYS_INLINE T pool_window(const ConvGeometry& g, const T* plane, int oy, int ox, int& arg) {
  const int y0 = oy * g.stride, x0 = ox * g.stride;
  if constexpr (Op == PoolOp::max) {
    T best = plane[std::size_t(y0) * g.in_w + x0];
    arg = y0 * g.in_w + x0;
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx) {
        const int i = (y0 + ky) * g.in_w + x0 + kx;
        if (plane[i] > best || plane[i] != plane[i]) {  // NaN propagates, as in PyTorch
          best = plane[i];
          arg = i;
        }
      }
    return best;
  } else {
    T s = T(0);
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx) s += plane[(y0 + ky) * g.in_w + x0 + kx];
    arg = 0;
    return s / T(g.kernel * g.kernel);
  }
}
}  // namespace detail

/// y = Epi(pool(x)); z receives the pooled values when the epilogue needs them in backward.
template <PoolOp Op, class Epi, class T>
void pool_forward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* x, T* y, T* z) {
  const std::size_t planes = batch * std::size_t(g.in_channels), in_plane = std::size_t(g.in_h) * g.in_w;
  const std::size_t out_plane = g.out_pixels();
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    for (std::size_t p = p0; p < p1; ++p) {
      const T* plane = x + p * in_plane;
      for (int oy = 0; oy < g.out_h; ++oy)
        for (int ox = 0; ox < g.out_w; ++ox) {
          int arg = 0;
          const T v = detail::pool_window<Op>(g, plane, oy, ox, arg);
          const std::size_t o = p * out_plane + std::size_t(oy) * g.out_w + ox;
          if constexpr (Epi::saves_input) z[o] = v;
          y[o] = Epi::apply(v);
        }
    }
  });
}

/// dx = pool^T(dy * Epi'); dy is overwritten with the gradient before the epilogue.
template <PoolOp Op, class Epi, class T>
void pool_backward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* x, const T* y, const T* z,
                   T* dy, T* dx) {
  const std::size_t planes = batch * std::size_t(g.in_channels), in_plane = std::size_t(g.in_h) * g.in_w;
  const std::size_t out_plane = g.out_pixels();
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    for (std::size_t p = p0; p < p1; ++p) {
      const T* plane = x + p * in_plane;
      T* dplane = dx + p * in_plane;
      std::fill(dplane, dplane + in_plane, T(0));
      for (int oy = 0; oy < g.out_h; ++oy)
        for (int ox = 0; ox < g.out_w; ++ox) {
          const std::size_t o = p * out_plane + std::size_t(oy) * g.out_w + ox;
          T d = dy[o];
          if constexpr (!Epi::empty) d *= Epi::derivative(z ? z[o] : y[o], y[o]);
          if constexpr (Op == PoolOp::max) {
            int arg = 0;
            (void)detail::pool_window<Op>(g, plane, oy, ox, arg);
            dplane[arg] += d;
          } else {
            const T share = d / T(g.kernel * g.kernel);
            for (int ky = 0; ky < g.kernel; ++ky)
              for (int kx = 0; kx < g.kernel; ++kx)
                dplane[(oy * g.stride + ky) * g.in_w + ox * g.stride + kx] += share;
          }
        }
    }
  });
}

}  // namespace fusedp::kernels::host
