#pragma once
// 3x3 convolutions with stride 1 or 2 and padding 1 at precision bf16, directly: no im2col matrix, no
// packed copy of it. What winograd.hpp is to fp32, this is to bf16. The products run on AMX tiles where
// the Host has them (Host::bf16_tiles), else by VDPBF16PS on the same operands in the same layouts
// (conv_block_dp, weight_block_dp: AMD's Zen 4 and later have AVX-512 BF16 and no tiles).
//
// The padded grid. A sample's input, with its zero border, is a plane of (H + 2) x Wp values, Wp =
// W + 2. Output pixel (y, x) reads the plane at (y + ky) Wp + x + kx for tap (ky, kx): with j = y Wp +
// x its grid position, at j + shift(tap). So over the grid positions j = 0, 1, 2, ... every tap reads a
// contiguous run of the plane, and a run of 16 positions is a row of 16 values an AMX tile loads with
// no gather; the positions x = W, W + 1 of each row are computed too and thrown away (Wp / W more
// work: 6% on 32 x 32 planes, 12% on 16 x 16).
//
// Small planes side by side. Under min_width, a grid holds several images in a row, sharing their
// borders (Wp = S (W + 1) + 1; image s's columns from 1 + s (W + 1)): the same shifts, and a thrown
// column per image instead of two per image and a span rounded up per image (of the positions
// computed, on ResNet-18's 8 x 8 planes 16% are thrown at 8 images, 33% alone; on 4 x 4, 27% at 16,
// 50% alone). Each thread picks the group size
// that computes the fewest positions over its samples (Plan::for_count), and the weight gradient sums
// several groups (k of 1024 positions or more) in each pass over its sums.
//
// Stride 2. The input becomes four planes a channel, its phases (x[2i + a][2j + b] at (i, j), on the
// output's grid): tap (ky, kx) reads phase (ky != 1, kx != 1) at a shift of 0 or 1 row and column, so
// the forward and the weight gradient are the stride-1 products with a phase per tap. The input
// gradient is a stride-1 product over dz whose taps fall into the four phases of dx (1, 2, 2 and 4
// taps), each written to every other pixel of dx.
//
//   forward, and the input gradient (for stride 1 the same product with the weights rotated and their
//   channels swapped): C tiles of 16 output channels x 16 grid positions; A = the weights of one tap and 32
//   input channels (16 x 16 pairs, packed once a call); B = 16 channel pairs x 16 positions, loaded
//   straight from the input's pair planes ("NC/2HW2": pair (c, c + 1) of each position, the plane of
//   each pair of channels `plane` pairs long).
//   weight gradient: C tiles of 16 input x 16 output channels per tap, summed over grid positions
//   (the product's k): A = 16 input channels x 32 positions, loaded straight from the bf16 input planes
//   at the tap's shift; B = 16 position pairs x 16 output channels, dz on the grid (zero at the thrown
//   positions) paired along positions.
//
// Each register block is 2 x 2 C tiles (32 x 32), from 2 A and 2 B tiles: four tile loads per four
// TDPBF16PS. Numerics as the bf16 GEMMs: operands rounded to bf16 (to nearest even), exact products,
// fp32 sums; only the order of the sums differs (pairs of channels here, pairs of the patch there). So
// HostPrecision::bf16_emulated, which keeps these convs on the GEMMs, gives VDPBF16PS's bits only where
// this path does not run (tests/net/precision.cpp).
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/host/gemm_bf16.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fusedp::kernels::host::conv3x3_bf16 {

using bf16::Pair;
static_assert(sizeof(Pair) == sizeof(float), "conv3x3_bf16: a pair is one float of scratch, and B's rows are strided alike");

/// Output channels and grid positions of one register block (2 x 2 C tiles); channels come in blocks
/// of this many.
inline constexpr std::size_t block = 32;
/// Planes narrower than this put several images side by side on one grid (Plan::samples): alone, their
/// thrown positions cost what im2col saves (8 x 8 planes: Wp / W = 1.25, a span of 80 rounded up to 96,
/// and k = 96 a sample in the weight gradient, whose sums went back to memory each sample).
inline constexpr int min_width = 16;
/// The narrowest plane the direct path takes (4 wide: over a quarter of the positions computed are thrown).
inline constexpr int narrowest = 4;

/// True where a conv's geometry suits this path: 3x3, stride 1 or 2, padding 1, channels in and out
/// multiples of 32, output planes at least `narrowest` wide. (Whether it runs also takes a Host at
/// precision bf16 and a translation unit compiled with its code, FUSEDP_HOST_AVX512_BF16: conv2d.hpp's
/// direct_bf16_runs. The geometry alone sizes the scratch, so every unit, nvcc's host pass included, sizes
/// it alike.)
constexpr bool applies(const ConvGeometry& g) {
  return g.kernel == 3 && (g.stride == 1 || g.stride == 2) && g.pad == 1 && g.in_channels % block == 0 &&
         g.out_channels % block == 0 && g.out_w >= narrowest;
}

/// The product that gives conv g's input gradient: a stride-1 3x3 conv over dz (O channels of its output
/// planes) into C channels on the same grid (for stride 1, winograd::transposed(g); for stride 2 each of
/// the four phases of dx takes its own taps of it, input_gradient3x3).
constexpr ConvGeometry input_gradient_geometry(const ConvGeometry& g) {
  return {g.out_channels, g.out_h, g.out_w, 3, 1, 1, g.in_channels, g.out_h, g.out_w};
}

/// Images side by side on one grid, at most: one on planes min_width or wider, else 64 / W.
constexpr std::size_t max_samples(const ConvGeometry& g) {
  return g.out_w >= min_width ? 1 : 64 / std::size_t(g.out_w);
}

/// The grid and one thread's scratch for conv `g`, in floats (a pair, or two bf16, a float), with
/// `samples` images side by side: image s's row y at padded row y + 1, columns 1 + s (W + 1) onwards,
/// the images' borders shared (Wp = samples (W + 1) + 1), W and the rows those of the output. With
/// stride 2 the input is four such planes a channel, its phases: phase 2a + b holds x[2i + a][2j + b]
/// at (i, j), so tap (ky, kx) reads phase (ky != 1, kx != 1) at (i + (ky != 0) - 1, j + (kx != 0) - 1).
struct Plan {
  ConvGeometry g;
  std::size_t samples = 1;
  [[nodiscard]] constexpr std::size_t wp() const { return samples * (std::size_t(g.out_w) + 1) + 1; }
  /// Planes a channel of the input: 1, or the 4 phases of a stride-2 conv.
  [[nodiscard]] constexpr std::size_t phases() const { return g.stride == 2 ? 4 : 1; }
  /// Grid positions of one group's outputs, the thrown ones included.
  [[nodiscard]] constexpr std::size_t grid() const { return std::size_t(g.out_h) * wp(); }
  /// Grid positions computed: grid() rounded up to whole blocks (the weight gradient's k a group).
  [[nodiscard]] constexpr std::size_t span() const { return host::detail::round_up(grid(), block); }
  /// Values of one channel's (or pair's) plane: every position a tap reads from span(), border included.
  [[nodiscard]] constexpr std::size_t plane() const { return host::detail::round_up(span() + 2 * wp() + 2, 16); }
  /// Where tap t of grid position j reads: position j + shift(t) of phase phase(t)'s padded plane.
  [[nodiscard]] constexpr std::size_t shift(std::size_t t) const {
    return g.stride == 2 ? (t / 3 != 0) * wp() + (t % 3 != 0) : t / 3 * wp() + t % 3;
  }
  [[nodiscard]] constexpr std::size_t phase(std::size_t t) const {
    return g.stride == 2 ? (t / 3 != 1) * 2 + (t % 3 != 1) : 0;
  }

  // conv3x3 (and input_gradient3x3, on input_gradient_geometry): the packed weights (thread 0's, read
  // by all), then the input's pair planes.
  [[nodiscard]] constexpr std::size_t weights() const {
    return align_elements(9 * std::size_t(g.in_channels) * std::size_t(g.out_channels) / 2);
  }
  [[nodiscard]] constexpr std::size_t input() const {
    return align_elements(phases() * std::size_t(g.in_channels) / 2 * plane());
  }
  [[nodiscard]] constexpr std::size_t per_thread() const { return weights() + input(); }

  // weight_gradient3x3: the thread's sums dW^T per tap (9, C, O) first (where the threads' sums are
  // added up, whatever each thread's plan), then for each of chunk() groups the input's bf16 planes,
  // dz on the grid (fp32, one group's), and for each group dz's pairs along positions.
  /// Groups whose products run in one pass over the sums: k of 1024 positions or more (the sums of
  /// ResNet-18's last stage are 9.4 MB a thread, read and written once a pass).
  [[nodiscard]] constexpr std::size_t chunk() const { return (1024 + span() - 1) / span(); }
  [[nodiscard]] constexpr std::size_t sums() const {
    return align_elements(9 * std::size_t(g.in_channels) * std::size_t(g.out_channels));
  }
  [[nodiscard]] constexpr std::size_t image() const {
    return align_elements(phases() * std::size_t(g.in_channels) * plane() / 2);
  }
  [[nodiscard]] constexpr std::size_t gradient() const { return align_elements(std::size_t(g.out_channels) * span()); }
  [[nodiscard]] constexpr std::size_t gradient_pairs() const {
    return align_elements(span() / 2 * std::size_t(g.out_channels));
  }
  [[nodiscard]] constexpr std::size_t image_at(std::size_t group) const { return sums() + group * image(); }
  [[nodiscard]] constexpr std::size_t gradient_at() const { return image_at(chunk()); }
  [[nodiscard]] constexpr std::size_t pairs_at(std::size_t group) const {
    return gradient_at() + gradient() + group * gradient_pairs();
  }
  [[nodiscard]] constexpr std::size_t weight_gradient_per_thread() const { return pairs_at(chunk()); }

  /// The plan for `count` images of one thread: the group size up to max_samples that computes the
  /// fewest grid positions over them (ties: fewer images a group).
  [[nodiscard]] static constexpr Plan for_count(const ConvGeometry& g, std::size_t count) {
    Plan best{g, 1};
    std::size_t least = ~std::size_t(0);
    for (std::size_t s = 1; s <= std::min(max_samples(g), std::max<std::size_t>(count, 1)); ++s) {
      const Plan p{g, s};
      const std::size_t work = (count + s - 1) / s * p.span();
      if (work < least) least = work, best = p;
    }
    return best;
  }
};

/// One thread's scratch for conv3x3 on `g` (input_gradient3x3: on input_gradient_geometry(g)), whatever
/// its plan (input() grows with the images a group).
constexpr std::size_t per_thread(const ConvGeometry& g) { return Plan{g, max_samples(g)}.per_thread(); }
/// One thread's scratch for weight_gradient3x3 on `g`, whatever its plan.
constexpr std::size_t weight_gradient_per_thread(const ConvGeometry& g) {
  std::size_t most = 0;
  for (std::size_t s = 1; s <= max_samples(g); ++s) most = std::max(most, Plan{g, s}.weight_gradient_per_thread());
  return most;
}

namespace detail {
// The positions [j0, j0 + 32) of a group of `count` images that are outputs, as runs of one image's row:
// run(s, p, at, length): image s's pixels p .. p + length, at out's column `at`.
template <class Run>
void for_each_run(const Plan& plan, std::size_t count, std::size_t j0, const Run& run) {
  const std::size_t wp = plan.wp(), W = std::size_t(plan.g.out_w);
  for (std::size_t j = j0, end = std::min(j0 + block, plan.grid()); j < end;) {
    const std::size_t oy = j / wp, col = j % wp, s = col / (W + 1), ox = col % (W + 1);
    if (s >= count) {  // past the group's last image: the row's rest
      j += wp - col;
      continue;
    }
    if (ox == W) {  // a border
      ++j;
      continue;
    }
    const std::size_t length = std::min(W - ox, end - j);
    run(s, oy * W + ox, j - j0, length);
    j += length;
  }
}
}  // namespace detail

#if FUSEDP_HOST_AVX512_BF16
// As in gemm_bf16.hpp: GCC 12 takes _mm512_undefined's self-initialization inside the conversion
// intrinsics for an uninitialized read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"  // the same, where it inlines them next to a gather
#endif
namespace detail {
using bf16::detail::bf16_bits;
using bf16::detail::first_lanes;

// One step of the 2 x 2 register block: C tiles 0, 1 (rows of A tile `a`) and 2, 3 (of `a_low`) += A
// times B tiles `b` (columns of C tiles 0, 2) and `b_right` (1, 3).
[[gnu::target("amx-tile,amx-bf16")]] FUSEDP_ALWAYS_INLINE void block_step(const void* a, const void* a_low,
                                                                          std::size_t a_stride, const void* b,
                                                                          const void* b_right, std::size_t b_stride) {
  _tile_loadd(4, a, a_stride);
  _tile_loadd(5, a_low, a_stride);
  _tile_loadd(6, b, b_stride);
  _tile_loadd(7, b_right, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}
// The block's C tiles to c (32 x 32 floats, rows ld apart).
[[gnu::target("amx-tile")]] FUSEDP_ALWAYS_INLINE void store_block(float* c, std::size_t ld) {
  _tile_stored(0, c, ld * sizeof(float));
  _tile_stored(1, c + 16, ld * sizeof(float));
  _tile_stored(2, c + 16 * ld, ld * sizeof(float));
  _tile_stored(3, c + 16 * ld + 16, ld * sizeof(float));
}

// 32 outputs x 32 grid positions: out (32 x 32 floats) = the sum over `taps` taps and blocks of 32
// input channels of A B. a: this block's weights, [tap][channel block][half][16 rows x 16 pairs]; in:
// the input's pair planes at the first position, channel pairs `plane` pairs apart, tap t's B at
// in + offset[t].
[[gnu::noinline, gnu::target("amx-tile,amx-bf16")]] inline void conv_block(const Pair* a, const Pair* in, std::size_t plane,
                                                                          std::size_t channel_blocks,
                                                                          const std::size_t* offset, std::size_t taps,
                                                                          float* out) {
  const std::size_t b_stride = plane * sizeof(Pair);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (std::size_t t = 0; t < taps; ++t) {
    const Pair* b = in + offset[t];
    for (std::size_t cb = 0; cb < channel_blocks; ++cb, a += 2 * 256, b += 16 * plane)
      block_step(a, a + 256, 64, b, b + 16, b_stride);
  }
  store_block(out, block);
}

// sums (32 input x 32 output channels, rows `outs` apart) += image (32 channels' bf16 planes at the
// tap's shift, `plane` apart) times dz's pairs (from position 0, rows of `outs` pairs), over `span`
// positions of each of `groups` groups (the next group's image `image_step` values on, its pairs
// `pairs_step` pairs on).
[[gnu::noinline, gnu::target("amx-tile,amx-bf16")]] inline void weight_block(const std::uint16_t* image, std::size_t plane,
                                                                            std::size_t image_step, const Pair* pairs,
                                                                            std::size_t outs, std::size_t pairs_step,
                                                                            std::size_t span, std::size_t groups,
                                                                            float* sums) {
  const std::size_t s_stride = outs * sizeof(float), a_stride = plane * sizeof(std::uint16_t);
  _tile_loadd(0, sums, s_stride);
  _tile_loadd(1, sums + 16, s_stride);
  _tile_loadd(2, sums + 16 * outs, s_stride);
  _tile_loadd(3, sums + 16 * outs + 16, s_stride);
  for (std::size_t q = 0; q < groups; ++q, image += image_step, pairs += pairs_step) {
    const std::uint16_t* a = image;
    const Pair* b = pairs;
    for (std::size_t j = 0; j < span; j += block, a += block, b += 16 * outs)
      block_step(a, a + 16 * plane, a_stride, b, b + 16, s_stride);
  }
  store_block(sums, outs);
}

// The same two products by VDPBF16PS, where the CPU has AVX-512 BF16 but no tiles (AMD Zen 4 and
// later): C rows of 32 lanes as two zmm of fp32 sums, dp_rows rows at a time (8: 16 sums, 2 B loads and
// 8 broadcasts for 16 VDPBF16PS), each lane += a pair of A broadcast times the lane's pair of B.
// Only the order of the sums differs from the tiles'.
constexpr std::size_t dp_rows = 8;

// C rows [r0, r0 + dp_rows) of a 2 x 2 tile block, as conv_block computes them: row r's pair q of A at
// a + (r / 16) 256 + (r % 16) 16 + q.
[[gnu::target("avx512f,avx512bf16")]] FUSEDP_ALWAYS_INLINE void conv_rows_dp(const Pair* a, const Pair* in,
                                                                             std::size_t plane,
                                                                             std::size_t channel_blocks,
                                                                             const std::size_t* offset,
                                                                             std::size_t taps, std::size_t r0,
                                                                             float* out) {
  __m512 acc[dp_rows][2];
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < dp_rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const Pair* rows = a + (r0 / 16) * 256 + (r0 % 16) * 16;
  for (std::size_t t = 0; t < taps; ++t) {
    const Pair* b = in + offset[t];
    for (std::size_t cb = 0; cb < channel_blocks; ++cb, rows += 2 * 256, b += 16 * plane)
      for (std::size_t q = 0; q < 16; ++q) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + q * plane);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + q * plane + 16);
        FUSEDP_UNROLL(8)
        for (std::size_t i = 0; i < dp_rows; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(int(rows[i * 16 + q]));
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w, b0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w, b1);
        }
      }
  }
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < dp_rows; ++i) {
    _mm512_storeu_ps(out + (r0 + i) * block, acc[i][0]);
    _mm512_storeu_ps(out + (r0 + i) * block + 16, acc[i][1]);
  }
}

// conv_block by VDPBF16PS.
[[gnu::noinline, gnu::target("avx512f,avx512bf16")]] inline void conv_block_dp(const Pair* a, const Pair* in,
                                                                              std::size_t plane,
                                                                              std::size_t channel_blocks,
                                                                              const std::size_t* offset,
                                                                              std::size_t taps, float* out) {
  for (std::size_t r0 = 0; r0 < block; r0 += dp_rows)
    conv_rows_dp(a, in, plane, channel_blocks, offset, taps, r0, out);
}

// weight_block by VDPBF16PS: sums' rows [r0, r0 + dp_rows) (input channels), A's pair k of row r the
// two bf16 values of positions 2k, 2k + 1 of image row r (a 32-bit read at any alignment).
[[gnu::target("avx512f,avx512bf16")]] FUSEDP_ALWAYS_INLINE void weight_rows_dp(
    const std::uint16_t* image, std::size_t plane, std::size_t image_step, const Pair* pairs, std::size_t outs,
    std::size_t pairs_step, std::size_t span, std::size_t groups, std::size_t r0, float* sums) {
  __m512 acc[dp_rows][2];
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < dp_rows; ++i) {
    acc[i][0] = _mm512_loadu_ps(sums + (r0 + i) * outs);
    acc[i][1] = _mm512_loadu_ps(sums + (r0 + i) * outs + 16);
  }
  image += r0 * plane;
  for (std::size_t g = 0; g < groups; ++g, image += image_step, pairs += pairs_step)
    for (std::size_t k = 0; k < span / 2; ++k) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pairs + k * outs);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pairs + k * outs + 16);
      FUSEDP_UNROLL(8)
      for (std::size_t i = 0; i < dp_rows; ++i) {
        std::uint32_t two;
        std::memcpy(&two, image + i * plane + 2 * k, sizeof two);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(int(two));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w, b1);
      }
    }
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < dp_rows; ++i) {
    _mm512_storeu_ps(sums + (r0 + i) * outs, acc[i][0]);
    _mm512_storeu_ps(sums + (r0 + i) * outs + 16, acc[i][1]);
  }
}

// weight_block by VDPBF16PS.
[[gnu::noinline, gnu::target("avx512f,avx512bf16")]] inline void weight_block_dp(
    const std::uint16_t* image, std::size_t plane, std::size_t image_step, const Pair* pairs, std::size_t outs,
    std::size_t pairs_step, std::size_t span, std::size_t groups, float* sums) {
  for (std::size_t r0 = 0; r0 < block; r0 += dp_rows)
    weight_rows_dp(image, plane, image_step, pairs, outs, pairs_step, span, groups, r0, sums);
}

// One tap's weights for 32 rows and 32 channels as A tiles' rows (32 rows of 16 pairs): row r's pair q
// = pair(src[r row_step + 2q step], src[r row_step + (2q + 1) step]), rounded as pair() rounds.
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void strided_pairs(const float* src, std::size_t row_step,
                                                                           int step, Pair* dst) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                                        _mm512_set1_epi32(step));
  // (No lambda for the two gathers: a lambda does not take the function's target, so builds without
  // -march=native could not inline the intrinsics into it.)
  for (std::size_t r = 0; r < block; ++r, src += row_step, dst += 16)
    _mm512_storeu_si512(dst, bf16::detail::pairs_of(_mm512_i32gather_ps(at, src, 4), _mm512_i32gather_ps(at, src + step, 4)));
}

// dst[j] = bf16 of src[j] (to_bf16's rounding) for j < n.
[[gnu::target("avx512f,avx512bw,avx512vl")]] inline void bf16_of(const float* src, std::size_t n, std::uint16_t* dst) {
  for (std::size_t j = 0; j < n; j += bf16::lanes) {
    const __mmask16 m = first_lanes(n - j);
    _mm256_mask_storeu_epi16(dst + j, m, _mm512_cvtepi32_epi16(bf16_bits(_mm512_maskz_loadu_ps(m, src + j))));
  }
}

// Lanes j = src[2j + b] of a row whose first n values are real (the rest read as zero).
[[gnu::target("avx512f,avx512bw")]] FUSEDP_ALWAYS_INLINE __m512 every_other(const float* src, std::size_t n, std::size_t b) {
  const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(n), src);
  const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(n > bf16::lanes ? n - bf16::lanes : 0), src + bf16::lanes);
  const __m512i at = _mm512_add_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                                      _mm512_set1_epi32(int(b)));
  return _mm512_permutex2var_ps(lo, at, hi);
}
// A phase's row: dst[j] = pair(even[2j + b], odd[2j + b]) for j < w, of input rows n long (zero past them).
[[gnu::noinline, gnu::target("avx512f,avx512bw")]] inline void phase_pairs(const float* even, const float* odd,
                                                                          std::size_t n, std::size_t b, std::size_t w,
                                                                          Pair* dst) {
  for (std::size_t j = 0; j < w; j += bf16::lanes) {
    const std::size_t left = n > 2 * j ? n - 2 * j : 0;
    _mm512_mask_storeu_epi32(dst + j, first_lanes(w - j),
                             bf16::detail::pairs_of(every_other(even + 2 * j, left, b), every_other(odd + 2 * j, left, b)));
  }
}
// A phase's row: dst[j] = bf16 of src[2j + b] for j < w, of an input row n long (zero past it).
[[gnu::noinline, gnu::target("avx512f,avx512bw,avx512vl")]] inline void phase_bf16(const float* src, std::size_t n,
                                                                                  std::size_t b, std::size_t w,
                                                                                  std::uint16_t* dst) {
  for (std::size_t j = 0; j < w; j += bf16::lanes) {
    const std::size_t left = n > 2 * j ? n - 2 * j : 0;
    _mm256_mask_storeu_epi16(dst + j, first_lanes(w - j), _mm512_cvtepi32_epi16(bf16_bits(every_other(src + 2 * j, left, b))));
  }
}

// The padded plane (Plan::plane() values, of type V) of `count` (at most p.samples) images of the output's
// h x w side by side: image s's row y at (y + 1) wp + 1 + s (w + 1), zero elsewhere (the absent images'
// columns too); row(s, y, dst) writes the w values of image s's row y.
template <class V, class Row>
void padded_plane(const Plan& p, std::size_t count, V* dst, const Row& row) {
  const std::size_t h = std::size_t(p.g.out_h), w = std::size_t(p.g.out_w), wp = p.wp();
  std::fill(dst, dst + wp, V(0));
  for (std::size_t y = 0; y < h; ++y) {
    V* r = dst + (y + 1) * wp;
    r[0] = V(0);  // the row's left border
    for (std::size_t s = 0; s < p.samples; ++s) {
      V* image = r + 1 + s * (w + 1);
      if (s < count) row(s, y, image);
      else std::fill(image, image + w, V(0));
      image[w] = V(0);  // the border after image s (the next one's left border, or the row's right one)
    }
  }
  std::fill(dst + (h + 1) * wp, dst + p.plane(), V(0));
}

// The input row that grid row i of phase ph reads, in channel plane `plane` (H x W): null past the input.
inline const float* phase_row(const Plan& p, std::size_t ph, const float* plane, std::size_t i) {
  const std::size_t row = p.g.stride == 2 ? 2 * i + ph / 2 : i;
  return row < std::size_t(p.g.in_h) ? plane + row * std::size_t(p.g.in_w) : nullptr;
}

// The group's input as pair planes, [phase][channel pair][plane]: samples n .. n + count of x, the
// batch of p.g's inputs.
inline void pair_planes(const Plan& p, const float* x, std::size_t n, std::size_t count, Pair* in) {
  const std::size_t C = std::size_t(p.g.in_channels), HW = std::size_t(p.g.in_h) * std::size_t(p.g.in_w);
  const std::size_t W = std::size_t(p.g.in_w), w = std::size_t(p.g.out_w), L = p.plane();
  for (std::size_t ph = 0; ph < p.phases(); ++ph)
    for (std::size_t cp = 0; cp < C / 2; ++cp)
      padded_plane(p, count, in + (ph * C / 2 + cp) * L, [&](std::size_t s, std::size_t i, Pair* dst) {
        const float* even = phase_row(p, ph, x + (n + s) * p.g.in_size() + 2 * cp * HW, i);
        if (even == nullptr) std::fill(dst, dst + w, Pair(0));
        else if (p.g.stride == 1) bf16::detail::pairs_of_rows(even, even + HW, W, dst);
        else phase_pairs(even, even + HW, W, ph % 2, w, dst);
      });
}

// The group's input as bf16 planes, [phase][channel][plane], as pair_planes.
inline void bf16_planes(const Plan& p, const float* x, std::size_t n, std::size_t count, std::uint16_t* image) {
  const std::size_t C = std::size_t(p.g.in_channels), HW = std::size_t(p.g.in_h) * std::size_t(p.g.in_w);
  const std::size_t W = std::size_t(p.g.in_w), w = std::size_t(p.g.out_w), L = p.plane();
  for (std::size_t ph = 0; ph < p.phases(); ++ph)
    for (std::size_t c = 0; c < C; ++c)
      padded_plane(p, count, image + (ph * C + c) * L, [&](std::size_t s, std::size_t i, std::uint16_t* dst) {
        const float* src = phase_row(p, ph, x + (n + s) * p.g.in_size() + c * HW, i);
        if (src == nullptr) std::fill(dst, dst + w, std::uint16_t(0));
        else if (p.g.stride == 1) bf16_of(src, W, dst);
        else phase_bf16(src, W, ph % 2, w, dst);
      });
}

// A product's weights as A tiles, [block of 32 rows][tap, in `order`][block of 32 k][32 rows x 16 pairs],
// from w as stored, (rows, k, 3, 3), or with `swapped` from the conv's whose input gradient this is,
// (k, rows, 3, 3). Gathered 16 at a time (one at a time, this was 5% of ResNet-18's bf16 step: 4.7 M
// weights a call in its last stage).
inline void pack_weights(const Host& host, const float* w, std::size_t rows, std::size_t k, bool swapped,
                         const std::size_t* order, Pair* a) {
  const std::size_t per_block = 9 * (k / block) * block * 16;
  host.parallel_for(rows / block, [&](std::size_t b0, std::size_t b1, int) {
    for (std::size_t rb = b0; rb < b1; ++rb) {
      Pair* dst = a + rb * per_block;
      for (std::size_t t = 0; t < 9; ++t)
        for (std::size_t kb = 0; kb < k / block; ++kb, dst += block * 16) {
          const std::size_t r = rb * block, kk = kb * block, tap = order[t];
          if (swapped) strided_pairs(w + (kk * rows + r) * 9 + tap, 9, int(rows * 9), dst);
          else strided_pairs(w + (r * k + kk) * 9 + tap, k * 9, 9, dst);
        }
    }
  });
}

// Passes of the product over one block of positions: pass q sums taps [first[q], first[q] + taps[q]) of
// the packed weights, tap t's B at the input planes + offset[t].
struct Passes {
  std::size_t count = 1;
  std::size_t first[4] = {0, 0, 0, 0};
  std::size_t taps[4] = {9, 0, 0, 0};
  std::size_t offset[9] = {};
};

// The product of packed weights `a` (conv3x3's layout for g) with each thread's samples in groups of its
// plan's size: prepare(plan, n, count, in) writes the group's input planes; for each block of 32 outputs
// (outermost: one block's weights, 288 KB at 512 channels, stay in cache over the group's positions)
// and 32 positions, each pass into out, then write(plan, q, n, count, ob, j0, out).
template <class PassesOf, class Prepare, class Write>
void direct_product(const Host& host, const ConvGeometry& g, std::size_t batch, const Pair* a, float* scratch,
                    const PassesOf& passes_of, const Prepare& prepare, const Write& write) {
  const std::size_t stride = per_thread(g), channel_blocks = std::size_t(g.in_channels) / block;
  const std::size_t per_block = 9 * channel_blocks * block * 16;
  const bool tiles = host.bf16_tiles();
  host.parallel_for(batch, [&](std::size_t n0, std::size_t n1, int thread) {
    if (tiles) bf16::detail::configure_tiles();  // per thread, per call: see gemm_bf16.hpp
    const Plan plan = Plan::for_count(g, n1 - n0);
    const Passes passes = passes_of(plan);
    auto* in = reinterpret_cast<Pair*>(scratch + std::size_t(thread) * stride + plan.weights());
    alignas(64) float out[block * block];
    for (std::size_t n = n0; n < n1; n += plan.samples) {
      const std::size_t count = std::min(plan.samples, n1 - n);
      prepare(plan, n, count, in);
      for (std::size_t ob = 0; ob < std::size_t(g.out_channels) / block; ++ob)
        for (std::size_t j0 = 0; j0 < plan.span(); j0 += block)
          for (std::size_t q = 0; q < passes.count; ++q) {
            (tiles ? conv_block : conv_block_dp)(a + ob * per_block + passes.first[q] * channel_blocks * block * 16,
                                                 in + j0, plan.plane(), channel_blocks,
                                                 passes.offset + passes.first[q], passes.taps[q], out);
            write(plan, q, n, count, ob, j0, out);
          }
    }
  });
}

}  // namespace detail
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

/// y = epi(conv(x, w)) for `batch` samples of a conv that `applies`: x (N, C, H, W), w as stored
/// (O, C, 3, 3). make_epi(n) gives sample n's epilogue, called as epi(o, p0, &y[n][o][p0], count) on runs
/// of one row. scratch: host.threads() x conv3x3_bf16::per_thread(g). Only at precision bf16 (conv2d.hpp's
/// direct_bf16_runs).
template <class MakeEpi>
void conv3x3(const Host& host, const ConvGeometry& g, std::size_t batch, const float* w, const float* x, float* y,
             float* scratch, const MakeEpi& make_epi) {
#if FUSEDP_HOST_AVX512_BF16
  const std::size_t O = std::size_t(g.out_channels), C = std::size_t(g.in_channels), P = g.out_pixels();
  auto* a = reinterpret_cast<Pair*>(scratch);  // thread 0's, read by all
  constexpr std::size_t natural[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  detail::pack_weights(host, w, O, C, false, natural, a);
  detail::direct_product(
      host, g, batch, a, scratch,
      [&](const Plan& plan) {
        detail::Passes passes;
        for (std::size_t t = 0; t < 9; ++t) passes.offset[t] = plan.phase(t) * (C / 2) * plan.plane() + plan.shift(t);
        return passes;
      },
      [&](const Plan& plan, std::size_t n, std::size_t count, Pair* in) { detail::pair_planes(plan, x, n, count, in); },
      [&](const Plan& plan, std::size_t, std::size_t n, std::size_t count, std::size_t ob, std::size_t j0,
          const float* out) {
        detail::for_each_run(plan, count, j0, [&](std::size_t s, std::size_t p, std::size_t at, std::size_t length) {
          const auto epi = make_epi(n + s);
          float* yn = y + (n + s) * g.out_size();
          for (std::size_t r = 0; r < block; ++r) {
            const std::size_t o = ob * block + r;
            float* dst = yn + o * P + p;
            simd::copy(dst, out + r * block + at, length);
            epi(o, p, dst, length);
          }
        });
      });
#else
  (void)host, (void)g, (void)batch, (void)w, (void)x, (void)y, (void)scratch, (void)make_epi;
  throw InvalidArgument("Host: the bf16 3x3 conv was called in a translation unit compiled without AVX-512 BF16 and AMX");
#endif
}

/// dx (N, C, H, W) = the input gradient of conv `g` (one that `applies`) over `batch` samples, from dz
/// (N, O, Ho, Wo), the gradient of its output before any epilogue, and w as stored (O, C, 3, 3); with
/// `bf16_dx`, rounded to bf16 values as it is written. The product of input_gradient_geometry(g): for
/// stride 1 a conv with the taps rotated (as winograd::conv3x3); for stride 2 each phase (a, b) of dx
/// (dx[2i + a][2j + b]) sums its own taps (1, 2, 2 or 4: ky = 1 for a = 0, ky = 0 and 2 for a = 1, reading
/// dz row i + 1 and i; columns alike) on the grid of dz. scratch: host.threads() x
/// conv3x3_bf16::per_thread(input_gradient_geometry(g)). Only at precision bf16.
inline void input_gradient3x3(const Host& host, const ConvGeometry& g, std::size_t batch, const float* w,
                              const float* dz, float* dx, float* scratch, bool bf16_dx) {
#if FUSEDP_HOST_AVX512_BF16
  const ConvGeometry gi = input_gradient_geometry(g);
  const std::size_t O = std::size_t(g.out_channels), C = std::size_t(g.in_channels), H = std::size_t(g.in_h);
  const std::size_t W = std::size_t(g.in_w);
  const bool strided = g.stride == 2;
  // Stride 2: the taps phase by phase, phase 2a + b's from first[ph] on.
  constexpr std::size_t rotated[9] = {8, 7, 6, 5, 4, 3, 2, 1, 0}, by_phase[9] = {4, 3, 5, 1, 7, 0, 2, 6, 8};
  constexpr std::size_t first[4] = {0, 1, 3, 5}, taps[4] = {1, 2, 2, 4};
  auto* a = reinterpret_cast<Pair*>(scratch);  // thread 0's, read by all
  detail::pack_weights(host, w, C, O, true, strided ? by_phase : rotated, a);
  auto round = [bf16_dx](float v) { return bf16_dx ? round_bf16(v) : v; };
  detail::direct_product(
      host, gi, batch, a, scratch,
      [&](const Plan& plan) {
        detail::Passes passes;
        if (!strided) {
          for (std::size_t t = 0; t < 9; ++t) passes.offset[t] = plan.shift(t);
          return passes;
        }
        passes.count = 4;
        for (std::size_t ph = 0; ph < 4; ++ph) passes.first[ph] = first[ph], passes.taps[ph] = taps[ph];
        // Tap (ky, kx) of grid position (i, j) reads dz at (i + (ky == 0), j + (kx == 0)).
        for (std::size_t t = 0; t < 9; ++t)
          passes.offset[t] = (1 + (by_phase[t] / 3 == 0)) * plan.wp() + 1 + (by_phase[t] % 3 == 0);
        return passes;
      },
      [&](const Plan& plan, std::size_t n, std::size_t count, Pair* in) { detail::pair_planes(plan, dz, n, count, in); },
      [&](const Plan& plan, std::size_t ph, std::size_t n, std::size_t count, std::size_t ob, std::size_t j0,
          const float* out) {
        detail::for_each_run(plan, count, j0, [&](std::size_t s, std::size_t p, std::size_t at, std::size_t length) {
          float* dxn = dx + (n + s) * g.in_size();
          if (!strided) {
            for (std::size_t r = 0; r < block; ++r) {
              float* dst = dxn + (ob * block + r) * H * W + p;
              simd::copy(dst, out + r * block + at, length);
              round_run_if(bf16_dx, dst, length);
            }
            return;
          }
          // Grid pixel (i, j) of phase ph is dx's (2i + a, 2j + b), where inside dx.
          const std::size_t wo = std::size_t(plan.g.out_w), iy = 2 * (p / wo) + ph / 2, x0 = 2 * (p % wo) + ph % 2;
          if (iy >= H) return;
          const std::size_t inside = x0 < W ? std::min(length, (W - x0 + 1) / 2) : 0;
          for (std::size_t r = 0; r < block; ++r) {
            float* dst = dxn + ((ob * block + r) * H + iy) * W + x0;
            const float* src = out + r * block + at;
            for (std::size_t u = 0; u < inside; ++u) dst[2 * u] = round(src[u]);
          }
        });
      });
#else
  (void)host, (void)g, (void)batch, (void)w, (void)dz, (void)dx, (void)scratch, (void)bf16_dx;
  throw InvalidArgument("Host: the bf16 3x3 conv was called in a translation unit compiled without AVX-512 BF16 and AMX");
#endif
}

/// dw (O, C, 3, 3) = the weight gradient of conv `g` (one that `applies`) over `batch` samples: x its
/// input, dz the gradient of its output (before any epilogue). Each thread sums over its samples; the
/// sums are added in thread order, so the result depends on the thread count only. scratch:
/// host.threads() x conv3x3_bf16::weight_gradient_per_thread(g). Only at precision bf16.
inline void weight_gradient3x3(const Host& host, const ConvGeometry& g, std::size_t batch, const float* x,
                               const float* dz, float* dw, float* scratch) {
#if FUSEDP_HOST_AVX512_BF16
  const std::size_t O = std::size_t(g.out_channels), C = std::size_t(g.in_channels), H = std::size_t(g.out_h);
  const std::size_t W = std::size_t(g.out_w), P = g.out_pixels(), stride = weight_gradient_per_thread(g);
  const auto threads = std::size_t(host.threads());
  const bool tiles = host.bf16_tiles();
  host.parallel_for(threads, [&](std::size_t, std::size_t, int thread) {
    const std::size_t n0 = batch * std::size_t(thread) / threads, n1 = batch * (std::size_t(thread) + 1) / threads;
    const Plan plan = Plan::for_count(g, n1 - n0);
    const std::size_t S = plan.samples, wp = plan.wp(), L = plan.plane(), J = plan.span();
    float* own = scratch + std::size_t(thread) * stride;
    float* sums = own;  // (9, C, O): Plan puts them first
    float* grid = own + plan.gradient_at();
    simd::zero(sums, 9 * C * O);
    if (tiles) bf16::detail::configure_tiles();
    for (std::size_t c0 = n0; c0 < n1; c0 += plan.chunk() * S) {
      const std::size_t groups = (std::min(plan.chunk() * S, n1 - c0) + S - 1) / S;
      for (std::size_t q = 0; q < groups; ++q) {
        const std::size_t n = c0 + q * S, count = std::min(S, n1 - n);
        detail::bf16_planes(plan, x, n, count, reinterpret_cast<std::uint16_t*>(own + plan.image_at(q)));
        // dz on the grid: image s's row y at y wp + s (W + 1), zero at the thrown positions, the absent
        // images' and past the last row.
        for (std::size_t o = 0; o < O; ++o) {
          float* dst = grid + o * J;
          for (std::size_t r = 0; r < H; ++r) {
            float* row = dst + r * wp;
            for (std::size_t s = 0; s < S; ++s) {
              float* image_row = row + s * (W + 1);
              if (s < count) simd::copy(image_row, dz + (n + s) * g.out_size() + o * P + r * W, W);
              else simd::zero(image_row, W);
              image_row[W] = 0.0f;
            }
            row[wp - 1] = 0.0f;
          }
          std::fill(dst + H * wp, dst + J, 0.0f);
        }
        bf16::detail::pairs_of_columns(grid, J, J, O, reinterpret_cast<Pair*>(own + plan.pairs_at(q)), O);
      }
      const auto* image = reinterpret_cast<const std::uint16_t*>(own + plan.image_at(0));
      const auto* pairs = reinterpret_cast<const Pair*>(own + plan.pairs_at(0));
      for (std::size_t t = 0; t < 9; ++t)
        for (std::size_t cb = 0; cb < C / block; ++cb)
          for (std::size_t ob = 0; ob < O / block; ++ob)
            (tiles ? detail::weight_block : detail::weight_block_dp)(
                image + (plan.phase(t) * C + cb * block) * L + plan.shift(t), L, 2 * plan.image(), pairs + ob * block,
                O, plan.gradient_pairs(), J, groups, sums + (t * C + cb * block) * O + ob * block);
    }
  });
  // dw (O, C, 3, 3) = the threads' sums (9, C, O) added in thread order, 32 input channels at a time:
  // first the other threads' rows (t, c) added into thread 0's along o (streams), which brings the
  // block's 9 x 32 rows into cache, then dw's rows written one o at a time from there. (Summing and
  // transposing in one pass, 32 x 32 channels at a time, each read was a miss of its own: 5.5% of
  // ResNet-18's bf16 step, its last stage's 2.4 M sums a thread; along o with dw written across rows,
  // 8%.)
  host.parallel_for(C / block, [&](std::size_t b0, std::size_t b1, int) {
    for (std::size_t c0 = b0 * block; c0 < b1 * block; c0 += block) {
      for (std::size_t t = 0; t < 9; ++t)
        for (std::size_t c = c0; c < c0 + block; ++c) {
          float* FUSEDP_RESTRICT row = scratch + (t * C + c) * O;
          if (threads == 1)
            for (std::size_t o = 0; o < O; o += 16) __builtin_prefetch(row + o);
          for (std::size_t th = 1; th < threads; ++th) {
            const float* FUSEDP_RESTRICT other = row + th * stride;
            for (std::size_t o = 0; o < O; ++o) row[o] += other[o];
          }
        }
      for (std::size_t o = 0; o < O; ++o) {
        float* out = dw + (o * C + c0) * 9;
        for (std::size_t c = c0; c < c0 + block; ++c)
          for (std::size_t t = 0; t < 9; ++t) *out++ = scratch[(t * C + c) * O + o];
      }
    }
  });
#else
  (void)host, (void)g, (void)batch, (void)x, (void)dz, (void)dw, (void)scratch;
  throw InvalidArgument("Host: the bf16 3x3 conv was called in a translation unit compiled without AVX-512 BF16 and AMX");
#endif
}

}  // namespace fusedp::kernels::host::conv3x3_bf16
