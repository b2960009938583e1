#pragma once
// Packed, register-blocked GEMM for the Host space: C = op(A) op(B) (+ C), with an epilogue called on
// each finished tile while it is still in cache.
//
// Levels, as in BLIS: a register tile (micro_kernel: MR rows by NV vectors of columns, all
// accumulators in registers) runs over packed panels (A: MR rows, k-major; B: NV vectors of columns,
// k-major); macro_kernel walks the tiles of one packed block; gemm() blocks, packs and splits over
// threads. Operands that are reused (a convolution's weights, shared by every sample) can be packed
// once and handed to gemm_packed().
//
// Vectorized with GCC/Clang vector extensions at the width the compiler targets (AVX-512, AVX2, SSE,
// NEON), with a scalar path (vectors of one lane) for other compilers. The register tile is chosen per
// call among a few shapes that fit the target's register file, by the padding they waste.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>

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

/// A register tile: MR rows by NV vectors of columns; all MR x NV accumulators stay in registers.
/// @tparam MR rows of C per tile (rows of a packed A panel)
/// @tparam NV vectors of columns per tile (a packed B panel is NV vectors wide)
template <std::size_t MR, std::size_t NV>
struct TileShape {
  static constexpr std::size_t mr = MR;
  static constexpr std::size_t nv = NV;
  template <class T>
  static constexpr std::size_t nr = NV * simd::lanes<T>;
};

namespace detail {

// The tile shapes of this target and their speed relative to each other, measured on packed operands
// (benchmarks/gemm_bench.cpp's shapes; m 96, n 384, k 576 and m 48, n 192, k 64 and 256) on a Xeon
// (Sapphire Rapids, one core: 215 GFLOP/s zmm FMA peak). AVX-512: 12x2 183-192 GFLOP/s, 8x3 187-191,
// 6x4 183-190, 16x1 145-177 (16 broadcasts from the A panel per k outrun the loads). AVX2 (-mavx2
// -mfma; 16 registers, 12 accumulators at most): 6x2 116-126, 4x3 120-123, 3x4 114-116, 12x1 105-113.
// Each shape keeps its accumulators, NV B vectors and a broadcast A value in the register file.
struct ShapeInfo {
  std::size_t mr, nv;
  double speed;
};
#if FUSEDP_VECTOR_EXTENSIONS
inline constexpr std::array<ShapeInfo, 4> shapes =
    simd::vector_registers >= 32 ? std::array<ShapeInfo, 4>{{{12, 2, 1.0}, {8, 3, 1.0}, {6, 4, 0.98}, {16, 1, 0.82}}}
                           : std::array<ShapeInfo, 4>{{{6, 2, 1.0}, {4, 3, 0.98}, {3, 4, 0.93}, {12, 1, 0.88}}};
#else
inline constexpr std::array<ShapeInfo, 4> shapes{{{4, 4, 1.0}, {8, 2, 0.95}, {2, 8, 0.95}, {16, 1, 0.9}}};
#endif

template <std::size_t S>
using shape_at = TileShape<shapes[S].mr, shapes[S].nv>;

constexpr std::size_t round_up(std::size_t x, std::size_t m) { return (x + m - 1) / m * m; }

}  // namespace detail

/// Bounds of every tile shape of every target, for sizing packed buffers without knowing T.
inline constexpr std::size_t max_tile_rows = 16;
inline constexpr std::size_t max_tile_cols = 64;
static_assert([] {
  for (const auto& s : detail::shapes)
    if (s.mr > max_tile_rows || s.nv * simd::lanes<float> > max_tile_cols) return false;
  return true;
}());

namespace detail {
// Index of the shape among `shapes` that wastes the least padded work on an m x n product, weighted by
// the shape's speed, for vectors of `lanes` columns.
template <std::size_t N>
constexpr std::size_t least_padded(const std::array<ShapeInfo, N>& shapes, std::size_t lanes, std::size_t m,
                                   std::size_t n) {
  std::size_t best = 0;
  double best_cost = 0;
  for (std::size_t s = 0; s < N; ++s) {
    const double cost =
        double(round_up(m, shapes[s].mr)) * double(round_up(n, shapes[s].nv * lanes)) / shapes[s].speed;
    if (s == 0 || cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// Calls f.template operator()<At<index>>() for a shape index 0..3 (At: a shape family's alias).
template <template <std::size_t> class At, class F>
FUSEDP_ALWAYS_INLINE decltype(auto) with_shape(std::size_t index, F&& f) {
  switch (index) {
    case 0: return f.template operator()<At<0>>();
    case 1: return f.template operator()<At<1>>();
    case 2: return f.template operator()<At<2>>();
    default: return f.template operator()<At<3>>();
  }
}
}  // namespace detail

/// Index of the tile shape for an m x n product: the least padded work, weighted by the shape's
/// speed. A pure function of (m, n) and the target, so packing and multiplying agree on it.
template <class T>
constexpr std::size_t choose_tile(std::size_t m, std::size_t n) {
  return detail::least_padded(detail::shapes, simd::lanes<T>, m, n);
}

/// Calls f.template operator()<TileShape<...>>() for tile shape `index` (see choose_tile).
template <class F>
FUSEDP_ALWAYS_INLINE decltype(auto) with_tile(std::size_t index, F&& f) {
  return detail::with_shape<detail::shape_at>(index, std::forward<F>(f));
}

/// Elements of an m x k A packed for shape S (whole panels of MR rows, plus slack for whole-vector
/// stores at the end).
template <class S, class T>
constexpr std::size_t packed_a_size(std::size_t m, std::size_t k) {
  return detail::round_up(m, S::mr) * k + simd::lanes<T>;
}
/// Elements of a k x n B packed for shape S.
template <class S, class T>
constexpr std::size_t packed_b_size(std::size_t k, std::size_t n) {
  return detail::round_up(n, S::template nr<T>) * k;
}

namespace detail {

// Writes the first rows x cols of a tile held in `tile` (row stride NR) to C, added to C when load_c:
// an edge tile's way out of the registers.
template <std::size_t NR, class T>
FUSEDP_ALWAYS_INLINE void store_tile(const T* tile, T* c, std::size_t ldc, std::size_t rows, std::size_t cols,
                                     bool load_c) {
  for (std::size_t i = 0; i < rows; ++i) {
    T* p = c + i * ldc;
    const T* t = tile + i * NR;
    if (load_c) {
      for (std::size_t j = 0; j < cols; ++j) p[j] += t[j];
    } else {
      for (std::size_t j = 0; j < cols; ++j) p[j] = t[j];
    }
  }
}

// C[rows x cols] (row stride ldc) = A (MR x kc) x B panel (kc x NR, k-major), added to C when load_c.
// A is a packed panel (k-major, MR values per k; lda unused) or, with AInPlace, MR rows of a
// row-major matrix lda apart. Full tiles go straight from registers to C; edge tiles through a local
// tile. (B is always packed: a B read in place, its rows 32 KiB apart in CIFAR fc1's input gradient,
// was measured slower than packing it; benchmarks/RESULTS.md.)
template <class T, std::size_t MR, std::size_t NV, bool AInPlace = false>
[[gnu::noinline]] void micro_kernel(std::size_t kc, const T* FUSEDP_RESTRICT a, std::size_t lda,
                                    const T* FUSEDP_RESTRICT b, T* FUSEDP_RESTRICT c,
                                    std::size_t ldc, std::size_t rows, std::size_t cols, bool load_c) {
  using V = simd::vec<T>;
  constexpr std::size_t L = simd::lanes<T>, NR = NV * L;
  V acc[MR][NV];
  FUSEDP_UNROLL(16)
  for (std::size_t i = 0; i < MR; ++i)
    FUSEDP_UNROLL(8)
    for (std::size_t v = 0; v < NV; ++v) acc[i][v] = V{};
  for (std::size_t k = 0; k < kc; ++k) {
    V bv[NV];
    FUSEDP_UNROLL(8)
    for (std::size_t v = 0; v < NV; ++v) bv[v] = simd::load(b + v * L);
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i) {
      const T ai = AInPlace ? a[i * lda] : a[i];
      FUSEDP_UNROLL(8)
      for (std::size_t v = 0; v < NV; ++v) acc[i][v] += ai * bv[v];
    }
    a += AInPlace ? 1 : MR;
    b += NR;
  }
  if (rows == MR && cols == NR) {
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i)
      FUSEDP_UNROLL(8)
      for (std::size_t v = 0; v < NV; ++v) {
        T* p = c + i * ldc + v * L;
        simd::store(p, load_c ? simd::load(p) + acc[i][v] : acc[i][v]);
      }
  } else {
    T tile[MR * NR];
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i)
      FUSEDP_UNROLL(8)
      for (std::size_t v = 0; v < NV; ++v) simd::store(tile + i * NR + v * L, acc[i][v]);
    store_tile<NR>(tile, c, ldc, rows, cols, load_c);
  }
}

// The tiles of an m x n block of C from packed A (panel i at a + i * a_panel) and packed B (panel j at
// b + j * b_panel), both already offset to the block's first k. `last`: the final k-block, so each
// finished tile's rows go through epi(i_base + i, j_base + j, &C[i][j], count).
// Below this depth the tiles of C are walked along rows (see macro_kernel).
inline constexpr std::size_t shallow_k = 96;

template <std::size_t MR, std::size_t NR, class P, class T, class Epi, class Micro>
void macro_tiles(std::size_t m, std::size_t n, std::size_t kc, const P* a, std::size_t a_panel, const P* b,
                 std::size_t b_panel, T* c, std::size_t ldc, bool load_c, bool last, std::size_t i_base,
                 std::size_t j_base, const Epi& epi, const Micro& micro) {
  auto tile = [&](std::size_t ir, std::size_t jr) {
    const std::size_t rows = std::min(MR, m - ir), cols = std::min(NR, n - jr);
    T* cp = c + ir * ldc + jr;
    micro(kc, a + ir / MR * a_panel, b + jr / NR * b_panel, cp, ldc, rows, cols, load_c);
    if constexpr (!std::is_same_v<Epi, NoEpilogue>) {
      if (last)
        for (std::size_t i = 0; i < rows; ++i) epi(i_base + ir + i, j_base + jr, cp + i * ldc, cols);
    }
  };
  if (kc >= shallow_k) {
    // A B panel (kc x NR) stays in L1 while the A panels stream past it from L2.
    for (std::size_t jr = 0; jr < n; jr += NR)
      for (std::size_t ir = 0; ir < m; ir += MR) tile(ir, jr);
  } else {
    // Shallow products (a linear layer's weight gradient, k = batch) are bound by writing C: walk it
    // along its rows, so each row is written in one sequential run rather than NR columns at a time
    // in every row (CIFAR fc1's dW, 1024 x 8192: rows 32 KiB apart).
    for (std::size_t ir = 0; ir < m; ir += MR)
      for (std::size_t jr = 0; jr < n; jr += NR) tile(ir, jr);
  }
}

// macro_tiles over packed float panels with the tile shape S's micro-kernel.
template <class S, class T, class Epi>
void macro_kernel(std::size_t m, std::size_t n, std::size_t kc, const T* a, std::size_t a_panel, const T* b,
                  std::size_t b_panel, T* c, std::size_t ldc, bool load_c, bool last, std::size_t i_base,
                  std::size_t j_base, const Epi& epi) {
  macro_tiles<S::mr, S::template nr<T>>(m, n, kc, a, a_panel, b, b_panel, c, ldc, load_c, last, i_base, j_base, epi,
                                        [](std::size_t kc, const T* ap, const T* bp, T* cp, std::size_t ldc, std::size_t rows,
                                           std::size_t cols, bool load_c) {
                                          micro_kernel<T, S::mr, S::nv>(kc, ap, S::mr, bp, cp, ldc, rows, cols, load_c);
                                        });
}

// Splits an m x n x k product over the threads of `host` by blocks of NR columns or MR rows, whichever
// gives the shorter slowest thread: its share of the multiply-adds (counted as `lanes` per operation
// on packed elements) plus what it packs. A split by columns packs all of A in every thread and
// 1/threads of B; by rows, the reverse. run(m', n', a', b', c', epi') computes one thread's block.
// An A read in place is split by rows, never shared: each thread then packs the whole of B.
template <std::size_t MR, std::size_t NR, bool AInPlace = false, class T, class Epi, class Run>
void split_over_threads(const Host& host, std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b,
                        T* c, std::size_t ldc, std::size_t lanes, const Epi& epi, const Run& run) {
  const auto threads = std::size_t(host.threads());
  const std::size_t col_blocks = (n + NR - 1) / NR, row_blocks = (m + MR - 1) / MR;
  const auto share = [&](std::size_t blocks) { return double((blocks + threads - 1) / threads) / double(blocks); };
  const double fma = double(m) * double(n) * double(k) / double(2 * lanes);
  const double by_cols = share(col_blocks) * (fma + double(k) * double(n)) + double(m) * double(k);
  const double by_rows = share(row_blocks) * (fma + double(m) * double(k)) + double(k) * double(n);
  if (!AInPlace && by_cols <= by_rows) {
    host.parallel_for(col_blocks, [&](std::size_t q0, std::size_t q1, int) {
      const std::size_t j0 = q0 * NR, j1 = std::min(n, q1 * NR);
      const MatrixRef<T> bs{b.data + j0 * b.col_stride, b.row_stride, b.col_stride};
      run(m, j1 - j0, a, bs, c + j0, [&](std::size_t i, std::size_t j, T* p, std::size_t cnt) { epi(i, j0 + j, p, cnt); });
    });
  } else {
    host.parallel_for(row_blocks, [&](std::size_t p0, std::size_t p1, int) {
      const std::size_t i0 = p0 * MR, i1 = std::min(m, p1 * MR);
      const MatrixRef<T> as{a.data + i0 * a.row_stride, a.row_stride, a.col_stride};
      run(i1 - i0, n, as, b, c + i0 * ldc, [&](std::size_t i, std::size_t j, T* p, std::size_t cnt) { epi(i0 + i, j, p, cnt); });
    });
  }
}

}  // namespace detail

/// Packs rows [i0, i0+m) x cols [k0, k0+kc) of A into panels of S::mr rows, k-major, zero-padded:
/// panel p at dst + p * kc * mr. A row-major A (the usual case) is transposed in registers.
template <class S, class T>
FUSEDP_NO_LIBCALL_LOOPS void pack_a(MatrixRef<T> a, std::size_t i0, std::size_t m, std::size_t k0, std::size_t kc, T* FUSEDP_RESTRICT dst) {
  using simd::lanes;
  constexpr std::size_t MR = S::mr, L = lanes<T>;
  for (std::size_t p = 0; p < m; p += MR, dst += kc * MR) {
    const std::size_t rows = std::min(MR, m - p);
    const T* src = a.data + (i0 + p) * a.row_stride + k0 * a.col_stride;
    if (a.row_stride == 1) {  // column-major: the MR values of one k are contiguous
      for (std::size_t k = 0; k < kc; ++k) {
        const T* s = src + k * a.col_stride;
        T* d = dst + k * MR;
        for (std::size_t i = 0; i < rows; ++i) d[i] = s[i];
        for (std::size_t i = rows; i < MR; ++i) d[i] = T(0);
      }
    } else if (FUSEDP_VECTOR_EXTENSIONS && a.col_stride == 1 && L > 1) {
      // Row-major: blocks of L rows x L k's, transposed in registers. Stores are whole vectors of
      // which the first min(L, MR - r0) lanes count; the next k's store overwrites the rest (the
      // buffer has L elements of slack, see packed_a_size).
      for (std::size_t k = 0; k < kc; k += L) {
        const std::size_t kn = std::min(L, kc - k);
        FUSEDP_UNROLL(2)
        for (std::size_t r0 = 0; r0 < MR; r0 += L) {
          simd::vec<T> blk[L];
          for (std::size_t r = 0; r < L; ++r) {
            const std::size_t i = r0 + r;
            const T* s = src + i * a.row_stride + k;
            blk[r] = i >= rows ? simd::vec<T>{} : kn == L ? simd::load(s) : simd::load_first(s, kn);
          }
          simd::transpose<T>(blk);
          for (std::size_t q = 0; q < kn; ++q) {
            if (r0 + L <= MR) {
              simd::store(dst + (k + q) * MR + r0, blk[q]);
            } else {
              alignas(sizeof(simd::vec<T>)) T tmp[L];
              simd::store(tmp, blk[q]);
              for (std::size_t r = 0; r < MR - r0; ++r) dst[(k + q) * MR + r0 + r] = tmp[r];
            }
          }
        }
      }
    } else {
      for (std::size_t k = 0; k < kc; ++k) {
        const T* s = src + k * a.col_stride;
        for (std::size_t i = 0; i < rows; ++i) dst[k * MR + i] = s[i * a.row_stride];
        for (std::size_t i = rows; i < MR; ++i) dst[k * MR + i] = T(0);
      }
    }
  }
}

/// Packs rows [k0, k0+kc) x cols [j0, j0+n) of B into panels of S::nr columns, k-major, zero-padded:
/// panel q at dst + q * kc * nr. A transposed B (columns contiguous) is transposed in registers.
namespace detail {
// How far ahead (elements) a transposing pack asks for each source row: 512 bytes. Packing W^T of
// CIFAR fc1 (1024 x 8192) took 3.3-3.6 ms with it and 3.6-17 ms without (best of 5, busy machine).
template <class T>
inline constexpr std::size_t prefetch_ahead = 512 / sizeof(T);
}  // namespace detail

template <class S, class T>
FUSEDP_NO_LIBCALL_LOOPS void pack_b(MatrixRef<T> b, std::size_t k0, std::size_t kc, std::size_t j0, std::size_t n, T* FUSEDP_RESTRICT dst) {
  using simd::lanes;
  constexpr std::size_t NR = S::template nr<T>, L = lanes<T>;
  for (std::size_t q = 0; q < n; q += NR, dst += kc * NR) {
    const std::size_t cols = std::min(NR, n - q);
    const T* src = b.data + k0 * b.row_stride + (j0 + q) * b.col_stride;
    if (b.col_stride == 1) {
      if (cols == NR) {  // whole vectors; a variable-length memcpy per row would be a library call
        for (std::size_t k = 0; k < kc; ++k)
          FUSEDP_UNROLL(8)
          for (std::size_t v = 0; v < NR; v += L) simd::store(dst + k * NR + v, simd::load(src + k * b.row_stride + v));
      } else {
        for (std::size_t k = 0; k < kc; ++k) {
          for (std::size_t j = 0; j < cols; ++j) dst[k * NR + j] = src[k * b.row_stride + j];
          for (std::size_t j = cols; j < NR; ++j) dst[k * NR + j] = T(0);
        }
      }
    } else if (FUSEDP_VECTOR_EXTENSIONS && b.row_stride == 1 && L > 1) {
      for (std::size_t k = 0; k < kc; k += L) {
        const std::size_t kn = std::min(L, kc - k);
        for (std::size_t c0 = 0; c0 < NR; c0 += L) {
          simd::vec<T> blk[L];
          for (std::size_t r = 0; r < L; ++r) {
            const std::size_t j = c0 + r;
            const T* s = src + j * b.col_stride + k;
            blk[r] = j >= cols ? simd::vec<T>{} : kn == L ? simd::load(s) : simd::load_first(s, kn);
#if FUSEDP_VECTOR_EXTENSIONS
            // NR rows are read side by side, more streams than a hardware prefetcher follows: ask for
            // each row's data a few blocks ahead.
            if (j < cols && k + detail::prefetch_ahead<T> < kc) __builtin_prefetch(s + detail::prefetch_ahead<T>);
#endif
          }
          simd::transpose<T>(blk);
          for (std::size_t r = 0; r < kn; ++r) simd::store(dst + (k + r) * NR + c0, blk[r]);
        }
      }
    } else {
      for (std::size_t k = 0; k < kc; ++k) {
        for (std::size_t j = 0; j < cols; ++j) dst[k * NR + j] = src[k * b.row_stride + j * b.col_stride];
        for (std::size_t j = cols; j < NR; ++j) dst[k * NR + j] = T(0);
      }
    }
  }
}

namespace detail {
// Cache budgets of the blocking. The B slice under the register tiles (kb x NR) stays in L1 while A
// streams past it: 24 KiB (half of Sapphire Rapids' 48 KiB L1; gemm_bench's CIFAR conv2 products ran
// at 155-170 GFLOP/s with 16 KiB, 160-190 with 24 and 32 KiB). The packed A block (mc x kp) and B
// block (kp x nc) share L2: 384 KiB and 768 KiB (of 1-2 MiB per core).
inline constexpr std::size_t l1_panel_bytes = 24 * 1024;
inline constexpr std::size_t l2_a_bytes = 384 * 1024;
inline constexpr std::size_t l2_b_bytes = 768 * 1024;
// L1 blocks per packed block (see gemm_with).
inline constexpr std::size_t pack_blocks = 4;

// Depth of a k-block for a k-long product: at most the L1 budget, split evenly (576 -> 3 x 192).
template <class S, class T>
constexpr std::size_t k_block(std::size_t k) {
  const std::size_t most = std::max<std::size_t>(32, l1_panel_bytes / (S::template nr<T> * sizeof(T)));
  const std::size_t blocks = (k + most - 1) / most;
  // Whole vectors per block where k allows: a transposing pack handles a partial vector lane by lane.
  return std::min(k, round_up((k + blocks - 1) / blocks, simd::lanes<T>));
}
}  // namespace detail

/// C[m x n] (row stride ldc) = A B, plus the old C when `accumulate`, from operands packed whole for
/// shape S (pack_a over all m rows and k, pack_b over all k and n columns). Calls epi(i, j0, &C[i][j0],
/// count) on each row of each finished tile.
template <class S, class T, class Epi = NoEpilogue>
void gemm_packed(std::size_t m, std::size_t n, std::size_t k, const T* packed_a, const T* packed_b, T* c,
                 std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::size_t i = 0; i < m; ++i) {
      if (!accumulate) std::fill(c + i * ldc, c + i * ldc + n, T(0));
      epi(i, 0, c + i * ldc, n);
    }
    return;
  }
  const std::size_t kb = detail::k_block<S, T>(k);
  for (std::size_t k0 = 0; k0 < k; k0 += kb) {
    const std::size_t kc = std::min(kb, k - k0);
    detail::macro_kernel<S>(m, n, kc, packed_a + k0 * S::mr, k * S::mr, packed_b + k0 * S::template nr<T>,
                            k * S::template nr<T>, c, ldc, accumulate || k0 > 0, k0 + kc == k, 0, 0, epi);
  }
}

/// Packing memory of one thread. Grows on first use; reused by every later call (no allocation in a
/// steady-state train step).
template <class T>
struct GemmScratch {
  HostBuffer<T> a, b;
};

/// The calling thread's scratch.
template <class T>
GemmScratch<T>& thread_scratch() {
  thread_local GemmScratch<T> s;
  return s;
}

/// C[m x n] (row stride ldc) = A[m x k] B[k x n] with the tile shape S, plus the old C when
/// `accumulate`. After the last k-block of each register tile, calls epi(i, j0, &C[i][j0], count) for
/// each of its rows, so bias and activation are applied while the tile is in L1. With AInPlace, A
/// (row-major) is read where it lies rather than packed (see gemm_a_in_place); only an edge panel of
/// fewer than MR rows is packed, where the register tile would read past A's last row.
template <class S, bool AInPlace = false, class T, class Epi = NoEpilogue>
void gemm_with(std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c, std::size_t ldc,
               bool accumulate, const Epi& epi = {}) {
  constexpr std::size_t MR = S::mr, NR = S::template nr<T>;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    gemm_packed<S>(m, n, 0, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), c, ldc, accumulate, epi);
    return;
  }
  // k is walked in packed blocks of kp (several L1 blocks of kb), so a transposed operand is read in
  // runs of kp elements (CIFAR fc1: 4 KiB of each row of W per pass rather than 768 bytes); the
  // register tiles still run over kb-deep slices that fit L1.
  const std::size_t kb = detail::k_block<S, T>(k);
  const std::size_t kp = std::min(k, detail::pack_blocks * kb);
  const std::size_t nb = std::max(NR, detail::l2_b_bytes / (kp * sizeof(T)) / NR * NR);
  // A small A under a wide B is packed whole, once, rather than once per block of B's columns (CIFAR
  // fc1's dx: 64 x 1024 under 8192 columns, packed 22 times, 9% of the product on one thread).
  const bool a_whole = !AInPlace && n > nb && packed_a_size<S, T>(m, k) * sizeof(T) <= detail::l2_a_bytes;
  const std::size_t mb = a_whole ? m : std::max(MR, detail::l2_a_bytes / (kp * sizeof(T)) / MR * MR);
  auto& s = thread_scratch<T>();
  // An in-place A's scratch holds its edge panel.
  s.a.reserve_discard(AInPlace ? packed_a_size<S, T>(MR, kb)
                      : a_whole ? packed_a_size<S, T>(m, k)
                                : packed_a_size<S, T>(std::min(mb, m), kp));
  s.b.reserve_discard(packed_b_size<S, T>(kp, std::min(nb, n)));
  if (a_whole) pack_a<S>(a, 0, m, 0, k, s.a.data());
  for (std::size_t j0 = 0; j0 < n; j0 += nb) {
    const std::size_t nc = std::min(nb, n - j0);
    for (std::size_t k0 = 0; k0 < k; k0 += kp) {
      const std::size_t kpc = std::min(kp, k - k0);
      pack_b<S>(b, k0, kpc, j0, nc, s.b.data());
      for (std::size_t i0 = 0; i0 < m; i0 += mb) {
        const std::size_t mc = std::min(mb, m - i0);
        if (!AInPlace && !a_whole) pack_a<S>(a, i0, mc, k0, kpc, s.a.data());
        for (std::size_t ks = 0; ks < kpc; ks += kb) {
          const std::size_t kc = std::min(kb, kpc - ks);
          T* cb = c + i0 * ldc + j0;
          const T* bp = s.b.data() + ks * NR;
          const bool load_c = accumulate || k0 + ks > 0, last = k0 + ks + kc == k;
          if constexpr (AInPlace) {
            const std::size_t lda = a.row_stride;
            detail::macro_tiles<MR, NR>(
                mc, nc, kc, a.data + i0 * lda + k0 + ks, MR * lda, bp, kpc * NR, cb, ldc, load_c, last, i0, j0, epi,
                [&](std::size_t kq, const T* ap, const T* bq, T* cp, std::size_t ldcp, std::size_t rows,
                    std::size_t cols, bool lc) {
                  if (rows == MR) {
                    detail::micro_kernel<T, MR, S::nv, true>(kq, ap, lda, bq, cp, ldcp, rows, cols, lc);
                  } else {
                    pack_a<S>(MatrixRef<T>{ap, lda, 1}, 0, rows, 0, kq, s.a.data());
                    detail::micro_kernel<T, MR, S::nv>(kq, s.a.data(), MR, bq, cp, ldcp, rows, cols, lc);
                  }
                });
          } else if (a_whole) {
            detail::macro_kernel<S>(mc, nc, kc, s.a.data() + (k0 + ks) * MR, k * MR, bp, kpc * NR, cb, ldc, load_c,
                                    last, i0, j0, epi);
          } else {
            detail::macro_kernel<S>(mc, nc, kc, s.a.data() + ks * MR, kpc * MR, bp, kpc * NR, cb, ldc, load_c, last,
                                    i0, j0, epi);
          }
        }
      }
    }
  }
}

/// gemm_with() on the tile shape that choose_tile picks for m x n.
template <class T, class Epi = NoEpilogue>
void gemm(std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c, std::size_t ldc,
          bool accumulate, const Epi& epi = {}) {
  with_tile(choose_tile<T>(m, n),
            [&]<class S>() { gemm_with<S>(m, n, k, a, b, c, ldc, accumulate, epi); });
}

/// gemm() split over the threads of `host` by blocks of columns (or rows, when there are few
/// columns). Each thread owns disjoint blocks of C, so the result does not depend on the split.
template <class T, class Epi = NoEpilogue>
void gemm(const Host& host, std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c,
          std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  const auto threads = std::size_t(host.threads());
  // Below about 2^17 multiply-adds (under 10 us on one core) a parallel region's wake-up and join
  // cost more than the second thread saves.
  if (threads == 1 || m * n * k < (std::size_t(1) << 17)) {
    gemm(m, n, k, a, b, c, ldc, accumulate, epi);
    return;
  }
  with_tile(choose_tile<T>(m, n), [&]<class S>() {
    detail::split_over_threads<S::mr, S::template nr<T>>(
        host, m, n, k, a, b, c, ldc, simd::lanes<T>, epi,
        [&](std::size_t mt, std::size_t nt, MatrixRef<T> at, MatrixRef<T> bt, T* ct, const auto& et) {
          gemm_with<S>(mt, nt, k, at, bt, ct, ldc, accumulate, et);
        });
  });
}

/// gemm_a_in_place() on the calling thread alone.
template <class T, class Epi = NoEpilogue>
void gemm_a_in_place(std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b, T* c,
                     std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  if (a.col_stride != 1)
    throw std::invalid_argument("gemm_a_in_place: A must be row-major (column stride 1) to be read in place");
  with_tile(choose_tile<T>(m, n), [&]<class S>() { gemm_with<S, true>(m, n, k, a, b, c, ldc, accumulate, epi); });
}

/// gemm() with A (row-major) read where it lies instead of packed, for products that use A only a few
/// times: a linear layer's weights against a batch of 64 as C^T = W X^T (n = the batch). Packing would
/// move each element of A once more than the multiplication reads it (CIFAR fc1's 32 MB of W every
/// step; the forward 6.2 -> 3.9 ms on two threads, benchmarks/RESULTS.md). Same tile shape and k-blocks
/// as gemm(), so the same result bit for bit; the threads split A's rows between them.
template <class T, class Epi = NoEpilogue>
void gemm_a_in_place(const Host& host, std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b,
                     T* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  const auto threads = std::size_t(host.threads());
  if (threads == 1 || m * n * k < (std::size_t(1) << 17)) {
    gemm_a_in_place(m, n, k, a, b, c, ldc, accumulate, epi);
    return;
  }
  if (a.col_stride != 1)
    throw std::invalid_argument("gemm_a_in_place: A must be row-major (column stride 1) to be read in place");
  with_tile(choose_tile<T>(m, n), [&]<class S>() {
    detail::split_over_threads<S::mr, S::template nr<T>, true>(
        host, m, n, k, a, b, c, ldc, simd::lanes<T>, epi,
        [&](std::size_t mt, std::size_t nt, MatrixRef<T> at, MatrixRef<T> bt, T* ct, const auto& et) {
          gemm_with<S, true>(mt, nt, k, at, bt, ct, ldc, accumulate, et);
        });
  });
}

}  // namespace fusedp::kernels::host
