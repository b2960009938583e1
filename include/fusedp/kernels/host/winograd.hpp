#pragma once
// 3x3 convolutions with stride 1 and padding 1 on the Host by Winograd's minimal filtering F(4x4, 3x3)
// (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016): each 4x4 tile of one
// output channel is
//     Y = A^T [ sum over c of (G w_c G^T) . (B^T d_c B) ] A        (. elementwise, 6 x 6)
// with d_c the 6x6 input patch of channel c. Per output value a layer then costs 36 C / 16 = 2.25 C
// multiply-adds instead of 9 C, in 36 independent GEMMs, one per point (xi, nu) of the 6x6 domain:
//     M_xn (O x tiles) = U_xn (O x C) V_xn (C x tiles)
// U = G w G^T the transformed weights (once per call, packed as the GEMM's A), V = B^T d B the
// transformed input tiles (written straight into the GEMM's packed B panels). The threads take blocks
// of tiles (of the whole batch: a 4x4 plane is one tile per sample), each with its own V and M;
// U is shared. The input gradient of such a conv is the same product with the weights rotated by 180
// degrees and their channels swapped, so backward runs it too.
//
// Numerics: the transforms have coefficients up to 5 and 1/24, so fp32 results differ from a direct
// sum by a few more ulps than im2col's (tests/kernels/host/conv2d.cpp bounds them against double).
#include "fusedp/core/config.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/host/gemm.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fusedp::kernels::host::winograd {

inline constexpr std::size_t tile = 4;     // outputs per tile side
inline constexpr std::size_t alpha = 6;    // inputs per tile side: tile + 3 - 1
inline constexpr std::size_t points = 36;  // alpha * alpha: GEMMs per conv

/// True where the Winograd path runs: 3x3, stride 1, padding 1, and at least 16 channels in and out
/// (fewer: the direct path or im2col's short GEMMs; the 36 transforms per tile would not pay).
/// The gathers index a group's samples with 32-bit offsets: up to 65 samples of the larger side.
constexpr bool applies(const ConvGeometry& g) {
  return g.kernel == 3 && g.stride == 1 && g.pad == 1 && g.in_channels >= 16 && g.out_channels >= 16 &&
         std::max(g.in_size(), g.out_size()) * 65 < (std::size_t(1) << 31);
}

/// The input gradient of conv `g` as a convolution: dz (O channels) in, dx (C channels) out.
constexpr ConvGeometry transposed(const ConvGeometry& g) {
  return {g.out_channels, g.out_h, g.out_w, g.kernel, g.stride, g.pad, g.in_channels, g.in_h, g.in_w};
}

/// How the tiles of one call are cut and where each thread's buffers lie, in elements.
struct Plan {
  ConvGeometry g;
  [[nodiscard]] constexpr std::size_t tiles_h() const { return (std::size_t(g.out_h) + tile - 1) / tile; }
  [[nodiscard]] constexpr std::size_t tiles_w() const { return (std::size_t(g.out_w) + tile - 1) / tile; }
  [[nodiscard]] constexpr std::size_t tiles_per_sample() const { return tiles_h() * tiles_w(); }
  // Tiles per block, at most: a multiple of the 32- and 64-column tile shapes the products take
  // (shape_for), so a thread's share of ResNet-18's tiles at batch 64 (2048, 512, 128, 32 on two
  // threads) is cut into whole panels.
  static constexpr std::size_t block = 128;
  // The 36 planes of V and M are `plane + skew` apart: a skew of one cache line keeps the 36 stores
  // (or loads) of one transformed tile out of a single L1 set when a plane is a multiple of 4 KiB.
  static constexpr std::size_t skew = 16;
  [[nodiscard]] constexpr std::size_t v_plane() const {
    return (block + max_tile_cols) * std::size_t(g.in_channels) + skew;  // a block rounded up to any panel width
  }
  [[nodiscard]] constexpr std::size_t m_plane() const { return std::size_t(g.out_channels) * block + skew; }
  // U_xn packed as A for any tile shape: (O rounded up to the shape's rows) x C, plus slack.
  [[nodiscard]] constexpr std::size_t u_plane() const {
    return (std::size_t(g.out_channels) + max_tile_rows) * std::size_t(g.in_channels) + max_tile_rows;
  }
  [[nodiscard]] constexpr std::size_t u() const { return align_elements(points * u_plane()); }
  [[nodiscard]] constexpr std::size_t v() const { return align_elements(points * v_plane()); }
  [[nodiscard]] constexpr std::size_t m() const { return align_elements(points * m_plane()); }
  /// One thread's scratch: U (thread 0's is the one used), then its V and M blocks.
  [[nodiscard]] constexpr std::size_t per_thread() const { return u() + v() + m(); }

  // The weight gradient's: V (C x block) and Z (O x block) row-major per point, and the thread's sum
  // over its tiles of Z V^T (O x C) per point.
  [[nodiscard]] constexpr std::size_t wv_plane() const { return std::size_t(g.in_channels) * block + skew; }
  [[nodiscard]] constexpr std::size_t wz_plane() const { return std::size_t(g.out_channels) * block + skew; }
  [[nodiscard]] constexpr std::size_t wm_plane() const {
    return std::size_t(g.out_channels) * std::size_t(g.in_channels) + skew;
  }
  [[nodiscard]] constexpr std::size_t wv() const { return align_elements(points * wv_plane()); }
  [[nodiscard]] constexpr std::size_t wz() const { return align_elements(points * wz_plane()); }
  [[nodiscard]] constexpr std::size_t wm() const { return align_elements(points * wm_plane()); }
  [[nodiscard]] constexpr std::size_t weight_gradient_per_thread() const { return wv() + wz() + wm(); }
};

namespace detail {

// B^T a: the input transform of 6 values (rows of B^T: 4 0 -5 0 1 0 / 0 -4 -4 1 1 0 / 0 4 -4 -1 1 0 /
// 0 -2 -1 2 1 0 / 0 2 -1 -2 1 0 / 0 4 0 -5 0 1).
template <class V>
FUSEDP_ALWAYS_INLINE void input_1d(const V* a, V* o) {
  const V four = V{} + 4, five = V{} + 5, two = V{} + 2;
  const V p = a[4] - four * a[2], q = a[3] - four * a[1];
  const V r = a[4] - a[2], s = two * (a[3] - a[1]);
  o[0] = four * a[0] - five * a[2] + a[4];
  o[1] = p + q;
  o[2] = p - q;
  o[3] = r + s;
  o[4] = r - s;
  o[5] = four * a[1] - five * a[3] + a[5];
}

// A^T a: the output transform of 6 values to 4 (rows of A^T: 1 1 1 1 1 0 / 0 1 -1 2 -2 0 /
// 0 1 1 4 4 0 / 0 1 -1 8 -8 1).
template <class V>
FUSEDP_ALWAYS_INLINE void output_1d(const V* a, V* o) {
  const V two = V{} + 2, four = V{} + 4, eight = V{} + 8;
  const V s12 = a[1] + a[2], d12 = a[1] - a[2], s34 = a[3] + a[4], d34 = a[3] - a[4];
  o[0] = a[0] + s12 + s34;
  o[1] = d12 + two * d34;
  o[2] = s12 + four * s34;
  o[3] = d12 + eight * d34 + a[5];
}

// The element type of a scalar or of a vector-extension vector.
template <class V, bool = std::is_arithmetic_v<V>>
struct element {
  using type = V;
};
template <class V>
struct element<V, false> {
  using type = std::remove_cvref_t<decltype(std::declval<V>()[0])>;
};

// G a: the weight transform of 3 values to 6 (rows of G: 1/4 0 0 / -1/6 -1/6 -1/6 / -1/6 1/6 -1/6 /
// 1/24 1/12 1/6 / 1/24 -1/12 1/6 / 0 0 1), for a scalar or a vector V.
template <class V>
FUSEDP_ALWAYS_INLINE void weight_1d(const V* a, std::size_t stride, V* o) {
  using E = typename element<V>::type;
  const V a0 = a[0], a1 = a[stride], a2 = a[2 * stride];
  const V s = (a0 + a2) * E(-1.0 / 6), t = a1 * E(1.0 / 6);
  const V u = a0 * E(1.0 / 24) + a2 * E(1.0 / 6), v = a1 * E(1.0 / 12);
  o[0] = a0 * E(0.25);
  o[1] = s - t;
  o[2] = s + t;
  o[3] = u + v;
  o[4] = u - v;
  o[5] = a2;
}

// Lanes: the tiles of a group, one per lane.
template <class T>
inline constexpr std::size_t L = simd::lanes<T>;
template <class T>
using Vec = simd::vec<T>;

// Where the lanes' 6x6 input patches lie: idx[l] the patch's top-left corner (it may lie in the zero
// border) relative to `base`, and which of its rows and columns are inside the image.
template <class T>
struct PatchGroup {
  const T* base;
  std::int32_t idx[L<T>];
  std::uint32_t row_ok[alpha];  // bit l: lane l's row i is inside
  std::uint32_t col_ok[alpha];
};

// The value at base + idx[l] + off of each lane whose bit is set in `lanes`, zero in the others.
template <class T>
FUSEDP_ALWAYS_INLINE Vec<T> gather(const T* base, const std::int32_t* idx, std::int32_t off, std::uint32_t lanes) {
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512i vi = _mm512_add_epi32(_mm512_loadu_si512(idx), _mm512_set1_epi32(off));
    return Vec<T>(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), __mmask16(lanes), vi, base, 4));
  } else if constexpr (std::is_same_v<T, double>) {
    const __m256i vi = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)), _mm256_set1_epi32(off));
    return Vec<T>(_mm512_mask_i32gather_pd(_mm512_setzero_pd(), __mmask8(lanes), vi, base, 8));
  }
#endif
  alignas(sizeof(Vec<T>)) T tmp[L<T>];
  for (std::size_t l = 0; l < L<T>; ++l) tmp[l] = (lanes >> l) & 1u ? base[idx[l] + off] : T(0);
  return simd::load(tmp);
}

// d[k] = the value at base + idx[l] + off + k of each lane l, for k < N (one row of each lane's patch),
// zero where bit l of row_ok or of col_ok[k] is clear. On AVX-512 in float each lane's row is one
// masked 8-float load, and two 8 x 8 transposes put the lanes side by side: 16 loads and 48 shuffles
// where gathers took N gathers of 16 elements (6 x ~21 cycles on Zen 4: the input transform was 12%
// of a ResNet-18 step).
template <std::size_t N, class T>
FUSEDP_ALWAYS_INLINE void load_row(const T* base, const std::int32_t* idx, std::int32_t off, std::uint32_t row_ok,
                                   const std::uint32_t* col_ok, Vec<T>* d) {
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, float> && L<T> == 16 && N <= 8) {
    using V8 = simd::vec_n<float, 8>;
    V8 half[2][8];
    FUSEDP_UNROLL(16)
    for (std::size_t l = 0; l < 16; ++l) {
      std::uint32_t m = 0;
      FUSEDP_UNROLL(8)
      for (std::size_t k = 0; k < N; ++k) m |= ((col_ok[k] >> l) & 1u) << k;
      if (!((row_ok >> l) & 1u)) m = 0;
      half[l / 8][l % 8] = V8(_mm256_maskz_loadu_ps(__mmask8(m), base + idx[l] + off));
    }
    simd::transpose<float, 8>(half[0]);
    simd::transpose<float, 8>(half[1]);
    FUSEDP_UNROLL(8)
    for (std::size_t k = 0; k < N; ++k)
      d[k] = __builtin_shufflevector(half[0][k], half[1][k], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return;
  }
#endif
  FUSEDP_UNROLL(8)
  for (std::size_t k = 0; k < N; ++k) d[k] = gather(base, idx, off + std::int32_t(k), row_ok & col_ok[k]);
}

// The tiles of a group: n, ty, tx of each lane's tile (global tile index t0 + l), and which lanes hold
// a tile (the block's last group may be short).
struct TileGroup {
  std::size_t n[64], ty[64], tx[64];
  std::uint32_t valid;
};

template <class T>
TileGroup tile_group(const Plan& p, std::size_t t0, std::size_t count) {
  TileGroup tg{};
  const std::size_t per = p.tiles_per_sample(), tw = p.tiles_w();
  for (std::size_t l = 0; l < L<T>; ++l) {
    const std::size_t t = t0 + std::min(l, count - 1);  // a short group repeats its last tile
    tg.n[l] = t / per;
    tg.ty[l] = t % per / tw;
    tg.tx[l] = t % per % tw;
    if (l < count) tg.valid |= 1u << l;
  }
  return tg;
}

// V_xn for the tiles [t0, t0 + count) of the whole batch, x (N, C, H, W), one plane per point, vp
// apart: tile j of channel c at (j / nr) (C nr) + c nr + j % nr, the packed B panels of a tile shape
// with nr columns (nr a multiple of the lanes), or with nr = Plan::block the row-major (C x block).
template <class T>
void transform_input(const Plan& p, const T* x, std::size_t t0, std::size_t count, std::size_t nr, std::size_t vp,
                     T* v) {
  constexpr std::size_t W = L<T>;
  const ConvGeometry& g = p.g;
  const std::size_t C = std::size_t(g.in_channels), H = std::size_t(g.in_h), Wd = std::size_t(g.in_w);
  const std::size_t plane = H * Wd, sample = C * plane;
  const std::size_t NR = nr;
  for (std::size_t j = 0; j < count; j += W) {
    const std::size_t cnt = std::min(W, count - j);
    const TileGroup tg = tile_group<T>(p, t0 + j, cnt);
    PatchGroup<T> pg{};
    pg.base = x + tg.n[0] * sample;
    for (std::size_t l = 0; l < W; ++l) {
      const std::ptrdiff_t y0 = std::ptrdiff_t(tg.ty[l] * tile) - 1, x0 = std::ptrdiff_t(tg.tx[l] * tile) - 1;
      pg.idx[l] = std::int32_t(std::ptrdiff_t((tg.n[l] - tg.n[0]) * sample) + y0 * std::ptrdiff_t(Wd) + x0);
      for (std::size_t i = 0; i < alpha; ++i) {
        const std::ptrdiff_t yy = y0 + std::ptrdiff_t(i), xx = x0 + std::ptrdiff_t(i);
        if (yy >= 0 && yy < std::ptrdiff_t(H)) pg.row_ok[i] |= 1u << l;
        if (xx >= 0 && xx < std::ptrdiff_t(Wd)) pg.col_ok[i] |= 1u << l;
      }
    }
    T* panel = v + j / NR * (C * NR) + j % NR;
    for (std::size_t c = 0; c < C; ++c) {
      const T* base = pg.base + c * plane;
      Vec<T> r[alpha][alpha];  // rows of the patch after the transform along x
      FUSEDP_UNROLL(6)
      for (std::size_t i = 0; i < alpha; ++i) {
        Vec<T> d[alpha];
        load_row<alpha>(base, pg.idx, std::int32_t(i * Wd), pg.row_ok[i], pg.col_ok, d);
        input_1d(d, r[i]);
      }
      FUSEDP_UNROLL(6)
      for (std::size_t nu = 0; nu < alpha; ++nu) {
        Vec<T> col[alpha], o[alpha];
        FUSEDP_UNROLL(6)
        for (std::size_t i = 0; i < alpha; ++i) col[i] = r[i][nu];
        input_1d(col, o);
        FUSEDP_UNROLL(6)
        for (std::size_t xi = 0; xi < alpha; ++xi) simd::store(panel + (xi * alpha + nu) * vp + c * NR, o[xi]);
      }
    }
  }
}

// dst[l] = v[l] for the lanes l in [l0, l1) (dst + l0 the first element written).
template <class T>
FUSEDP_ALWAYS_INLINE void store_lanes(T* dst, const Vec<T>& v, std::size_t l0, std::size_t l1) {
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
  const std::uint32_t mask = ((l1 >= 32 ? 0u : (1u << l1)) - 1u) & ~((1u << l0) - 1u);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, __mmask16(mask), __m512(v));
    return;
  } else if constexpr (std::is_same_v<T, double>) {
    _mm512_mask_storeu_pd(dst, __mmask8(mask), __m512d(v));
    return;
  }
#endif
  alignas(sizeof(Vec<T>)) T tmp[L<T>];
  simd::store(tmp, v);
  for (std::size_t l = l0; l < l1; ++l) dst[l] = tmp[l];
}

// kern[e] = element e (8 - e when rotated) of the 3x3 kernel at src + idx[l] of each lane l whose bit
// is set in `valid`, zero in the others. On AVX-512 in float: one masked load of each lane's 9 values
// and a 16 x 16 transpose, where 9 gathers of 16 elements took ~21 cycles each on Zen 4.
template <class T>
FUSEDP_ALWAYS_INLINE void load_kernels(const T* src, const std::int32_t* idx, std::uint32_t valid, bool rotate,
                                       Vec<T>* kern) {
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> && L<T> == 16) {
    Vec<T> rows[16];
    FUSEDP_UNROLL(16)
    for (std::size_t l = 0; l < 16; ++l)
      rows[l] = Vec<T>(_mm512_maskz_loadu_ps(__mmask16((valid >> l) & 1u ? 0x1ffu : 0u), src + idx[l]));
    simd::transpose<T>(rows);
    FUSEDP_UNROLL(9)
    for (std::size_t e = 0; e < 9; ++e) kern[e] = rows[rotate ? 8 - e : e];
    return;
  }
#endif
  FUSEDP_UNROLL(9)
  for (std::size_t e = 0; e < 9; ++e) kern[e] = gather(src, idx, std::int32_t(rotate ? 8 - e : e), valid);
}

#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
inline constexpr bool streams_u = true;  // transform_weights may stream U (float, AVX-512: stream_run)
#else
inline constexpr bool streams_u = false;
#endif

constexpr std::size_t common_multiple(std::size_t a, std::size_t b) {
  std::size_t x = a, y = b;
  while (y != 0) {
    const std::size_t t = x % y;
    x = y;
    y = t;
  }
  return a / x * b;
}

// Whether transform_weights streams U (see there): float on AVX-512, U of 4 MiB or more (points planes of
// u_plane values), and every run of ks x mr values of a panel at a cache line.
template <class T>
[[nodiscard]] bool streams(const T* u, std::size_t u_plane, std::size_t ks, std::size_t mr) {
  return streams_u && std::is_same_v<T, float> && points * u_plane * sizeof(T) >= (std::size_t(4) << 20) &&
         reinterpret_cast<std::uintptr_t>(u) % 64 == 0 && u_plane % 16 == 0 && ks * mr % 16 == 0;
}

// dst[0, n) = src[0, n), dst and src at cache lines (streams()): non-temporal stores of whole lines (no
// read for ownership: U, 38 MB at 512 x 512 channels, is written at twice the rate, and the GEMMs read
// it back as fast), the last partial line stored normally.
template <class T>
FUSEDP_ALWAYS_INLINE void stream_run(T* dst, const T* src, std::size_t n) {
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
    simd::copy(dst + i, src + i, n - i);
    return;
  }
#endif
  simd::copy(dst, src, n);
}

// U_xn = G w G^T for every (row, k) of the product: w(row, k) the 3x3 kernel at w + row * row_step +
// k * k_step, rotated by 180 degrees when `rotate` (the input gradient), written as shape S's packed
// A (panels of MR rows, k-major), one plane per point, u_plane apart. Rows [r0, r1) only; r0 and r1
// multiples of MR or r1 = rows (the padding rows of the last panel are zeroed). The lanes take
// consecutive rows: 9 gathers per group of rows and k, and each point's values stored as runs of a
// panel's rows (a scalar store per value was 5% of a ResNet-18 step).
// Where U outgrows the caches (streams()), the values go through a buffer instead, for a group of whole
// panels (and whole vectors) and KB values of k, whose every plane and panel is one run of KB x MR
// values, whole cache lines, written to U by non-temporal stores (stream_run). Stored in place, each
// line of U was written in pieces from two groups of rows a k loop apart, and read for ownership first:
// 4.8 GB/s at 512 x 512 channels on one core, where such stores reach 8.2 at most and non-temporal ones 19.
template <class S, class T>
void transform_weights(const T* w, std::size_t rows, std::size_t ks, std::size_t row_step, std::size_t k_step,
                       bool rotate, std::size_t r0, std::size_t r1, std::size_t u_plane, T* u) {
  constexpr std::size_t MR = S::mr, W = L<T>;
  constexpr bool bufferable = streams_u && std::is_same_v<T, float>;
  constexpr std::size_t G = bufferable ? common_multiple(MR, W) : W;  // rows of a group
  constexpr std::size_t KB = 8;                                       // k of a buffered block
  static_assert(!bufferable || KB * MR * sizeof(T) % 64 == 0, "winograd: U's buffered runs must be whole lines");
  const std::size_t r_end = r1 == rows ? host::detail::round_up(rows, MR) : r1;
  // One core, U of 256 and 512 channels in and out (10 and 40 MB): 1.9 -> 1.2 and 10.4 -> 5.2 ms. Buffered
  // without non-temporal stores, 128 channels (2.6 MB) went 0.29 -> 0.41 ms and 64 (0.7 MB) 0.04 -> 0.06:
  // smaller U is stored in place, where the GEMMs find it in cache.
  const bool stream = bufferable && streams(u, u_plane, ks, MR);
  alignas(64) T buf[bufferable ? points * G * KB : 1];  // 55 KB at 12-row panels
  // Point pt of (row, k) at base + pt plane_step + row / MR panel_step + (k - k_origin) MR + row % MR: in
  // U itself, row counted from 0; or in the buffer, from the group's first (a multiple of MR).
  const std::size_t plane_step = stream ? G * KB : u_plane, panel_step = stream ? KB * MR : ks * MR;
  T* base = stream ? buf : u;
  for (std::size_t g0 = r0; g0 < r_end; g0 += G) {
    const std::size_t group_rows = std::min(G, r_end - g0), panels = group_rows / MR, row_origin = stream ? g0 : 0;
    for (std::size_t k0 = 0; k0 < ks; k0 += stream ? KB : ks) {
      const std::size_t kn = stream ? std::min(KB, ks - k0) : ks, k_origin = stream ? k0 : 0;
      for (std::size_t v0 = 0; v0 < group_rows; v0 += W) {
        const std::size_t r = g0 + v0, rn = std::min(W, group_rows - v0);
        std::int32_t idx[W];
        std::uint32_t valid = 0;
        for (std::size_t l = 0; l < W; ++l) {
          idx[l] = std::int32_t(l * row_step);
          if (l < rn && r + l < rows) valid |= 1u << l;
        }
        for (std::size_t k = k0; k < k0 + kn; ++k) {
          const T* src = w + r * row_step + k * k_step;
          Vec<T> kern[9];
          load_kernels(src, idx, valid, rotate, kern);
          Vec<T> gw[alpha][3];  // G w: 6 x 3
          FUSEDP_UNROLL(3)
          for (std::size_t col = 0; col < 3; ++col) {
            Vec<T> o[alpha];
            weight_1d(kern + col, 3, o);
            FUSEDP_UNROLL(6)
            for (std::size_t i = 0; i < alpha; ++i) gw[i][col] = o[i];
          }
          FUSEDP_UNROLL(6)
          for (std::size_t xi = 0; xi < alpha; ++xi) {
            Vec<T> o[alpha];
            weight_1d(gw[xi], 1, o);
            FUSEDP_UNROLL(6)
            for (std::size_t nu = 0; nu < alpha; ++nu) {
              T* at = base + (xi * alpha + nu) * plane_step + (k - k_origin) * MR;
              // Lanes [l, l + run) are rows of one panel, at consecutive places of its k-th MR values.
              for (std::size_t l = 0; l < rn;) {
                const std::size_t row = r + l - row_origin, run = std::min(rn - l, MR - row % MR);
                store_lanes(at + row / MR * panel_step + row % MR - l, o[nu], l, l + run);
                l += run;
              }
            }
          }
        }
      }
      if (stream)
        for (std::size_t pt = 0; pt < points; ++pt)
          for (std::size_t p = 0; p < panels; ++p)
            stream_run(u + pt * u_plane + (g0 / MR + p) * (ks * MR) + k0 * MR, buf + pt * plane_step + p * panel_step,
                       kn * MR);
    }
  }
#if FUSEDP_VECTOR_EXTENSIONS && defined(__AVX512F__)
  // Non-temporal stores are weakly ordered: fenced before this thread's later stores, among them the
  // pool's signal that its share is done, after which the other threads read U.
  if (stream) _mm_sfence();
#endif
}

// A y: the transform of 4 output-gradient values to 6 (the adjoint of output_1d).
template <class V>
FUSEDP_ALWAYS_INLINE void gradient_1d(const V* y, V* o) {
  const V two = V{} + 2, four = V{} + 4, eight = V{} + 8;
  const V e = y[0] + y[2], f = y[1] + y[3], e4 = y[0] + four * y[2], f8 = two * y[1] + eight * y[3];
  o[0] = y[0];
  o[1] = e + f;
  o[2] = e - f;
  o[3] = e4 + f8;
  o[4] = e4 - f8;
  o[5] = y[3];
}

// G^T m: the adjoint of weight_1d, 6 values to 3.
template <class V>
FUSEDP_ALWAYS_INLINE void weight_gradient_1d(const V* m, V* o) {
  const V s12 = m[1] + m[2], d12 = m[2] - m[1], s34 = m[3] + m[4], d34 = m[3] - m[4];
  o[0] = m[0] / 4 - s12 / 6 + s34 / 24;
  o[1] = d12 / 6 + d34 / 12;
  o[2] = s34 / 6 - s12 / 6 + m[5];
}

// Z_xn = A dz A^T for the tiles [t0, t0 + count), dz (N, O, OH, OW) (zero past the edges): row-major
// (O x Plan::block) per point, zp apart.
template <class T>
void transform_gradient(const Plan& p, const T* dz, std::size_t t0, std::size_t count, std::size_t zp, T* z) {
  constexpr std::size_t W = L<T>;
  const ConvGeometry& g = p.g;
  const std::size_t O = std::size_t(g.out_channels), OH = std::size_t(g.out_h), OW = std::size_t(g.out_w);
  const std::size_t plane = OH * OW, sample = O * plane;
  for (std::size_t j = 0; j < count; j += W) {
    const std::size_t cnt = std::min(W, count - j);
    const TileGroup tg = tile_group<T>(p, t0 + j, cnt);
    std::int32_t idx[W];
    std::uint32_t row_ok[tile] = {}, col_ok[tile] = {};
    const T* base = dz + tg.n[0] * sample;
    for (std::size_t l = 0; l < W; ++l) {
      const std::size_t y0 = tg.ty[l] * tile, x0 = tg.tx[l] * tile;
      idx[l] = std::int32_t((tg.n[l] - tg.n[0]) * sample + y0 * OW + x0);
      for (std::size_t i = 0; i < tile; ++i) {
        if (y0 + i < OH) row_ok[i] |= 1u << l;
        if (x0 + i < OW) col_ok[i] |= 1u << l;
      }
    }
    for (std::size_t o = 0; o < O; ++o) {
      const T* src = base + o * plane;
      Vec<T> r[tile][alpha];  // rows of the tile after the transform along x
      FUSEDP_UNROLL(4)
      for (std::size_t i = 0; i < tile; ++i) {
        Vec<T> d[tile];
        load_row<tile>(src, idx, std::int32_t(i * OW), row_ok[i], col_ok, d);
        gradient_1d(d, r[i]);
      }
      FUSEDP_UNROLL(6)
      for (std::size_t nu = 0; nu < alpha; ++nu) {
        Vec<T> col[tile], out[alpha];
        FUSEDP_UNROLL(4)
        for (std::size_t i = 0; i < tile; ++i) col[i] = r[i][nu];
        gradient_1d(col, out);
        FUSEDP_UNROLL(6)
        for (std::size_t xi = 0; xi < alpha; ++xi) simd::store(z + (xi * alpha + nu) * zp + o * Plan::block + j, out[xi]);
      }
    }
  }
}

// y for the tiles [t0, t0 + count) from M (the 36 planes of O x block, m_plane apart, row stride
// block): the output transform, then epi(n)(o, p0, &y[n][o][p0], run) on each run of a tile row.
template <class T, class MakeEpi>
void transform_output(const Plan& p, const T* m, std::size_t t0, std::size_t count, T* y, const MakeEpi& make_epi) {
  constexpr std::size_t W = L<T>;
  const ConvGeometry& g = p.g;
  const std::size_t O = std::size_t(g.out_channels), OH = std::size_t(g.out_h), OW = std::size_t(g.out_w);
  const std::size_t opix = OH * OW, mp = p.m_plane();
  for (std::size_t j = 0; j < count; j += W) {
    const std::size_t cnt = std::min(W, count - j);
    const TileGroup tg = tile_group<T>(p, t0 + j, cnt);
    for (std::size_t o = 0; o < O; ++o) {
      const T* src = m + o * Plan::block + j;
      Vec<T> s[alpha][tile];  // after the transform along nu
      FUSEDP_UNROLL(6)
      for (std::size_t xi = 0; xi < alpha; ++xi) {
        Vec<T> a[alpha];
        FUSEDP_UNROLL(6)
        for (std::size_t nu = 0; nu < alpha; ++nu) a[nu] = simd::load(src + (xi * alpha + nu) * mp);
        output_1d(a, s[xi]);
      }
      alignas(sizeof(Vec<T>)) T out[tile * tile][W];
      FUSEDP_UNROLL(4)
      for (std::size_t c = 0; c < tile; ++c) {
        Vec<T> a[alpha], r[tile];
        FUSEDP_UNROLL(6)
        for (std::size_t xi = 0; xi < alpha; ++xi) a[xi] = s[xi][c];
        output_1d(a, r);
        FUSEDP_UNROLL(4)
        for (std::size_t i = 0; i < tile; ++i) simd::store(out[i * tile + c], r[i]);
      }
      // Each lane's tile as its 16 values in a row: transposed in registers where the lanes are 16 (a
      // scalar copy of each value was half of this pass).
      const T* by_tile = &out[0][0];
      std::size_t lane_step = 1, value_step = W;
      bool transposed = false;
      alignas(sizeof(Vec<T>)) T tiles_out[W][tile * tile];
      if constexpr (W == tile * tile) {
        Vec<T> rows[W];
        for (std::size_t v = 0; v < W; ++v) rows[v] = simd::load(out[v]);
        simd::transpose<T>(rows);
        for (std::size_t l = 0; l < W; ++l) simd::store(tiles_out[l], rows[l]);
        by_tile = &tiles_out[0][0];
        lane_step = tile * tile;
        value_step = 1;
        transposed = true;
      }
      for (std::size_t l = 0; l < cnt; ++l) {
        const std::size_t n = tg.n[l], oy0 = tg.ty[l] * tile, ox0 = tg.tx[l] * tile;
        const std::size_t run = std::min(tile, OW - ox0);
        T* yn = y + n * O * opix;
        const auto epi = make_epi(n);
        const T* mine = by_tile + l * lane_step;
        for (std::size_t i = 0; i < tile && oy0 + i < OH; ++i) {
          const std::size_t p0 = (oy0 + i) * OW + ox0;
          T* dst = yn + o * opix + p0;
          if (transposed && run == tile) {
            simd::store(dst, simd::load_as<simd::vec_n<T, tile>>(mine + i * tile));
          } else {
            for (std::size_t e = 0; e < run; ++e) dst[e] = mine[(i * tile + e) * value_step];
          }
          epi(o, p0, dst, run);
        }
      }
    }
  }
}

// Tiles per block for a thread's share of n tiles: as few blocks as Plan::block allows, of equal size
// in whole units of `unit` tiles (a panel's columns, or the lanes), the last one shorter.
constexpr std::size_t block_for(std::size_t n, std::size_t unit) {
  const std::size_t blocks = std::max<std::size_t>(1, (n + Plan::block - 1) / Plan::block);
  return std::min(Plan::block, host::detail::round_up((n + blocks - 1) / blocks, unit));
}

// The register tile of the products of a conv with `outs` output channels: the least padded for
// 64-tile blocks among the shapes, so a 32- or 64-column one (12x2 or 6x4 under AVX-512), whatever
// the batch and the thread count: the same shape gives every output the same bits in any split.
// (8x3's 48 columns padded ResNet-18's 64- and 32-tile blocks of its last stages by a third.)
template <class T>
constexpr std::size_t shape_for(std::size_t outs) {
  return choose_tile<T>(outs, 64);
}

}  // namespace detail

/// y = epi(conv(x, w)) for `batch` samples of a conv that `applies`: x (N, C, H, W), w as stored
/// (O, C, 3, 3), or, with `input_gradient`, w of the conv whose input gradient this is (C_out = its
/// C, so its (C', O', 3, 3) rotated and swapped). make_epi(n) gives sample n's epilogue, called as
/// epi(o, p0, &y[n][o][p0], count) on runs of one row. scratch: host.threads() x Plan{g}.per_thread().
template <class T, class MakeEpi>
void conv3x3(const Host& host, const ConvGeometry& g, std::size_t batch, const T* w, bool input_gradient, const T* x,
             T* y, T* scratch, const MakeEpi& make_epi) {
  const Plan plan{g};
  const std::size_t O = std::size_t(g.out_channels), C = std::size_t(g.in_channels);
  const std::size_t stride = plan.per_thread(), tiles = batch * plan.tiles_per_sample();
  const auto threads = std::size_t(host.threads());
  // Row r of the product is an output channel, k an input channel. Forward: w(r, k) at w + (r C + k) 9.
  // Input gradient: w is stored (C, O, 3, 3) by the conv whose input gradient this is (its O is this
  // C), so w(r, k) lies at w + (k O + r) 9, rotated.
  const std::size_t row_step = input_gradient ? 9 : C * 9, k_step = input_gradient ? O * 9 : 9;
  with_tile(detail::shape_for<T>(O), [&]<class S>() {
    T* u = scratch;  // thread 0's, read by all
    const std::size_t panels = (O + S::mr - 1) / S::mr;
    host.parallel_for(panels, [&](std::size_t q0, std::size_t q1, int) {
      detail::transform_weights<S>(w, O, C, row_step, k_step, input_gradient, q0 * S::mr, std::min(O, q1 * S::mr),
                                   plan.u_plane(), u);
    });
    // Each thread an equal share of the tiles, in blocks of at most Plan::block (whole blocks dealt
    // out left ResNet-18's third stage, 256 tiles, at 192 against 64).
    host.parallel_for(threads, [&](std::size_t, std::size_t, int thread) {
      T* own = scratch + std::size_t(thread) * stride;
      T* v = own + plan.u();
      T* m = v + plan.v();
      const std::size_t first = tiles * std::size_t(thread) / threads, last = tiles * (std::size_t(thread) + 1) / threads;
      const std::size_t block = detail::block_for(last - first, S::template nr<T>);
      for (std::size_t t0 = first; t0 < last; t0 += block) {
        const std::size_t count = std::min(block, last - t0);
        detail::transform_input(plan, x, t0, count, S::template nr<T>, plan.v_plane(), v);
        for (std::size_t pt = 0; pt < points; ++pt)
          gemm_packed<S>(O, count, C, u + pt * plan.u_plane(), v + pt * plan.v_plane(), m + pt * plan.m_plane(),
                         Plan::block, false);
        detail::transform_output(plan, m, t0, count, y, make_epi);
      }
    });
  });
}

/// dw (O, C, 3, 3) = the weight gradient of conv `g` (one that `applies`) over `batch` samples: x its
/// input, dz the gradient of its output (before any epilogue). Each thread sums Z V^T over its share
/// of the tiles (M' per point, O x C); the shares are added in thread order as G^T M' G is taken, so
/// the result depends on the thread count only. scratch: host.threads() x
/// Plan{g}.weight_gradient_per_thread().
template <class T>
void weight_gradient3x3(const Host& host, const ConvGeometry& g, std::size_t batch, const T* x, const T* dz, T* dw,
                        T* scratch) {
  const Plan plan{g};
  const std::size_t O = std::size_t(g.out_channels), C = std::size_t(g.in_channels);
  const std::size_t stride = plan.weight_gradient_per_thread(), tiles = batch * plan.tiles_per_sample();
  const auto threads = std::size_t(host.threads());
  host.parallel_for(threads, [&](std::size_t, std::size_t, int thread) {
    T* own = scratch + std::size_t(thread) * stride;
    T* v = own;
    T* z = v + plan.wv();
    T* m = z + plan.wz();
    const std::size_t first = tiles * std::size_t(thread) / threads, last = tiles * (std::size_t(thread) + 1) / threads;
    if (first == last) {
      for (std::size_t pt = 0; pt < points; ++pt) simd::zero(m + pt * plan.wm_plane(), O * C);
      return;
    }
    const std::size_t block = detail::block_for(last - first, detail::L<T>);
    for (std::size_t t0 = first; t0 < last; t0 += block) {
      const std::size_t count = std::min(block, last - t0);
      detail::transform_input(plan, x, t0, count, Plan::block, plan.wv_plane(), v);
      detail::transform_gradient(plan, dz, t0, count, plan.wz_plane(), z);
      // M'_xn (O x C) += Z_xn (O x count) V_xn^T (count x C)
      for (std::size_t pt = 0; pt < points; ++pt)
        gemm(O, C, count, row_major<T>(z + pt * plan.wz_plane(), Plan::block),
             MatrixRef<T>{v + pt * plan.wv_plane(), 1, Plan::block}, m + pt * plan.wm_plane(), C, t0 != first);
    }
  });
  // dw = G^T (sum over threads of M') G, vectorized over runs of channels c.
  constexpr std::size_t W = detail::L<T>;
  host.parallel_for(O, [&](std::size_t o0, std::size_t o1, int) {
    for (std::size_t o = o0; o < o1; ++o)
      for (std::size_t c0 = 0; c0 < C; c0 += W) {
        const std::size_t cn = std::min(W, C - c0);
        detail::Vec<T> r[alpha][3];  // G^T m along nu, per xi
        FUSEDP_UNROLL(6)
        for (std::size_t xi = 0; xi < alpha; ++xi) {
          detail::Vec<T> mv[alpha];
          FUSEDP_UNROLL(6)
          for (std::size_t nu = 0; nu < alpha; ++nu) {
            const T* at = scratch + plan.wv() + plan.wz() + (xi * alpha + nu) * plan.wm_plane() + o * C + c0;
            detail::Vec<T> acc = cn == W ? simd::load(at) : simd::load_first(at, cn);
            for (std::size_t t = 1; t < threads; ++t) {
              const T* q = at + t * stride;
              acc += cn == W ? simd::load(q) : simd::load_first(q, cn);
            }
            mv[nu] = acc;
          }
          detail::weight_gradient_1d(mv, r[xi]);
        }
        alignas(sizeof(detail::Vec<T>)) T out[9][W];
        FUSEDP_UNROLL(3)
        for (std::size_t b = 0; b < 3; ++b) {
          detail::Vec<T> col[alpha], k[3];
          FUSEDP_UNROLL(6)
          for (std::size_t xi = 0; xi < alpha; ++xi) col[xi] = r[xi][b];
          detail::weight_gradient_1d(col, k);
          FUSEDP_UNROLL(3)
          for (std::size_t a = 0; a < 3; ++a) simd::store(out[a * 3 + b], k[a]);
        }
        for (std::size_t l = 0; l < cn; ++l)
          for (std::size_t e = 0; e < 9; ++e) dw[(o * C + c0 + l) * 9 + e] = out[e][l];
      }
  });
}

}  // namespace fusedp::kernels::host::winograd
