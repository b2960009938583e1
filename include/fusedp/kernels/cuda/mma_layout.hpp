#pragma once
// Where every element of a tensor-core GEMM tile lives, as index math both compilers see: which 16-byte
// copy each thread issues for a slice of an operand, where that copy lands in (swizzled or padded)
// shared memory, which shared-memory row each lane hands to ldmatrix, which element each register of an
// mma.sync m16n8k8 TF32 fragment holds, and where each accumulator goes. gemm_mma.cuh's kernel is made
// of these functions and the PTX instructions; tests/kernels/cuda/mma_layout.cpp runs the same
// functions on the CPU with the instructions emulated as the PTX ISA defines them (ldmatrix's lane
// groups, the m16n8k8 fragment tables, cp.async's zero fill) and checks the GEMM against double, and
// that no shared-memory access pattern of the kernel conflicts on a bank.
//
// Nothing here includes CUDA: g++ compiles it for the emulation, nvcc for the kernel.
#include "fusedp/core/config.hpp"
#include "fusedp/kernels/bf16.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fusedp::kernels::cuda::mma {

/// Which index of an operand walks contiguous memory. k: the reduction index (a row-major A(m, k),
/// B(n, k) as a Linear's x and W in the forward); mn: the row index (dz and x by columns in a weight
/// gradient, W by columns in an input gradient).
enum class Major { k, mn };

inline constexpr int slice_k = 32;     // reduction depth of one staged slice
inline constexpr int chunk_floats = 4;  // one 16-byte cp.async

/// One operand's slice in shared memory: Rows operand rows (BM or BN) by slice_k reduction indices,
/// filled by copies of Copy floats: 4 (16-byte cp.async of an operand in memory, along its contiguous
/// index) or 1 (4-byte cp.async of a gathered element: an implicit-GEMM convolution's im2col).
template <int Rows, Major M, int Copy = chunk_floats>
struct SliceLayout;

/// K-major: Rows rows of 32 floats (8 chunks of 16 bytes), chunk c of row r stored at chunk c ^ (r % 8).
/// The 8 rows an ldmatrix phase reads (8 consecutive rows, one logical chunk) and the 8 chunks a
/// cp.async phase writes (one row) each fall on 8 distinct groups of 4 banks; 4-byte copies of 32
/// lanes write one row's 32 floats.
template <int Rows, int Copy>
struct SliceLayout<Rows, Major::k, Copy> {
  static constexpr Major major = Major::k;
  static constexpr int copy_floats = Copy;
  static constexpr int copies_per_row = slice_k / Copy;
  static constexpr int floats = Rows * slice_k;
  static constexpr int copies = Rows * copies_per_row;  // copies that fill the slice
  static_assert(Rows % 16 == 0, "SliceLayout: whole 16-row fragments");
  static_assert(Copy == 1 || Copy == chunk_floats, "SliceLayout: copies of 4 or 16 bytes");
  /// Copy i of the slice: the operand row and reduction index of its first float (Copy along k).
  FUSEDP_HD static constexpr void copy_at(int i, int& row, int& k) {
    // Unsigned: the divisors are powers of two, and a signed division costs a rounding fix-up.
    row = int(unsigned(i) / copies_per_row);
    k = int(unsigned(i) % copies_per_row) * Copy;
  }
  /// With 4-byte copies every copy of thread `tid` in a slice has the reduction index fixed_k(tid)
  /// (blocks of whole warps), so a gather's k-dependent index math runs once per slice (a k cursor).
  static constexpr bool k_fixed_per_thread = Copy == 1;
  FUSEDP_HD static constexpr int fixed_k(int tid) { return tid % slice_k; }
  template <int Threads>
  static constexpr bool row_fixed_per_thread = false;  // a thread's copies walk rows
  FUSEDP_HD static constexpr int fixed_row(int) { return 0; }
  /// Float offset of element (row, k) in the slice.
  FUSEDP_HD static constexpr int offset(int row, int k) {
    const unsigned c = unsigned(k) / chunk_floats, e = unsigned(k) % chunk_floats;
    return row * slice_k + int((c ^ (unsigned(row) & 7u)) * chunk_floats + e);
  }
};

/// MN-major: 32 rows (one per k) of Rows floats, padded to Rows + 8 so that the four k of a fragment
/// load (scalar: ldmatrix cannot transpose 32-bit elements) start 8 banks apart.
template <int Rows, int Copy>
struct SliceLayout<Rows, Major::mn, Copy> {
  static constexpr Major major = Major::mn;
  static constexpr int copy_floats = Copy;
  static constexpr int pitch = Rows + 8;
  static constexpr int copies_per_row = Rows / Copy;
  static constexpr int floats = slice_k * pitch;
  static constexpr int copies = slice_k * copies_per_row;
  static_assert(Rows % 16 == 0 && (pitch % 32 == 8 || pitch % 32 == 24),
                "SliceLayout: the padded pitch must put k rows 8 banks apart");
  static_assert(Copy == 1 || Copy == chunk_floats, "SliceLayout: copies of 4 or 16 bytes");
  /// Copy i of the slice: the operand row of its first float (Copy along the rows) and its k; a warp's
  /// 4-byte copies take 32 consecutive rows of one k, so each thread keeps its rows from slice to slice.
  /// Rows of 16: a pass (8 16-byte copies, or 32 4-byte ones) writes k rows k and k + 2, which the
  /// pitch of 24 puts on disjoint banks (k and k + 1 would overlap by 8).
  FUSEDP_HD static constexpr void copy_at(int i, int& row, int& k) {
    k = int(unsigned(i) / copies_per_row);
    if constexpr (Rows == 16) k = (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1);
    row = int(unsigned(i) % copies_per_row) * Copy;
  }
  /// With 4-byte copies and a block of a multiple of Rows threads, every copy of thread `tid` has the
  /// row fixed_row(tid) in every slice, so a gather's row-dependent index math runs once per thread
  /// (a row cursor: the im2col offsets computed once per tile row, not per element).
  template <int Threads>
  static constexpr bool row_fixed_per_thread = Copy == 1 && Threads % Rows == 0;
  FUSEDP_HD static constexpr int fixed_row(int tid) { return tid % Rows; }
  static constexpr bool k_fixed_per_thread = false;  // a thread's copies walk k
  FUSEDP_HD static constexpr int fixed_k(int) { return 0; }
  FUSEDP_HD static constexpr int offset(int row, int k) { return k * pitch + row; }
};

/// Block tile of the tensor-core GEMM: BM x BN outputs, WarpsM x WarpsN warps each owning a
/// (BM / WarpsM) x (BN / WarpsN) part made of 16 x 8 mma.sync fragments, Stages slices of 32 in flight.
/// It also answers what gemm.cuh's epilogues ask of a tile (bm, bn, threads).
template <int BM, int BN, int WarpsM, int WarpsN, int Stages>
struct MmaTile {
  static constexpr int bm = BM, bn = BN, bk = slice_k;
  static constexpr int warps_m = WarpsM, warps_n = WarpsN, stages = Stages;
  static constexpr int threads = 32 * WarpsM * WarpsN;
  static constexpr int warp_m = BM / WarpsM, warp_n = BN / WarpsN;
  static constexpr int frags_m = warp_m / 16, frags_n = warp_n / 8;
  static constexpr int ldc = BN + 8;  // accumulator tile pitch: a half-warp's float2 stores hit 32 banks
  // Two blocks per SM on sm_90 (the stages take about 96 KiB of its 228; sm_80's 164 hold one): at most
  // 128 registers a thread.
  static constexpr int min_blocks = 65536 / (128 * 32 * WarpsM * WarpsN) < 2 ? 1 : 2;
  static_assert(warp_m % 16 == 0 && warp_n % 16 == 0, "MmaTile: each warp owns 16 x 16 multiples");
  static_assert(Stages >= 2, "MmaTile: at least two stages");
  template <Major MA, Major MB>
  static constexpr int stage_floats = SliceLayout<BM, MA>::floats + SliceLayout<BN, MB>::floats;
  /// Dynamic shared memory of the kernel: the stages, reused for the accumulator tile afterwards.
  template <Major MA, Major MB>
  static constexpr std::size_t smem_bytes =
      sizeof(float) * (Stages * stage_floats<MA, MB> > BM * ldc ? Stages * stage_floats<MA, MB> : BM * ldc);
};

// The closed set of tiles, chosen by a GEMM's n (a layer's width, a compile-time fact) as tile_for does.
// Stages: as many 32-deep slices as fit about 96 KiB, so two blocks share an SM's 228 KiB (sm_90); with
// MN-major operands the largest need up to 104 KiB, more than sm_86/89/120 give a block (99 KiB):
// gemm_mma_can_run says no there.
using MmaTile128x128 = MmaTile<128, 128, 2, 4, 3>;  // n > 64; warp 64 x 32
using MmaTile128x64 = MmaTile<128, 64, 4, 2, 4>;    // 32 < n <= 64; warp 32 x 32
using MmaTile128x32 = MmaTile<128, 32, 8, 1, 4>;    // 16 < n <= 32; warp 16 x 32
using MmaTile128x16 = MmaTile<128, 16, 8, 1, 4>;    // n <= 16; warp 16 x 16

template <int N>
using mma_tile_for =
    std::conditional_t<(N > 64), MmaTile128x128,
                       std::conditional_t<(N > 32), MmaTile128x64,
                                          std::conditional_t<(N > 16), MmaTile128x32, MmaTile128x16>>>;

/// The schedule of the cp.async ring: the prologue issues slices 0 .. Stages - 2 (one commit group
/// each, empty past the last slice); before computing slice s a thread waits until at most
/// `pending_at_wait` groups are in flight (so slice s has landed), the block synchronizes, and slice
/// s + Stages - 1 is issued into the stage slice s - 1 used. An operand held in registers (16 bits in
/// memory) is loaded where its copies would be issued and stored into that stage after slice s is
/// multiplied: before the next barrier, which every read of the stage follows.
template <int Stages>
struct Pipeline {
  static constexpr int prologue = Stages - 1;
  static constexpr int pending_at_wait = Stages - 2;
  FUSEDP_HD static constexpr int stage_of(int slice) { return slice % Stages; }
  FUSEDP_HD static constexpr int issued_with(int slice) { return slice + Stages - 1; }
};

/// A thread's copies of one slice of an operand stored in 16 bits (BFloat16), between their loads and
/// their stores to shared memory (gemm_mma_kernel's operands held in registers): `Copies` copies of
/// `Elements` (4 or 1) elements, two elements to a 32-bit word (the lower-numbered in the low half), so
/// one-element gathers take half the registers. The kernel indexes it only by constants (its loops over
/// copies are unrolled), so it stays in registers. Host code calls it too (the emulation).
template <int Elements, int Copies>
struct HeldCopies {
  static_assert(Elements == 1 || Elements == chunk_floats, "HeldCopies: copies of four elements or one");
  static constexpr int copies = Copies;
  static constexpr int words = (Copies * Elements + 1) / 2;
  std::uint32_t w[words];

  /// Copy j: the first `count` of its elements at `src` (the rest zeros; src is not read when count is
  /// 0). On a device through the read-only path, a whole copy of four as one 8-byte load (src aligned
  /// as gemm_mma_can_run checks).
  FUSEDP_HD FUSEDP_ALWAYS_INLINE void fetch(int j, const BFloat16* src, int count) {
    if constexpr (Elements == 4) {
#if defined(__CUDA_ARCH__)
      if (count == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
        w[2 * j] = v.x;
        w[2 * j + 1] = v.y;
        return;
      }
#endif
      std::uint32_t e[4] = {0u, 0u, 0u, 0u};
      for (int i = 0; i < 4; ++i)
        if (i < count) e[i] = bits_at(src + i);
      w[2 * j] = e[0] | (e[1] << 16);
      w[2 * j + 1] = e[2] | (e[3] << 16);
    } else {
      const std::uint32_t e = count > 0 ? bits_at(src) : 0u;
      if (j % 2 == 0) w[j / 2] = e;
      else w[j / 2] |= e << 16;
    }
  }
  /// Element e of the held copies as fp32 (exactly): its bf16 bits become the upper half.
  FUSEDP_HD FUSEDP_ALWAYS_INLINE float value(int e) const {
    const std::uint32_t u = e % 2 == 0 ? w[e / 2] << 16 : w[e / 2] & 0xffff0000u;
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f = 0;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
  }
  /// Copy j's elements at `smem` (where the layout places the copy): one 16-byte store of four on a
  /// device.
  FUSEDP_HD FUSEDP_ALWAYS_INLINE void land(int j, float* smem) const {
    if constexpr (Elements == 4) {
#if defined(__CUDA_ARCH__)
      *reinterpret_cast<float4*>(smem) = make_float4(value(4 * j), value(4 * j + 1), value(4 * j + 2), value(4 * j + 3));
#else
      for (int i = 0; i < 4; ++i) smem[i] = value(4 * j + i);
#endif
    } else {
      *smem = value(j);
    }
  }

 private:
  FUSEDP_HD FUSEDP_ALWAYS_INLINE static std::uint32_t bits_at(const BFloat16* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const unsigned short*>(p));
#else
    return p->bits;
#endif
  }
};

/// Lane roles of mma.sync m16n8k8: group = lane / 4 (a fragment row), member = lane % 4.
FUSEDP_HD constexpr int lane_group(int lane) { return lane >> 2; }
FUSEDP_HD constexpr int lane_member(int lane) { return lane & 3; }

/// The element of a 16 x 8 (rows x k) A fragment that register r (0..3) of `lane` holds (PTX ISA,
/// "Matrix Fragments for mma.m16n8k8", .tf32): rows group and group + 8, k member and member + 4.
FUSEDP_HD constexpr void a_element(int lane, int r, int& row, int& k) {
  row = lane_group(lane) + 8 * (r & 1);
  k = lane_member(lane) + 4 * (r >> 1);
}
/// The element of an 8 x 8 (n x k) B fragment that register r (0..1) of `lane` holds.
FUSEDP_HD constexpr void b_element(int lane, int r, int& n, int& k) {
  n = lane_group(lane);
  k = lane_member(lane) + 4 * r;
}
/// The element of a 16 x 8 accumulator fragment that register r (0..3) of `lane` holds.
FUSEDP_HD constexpr void c_element(int lane, int r, int& row, int& col) {
  row = lane_group(lane) + 8 * (r >> 1);
  col = 2 * lane_member(lane) + (r & 1);
}

/// BF16 (mma.sync m16n8k16) from two TF32-layout steps: register r of the A fragment packs elements
/// (lo, hi) of the fp32 A fragment of step `half` (k 0-7 or 8-15). PTX's A register r holds rows
/// g (+8 for odd r) at k 2t, 2t+1 (+8 for r >= 2); packing the fp32 fragment's k t and t+4 there
/// instead permutes k within each 8 the same way for every lane, and bf16_b_pair permutes B's k
/// identically, so the products pair up and the sum over k is unchanged.
FUSEDP_HD constexpr void bf16_a_pair(int r, int& half, int& lo, int& hi) {
  half = r >> 1;
  lo = r & 1;      // rows g or g + 8 at k t
  hi = (r & 1) + 2;  // the same row at k t + 4
}
/// Register r of the BF16 B fragment: the fp32 B fragment of step r, elements k t and t + 4.
FUSEDP_HD constexpr void bf16_b_pair(int r, int& half, int& lo, int& hi) {
  half = r;
  lo = 0;
  hi = 1;
}

/// bf16 rounding on the host (to nearest, ties to even; finite inputs), as __floats2bfloat162_rn.
inline float round_bf16_host(float v) {
  std::uint32_t u = 0;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

/// ldmatrix.x4 for a K-major A fragment (16 rows x 8 k): lane l supplies the address of row l % 8 of
/// matrix l / 8, the matrices being (rows 0-7, k 0-3), (rows 8-15, k 0-3), (rows 0-7, k 4-7),
/// (rows 8-15, k 4-7), so the four registers come back as a_element's r = 0..3 (a 32-bit element is
/// two 16-bit ones: lane l receives word l % 4 of row l / 4).
FUSEDP_HD constexpr void a_ldmatrix_row(int lane, int& row, int& k) {
  const int matrix = lane >> 3;
  row = (lane & 7) + 8 * (matrix & 1);
  k = 4 * (matrix >> 1);
}
/// ldmatrix.x4 for two K-major B fragments (n 0-7 and 8-15, k 0-7): matrices (n 0-7, k 0-3),
/// (n 0-7, k 4-7), (n 8-15, k 0-3), (n 8-15, k 4-7), i.e. registers b[0][0], b[0][1], b[1][0], b[1][1].
FUSEDP_HD constexpr void b_ldmatrix_row(int lane, int& n, int& k) {
  const int matrix = lane >> 3;
  n = (lane & 7) + 8 * (matrix >> 1);
  k = 4 * (matrix & 1);
}

/// A warp's place in its block tile: warps walk M fastest.
template <class TileT>
FUSEDP_HD constexpr void warp_origin(int warp, int& row0, int& col0) {
  row0 = (warp % TileT::warps_m) * TileT::warp_m;
  col0 = (warp / TileT::warps_m) * TileT::warp_n;
}

/// How many of the Copy floats of one copy lie inside the problem (0..Copy; cp.async fills the rest
/// with zeros). `row` and `k` are problem coordinates of the first float; `rows` and `k_end` bound
/// them. K-major copies run along k, MN-major along rows.
template <Major M, int Copy = chunk_floats>
FUSEDP_HD constexpr int copy_count(int row, int k, int rows, int k_end) {
  if (row >= rows || k >= k_end) return 0;
  const int room = M == Major::k ? k_end - k : rows - row;
  return room < Copy ? room : Copy;
}

/// The shared-memory offsets (floats, within a stage) one lane of a warp reads for its fragments at
/// 8-deep step `step` (0..3) of a slice: through ldmatrix for K-major operands (the lane's row address),
/// one float per register for MN-major ones. A's slice comes first in a stage, B's follows at b_base.
template <class TileT, Major MA, Major MB>
struct WarpFragments {
  using LA = SliceLayout<TileT::bm, MA>;
  using LB = SliceLayout<TileT::bn, MB>;
  static constexpr int b_base = LA::floats;
  /// K-major A: the row address lane `lane` gives ldmatrix.x4 for fragment i (rows row0 + 16 i ...).
  FUSEDP_HD static constexpr int a_ldmatrix(int lane, int row0, int i, int step) {
    int row = 0, k = 0;
    a_ldmatrix_row(lane, row, k);
    return LA::offset(row0 + 16 * i + row, 8 * step + k);
  }
  /// MN-major A: register r of fragment i.
  FUSEDP_HD static constexpr int a_scalar(int lane, int row0, int i, int step, int r) {
    int row = 0, k = 0;
    a_element(lane, r, row, k);
    return LA::offset(row0 + 16 * i + row, 8 * step + k);
  }
  /// K-major B: the row address for fragments 2 p and 2 p + 1 (columns col0 + 16 p ...).
  FUSEDP_HD static constexpr int b_ldmatrix(int lane, int col0, int p, int step) {
    int n = 0, k = 0;
    b_ldmatrix_row(lane, n, k);
    return b_base + LB::offset(col0 + 16 * p + n, 8 * step + k);
  }
  /// MN-major B: register r of fragment j.
  FUSEDP_HD static constexpr int b_scalar(int lane, int col0, int j, int step, int r) {
    int n = 0, k = 0;
    b_element(lane, r, n, k);
    return b_base + LB::offset(col0 + 8 * j + n, 8 * step + k);
  }
  /// Where register r of accumulator fragment (i, j) goes in the block's C tile (pitch TileT::ldc).
  FUSEDP_HD static constexpr int c_offset(int lane, int row0, int col0, int i, int j, int r) {
    int row = 0, col = 0;
    c_element(lane, r, row, col);
    return (row0 + 16 * i + row) * TileT::ldc + col0 + 8 * j + col;
  }
};

/// cvt.rna.tf32.f32 on the host: round to the nearest value with a 10-bit mantissa, ties away from
/// zero (the emulation's stand-in for the instruction the kernel issues; finite inputs).
inline float round_tf32_host(float v) {
  std::uint32_t u = 0;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

}  // namespace fusedp::kernels::cuda::mma
