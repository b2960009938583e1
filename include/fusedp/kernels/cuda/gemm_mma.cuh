#pragma once
// The tensor-core GEMM mainloop (sm_80 and later, TF32): C (m x n) = sum over k of A(m, k) B(n, k) for
// operands that say where each element lies (CopyOperand: gemm.cuh's Rows and Columns, copied four
// elements at a time, and conv2d.cuh's implicit-GEMM gathers, one at a time), with gemm.cuh's
// GemmProblem, split-K and epilogues unchanged. Per block: `Stages` 32-deep slices in flight through
// cp.async (zero-filled past the problem's edges and in a convolution's padding); an operand stored in
// 16 bits (BFloat16, a 16-bit activation workspace) is loaded into registers instead when its copies
// would be issued and stored to shared memory as fp32 (exact) after the slice in hand is multiplied, so
// shared memory and everything after it are the same for either element. K-major slices XOR-swizzled in shared
// memory and read by ldmatrix.x4, MN-major slices padded and read one float per register (ldmatrix
// cannot transpose 32-bit elements), each element rounded once by cvt.rna.tf32 and multiplied by
// mma.sync.m16n8k8 with fp32 accumulators in registers; the finished tile goes through shared memory to
// the epilogue as in gemm_kernel. The row sums of A (a weight gradient's bias gradient) are summed from
// the fp32 fragments before rounding, in a fixed order.
//
// The index math is mma_layout.hpp, run on the CPU with the instructions emulated by
// tests/kernels/cuda/mma_layout.cpp; tests/gpu/gemm_mma.cu checks the kernel on a device. Not yet run on
// a GPU (benchmarks/RESULTS.md says what an H200 has measured).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/gemm.cuh"
#include "fusedp/kernels/cuda/mma_layout.hpp"

#include <cuda_bf16.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp::kernels::cuda {

/// What the tensor-core mainloop asks of an operand (besides gemm.cuh's `at` and `k_fastest`):
/// `element`, what memory holds (float, or BFloat16 in a 16-bit workspace); `copy_floats`, the elements
/// of one copy and so the floats it fills in shared memory: 4 (copies along the contiguous index: Rows
/// and Columns, whose base and leading dimension must then be aligned to four elements) or 1 (gathered
/// elements: the implicit GEMMs of a convolution); `source(row, k)`, the address of a copy's first
/// element, or null where the copy is all zeros (a convolution's padding); `base()`, a valid address for
/// the copies that read nothing.
template <class L>
concept CopyOperand = requires(const L& l, int r, int k) {
  typename L::element;
  { L::copy_floats } -> std::convertible_to<int>;
  { l.source(r, k) } -> std::same_as<const typename L::element*>;
  { l.base() } -> std::same_as<const typename L::element*>;
} && (std::is_same_v<typename L::element, float> || std::is_same_v<typename L::element, BFloat16>) &&
                      (L::copy_floats == 1 || L::copy_floats == mma::chunk_floats);

/// An operand the mainloop loads through registers: one stored in 16 bits (cp.async cannot widen).
template <class L>
inline constexpr bool held_in_registers = std::is_same_v<typename L::element, BFloat16>;

template <class L>
inline constexpr mma::Major major_of = L::k_fastest ? mma::Major::k : mma::Major::mn;

/// A gathered operand whose row-dependent index math can be done once (`row_cursor(row)`, then
/// `source(cursor, k)`), or whose k-dependent math can (`k_cursor(k)`, then `source(row, cursor)`):
/// conv2d.cuh's implicit-GEMM operands. The kernel hoists a cursor where its copies keep the row (or k).
template <class L>
concept RowCursorOperand = requires(const L& l) {
  { l.source(l.row_cursor(0), 0) } -> std::same_as<const typename L::element*>;
};
template <class L>
concept KCursorOperand = requires(const L& l) {
  { l.source(0, l.k_cursor(0)) } -> std::same_as<const typename L::element*>;
};

namespace detail {

template <class L>
bool aligned_for_copies(const L& l) {
  if constexpr (L::copy_floats == 1) {
    return true;
  } else {
    return reinterpret_cast<std::uintptr_t>(l.p) % (mma::chunk_floats * sizeof(typename L::element)) == 0 &&
           l.ld % mma::chunk_floats == 0;
  }
}

// An operand's copy addresses with the cursors the layout lets a thread keep: a row cursor made once
// per thread, a k cursor once per slice, or none (source(row, k) per copy).
template <class Layout, class Op, int Threads>
struct CopySource {
  static constexpr bool by_row = Layout::major == mma::Major::mn && RowCursorOperand<Op> &&
                                 Layout::template row_fixed_per_thread<Threads>;
  static constexpr bool by_k = Layout::major == mma::Major::k && KCursorOperand<Op> && Layout::k_fixed_per_thread;
  /// The cursor of thread `tid`'s row in a block whose rows start at `origin` (0 when unused).
  FUSEDP_HD static auto row_cursor(const Op& op, int origin, int tid) {
    if constexpr (by_row) return op.row_cursor(origin + Layout::fixed_row(tid));
    else return 0;
  }
  /// The cursor of thread `tid`'s k in the slice starting at k0 (0 when unused).
  FUSEDP_HD static auto k_cursor(const Op& op, int k0, int tid) {
    if constexpr (by_k) return op.k_cursor(k0 + Layout::fixed_k(tid));
    else return 0;
  }
  template <class R, class K>
  FUSEDP_HD static const typename Op::element* at(const Op& op, const R& row_cursor, const K& k_cursor, int row,
                                                  int k) {
    if constexpr (by_row) return op.source(row_cursor, k);
    else if constexpr (by_k) return op.source(row, k_cursor);
    else return op.source(row, k);
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FUSEDP_MMA_UNSUPPORTED_ARCH 1
#endif

// Floats global -> shared, of which the first `count` come from `gmem` and the rest are zeros: 16 bytes
// bypassing L1 (.cg), or one float through L1 (.ca: neighbouring gathers of a convolution reread it).
template <int Floats>
__device__ FUSEDP_ALWAYS_INLINE void cp_async(float* smem, const float* gmem, int count) {
#ifdef FUSEDP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (Floats == 4)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(count * 4));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(count * 4));
#endif
}
__device__ FUSEDP_ALWAYS_INLINE void cp_async_commit() {
#ifndef FUSEDP_MMA_UNSUPPORTED_ARCH
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int Pending>
__device__ FUSEDP_ALWAYS_INLINE void cp_async_wait() {
#ifndef FUSEDP_MMA_UNSUPPORTED_ARCH
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}
__device__ FUSEDP_ALWAYS_INLINE void ldmatrix_x4(unsigned (&r)[4], const float* smem) {
#ifdef FUSEDP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}
__device__ FUSEDP_ALWAYS_INLINE unsigned to_tf32(unsigned bits) {
#ifdef FUSEDP_MMA_UNSUPPORTED_ARCH
  return bits;
#else
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(bits)));
  return r;
#endif
}
__device__ FUSEDP_ALWAYS_INLINE void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef FUSEDP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
// Two fp32 values as a bf16x2 register, each rounded to nearest even: `lo` in the low half (the
// fragment's lower-numbered element).
__device__ FUSEDP_ALWAYS_INLINE unsigned pack_bf16(unsigned lo, unsigned hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(__uint_as_float(lo), __uint_as_float(hi));
  return *reinterpret_cast<const unsigned*>(&v);
}
__device__ FUSEDP_ALWAYS_INLINE void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef FUSEDP_MMA_UNSUPPORTED_ARCH
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#undef FUSEDP_MMA_UNSUPPORTED_ARCH

}  // namespace detail

/// The tensor-core GEMM kernel: one TileT::bm x TileT::bn tile of C per block over its split's k-range,
/// multiplied in precision P: Tf32 (m16n8k8) or Bf16 (m16n8k16; operands rounded to bf16 from the fp32
/// in shared memory, fp32 accumulation).
template <class TileT, bool RowSums, class P, class A, class B, class Epi>
__global__ void __launch_bounds__(TileT::threads, TileT::min_blocks) gemm_mma_kernel(const GemmProblem<A, B, Epi> p) {
  kernel_prologue();
  constexpr bool BF16 = std::is_same_v<P, precision::Bf16>;
  static_assert(BF16 || std::is_same_v<P, precision::Tf32>, "gemm_mma_kernel: TF32 or BF16 tensor cores");
  constexpr mma::Major MA = major_of<A>, MB = major_of<B>;
  using LA = mma::SliceLayout<TileT::bm, MA, A::copy_floats>;
  using LB = mma::SliceLayout<TileT::bn, MB, B::copy_floats>;
  using W = mma::WarpFragments<TileT, MA, MB>;
  constexpr int NT = TileT::threads, FM = TileT::frags_m, FN = TileT::frags_n, STAGES = TileT::stages;
  constexpr int STAGE = LA::floats + LB::floats;
  constexpr int CA = (LA::copies + NT - 1) / NT, CB = (LB::copies + NT - 1) / NT;  // copies per thread
  static_assert(FN % 2 == 0, "gemm_mma_kernel: B fragments are loaded in pairs");

  extern __shared__ __align__(128) float smem[];
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int m0 = int(blockIdx.x) * TileT::bm, n0 = int(blockIdx.y) * TileT::bn, split = int(blockIdx.z);
  const int k_begin = split * p.k_chunk;
  const int k_end = k_begin + min(p.k_chunk, p.k - k_begin);  // k_begin + k_chunk may pass 2^31
  const int slices = k_begin < k_end ? (k_end - k_begin + mma::slice_k - 1) / mma::slice_k : 0;

  // Cursors: a gathered operand's row-dependent index math once per thread (MN-major: each thread
  // keeps its row in every slice), its k-dependent math once per slice (K-major: each keeps its k).
  using SA = detail::CopySource<LA, A, NT>;
  using SB = detail::CopySource<LB, B, NT>;
  const auto a_rows = SA::row_cursor(p.a, m0, tid);
  const auto b_rows = SB::row_cursor(p.b, n0, tid);

  // One operand's copies of slice s: copies_per_thread per thread, rows from `origin`, into the slice
  // at `dst`. Gathers (4-byte copies) run as a loop, not unrolled: unrolled, the compiler keeps every
  // copy's slice-invariant index math in registers across slices (16 rows of a K-major im2col: spills
  // under the 128-register bound).
  auto copy = [&](const auto& op, auto layout, auto source, const auto& rows_cursor, int copies_per_thread, int origin,
                  int rows, int k0, float* dst) {
    static_assert(!held_in_registers<std::remove_cvref_t<decltype(op)>>, "gemm_mma_kernel: cp.async copies fp32 only");
    using L = decltype(layout);
    using Src = decltype(source);
    const auto k_cursor = Src::k_cursor(op, k0, tid);
    auto one = [&](int j) {
      int r = 0, k = 0;
      L::copy_at(tid + j * NT, r, k);
      const int count = mma::copy_count<L::major, L::copy_floats>(origin + r, k0 + k, rows, k_end);
      const float* src = count > 0 ? Src::at(op, rows_cursor, k_cursor, origin + r, k0 + k) : nullptr;
      detail::cp_async<L::copy_floats>(dst + L::offset(r, k), src != nullptr ? src : op.base(),
                                       src != nullptr ? count : 0);
    };
    if constexpr (L::copy_floats == 1) {
#pragma unroll 1
      for (int j = 0; j < copies_per_thread; ++j)
        if (L::copies % NT == 0 || tid + j * NT < L::copies) one(j);
    } else {
#pragma unroll
      for (int j = 0; j < copies_per_thread; ++j)
        if (L::copies % NT == 0 || tid + j * NT < L::copies) one(j);
    }
  };
  // A 16-bit operand's copies of slice s: loaded into `held` (registers: the loop is unrolled), then
  // stored to shared memory by `land` once the slice in hand is multiplied.
  auto fetch = [&](const auto& op, auto layout, auto source, const auto& rows_cursor, auto& held, int origin, int rows,
                   int k0) {
    using L = decltype(layout);
    using Src = decltype(source);
    constexpr int copies_per_thread = std::remove_reference_t<decltype(held)>::copies;
    const auto k_cursor = Src::k_cursor(op, k0, tid);
#pragma unroll
    for (int j = 0; j < copies_per_thread; ++j) {
      if (L::copies % NT == 0 || tid + j * NT < L::copies) {
        int r = 0, k = 0;
        L::copy_at(tid + j * NT, r, k);
        const int count = mma::copy_count<L::major, L::copy_floats>(origin + r, k0 + k, rows, k_end);
        const BFloat16* src = count > 0 ? Src::at(op, rows_cursor, k_cursor, origin + r, k0 + k) : nullptr;
        held.fetch(j, src, src != nullptr ? count : 0);
      }
    }
  };
  auto land = [&](auto layout, const auto& held, float* dst) {
    using L = decltype(layout);
    constexpr int copies_per_thread = std::remove_reference_t<decltype(held)>::copies;
#pragma unroll
    for (int j = 0; j < copies_per_thread; ++j) {
      if (L::copies % NT == 0 || tid + j * NT < L::copies) {
        int r = 0, k = 0;
        L::copy_at(tid + j * NT, r, k);
        held.land(j, dst + L::offset(r, k));
      }
    }
  };
  constexpr bool HA = held_in_registers<A>, HB = held_in_registers<B>;
  mma::HeldCopies<A::copy_floats, HA ? CA : 1> held_a;
  mma::HeldCopies<B::copy_floats, HB ? CB : 1> held_b;

  using Ring = mma::Pipeline<STAGES>;
  // Slice s's copies: cp.async for fp32 operands, registers for 16-bit ones (until store(s)).
  auto load = [&](int s) {
    float* const stage = smem + Ring::stage_of(s) * STAGE;
    const int k0 = k_begin + s * mma::slice_k;
    if constexpr (HA) fetch(p.a, LA{}, SA{}, a_rows, held_a, m0, p.m, k0);
    else copy(p.a, LA{}, SA{}, a_rows, CA, m0, p.m, k0, stage);
    if constexpr (HB) fetch(p.b, LB{}, SB{}, b_rows, held_b, n0, p.n, k0);
    else copy(p.b, LB{}, SB{}, b_rows, CB, n0, p.n, k0, stage + W::b_base);
  };
  auto store = [&](int s) {
    float* const stage = smem + Ring::stage_of(s) * STAGE;
    if constexpr (HA) land(LA{}, held_a, stage);
    if constexpr (HB) land(LB{}, held_b, stage + W::b_base);
  };

  int row0 = 0, col0 = 0;
  mma::warp_origin<TileT>(warp, row0, col0);
  // Warps of the first column of warps in the first column of blocks sum A's rows (warp-uniform).
  const bool sums_here = RowSums && p.row_sums != nullptr && blockIdx.y == 0 && col0 == 0;
  float acc[FM][FN][4] = {};
  float sums[FM][2] = {};

#pragma unroll
  for (int s = 0; s < Ring::prologue; ++s) {
    if (s < slices) {
      load(s);
      store(s);
    }
    detail::cp_async_commit();
  }
  for (int s = 0; s < slices; ++s) {
    // Slice s has landed (one commit group per slice, empty ones included; a 16-bit operand's stores
    // before this barrier), and every warp is done with slice s - 1, whose stage the next load
    // overwrites.
    detail::cp_async_wait<Ring::pending_at_wait>();
    __syncthreads();
    const bool more = Ring::issued_with(s) < slices;
    if (more) load(Ring::issued_with(s));
    detail::cp_async_commit();
    const float* const stage = smem + Ring::stage_of(s) * STAGE;
    // The fp32 bits of one 8-deep step's fragments (the m16n8k8 .tf32 layouts), A's row sums on the way.
    auto fragments = [&](int step, unsigned (&a)[FM][4], unsigned (&b)[FN][2]) {
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        if constexpr (MA == mma::Major::k) {
          detail::ldmatrix_x4(a[i], stage + W::a_ldmatrix(lane, row0, i, step));
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[i][r] = __float_as_uint(stage[W::a_scalar(lane, row0, i, step, r)]);
        }
        if constexpr (RowSums) {
          if (sums_here) {
            sums[i][0] += __uint_as_float(a[i][0]) + __uint_as_float(a[i][2]);
            sums[i][1] += __uint_as_float(a[i][1]) + __uint_as_float(a[i][3]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < FN; j += 2) {
        if constexpr (MB == mma::Major::k) {
          unsigned t[4];
          detail::ldmatrix_x4(t, stage + W::b_ldmatrix(lane, col0, j / 2, step));
          b[j][0] = t[0];
          b[j][1] = t[1];
          b[j + 1][0] = t[2];
          b[j + 1][1] = t[3];
        } else {
#pragma unroll
          for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int r = 0; r < 2; ++r) b[j + q][r] = __float_as_uint(stage[W::b_scalar(lane, col0, j + q, step, r)]);
        }
      }
    };
    if constexpr (!BF16) {
#pragma unroll
      for (int step = 0; step < mma::slice_k / 8; ++step) {
        unsigned a[FM][4], b[FN][2];
        fragments(step, a, b);
#pragma unroll
        for (int i = 0; i < FM; ++i)
#pragma unroll
          for (int r = 0; r < 4; ++r) a[i][r] = detail::to_tf32(a[i][r]);
#pragma unroll
        for (int j = 0; j < FN; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) b[j][r] = detail::to_tf32(b[j][r]);
#pragma unroll
        for (int i = 0; i < FM; ++i)
#pragma unroll
          for (int j = 0; j < FN; ++j) detail::mma_tf32(acc[i][j], a[i], b[j]);
      }
    } else {
      // BF16: two 8-deep steps make one m16n8k16, each register a pair of elements (mma::bf16_a_pair
      // and bf16_b_pair: the same k permutation for A and B, so the sum over k is unchanged).
#pragma unroll
      for (int step = 0; step < mma::slice_k / 8; step += 2) {
        unsigned a[2][FM][4], b[2][FN][2];
        fragments(step, a[0], b[0]);
        fragments(step + 1, a[1], b[1]);
        unsigned a16[FM][4], b16[FN][2];
#pragma unroll
        for (int i = 0; i < FM; ++i)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            int half = 0, lo = 0, hi = 0;
            mma::bf16_a_pair(r, half, lo, hi);
            a16[i][r] = detail::pack_bf16(a[half][i][lo], a[half][i][hi]);
          }
#pragma unroll
        for (int j = 0; j < FN; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            int half = 0, lo = 0, hi = 0;
            mma::bf16_b_pair(r, half, lo, hi);
            b16[j][r] = detail::pack_bf16(b[half][j][lo], b[half][j][hi]);
          }
#pragma unroll
        for (int i = 0; i < FM; ++i)
#pragma unroll
          for (int j = 0; j < FN; ++j) detail::mma_bf16(acc[i][j], a16[i], b16[j]);
      }
    }
    // Into the stage of slice s - 1, which no warp reads after the barrier above; read after the next.
    if constexpr (HA || HB) {
      if (more) store(Ring::issued_with(s));
    }
  }
  detail::cp_async_wait<0>();
  __syncthreads();  // the stages become the accumulator tile

  if constexpr (RowSums) {
    if (sums_here) {
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v = sums[i][h];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          const int row = m0 + row0 + 16 * i + mma::lane_group(lane) + 8 * h;
          if (mma::lane_member(lane) == 0 && row < p.m) p.put_row_sum(split, row, v);
        }
    }
  }

  float* const c = smem;
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
#pragma unroll
      for (int r = 0; r < 4; r += 2)
        *reinterpret_cast<float2*>(c + W::c_offset(lane, row0, col0, i, j, r)) = make_float2(acc[i][j][r], acc[i][j][r + 1]);
  __syncthreads();
  p.epi.template apply<TileT>(c, TileT::ldc, m0, n0, split, tid);
  detail::finish_split_tile<TileT>(p.epi, m0, n0, tid);
}

/// What of a device decides whether the tensor-core mainloop runs on it: its compute capability
/// (major * 10 + minor) and the dynamic shared memory one block may opt in to (227 KiB on sm_90, 163 on
/// sm_80, 99 on sm_86, sm_89 and sm_120, where the largest tiles with MN-major operands do not fit).
struct MmaDevice {
  int arch = 0;
  std::size_t smem_per_block = 0;
  template <class P>
  static MmaDevice of(const CudaSpace<P>& space) {
    return {space.architecture(), space.shared_memory_per_block()};
  }
};

/// Whether the tensor-core mainloop can run a problem with tile TileT on device `d`: sm_80 or later,
/// the tile's stages within the device's shared memory per block, operands copied four elements at a
/// time aligned to four elements with leading dimensions a multiple of four, and splits of whole 32-deep
/// slices.
template <class TileT, class A, class B, class Epi>
[[nodiscard]] bool gemm_mma_can_run(const GemmProblem<A, B, Epi>& p, const MmaDevice& d) {
  // The same for either precision: the shared memory holds fp32 either way.
  if constexpr (!CopyOperand<A> || !CopyOperand<B>) {
    return false;
  } else {
    return d.arch >= 80 && TileT::template smem_bytes<major_of<A>, major_of<B>> <= d.smem_per_block &&
           detail::aligned_for_copies(p.a) && detail::aligned_for_copies(p.b) &&
           (p.k_chunk >= p.k || p.k_chunk % mma::slice_k == 0) && p.k_chunk > 0;
  }
}

/// Launches gemm_mma_kernel in precision P (Tf32 or Bf16) on `stream` over (m / BM) x (n / BN) x splits
/// blocks. The problem must pass gemm_mma_can_run (checked; an error names what failed).
template <class TileT, bool RowSums, class P = precision::Tf32, class A, class B, class Epi>
void launch_gemm_mma(const GemmProblem<A, B, Epi>& p, int splits, const MmaDevice& d, cudaStream_t stream) {
  static_assert(CopyOperand<A> && CopyOperand<B>,
                "launch_gemm_mma: an operand without source()/base()/copy_floats (CopyOperand) cannot be copied");
  if (p.m <= 0 || p.n <= 0) return;
  check_gemm_k("gemm_mma", p.k);
  constexpr std::size_t bytes = TileT::template smem_bytes<major_of<A>, major_of<B>>;
  require(gemm_mma_can_run<TileT>(p, d), "gemm_mma: needs sm_80 or later (this device: sm_", d.arch, ") with ",
          bytes, " bytes of shared memory per block (it allows ", d.smem_per_block,
          "), operands copied four elements at a time aligned to four elements with leading dimensions a multiple "
          "of four (A ",
          detail::aligned_for_copies(p.a) ? "is" : "is not", ", B ", detail::aligned_for_copies(p.b) ? "is" : "is not",
          ") and splits of whole 32-deep slices (k_chunk ", p.k_chunk, " of k ", p.k, ")");
  const unsigned gx = unsigned((p.m + TileT::bm - 1) / TileT::bm);
  const unsigned gy = unsigned((p.n + TileT::bn - 1) / TileT::bn);
  require(gy <= 65535u && splits >= 1 && splits <= 65535, "gemm_mma: grid of ", gx, " x ", gy, " x ", splits,
          " blocks exceeds CUDA's limits (n = ", p.n, ")");
  constexpr auto kernel = gemm_mma_kernel<TileT, RowSums, P, A, B, Epi>;
  // More than 48 KiB of dynamic shared memory is an opt-in of the kernel on the current device; set at
  // every launch (a host-side attribute, not a stream operation), so a reset device or a new context
  // never meets a stale cache.
  if constexpr (bytes > 48 * 1024)
    FUSEDP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  launch<kernel>("gemm_mma_kernel", dim3(gx, gy, unsigned(splits)), TileT::threads, bytes, stream, p);
}

/// weight_gradient on the tensor-core mainloop: dW (m x n) = sum over k of A(m, k) B(n, k), db the row
/// sums of A when not null, split over k by the same plan (TileT's 32-deep slices) and reduced in the same
/// fixed order; `scratch` holds weight_gradient_scratch<TileT>(m, n, k, sm_count) floats; `update` and
/// `arrivals` as weight_gradient's.
template <class TileT, class P = precision::Tf32, class A, class B>
void weight_gradient_mma(cudaStream_t stream, int sm_count, const MmaDevice& d, int m, int n, int k, const A& a,
                         const B& b, float* dw, float* db, float* scratch, const LayerUpdate<float>& update = {},
                         const ArrivalCounters& arrivals = {}) {
  split_weight_gradient<TileT>(
      sm_count, m, n, k, a, b, dw, db, scratch, update, arrivals,
      [&](const auto& p, int splits) { launch_gemm_mma<TileT, true, P>(p, splits, d, stream); }, PassOnStream{stream});
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
