#pragma once
// Packed, register-blocked GEMM for the Host space: C = op(A) op(B) (+ C), with an epilogue called on
// each finished tile while it is still in cache. Vectorized with GCC/Clang vector extensions at the
// width the compiler targets (AVX-512, AVX2, SSE, NEON), with a scalar path for other compilers.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace fusedp::kernels::host {

/// Strided read-only matrix: element (i, j) is data[i * row_stride + j * col_stride]. A transposed
/// operand is the same memory with the strides swapped.
template <class T>
struct MatrixRef {
  const T* data;
  std::size_t row_stride;
  std::size_t col_stride;
  [[nodiscard]] MatrixRef transposed() const { return {data, col_stride, row_stride}; }
};
/// A row-major (rows x cols) matrix.
template <class T>
MatrixRef<T> row_major(const T* data, std::size_t cols) { return {data, cols, 1}; }

/// An epilogue that does nothing.
struct NoEpilogue {
  template <class T>
  void operator()(std::size_t, std::size_t, T*, std::size_t) const {}
};

namespace detail {

#if defined(__AVX512F__)
inline constexpr std::size_t vector_bytes = 64;
#elif defined(__AVX__)
inline constexpr std::size_t vector_bytes = 32;
#else
inline constexpr std::size_t vector_bytes = 16;
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define FUSEDP_VECTOR_EXTENSIONS 1
template <class T>
using vec [[gnu::vector_size(vector_bytes)]] = T;
#else
#define FUSEDP_VECTOR_EXTENSIONS 0
#endif

// Register tile: MR rows by two vectors of columns. 6 x 2 vectors keeps 12 accumulators live, which
// covers the FMA latency times throughput (4 x 2) and fits the 16 registers of AVX2 as well as the 32
// of AVX-512 and NEON.
template <class T>
struct Tile {
  static constexpr std::size_t lanes = vector_bytes / sizeof(T);
  static constexpr std::size_t mr = 6;
  static constexpr std::size_t nr = 2 * lanes;
  // Cache blocks: an A block (mc x kc) stays in L2, a B panel (kc x nr) in L1.
  static constexpr std::size_t kc = 256;
  static constexpr std::size_t mc = 120;
  static constexpr std::size_t nc = 3072;
};

template <class T>
FUSEDP_ALWAYS_INLINE void micro_kernel(std::size_t kc, const T* FUSEDP_RESTRICT a, const T* FUSEDP_RESTRICT b,
                                       T* FUSEDP_RESTRICT out /* mr x nr, row-major */) {
  using Tl = Tile<T>;
#if FUSEDP_VECTOR_EXTENSIONS
  using V = vec<T>;
  V acc[Tl::mr][2] = {};
  for (std::size_t k = 0; k < kc; ++k) {
    V b0, b1;
    std::memcpy(&b0, b, sizeof(V));
    std::memcpy(&b1, b + Tl::lanes, sizeof(V));
    for (std::size_t i = 0; i < Tl::mr; ++i) {
      acc[i][0] += a[i] * b0;
      acc[i][1] += a[i] * b1;
    }
    a += Tl::mr;
    b += Tl::nr;
  }
  for (std::size_t i = 0; i < Tl::mr; ++i) {
    std::memcpy(out + i * Tl::nr, &acc[i][0], sizeof(V));
    std::memcpy(out + i * Tl::nr + Tl::lanes, &acc[i][1], sizeof(V));
  }
#else
  T acc[Tl::mr][Tl::nr] = {};
  for (std::size_t k = 0; k < kc; ++k, a += Tl::mr, b += Tl::nr)
    for (std::size_t i = 0; i < Tl::mr; ++i)
      for (std::size_t j = 0; j < Tl::nr; ++j) acc[i][j] += a[i] * b[j];
  for (std::size_t i = 0; i < Tl::mr; ++i)
    for (std::size_t j = 0; j < Tl::nr; ++j) out[i * Tl::nr + j] = acc[i][j];
#endif
}

// Packs rows [i0, i0+m) x cols [k0, k0+kc) of A into panels of mr rows, k-major, zero-padded.
template <class T>
void pack_a(MatrixRef<T> a, std::size_t i0, std::size_t m, std::size_t k0, std::size_t kc, T* FUSEDP_RESTRICT dst) {
  constexpr std::size_t mr = Tile<T>::mr;
  for (std::size_t p = 0; p < m; p += mr) {
    const std::size_t rows = std::min(mr, m - p);
    const T* src = a.data + (i0 + p) * a.row_stride + k0 * a.col_stride;
    if (a.col_stride == 1) {
      for (std::size_t k = 0; k < kc; ++k) {
        for (std::size_t i = 0; i < rows; ++i) dst[k * mr + i] = src[i * a.row_stride + k];
        for (std::size_t i = rows; i < mr; ++i) dst[k * mr + i] = T(0);
      }
    } else {
      for (std::size_t k = 0; k < kc; ++k) {
        const T* s = src + k * a.col_stride;
        for (std::size_t i = 0; i < rows; ++i) dst[k * mr + i] = s[i * a.row_stride];
        for (std::size_t i = rows; i < mr; ++i) dst[k * mr + i] = T(0);
      }
    }
    dst += kc * mr;
  }
}

// Packs rows [k0, k0+kc) x cols [j0, j0+n) of B into panels of nr columns, k-major, zero-padded.
template <class T>
void pack_b(MatrixRef<T> b, std::size_t k0, std::size_t kc, std::size_t j0, std::size_t n, T* FUSEDP_RESTRICT dst) {
  constexpr std::size_t nr = Tile<T>::nr;
  for (std::size_t q = 0; q < n; q += nr) {
    const std::size_t cols = std::min(nr, n - q);
    const T* src = b.data + k0 * b.row_stride + (j0 + q) * b.col_stride;
    if (b.col_stride == 1) {
      for (std::size_t k = 0; k < kc; ++k) {
        std::memcpy(dst + k * nr, src + k * b.row_stride, cols * sizeof(T));
        for (std::size_t j = cols; j < nr; ++j) dst[k * nr + j] = T(0);
      }
    } else {
      for (std::size_t j = 0; j < cols; ++j) {
        const T* s = src + j * b.col_stride;
        for (std::size_t k = 0; k < kc; ++k) dst[k * nr + j] = s[k * b.row_stride];
      }
      for (std::size_t k = 0; k < kc; ++k)
        for (std::size_t j = cols; j < nr; ++j) dst[k * nr + j] = T(0);
    }
    dst += kc * nr;
  }
}

}  // namespace detail

/// Packing memory of one thread. Grows on first use; reused by every later call (no allocation in a
/// steady-state train step).
template <class T>
struct GemmScratch {
  HostBuffer<T> a, b;
  T tile[detail::Tile<T>::mr * detail::Tile<T>::nr];
};

/// The calling thread's scratch.
template <class T>
GemmScratch<T>& thread_scratch() {
  thread_local GemmScratch<T> s;
  return s;
}

/// C[m x n] (row stride ldc) = A[m x k] B[k x n], plus the old C when `accumulate`. After the last
/// k-block of each register tile, calls epi(i, j0, &C[i][j0], count) for each of its rows, so bias and
/// activation are applied while the tile is in L1.
template <class T, class Epi = NoEpilogue>
void gemm(std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c, std::size_t ldc,
          bool accumulate, const Epi& epi = {}) {
  using Tl = detail::Tile<T>;
  if (m == 0 || n == 0) return;
  auto& s = thread_scratch<T>();
  if (k == 0) {
    for (std::size_t i = 0; i < m; ++i) {
      if (!accumulate) std::fill(c + i * ldc, c + i * ldc + n, T(0));
      epi(i, 0, c + i * ldc, n);
    }
    return;
  }
  s.a.reserve_discard(Tl::mc * Tl::kc);
  s.b.reserve_discard(Tl::kc * Tl::nc);
  for (std::size_t j0 = 0; j0 < n; j0 += Tl::nc) {
    const std::size_t nc = std::min(Tl::nc, n - j0);
    for (std::size_t k0 = 0; k0 < k; k0 += Tl::kc) {
      const std::size_t kc = std::min(Tl::kc, k - k0);
      const bool first = k0 == 0, last = k0 + kc == k;
      detail::pack_b(b, k0, kc, j0, nc, s.b.data());
      for (std::size_t i0 = 0; i0 < m; i0 += Tl::mc) {
        const std::size_t mc = std::min(Tl::mc, m - i0);
        detail::pack_a(a, i0, mc, k0, kc, s.a.data());
        for (std::size_t jr = 0; jr < nc; jr += Tl::nr) {
          const std::size_t cols = std::min(Tl::nr, nc - jr);
          for (std::size_t ir = 0; ir < mc; ir += Tl::mr) {
            const std::size_t rows = std::min(Tl::mr, mc - ir);
            detail::micro_kernel(kc, s.a.data() + ir * kc, s.b.data() + jr * kc, s.tile);
            for (std::size_t i = 0; i < rows; ++i) {
              T* dst = c + (i0 + ir + i) * ldc + j0 + jr;
              const T* src = s.tile + i * Tl::nr;
              if (first && !accumulate) {
                for (std::size_t j = 0; j < cols; ++j) dst[j] = src[j];
              } else {
                for (std::size_t j = 0; j < cols; ++j) dst[j] += src[j];
              }
              if (last) epi(i0 + ir + i, j0 + jr, dst, cols);
            }
          }
        }
      }
    }
  }
}

/// gemm() split over the threads of `host` by blocks of columns (or rows, when there are few
/// columns). Each thread owns disjoint blocks of C, so the result does not depend on the split.
template <class T, class Epi = NoEpilogue>
void gemm(const Host& host, std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c,
          std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  using Tl = detail::Tile<T>;
  const std::size_t col_blocks = (n + Tl::nr - 1) / Tl::nr, row_blocks = (m + Tl::mr - 1) / Tl::mr;
  const auto threads = std::size_t(host.threads());
  if (threads == 1 || m * n * k < 32768) {
    gemm(m, n, k, a, b, c, ldc, accumulate, epi);
  } else if (col_blocks >= threads || col_blocks >= row_blocks) {
    host.parallel_for(col_blocks, [&](std::size_t q0, std::size_t q1, int) {
      const std::size_t j0 = q0 * Tl::nr, j1 = std::min(n, q1 * Tl::nr);
      const MatrixRef<T> bs{b.data + j0 * b.col_stride, b.row_stride, b.col_stride};
      gemm(m, j1 - j0, k, a, bs, c + j0, ldc, accumulate,
           [&](std::size_t i, std::size_t j, T* p, std::size_t cnt) { epi(i, j0 + j, p, cnt); });
    });
  } else {
    host.parallel_for(row_blocks, [&](std::size_t p0, std::size_t p1, int) {
      const std::size_t i0 = p0 * Tl::mr, i1 = std::min(m, p1 * Tl::mr);
      const MatrixRef<T> as{a.data + i0 * a.row_stride, a.row_stride, a.col_stride};
      gemm(i1 - i0, n, k, as, b, c + i0 * ldc, ldc, accumulate,
           [&](std::size_t i, std::size_t j, T* p, std::size_t cnt) { epi(i0 + i, j, p, cnt); });
    });
  }
}

}  // namespace fusedp::kernels::host
