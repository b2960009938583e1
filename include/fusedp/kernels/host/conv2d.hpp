#pragma once
// Conv2d on the Host (NCHW, weights OIHW as PyTorch), as GEMMs per sample with threads over samples:
//   forward   y (O x P) = W (O x K) col (K x P), bias and activation in the GEMM epilogue
//   backward  dW^T (K x O) += col (K x P) dz^T (P x O)   (private per thread, summed in fixed order;
//             col read in place by the GEMM; dW (O x K) += dz col^T on planes under 64 pixels, by dot
//             products where a side is narrow and by the bf16 GEMM at precision bf16; the direct
//             path's dW^T has padded channels)
//             dcol (K x P) = W^T (K x O) dz (O x P), then col2im into dx
// with K = C*kh*kw the patch and P the output pixels. A 3x3 conv with stride 1 and padding 1 and at
// least 16 channels in and out (every conv of ResNet's stages but the strided ones and the stem) runs
// all three products by Winograd's F(4x4, 3x3) over the whole batch instead (winograd.hpp: 4x fewer
// multiply-adds; ResNet-18's train step on 2 cores -40%, benchmarks/RESULTS.md), in fp32 and double. The weights are packed once per call and shared
// by every sample and thread; the forward im2col writes the GEMM's packed B panels directly, so no
// im2col matrix is materialized and packed again. At precision bf16 the GEMMs take bf16 pairs
// (gemm_bf16.hpp): the forward's im2col writes pairs into the panels, the backward's the row-major
// matrix, which is packed into pairs; the direct path (few output channels, no GEMM) stays fp32. 3x3
// convs with stride 1 or 2 on planes 4 or more wide with channels in multiples of 32 run directly from
// the padded input, no im2col, on AMX tiles or by VDPBF16PS (conv3x3_bf16.hpp; small planes several
// samples a grid, strided ones over the input's four phases; by VDPBF16PS the forward of planes under
// 16 wide stays on the GEMM, direct_bf16_forward),
// and elsewhere on planes under 64 pixels the forward and input-gradient products take 64 / P samples
// side by side (tile_group).
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/host/conv3x3_bf16.hpp"
#include "fusedp/kernels/host/gemm.hpp"
#include "fusedp/kernels/host/gemm_bf16.hpp"
#include "fusedp/kernels/host/gemm_nt.hpp"
#include "fusedp/kernels/host/instances.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/kernels/host/winograd.hpp"

#include <algorithm>
#include <cstddef>

namespace fusedp::kernels::host {

/// How one thread's scratch is laid out for the Host conv2d kernels on geometry `g`, in elements, for
/// any tile shape of any target (bounds from gemm.hpp):
///   packed weights  W for forward, W^T for backward (thread 0's copy is shared by all threads)
///   col             im2col: packed B panels (forward) or the row-major matrix (backward)
///   dcol            the im2col gradient (backward)
///   dz panels       dz packed as B of the input-gradient GEMM, or dz transposed (direct path)
///   dW, db          this thread's weight and bias gradients (dW^T for the GEMM, with padded channels
///                   for the direct path; dW for dot products and bf16)
///   padded          the input with its zero border (when pad > 0)
struct ConvScratch {
  ConvGeometry g;
  [[nodiscard]] constexpr std::size_t packed_weights() const {
    const std::size_t o = std::size_t(g.out_channels), k = g.patch();
    // A shape's row count pads m to less than m + max_tile_rows (12 does not divide 16).
    const std::size_t forward = (o + max_tile_rows) * k, backward = (k + max_tile_rows) * o;
    return align_elements(std::max(forward, backward) + max_tile_cols);
  }
  [[nodiscard]] constexpr std::size_t col() const { return align_elements(g.patch() * (g.out_pixels() + max_tile_cols)); }
  [[nodiscard]] constexpr std::size_t dz_panels() const {
    const std::size_t o = std::size_t(g.out_channels), p = g.out_pixels();
    return align_elements(std::max(o * (p + max_tile_cols), p * (o + max_tile_rows)));
  }
  [[nodiscard]] constexpr std::size_t dw() const {
    return align_elements((std::size_t(g.out_channels) + max_tile_rows) * g.patch());
  }
  [[nodiscard]] constexpr std::size_t padded() const {
    return g.pad == 0 ? 0 : align_elements(std::size_t(g.in_channels) * (g.in_h + 2 * g.pad) * (g.in_w + 2 * g.pad));
  }
  [[nodiscard]] constexpr std::size_t per_thread() const {
    const std::size_t gemms =
        packed_weights() + 2 * col() + dz_panels() + dw() + align_elements(std::size_t(g.out_channels)) + padded();
    std::size_t most = gemms;
    if (winograd::applies(g)) {
      const winograd::Plan forward{g}, input_gradient{winograd::transposed(g)};
      most = std::max({most, forward.per_thread(), forward.weight_gradient_per_thread(), input_gradient.per_thread()});
    }
    if (conv3x3_bf16::applies(g)) {
      most = std::max({most, conv3x3_bf16::per_thread(g), conv3x3_bf16::weight_gradient_per_thread(g),
                       conv3x3_bf16::per_thread(conv3x3_bf16::input_gradient_geometry(g))});
    }
    return most;
  }
};

/// The input of one sample with its zero border, (C, H + 2 pad, W + 2 pad): im2col then reads every
/// patch row as one run, with no bounds checks.
template <class T>
FUSEDP_NO_LIBCALL_LOOPS void pad_input(const ConvGeometry& g, const T* FUSEDP_RESTRICT x, T* FUSEDP_RESTRICT padded) {
  const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad), hp = std::size_t(g.in_h) + 2 * std::size_t(g.pad);
  for (int c = 0; c < g.in_channels; ++c) {
    T* plane = padded + std::size_t(c) * hp * wp;
    const T* in = x + std::size_t(c) * g.in_h * g.in_w;
    simd::zero(plane, std::size_t(g.pad) * wp);
    for (int iy = 0; iy < g.in_h; ++iy) {
      T* row = plane + (std::size_t(iy) + std::size_t(g.pad)) * wp;
      simd::zero(row, std::size_t(g.pad));
      simd::copy(row + g.pad, in + std::size_t(iy) * g.in_w, std::size_t(g.in_w));
      simd::zero(row + g.pad + g.in_w, std::size_t(g.pad));
    }
    simd::zero(plane + (std::size_t(g.in_h) + std::size_t(g.pad)) * wp, std::size_t(g.pad) * wp);
  }
}

/// im2col: col(k, p) = x[c, oy*s - pad + ky, ox*s - pad + kx] for k = (c, ky, kx), p = (oy, ox), zero
/// outside the image. Written to col + (p / width) * (K * width) + k * width + p % width: width = P
/// gives the row-major matrix (K x P); width = a tile's NR gives the B panels of gemm_packed (the
/// last panel zero-padded). `padded`: ConvScratch{g}.padded() elements of scratch, used when pad > 0.
/// `row_stride` (width = P only): the rows of col that far apart, a sample's block beside others'.
template <class T>
FUSEDP_NO_LIBCALL_LOOPS void im2col(const ConvGeometry& g, const T* FUSEDP_RESTRICT x, T* FUSEDP_RESTRICT col,
                                    std::size_t width, T* FUSEDP_RESTRICT padded, std::size_t row_stride = 0) {
  const std::size_t panel = g.patch() * width, stride = std::size_t(g.stride), out_w = std::size_t(g.out_w);
  const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad), hp = std::size_t(g.in_h) + 2 * std::size_t(g.pad);
  const T* src = x;
  if (g.pad > 0) {
    pad_input(g, x, padded);
    src = padded;
  }
  std::size_t k = 0;
  for (int c = 0; c < g.in_channels; ++c)
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx, ++k) {
        const T* plane = src + std::size_t(c) * hp * wp + std::size_t(ky) * wp + std::size_t(kx);
        T* out = col + k * (row_stride != 0 ? row_stride : width);
        std::size_t room = width;  // left in the current panel's row
        for (int oy = 0; oy < g.out_h; ++oy) {
          const T* in = plane + std::size_t(oy) * stride * wp;
          // One output row, in runs that stay inside a panel.
          for (std::size_t ox = 0; ox < out_w;) {
            const std::size_t n = std::min(out_w - ox, room);
            if (stride == 1) {
              simd::copy(out, in + ox, n);
            } else {
              for (std::size_t j = 0; j < n; ++j) out[j] = in[(ox + j) * stride];
            }
            out += n;
            ox += n;
            room -= n;
            if (room == 0) {
              out += panel - width;
              room = width;
            }
          }
        }
        if (room != width) simd::zero(out, room);
      }
}

namespace detail {
#if FUSEDP_HOST_AVX512_BF16
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // see gemm_bf16.hpp
#endif
// One pair of im2col rows written as bf16 pairs into B panels: pixel p of the rows that start at `even`
// and `odd` (a padded plane, rows wp apart, read every `stride` values; odd null past the patch) goes
// to dst[(first + p) / nr * panel + (first + p) % nr], 16 pixels at a time.
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void pairs_of_patch_rows(
    const float* even, const float* odd, std::size_t wp, std::size_t stride, std::size_t out_h, std::size_t out_w,
    std::size_t nr, std::size_t panel, bf16::Pair* dst, std::size_t first) {
  const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int(stride)));
  std::size_t p = first;
  for (std::size_t oy = 0; oy < out_h; ++oy) {
    const float* e = even + oy * stride * wp;
    const float* o = odd ? odd + oy * stride * wp : nullptr;
    for (std::size_t ox = 0; ox < out_w;) {
      const std::size_t j = p % nr, n = std::min({out_w - ox, nr - j, bf16::lanes});
      const __mmask16 m = bf16::detail::first_lanes(n);
      __m512 lo, hi = _mm512_setzero_ps();
      if (stride == 1) {
        lo = _mm512_maskz_loadu_ps(m, e + ox);
        if (o) hi = _mm512_maskz_loadu_ps(m, o + ox);
      } else {
        lo = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, step, e + ox * stride, 4);
        if (o) hi = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, step, o + ox * stride, 4);
      }
      _mm512_mask_storeu_epi32(dst + p / nr * panel + j, m, bf16::detail::pairs_of(lo, hi));
      ox += n;
      p += n;
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
}  // namespace detail

/// im2col straight into the bf16 B panels of tile shape S, as im2col into a row-major col followed by
/// bf16::pack_b<S> (the same pairs, zero padding included) without the fp32 matrix between them: where
/// the CPU packs with AVX-512; elsewhere it is those two steps, `col` (ConvScratch::col()) in between.
/// Samples side by side (conv2d_forward's groups, where the CPU packs with AVX-512): this sample's
/// pixels go to columns [first, first + P) of a product `columns` wide, whose padding the call for its
/// last sample writes.
template <class S>
void im2col_pairs(const ConvGeometry& g, const float* FUSEDP_RESTRICT x, bf16::Pair* FUSEDP_RESTRICT panels,
                  float* FUSEDP_RESTRICT col, float* FUSEDP_RESTRICT padded, std::size_t first = 0,
                  std::size_t columns = 0) {
  const std::size_t patch = g.patch(), pixels = g.out_pixels();
  if (columns == 0) columns = pixels;
#if FUSEDP_HOST_AVX512_BF16
  if (bf16::detail::vector_packing()) {
    constexpr std::size_t NR = S::nr;
    const std::size_t kq = bf16::pairs(patch), kqp = bf16::panel_pairs<S>(patch), panel = kqp * NR;
    const std::size_t panels_n = (columns + NR - 1) / NR, tail = columns % NR;
    const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad), hp = std::size_t(g.in_h) + 2 * std::size_t(g.pad);
    const float* src = x;
    if (g.pad > 0) {
      pad_input(g, x, padded);
      src = padded;
    }
    const std::size_t kk = std::size_t(g.kernel) * std::size_t(g.kernel);
    auto row = [&](std::size_t k) {
      const std::size_t c = k / kk, ky = k % kk / std::size_t(g.kernel), kx = k % std::size_t(g.kernel);
      return src + c * hp * wp + ky * wp + kx;
    };
    for (std::size_t q = 0; q < kq; ++q)
      detail::pairs_of_patch_rows(row(2 * q), 2 * q + 1 < patch ? row(2 * q + 1) : nullptr, wp, std::size_t(g.stride),
                                  std::size_t(g.out_h), std::size_t(g.out_w), NR, panel, panels + q * NR, first);
    if (first + pixels != columns) return;
    for (std::size_t t = 0; t < panels_n; ++t) {
      bf16::Pair* d = panels + t * panel;
      for (std::size_t q = kq; q < kqp; ++q)
        for (std::size_t j = 0; j < NR; ++j) d[q * NR + j] = 0;
    }
    if (tail != 0) {
      bf16::Pair* d = panels + (panels_n - 1) * panel;
      for (std::size_t q = 0; q < kq; ++q)
        for (std::size_t j = tail; j < NR; ++j) d[q * NR + j] = 0;
    }
    return;
  }
#endif
  if (first != 0 || columns != pixels)
    throw InvalidArgument("im2col_pairs: samples side by side need AVX-512 packing, which this CPU or build lacks");
  im2col(g, x, col, pixels, padded);
  bf16::pack_b<S>(row_major<float>(col, pixels), 0, patch, 0, pixels, panels);
}

namespace detail {
// A bf16 weight gradient over a group of samples (conv2d_backward): the calling thread's im2col
// matrices side by side (K x group*P) and their dz (O x group*P), reused by every later call. Like
// the GEMMs' packing buffers, they are not part of ConvScratch or CostModel::host_memory.
struct SampleGroup {
  HostBuffer<float> cols, dz;
};
inline SampleGroup& sample_group() {
  thread_local SampleGroup g;
  return g;
}
// Samples a bf16 weight gradient takes at once: enough for 256 values of k on small planes, where a
// product per sample (k = P) reads and writes all of dW for a few multiply-adds (ResNet-18's layer4:
// 512 x 4608 x 16 a sample).
constexpr std::size_t weight_gradient_group(std::size_t pixels) { return pixels < 256 ? 256 / pixels : 1; }
// Samples a bf16 forward and input gradient take at once on AMX tiles: on planes of 32 pixels or fewer,
// 64 / P samples side by side make one product for the 16 x 64 row of tiles, where one sample's would
// waste most of it or take the single 16 x 16 tile (ResNet-18's layer4: 512 x 16 x 4608 a sample, or
// 512 x 64 x 4608 for four).
constexpr std::size_t tile_group(std::size_t pixels) { return pixels < 64 ? 64 / pixels : 1; }
}  // namespace detail

/// The adjoint of the row-major im2col: dx[c, iy, ix] = sum of the col entries that read it. Sums into
/// the padded input (`padded`: ConvScratch{g}.padded() elements, used when pad > 0), so every patch row adds
/// as one run with no bounds checks, then copies the inside out. `row_stride`: the rows of col that far
/// apart (a sample's block beside others'), else P.
template <class T>
FUSEDP_NO_LIBCALL_LOOPS void col2im(const ConvGeometry& g, const T* FUSEDP_RESTRICT col, T* FUSEDP_RESTRICT dx,
                                    T* FUSEDP_RESTRICT padded, std::size_t row_stride = 0) {
  const std::size_t pixels = g.out_pixels(), stride = std::size_t(g.stride), out_w = std::size_t(g.out_w);
  const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad), hp = std::size_t(g.in_h) + 2 * std::size_t(g.pad);
  T* dst = g.pad > 0 ? padded : dx;
  simd::zero(dst, std::size_t(g.in_channels) * hp * wp);
  std::size_t k = 0;
  for (int c = 0; c < g.in_channels; ++c)
    for (int ky = 0; ky < g.kernel; ++ky)
      for (int kx = 0; kx < g.kernel; ++kx, ++k) {
        const T* row = col + k * (row_stride != 0 ? row_stride : pixels);
        T* plane = dst + std::size_t(c) * hp * wp + std::size_t(ky) * wp + std::size_t(kx);
        for (std::size_t oy = 0; oy < std::size_t(g.out_h); ++oy) {
          T* out = plane + oy * stride * wp;
          const T* in = row + oy * out_w;
          if (stride == 1) {
            simd::accumulate(out, in, out_w);
          } else {
            for (std::size_t ox = 0; ox < out_w; ++ox) out[ox * stride] += in[ox];
          }
        }
      }
  if (g.pad > 0)
    for (int c = 0; c < g.in_channels; ++c)
      for (int iy = 0; iy < g.in_h; ++iy)
        simd::copy(dx + (std::size_t(c) * g.in_h + iy) * g.in_w,
                   padded + std::size_t(c) * hp * wp + (std::size_t(iy) + g.pad) * wp + g.pad, std::size_t(g.in_w));
}

namespace detail {

// Sum of n values with lanes-wide partial sums (a single running sum is one add per 4 cycles).
template <class T>
T sum(const T* FUSEDP_RESTRICT p, std::size_t n) {
  constexpr std::size_t L = simd::lanes<T>;
  simd::vec<T> a0{}, a1{};
  std::size_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    a0 += simd::load(p + i);
    a1 += simd::load(p + i + L);
  }
  a0 += a1;
  T s = T(0);
  if constexpr (L == 1) {
    s = a0;
  } else {
    for (std::size_t l = 0; l < L; ++l) s += a0[l];
  }
  for (; i < n; ++i) s += p[i];
  return s;
}

// Sample n's gradient before the epilogue, in place of dy's (dy * Epi'(z or y)), its channel sums
// added to db (the bias gradient; null for a conv without bias); returns it.
template <class Epi, class T>
T* sample_dz(const ConvGeometry& g, std::size_t n, const T* y, const T* z, T* dy, T* db) {
  const std::size_t outs = std::size_t(g.out_channels), pixels = g.out_pixels();
  T* dzn = dy + n * g.out_size();
  if constexpr (!Epi::empty) {
    const T* yn = y + n * g.out_size();
    const T* zn = z ? z + n * g.out_size() : yn;
    for (std::size_t i = 0; i < outs * pixels; ++i) dzn[i] *= Epi::derivative(zn[i], yn[i]);
  }
  if (db != nullptr)
    for (std::size_t o = 0; o < outs; ++o) db[o] += sum(dzn + o * pixels, pixels);
  return dzn;
}

// Sums `count` values at `offset` of every thread's scratch (stride apart) into out, in thread order:
// the result is the same on every run with the same thread count.
template <class T>
void reduce_threads(const Host& host, const T* scratch, std::size_t stride, std::size_t offset, std::size_t count,
                    T* out) {
  const int threads = host.threads();
  auto body = [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) {
      T s = scratch[offset + i];
      for (int t = 1; t < threads; ++t) s += scratch[std::size_t(t) * stride + offset + i];
      out[i] = s;
    }
  };
  // A parallel region costs a few microseconds; below ~64 K values one thread is done sooner.
  if (count < (std::size_t(1) << 16)) body(0, count, 0);
  else host.parallel_for(count, body);
}

// out (rows x cols) = the transpose of the sum over threads of the (cols x width) matrices at
// scratch + t * stride + offset (only their first `rows` columns), in thread order: the weight
// gradients kept as dW^T. Threads take blocks of 16 rows of out, each read as runs of 16 values.
template <class T>
void reduce_threads_transposed(const Host& host, const T* scratch, std::size_t stride, std::size_t offset,
                               std::size_t width, std::size_t rows, std::size_t cols, T* out) {
  constexpr std::size_t R = 16;
  const int threads = host.threads();
  auto body = [&](std::size_t b0, std::size_t b1, int) {
    for (std::size_t r0 = b0 * R; r0 < std::min(rows, b1 * R); r0 += R) {
      const std::size_t rn = std::min(R, rows - r0);
      for (std::size_t c = 0; c < cols; ++c) {
        T s[R];
        const T* p = scratch + offset + c * width + r0;
        for (std::size_t r = 0; r < rn; ++r) s[r] = p[r];
        for (int t = 1; t < threads; ++t) {
          const T* q = p + std::size_t(t) * stride;
          for (std::size_t r = 0; r < rn; ++r) s[r] += q[r];
        }
        for (std::size_t r = 0; r < rn; ++r) out[(r0 + r) * cols + c] = s[r];
      }
    }
  };
  const std::size_t blocks = (rows + R - 1) / R;
  if (rows * cols < (std::size_t(1) << 16)) body(0, blocks, 0);
  else host.parallel_for(blocks, body);
}

// True where a 3x3 conv runs by Winograd's F(4x4, 3x3) (winograd.hpp): its geometry, and fp32 or
// double (bf16 keeps its GEMMs on im2col).
template <class T>
bool winograd_runs(const Host& host, const ConvGeometry& g) {
  if constexpr (std::is_same_v<T, float>)
    if (host.precision() != HostPrecision::fp32) return false;
  return winograd::applies(g);
}

// True where a 3x3 conv's backward (and forward: direct_bf16_forward) runs directly from the padded grid
// (conv3x3_bf16.hpp): its geometry, at precision bf16 (on AMX tiles, or by VDPBF16PS where the Host has
// none), in a translation unit compiled with their code.
template <class T>
bool direct_bf16_runs(const Host& host, const ConvGeometry& g) {
  if constexpr (std::is_same_v<T, float> && FUSEDP_HOST_AVX512_BF16)
    return host.precision() == HostPrecision::bf16 && bf16::detail::vector_packing() && conv3x3_bf16::applies(g);
  return false;
}
// --- Direct convolution with the output channels in the vector lanes -----------------------------
// For few output channels (LeNet: 6 and 16) im2col writes K values per output pixel to be used by only
// O multiply-adds, and costs more than the product (65% of LeNet's second conv forward). Here each
// input value is broadcast from the (padded) image straight into the multiply-adds: a register tile
// holds R output pixels of one row by NV vectors of W channels, and each tap (c, ky, kx) costs NV
// weight loads and R x NV FMAs. The tile is then written transposed into the NCHW output.

// Output channels per vector for O channels: the target's vector, or a narrower one for O below half
// of it (6 channels in 8 lanes rather than 16).
template <class T>
constexpr std::size_t direct_width(std::size_t o) {
  std::size_t w = simd::lanes<T>;
  while (w > 1 && w / 2 >= o) w /= 2;
  return w;
}

// True where the direct path runs: stride 1 (any padding), kernels up to 7 and at most two vectors
// of output channels.
template <class T>
constexpr bool use_direct(const ConvGeometry& g) {
  return FUSEDP_VECTOR_EXTENSIONS && g.stride == 1 && g.kernel <= 7 &&
         std::size_t(g.out_channels) <= 2 * simd::lanes<T>;
}

// The forward: as the backward, but by VDPBF16PS only on planes conv3x3_bf16::min_width or wider, where
// no samples share a grid, or where the GEMM would not take it (few output channels: use_direct's fp32).
// (AMD EPYC Zen 4, 2 threads, stage_bench --net resnet18 --precision bf16, medians of 3 alternating runs,
// direct against the im2col GEMM: the forward of the 32 x 32 and 16 x 16 convs 61.6 / 66.2 and 42.2 /
// 44.4 ms, of the 8 x 8 and 4 x 4 ones 49.1 / 43.4 and 58.7 / 53.8, where 19% and 38% of the grid's
// positions are thrown; the backward's direct products won on every plane, the step's stages 788
// against 894 ms in all.)
template <class T>
bool direct_bf16_forward(const Host& host, const ConvGeometry& g) {
  return direct_bf16_runs<T>(host, g) &&
         (host.bf16_tiles() || g.out_w >= conv3x3_bf16::min_width || use_direct<T>(g));
}

// Calls f.template operator()<W, NV>() with the channel vectors of the direct path for O channels.
template <class T, class F>
void with_direct_width(std::size_t outs, F&& f) {
  constexpr std::size_t L = simd::lanes<T>;
  if (outs > L) f.template operator()<L, 2>();
  else if (direct_width<T>(outs) == L) f.template operator()<L, 1>();
  else if constexpr (L >= 2) {
    if (direct_width<T>(outs) == L / 2) f.template operator()<L / 2, 1>();
    else if constexpr (L >= 4) {
      if (direct_width<T>(outs) == L / 4) f.template operator()<L / 4, 1>();
      else f.template operator()<(L >= 8 ? L / 8 : 1), 1>();
    }
  }
}

// Calls f.template operator()<K>() for a kernel size 1..7.
template <class F>
void with_kernel(int k, F&& f) {
  switch (k) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    default: return f.template operator()<7>();
  }
}

// tile[r][0, NV*W) = sum over taps of image(c, ky, r + kx) * wt[tap][...], for R pixels starting at
// `at` (the padded image at channel 0, the tile's first input row and column).
template <class T, std::size_t W, std::size_t NV, std::size_t R>
FUSEDP_ALWAYS_INLINE void direct_tile(const T* FUSEDP_RESTRICT at, std::size_t plane, std::size_t wp, int channels,
                                      int kernel, const T* FUSEDP_RESTRICT wt, T* FUSEDP_RESTRICT tile) {
  using V = simd::vec_n<T, W>;
  V acc[R][NV];
  FUSEDP_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    FUSEDP_UNROLL(2)
    for (std::size_t v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int c = 0; c < channels; ++c)
    for (int ky = 0; ky < kernel; ++ky) {
      const T* row = at + std::size_t(c) * plane + std::size_t(ky) * wp;
      for (int kx = 0; kx < kernel; ++kx, wt += NV * W) {
        V wv[NV];
        FUSEDP_UNROLL(2)
        for (std::size_t v = 0; v < NV; ++v) wv[v] = simd::load_as<V>(wt + v * W);
        FUSEDP_UNROLL(16)
        for (std::size_t r = 0; r < R; ++r) {
          const T a = row[r + std::size_t(kx)];
          FUSEDP_UNROLL(2)
          for (std::size_t v = 0; v < NV; ++v) acc[r][v] += a * wv[v];
        }
      }
    }
  FUSEDP_UNROLL(16)
  for (std::size_t r = 0; r < R; ++r)
    FUSEDP_UNROLL(2)
    for (std::size_t v = 0; v < NV; ++v) simd::store(tile + (r * NV + v) * W, acc[r][v]);
}

// One sample: y (O x P) before the epilogue, which epi(o, p0, &y[o][p0], count) applies per row
// segment. `src`: the padded input; wt: the weights as (K x NV*W), channels zero-padded.
template <class T, std::size_t W, std::size_t NV, class Epi>
FUSEDP_BROADCAST_LOADS void direct_forward_sample(const ConvGeometry& g, const T* src, const T* wt, T* y, const Epi& epi) {
  const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad);
  const std::size_t plane = (std::size_t(g.in_h) + 2 * std::size_t(g.pad)) * wp;
  const std::size_t outs = std::size_t(g.out_channels), pixels = g.out_pixels(), out_w = std::size_t(g.out_w);
  // At most 24 accumulators: 16 pixels of one vector of channels, 8 of two.
  constexpr std::size_t most = NV == 1 ? 16 : 8;
  alignas(64) T tile[most * NV * W];
  for (std::size_t oy = 0; oy < std::size_t(g.out_h); ++oy) {
    std::size_t ox = 0;
    auto segment = [&]<std::size_t R>() {
      direct_tile<T, W, NV, R>(src + oy * wp + ox, plane, wp, g.in_channels, g.kernel, wt, tile);
      T* base = y + oy * out_w + ox;
      for (std::size_t o = 0; o < outs; ++o) {
        T* row = base + o * pixels;
        FUSEDP_UNROLL(16)
        for (std::size_t r = 0; r < R; ++r) row[r] = tile[r * NV * W + o];
        epi(o, oy * out_w + ox, row, R);
      }
      ox += R;
    };
    while (out_w - ox >= most) segment.template operator()<most>();
    if constexpr (most >= 16) if (out_w - ox >= 8) segment.template operator()<8>();
    if (out_w - ox >= 4) segment.template operator()<4>();
    if (out_w - ox >= 2) segment.template operator()<2>();
    if (out_w - ox >= 1) segment.template operator()<1>();
  }
}

// dzt (P x NV*W) = dz (O x P) transposed, channels zero-padded: the pixel-major gradient whose rows
// the direct weight gradient multiplies by broadcast image values.
template <class T, std::size_t W, std::size_t NV>
FUSEDP_NO_LIBCALL_LOOPS void transpose_dz(const T* FUSEDP_RESTRICT dz, std::size_t outs, std::size_t pixels,
                                          T* FUSEDP_RESTRICT dzt) {
  using V = simd::vec_n<T, W>;
  constexpr std::size_t NW = NV * W;
  for (std::size_t p0 = 0; p0 < pixels; p0 += W) {
    const std::size_t np = std::min(W, pixels - p0);
    FUSEDP_UNROLL(2)
    for (std::size_t v = 0; v < NV; ++v) {
      V blk[W];
      for (std::size_t r = 0; r < W; ++r) {
        const std::size_t o = v * W + r;
        if (o >= outs) {
          blk[r] = V{};
        } else if (np == W) {
          blk[r] = simd::load_as<V>(dz + o * pixels + p0);
        } else {
          alignas(sizeof(V)) T tmp[W] = {};
          for (std::size_t j = 0; j < np; ++j) tmp[j] = dz[o * pixels + p0 + j];
          blk[r] = simd::load_as<V>(tmp);
        }
      }
      simd::transpose<T, W>(blk);
      for (std::size_t j = 0; j < np; ++j) simd::store(dzt + (p0 + j) * NW + v * W, blk[j]);
    }
  }
}

// dwt[kx][0, NV*W) += sum over output pixels of image(c, oy + ky, ox + kx) * dzt[pixel] for the K
// taps of one (c, ky); `src` is the padded image at (c, ky, 0). K x NV accumulators in registers,
// each image value broadcast from memory.
template <class T, std::size_t W, std::size_t NV, std::size_t K>
FUSEDP_ALWAYS_INLINE void direct_dw_row(const T* FUSEDP_RESTRICT src, std::size_t wp, std::size_t out_h,
                                        std::size_t out_w, const T* FUSEDP_RESTRICT dzt, T* FUSEDP_RESTRICT dwt) {
  using V = simd::vec_n<T, W>;
  constexpr std::size_t NW = NV * W;
  V acc[K][NV];
  FUSEDP_UNROLL(8)
  for (std::size_t kx = 0; kx < K; ++kx)
    FUSEDP_UNROLL(2)
    for (std::size_t v = 0; v < NV; ++v) acc[kx][v] = V{};
  for (std::size_t oy = 0; oy < out_h; ++oy) {
    const T* row = src + oy * wp;
    const T* d = dzt + oy * out_w * NW;
    for (std::size_t ox = 0; ox < out_w; ++ox, d += NW) {
      V dv[NV];
      FUSEDP_UNROLL(2)
      for (std::size_t v = 0; v < NV; ++v) dv[v] = simd::load_as<V>(d + v * W);
      FUSEDP_UNROLL(8)
      for (std::size_t kx = 0; kx < K; ++kx) {
        const T a = row[ox + kx];
        FUSEDP_UNROLL(2)
        for (std::size_t v = 0; v < NV; ++v) acc[kx][v] += a * dv[v];
      }
    }
  }
  FUSEDP_UNROLL(8)
  for (std::size_t kx = 0; kx < K; ++kx)
    FUSEDP_UNROLL(2)
    for (std::size_t v = 0; v < NV; ++v) {
      T* p = dwt + kx * NW + v * W;
      simd::store(p, V(simd::load_as<V>(p) + acc[kx][v]));
    }
}

// One sample's weight gradient, added to dwt (K_total x NV*W): `src` the padded input.
template <class T, std::size_t W, std::size_t NV, std::size_t K>
FUSEDP_BROADCAST_LOADS void direct_dw_sample(const ConvGeometry& g, const T* src, const T* dzt, T* dwt) {
  const std::size_t wp = std::size_t(g.in_w) + 2 * std::size_t(g.pad);
  const std::size_t plane = (std::size_t(g.in_h) + 2 * std::size_t(g.pad)) * wp;
  for (std::size_t c = 0; c < std::size_t(g.in_channels); ++c)
    for (std::size_t ky = 0; ky < K; ++ky)
      direct_dw_row<T, W, NV, K>(src + c * plane + ky * wp, wp, std::size_t(g.out_h), std::size_t(g.out_w), dzt,
                                 dwt + (c * K + ky) * K * NV * W);
}

}  // namespace detail

/// y = Epi(conv(x, w) + b) for `batch` samples; z receives the values before the epilogue when the
/// epilogue needs them in backward (else null). scratch: threads x ConvScratch{g}.per_thread() elements.
/// Evaluation of a conv and the BatchNorm after it: with `fold`, each value is normalized as that
/// BatchNorm would, then `add` (when given: values of y's layout, a residual block's shortcut) added,
/// before the epilogue. With `bf16_y` (float), y is stored as bf16 values (net/activation_storage.hpp):
/// each run rounded as it is written.
template <class Epi, class T>
void conv2d_forward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* w, const T* b,
                    const T* x, T* y, T* z, T* scratch, const BatchNormFold<T>* fold = nullptr,
                    const T* add = nullptr, bool bf16_y = false) {
  const std::size_t pixels = g.out_pixels(), patch = g.patch(), outs = std::size_t(g.out_channels);
  const ConvScratch layout{g};
  const std::size_t stride = layout.per_thread();
  // Sample yn's epilogue; with `round`, y stored as bf16 values, each run rounded as it is written (the
  // direct path, whose runs are a few pixels, rounds its samples whole instead: run by run, the
  // rounding cost LeNet's bf16 step 5%).
  auto epilogue = [&](T* yn, T* zn, bool round) {
    const T* addn = add ? add + (yn - y) : nullptr;
    return [=](std::size_t o, std::size_t, T* p, std::size_t cnt) {
      const T bias = b ? b[o] : T(0);  // no bias: Conv2d<..., no_bias>
      if (fold != nullptr) {
        // The folded BatchNorm (evaluation only: nothing is saved for backward).
        const BatchNormChannel<T> ch = fold->channel(o);
        const T* ap = addn ? addn + (p - yn) : nullptr;
        for (std::size_t j = 0; j < cnt; ++j) {
          const T v = ch.normalize(p[j] + bias);
          p[j] = Epi::apply(ap ? v + ap[j] : v);
        }
      } else if constexpr (Epi::saves_input) {
        T* zp = zn + (p - yn);
        for (std::size_t j = 0; j < cnt; ++j) {
          zp[j] = p[j] + bias;
          p[j] = Epi::apply(zp[j]);
        }
      } else {
        for (std::size_t j = 0; j < cnt; ++j) p[j] = Epi::apply(p[j] + bias);
      }
      round_run_if(round, p, cnt);
    };
  };
  if (detail::winograd_runs<T>(host, g)) {
    winograd::conv3x3(host, g, batch, w, false, x, y, scratch, [&](std::size_t n) {
      return epilogue(y + n * g.out_size(), z ? z + n * g.out_size() : nullptr, bf16_y);
    });
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (detail::direct_bf16_forward<T>(host, g)) {
      conv3x3_bf16::conv3x3(host, g, batch, w, x, y, scratch, [&](std::size_t n) {
        return epilogue(y + n * g.out_size(), z ? z + n * g.out_size() : nullptr, bf16_y);
      });
      return;
    }
  }
  if constexpr (FUSEDP_VECTOR_EXTENSIONS) {
    if (detail::use_direct<T>(g)) {
      detail::with_direct_width<T>(outs, [&]<std::size_t W, std::size_t NV>() {
        // W^T (K x NV*W), channels zero-padded: thread 0's packed-weight scratch, read by all.
        T* wt = scratch;
        for (std::size_t k = 0; k < patch; ++k)
          for (std::size_t o = 0; o < NV * W; ++o) wt[k * NV * W + o] = o < outs ? w[o * patch + k] : T(0);
        host.parallel_for(batch, [&](std::size_t n0, std::size_t n1, int thread) {
          T* padded = scratch + std::size_t(thread + 1) * stride - layout.padded();
          for (std::size_t n = n0; n < n1; ++n) {
            const T* xn = x + n * g.in_size();
            if (g.pad > 0) pad_input(g, xn, padded);
            T* yn = y + n * g.out_size();
            detail::direct_forward_sample<T, W, NV>(g, g.pad > 0 ? padded : xn, wt, yn,
                                                    epilogue(yn, z ? z + n * g.out_size() : nullptr, false));
            round_run_if(bf16_y, yn, g.out_size());
          }
        });
      });
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (host.precision() != HostPrecision::fp32) {
      // On AMX, small planes' samples side by side (tile_group): their product goes to the first col
      // region, then to each sample's y through its epilogue.
      const bool tiles = host.bf16_tiles();
      const std::size_t group = tiles && bf16::detail::vector_packing() &&
                                        outs * detail::tile_group(pixels) * pixels <= layout.col()
                                    ? detail::tile_group(pixels)
                                    : 1;
      bf16::with_tile(bf16::choose_tile(outs, group * pixels, patch, tiles), [&]<class S>() {
        // The pairs live in the float scratch: weights where fp32's packed weights go, each thread's
        // pair panels in its second col region (im2col_pairs writes them straight from the input; only
        // without AVX-512 packing does an fp32 im2col matrix go in the first).
        auto* packed_w = reinterpret_cast<bf16::Pair*>(scratch);
        bf16::pack_a<S>(row_major(w, patch), 0, outs, 0, patch, packed_w);
        host.parallel_for(batch, [&](std::size_t n0, std::size_t n1, int thread) {
          T* col = scratch + std::size_t(thread) * stride + layout.packed_weights();
          auto* panels = reinterpret_cast<bf16::Pair*>(col + layout.col());
          T* padded = scratch + std::size_t(thread + 1) * stride - layout.padded();
          if (group == 1) {
            for (std::size_t n = n0; n < n1; ++n) {
              T* yn = y + n * g.out_size();
              im2col_pairs<S>(g, x + n * g.in_size(), panels, col, padded);
              bf16::gemm_packed<S>(host.precision(), outs, pixels, patch, packed_w, panels, yn, pixels, false,
                                   epilogue(yn, z ? z + n * g.out_size() : nullptr, bf16_y));
            }
            return;
          }
          for (std::size_t n = n0; n < n1; n += group) {
            const std::size_t count = std::min(group, n1 - n), columns = count * pixels;
            for (std::size_t s = 0; s < count; ++s)
              im2col_pairs<S>(g, x + (n + s) * g.in_size(), panels, col, padded, s * pixels, columns);
            bf16::gemm_packed<S>(host.precision(), outs, columns, patch, packed_w, panels, col, columns, false);
            for (std::size_t s = 0; s < count; ++s) {
              T* yn = y + (n + s) * g.out_size();
              const auto epi = epilogue(yn, z ? z + (n + s) * g.out_size() : nullptr, bf16_y);
              for (std::size_t o = 0; o < outs; ++o) {
                simd::copy(yn + o * pixels, col + o * columns + s * pixels, pixels);
                epi(o, 0, yn + o * pixels, pixels);
              }
            }
          }
        });
      });
      return;
    }
  }
  with_tile(choose_tile<T>(outs, pixels), [&]<class S>() {
    T* packed_w = scratch;  // thread 0's, read by all
    pack_a<S>(row_major(w, patch), 0, outs, 0, patch, packed_w);
    host.parallel_for(batch, [&](std::size_t n0, std::size_t n1, int thread) {
      T* panels = scratch + std::size_t(thread) * stride + layout.packed_weights();
      T* padded = scratch + std::size_t(thread + 1) * stride - layout.padded();
      for (std::size_t n = n0; n < n1; ++n) {
        T* yn = y + n * g.out_size();
        im2col(g, x + n * g.in_size(), panels, S::template nr<T>, padded);
        gemm_packed<S>(outs, pixels, patch, packed_w, panels, yn, pixels, false,
                       epilogue(yn, z ? z + n * g.out_size() : nullptr, bf16_y));
      }
    });
  });
}

/// Backward of conv2d_forward. dy is overwritten with the gradient before the epilogue. dw and db are
/// set (not accumulated); dx is skipped when null (the first layer of a network), and with `bf16_dx`
/// (float) stored as bf16 values, each sample's rounded as it is written.
template <class Epi, class T>
void conv2d_backward(const Host& host, const ConvGeometry& g, std::size_t batch, const T* w, const T* x, const T* y,
                     const T* z, T* dy, T* dx, T* dw, T* db, T* scratch, bool bf16_dx = false) {
  const std::size_t pixels = g.out_pixels(), patch = g.patch(), outs = std::size_t(g.out_channels);
  const ConvScratch layout{g};
  const std::size_t stride = layout.per_thread(), weights = layout.packed_weights();
  // Each sample's dx as the Winograd product writes it: rounded run by run where bf16_dx.
  const auto stores_dx = [bf16_dx](std::size_t) {
    return [bf16_dx](std::size_t, std::size_t, T* p, std::size_t count) { round_run_if(bf16_dx, p, count); };
  };
  const bool direct_bf16 = detail::direct_bf16_runs<T>(host, g);
  if (direct_bf16 || detail::winograd_runs<T>(host, g)) {
    // By Winograd (or at bf16 directly from the padded grid) over the whole batch: dz and the bias
    // gradient per sample first, then the weight and input gradients.
    const auto threads = std::size_t(host.threads());
    host.parallel_for(threads, [&](std::size_t, std::size_t, int thread) {
      T* db_t = scratch + std::size_t(thread) * stride;
      simd::zero(db_t, outs);
      for (std::size_t n = batch * std::size_t(thread) / threads; n < batch * (std::size_t(thread) + 1) / threads; ++n) {
        detail::sample_dz<Epi>(g, n, y, z, dy, db ? db_t : nullptr);
      }
    });
    if (db) detail::reduce_threads(host, scratch, stride, 0, outs, db);
    if constexpr (std::is_same_v<T, float>) {
      if (direct_bf16) {
        conv3x3_bf16::weight_gradient3x3(host, g, batch, x, dy, dw, scratch);
        if (dx) conv3x3_bf16::input_gradient3x3(host, g, batch, w, dy, dx, scratch, bf16_dx);
        return;
      }
    }
    winograd::weight_gradient3x3(host, g, batch, x, dy, dw, scratch);
    if (dx) winograd::conv3x3(host, winograd::transposed(g), batch, w, true, dy, dx, scratch, stores_dx);
    return;
  }
  const std::size_t col_at = weights, dcol_at = col_at + layout.col(), dz_at = dcol_at + layout.col();
  const std::size_t dw_at = dz_at + layout.dz_panels(), db_at = dw_at + layout.dw();
  const int threads = host.threads();
  const bool direct = detail::use_direct<T>(g);
  bool fp32 = true;
  if constexpr (std::is_same_v<T, float>) fp32 = host.precision() == HostPrecision::fp32;
  // The weight gradient, per thread: dW^T (K x O) += col (K x P) dz^T (P x O) with the im2col matrix
  // read in place rather than transposed into packed panels (one core, gemm_bench: CIFAR conv2's
  // 128 x 576 x 256 137 -> 166 GFLOP/s, ResNet-18's stages 107 -> 154, 136 -> 164, 156 -> 162); but
  // dW (O x K) += dz (O x P) col^T (P x K) on planes under 64 pixels, whose products are bound by
  // reading and writing the accumulated dW (ResNet-18's last stage: its 3x3 convs' backward 178 -> 214
  // ms a step in dW^T, benchmarks/RESULTS.md), by dot products where a side is narrow (gemm_nt), and
  // at bf16; the direct path keeps a dW^T with channels in the lanes. `width`: the columns of a dW^T,
  // 0 for a dW.
  const bool nt = use_nt(outs, patch, pixels);
  const bool col_in_place = !direct && fp32 && !nt && pixels >= 64;
  std::size_t width = col_in_place ? outs : 0;
  auto weight_gradient = [&](const T* dzn, const T* xn, T* col, T* dz_panels, T* padded, T* dw_t) {
    if constexpr (FUSEDP_VECTOR_EXTENSIONS) {
      if (direct) {
        detail::with_direct_width<T>(outs, [&]<std::size_t W, std::size_t NV>() {
          detail::transpose_dz<T, W, NV>(dzn, outs, pixels, dz_panels);
          if (g.pad > 0) pad_input(g, xn, padded);
          detail::with_kernel(g.kernel, [&]<std::size_t K>() {
            detail::direct_dw_sample<T, W, NV, K>(g, g.pad > 0 ? padded : xn, dz_panels, dw_t);
          });
        });
        return;
      }
    }
    if (!g.direct()) im2col(g, xn, col, pixels, padded);
    const T* cols = g.direct() ? xn : col;
    if constexpr (std::is_same_v<T, float>) {
      if (host.precision() != HostPrecision::fp32) {
        bf16::gemm(host.precision(), host.bf16_tiles(), outs, patch, pixels, row_major<T>(dzn, pixels), MatrixRef<T>{cols, 1, pixels},
                   dw_t, patch, true);
        return;
      }
    }
    // dz and col both run along the pixels: in place by dot products where a side is narrow.
    if (nt) gemm_nt(outs, patch, pixels, dzn, pixels, cols, pixels, dw_t, patch, true);
    else if (col_in_place)
      gemm_a_in_place(patch, outs, pixels, row_major(cols, pixels), MatrixRef<T>{dzn, 1, pixels}, dw_t, outs, true);
    else gemm(outs, patch, pixels, row_major<T>(dzn, pixels), MatrixRef<T>{cols, 1, pixels}, dw_t, patch, true);
  };
  if (direct) detail::with_direct_width<T>(outs, [&]<std::size_t W, std::size_t NV>() { width = NV * W; });
  const bool bf16_groups = !fp32 && !direct && detail::weight_gradient_group(pixels) > 1;
  // On AMX the input gradients of a weight gradient's group too, tile_group samples at a time (a
  // product of up to 64 columns, whose dcol the region of one sample's holds: P + max_tile_cols).
  bool tiles = false;
  if constexpr (std::is_same_v<T, float>) tiles = !fp32 && host.bf16_tiles();
  const std::size_t dx_group = bf16_groups && tiles ? detail::tile_group(pixels) : 1;  // <= the dW group
  // Each thread's samples with its own scratch; input_gradient(dz, ld, columns, dz_panels, target)
  // computes dcol (K x columns) = W^T (K x O) dz (O x columns, rows ld apart) into target. One index per
  // thread: parallel_for lets the caller take over the index of a late worker.
  auto per_thread = [&](const auto& input_gradient) {
    host.parallel_for(std::size_t(threads), [&](std::size_t, std::size_t, int thread) {
      T* own = scratch + std::size_t(thread) * stride;
      T* col = own + col_at;
      T* dcol = own + dcol_at;
      T* dz_panels = own + dz_at;
      T* dw_t = own + dw_at;
      T* db_t = own + db_at;
      T* padded = own + stride - layout.padded();
      simd::zero(dw_t, width > 0 ? patch * width : outs * patch);
      simd::zero(db_t, outs);
      const std::size_t n0 = batch * std::size_t(thread) / std::size_t(threads);
      const std::size_t n1 = batch * (std::size_t(thread) + 1) / std::size_t(threads);
      // At bf16 on small planes, the weight gradient of `group` samples at once: dW += [dz_0 .. dz_g]
      // [col_0 .. col_g]^T, one pass over dW a group instead of one a sample.
      const std::size_t group = bf16_groups ? std::min(detail::weight_gradient_group(pixels), n1 - n0) : 1;
      float* group_cols = nullptr;
      float* group_dz = nullptr;
      if (group > 1) {
        auto& buffers = detail::sample_group();
        buffers.cols.reserve_discard(patch * group * pixels);
        buffers.dz.reserve_discard(outs * group * pixels);
        group_cols = buffers.cols.data();
        group_dz = buffers.dz.data();
      }
      std::size_t grouped = 0;
      for (std::size_t n = n0; n < n1; ++n) {
        T* dzn = detail::sample_dz<Epi>(g, n, y, z, dy, db ? db_t : nullptr);
        const T* xn = x + n * g.in_size();
        if constexpr (std::is_same_v<T, float>) {
          if (group > 1) {
            const std::size_t ld = group * pixels;
            im2col(g, xn, group_cols + grouped * pixels, pixels, padded, ld);
            for (std::size_t o = 0; o < outs; ++o) simd::copy(group_dz + o * ld + grouped * pixels, dzn + o * pixels, pixels);
            if (++grouped == group || n + 1 == n1) {
              bf16::gemm(host.precision(), host.bf16_tiles(), outs, patch, grouped * pixels, row_major<T>(group_dz, ld),
                         MatrixRef<T>{group_cols, 1, ld}, dw_t, patch, true);
              // The group's input gradients, dx_group samples a product: dcol (K x count P), then each
              // sample's block of columns into its dx.
              for (std::size_t s0 = 0; dx && dx_group > 1 && s0 < grouped; s0 += dx_group) {
                const std::size_t count = std::min(dx_group, grouped - s0), columns = count * pixels;
                input_gradient(group_dz + s0 * pixels, ld, columns, dz_panels, dcol);
                for (std::size_t s = 0; s < count; ++s) {
                  T* dxs = dx + (n + 1 - grouped + s0 + s) * g.in_size();
                  if (!g.direct()) col2im(g, dcol + s * pixels, dxs, padded, columns);
                  else
                    for (std::size_t c = 0; c < patch; ++c)
                      simd::copy(dxs + c * pixels, dcol + c * columns + s * pixels, pixels);
                  round_run_if(bf16_dx, dxs, g.in_size());
                }
              }
              grouped = 0;
            }
          }
        }
        if (group == 1) weight_gradient(dzn, xn, col, dz_panels, padded, dw_t);
        if (dx && (group == 1 || dx_group == 1)) {
          T* dxn = dx + n * g.in_size();
          T* target = g.direct() ? dxn : dcol;
          input_gradient(dzn, pixels, pixels, dz_panels, target);
          if (!g.direct()) col2im(g, dcol, dxn, padded);
          round_run_if(bf16_dx, dxn, g.in_size());
        }
      }
    });
  };
  // W^T (K x O) is W read column-major, packed once (thread 0's scratch, read by all).
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (host.precision() != HostPrecision::fp32) {
      bf16::with_tile(bf16::choose_tile(patch, dx_group * pixels, outs, host.bf16_tiles()), [&]<class S>() {
        auto* packed_wt = reinterpret_cast<bf16::Pair*>(scratch);
        if (dx) bf16::pack_a<S>(MatrixRef<T>{w, 1, patch}, 0, patch, 0, outs, packed_wt);
        per_thread([&](const T* dzn, std::size_t ld, std::size_t columns, T* dz_panels, T* target) {
          auto* panels = reinterpret_cast<bf16::Pair*>(dz_panels);
          bf16::pack_b<S>(row_major<T>(dzn, ld), 0, outs, 0, columns, panels);
          bf16::gemm_packed<S>(host.precision(), patch, columns, outs, packed_wt, panels, target, columns, false);
        });
      });
      done = true;
    }
  }
  if (!done)
    with_tile(choose_tile<T>(patch, pixels), [&]<class S>() {
      T* packed_wt = scratch;
      if (dx) pack_a<S>(MatrixRef<T>{w, 1, patch}, 0, patch, 0, outs, packed_wt);
      per_thread([&](const T* dzn, std::size_t ld, std::size_t columns, T* dz_panels, T* target) {
        pack_b<S>(row_major<T>(dzn, ld), 0, outs, 0, columns, dz_panels);
        gemm_packed<S>(patch, columns, outs, packed_wt, dz_panels, target, columns, false);
      });
    });
  if (width > 0) detail::reduce_threads_transposed(host, scratch, stride, dw_at, width, outs, patch, dw);
  else detail::reduce_threads(host, scratch, stride, dw_at, outs * patch, dw);
  if (db) detail::reduce_threads(host, scratch, stride, db_at, outs, db);
}

// The instances a build may compile once (kernels/host/instances.hpp).
#define FUSEDP_HOST_CONV2D_INSTANCE(prefix, Epi, T)                                                          \
  prefix template void conv2d_forward<Epi, T>(const Host&, const ConvGeometry&, std::size_t, const T*, const T*, \
                                              const T*, T*, T*, T*, const BatchNormFold<T>*, const T*, bool);  \
  prefix template void conv2d_backward<Epi, T>(const Host&, const ConvGeometry&, std::size_t, const T*, const T*, \
                                               const T*, const T*, T*, T*, T*, T*, T*, bool);
#if FUSEDP_HOST_KERNELS_PREBUILT
FUSEDP_HOST_KERNEL_INSTANCES(FUSEDP_HOST_CONV2D_INSTANCE, extern)
#endif

}  // namespace fusedp::kernels::host
