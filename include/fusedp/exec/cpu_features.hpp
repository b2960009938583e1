#pragma once
// What the CPU's instruction set offers the Host kernels, read at run time (CPUID and the operating
// system's enabled register state), so one binary picks the instructions of the machine it runs on.
#include "fusedp/core/config.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__)
#include <cpuid.h>
#define FUSEDP_X86_CPUID 1
#else
#define FUSEDP_X86_CPUID 0
#endif
#if FUSEDP_X86_CPUID && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fusedp {

/// The instruction-set features the Host kernels choose by.
struct CpuFeatures {
  bool avx512f = false;      ///< AVX-512 Foundation, with the zmm state enabled by the OS
  bool avx512_bf16 = false;  ///< VDPBF16PS: 16 lanes of bf16 pair dot products into fp32
  bool amx_bf16 = false;     ///< AMX tiles with TDPBF16PS, tile state enabled by the OS (XCR0 bits 17, 18);
                             ///< Linux also wants each process to ask for it: amx_usable()
};

namespace detail {
#if FUSEDP_X86_CPUID
inline unsigned long long read_xcr0() noexcept {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Linux enables the 8 KiB of tile data per thread only for a process that asks (first use without it
// is SIGILL): asked once, the answer kept. Elsewhere, XCR0's bits are the whole story.
inline bool tile_data_granted() noexcept {
#if defined(__linux__)
  static const bool granted = [] {
    constexpr long req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;  // asm/prctl.h, the tile data state
    return syscall(SYS_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0;
  }();
  return granted;
#else
  return true;
#endif
}
#endif
}  // namespace detail

namespace detail {
inline CpuFeatures read_cpu_features() noexcept {
  CpuFeatures f;
#if FUSEDP_X86_CPUID
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid(1, a, b, c, d);
  const bool osxsave = (c >> 27) & 1u;
  if (!osxsave) return f;
  const unsigned long long xcr0 = detail::read_xcr0();
  const bool zmm_state = (xcr0 & 0xe6u) == 0xe6u;              // SSE, AVX, opmask, zmm halves
  const bool tile_state = (xcr0 & (3ull << 17)) == (3ull << 17);  // TILECFG, TILEDATA
  __cpuid_count(7, 0, a, b, c, d);
  f.avx512f = zmm_state && ((b >> 16) & 1u);
  const bool amx_tile = (d >> 24) & 1u, amx_bf16 = (d >> 22) & 1u;
  const bool avx512bw = (b >> 30) & 1u;
  f.amx_bf16 = tile_state && amx_tile && amx_bf16 && f.avx512f;
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = f.avx512f && avx512bw && ((a >> 5) & 1u);
#endif
  return f;
}
}  // namespace detail

/// This CPU's features (all false where they cannot be read: not x86-64, or not GCC/Clang), read once
/// (CPUID is a VM exit under a hypervisor).
[[nodiscard]] inline CpuFeatures cpu_features() noexcept {
  static const CpuFeatures f = detail::read_cpu_features();
  return f;
}

/// Whether this process may run AMX tiles: the CPU and the OS support them (cpu_features().amx_bf16)
/// and, on Linux, the kernel granted the process their 8 KiB of state a thread, which the first call
/// asks for (only then: a granted process gets larger signal frames, and Linux refuses it small
/// alternate signal stacks). A bf16 Host calls it; nothing else does.
[[nodiscard]] inline bool amx_usable() noexcept {
#if FUSEDP_X86_CPUID
  return cpu_features().amx_bf16 && detail::tile_data_granted();
#else
  return false;
#endif
}

}  // namespace fusedp
