#pragma once
// Conv2d on the Host: per sample, an im2col matrix times the weights (NCHW, weights OIHW as PyTorch),
// threads over samples, bias and activation applied in the GEMM epilogue.
#include "fusedp/core/config.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/gemm.hpp"

#include <algorithm>
#include <cstddef>

namespace fusedp::kernels::host {

/// Geometry of a 2-d convolution or pooling window over one sample.
struct ConvGeometry {
  int in_channels, in_h, in_w, kernel, stride, pad, out_channels, out_h, out_w;
  [[nodiscard]] constexpr std::size_t in_size() const { return std::size_t(in_channels) * in_h * in_w; }
  [[nodiscard]] constexpr std::size_t out_pixels() const { return std::size_t(out_h) * out_w; }
  [[nodiscard]] constexpr std::size_t out_size() const { return std::size_t(out_channels) * out_pixels(); }
  [[nodiscard]] constexpr std::size_t patch() const { return std::size_t(in_channels) * kernel * kernel; }
  // A 1x1 kernel with stride 1 and no padding reads the input as its own im2col matrix.
  [[nodiscard]] constexpr bool direct() const { return kernel == 1 && stride == 1 && pad == 0; }
  // Per-thread scratch: im2col matrix, its gradient, and private weight and bias gradients.
  [[nodiscard]] constexpr std::size_t scratch_per_thread() const {
    return 2 * align_elements(patch() * out_pixels()) + align_elements(std::size_t(out_channels) * patch()) +
           align_elements(std::size_t(out_channels));
  }
};

// col[(c, ky, kx), (oy, ox)] = x[c, oy*s - p + ky, ox*s - p + kx], zero outside the image.
template <class T>
void im2col(const ConvGeometry& g, const T* FUSEDP_RESTRICT x, T* FUSEDP_RESTRICT col) {
  const std::size_t pixels = g.out_pixels();
  for (int c = 0; c < g.in_channels; ++c)
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx) {
        T* row = col + ((std::size_t(c) * g.kernel + ky) * g.kernel + kx) * pixels;
        const T* plane = x + std::size_t(c) * g.in_h * g.in_w;
        for (int oy = 0; oy < g.out_h; ++oy) {
          const int iy = oy * g.stride - g.pad + ky;
          T* out = row + std::size_t(oy) * g.out_w;
          if (iy < 0 || iy >= g.in_h) {
            std::fill(out, out + g.out_w, T(0));
            continue;
          }
          const T* in = plane + std::size_t(iy) * g.in_w;
          if (g.stride == 1) {
            const int lo = std::max(0, g.pad - kx), hi = std::min(g.out_w, g.in_w + g.pad - kx);
            for (int ox = 0; ox < lo; ++ox) out[ox] = T(0);
            for (int ox = lo; ox < hi; ++ox) out[ox] = in[ox - g.pad + kx];
            for (int ox = std::max(lo, hi); ox < g.out_w; ++ox) out[ox] = T(0);
          } else {
            for (int ox = 0; ox < g.out_w; ++ox) {
              const int ix = ox * g.stride - g.pad + kx;
              out[ox] = (ix >= 0 && ix < g.in_w) ? in[ix] : T(0);
            }
          }
        }
      }
}

// The adjoint of im2col: dx[c, iy, ix] = sum of the col entries that read it.
template <class T>
void col2im(const ConvGeometry& g, const T* FUSEDP_RESTRICT col, T* FUSEDP_RESTRICT dx) {
  std::fill(dx, dx + g.in_size(), T(0));
  const std::size_t pixels = g.out_pixels();
  for (int c = 0; c < g.in_channels; ++c)
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx) {
        const T* row = col + ((std::size_t(c) * g.kernel + ky) * g.kernel + kx) * pixels;
        T* plane = dx + std::size_t(c) * g.in_h * g.in_w;
        for (int oy = 0; oy < g.out_h; ++oy) {
          const int iy = oy * g.stride - g.pad + ky;
          if (iy < 0 || iy >= g.in_h) continue;
          const T* in = row + std::size_t(oy) * g.out_w;
          T* out = plane + std::size_t(iy) * g.in_w;
          for (int ox = 0; ox < g.out_w; ++ox) {
            const int ix = ox * g.stride - g.pad + kx;
            if (ix >= 0 && ix < g.in_w) out[ix] += in[ox];
          }
        }
      }
}

/// y = Epi(conv(x, w) + b) for `batch` samples; z receives the values before the epilogue when the
/// epilogue needs them in backward (else null). scratch: threads x g.scratch_per_thread() elements.
template <class Epi, class T>
void conv2d_forward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* w, const T* b,
                    const T* x, T* y, T* z, T* scratch) {
  const std::size_t pixels = g.out_pixels(), patch = g.patch();
  host.parallel_for(batch, [&](std::size_t n0, std::size_t n1, int thread) {
    T* col = scratch + std::size_t(thread) * g.scratch_per_thread();
    for (std::size_t n = n0; n < n1; ++n) {
      const T* xn = x + n * g.in_size();
      T* yn = y + n * g.out_size();
      T* zn = z ? z + n * g.out_size() : nullptr;
      if (!g.direct()) im2col(g, xn, col);
      const T* cols = g.direct() ? xn : col;
      gemm(std::size_t(g.out_channels), pixels, patch, row_major(w, patch), row_major(cols, pixels), yn, pixels, false,
           [&](std::size_t o, std::size_t j0, T* p, std::size_t cnt) {
             const T bias = b[o];
             if constexpr (Epi::saves_input) {
               T* zp = zn + (p - yn);
               for (std::size_t j = 0; j < cnt; ++j) {
                 zp[j] = p[j] + bias;
                 p[j] = Epi::apply(zp[j]);
               }
             } else {
               for (std::size_t j = 0; j < cnt; ++j) p[j] = Epi::apply(p[j] + bias);
             }
             (void)j0;
           });
    }
  });
}

/// Backward of conv2d_forward. dy is overwritten with the gradient before the epilogue. dw and db are
/// set (not accumulated); dx is skipped when null (the first layer of a network).
template <class Epi, class T>
void conv2d_backward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* w, const T* x, const T* y,
                     const T* z, T* dy, T* dx, T* dw, T* db, T* scratch) {
  const std::size_t pixels = g.out_pixels(), patch = g.patch(), outs = std::size_t(g.out_channels);
  const std::size_t col_size = align_elements(patch * pixels), dw_size = align_elements(outs * patch);
  const int threads = host.threads();
  host.run_on_all([&](int thread) {
    T* col = scratch + std::size_t(thread) * g.scratch_per_thread();
    T* dcol = col + col_size;
    T* dw_t = dcol + col_size;
    T* db_t = dw_t + dw_size;
    std::fill(dw_t, dw_t + outs * patch, T(0));
    std::fill(db_t, db_t + outs, T(0));
    const std::size_t n0 = batch * std::size_t(thread) / std::size_t(threads);
    const std::size_t n1 = batch * (std::size_t(thread) + 1) / std::size_t(threads);
    for (std::size_t n = n0; n < n1; ++n) {
      T* dzn = dy + n * g.out_size();
      const T* yn = y + n * g.out_size();
      const T* zn = z ? z + n * g.out_size() : yn;
      for (std::size_t o = 0; o < outs; ++o) {
        T s = T(0);
        for (std::size_t p = o * pixels; p < (o + 1) * pixels; ++p) {
          dzn[p] *= Epi::derivative(zn[p], yn[p]);
          s += dzn[p];
        }
        db_t[o] += s;
      }
      const T* xn = x + n * g.in_size();
      if (!g.direct()) im2col(g, xn, col);
      const T* cols = g.direct() ? xn : col;
      // dW (outs x patch) += dz (outs x pixels) * col^T (pixels x patch)
      gemm(outs, patch, pixels, row_major<T>(dzn, pixels), MatrixRef<T>{cols, 1, pixels}, dw_t, patch, true);
      if (dx) {
        T* dxn = dx + n * g.in_size();
        // dcol (patch x pixels) = W^T (patch x outs) * dz (outs x pixels)
        T* target = g.direct() ? dxn : dcol;
        gemm(patch, pixels, outs, MatrixRef<T>{w, 1, patch}, row_major<T>(dzn, pixels), target, pixels, false);
        if (!g.direct()) col2im(g, dcol, dxn);
      }
    }
  });
  // Fixed order over threads: the sum is the same on every run with the same thread count.
  const std::size_t stride = g.scratch_per_thread();
  host.parallel_for(outs * patch + outs, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) {
      const std::size_t off = i < outs * patch ? 2 * col_size + i : 2 * col_size + dw_size + (i - outs * patch);
      T s = T(0);
      for (int t = 0; t < threads; ++t) s += scratch[std::size_t(t) * stride + off];
      (i < outs * patch ? dw[i] : db[i - outs * patch]) = s;
    }
  });
}

}  // namespace fusedp::kernels::host
