// The tensor-core GEMM's index math (kernels/cuda/mma_layout.hpp) run on the CPU: every block of
// gemm_mma_kernel is emulated thread by thread and lane by lane with the same copy, swizzle, ldmatrix
// and fragment functions the kernel is made of, while the instructions themselves are emulated here as
// the PTX ISA defines them, independently of the header: cp.async copies 16 bytes and zero-fills past
// its source size; ldmatrix.x4 gives lane l, in register j, 32-bit word l % 4 of the row whose address
// lane 8 j + l / 4 supplied; mma.m16n8k8 .tf32 reads and writes its fragments by the tables of "Matrix
// Fragments for mma.m16n8k8". The result is compared with a double GEMM of the TF32-rounded operands,
// the row sums with double sums, for every tile of the closed set, every operand layout, edges in m, n
// and k, and split-K. Also checked: no shared-memory access of the kernel conflicts on a bank.
//
// The cp.async ring runs as the kernel schedules it (mma::Pipeline): copies land only when a wait
// retires their commit group, their destinations read as NaN until then. An operand held in registers
// (BFloat16 in memory) goes through mma::HeldCopies, the kernel's own packing, each thread's copies
// fetched where they are issued (their destinations poisoned) and landed only after the slice in hand
// is multiplied, so a store into a stage still being read, or a read before the store, shows. What this cannot check is the
// hardware itself (the real instructions, the barriers between warps); tests/gpu/gemm_mma.cu does, on a
// device.
#include <doctest/doctest.h>

#include <fusedp/kernels/cuda/mma_layout.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <vector>

namespace fp = fusedp;
namespace mma = fusedp::kernels::cuda::mma;
using mma::Major;

namespace {

// --- the PTX ISA's definitions, written here without the header's help ------------------------------

// mma.m16n8k8 .tf32 A (16 x 8): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4).
void ptx_a(int lane, int reg, int& row, int& col) {
  const int g = lane / 4, t = lane % 4;
  row = (reg == 0 || reg == 2) ? g : g + 8;
  col = (reg < 2) ? t : t + 4;
}
// B (8 x 8, k x n): b0 (k = t, n = g), b1 (k = t + 4, n = g).
void ptx_b(int lane, int reg, int& k, int& n) {
  k = lane % 4 + (reg == 0 ? 0 : 4);
  n = lane / 4;
}
// C (16 x 8): c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
void ptx_c(int lane, int reg, int& row, int& col) {
  row = lane / 4 + (reg >= 2 ? 8 : 0);
  col = 2 * (lane % 4) + (reg % 2);
}

// Addresses an instruction needs 16-byte aligned that were not (ldmatrix rows, 16-byte cp.async).
int misaligned = 0;

// mma.m16n8k16 .bf16 A (16 x 16), element i (0..7; register i / 2, the even one in the low half):
// rows g (i in 0, 1, 4, 5) or g + 8, k 2t + (i & 1), + 8 for i >= 4.
void ptx_a16(int lane, int i, int& row, int& col) {
  const int g = lane / 4, t = lane % 4;
  row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
  col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
}
// B (16 x 8, k x n), element i (0..3): k 2t + (i & 1), + 8 for i >= 2; n g.
void ptx_b16(int lane, int i, int& k, int& n) {
  k = 2 * (lane % 4) + (i & 1) + (i >= 2 ? 8 : 0);
  n = lane / 4;
}

// ldmatrix.x4 (.b16 8x8, a 32-bit element being two 16-bit ones): register j of lane l. Each row
// address must be 16-byte aligned.
void ldmatrix_x4(const std::vector<float>& smem, const int (&row_address)[32], float (&out)[32][4]) {
  for (int l = 0; l < 32; ++l) misaligned += row_address[l] % 4 != 0;
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < 4; ++j) out[l][j] = smem.at(std::size_t(row_address[8 * j + l / 4] + l % 4));
}

// --- the operands ------------------------------------------------------------------------------------

struct Operand {
  Major major;
  int rows, k, ld;
  std::vector<float> data;
  std::vector<fp::kernels::BFloat16> held;  // the same values as 16-bit elements, for a held operand
  const fp::kernels::BFloat16* held_address(int r, int kk) const { return held.data() + (address(r, kk) - data.data()); }
  float at(int r, int kk) const {
    return major == Major::k ? data[std::size_t(r) * ld + kk] : data[std::size_t(kk) * ld + r];
  }
  const float* address(int r, int kk) const {
    return major == Major::k ? &data[std::size_t(r) * ld + kk] : &data[std::size_t(kk) * ld + r];
  }
};

// Leading dimensions padded to a multiple of 4 floats (the kernel's alignment rule).
Operand make_operand(Major major, int rows, int k, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Operand o{major, rows, k, 0, {}, {}};
  const int contiguous = major == Major::k ? k : rows, outer = major == Major::k ? rows : k;
  o.ld = (contiguous + 3) / 4 * 4;
  o.data.assign(std::size_t(outer) * o.ld, std::numeric_limits<float>::quiet_NaN());  // padding never read
  for (int r = 0; r < rows; ++r)
    for (int kk = 0; kk < k; ++kk) {
      const std::size_t i = major == Major::k ? std::size_t(r) * o.ld + kk : std::size_t(kk) * o.ld + r;
      o.data[i] = dist(rng);
    }
  return o;
}

// --- the kernel, block by block ------------------------------------------------------------------

// The writes of the copies in flight: (shared-memory offset, value), landing when a wait retires them.
using Writes = std::vector<std::pair<std::size_t, float>>;

// One slice's copies for one operand, as each thread of the block issues them: recorded in `in_flight`,
// and their destinations poisoned until they land (a read of a slice before its wait sees NaN).
template <class Layout>
void copy_slice(Writes& in_flight, std::vector<float>& smem, int base, const Operand& o, int row_origin, int k0,
                int k_end, int threads) {
  for (int tid = 0; tid < threads; ++tid)
    for (int i = tid; i < Layout::copies; i += threads) {
      int r = 0, k = 0;
      Layout::copy_at(i, r, k);
      const int count = mma::copy_count<Layout::major, Layout::copy_floats>(row_origin + r, k0 + k, o.rows, k_end);
      const float* src = count > 0 ? o.address(row_origin + r, k0 + k) : nullptr;
      const int dst = base + Layout::offset(r, k);
      if (Layout::copy_floats == 4) misaligned += dst % 4 != 0;
      for (int e = 0; e < Layout::copy_floats; ++e) {  // contiguous bytes at the copy's offset
        in_flight.emplace_back(std::size_t(dst + e), e < count ? src[e] : 0.0f);
        smem.at(std::size_t(dst + e)) = std::numeric_limits<float>::quiet_NaN();
      }
    }
}

// A held operand's copies of one slice: each thread fetches its copies into an mma::HeldCopies from the
// operand's 16-bit elements (their destinations poisoned now) and lands them when `lands` run.
template <class Layout, int Threads>
void hold_slice(std::vector<std::function<void()>>& lands, std::vector<float>& smem, int base, const Operand& o,
                int row_origin, int k0, int k_end) {
  constexpr int per_thread = (Layout::copies + Threads - 1) / Threads;
  for (int tid = 0; tid < Threads; ++tid) {
    mma::HeldCopies<Layout::copy_floats, per_thread> h{};
    std::vector<std::pair<int, int>> at;  // (copy, shared-memory offset)
    for (int j = 0; j < per_thread; ++j) {
      const int i = tid + j * Threads;
      if (i >= Layout::copies) continue;
      int r = 0, k = 0;
      Layout::copy_at(i, r, k);
      const int count = mma::copy_count<Layout::major, Layout::copy_floats>(row_origin + r, k0 + k, o.rows, k_end);
      h.fetch(j, count > 0 ? o.held_address(row_origin + r, k0 + k) : nullptr, count);
      const int dst = base + Layout::offset(r, k);
      if (Layout::copy_floats == 4) misaligned += dst % 4 != 0;
      at.emplace_back(j, dst);
      for (int e = 0; e < Layout::copy_floats; ++e) smem.at(std::size_t(dst + e)) = std::numeric_limits<float>::quiet_NaN();
    }
    lands.emplace_back([&smem, h, at] {
      for (const auto& [j, dst] : at) h.land(j, &smem.at(std::size_t(dst)));
    });
  }
}

struct Result {
  std::vector<float> c;     // splits x m x n
  std::vector<float> sums;  // splits x m
};

template <class TileT, Major MA, Major MB, int CopyA, int CopyB, bool Bf16, bool HeldA, bool HeldB>
Result emulate(const Operand& a, const Operand& b, int k_chunk, bool row_sums) {
  using LA = mma::SliceLayout<TileT::bm, MA, CopyA>;
  using LB = mma::SliceLayout<TileT::bn, MB, CopyB>;
  using W = mma::WarpFragments<TileT, MA, MB>;
  constexpr int FM = TileT::frags_m, FN = TileT::frags_n, STAGE = LA::floats + LB::floats;
  constexpr int warps = TileT::warps_m * TileT::warps_n;
  const int m = a.rows, n = b.rows, k = a.k;
  const int splits = (k + k_chunk - 1) / k_chunk;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Result out{std::vector<float>(std::size_t(splits) * m * n, nan), std::vector<float>(std::size_t(splits) * m, nan)};
  const std::size_t smem_floats = TileT::template smem_bytes<MA, MB> / sizeof(float);

  for (int z = 0; z < splits; ++z)
    for (int m0 = 0; m0 < m; m0 += TileT::bm)
      for (int n0 = 0; n0 < n; n0 += TileT::bn) {
        const int k_begin = z * k_chunk, k_end = std::min(k, k_begin + k_chunk);
        const int slices = (k_end - k_begin + mma::slice_k - 1) / mma::slice_k;
        std::vector<float> smem(smem_floats, nan);
        // acc[warp][lane][i][j][r], sums[warp][lane][i][h]
        std::vector<float> acc(std::size_t(warps) * 32 * FM * FN * 4, 0.0f);
        std::vector<float> sums(std::size_t(warps) * 32 * FM * 2, 0.0f);
        auto acc_at = [&](int w, int l, int i, int j, int r) -> float& {
          return acc[(((std::size_t(w) * 32 + l) * FM + i) * FN + j) * 4 + r];
        };
        auto sum_at = [&](int w, int l, int i, int h) -> float& { return sums[((std::size_t(w) * 32 + l) * FM + i) * 2 + h]; };
        // The cp.async ring as the kernel runs it (mma::Pipeline): commit groups land only when a wait
        // retires them.
        using Ring = mma::Pipeline<TileT::stages>;
        std::deque<Writes> groups;
        Writes open;
        std::vector<std::function<void()>> lands;
        auto issue = [&](int s) {
          const int base = Ring::stage_of(s) * STAGE, k0 = k_begin + s * mma::slice_k;
          if constexpr (HeldA) hold_slice<LA, TileT::threads>(lands, smem, base, a, m0, k0, k_end);
          else copy_slice<LA>(open, smem, base, a, m0, k0, k_end, TileT::threads);
          if constexpr (HeldB) hold_slice<LB, TileT::threads>(lands, smem, base + W::b_base, b, n0, k0, k_end);
          else copy_slice<LB>(open, smem, base + W::b_base, b, n0, k0, k_end, TileT::threads);
        };
        auto store = [&] {
          for (const auto& land : lands) land();
          lands.clear();
        };
        auto commit = [&] {
          groups.push_back(std::move(open));
          open.clear();
        };
        auto wait = [&](int pending) {
          for (; int(groups.size()) > pending; groups.pop_front())
            for (const auto& [at, v] : groups.front()) smem.at(at) = v;
        };
        for (int s = 0; s < Ring::prologue; ++s) {
          if (s < slices) {
            issue(s);
            store();
          }
          commit();
        }
        for (int s = 0; s < slices; ++s) {
          wait(Ring::pending_at_wait);
          if (Ring::issued_with(s) < slices) issue(Ring::issued_with(s));
          commit();
          const int base = Ring::stage_of(s) * STAGE;
          for (int w = 0; w < warps; ++w) {
            int row0 = 0, col0 = 0;
            mma::warp_origin<TileT>(w, row0, col0);
            // One 8-deep step's fragments as fp32 (the m16n8k8 .tf32 layouts), A's row sums on the way.
            auto load_step = [&](int step, float (&fa)[FM][32][4], float (&fb)[FN][32][2]) {
              for (int i = 0; i < FM; ++i) {
                if constexpr (MA == Major::k) {
                  int addr[32];
                  for (int l = 0; l < 32; ++l) addr[l] = base + W::a_ldmatrix(l, row0, i, step);
                  ldmatrix_x4(smem, addr, fa[i]);
                } else {
                  for (int l = 0; l < 32; ++l)
                    for (int r = 0; r < 4; ++r) fa[i][l][r] = smem.at(std::size_t(base + W::a_scalar(l, row0, i, step, r)));
                }
                if (row_sums && col0 == 0 && n0 == 0)
                  for (int l = 0; l < 32; ++l) {
                    sum_at(w, l, i, 0) += fa[i][l][0] + fa[i][l][2];
                    sum_at(w, l, i, 1) += fa[i][l][1] + fa[i][l][3];
                  }
              }
              for (int j = 0; j < FN; j += 2) {
                if constexpr (MB == Major::k) {
                  int addr[32];
                  float t[32][4];
                  for (int l = 0; l < 32; ++l) addr[l] = base + W::b_ldmatrix(l, col0, j / 2, step);
                  ldmatrix_x4(smem, addr, t);
                  for (int l = 0; l < 32; ++l) {
                    fb[j][l][0] = t[l][0];
                    fb[j][l][1] = t[l][1];
                    fb[j + 1][l][0] = t[l][2];
                    fb[j + 1][l][1] = t[l][3];
                  }
                } else {
                  for (int q = 0; q < 2; ++q)
                    for (int l = 0; l < 32; ++l)
                      for (int r = 0; r < 2; ++r)
                        fb[j + q][l][r] = smem.at(std::size_t(base + W::b_scalar(l, col0, j + q, step, r)));
                }
              }
            };
            if constexpr (!Bf16) {
              for (int step = 0; step < mma::slice_k / 8; ++step) {
                float fa[FM][32][4], fb[FN][32][2];
                load_step(step, fa, fb);
                // mma.sync m16n8k8 .tf32: operands rounded (cvt.rna), gathered into matrices by the PTX
                // tables, multiplied, scattered back.
                for (int i = 0; i < FM; ++i)
                  for (int j = 0; j < FN; ++j) {
                    double am[16][8] = {}, bm[8][8] = {};
                    for (int l = 0; l < 32; ++l) {
                      for (int r = 0; r < 4; ++r) {
                        int row = 0, col = 0;
                        ptx_a(l, r, row, col);
                        am[row][col] = mma::round_tf32_host(fa[i][l][r]);
                      }
                      for (int r = 0; r < 2; ++r) {
                        int kk = 0, col = 0;
                        ptx_b(l, r, kk, col);
                        bm[kk][col] = mma::round_tf32_host(fb[j][l][r]);
                      }
                    }
                    for (int l = 0; l < 32; ++l)
                      for (int r = 0; r < 4; ++r) {
                        int row = 0, col = 0;
                        ptx_c(l, r, row, col);
                        double d = 0;
                        for (int kk = 0; kk < 8; ++kk) d += am[row][kk] * bm[kk][col];
                        acc_at(w, l, i, j, r) += float(d);
                      }
                  }
              }
            } else {
              for (int step = 0; step < mma::slice_k / 8; step += 2) {
                float fa[2][FM][32][4], fb[2][FN][32][2];
                load_step(step, fa[0], fb[0]);
                load_step(step + 1, fa[1], fb[1]);
                // mma.sync m16n8k16 .bf16: register r of a lane packs (element 2r low, 2r + 1 high) as the
                // kernel packs them (mma::bf16_a_pair / bf16_b_pair), read by the PTX tables.
                for (int i = 0; i < FM; ++i)
                  for (int j = 0; j < FN; ++j) {
                    double am[16][16] = {}, bm[16][8] = {};
                    for (int l = 0; l < 32; ++l) {
                      for (int r = 0; r < 4; ++r) {
                        int half = 0, lo = 0, hi = 0;
                        mma::bf16_a_pair(r, half, lo, hi);
                        const float v[2] = {fa[half][i][l][lo], fa[half][i][l][hi]};
                        for (int e = 0; e < 2; ++e) {
                          int row = 0, col = 0;
                          ptx_a16(l, 2 * r + e, row, col);
                          am[row][col] = mma::round_bf16_host(v[e]);
                        }
                      }
                      for (int r = 0; r < 2; ++r) {
                        int half = 0, lo = 0, hi = 0;
                        mma::bf16_b_pair(r, half, lo, hi);
                        const float v[2] = {fb[half][j][l][lo], fb[half][j][l][hi]};
                        for (int e = 0; e < 2; ++e) {
                          int kk = 0, col = 0;
                          ptx_b16(l, 2 * r + e, kk, col);
                          bm[kk][col] = mma::round_bf16_host(v[e]);
                        }
                      }
                    }
                    for (int l = 0; l < 32; ++l)
                      for (int r = 0; r < 4; ++r) {
                        int row = 0, col = 0;
                        ptx_c(l, r, row, col);
                        double d = 0;
                        for (int kk = 0; kk < 16; ++kk) d += am[row][kk] * bm[kk][col];
                        acc_at(w, l, i, j, r) += float(d);
                      }
                  }
              }
            }
          }
          store();  // after the products, before the next barrier
        }
        wait(0);
        // Row sums: the butterfly over the four lanes of a fragment row, then lane % 4 == 0 writes.
        if (row_sums && n0 == 0)
          for (int w = 0; w < warps; ++w) {
            int row0 = 0, col0 = 0;
            mma::warp_origin<TileT>(w, row0, col0);
            if (col0 != 0) continue;
            for (int i = 0; i < FM; ++i)
              for (int h = 0; h < 2; ++h) {
                float v1[32], v2[32];
                for (int l = 0; l < 32; ++l) v1[l] = sum_at(w, l, i, h) + sum_at(w, l ^ 1, i, h);
                for (int l = 0; l < 32; ++l) v2[l] = v1[l] + v1[l ^ 2];
                for (int l = 0; l < 32; l += 4) {
                  const int row = m0 + row0 + 16 * i + mma::lane_group(l) + 8 * h;
                  if (row < m) out.sums[std::size_t(z) * m + row] = v2[l];
                }
              }
          }
        // Accumulators to the C tile (shared memory reused), then a plain row-major store.
        std::fill(smem.begin(), smem.end(), nan);
        for (int w = 0; w < warps; ++w) {
          int row0 = 0, col0 = 0;
          mma::warp_origin<TileT>(w, row0, col0);
          for (int l = 0; l < 32; ++l)
            for (int i = 0; i < FM; ++i)
              for (int j = 0; j < FN; ++j)
                for (int r = 0; r < 4; ++r) smem.at(std::size_t(W::c_offset(l, row0, col0, i, j, r))) = acc_at(w, l, i, j, r);
        }
        for (int lm = 0; lm < TileT::bm && m0 + lm < m; ++lm)
          for (int ln = 0; ln < TileT::bn && n0 + ln < n; ++ln)
            out.c[(std::size_t(z) * m + m0 + lm) * n + n0 + ln] = smem[std::size_t(lm) * TileT::ldc + ln];
      }
  return out;
}

template <class TileT, Major MA, Major MB, int CopyA = 4, int CopyB = 4, bool Bf16 = false, bool HeldA = false,
          bool HeldB = false>
void check_gemm(int m, int n, int k, int k_chunk, unsigned seed) {
  CAPTURE(TileT::bm);
  CAPTURE(TileT::bn);
  CAPTURE(int(MA));
  CAPTURE(int(MB));
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(k_chunk);
  CAPTURE(CopyA);
  CAPTURE(CopyB);
  CAPTURE(Bf16);
  CAPTURE(HeldA);
  CAPTURE(HeldB);
  std::mt19937 rng(seed);
  Operand a = make_operand(MA, m, k, rng), b = make_operand(MB, n, k, rng);
  // Operands held in registers are BFloat16 elements in memory (the padding's NaN too).
  for (Operand* o : {HeldA ? &a : nullptr, HeldB ? &b : nullptr}) {
    if (o == nullptr) continue;
    for (float v : o->data) o->held.push_back(fp::kernels::BFloat16{fp::kernels::to_bf16(v)});
    for (float& v : o->data) v = mma::round_bf16_host(v);
  }
  misaligned = 0;
  const Result got = emulate<TileT, MA, MB, CopyA, CopyB, Bf16, HeldA, HeldB>(a, b, k_chunk, true);
  const auto round = [](float v) { return Bf16 ? mma::round_bf16_host(v) : mma::round_tf32_host(v); };
  const int splits = (k + k_chunk - 1) / k_chunk;
  int bad = 0;
  for (int z = 0; z < splits; ++z) {
    const int k_begin = z * k_chunk, k_end = std::min(k, k_begin + k_chunk);
    for (int i = 0; i < m; ++i) {
      double rs = 0, rs_abs = 0;
      for (int kk = k_begin; kk < k_end; ++kk) {
        rs += a.at(i, kk);
        rs_abs += std::fabs(a.at(i, kk));
      }
      const float gs = got.sums[std::size_t(z) * m + i];
      if (!(std::fabs(gs - rs) <= 1e-5 * rs_abs + 1e-6) && bad++ < 5) FAIL_CHECK("row sum ", i, " split ", z, ": ", gs, " vs ", rs);
      for (int j = 0; j < n; ++j) {
        double ref = 0, mag = 0;
        for (int kk = k_begin; kk < k_end; ++kk) {
          const double p = double(round(a.at(i, kk))) * double(round(b.at(j, kk)));
          ref += p;
          mag += std::fabs(p);
        }
        const float g = got.c[(std::size_t(z) * m + i) * n + j];
        if (!(std::fabs(g - ref) <= 1e-5 * mag + 1e-6) && bad++ < 5)
          FAIL_CHECK("C(", i, ", ", j, ") split ", z, ": ", g, " vs ", ref);
      }
    }
  }
  CHECK(bad == 0);
  CHECK_MESSAGE(misaligned == 0, misaligned, " ldmatrix rows or 16-byte copies not 16-byte aligned");
}

template <class TileT>
void check_tile_all_layouts(int m, int n, int k, int k_chunk, unsigned seed) {
  check_gemm<TileT, Major::k, Major::k>(m, n, k, k_chunk, seed);
  check_gemm<TileT, Major::k, Major::mn>(m, n, k, k_chunk, seed + 1);
  check_gemm<TileT, Major::mn, Major::k>(m, n, k, k_chunk, seed + 2);
  check_gemm<TileT, Major::mn, Major::mn>(m, n, k, k_chunk, seed + 3);
  // 4-byte copies (gathered operands: a convolution's implicit GEMMs) in both layouts, with each other
  // and with 16-byte ones.
  check_gemm<TileT, Major::mn, Major::k, 1, 4>(m, n, k, k_chunk, seed + 4);
  check_gemm<TileT, Major::k, Major::k, 1, 1>(m, n, k, k_chunk, seed + 5);
  check_gemm<TileT, Major::k, Major::mn, 4, 1>(m, n, k, k_chunk, seed + 6);
  check_gemm<TileT, Major::mn, Major::mn, 1, 1>(m, n, k, k_chunk, seed + 7);
}

// BF16 (m16n8k16, packed from two TF32-layout steps) for every operand layout and copy size.
template <class TileT>
void check_tile_bf16(int m, int n, int k, int k_chunk, unsigned seed) {
  check_gemm<TileT, Major::k, Major::k, 4, 4, true>(m, n, k, k_chunk, seed);
  check_gemm<TileT, Major::k, Major::mn, 4, 4, true>(m, n, k, k_chunk, seed + 1);
  check_gemm<TileT, Major::mn, Major::k, 4, 4, true>(m, n, k, k_chunk, seed + 2);
  check_gemm<TileT, Major::mn, Major::mn, 4, 4, true>(m, n, k, k_chunk, seed + 3);
  check_gemm<TileT, Major::mn, Major::k, 1, 1, true>(m, n, k, k_chunk, seed + 4);
  check_gemm<TileT, Major::k, Major::k, 1, 1, true>(m, n, k, k_chunk, seed + 5);
}

// Operands stored in 16 bits, loaded through registers and stored after the products: either operand
// or both, copies of four or one, both layouts, with cp.async operands beside them.
template <class TileT>
void check_tile_held(int m, int n, int k, int k_chunk, unsigned seed) {
  check_gemm<TileT, Major::k, Major::k, 4, 4, true, true, false>(m, n, k, k_chunk, seed);
  check_gemm<TileT, Major::mn, Major::mn, 4, 4, true, false, true>(m, n, k, k_chunk, seed + 1);
  check_gemm<TileT, Major::k, Major::mn, 4, 4, false, true, true>(m, n, k, k_chunk, seed + 2);
  check_gemm<TileT, Major::mn, Major::k, 1, 4, true, true, false>(m, n, k, k_chunk, seed + 3);
  check_gemm<TileT, Major::k, Major::k, 1, 1, true, true, true>(m, n, k, k_chunk, seed + 4);
  check_gemm<TileT, Major::mn, Major::mn, 1, 1, false, true, true>(m, n, k, k_chunk, seed + 5);
}

// Banks (4-byte words modulo 32) of a set of accesses that the hardware serves in one pass.
bool conflict_free(const std::vector<int>& word_offsets) {
  std::set<int> addresses(word_offsets.begin(), word_offsets.end());  // one address read by several lanes is a broadcast
  std::set<int> banks;
  for (int w : addresses) banks.insert(w % 32);
  return banks.size() == addresses.size();
}

template <class Layout, int Threads>
void check_copy_banks() {
  // A warp's 32 16-byte copies are served in passes of 8 threads (128 bytes), its 32 4-byte copies in
  // one pass.
  constexpr int pass = Layout::copy_floats == 4 ? 8 : 32;
  for (int first = 0; first < Layout::copies; first += pass) {
    std::vector<int> words;
    for (int i = first; i < first + pass && i < Layout::copies; ++i) {
      int r = 0, k = 0;
      Layout::copy_at(i, r, k);
      for (int e = 0; e < Layout::copy_floats; ++e) words.push_back(Layout::offset(r, k) + e);
    }
    CHECK_MESSAGE(conflict_free(words), "copies from ", first, " of ", Layout::copy_floats, " floats");
  }
}

template <class TileT, Major MA, Major MB>
void check_fragment_banks() {
  using W = mma::WarpFragments<TileT, MA, MB>;
  for (int warp = 0; warp < TileT::warps_m * TileT::warps_n; ++warp) {
    int row0 = 0, col0 = 0;
    mma::warp_origin<TileT>(warp, row0, col0);
    for (int step = 0; step < 4; ++step) {
      for (int i = 0; i < TileT::frags_m; ++i) {
        if constexpr (MA == Major::k) {
          for (int matrix = 0; matrix < 4; ++matrix) {  // one pass per 8x8 matrix: 8 rows of 16 bytes
            std::vector<int> words;
            for (int l = 8 * matrix; l < 8 * matrix + 8; ++l)
              for (int e = 0; e < 4; ++e) words.push_back(W::a_ldmatrix(l, row0, i, step) + e);
            CHECK_MESSAGE(conflict_free(words), "A ldmatrix warp ", warp, " fragment ", i, " step ", step);
          }
        } else {
          for (int r = 0; r < 4; ++r) {
            std::vector<int> words;
            for (int l = 0; l < 32; ++l) words.push_back(W::a_scalar(l, row0, i, step, r));
            CHECK_MESSAGE(conflict_free(words), "A scalar warp ", warp, " fragment ", i, " register ", r);
          }
        }
      }
      for (int j = 0; j < TileT::frags_n; ++j) {
        if constexpr (MB == Major::k) {
          if (j % 2 == 0)
            for (int matrix = 0; matrix < 4; ++matrix) {
              std::vector<int> words;
              for (int l = 8 * matrix; l < 8 * matrix + 8; ++l)
                for (int e = 0; e < 4; ++e) words.push_back(W::b_ldmatrix(l, col0, j / 2, step) + e);
              CHECK_MESSAGE(conflict_free(words), "B ldmatrix warp ", warp, " pair ", j / 2, " step ", step);
            }
        } else {
          for (int r = 0; r < 2; ++r) {
            std::vector<int> words;
            for (int l = 0; l < 32; ++l) words.push_back(W::b_scalar(l, col0, j, step, r));
            CHECK_MESSAGE(conflict_free(words), "B scalar warp ", warp, " fragment ", j, " register ", r);
          }
        }
      }
    }
    // The accumulator tile: float2 stores, served per half-warp.
    for (int i = 0; i < TileT::frags_m; ++i)
      for (int j = 0; j < TileT::frags_n; ++j)
        for (int r = 0; r < 4; r += 2)
          for (int half = 0; half < 2; ++half) {
            std::vector<int> words;
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
              words.push_back(W::c_offset(l, row0, col0, i, j, r));
              words.push_back(W::c_offset(l, row0, col0, i, j, r) + 1);
              CHECK(W::c_offset(l, row0, col0, i, j, r + 1) == W::c_offset(l, row0, col0, i, j, r) + 1);
            }
            CHECK_MESSAGE(conflict_free(words), "C store warp ", warp, " fragment ", i, ",", j);
          }
  }
}

template <class TileT>
void check_tile_banks() {
  check_copy_banks<mma::SliceLayout<TileT::bm, Major::k>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bm, Major::mn>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bn, Major::k>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bn, Major::mn>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bm, Major::k, 1>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bm, Major::mn, 1>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bn, Major::k, 1>, TileT::threads>();
  check_copy_banks<mma::SliceLayout<TileT::bn, Major::mn, 1>, TileT::threads>();
  check_fragment_banks<TileT, Major::k, Major::k>();
  check_fragment_banks<TileT, Major::mn, Major::mn>();
}

}  // namespace

TEST_CASE("mma layout: the PTX fragment tables the kernel's scalar loads use are the ISA's") {
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) {
      int hr = 0, hk = 0, pr = 0, pk = 0;
      mma::a_element(lane, r, hr, hk);
      ptx_a(lane, r, pr, pk);
      CHECK(hr == pr);
      CHECK(hk == pk);
      mma::c_element(lane, r, hr, hk);
      ptx_c(lane, r, pr, pk);
      CHECK(hr == pr);
      CHECK(hk == pk);
    }
    for (int r = 0; r < 2; ++r) {
      int hn = 0, hk = 0, pn = 0, pk = 0;
      mma::b_element(lane, r, hn, hk);
      ptx_b(lane, r, pk, pn);
      CHECK(hn == pn);
      CHECK(hk == pk);
    }
  }
}

TEST_CASE("mma layout: cvt.rna.tf32 on the host keeps 10 mantissa bits, rounding ties away from zero") {
  CHECK(mma::round_tf32_host(1.0f) == 1.0f);
  CHECK(mma::round_tf32_host(1.0f + 0x1p-11f) == 1.0f + 0x1p-10f);  // the tie rounds away from zero
  CHECK(mma::round_tf32_host(-(1.0f + 0x1p-11f)) == -(1.0f + 0x1p-10f));
  CHECK(mma::round_tf32_host(1.0f + 0x1p-12f) == 1.0f);
  CHECK(mma::round_tf32_host(1.0f + 3 * 0x1p-12f) == 1.0f + 0x1p-10f);
}

TEST_CASE("mma layout: every tile and operand layout computes the GEMM, with edges in m, n and k") {
  // m and n off the tile, k off the slice and off 4 (a zero-filled partial copy).
  check_tile_all_layouts<mma::MmaTile128x128>(150, 137, 83, 83, 1);
  check_tile_all_layouts<mma::MmaTile128x64>(131, 70, 70, 70, 11);
  check_tile_all_layouts<mma::MmaTile128x32>(129, 45, 97, 97, 21);
  check_tile_all_layouts<mma::MmaTile128x16>(130, 21, 66, 66, 31);
}

TEST_CASE("mma layout: BF16 pairs two TF32-layout steps into m16n8k16 registers without changing the sum") {
  check_tile_bf16<mma::MmaTile128x128>(150, 137, 83, 83, 61);
  check_tile_bf16<mma::MmaTile128x64>(64, 40, 200, 64, 71);
  check_tile_bf16<mma::MmaTile128x32>(129, 45, 97, 97, 81);
  check_tile_bf16<mma::MmaTile128x16>(130, 21, 66, 66, 91);
}

TEST_CASE("mma layout: operands held in registers (16 bits in memory) are stored where and when the ring allows") {
  check_tile_held<mma::MmaTile128x128>(150, 137, 83, 83, 101);
  check_tile_held<mma::MmaTile128x64>(64, 40, 200, 64, 111);  // splits, more slices than stages
  check_tile_held<mma::MmaTile128x32>(129, 45, 97, 97, 121);
  check_tile_held<mma::MmaTile128x16>(130, 21, 66, 66, 131);
}

// HeldCopies<E, C>: C copies fetched with counts 0..E (a partial copy at an edge, an all-zero one),
// landed as the widened elements and zeros after `count`, whatever the words held before.
template <int E, int C>
void check_held_copies(unsigned seed) {
  CAPTURE(E);
  CAPTURE(C);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  constexpr std::size_t n = static_cast<std::size_t>(C) * E;
  std::vector<fp::kernels::BFloat16> src(n);
  for (auto& b : src) b.bits = fp::kernels::to_bf16(dist(rng));
  mma::HeldCopies<E, C> h;
  for (auto& w : h.w) w = 0xdeadbeefu;
  int counts[C];
  for (int j = 0; j < C; ++j) {
    counts[j] = (3 * j + 1 + int(seed)) % (E + 1);
    h.fetch(j, counts[j] > 0 ? &src[std::size_t(j) * E] : nullptr, counts[j]);
  }
  std::vector<float> out(n, std::numeric_limits<float>::quiet_NaN());
  for (int j = 0; j < C; ++j) h.land(j, &out[std::size_t(j) * E]);
  int bad = 0;
  for (int j = 0; j < C; ++j)
    for (int i = 0; i < E; ++i) {
      const float want = i < counts[j] ? fp::kernels::to_float(src[std::size_t(j) * E + i]) : 0.0f;
      const float got = out[std::size_t(j) * E + i];
      if (std::memcmp(&got, &want, sizeof got) != 0 && bad++ < 3)
        FAIL_CHECK("copy ", j, " element ", i, " (count ", counts[j], "): ", got, " vs ", want);
    }
  CHECK(bad == 0);
}

TEST_CASE("mma layout: held copies pack two 16-bit elements to a word and land them widened, zeros past the count") {
  check_held_copies<4, 1>(0);
  check_held_copies<4, 3>(1);
  check_held_copies<4, 4>(2);
  check_held_copies<1, 16>(3);  // a gather's copies: two to a word
  check_held_copies<1, 15>(4);  // an odd count: the last word half used
  check_held_copies<1, 7>(5);
}

TEST_CASE("mma layout: bf16 rounding on the host is to nearest, ties to even") {
  CHECK(mma::round_bf16_host(1.0f) == 1.0f);
  CHECK(mma::round_bf16_host(1.0f + 0x1p-8f) == 1.0f);                  // tie, even below
  CHECK(mma::round_bf16_host(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);    // tie, even above
  CHECK(mma::round_bf16_host(-(1.0f + 3 * 0x1p-8f)) == -(1.0f + 0x1p-6f));
  CHECK(mma::round_bf16_host(1.0f + 0x1p-9f) == 1.0f);
}

TEST_CASE("mma layout: split-K runs whole slices per split, each with its own row sums") {
  // k = 200 in chunks of 64: four splits, the last one 8 deep, with more slices than stages.
  check_tile_all_layouts<mma::MmaTile128x64>(64, 40, 200, 64, 41);
  check_tile_all_layouts<mma::MmaTile128x128>(33, 130, 300, 160, 51);
}

TEST_CASE("mma layout: no copy, fragment load or accumulator store conflicts on a bank") {
  check_tile_banks<mma::MmaTile128x128>();
  check_tile_banks<mma::MmaTile128x64>();
  check_tile_banks<mma::MmaTile128x32>();
  check_tile_banks<mma::MmaTile128x16>();
}

template <class Layout, int Threads>
void check_fixed_coordinates() {
  for (int tid = 0; tid < Threads; ++tid)
    for (int i = tid; i < Layout::copies; i += Threads) {
      int r = 0, k = 0;
      Layout::copy_at(i, r, k);
      if constexpr (Layout::template row_fixed_per_thread<Threads>) CHECK(r == Layout::fixed_row(tid));
      if constexpr (Layout::k_fixed_per_thread) CHECK(k == Layout::fixed_k(tid));
    }
}

template <class TileT>
void check_tile_cursors() {
  using mma::SliceLayout;
  static_assert(SliceLayout<TileT::bm, Major::mn, 1>::template row_fixed_per_thread<TileT::threads>);
  static_assert(SliceLayout<TileT::bn, Major::mn, 1>::template row_fixed_per_thread<TileT::threads>);
  static_assert(SliceLayout<TileT::bm, Major::k, 1>::k_fixed_per_thread);
  static_assert(!SliceLayout<TileT::bm, Major::mn, 4>::template row_fixed_per_thread<TileT::threads>);
  check_fixed_coordinates<SliceLayout<TileT::bm, Major::mn, 1>, TileT::threads>();
  check_fixed_coordinates<SliceLayout<TileT::bn, Major::mn, 1>, TileT::threads>();
  check_fixed_coordinates<SliceLayout<TileT::bm, Major::k, 1>, TileT::threads>();
  check_fixed_coordinates<SliceLayout<TileT::bn, Major::k, 1>, TileT::threads>();
}

TEST_CASE("mma layout: a thread's 4-byte copies keep their row (MN-major) or k (K-major), so cursors hold") {
  // gemm_mma_kernel computes a gather's row-dependent index math once per thread and its k-dependent
  // math once per slice on the strength of this.
  check_tile_cursors<mma::MmaTile128x128>();
  check_tile_cursors<mma::MmaTile128x64>();
  check_tile_cursors<mma::MmaTile128x32>();
  check_tile_cursors<mma::MmaTile128x16>();
}

TEST_CASE("mma layout: the stages and the accumulator tile fit in the shared memory an H200 block may use") {
  // 227 KiB is sm_90's opt-in maximum per block; two blocks of an SM share 228 KiB.
  CHECK(mma::MmaTile128x128::smem_bytes<Major::k, Major::k> <= 114 * 1024);
  CHECK(mma::MmaTile128x64::smem_bytes<Major::mn, Major::mn> <= 114 * 1024);
  CHECK(mma::MmaTile128x32::smem_bytes<Major::k, Major::mn> <= 114 * 1024);
  CHECK(mma::MmaTile128x16::smem_bytes<Major::mn, Major::k> <= 114 * 1024);
  CHECK(mma::MmaTile128x128::min_blocks == 2);
}
