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
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/host/gemm.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

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
  // Tiles per block: a multiple of every tile shape's columns (16, 32, 48 and 64 floats under AVX-512)
  // would be 192; 96 keeps the V and M blocks of 64-channel layers in L2 and wastes at most a third of
  // a 64-wide panel. (Measured on the 2-core Xeon, benchmarks/RESULTS.md.)
  static constexpr std::size_t block = 96;
  // The 36 planes of V and M are `plane + skew` apart: a skew of one cache line keeps the 36 stores
  // (or loads) of one transformed tile out of a single L1 set when a plane is a multiple of 4 KiB.
  static constexpr std::size_t skew = 16;
  [[nodiscard]] constexpr std::size_t v_plane() const {
    return host::detail::round_up(block, max_tile_cols) * std::size_t(g.in_channels) + skew;
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

// G a: the weight transform of 3 values to 6 (rows of G: 1/4 0 0 / -1/6 -1/6 -1/6 / -1/6 1/6 -1/6 /
// 1/24 1/12 1/6 / 1/24 -1/12 1/6 / 0 0 1).
template <class T>
FUSEDP_ALWAYS_INLINE void weight_1d(const T* a, std::size_t stride, T* o) {
  const T a0 = a[0], a1 = a[stride], a2 = a[2 * stride];
  const T s = (a0 + a2) / T(-6), t = a1 / T(6);
  const T u = a0 / T(24) + a2 / T(6), v = a1 / T(12);
  o[0] = a0 / T(4);
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

// V_xn for the tiles [t0, t0 + count) of the whole batch, x (N, C, H, W): written into the packed B
// panels of shape S (NR columns per panel, C deep) of v, one plane per point, v_plane apart.
template <class S, class T>
void transform_input(const Plan& p, const T* x, std::size_t t0, std::size_t count, T* v) {
  constexpr std::size_t NR = S::template nr<T>, W = L<T>;
  static_assert(NR % W == 0, "winograd: a packed panel holds whole groups of tiles");
  const ConvGeometry& g = p.g;
  const std::size_t C = std::size_t(g.in_channels), H = std::size_t(g.in_h), Wd = std::size_t(g.in_w);
  const std::size_t plane = H * Wd, sample = C * plane, vp = p.v_plane();
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
        FUSEDP_UNROLL(6)
        for (std::size_t k = 0; k < alpha; ++k)
          d[k] = gather(base, pg.idx, std::int32_t(i * Wd + k), pg.row_ok[i] & pg.col_ok[k]);
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

// U_xn = G w G^T for every (row, k) of the product: w(row, k) the 3x3 kernel at w + row * row_step +
// k * k_step, rotated by 180 degrees when `rotate` (the input gradient), written as shape S's packed
// A (panels of MR rows, k-major), one plane per point, u_plane apart. Rows [r0, r1) only; r0 and r1
// multiples of MR or r1 = rows (the padding rows of the last panel are zeroed).
template <class S, class T>
void transform_weights(const T* w, std::size_t rows, std::size_t ks, std::size_t row_step, std::size_t k_step,
                       bool rotate, std::size_t r0, std::size_t r1, std::size_t u_plane, T* u) {
  constexpr std::size_t MR = S::mr;
  const std::size_t r_end = r1 == rows ? host::detail::round_up(rows, MR) : r1;
  for (std::size_t r = r0; r < r_end; ++r) {
    T* dst = u + r / MR * (ks * MR) + r % MR;
    if (r >= rows) {
      for (std::size_t pt = 0; pt < points; ++pt)
        for (std::size_t k = 0; k < ks; ++k) dst[pt * u_plane + k * MR] = T(0);
      continue;
    }
    for (std::size_t k = 0; k < ks; ++k) {
      const T* src = w + r * row_step + k * k_step;
      T kern[9];
      for (std::size_t e = 0; e < 9; ++e) kern[e] = rotate ? src[8 - e] : src[e];
      T gw[alpha][3];  // G w: 6 x 3
      for (std::size_t col = 0; col < 3; ++col) {
        T o[alpha];
        weight_1d(kern + col, 3, o);
        for (std::size_t i = 0; i < alpha; ++i) gw[i][col] = o[i];
      }
      for (std::size_t xi = 0; xi < alpha; ++xi) {
        T o[alpha];
        weight_1d(gw[xi], 1, o);
        for (std::size_t nu = 0; nu < alpha; ++nu) dst[(xi * alpha + nu) * u_plane + k * MR] = o[nu];
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
      for (std::size_t l = 0; l < cnt; ++l) {
        const std::size_t n = tg.n[l], oy0 = tg.ty[l] * tile, ox0 = tg.tx[l] * tile;
        const std::size_t run = std::min(tile, OW - ox0);
        T* yn = y + n * O * opix;
        const auto epi = make_epi(n);
        for (std::size_t i = 0; i < tile && oy0 + i < OH; ++i) {
          const std::size_t p0 = (oy0 + i) * OW + ox0;
          T* dst = yn + o * opix + p0;
          for (std::size_t e = 0; e < run; ++e) dst[e] = out[i * tile + e][l];
          epi(o, p0, dst, run);
        }
      }
    }
  }
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
  const std::size_t blocks = (tiles + Plan::block - 1) / Plan::block;
  // Row r of the product is an output channel, k an input channel. Forward: w(r, k) at w + (r C + k) 9.
  // Input gradient: w is stored (C, O, 3, 3) by the conv whose input gradient this is (its O is this
  // C), so w(r, k) lies at w + (k O + r) 9, rotated.
  const std::size_t row_step = input_gradient ? 9 : C * 9, k_step = input_gradient ? O * 9 : 9;
  with_tile(choose_tile<T>(O, Plan::block), [&]<class S>() {
    T* u = scratch;  // thread 0's, read by all
    const std::size_t panels = (O + S::mr - 1) / S::mr;
    host.parallel_for(panels, [&](std::size_t q0, std::size_t q1, int) {
      detail::transform_weights<S>(w, O, C, row_step, k_step, input_gradient, q0 * S::mr, std::min(O, q1 * S::mr),
                                   plan.u_plane(), u);
    });
    host.parallel_for(blocks, [&](std::size_t b0, std::size_t b1, int thread) {
      T* own = scratch + std::size_t(thread) * stride;
      T* v = own + plan.u();
      T* m = v + plan.v();
      for (std::size_t b = b0; b < b1; ++b) {
        const std::size_t t0 = b * Plan::block, count = std::min(Plan::block, tiles - t0);
        detail::transform_input<S>(plan, x, t0, count, v);
        for (std::size_t pt = 0; pt < points; ++pt)
          gemm_packed<S>(O, count, C, u + pt * plan.u_plane(), v + pt * plan.v_plane(), m + pt * plan.m_plane(),
                         Plan::block, false);
        detail::transform_output(plan, m, t0, count, y, make_epi);
      }
    });
  });
}

}  // namespace fusedp::kernels::host::winograd
