#pragma once
// Max and average pooling on the Host (NCHW, floor mode, no padding), threads over (sample, channel)
// planes. Max pooling saves nothing: backward finds the window's maximum again in the saved input,
// taking the first maximum in scan order as PyTorch does (and NaN, which propagates).
//
// Window size and stride are compile-time constants, so the window loops unroll, and the maximum is a
// chain of selects rather than branches (a branch per element mispredicts on half of random data:
// LeNet's first max-pool backward took 0.55 ms at batch 64 with branches). Non-overlapping windows
// (stride >= window) write every input gradient once, instead of clearing the plane and scattering.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/pool_op.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <cstddef>

namespace fusedp::kernels::host {

namespace detail {

// The first maximum of a K x K window (NaN wins, as in PyTorch) and its offset from the window's
// top-left element.
template <int K, class T>
FUSEDP_ALWAYS_INLINE T window_max(const T* FUSEDP_RESTRICT w0, int in_w, int& at) {
  T best = w0[0];
  at = 0;
  FUSEDP_UNROLL(8)
  for (int ky = 0; ky < K; ++ky)
    FUSEDP_UNROLL(8)
    for (int kx = 0; kx < K; ++kx) {
      if (ky == 0 && kx == 0) continue;
      const T v = w0[ky * in_w + kx];
      const bool take = v > best || v != v;
      best = take ? v : best;
      at = take ? ky * in_w + kx : at;
    }
  return best;
}

template <int K, class T>
FUSEDP_ALWAYS_INLINE T window_mean(const T* FUSEDP_RESTRICT w0, int in_w) {
  T s = T(0);
  FUSEDP_UNROLL(8)
  for (int ky = 0; ky < K; ++ky)
    FUSEDP_UNROLL(8)
    for (int kx = 0; kx < K; ++kx) s += w0[ky * in_w + kx];
  return s * (T(1) / T(K * K));
}

#if FUSEDP_VECTOR_EXTENSIONS
// 2x2 max pooling with stride 2, the layer of both seed networks, W outputs at a time: the two input
// rows are split into even and odd columns by shuffles, and the first maximum is a chain of selects.
// take[i]: candidate i (of x00 x01 x10 x11) replaced the running maximum.
template <class T, std::size_t W, std::size_t... I>
FUSEDP_ALWAYS_INLINE simd::vec_n<T, W> max2x2(const T* r0, const T* r1, simd::mask_of<simd::vec_n<T, W>> (&take)[3],
                                             std::index_sequence<I...>) {
  using V = simd::vec_n<T, W>;
  const V a0 = simd::load_as<V>(r0), a1 = simd::load_as<V>(r0 + W);
  const V b0 = simd::load_as<V>(r1), b1 = simd::load_as<V>(r1 + W);
  V best = __builtin_shufflevector(a0, a1, (2 * I)...);
  const V cand[3] = {__builtin_shufflevector(a0, a1, (2 * I + 1)...), __builtin_shufflevector(b0, b1, (2 * I)...),
                     __builtin_shufflevector(b0, b1, (2 * I + 1)...)};
  FUSEDP_UNROLL(3)
  for (int c = 0; c < 3; ++c) {
    take[c] = (cand[c] > best) | (cand[c] != cand[c]);
    best = simd::select(take[c], cand[c], best);
  }
  return best;
}
#endif

// One output row of 2x2 stride-2 max pooling: yrow[ox] = max of the window (before the epilogue).
template <class T>
void max2x2_row(const T* FUSEDP_RESTRICT r0, const T* FUSEDP_RESTRICT r1, T* FUSEDP_RESTRICT out, int out_w) {
  simd::for_chunks<T>(std::size_t(out_w), [&]<std::size_t W>(std::size_t ox) {
#if FUSEDP_VECTOR_EXTENSIONS
    if constexpr (W > 1) {
      simd::mask_of<simd::vec_n<T, W>> take[3];
      simd::store(out + ox, max2x2<T, W>(r0 + 2 * ox, r1 + 2 * ox, take, std::make_index_sequence<W>{}));
      return;
    }
#endif
    for (std::size_t j = ox; j < ox + W; ++j) {
      const T x[4] = {r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1]};
      T best = x[0];
      for (int c = 1; c < 4; ++c) best = (x[c] > best || x[c] != x[c]) ? x[c] : best;
      out[j] = best;
    }
  });
}

// Backward of one output row: the two input-gradient rows get d at each window's first maximum and
// zero elsewhere (d: the row's gradient after the epilogue's derivative).
template <class T>
void max2x2_backward_row(const T* FUSEDP_RESTRICT r0, const T* FUSEDP_RESTRICT r1, const T* FUSEDP_RESTRICT d,
                         T* FUSEDP_RESTRICT g0, T* FUSEDP_RESTRICT g1, int out_w) {
  simd::for_chunks<T>(std::size_t(out_w), [&]<std::size_t W>(std::size_t ox) {
#if FUSEDP_VECTOR_EXTENSIONS
    if constexpr (W > 1) {
      using V = simd::vec_n<T, W>;
      using M = simd::mask_of<V>;
      M take[3];
      (void)max2x2<T, W>(r0 + 2 * ox, r1 + 2 * ox, take, std::make_index_sequence<W>{});
      const V dv = simd::load_as<V>(d + ox), zero{};
      // The last candidate that took the maximum is the first maximum in scan order.
      const M at3 = take[2], at2 = take[1] & ~at3, at1 = take[0] & ~take[1] & ~at3, at0 = ~(take[0] | take[1] | at3);
      const V v0 = simd::select(at0, dv, zero), v1 = simd::select(at1, dv, zero);
      const V v2 = simd::select(at2, dv, zero), v3 = simd::select(at3, dv, zero);
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        // Interleave: (v0[0], v1[0], v0[1], v1[1], ...) is the first input row.
        simd::store(g0 + 2 * ox, __builtin_shufflevector(v0, v1, ((I & 1) ? W + I / 2 : I / 2)...));
        simd::store(g1 + 2 * ox, __builtin_shufflevector(v2, v3, ((I & 1) ? W + I / 2 : I / 2)...));
      }(std::make_index_sequence<2 * W>{});
      return;
    }
#endif
    for (std::size_t j = ox; j < ox + W; ++j) {
      const T x[4] = {r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1]};
      T best = x[0];
      int at = 0;
      for (int c = 1; c < 4; ++c) {
        const bool t = x[c] > best || x[c] != x[c];
        best = t ? x[c] : best;
        at = t ? c : at;
      }
      g0[2 * j] = at == 0 ? d[j] : T(0);
      g0[2 * j + 1] = at == 1 ? d[j] : T(0);
      g1[2 * j] = at == 2 ? d[j] : T(0);
      g1[2 * j + 1] = at == 3 ? d[j] : T(0);
    }
  });
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
      for (int oy = 0; oy < g.out_h; ++oy) {
        const T* row = plane + std::size_t(oy) * S * g.in_w;
        T* yp = y + p * out_plane + std::size_t(oy) * g.out_w;
        T* zp = z ? z + p * out_plane + std::size_t(oy) * g.out_w : nullptr;
        if constexpr (Op == PoolOp::max && K == 2 && S == 2) {
          detail::max2x2_row(row, row + g.in_w, Epi::saves_input ? zp : yp, g.out_w);
          if constexpr (Epi::saves_input) {
            for (int ox = 0; ox < g.out_w; ++ox) yp[ox] = Epi::apply(zp[ox]);
          } else if constexpr (!Epi::empty) {
            for (int ox = 0; ox < g.out_w; ++ox) yp[ox] = Epi::apply(yp[ox]);
          }
        } else {
          for (int ox = 0; ox < g.out_w; ++ox) {
            T v;
            if constexpr (Op == PoolOp::max) {
              int at;
              v = detail::window_max<K>(row + ox * S, g.in_w, at);
            } else {
              v = detail::window_mean<K>(row + ox * S, g.in_w);
            }
            if constexpr (Epi::saves_input) zp[ox] = v;
            yp[ox] = Epi::apply(v);
          }
        }
      }
    }
  });
}

/// dx = pool^T(dy * Epi').
template <PoolOp Op, int K, int S, class Epi, class T>
void pool_backward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* x, const T* y, const T* z,
                   T* dy, T* dx) {
  const std::size_t planes = batch * std::size_t(g.in_channels), in_plane = std::size_t(g.in_h) * g.in_w;
  const std::size_t out_plane = g.out_pixels();
  host.parallel_for(planes, [&](std::size_t p0, std::size_t p1, int) {
    // One row of dy * Epi' for the 2x2 path (wider rows take the generic path below).
    T dtmp[Epi::empty ? 1 : 1024];
    for (std::size_t p = p0; p < p1; ++p) {
      const T* plane = x + p * in_plane;
      T* dplane = dx + p * in_plane;
      if constexpr (S == K) {
        // Windows tile the plane: zero only what no window covers (the floor-mode remainder).
        const int covered_w = g.out_w * K;
        for (int iy = 0; iy < g.out_h * K; ++iy)
          std::fill(dplane + std::size_t(iy) * g.in_w + covered_w, dplane + std::size_t(iy + 1) * g.in_w, T(0));
        std::fill(dplane + std::size_t(g.out_h) * K * g.in_w, dplane + in_plane, T(0));
      } else {
        std::fill(dplane, dplane + in_plane, T(0));
      }
      for (int oy = 0; oy < g.out_h; ++oy) {
        const std::size_t row_at = std::size_t(oy) * S * g.in_w;
        const T* drow = dy + p * out_plane + std::size_t(oy) * g.out_w;
        const T* yrow = y + p * out_plane + std::size_t(oy) * g.out_w;
        const T* zrow = z ? z + p * out_plane + std::size_t(oy) * g.out_w : yrow;
        if (Op == PoolOp::max && K == 2 && S == 2 && (Epi::empty || g.out_w <= 1024)) {
          const T* d = drow;
          if constexpr (!Epi::empty) {
            for (int ox = 0; ox < g.out_w; ++ox) dtmp[ox] = drow[ox] * Epi::derivative(zrow[ox], yrow[ox]);
            d = dtmp;
          }
          detail::max2x2_backward_row(plane + row_at, plane + row_at + g.in_w, d, dplane + row_at,
                                      dplane + row_at + g.in_w, g.out_w);
        } else {
          for (int ox = 0; ox < g.out_w; ++ox) {
            T d = drow[ox];
            if constexpr (!Epi::empty) d *= Epi::derivative(zrow[ox], yrow[ox]);
            const T* w0 = plane + row_at + ox * S;
            T* d0 = dplane + row_at + ox * S;
            if constexpr (Op == PoolOp::max) {
              int at;
              (void)detail::window_max<K>(w0, g.in_w, at);
              if constexpr (S == K) {
                FUSEDP_UNROLL(8)
                for (int ky = 0; ky < K; ++ky)
                  FUSEDP_UNROLL(8)
                  for (int kx = 0; kx < K; ++kx) d0[ky * g.in_w + kx] = ky * g.in_w + kx == at ? d : T(0);
              } else {
                d0[at] += d;
              }
            } else {
              const T share = d * (T(1) / T(K * K));
              FUSEDP_UNROLL(8)
              for (int ky = 0; ky < K; ++ky)
                FUSEDP_UNROLL(8)
                for (int kx = 0; kx < K; ++kx) {
                  if constexpr (S == K) d0[ky * g.in_w + kx] = share;
                  else d0[ky * g.in_w + kx] += share;
                }
            }
          }
        }
      }
    }
  });
}

}  // namespace fusedp::kernels::host
