// tests include/fusedp/exec/peak.hpp: the chains whose rate is a Host's peak do the arithmetic their
// FLOP counts assume, the instruction follows the Host's precision, and bad arguments are refused.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/exec/cpu_features.hpp>
#include <fusedp/exec/host.hpp>
#include <fusedp/exec/peak.hpp>

#include <cmath>
#include <string>

namespace fp = fusedp;

TEST_CASE("the chains compute every product their FLOP counts assume") {
#if FUSEDP_HOST_AVX512_BF16
  // 16 chains of VDPBF16PS, each of 16 lanes += 1 * 1 + 1 * 1 a round: 512 a round over all of them (a
  // chain or half the lanes left out would show). Chain c starts at c (16 lanes x (0 + ... + 15) = 1920),
  // so no two chains are the same computation, which a compiler may do once (chains that start equal
  // sum to the same value, so only this start tells them apart).
  if (fp::cpu_features().avx512_bf16) {
    CHECK(fp::detail::dpbf16_chains(1) == 1920.0f + 512.0f);
    CHECK(fp::detail::dpbf16_chains(100) == 1920.0f + 51200.0f);
  }
  // Four C tiles, each element += 32 a round (a row of 32 bf16 ones times a column of 32): the four
  // tiles' first and last elements sum to 256 a round (a tile left out, a shorter row or fewer rows
  // would show).
  if (fp::amx_usable()) {
    CHECK(fp::detail::amx_chains(1) == 256.0f);
    CHECK(fp::detail::amx_chains(1000) == 256000.0f);
  }
#endif
  // One round of the fp32 chains: chain c's lanes hold (c + 1) 0.999999 + 1e-7; all of them summed.
  const int lanes = fp::detail::peak_vector_bytes / 4;
  double expected = 0;
  for (int c = 0; c < 16; ++c) expected += lanes * (double(c + 1) * double(0.999999f) + double(1e-7f));
  CHECK(double(fp::detail::fma_chains(1, 1.0f)) == doctest::Approx(expected).epsilon(1e-6));
}

TEST_CASE("a Host's peak is the rate of the instruction its precision multiplies with") {
  CHECK(fp::host_peak_instruction(fp::Host{1}) == fp::HostPeak::fma32);
  // The emulation computes bf16 products with fp32 FMAs.
  CHECK(fp::host_peak_instruction(fp::Host{1, fp::HostPrecision::bf16_emulated}) == fp::HostPeak::fma32);
  if (fp::cpu_features().avx512_bf16) {
    const fp::Host bf16{1, fp::HostPrecision::bf16};
    CHECK(fp::host_peak_instruction(bf16) == (fp::amx_usable() ? fp::HostPeak::amx_bf16 : fp::HostPeak::dpbf16));
    if (fp::amx_usable()) CHECK(fp::host_peak_instruction(bf16.with_bf16_tiles(false)) == fp::HostPeak::dpbf16);
  }
  CHECK(std::string(fp::to_string(fp::HostPeak::amx_bf16)) == "AMX TDPBF16PS");
}

TEST_CASE("measure_host_peak_flops measures what runs here and refuses what does not") {
  for (fp::HostPeak what : {fp::HostPeak::fma32, fp::HostPeak::dpbf16, fp::HostPeak::amx_bf16}) {
    CAPTURE(fp::to_string(what));
    const bool runs = what == fp::HostPeak::fma32 ||
                      (FUSEDP_HOST_AVX512_BF16 && (what == fp::HostPeak::dpbf16 ? fp::cpu_features().avx512_bf16
                                                                                : fp::amx_usable()));
    if (runs) {
      for (int threads : {1, 2}) {
        const double rate = fp::measure_host_peak_flops(threads, 0.005, what);
        CHECK(std::isfinite(rate));
        CHECK(rate > 1e8);  // any CPU this library runs on, in any build, does 0.1 GFLOP/s a thread
      }
    } else {
      CHECK_THROWS_WITH_AS(fp::measure_host_peak_flops(1, 0.005, what), doctest::Contains("does not run here"),
                           fp::InvalidArgument);
    }
  }
  // A Host's own: the instruction of its precision.
  CHECK(fp::measure_host_peak_flops(fp::Host{1}, 1, 0.005) > 1e8);
  CHECK_THROWS_WITH_AS(fp::measure_host_peak_flops(0), doctest::Contains("threads must be >= 1, got 0"),
                       fp::InvalidArgument);
  CHECK_THROWS_WITH_AS(fp::measure_host_peak_flops(1, 0.0), doctest::Contains("seconds must be > 0"),
                       fp::InvalidArgument);
}
