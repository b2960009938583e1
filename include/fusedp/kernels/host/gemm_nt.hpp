#pragma once
// C = A B^T for operands whose rows both run along k, read in place: a convolution's weight gradient
// dz (O x P) col^T (col: K x P, row-major), where the output channels O or the patch K are few.
//
// The packed GEMM (gemm.hpp) must transpose both of these operands into k-major panels first. When
// k is long and m or n short that packing costs more than the product: CIFAR conv1's weight gradient
// (64 x 27 x 1024 per sample) ran at 69 GFLOP/s on one 175 GFLOP/s core, mostly packing. Here k lies
// in the vector lanes instead: a register tile holds one vector of partial sums per element of a
// rows x cols block of C, each step loads `rows` vectors of A and `cols` of B straight from their rows
// and does rows x cols multiply-adds; each partial-sum vector is added up (log2(lanes) halvings) once
// per k-block. That last part is the price: about 8 operations per element of C and k-block, small
// against k / lanes multiply-adds when k is long (use_nt decides). The tile's 10 row streams run at
// about half the FMA peak (rows a multiple of 4 KiB apart share L1 sets), so gemm() keeps the products
// whose packing it can amortize.
#include "fusedp/core/config.hpp"
#include "fusedp/kernels/host/gemm.hpp"
#include "fusedp/kernels/host/simd.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

namespace fusedp::kernels::host {

namespace detail {

// The register tile: 4 rows of A by 6 rows of B, 24 partial-sum vectors, 4 A vectors and one B vector
// live (29 of AVX-512's 32 registers); 10 loads for 24 multiply-adds, so the FMA ports bind.
inline constexpr std::size_t nt_rows = 4;
inline constexpr std::size_t nt_cols = 6;
// k per pass: a 6-row tile of B (6 x 1024 floats, 24 KiB) stays in L1 while the A rows of the block
// stream from L2; the sums are added up once per pass.
inline constexpr std::size_t nt_k_block = 1024;

// The sum of v's lanes, by halving (a W-lane vector: log2(W) extracts and adds). Shuffles, not
// copies through memory: an accumulator whose address is taken is kept in memory for the whole loop.
template <class T, std::size_t W>
FUSEDP_ALWAYS_INLINE T lane_sum(simd::vec_n<T, W> v) {
#if FUSEDP_VECTOR_EXTENSIONS
  if constexpr (W == 1) {
    return v;
  } else if constexpr (W == 2) {
    return v[0] + v[1];
  } else {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      const simd::vec_n<T, W / 2> lo = __builtin_shufflevector(v, v, I...);
      const simd::vec_n<T, W / 2> hi = __builtin_shufflevector(v, v, (I + W / 2)...);
      return lane_sum<T, W / 2>(lo + hi);
    }(std::make_index_sequence<W / 2>{});
  }
#else
  return v;
#endif
}

// out[i][j] = sum over k in [0, kc) of a[i][k] * b[j][k], rows given by pointers.
template <class T, std::size_t MI, std::size_t NJ>
[[gnu::noinline]] void nt_tile(std::size_t kc, const T* const* FUSEDP_RESTRICT a, const T* const* FUSEDP_RESTRICT b,
                               T* FUSEDP_RESTRICT out) {
  using V = simd::vec<T>;
  constexpr std::size_t L = simd::lanes<T>;
  V acc[MI][NJ];
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < MI; ++i)
    FUSEDP_UNROLL(8)
    for (std::size_t j = 0; j < NJ; ++j) acc[i][j] = V{};
  const T* ap[MI];
  const T* bp[NJ];
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < MI; ++i) ap[i] = a[i];
  FUSEDP_UNROLL(8)
  for (std::size_t j = 0; j < NJ; ++j) bp[j] = b[j];
  const std::size_t whole = kc / L * L;
  for (std::size_t k = 0; k < whole; k += L) {
    V av[MI];
    FUSEDP_UNROLL(8)
    for (std::size_t i = 0; i < MI; ++i) av[i] = simd::load(ap[i] + k);
    FUSEDP_UNROLL(8)
    for (std::size_t j = 0; j < NJ; ++j) {
      const V bv = simd::load(bp[j] + k);
      FUSEDP_UNROLL(8)
      for (std::size_t i = 0; i < MI; ++i) acc[i][j] += av[i] * bv;
    }
  }
  // The last k % lanes terms one by one, after the lanes are added up (a partial load would keep the
  // accumulators out of registers).
  FUSEDP_UNROLL(8)
  for (std::size_t i = 0; i < MI; ++i)
    FUSEDP_UNROLL(8)
    for (std::size_t j = 0; j < NJ; ++j) {
      T s = lane_sum<T, L>(acc[i][j]);
      for (std::size_t k = whole; k < kc; ++k) s += ap[i][k] * bp[j][k];
      out[i * NJ + j] = s;
    }
}

}  // namespace detail

/// Whether gemm_nt is the faster way to an m x n x k product of k-contiguous operands than packing them
/// for gemm(): adding up its partial sums costs per element of C and pass over k, the transposing packs
/// per element of A and B. The factor is measured (gemm_bench, one thread of a Sapphire Rapids core,
/// the 4x6 tile here against gemm()'s best): gemm_nt wins where one side is narrow, CIFAR conv1's
/// weight gradient 64 x 27 x 1024 at 86 GFLOP/s against 39 and LeNet conv1's 6 x 25 x 576 at 65
/// against 16; gemm() where both are wide, CIFAR fc1's forward 64 x 1024 x 8192 (87 against 76),
/// ResNet-18's first stage 64 x 576 x 1024 (99 against 95) and conv2's weight gradients.
constexpr bool use_nt(std::size_t m, std::size_t n, std::size_t k) {
  const std::size_t passes = (k + detail::nt_k_block - 1) / detail::nt_k_block;
  return 32 * m * n * passes < (m + n) * k;
}

/// C[m x n] (row stride ldc) = A B^T, plus the old C when `accumulate`, for A (m x k, row stride lda)
/// and B (n x k, row stride ldb) with k contiguous in both. After C's last k-block each finished tile's
/// rows go through epi(i, j0, &C[i][j0], count).
template <class T, class Epi = NoEpilogue>
void gemm_nt(std::size_t m, std::size_t n, std::size_t k, const T* a, std::size_t lda, const T* b, std::size_t ldb,
             T* c, std::size_t ldc, bool accumulate, const Epi& epi = {}) {
  constexpr std::size_t MI = detail::nt_rows, NJ = detail::nt_cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    gemm_packed<detail::shape_at<0>>(m, n, 0, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr), c, ldc,
                                     accumulate, epi);
    return;
  }
  for (std::size_t k0 = 0; k0 < k; k0 += detail::nt_k_block) {
    const std::size_t kc = std::min(detail::nt_k_block, k - k0);
    const bool add = accumulate || k0 > 0, last = k0 + kc == k;
    for (std::size_t j0 = 0; j0 < n; j0 += NJ) {
      const std::size_t cols = std::min(NJ, n - j0);
      const T* bj[NJ];
      // An edge tile repeats the last row; its sums are computed and dropped.
      for (std::size_t j = 0; j < NJ; ++j) bj[j] = b + (j0 + std::min(j, cols - 1)) * ldb + k0;
      for (std::size_t i0 = 0; i0 < m; i0 += MI) {
        const std::size_t rows = std::min(MI, m - i0);
        const T* ai[MI];
        for (std::size_t i = 0; i < MI; ++i) ai[i] = a + (i0 + std::min(i, rows - 1)) * lda + k0;
        T tile[MI * NJ];
        detail::nt_tile<T, MI, NJ>(kc, ai, bj, tile);
        for (std::size_t i = 0; i < rows; ++i) {
          T* row = c + (i0 + i) * ldc + j0;
          for (std::size_t j = 0; j < cols; ++j) row[j] = add ? row[j] + tile[i * NJ + j] : tile[i * NJ + j];
          if constexpr (!std::is_same_v<Epi, NoEpilogue>) {
            if (last) epi(i0 + i, j0, row, cols);
          }
        }
      }
    }
  }
}

}  // namespace fusedp::kernels::host
