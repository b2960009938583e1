#pragma once
// The one GEMM every Cuda stage is made of: C (m x n) = sum over k of A(m, k) B(n, k), tiled over
// thread blocks, with operands fetched through loader functors (so an implicit-GEMM convolution
// gathers its im2col matrix on the fly and a backward GEMM multiplies dy by the activation derivative
// as it loads it) and results handed to an epilogue functor while they sit in shared memory (bias,
// activation, pooling, the store). Precision is a policy: TF32 or BF16 tensor cores through WMMA, or
// exact fp32 FFMA.
//
// Verified on an H200 (sm_90; benchmarks/RESULTS.md) against the Host kernels; the loaders and
// epilogues are __host__ __device__ and also checked on the CPU (tests/gpu/emulation.cu). Measured
// there, this mainloop is far from the tensor cores' rate (conv2's weight gradient of the CIFAR-10 CNN
// at about 7 TFLOP/s); gemm_mma.cuh is its replacement (issue 14), for the same problems and epilogues,
// not yet run on a GPU.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/optimizer.hpp"

#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp::kernels::cuda {

/// Block tile of a GEMM: BM x BN outputs per block, BK-deep slices of the reduction staged through
/// shared memory (two stages), WarpsM x WarpsN warps each owning a (BM / WarpsM) x (BN / WarpsN) part
/// on tensor cores, or each thread a TM x TN part with FFMA.
/// Chosen so every configuration fits the 48 KiB of static shared memory with two stages, not by a
/// sweep: the H200 runs (benchmarks/RESULTS.md) measured the whole steps, not alternative tiles.
template <int BM, int BN, int BK, int WarpsM, int WarpsN, int TM, int TN>
struct Tile {
  static constexpr int bm = BM, bn = BN, bk = BK;
  static constexpr int warps_m = WarpsM, warps_n = WarpsN;
  static constexpr int threads = 32 * WarpsM * WarpsN;
  static constexpr int warp_m = BM / WarpsM, warp_n = BN / WarpsN;
  static constexpr int tm = TM, tn = TN;
  static_assert(warp_m % 16 == 0 && warp_n % 16 == 0, "Tile: each warp owns whole 16 x 16 fragments");
  static_assert((BM / TM) * (BN / TN) == threads, "Tile: the FFMA micro-tiles must cover the block tile");
  static_assert(BK % 16 == 0, "Tile: BK must be a multiple of 16 (one BF16 MMA step)");
  static_assert(BM <= threads, "Tile: row sums need one thread per row");
};

using TileWide = Tile<64, 64, 32, 2, 2, 8, 4>;    // n > 32
using TileTall32 = Tile<128, 32, 32, 4, 1, 8, 4>;  // 16 < n <= 32
using TileTall16 = Tile<128, 16, 32, 4, 1, 8, 2>;  // n <= 16

/// The tile for a GEMM whose n (columns of C) is N, a compile-time fact of each layer, so a network
/// instantiates at most three tiles per kernel family.
template <int N>
using tile_for = std::conditional_t<(N > 32), TileWide, std::conditional_t<(N > 16), TileTall32, TileTall16>>;

/// How operands sit in shared memory for a precision: the element type, the padding of each row (keeps
/// WMMA pointers 32-byte aligned and spreads rows over banks), and the rounding on the way in.
template <class P>
struct Operand {
  using type = float;
  static constexpr int pad = 4;
  __device__ static float convert(float v) { return v; }
  __device__ static float to_float(float v) { return v; }
};
template <>
struct Operand<precision::Tf32> {
  using type = float;
  static constexpr int pad = 4;
  // Rounded to nearest (cvt.rna) once, on the way into shared memory, so each element is rounded by
  // one instruction rather than at every fragment load; the tensor cores ignore the low 13 bits of
  // what they read. Only the MMA reads these values (the row sums use the registers' fp32 values).
  __device__ static float convert(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return nvcuda::wmma::__float_to_tf32(v);
#else
    return v;
#endif
  }
  __device__ static float to_float(float v) { return v; }
};
template <>
struct Operand<precision::Bf16> {
  using type = __nv_bfloat16;
  static constexpr int pad = 8;
  __device__ static __nv_bfloat16 convert(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

/// The longest reduction a GEMM launch takes: the kernels index k in int and step past a split's end by
/// at most a slice (32 or 64), so k keeps that much room below 2^31.
inline constexpr int gemm_k_limit = 0x7fffffff - 65536;
/// Throws InvalidArgument naming `what` when the reduction is longer than gemm_k_limit.
inline void check_gemm_k(const char* what, int k) {
  require(k <= gemm_k_limit, what, ": a reduction over ", k, " terms exceeds the kernels' int indices (at most ",
          gemm_k_limit, "); use smaller batches");
}

/// Everything one GEMM launch needs. A loader is a functor `at(row, k)` with a `k_fastest` flag saying
/// which index walks contiguous memory; it is only called inside the problem (rows < m or n, k < k), so
/// it returns zeros only for its own reasons (convolution padding). The epilogue's
/// apply<TileT>(c, ldc, m0, n0, split, tid) is called by every thread of a block with the finished
/// tile in shared memory. Loaders and epilogues are __host__ __device__ so tests can run them on a CPU.
template <class A, class B, class Epi>
struct GemmProblem {
  int m, n, k;
  int k_chunk;       // reduction elements per split (blockIdx.z); a multiple of BK, or k when not split
  A a;               // A(m, k)
  B b;               // B(n, k)
  Epi epi;
  float* row_sums;   // when not null: sum over the split's k of A(row, k) at row_sums[split * m + row]
  UpdateTarget<float> row_update{};  // active (an unsplit weight gradient): the bias's update, applied with
                                     // each row's finished sum
  /// Stores the row sum `s` of `row` for `split`, and applies the bias's update to it.
  FUSEDP_HD void put_row_sum(int split, int row, float s) const {
    row_sums[std::size_t(split) * m + row] = s;
    if (row_update.active()) row_update.apply(row_update.load(), std::size_t(row), s);
  }
};

/// Operand made of the rows of a row-major matrix of E (float, or BFloat16 where a 16-bit workspace
/// holds it): at(r, k) = p[r * ld + k] as a float. For the tensor-core mainloop (gemm_mma.cuh) also
/// `source`, the address of a copy of four elements along k.
template <class E>
struct RowsOf {
  using element = E;
  const E* p;
  int ld;
  static constexpr bool k_fastest = true;
  static constexpr int copy_floats = 4;
  FUSEDP_HD float at(int r, int k) const { return to_float(p[std::size_t(r) * ld + k]); }
  FUSEDP_HD const E* source(int r, int k) const { return p + std::size_t(r) * ld + k; }
  FUSEDP_HD const E* base() const { return p; }
};
using Rows = RowsOf<float>;

/// Operand made of the columns of a row-major matrix of E: at(r, k) = p[k * ld + r]; `source` as
/// RowsOf's, a copy running along r.
template <class E>
struct ColumnsOf {
  using element = E;
  const E* p;
  int ld;
  static constexpr bool k_fastest = false;
  static constexpr int copy_floats = 4;
  FUSEDP_HD float at(int r, int k) const { return to_float(p[std::size_t(k) * ld + r]); }
  FUSEDP_HD const E* source(int r, int k) const { return p + std::size_t(k) * ld + r; }
  FUSEDP_HD const E* base() const { return p; }
};
using Columns = ColumnsOf<float>;

/// A value another block of the same kernel wrote (and fenced): read from L2, past this SM's L1, which
/// does not see other SMs' stores.
template <class T>
FUSEDP_HD FUSEDP_ALWAYS_INLINE T load_from_l2(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

/// `L` consecutive elements' values, one per lane.
template <int L>
struct Lanes {
  float v[L];
};

/// The `L` floats at p (L = 4: one 16-byte load, p 16-byte aligned), written by another block of the
/// same kernel: load_from_l2.
template <int L>
FUSEDP_HD FUSEDP_ALWAYS_INLINE Lanes<L> load_lanes(const float* p) {
  static_assert(L == 1 || L == 4, "load_lanes: one float or four");
  if constexpr (L == 1) {
    return {{load_from_l2(p)}};
  } else {
    const float4 q = load_from_l2(reinterpret_cast<const float4*>(p));
    return {{q.x, q.y, q.z, q.w}};
  }
}

/// The sums of the `splits` partial products partial[z * stride + i + c] of elements i + c (c < L), each
/// in split order from 0: how every split-K GEMM adds up an element, whether a second kernel or the
/// GEMM's last block does it, so both give the same bits. The loads of InFlight splits are written
/// before their adds (loops of constant length, which nvcc unrolls), so each thread keeps that many loads
/// in flight (the GPU issues in order: an add waiting for its load would hold back the next load). Only
/// when the loads are issued depends on InFlight, not the order of the adds, so every InFlight gives the
/// same bits: 4 in a GEMM's last block (registers), split_sums_in_flight in the second kernels, whose
/// one element per thread is a chain of `splits` loads from L2. L = 4 needs partial + i and stride
/// 16-byte aligned.
template <int L, int InFlight = 4>
FUSEDP_HD FUSEDP_ALWAYS_INLINE Lanes<L> split_sums(const float* partial, int splits, std::size_t stride, std::size_t i) {
  Lanes<L> s{};
  int z = 0;
  for (; z + InFlight <= splits; z += InFlight) {
    Lanes<L> v[InFlight];
    for (int q = 0; q < InFlight; ++q) v[q] = load_lanes<L>(partial + std::size_t(z + q) * stride + i);
    for (int q = 0; q < InFlight; ++q)
      for (int c = 0; c < L; ++c) s.v[c] += v[q].v[c];
  }
  if constexpr (InFlight > 4) {
    // The second kernels load the last splits as one predicated group, so 9 splits take one round trip,
    // not nine. The GEMM's last block (4) loads them one at a time: the predicated group raised a WMMA
    // weight gradient's registers from 190 to 255 with 108 bytes of spills (ptxas, sm_90, 2026-12-06).
    Lanes<L> v[InFlight];
    for (int q = 0; q < InFlight; ++q)
      if (z + q < splits) v[q] = load_lanes<L>(partial + std::size_t(z + q) * stride + i);
    for (int q = 0; q < InFlight; ++q)
      if (z + q < splits)
        for (int c = 0; c < L; ++c) s.v[c] += v[q].v[c];
  } else {
    for (; z < splits; ++z) {
      const Lanes<L> v = load_lanes<L>(partial + std::size_t(z) * stride + i);
      for (int c = 0; c < L; ++c) s.v[c] += v.v[c];
    }
  }
  return s;
}

/// Loads in flight per thread in the second kernels that add up split parts (reduce_splits_kernel,
/// linear_forward_reduce_kernel): a thread's element is a chain of `splits` dependent adds, up to twice
/// the SMs (plan_split: 264 over one tile on an H200), whose loads would otherwise wait a round trip to
/// L2 every four. An estimate, not a measurement: 16 turns 64 round trips into 16 for 256 splits.
inline constexpr int split_sums_in_flight = 16;

/// out[i + c] = split_sums for c < L, then `target`'s update with `step` where active: how every split-K
/// weight gradient finishes its elements, whether reduce_splits_kernel or the GEMM's last block
/// (SplitTileReduction: with L = 4, and the updates in a pass of their own) does it.
template <int L, int InFlight = 4>
FUSEDP_HD FUSEDP_ALWAYS_INLINE void finish_split_sums(const float* partial, int splits, std::size_t stride,
                                                      std::size_t i, float* out, const UpdateTarget<float>& target,
                                                      const AnyStep<float>& step) {
  const Lanes<L> s = split_sums<L, InFlight>(partial, splits, stride, i);
  for (int c = 0; c < L; ++c) {
    out[i + c] = s.v[c];
    if (target.active()) target.apply(step, i + c, s.v[c]);
  }
}

/// Calls f(local_row, local_col, row, col) for thread `tid`'s share of the elements of a block's tile
/// inside the problem, the threads of the block walking rows fastest (MFastest) or columns fastest, for
/// coalesced stores. Host code may call it (tests emulate a block thread by thread).
template <class TileT, bool MFastest, class F>
FUSEDP_HD FUSEDP_ALWAYS_INLINE void for_each_in_tile(int tid, int m0, int n0, int m, int n, F&& f) {
  for (int idx = tid; idx < TileT::bm * TileT::bn; idx += TileT::threads) {
    const int lm = MFastest ? idx % TileT::bm : idx / TileT::bn;
    const int ln = MFastest ? idx / TileT::bm : idx % TileT::bn;
    if (m0 + lm < m && n0 + ln < n) f(lm, ln, m0 + lm, n0 + ln);
  }
}

/// The last block of a split tile finishing its elements: f(row, col, lanes) for thread `tid`'s share,
/// in runs of four along a row, the threads walking runs fastest (coalesced 16-byte loads of the partial
/// products). lanes is std::integral_constant<int, 4> for a whole run when `vector` (n % 4 == 0 and the
/// partial products 16-byte aligned: every run starts 16-byte aligned), else <int, 1> for each element
/// of the run inside the problem. Host code may call it (tests emulate a block thread by thread).
template <class TileT, class F>
FUSEDP_HD FUSEDP_ALWAYS_INLINE void for_each_run_in_tile(int tid, int m0, int n0, int m, int n, bool vector, F&& f) {
  static_assert(TileT::bn % 4 == 0, "for_each_run_in_tile: tiles of whole runs of four columns");
  constexpr int runs = TileT::bn / 4;  // per row of the tile
  // Not unrolled: each run already has four splits' loads in flight, and unrolling the runs too would
  // raise the whole kernel's registers for its tail (ptxas: 191 -> 255 and spills in a WMMA weight
  // gradient, 2026-12-05).
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int idx = tid; idx < TileT::bm * runs; idx += TileT::threads) {
    const int gm = m0 + idx / runs, gn = n0 + (idx % runs) * 4;
    if (gm >= m || gn >= n) continue;
    if (vector) {
      f(gm, gn, std::integral_constant<int, 4>{});
    } else {
      for (int c = 0; c < 4 && gn + c < n; ++c) f(gm, gn + c, std::integral_constant<int, 1>{});
    }
  }
}

/// Whether the partial products at `partial`, of an (m x n) output with split z's at partial + z *
/// stride, can be read four at a time (every run of four starts 16-byte aligned).
[[nodiscard]] FUSEDP_HD FUSEDP_ALWAYS_INLINE bool runs_of_four(const float* partial, int n, std::size_t stride) {
  return n % 4 == 0 && stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(partial) % 16 == 0;
}

namespace detail {

template <class TileT, class P>
struct GemmSmem {
  using S = typename Operand<P>::type;
  static constexpr int lds = TileT::bk + Operand<P>::pad;  // row pitch of staged A and B slices
  static constexpr int ldc = TileT::bn + 4;                // row pitch of the accumulator tile (floats)
  static constexpr std::size_t a_bytes = std::size_t(TileT::bm) * lds * sizeof(S);
  static constexpr std::size_t stage_bytes = std::size_t(TileT::bm + TileT::bn) * lds * sizeof(S);
  static constexpr std::size_t c_bytes = std::size_t(TileT::bm) * ldc * sizeof(float);
  static constexpr std::size_t sums_bytes = std::size_t(TileT::bm) * TileT::bk * sizeof(float);
  static constexpr std::size_t bytes = std::max({2 * stage_bytes, c_bytes, sums_bytes});
  static_assert(bytes <= 48 * 1024, "GEMM tile needs more than 48 KiB of static shared memory");
  static_assert(a_bytes % 32 == 0 && stage_bytes % 32 == 0, "WMMA needs 32-byte aligned fragments");
};

// Tensor-core part of a block tile, one warp's share: FM x FN fragments of 16 x 16.
template <class TileT, class P>
struct WarpMma {
  static constexpr int fm = TileT::warp_m / 16, fn = TileT::warp_n / 16;
  static constexpr bool bf16 = std::is_same_v<P, precision::Bf16>;
  static constexpr int kstep = bf16 ? 16 : 8;
  using S = typename Operand<P>::type;
  using in_t = std::conditional_t<bf16, __nv_bfloat16, nvcuda::wmma::precision::tf32>;
  using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, kstep, in_t, nvcuda::wmma::row_major>;
  using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, kstep, in_t, nvcuda::wmma::col_major>;
  using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, kstep, float>;

  FragC acc[fm][fn];
  int row0, col0;  // the warp's first row and column in the block tile

  __device__ explicit WarpMma(int warp) : row0((warp % TileT::warps_m) * TileT::warp_m), col0((warp / TileT::warps_m) * TileT::warp_n) {
    for (int i = 0; i < fm; ++i)
      for (int j = 0; j < fn; ++j) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
  }
  // As is (BM x lds) row-major: A(m, k); Bs is (BN x lds): B(n, k), i.e. the K x N operand column-major.
  __device__ void step(const S* as, const S* bs, int lds) {
#pragma unroll
    for (int kk = 0; kk < TileT::bk; kk += kstep) {
      FragA a[fm];
      FragB b[fn];
#pragma unroll
      for (int i = 0; i < fm; ++i) nvcuda::wmma::load_matrix_sync(a[i], as + (row0 + 16 * i) * lds + kk, lds);
#pragma unroll
      for (int j = 0; j < fn; ++j) nvcuda::wmma::load_matrix_sync(b[j], bs + (col0 + 16 * j) * lds + kk, lds);
#pragma unroll
      for (int i = 0; i < fm; ++i)
#pragma unroll
        for (int j = 0; j < fn; ++j) nvcuda::wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }
  __device__ void store(float* c, int ldc) const {
    for (int i = 0; i < fm; ++i)
      for (int j = 0; j < fn; ++j)
        nvcuda::wmma::store_matrix_sync(c + (row0 + 16 * i) * ldc + col0 + 16 * j, acc[i][j], ldc,
                                        nvcuda::wmma::mem_row_major);
  }
};

// FFMA part of a block tile, one thread's share: TM x TN outputs strided over the tile.
template <class TileT, class P>
struct ThreadFma {
  static constexpr int threads_n = TileT::bn / TileT::tn, threads_m = TileT::bm / TileT::tm;
  using S = typename Operand<P>::type;
  float acc[TileT::tm][TileT::tn] = {};
  int tm0, tn0;

  __device__ explicit ThreadFma(int tid) : tm0(tid / threads_n), tn0(tid % threads_n) {}
  __device__ void step(const S* as, const S* bs, int lds) {
#pragma unroll 4
    for (int kk = 0; kk < TileT::bk; ++kk) {
      float a[TileT::tm], b[TileT::tn];
#pragma unroll
      for (int i = 0; i < TileT::tm; ++i) a[i] = Operand<P>::to_float(as[(tm0 + i * threads_m) * lds + kk]);
#pragma unroll
      for (int j = 0; j < TileT::tn; ++j) b[j] = Operand<P>::to_float(bs[(tn0 + j * threads_n) * lds + kk]);
#pragma unroll
      for (int i = 0; i < TileT::tm; ++i)
#pragma unroll
        for (int j = 0; j < TileT::tn; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
  __device__ void store(float* c, int ldc) const {
    for (int i = 0; i < TileT::tm; ++i)
      for (int j = 0; j < TileT::tn; ++j) c[(tm0 + i * threads_m) * ldc + tn0 + j * threads_n] = acc[i][j];
  }
};

// Tensor cores for TF32 and BF16 from sm_80 on; FFMA for fp32, and for any precision on older
// devices (there the tensor-core policies still give correct, more precise, results).
template <class TileT, class P>
struct BlockMath {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  using type = ThreadFma<TileT, P>;
#else
  using type = std::conditional_t<std::is_same_v<P, precision::Fp32>, ThreadFma<TileT, P>, WarpMma<TileT, P>>;
#endif
};

template <class TileT, bool KFastest, int Rows>
__device__ FUSEDP_ALWAYS_INLINE void slot_of(int idx, int& row, int& kk) {
  if constexpr (KFastest) {
    kk = idx % TileT::bk;
    row = idx / TileT::bk;
  } else {
    row = idx % Rows;
    kk = idx / Rows;
  }
}

}  // namespace detail

namespace detail {
// After the epilogue of a split GEMM whose epilogue has an active `reduction` (StoreRowMajor's
// SplitTileReduction, PartialsRowMajor's LinearForwardReduction): counts this block's arrival at its
// tile, and the last split to arrive reduces the tile (and resets the count). Every thread fences its
// own stores (the partial tile, the row sums) before the block counts itself.
template <class E>
concept ReducesSplitTiles = requires(const E& e, unsigned* p) {
  { e.out } -> std::convertible_to<const float*>;
  { e.m } -> std::convertible_to<int>;
  { e.n } -> std::convertible_to<int>;
  { e.reduction.active() } -> std::convertible_to<bool>;
  { e.reduction.arrivals } -> std::convertible_to<unsigned*>;
  { e.reduction.splits } -> std::convertible_to<int>;
};
template <class TileT, class Epi>
__device__ FUSEDP_ALWAYS_INLINE void finish_split_tile(const Epi& epi, int m0, int n0, int tid) {
  if constexpr (requires { epi.reduction; }) {
    static_assert(ReducesSplitTiles<Epi>, "finish_split_tile: an epilogue with a `reduction` must have out, m, n, "
                                          "and a reduction with active(), arrivals and splits");
    const auto& r = epi.reduction;
    if (!r.active()) return;
    __threadfence();
    __syncthreads();
    unsigned* const count = r.arrivals + std::size_t(blockIdx.x) * gridDim.y + blockIdx.y;
    bool arrived_last = false;
    if (tid == 0) {
      __threadfence();  // cumulative: the block's stores, ordered before it by the barrier
      arrived_last = atomicAdd(count, 1u) == unsigned(r.splits - 1);
      __threadfence();
    }
    // No static shared memory for the answer: a tensor-core tile may use every byte of the opt-in.
    if (!__syncthreads_or(arrived_last)) return;
    __threadfence();
    r.template reduce_tile<TileT>(epi.out, epi.m, epi.n, m0, n0, tid);
    if (tid == 0) *count = 0u;
  }
}
}  // namespace detail

/// The GEMM kernel. Each block computes one BM x BN tile of C over the k-range of its split: operand
/// slices go global memory -> registers -> shared memory (two stages, one barrier per slice; the loads
/// of slice i+1 are in flight while slice i is multiplied), then the tile goes to the epilogue.
template <class TileT, class P, bool RowSums, class A, class B, class Epi>
__global__ void __launch_bounds__(TileT::threads) gemm_kernel(const GemmProblem<A, B, Epi> p) {
  kernel_prologue();
  using Smem = detail::GemmSmem<TileT, P>;
  using S = typename Smem::S;
  using Math = typename detail::BlockMath<TileT, P>::type;
  constexpr int BM = TileT::bm, BN = TileT::bn, BK = TileT::bk, NT = TileT::threads, LDS = Smem::lds;
  constexpr int EA = BM * BK / NT, EB = BN * BK / NT;
  static_assert(BM * BK % NT == 0 && BN * BK % NT == 0, "gemm_kernel: slices must split evenly over threads");

  __shared__ __align__(128) unsigned char smem[Smem::bytes];
  S* const as0 = reinterpret_cast<S*>(smem);
  S* const as1 = reinterpret_cast<S*>(smem + Smem::stage_bytes);

  const int tid = int(threadIdx.x);
  const int m0 = int(blockIdx.x) * BM, n0 = int(blockIdx.y) * BN, split = int(blockIdx.z);
  const int k_begin = split * p.k_chunk;
  const int k_end = k_begin + min(p.k_chunk, p.k - k_begin);  // k_begin + k_chunk may pass 2^31

  float ra[EA], rb[EB];
  float rs[RowSums ? EA : 1];
#pragma unroll
  for (int j = 0; j < (RowSums ? EA : 1); ++j) rs[j] = 0.0f;

  auto load = [&](int k0) {
#pragma unroll
    for (int j = 0; j < EA; ++j) {
      int r = 0, kk = 0;
      detail::slot_of<TileT, A::k_fastest, BM>(tid + j * NT, r, kk);
      ra[j] = (m0 + r < p.m && k0 + kk < k_end) ? p.a.at(m0 + r, k0 + kk) : 0.0f;
      if constexpr (RowSums) rs[j] += ra[j];
    }
#pragma unroll
    for (int j = 0; j < EB; ++j) {
      int c = 0, kk = 0;
      detail::slot_of<TileT, B::k_fastest, BN>(tid + j * NT, c, kk);
      rb[j] = (n0 + c < p.n && k0 + kk < k_end) ? p.b.at(n0 + c, k0 + kk) : 0.0f;
    }
  };
  auto store = [&](S* as) {
    S* bs = as + BM * LDS;
#pragma unroll
    for (int j = 0; j < EA; ++j) {
      int r = 0, kk = 0;
      detail::slot_of<TileT, A::k_fastest, BM>(tid + j * NT, r, kk);
      as[r * LDS + kk] = Operand<P>::convert(ra[j]);
    }
#pragma unroll
    for (int j = 0; j < EB; ++j) {
      int c = 0, kk = 0;
      detail::slot_of<TileT, B::k_fastest, BN>(tid + j * NT, c, kk);
      bs[c * LDS + kk] = Operand<P>::convert(rb[j]);
    }
  };

  Math math(std::is_same_v<Math, detail::ThreadFma<TileT, P>> ? tid : tid / 32);

  if (k_begin < k_end) {
    load(k_begin);
    store(as0);
    __syncthreads();
    bool second = false;
    for (int k0 = k_begin; k0 < k_end; k0 += BK) {
      const bool more = k0 + BK < k_end;
      if (more) load(k0 + BK);
      const S* cur = second ? as1 : as0;
      math.step(cur, cur + BM * LDS, LDS);
      if (more) store(second ? as0 : as1);
      __syncthreads();
      second = !second;
    }
  }

  // Row sums of A (the bias gradient of a weight-gradient GEMM), from the fp32 values before any
  // rounding, in a fixed order: each thread's register sums, then each row over its BK slots.
  if constexpr (RowSums) {
    if (p.row_sums != nullptr && blockIdx.y == 0) {
      float* sums = reinterpret_cast<float*>(smem);  // slot (row, kk) at the thread's load index
#pragma unroll
      for (int j = 0; j < EA; ++j) sums[tid + j * NT] = rs[j];
      __syncthreads();
      if (tid < BM) {
        float s = 0.0f;
        for (int kk = 0; kk < BK; ++kk) s += A::k_fastest ? sums[tid * BK + kk] : sums[kk * BM + tid];
        if (m0 + tid < p.m) p.put_row_sum(split, m0 + tid, s);
      }
      __syncthreads();
    }
  }

  float* c = reinterpret_cast<float*>(smem);
  math.store(c, Smem::ldc);
  __syncthreads();
  p.epi.template apply<TileT>(c, Smem::ldc, m0, n0, split, tid);
  detail::finish_split_tile<TileT>(p.epi, m0, n0, tid);
}

/// How a GEMM's reduction is split over blocks: `splits` partial products of `k_chunk` each.
struct SplitPlan {
  int splits;
  int k_chunk;
};

/// Splits a long reduction (a weight gradient sums over the whole batch) until the grid holds about
/// two blocks per SM, keeping at least four BK slices per split. Not swept; on the H200 the split forward
/// of the CIFAR-10 CNN's Linear 8192 -> 1024 took 403 -> 104 us (benchmarks/RESULTS.md).
inline SplitPlan plan_split(int m, int n, int k, int bm, int bn, int bk, int sm_count) {
  const long tiles = long((m + bm - 1) / bm) * ((n + bn - 1) / bn);
  const long target = 2L * std::max(sm_count, 1);
  const int min_chunk = 4 * bk;
  if (tiles >= target || k <= 2 * min_chunk) return {1, k};
  long splits = std::min<long>((target + tiles - 1) / tiles, k / min_chunk);
  splits = std::clamp<long>(splits, 1, 65535);
  // In long: k + splits and k + chunk may pass 2^31 for k near it.
  long chunk = (long(k) + splits - 1) / splits;
  chunk = (chunk + bk - 1) / bk * bk;
  return {int((long(k) + chunk - 1) / chunk), int(chunk)};
}

/// Launches gemm_kernel on `stream` over a grid of (m / BM) x (n / BN) x splits blocks.
template <class TileT, class P, bool RowSums, class A, class B, class Epi>
void launch_gemm(const GemmProblem<A, B, Epi>& p, int splits, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  check_gemm_k("gemm", p.k);
  const unsigned gx = unsigned((p.m + TileT::bm - 1) / TileT::bm);
  const unsigned gy = unsigned((p.n + TileT::bn - 1) / TileT::bn);
  require(gy <= 65535u && splits >= 1 && splits <= 65535, "gemm: grid of ", gx, " x ", gy, " x ", splits,
          " blocks exceeds CUDA's limits (n = ", p.n, ")");
  launch<gemm_kernel<TileT, P, RowSums, A, B, Epi>>("gemm_kernel", dim3(gx, gy, unsigned(splits)), TileT::threads, 0,
                                                    stream, p);
}

/// The second half of a split-K weight gradient done by the GEMM's own blocks: each split stores its
/// partial product, and the last split of a tile to finish (counted in `arrivals`, one counter per
/// output tile, zero before the launch, set back to zero by that block) adds the tile's partial
/// products in split order, exactly as reduce_splits_kernel does (the same sums, so the same bits),
/// with the same updates; the tiles of the first column (n0 == 0) also add their rows' partial row sums.
/// One launch fewer per split weight gradient. Inactive (no arrivals, or a tile's parts over their
/// limit: reduces_in_gemm): reduce_splits_kernel runs.
struct SplitTileReduction {
  unsigned* arrivals = nullptr;  // one per (blockIdx.x, blockIdx.y) tile, row-major over the grid
  int splits = 1;
  float* out = nullptr;  // dw (m x n)
  const float* row_partial = nullptr;
  float* row_out = nullptr;  // db (m), or null
  LayerUpdate<float> update{};

  [[nodiscard]] FUSEDP_HD bool active() const { return arrivals != nullptr; }
  /// The reduction of tile (m0, n0), thread `tid`'s share, from the partial products `partial` (split
  /// z's at partial + z * m * n), by the block that finished the tile last.
  template <class TileT>
  FUSEDP_HD void reduce_tile(const float* partial, int m, int n, int m0, int n0, int tid) const {
    const std::size_t count = std::size_t(m) * n;
    const AnyStep<float> step = update.weight.active() ? update.weight.load() : AnyStep<float>{};
    // The sums first, then the updates in a pass of their own over the same elements (each thread reads
    // back what it wrote): updates inlined beside four lanes' loads raised a WMMA weight gradient's
    // registers from 192 to 255 with spills (ptxas, sm_90, 2026-12-05).
    const bool vector = runs_of_four(partial, n, count);
    for_each_run_in_tile<TileT>(tid, m0, n0, m, n, vector, [&](int gm, int gn, auto lanes) {
      finish_split_sums<decltype(lanes)::value>(partial, splits, count, std::size_t(gm) * n + gn, out, {}, step);
    });
    if (update.weight.active())
      for_each_run_in_tile<TileT>(tid, m0, n0, m, n, vector, [&](int gm, int gn, auto lanes) {
        const std::size_t i = std::size_t(gm) * n + gn;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
        for (int c = 0; c < decltype(lanes)::value; ++c) update.weight.apply(step, i + c, out[i + c]);
      });
    if (row_out == nullptr || n0 != 0) return;
    const AnyStep<float> bias_step = update.bias.active() ? update.bias.load() : AnyStep<float>{};
    for (int r = tid; r < TileT::bm && m0 + r < m; r += TileT::threads)
      finish_split_sums<1>(row_partial, splits, std::size_t(m), std::size_t(m0 + r), row_out, update.bias, bias_step);
  }
};

/// Epilogue: C to a row-major (m x n) array; a split writes its partial product `split_stride`
/// elements after the previous split's. With an active `update` (an unsplit weight gradient only) each
/// stored value is also that weight's finished gradient, and the optimizer's update of the weight is
/// applied on the spot (kernels/optimizer.hpp: UpdateTarget).
struct StoreRowMajor {
  float* out;
  int m, n;
  std::size_t split_stride;
  UpdateTarget<float> update{};
  SplitTileReduction reduction{};  // active: the last split of each tile reduces it (split_stride = m * n)
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int split, int tid) const {
    float* o = out + std::size_t(split) * split_stride;
    const bool updating = update.active();
    const AnyStep<float> step = updating ? update.load() : AnyStep<float>{};
    for_each_in_tile<TileT, false>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      const std::size_t i = std::size_t(gm) * n + gn;
      const float g = c[lm * ldc + ln];
      o[i] = g;
      if (updating) update.apply(step, i, g);
    });
  }
};

/// Epilogue of a split GEMM whose second half is not a weight gradient's: split z's partial product
/// (m x n, row-major) at out + z * split_stride, and, where `reduction` is active, the last split of each
/// tile to finish (finish_split_tile) hands the tile to reduction.reduce_tile (linear.cuh's
/// LinearForwardReduction: bias and activation after the sum).
template <class Reduction>
struct PartialsRowMajor {
  float* out;
  int m, n;
  std::size_t split_stride;
  Reduction reduction{};
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int split, int tid) const {
    float* o = out + std::size_t(split) * split_stride;
    for_each_in_tile<TileT, false>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      o[std::size_t(gm) * n + gn] = c[lm * ldc + ln];
    });
  }
};

/// Whether `arrivals` has a counter for every tile of an m x n output in tiles of each TileT (the grid
/// of whichever of them runs).
template <class... TileT>
[[nodiscard]] bool arrivals_cover(const ArrivalCounters& arrivals, int m, int n) {
  const auto tiles = [&](int bm, int bn) { return std::size_t((m + bm - 1) / bm) * std::size_t((n + bn - 1) / bn); };
  return arrivals.data != nullptr && ((tiles(TileT::bm, TileT::bn) <= arrivals.count) && ...);
}

/// The longest chain of dependent round trips to L2 that one thread of TileT's last block per tile walks
/// to add up a tile of an m x n output in `splits` parts (SplitTileReduction, LinearForwardReduction):
/// its share of the tile's runs of four columns (for_each_run_in_tile: ceil(rows x runs a row / threads)
/// for the busiest thread), each run one 16-byte load a part where n is a multiple of 4, else one chain a
/// column; each chain's loads four at a time and the last parts one at a time (split_sums); plus one chain
/// for the row sums (a weight gradient's bias). The reduction runs while the rest of the GPU waits for the
/// kernel to end, so this chain is what it costs.
template <class TileT>
[[nodiscard]] constexpr int tile_reduction_trips(int m, int n, int splits, bool row_sums) {
  constexpr int runs_a_row = TileT::bn / 4;
  static_assert(TileT::threads % runs_a_row == 0, "tile_reduction_trips: each thread keeps its column run");
  const int rows = m < TileT::bm ? m : TileT::bm, cols = n < TileT::bn ? n : TileT::bn;
  const int runs = (rows * runs_a_row + TileT::threads - 1) / TileT::threads;
  const int chains = runs * (n % 4 == 0 ? 1 : (cols < 4 ? cols : 4)) + (row_sums ? 1 : 0);
  return chains * (splits / 4 + splits % 4);
}

/// The longest chain tile_reduction_trips may give for a split GEMM's last block to add up its tile's
/// parts by default (ArrivalCounters::reduction_trip_limit; kernels/cuda/gemm_dispatch.cuh,
/// split_arrivals). An estimate, written before any measurement: a round trip to L2 takes 0.2-0.4 us on
/// Hopper, so 8 take 1.6-3.2 us, what the launch and boundary of the second kernel it saves cost
/// (benchmarks/RESULTS.md, session 21; that kernel's own chain is one round trip per 16 parts). A longer
/// one, such as the CIFAR-10 CNN's conv1 weight gradient (a tile of 64 x 27 in 256 parts: 1,088 round
/// trips, 220-435 us for one block; RESULTS.md, session 30), goes to reduce_splits_kernel, one element
/// per thread over the whole grid. benchmarks/gpu/check.sh times the two extremes
/// (FUSEDP_CUDA_SPLIT_REDUCTION=gemm and kernel).
inline constexpr int split_tile_reduction_trips = 8;

/// Whether the last split of each tile adds up the tile's parts in the GEMM (SplitTileReduction,
/// LinearForwardReduction) for an m x n output in `splits` parts on tiles TileT (the grids that may run),
/// with its rows' sums where `row_sums`: `arrivals` has a counter for every tile, and every TileT's
/// tile_reduction_trips is within arrivals.reduction_trip_limit. Else a second kernel does.
template <class... TileT>
[[nodiscard]] bool reduces_in_gemm(const ArrivalCounters& arrivals, int m, int n, int splits, bool row_sums) {
  return arrivals_cover<TileT...>(arrivals, m, n) &&
         ((tile_reduction_trips<TileT>(m, n, splits, row_sums) <= arrivals.reduction_trip_limit) && ...);
}

/// The second half of a split-K weight gradient as a pass of its own (reduce_splits_kernel, where
/// reduces_in_gemm says no): out[i] = sum over splits of partial[s * count + i], and likewise row_out[i]
/// from the row sums for i < rows, in split order, so the result does not depend on scheduling; active
/// updates apply the optimizer to the weights (out) and the bias (row_out) with the finished sums. One
/// element per call; host code may call it (tests/gpu/emulation.cu runs the pass element by element).
struct ReduceSplits {
  const float* partial = nullptr;
  int splits = 1;
  std::size_t count = 0;  // elements of out
  float* out = nullptr;
  const float* row_partial = nullptr;
  int rows = 0;  // elements of row_out
  float* row_out = nullptr;
  LayerUpdate<float> update{};

  /// Elements the pass walks: every element of out, and of row_out.
  [[nodiscard]] FUSEDP_HD std::size_t size() const { return count > std::size_t(rows) ? count : std::size_t(rows); }
  FUSEDP_HD void operator()(std::size_t i) const {
    if (i < count)
      finish_split_sums<1, split_sums_in_flight>(partial, splits, count, i, out, update.weight,
                                                 update.weight.active() ? update.weight.load() : AnyStep<float>{});
    if (row_out != nullptr && i < std::size_t(rows))
      finish_split_sums<1, split_sums_in_flight>(row_partial, splits, std::size_t(rows), i, row_out, update.bias,
                                                 update.bias.active() ? update.bias.load() : AnyStep<float>{});
  }
};

/// ReduceSplits over its elements, one a thread.
template <class Pass>
__global__ void reduce_splits_kernel(Pass pass) {
  kernel_prologue();
  const std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < pass.size()) pass(i);
}

/// Launches reduce_splits_kernel over `pass` on `stream`.
inline void launch_pass(const ReduceSplits& pass, cudaStream_t stream) {
  launch<reduce_splits_kernel<ReduceSplits>>("reduce_splits_kernel", unsigned((pass.size() + 255) / 256), 256, 0,
                                             stream, pass);
}

/// A split flow's `run_pass` on a device (split_weight_gradient, linear.cuh's split_linear_forward):
/// launches the second pass's kernel on `stream` (launch_pass). Tests run the pass on the host instead.
struct PassOnStream {
  cudaStream_t stream = nullptr;
  template <class Pass>
  void operator()(const Pass& pass) const {
    launch_pass(pass, stream);
  }
};

/// Scratch (floats) a weight-gradient GEMM of this shape needs for its split partial products.
template <class TileT>
std::size_t weight_gradient_scratch(int m, int n, int k, int sm_count) {
  const SplitPlan s = plan_split(m, n, k, TileT::bm, TileT::bn, TileT::bk, sm_count);
  return s.splits == 1 ? 0 : std::size_t(s.splits) * (std::size_t(m) * n + std::size_t(m));
}

/// The split-K flow of a weight gradient with the GEMM launched by `run_gemm(problem, splits)`: one
/// launch straight into dw and db when the plan does not split, else partial products into `scratch`,
/// added up in split order by the last split of each tile (SplitTileReduction) where reduces_in_gemm
/// says so (`arrivals` has a counter for every tile, and the last block's chain of loads is within
/// their limit), else by the ReduceSplits pass `run_pass(pass)` runs (on a device: PassOnStream,
/// reduce_splits_kernel). The updates are applied by whichever writes dw and db last (the bias's only
/// with db). Shared by weight_gradient and gemm_mma.cuh's weight_gradient_mma (and
/// tests/gpu/emulation.cu, which runs the blocks and the pass on the host).
template <class TileT, class A, class B, class Launch, class Pass>
void split_weight_gradient(int sm_count, int m, int n, int k, const A& a, const B& b, float* dw, float* db,
                           float* scratch, const LayerUpdate<float>& update, const ArrivalCounters& arrivals,
                           Launch&& run_gemm, Pass&& run_pass) {
  const SplitPlan s = plan_split(m, n, k, TileT::bm, TileT::bn, TileT::bk, sm_count);
  const LayerUpdate<float> u{update.weight, db ? update.bias : UpdateTarget<float>{}};
  if (s.splits == 1) {
    run_gemm(GemmProblem<A, B, StoreRowMajor>{m, n, k, k, a, b, StoreRowMajor{dw, m, n, 0, u.weight}, db, u.bias}, 1);
    return;
  }
  require(scratch != nullptr, "weight_gradient: a split GEMM needs scratch");
  const std::size_t count = std::size_t(m) * n;
  float* row_partial = scratch + std::size_t(s.splits) * count;
  const bool in_kernel = reduces_in_gemm<TileT>(arrivals, m, n, s.splits, db != nullptr);
  StoreRowMajor partials{scratch, m, n, count};
  if (in_kernel) partials.reduction = {arrivals.data, s.splits, dw, row_partial, db, u};
  run_gemm(GemmProblem<A, B, StoreRowMajor>{m, n, k, s.k_chunk, a, b, partials, db ? row_partial : nullptr}, s.splits);
  if (in_kernel) return;
  run_pass(ReduceSplits{scratch, s.splits, count, dw, row_partial, m, db, u});
}

/// dW (m x n, row-major) = sum over k of A(m, k) B(n, k), and db (m) = sum over k of A(m, k) when db is
/// not null: the weight and bias gradients of a layer in one GEMM, split over k when the grid would be
/// too small, partial products then summed in a fixed order. `scratch` holds
/// weight_gradient_scratch<TileT>(m, n, k, sm_count) floats. With active updates the optimizer is
/// applied to the weights and the bias as their gradients are finished (dw and db are still written).
/// `arrivals`: the stream's counters (CudaSpace::arrival_counters), with which the split GEMM reduces
/// its own tiles where reduces_in_gemm allows (their reduction_trip_limit); else a second kernel does.
template <class TileT, class P, class A, class B>
void weight_gradient(cudaStream_t stream, int sm_count, int m, int n, int k, const A& a, const B& b, float* dw,
                     float* db, float* scratch, const LayerUpdate<float>& update = {},
                     const ArrivalCounters& arrivals = {}) {
  split_weight_gradient<TileT>(
      sm_count, m, n, k, a, b, dw, db, scratch, update, arrivals,
      [&](const auto& p, int splits) { launch_gemm<TileT, P, true>(p, splits, stream); }, PassOnStream{stream});
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
