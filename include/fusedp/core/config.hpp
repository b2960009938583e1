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

// Optional parts, switched on by the build, never guessed from the include path, so that every
// translation unit of a program sees the same types with the same layout (the one-definition rule):
//   FUSEDP_WITH_MPI=1   Parallel<> between processes (MpiWorld, parallel/mpi.hpp). Defined by the
//                       CMake target fusedp::mpi (and the Conan and vcpkg packages' fusedp::mpi).
//   FUSEDP_WITH_NCCL=1  Parallel<> on Cuda (parallel/nccl.hpp), in translation units compiled by nvcc.
//                       Defined by fusedp::cuda.
// A plain `-I include` build defines neither and gets replicas in one process on Host. Define them
// the same for every translation unit of a program (-DFUSEDP_WITH_MPI=1 on the command line).
#ifndef FUSEDP_WITH_MPI
#define FUSEDP_WITH_MPI 0
#endif
#ifndef FUSEDP_WITH_NCCL
#define FUSEDP_WITH_NCCL 0
#endif
// Whether this translation unit has NCCL's Parallel<Net, Cuda>: asked for by the build and compiled by nvcc.
#if FUSEDP_HAS_CUDA && FUSEDP_WITH_NCCL
#define FUSEDP_HAS_NCCL 1
#else
#define FUSEDP_HAS_NCCL 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FUSEDP_ALWAYS_INLINE inline __attribute__((always_inline))
#define FUSEDP_RESTRICT __restrict__
#else
#define FUSEDP_ALWAYS_INLINE inline
#define FUSEDP_RESTRICT
#endif

// Asks the host compiler for a loop unrolled n times (register tiles and independent chains must be
// fully unrolled to stay in registers, at -O2 too).
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define FUSEDP_PRAGMA(x) _Pragma(#x)
#define FUSEDP_UNROLL(n) FUSEDP_PRAGMA(GCC unroll n)
#else
#define FUSEDP_UNROLL(n)
#endif

namespace fusedp {
// Bytes every tensor in a flat parameter buffer and every workspace region is aligned to: a cache
// line on x86-64 and ARM64, and a multiple of the 16-byte vector loads of the Cuda kernels.
inline constexpr unsigned alignment_bytes = 64;
}  // namespace fusedp
