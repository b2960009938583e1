#pragma once
// Configuration macros shared by every fusedp header. Included first by every other header.

#define FUSEDP_VERSION_MAJOR 0
#define FUSEDP_VERSION_MINOR 1
#define FUSEDP_VERSION_PATCH 0
#define FUSEDP_VERSION_STRING "0.1.0"

// FUSEDP_HD marks math that both execution spaces run: a host function under g++, a host and
// device function under nvcc. FUSEDP_HAS_CUDA is 1 only in translation units compiled by nvcc.
#if defined(__CUDACC__)
#define FUSEDP_HD __host__ __device__
#define FUSEDP_HAS_CUDA 1
#else
#define FUSEDP_HD
#define FUSEDP_HAS_CUDA 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FUSEDP_ALWAYS_INLINE inline __attribute__((always_inline))
#define FUSEDP_RESTRICT __restrict__
#else
#define FUSEDP_ALWAYS_INLINE inline
#define FUSEDP_RESTRICT
#endif

namespace fusedp {
// Bytes every tensor in a flat parameter buffer and every workspace region is aligned to: a cache
// line on x86-64 and ARM64, and a multiple of the 16-byte vector loads of the Cuda kernels.
inline constexpr unsigned alignment_bytes = 64;
}  // namespace fusedp
