#pragma once
// The Host GEMM at precision bf16: C (fp32) = A B with the operands rounded to bfloat16 (round to nearest
// even, kernels/bf16.hpp) as they are packed, and fp32 sums. The levels and the blocking are gemm.hpp's;
// what changes is the packed element and the register tile's instruction:
//
//   packed element  a pair of bf16 of adjacent k in 32 bits, the even k in the low half (the "VNNI"
//                   layout VDPBF16PS reads, and AMX's TDPBF16PS too), so a panel is half as deep
//   micro-kernel    VDPBF16PS: each of 16 fp32 lanes += a_odd * b_odd, then += a_even * b_even, the
//                   products exact, on AVX-512 BF16 (chosen at run time, the function compiled for it
//                   whatever the build's target); or the same arithmetic in fp32 instructions
//                   (HostPrecision::bf16_emulated, for checking bf16 results on any CPU)
//
//   tiles (AMX)     on CPUs with AMX (Host::bf16_tiles), products 16 or more deep run on TDPBF16PS: a C
//                   row of 16 x 64 (or 16 x 16) in tile registers, A packed row by row in blocks of 16
//                   rows x 16 pairs (the layout an A tile loads), B in the same pair panels as above
//                   with the pairs padded to a multiple of 16 (whole B tiles)
//
// Speed, measured on this project's Xeon (Sapphire Rapids class) as a KVM guest without AMX: VDPBF16PS
// retires about one zmm instruction every two cycles where FMA retires two a cycle (1.3 G against
// 5.35 G a second, 24 independent chains each), so its 64 FLOP an instruction come at half fp32's rate:
// the register tiles run at 72-79 GFLOP/s against fp32's 122-163 on one core (gemm_bench 1 0.3 --bf16)
// and a CIFAR-10 CNN step takes 119 ms against 75: without AMX, bf16 buys bf16 numerics (the rounding
// of a bf16 accelerator, checked on the CPU), not speed. With AMX exposed (2026-12-07) the tiles run
// at 645-1655 GFLOP/s on one core (amx_shapes below) and the CIFAR-10 CNN's bf16 step takes 29 ms
// against 35 in fp32 (benchmarks/RESULTS.md).
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/amx.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/host/gemm.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>


namespace fusedp::kernels::host {

namespace bf16 {

/// Two bf16 values of adjacent k in one 32-bit word: the even k in the low half.
using Pair = std::uint32_t;
/// The kernels' vector: 16 fp32 lanes (AVX-512), whatever the build targets.
inline constexpr std::size_t lanes = 16;

FUSEDP_ALWAYS_INLINE Pair pair(float even, float odd) {
  return Pair(to_bf16(even)) | (Pair(to_bf16(odd)) << 16);
}
FUSEDP_ALWAYS_INLINE float low(Pair p) { return from_bf16(std::uint16_t(p & 0xffffu)); }
FUSEDP_ALWAYS_INLINE float high(Pair p) { return from_bf16(std::uint16_t(p >> 16)); }

/// A register tile: MR rows by NV vectors of 16 columns.
template <std::size_t MR, std::size_t NV>
struct Tile {
  static constexpr std::size_t mr = MR;
  static constexpr std::size_t nv = NV;
  static constexpr std::size_t nr = NV * lanes;
  static constexpr bool amx = false;
  static constexpr std::size_t pair_block = 1;  ///< a panel's pairs are a multiple of this
};

/// A row of AMX tiles: 16 rows of C by NV tiles of 16 columns, each C tile in a tile register.
template <std::size_t NV>
struct AmxTile {
  static constexpr std::size_t mr = 16;
  static constexpr std::size_t nv = NV;
  static constexpr std::size_t nr = NV * lanes;
  static constexpr bool amx = true;
  static constexpr std::size_t pair_block = 16;  ///< the pairs (rows of a B tile) one TDPBF16PS takes
};

// The AVX-512 shapes of gemm.hpp (32 zmm registers: MR x NV accumulators, NV B vectors, a broadcast).
inline constexpr std::array<host::detail::ShapeInfo, 4> shapes{{{12, 2, 1.0}, {8, 3, 1.0}, {6, 4, 0.98}, {16, 1, 0.82}}};
template <std::size_t S>
using tile_at = Tile<shapes[S].mr, shapes[S].nv>;

// The AMX shapes (indices 4 and 5 of with_tile): four C tiles with one A tile and three B tile registers
// (a fourth B tile reuses the first's), or one C tile for narrow products. Their speeds, one thread on
// operands packed whole (a throwaway program over gemm_packed, Xeon with AMX, 2026-12-07), GFLOP/s of
// 16 x 64 against 16 x 16 (AVX-512 BF16's 12 x 2: 107-117): 128 x 256 x 576 680 / 509, 64 x 1024 x 576
// 1038 / 929, 256 x 64 x 2304 1655 / 787, 128 x 1024 x 1152 1077 / 712, 64 x 1024 x 64 393 / 339;
// where n is 16 (512 x 16 x 4608) 278 / 466. So 16 x 16 runs at about 0.7 of 16 x 64.
inline constexpr std::array<host::detail::ShapeInfo, 2> amx_shapes{{{16, 4, 1.0}, {16, 1, 0.7}}};
inline constexpr std::size_t amx_first = shapes.size();
/// The shallowest product the tiles take. Padded to 32 along k, a product of 16 still runs faster on
/// the tiles than on VDPBF16PS (gemm_bench: ResNet-18's 512 x 4608 x 16, 135 against 94 GFLOP/s); and
/// from 16 on, a panel of k/2 pairs padded to 16 takes no more than k floats, so the packed operands fit
/// the scratch that callers size for the vector shapes (ConvScratch).
inline constexpr std::size_t amx_min_k = 16;

/// The tile shape for an m x n x k product: an AMX shape where `tiles` (Host::bf16_tiles) and k >=
/// amx_min_k, else a vector one; among them, by the padding it wastes (as choose_tile). A pure function
/// of its arguments, so packing and multiplying agree on it.
constexpr std::size_t choose_tile(std::size_t m, std::size_t n, std::size_t k = 0, bool tiles = false) {
  if (tiles && k >= amx_min_k) return amx_first + host::detail::least_padded(amx_shapes, lanes, m, n);
  return host::detail::least_padded(shapes, lanes, m, n);
}

/// Calls f.template operator()<S>() for shape `index` of choose_tile.
template <class F>
FUSEDP_ALWAYS_INLINE decltype(auto) with_tile(std::size_t index, F&& f) {
  if (index == amx_first) return f.template operator()<AmxTile<amx_shapes[0].nv>>();
  if (index > amx_first) return f.template operator()<AmxTile<amx_shapes[1].nv>>();
  return host::detail::with_shape<tile_at>(index, std::forward<F>(f));
}

constexpr std::size_t pairs(std::size_t k) { return (k + 1) / 2; }
/// Pairs in each row (A) or column (B) of a panel of k: pairs(k), padded to whole tiles for AMX.
template <class S>
constexpr std::size_t panel_pairs(std::size_t k) {
  return host::detail::round_up(pairs(k), S::pair_block);
}

/// Pairs of an m x k A packed for shape S.
template <class S>
constexpr std::size_t packed_a_size(std::size_t m, std::size_t k) {
  return host::detail::round_up(m, S::mr) * panel_pairs<S>(k);
}
/// Pairs of a k x n B packed for shape S.
template <class S>
constexpr std::size_t packed_b_size(std::size_t k, std::size_t n) {
  return host::detail::round_up(n, S::nr) * panel_pairs<S>(k);
}

namespace detail {
#if FUSEDP_HOST_AVX512_BF16
// GCC 12 takes the self-initialized _mm512_undefined_epi32 inside its shift and conversion intrinsics
// for an uninitialized read once they are inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// The bf16 bits of 16 floats in the low halves of 32-bit lanes, rounded as to_bf16 (to nearest even,
// NaN kept quiet), so packed pairs are the same whichever path packs them.
[[gnu::target("avx512f,avx512bw")]] FUSEDP_ALWAYS_INLINE __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

// The first min(n, 16) lanes.
FUSEDP_ALWAYS_INLINE __mmask16 first_lanes(std::size_t n) {
  return n >= lanes ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// 16 pairs, lane j = pair(even lane j, odd lane j).
[[gnu::target("avx512f,avx512bw")]] FUSEDP_ALWAYS_INLINE __m512i pairs_of(__m512 even, __m512 odd) {
  return _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32(bf16_bits(odd), 16));
}

// The 16 pairs of 32 contiguous floats (those from `left` on read as zero): lane j = pair(src[2j],
// src[2j + 1]).
[[gnu::target("avx512f,avx512bw")]] FUSEDP_ALWAYS_INLINE __m512i pairs_of_adjacent(const float* src, std::size_t left) {
  const __m512i lo = bf16_bits(_mm512_maskz_loadu_ps(first_lanes(left), src));
  const __m512i hi = bf16_bits(_mm512_maskz_loadu_ps(first_lanes(left > lanes ? left - lanes : 0), src + lanes));
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
}

// dst[j] = pair(even[j], odd ? odd[j] : 0) for j < cols: B's pairs from two rows.
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void pairs_of_rows(const float* even, const float* odd, std::size_t cols,
                                                              Pair* dst) {
  for (std::size_t j = 0; j < cols; j += lanes) {
    const __mmask16 m = first_lanes(cols - j);
    const __m512 e = _mm512_maskz_loadu_ps(m, even + j), o = odd ? _mm512_maskz_loadu_ps(m, odd + j) : _mm512_setzero_ps();
    _mm512_mask_storeu_epi32(dst + j, m, pairs_of(e, o));
  }
}

// The pairs of a contiguous row of kc floats, 16 pairs (32 floats) a block, block b at dst + b * stride,
// for `blocks` blocks (zero past kc): an AMX A panel's row.
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void pairs_of_run(const float* src, std::size_t kc, Pair* dst,
                                                             std::size_t stride, std::size_t blocks) {
  for (std::size_t b = 0; b < blocks; ++b, src += 2 * lanes, dst += stride) {
    const std::size_t k = 2 * lanes * b;
    _mm512_storeu_si512(dst, pairs_of_adjacent(src, k < kc ? kc - k : 0));
  }
}

// A 16 x 16 block of 32-bit words transposed in registers: r[i] lane j becomes r[j] lane i.
[[gnu::target("avx512f")]] FUSEDP_ALWAYS_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Rows now hold 4 x 4 blocks in 128-bit lanes: r[4a + b] lane block c is row 4c + b's block a.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// A B panel from a B whose k run contiguously (column j at src + j * cs): pair q of column j to
// dst[q * nr + j] for q < pairs(kc) and j < cols, zero for cols <= j < round_up(cols, 16). 16 columns x
// 16 pairs at a time: each column's 32 values rounded into 16 pairs, then the block transposed.
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void pairs_of_columns(const float* src, std::size_t cs,
                                                                                std::size_t kc, std::size_t cols,
                                                                                Pair* dst, std::size_t nr) {
  const std::size_t kq = pairs(kc);
  for (std::size_t j0 = 0; j0 < cols; j0 += lanes)
    for (std::size_t q0 = 0; q0 < kq; q0 += lanes) {
      const std::size_t k = 2 * q0, left = kc - k;
      __m512i r[16];
      for (std::size_t j = 0; j < lanes; ++j) {
        if (j0 + j >= cols) {
          r[j] = _mm512_setzero_si512();
          continue;
        }
        r[j] = pairs_of_adjacent(src + (j0 + j) * cs + k, left);
      }
      transpose16(r);
      const std::size_t rows = std::min(lanes, kq - q0);
      for (std::size_t q = 0; q < rows; ++q) _mm512_storeu_si512(dst + (q0 + q) * nr + j0, r[q]);
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

// Whether this process may pack with AVX-512 (the conversions above).
inline bool vector_packing() {
#if FUSEDP_HOST_AVX512_BF16
  static const bool yes = cpu_features().avx512_bf16;
  return yes;
#else
  return false;
#endif
}
}  // namespace detail

/// Packs rows [i0, i0+m) x cols [k0, k0+kc) of A into panels of S::mr rows of k pairs, zero-padded:
/// panel p at dst + p * panel_pairs<S>(kc) * mr; pair q of row i at [q * mr + i], or for an AMX shape
/// at [q / 16 * 256 + i * 16 + q % 16] (blocks of 16 rows x 16 pairs, each an A tile).
template <class S>
FUSEDP_NO_LIBCALL_LOOPS void pack_a(MatrixRef<float> a, std::size_t i0, std::size_t m, std::size_t k0, std::size_t kc,
                                    Pair* FUSEDP_RESTRICT dst) {
  constexpr std::size_t MR = S::mr;
  const std::size_t kq = pairs(kc), whole = kc / 2;
  const std::size_t rs = a.row_stride, cs = a.col_stride;
  if constexpr (S::amx) {
    constexpr std::size_t block = 16 * MR;  // pairs of one A tile
    const std::size_t kqp = panel_pairs<S>(kc), blocks = kqp / 16;
    for (std::size_t p = 0; p < m; p += MR, dst += kqp * MR)
      for (std::size_t i = 0; i < MR; ++i) {
        Pair* row = dst + i * 16;
        const float* src = a.data + (i0 + p + i) * rs + k0 * cs;
        if (p + i >= m) {
          for (std::size_t q = 0; q < kqp; ++q) row[q / 16 * block + q % 16] = 0;
          continue;
        }
#if FUSEDP_HOST_AVX512_BF16
        if (cs == 1 && detail::vector_packing()) {
          detail::pairs_of_run(src, kc, row, block, blocks);
          continue;
        }
#endif
        for (std::size_t q = 0; q < kqp; ++q)
          row[q / 16 * block + q % 16] = q < whole ? pair(src[2 * q * cs], src[(2 * q + 1) * cs])
                                         : q < kq  ? pair(src[(kc - 1) * cs], 0.0f)
                                                   : 0;
      }
    (void)blocks;
    return;
  }
  for (std::size_t p = 0; p < m; p += MR, dst += kq * MR) {
    const std::size_t rows = std::min(MR, m - p);
    const float* src = a.data + (i0 + p) * rs + k0 * cs;
    if (rs == 1) {  // column-major: the rows of one k are contiguous
      for (std::size_t q = 0; q < kq; ++q) {
        const float* even = src + 2 * q * cs;
        const float* odd = 2 * q + 1 < kc ? even + cs : nullptr;
        for (std::size_t i = 0; i < rows; ++i) dst[q * MR + i] = pair(even[i], odd ? odd[i] : 0.0f);
        for (std::size_t i = rows; i < MR; ++i) dst[q * MR + i] = 0;
      }
    } else {
      for (std::size_t i = 0; i < MR; ++i) {
        const float* row = src + i * rs;
        if (i >= rows) {
          for (std::size_t q = 0; q < kq; ++q) dst[q * MR + i] = 0;
          continue;
        }
        for (std::size_t q = 0; q < whole; ++q) dst[q * MR + i] = pair(row[2 * q * cs], row[(2 * q + 1) * cs]);
        if (kc % 2) dst[whole * MR + i] = pair(row[(kc - 1) * cs], 0.0f);
      }
    }
  }
}

/// Packs rows [k0, k0+kc) x cols [j0, j0+n) of B into panels of S::nr columns of k pairs, zero-padded:
/// panel t at dst + t * panel_pairs<S>(kc) * nr, pair q of column j at [q * nr + j].
template <class S>
FUSEDP_NO_LIBCALL_LOOPS void pack_b(MatrixRef<float> b, std::size_t k0, std::size_t kc, std::size_t j0, std::size_t n,
                                    Pair* FUSEDP_RESTRICT dst) {
  constexpr std::size_t NR = S::nr;
  const std::size_t kq = pairs(kc), kqp = panel_pairs<S>(kc);
  const std::size_t rs = b.row_stride, cs = b.col_stride;
  for (std::size_t t = 0; t < n; t += NR, dst += kqp * NR) {
    const std::size_t cols = std::min(NR, n - t);
    for (std::size_t q = kq; q < kqp; ++q)
      for (std::size_t j = 0; j < NR; ++j) dst[q * NR + j] = 0;
#if FUSEDP_HOST_AVX512_BF16
    if (rs == 1 && detail::vector_packing()) {  // k contiguous: B^T row-major (an input, im2col^T)
      detail::pairs_of_columns(b.data + k0 + (j0 + t) * cs, cs, kc, cols, dst, NR);
      for (std::size_t q = 0; q < kq; ++q)
        for (std::size_t j = host::detail::round_up(cols, lanes); j < NR; ++j) dst[q * NR + j] = 0;
      continue;
    }
#endif
    for (std::size_t q = 0; q < kq; ++q) {
      const float* even = b.data + (k0 + 2 * q) * rs + (j0 + t) * cs;
      Pair* d = dst + q * NR;
#if FUSEDP_HOST_AVX512_BF16
      if (cs == 1 && detail::vector_packing()) {
        detail::pairs_of_rows(even, 2 * q + 1 < kc ? even + rs : nullptr, cols, d);
        for (std::size_t j = cols; j < NR; ++j) d[j] = 0;
        continue;
      }
#endif
      if (2 * q + 1 < kc) {
        const float* odd = even + rs;
        if (cs == 1) {
          for (std::size_t j = 0; j < cols; ++j) d[j] = pair(even[j], odd[j]);
        } else {
          for (std::size_t j = 0; j < cols; ++j) d[j] = pair(even[j * cs], odd[j * cs]);
        }
      } else {
        for (std::size_t j = 0; j < cols; ++j) d[j] = pair(even[j * cs], 0.0f);
      }
      for (std::size_t j = cols; j < NR; ++j) d[j] = 0;
    }
  }
}

namespace detail {

// The register tile in fp32 instructions: each lane adds the odd pair's product, then the even one's,
// as VDPBF16PS does. The products of two bf16 are exact in fp32, so a contracted multiply-add rounds
// the same way.
template <std::size_t MR, std::size_t NV>
[[gnu::noinline]] void micro_kernel_emulated(std::size_t kq, const Pair* FUSEDP_RESTRICT a,
                                             const Pair* FUSEDP_RESTRICT b, float* FUSEDP_RESTRICT c,
                                             std::size_t ldc, std::size_t rows, std::size_t cols, bool load_c) {
  constexpr std::size_t NR = NV * lanes;
  float acc[MR * NR] = {};
  for (std::size_t q = 0; q < kq; ++q, a += MR, b += NR)
    for (std::size_t i = 0; i < MR; ++i) {
      const float ae = low(a[i]), ao = high(a[i]);
      for (std::size_t j = 0; j < NR; ++j) {
        float s = acc[i * NR + j] + ao * high(b[j]);
        acc[i * NR + j] = s + ae * low(b[j]);
      }
    }
  host::detail::store_tile<NR>(acc, c, ldc, rows, cols, load_c);
}

#if FUSEDP_HOST_AVX512_BF16
// The register tile on AVX-512 BF16: per pair of k, NV vector loads of B, MR broadcasts of A's pair and
// MR x NV VDPBF16PS.
template <std::size_t MR, std::size_t NV>
[[gnu::noinline, gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] void micro_kernel_avx512(
    std::size_t kq, const Pair* FUSEDP_RESTRICT a, const Pair* FUSEDP_RESTRICT b, float* FUSEDP_RESTRICT c,
    std::size_t ldc, std::size_t rows, std::size_t cols, bool load_c) {
  constexpr std::size_t NR = NV * lanes;
  __m512 acc[MR][NV];
  FUSEDP_UNROLL(16)
  for (std::size_t i = 0; i < MR; ++i)
    FUSEDP_UNROLL(4)
    for (std::size_t v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (std::size_t q = 0; q < kq; ++q, a += MR, b += NR) {
    __m512bh bv[NV];
    FUSEDP_UNROLL(4)
    for (std::size_t v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * lanes);
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(a[i]));
      FUSEDP_UNROLL(4)
      for (std::size_t v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
  if (rows == MR && cols == NR) {
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i)
      FUSEDP_UNROLL(4)
      for (std::size_t v = 0; v < NV; ++v) {
        float* p = c + i * ldc + v * lanes;
        _mm512_storeu_ps(p, load_c ? _mm512_add_ps(_mm512_loadu_ps(p), acc[i][v]) : acc[i][v]);
      }
  } else {
    alignas(64) float tile[MR * NR];
    FUSEDP_UNROLL(16)
    for (std::size_t i = 0; i < MR; ++i)
      FUSEDP_UNROLL(4)
      for (std::size_t v = 0; v < NV; ++v) _mm512_store_ps(tile + i * NR + v * lanes, acc[i][v]);
    host::detail::store_tile<NR>(tile, c, ldc, rows, cols, load_c);
  }
}
#endif

#if FUSEDP_HOST_AVX512_BF16
using fusedp::detail::configure_tiles;

// The AMX row of tiles (the tiles configured by configure_tiles): C tiles 0 .. NV-1, per 16 pairs one A
// tile (4) and NV B tiles (5, 6, 7, then 5 again), NV TDPBF16PS. kq pairs, read up to the next multiple
// of 16 (the packs pad with zeros). A whole tile starts from C when load_c (the tiles add to it); an
// edge tile starts from zero and goes through a local tile, added to C in fp32 as micro_kernel_avx512's
// (so an edge's accumulation rounds once more, deterministically).
template <std::size_t NV>
[[gnu::noinline, gnu::target("amx-tile,amx-bf16,avx512f")]] void micro_kernel_amx(
    std::size_t kq, const Pair* FUSEDP_RESTRICT a, const Pair* FUSEDP_RESTRICT b, float* FUSEDP_RESTRICT c,
    std::size_t ldc, std::size_t rows, std::size_t cols, bool load_c) {
  static_assert(NV == 1 || NV == 4, "micro_kernel_amx: a row of 1 or 4 C tiles");
  constexpr std::size_t NR = NV * lanes, b_stride = NR * sizeof(Pair);
  const bool whole = rows == 16 && cols == NR;
  alignas(64) float edge[16 * NR];
  float* out = whole ? c : edge;
  const std::size_t out_stride = (whole ? ldc : NR) * sizeof(float);
  if (whole && load_c) {
    _tile_loadd(0, out, out_stride);
    if constexpr (NV == 4) {
      _tile_loadd(1, out + 16, out_stride);
      _tile_loadd(2, out + 32, out_stride);
      _tile_loadd(3, out + 48, out_stride);
    }
  } else {
    _tile_zero(0);
    if constexpr (NV == 4) {
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (std::size_t q = 0; q < kq; q += 16, a += 16 * 16, b += 16 * NR) {
    _tile_loadd(4, a, 16 * sizeof(Pair));
    _tile_loadd(5, b, b_stride);
    if constexpr (NV == 4) {
      _tile_loadd(6, b + 16, b_stride);
      _tile_loadd(7, b + 32, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 48, b_stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    } else {
      _tile_dpbf16ps(0, 4, 5);
    }
  }
  _tile_stored(0, out, out_stride);
  if constexpr (NV == 4) {
    _tile_stored(1, out + 16, out_stride);
    _tile_stored(2, out + 32, out_stride);
    _tile_stored(3, out + 48, out_stride);
  }
  if (!whole) host::detail::store_tile<NR>(edge, c, ldc, rows, cols, load_c);
}
#endif

// The micro-kernel of shape S for `precision` (bf16 or bf16_emulated); an AMX shape's runs on AMX.
template <class S>
auto micro_for(HostPrecision precision) {
#if FUSEDP_HOST_AVX512_BF16
  if constexpr (S::amx)
    if (precision == HostPrecision::bf16) configure_tiles();
#endif
  return [precision](std::size_t kq, const Pair* a, const Pair* b, float* c, std::size_t ldc, std::size_t rows,
                     std::size_t cols, bool load_c) {
    if constexpr (S::amx) {
#if FUSEDP_HOST_AVX512_BF16
      if (precision == HostPrecision::bf16) {
        micro_kernel_amx<S::nv>(kq, a, b, c, ldc, rows, cols, load_c);
        return;
      }
#endif
      throw InvalidArgument(FUSEDP_HOST_AVX512_BF16
                                ? std::string("Host: an AMX tile shape needs precision bf16, not ") + to_string(precision)
                                : std::string("Host: an AMX tile shape was chosen, but this translation unit was compiled "
                                              "without AVX-512 and AMX (nvcc's host pass, or not x86-64 GCC/Clang)"));
    }
#if FUSEDP_HOST_AVX512_BF16
    if (precision == HostPrecision::bf16) {
      micro_kernel_avx512<S::mr, S::nv>(kq, a, b, c, ldc, rows, cols, load_c);
      return;
    }
#endif
    if (precision != HostPrecision::bf16_emulated)
      throw InvalidArgument("Host: bf16 GEMMs run on AVX-512 BF16, which this translation unit was compiled "
                            "without (nvcc's host pass, or not x86-64 GCC/Clang)");
    micro_kernel_emulated<S::mr, S::nv>(kq, a, b, c, ldc, rows, cols, load_c);
  };
}

// Depth (in k, even) of an L1 block: a B panel of NR pair columns in 24 KiB, as gemm.hpp's k_block.
template <class S>
constexpr std::size_t k_block(std::size_t k) {
  const std::size_t most = 2 * std::max<std::size_t>(16, host::detail::l1_panel_bytes / (S::nr * sizeof(Pair)));
  const std::size_t blocks = (k + most - 1) / most;
  return std::min(k, host::detail::round_up((k + blocks - 1) / blocks, 2 * lanes));
}

}  // namespace detail

/// The packing memory of one thread (pairs), reused by every later call.
inline GemmScratch<Pair>& thread_scratch() {
  thread_local GemmScratch<Pair> s;
  return s;
}

/// C[m x n] (row stride ldc) = A[m x k] B[k x n] in bf16 with tile shape S (see gemm_with).
template <class S, class Epi = NoEpilogue>
void gemm_with(HostPrecision precision, std::size_t m, std::size_t n, std::size_t k, MatrixRef<float> a,
               MatrixRef<float> b, float* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  constexpr std::size_t MR = S::mr, NR = S::nr;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    host::gemm_packed<host::detail::shape_at<0>>(m, n, 0, static_cast<const float*>(nullptr),
                                                 static_cast<const float*>(nullptr), c, ldc, accumulate, epi);
    return;
  }
  const auto micro = detail::micro_for<S>(precision);
  const std::size_t kb = detail::k_block<S>(k);  // even: a block never splits a pair
  const std::size_t kp = std::min(k, host::detail::pack_blocks * kb);
  const std::size_t mb = std::max(MR, host::detail::l2_a_bytes / (pairs(kp) * sizeof(Pair)) / MR * MR);
  const std::size_t nb = std::max(NR, host::detail::l2_b_bytes / (pairs(kp) * sizeof(Pair)) / NR * NR);
  auto& s = thread_scratch();
  s.a.reserve_discard(packed_a_size<S>(std::min(mb, m), kp));
  s.b.reserve_discard(packed_b_size<S>(kp, std::min(nb, n)));
  for (std::size_t j0 = 0; j0 < n; j0 += nb) {
    const std::size_t nc = std::min(nb, n - j0);
    for (std::size_t k0 = 0; k0 < k; k0 += kp) {
      const std::size_t kpc = std::min(kp, k - k0), kpq = panel_pairs<S>(kpc);
      pack_b<S>(b, k0, kpc, j0, nc, s.b.data());
      for (std::size_t i0 = 0; i0 < m; i0 += mb) {
        const std::size_t mc = std::min(mb, m - i0);
        pack_a<S>(a, i0, mc, k0, kpc, s.a.data());
        for (std::size_t ks = 0; ks < kpc; ks += kb) {
          const std::size_t kc = std::min(kb, kpc - ks);
          host::detail::macro_tiles<MR, NR>(mc, nc, pairs(kc), s.a.data() + ks / 2 * MR, kpq * MR,
                                            s.b.data() + ks / 2 * NR, kpq * NR, c + i0 * ldc + j0, ldc,
                                            accumulate || k0 + ks > 0, k0 + ks + kc == k, i0, j0, epi, micro);
        }
      }
    }
  }
}

/// C[m x n] (row stride ldc) = A B from operands packed whole for shape S (pack_a over all m rows and k,
/// pack_b over all k and n columns), as gemm_packed.
template <class S, class Epi = NoEpilogue>
void gemm_packed(HostPrecision precision, std::size_t m, std::size_t n, std::size_t k, const Pair* packed_a,
                 const Pair* packed_b, float* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  if (m == 0 || n == 0) return;
  const std::size_t kq = pairs(k), kqp = panel_pairs<S>(k);
  host::detail::macro_tiles<S::mr, S::nr>(m, n, kq, packed_a, kqp * S::mr, packed_b, kqp * S::nr, c, ldc, accumulate,
                                          true, 0, 0, epi, detail::micro_for<S>(precision));
}

/// One thread's bf16 GEMM on the shape choose_tile picks, an AMX one where `tiles` (Host::bf16_tiles).
template <class Epi = NoEpilogue>
void gemm(HostPrecision precision, bool tiles, std::size_t m, std::size_t n, std::size_t k, MatrixRef<float> a,
          MatrixRef<float> b, float* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  with_tile(choose_tile(m, n, k, tiles),
            [&]<class S>() { gemm_with<S>(precision, m, n, k, a, b, c, ldc, accumulate, epi); });
}

}  // namespace bf16

/// The GEMM at the Host's precision: host::gemm (fp32) or bf16's, split over the Host's threads alike.
template <class T, class Epi = NoEpilogue>
void gemm_at_precision(const Host& host, std::size_t m, std::size_t n, std::size_t k, MatrixRef<T> a, MatrixRef<T> b,
                       T* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  if constexpr (std::is_same_v<T, float>) {
    if (host.precision() != HostPrecision::fp32) {
      if (host.threads() == 1 || m * n * k < (std::size_t(1) << 17)) {
        bf16::gemm(host.precision(), host.bf16_tiles(), m, n, k, a, b, c, ldc, accumulate, epi);
        return;
      }
      bf16::with_tile(bf16::choose_tile(m, n, k, host.bf16_tiles()), [&]<class S>() {
        detail::split_over_threads<S::mr, S::nr>(
            host, m, n, k, a, b, c, ldc, 2 * bf16::lanes, epi,
            [&](std::size_t mt, std::size_t nt, MatrixRef<float> at, MatrixRef<float> bt, float* ct, const auto& et) {
              bf16::gemm_with<S>(host.precision(), mt, nt, k, at, bt, ct, ldc, accumulate, et);
            });
      });
      return;
    }
  }
  gemm(host, m, n, k, a, b, c, ldc, accumulate, epi);
}

}  // namespace fusedp::kernels::host
