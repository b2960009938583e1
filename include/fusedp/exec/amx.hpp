#pragma once
// What the x86 bf16 code of the Host needs before any kernel: whether this translation unit can compile
// AVX-512 BF16 and AMX intrinsics (FUSEDP_HOST_AVX512_BF16: GCC or Clang on x86-64, not nvcc's host
// pass; each function takes its instruction set by a target attribute, whatever the build's -march, and
// runs only where cpu_features() and amx_usable() say it may), and the tile registers' configuration,
// shared by the bf16 kernels (kernels/host/gemm_bf16.hpp, conv3x3_bf16.hpp) and the peak measurement
// (exec/peak.hpp).
#include "fusedp/core/config.hpp"

#include <cstdint>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>
#define FUSEDP_HOST_AVX512_BF16 1
#else
#define FUSEDP_HOST_AVX512_BF16 0
#endif

namespace fusedp::detail {

#if FUSEDP_HOST_AVX512_BF16
// The tile registers' shapes: all eight 16 rows x 64 bytes (C: 16 x 16 fp32; A: 16 rows x 16 pairs;
// B: 16 pairs x 16 columns). Loaded at the start of every GEMM on the calling thread (micro_for), so
// another library's tile configuration in between (oneDNN in the same process) cannot mislead ours.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(TileConfig) == 64);

[[gnu::noinline, gnu::target("amx-tile")]] inline void configure_tiles() {
  static constexpr TileConfig config{};
  _tile_loadconfig(&config);
}
#endif

}  // namespace fusedp::detail
