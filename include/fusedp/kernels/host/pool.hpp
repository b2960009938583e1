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
// Window size and stride are compile-time constants so the window loops unroll.
template <PoolOp Op, int K, int S, class T>
FUSEDP_ALWAYS_INLINE T pool_window(const T* FUSEDP_RESTRICT plane, int in_w, int oy, int ox, int& arg) {
  const T* w0 = plane + (oy * S) * in_w + ox * S;
  if constexpr (Op == PoolOp::max) {
    T best = w0[0];
    int at = 0;
    for (int ky = 0; ky < K; ++ky)
      for (int kx = 0; kx < K; ++kx) {
        const T v = w0[ky * in_w + kx];
        if (v > best || v != v) {  // the first maximum; NaN propagates, as in PyTorch
          best = v;
          at = ky * in_w + kx;
        }
      }
    arg = (oy * S) * in_w + ox * S + at;
    return best;
  } else {
    T s = T(0);
    for (int ky = 0; ky < K; ++ky)
      for (int kx = 0; kx < K; ++kx) s += w0[ky * in_w + kx];
    arg = 0;
    return s * (T(1) / T(K * K));
  }
}
}  // namespace detail

/// y = Epi(pool(x)) over K x K windows with stride S; z receives the pooled values when the epilogue
/// needs them in backward.
template <PoolOp Op, int K, int S, class Epi, class T>
void pool_forward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* x, T* y, T* z) {
  const std::size_t planes = batch * std::size_t(g.in_channels), in_plane = std::size_t(g.in_h) * g.in_w;
  const std::size_t out_plane = g.out_pixels();
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    for (std::size_t p = p0; p < p1; ++p) {
      const T* plane = x + p * in_plane;
      T* yp = y + p * out_plane;
      T* zp = z ? z + p * out_plane : nullptr;
      for (int oy = 0; oy < g.out_h; ++oy)
        for (int ox = 0; ox < g.out_w; ++ox) {
          int arg = 0;
          const T v = detail::pool_window<Op, K, S>(plane, g.in_w, oy, ox, arg);
          const std::size_t o = std::size_t(oy) * g.out_w + ox;
          if constexpr (Epi::saves_input) zp[o] = v;
          yp[o] = Epi::apply(v);
        }
    }
  });
}

/// dx = pool^T(dy * Epi'); dy is overwritten with the gradient before the epilogue.
template <PoolOp Op, int K, int S, class Epi, class T>
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
            (void)detail::pool_window<Op, K, S>(plane, g.in_w, oy, ox, arg);
            dplane[arg] += d;
          } else {
            const T share = d * (T(1) / T(K * K));
            T* w0 = dplane + (oy * S) * g.in_w + ox * S;
            for (int ky = 0; ky < K; ++ky)
              for (int kx = 0; kx < K; ++kx) w0[ky * g.in_w + kx] += share;
          }
        }
    }
  });
}

}  // namespace fusedp::kernels::host
