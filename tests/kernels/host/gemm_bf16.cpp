// tests include/fusedp/kernels/host/gemm_bf16.hpp: the Host GEMM at precision bf16. The pair layout of
// the packed panels; the emulated kernel against the double product of the bf16-rounded operands (every
// tile shape, operand layouts, edges of tiles, pairs and k-blocks, accumulate, epilogue); the AVX-512
// BF16 kernel bit for bit equal to the emulated one where the CPU has it; the AMX tiles' packed layouts,
// and their products against double where the CPU has AMX; the split over threads; the Host's precision
// checks.
#include <fusedp/kernels/host/gemm_bf16.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kh = fusedp::kernels::host;
namespace bf = fusedp::kernels::host::bf16;
using fusedp::HostPrecision;
using kernel_test::value;

namespace {

using Operand = kernel_test::Operand<float>;

double rounded(double x) { return double(fusedp::kernels::round_bf16(float(x))); }

// C = A B through bf16::gemm_with<S> at `precision`, checked against the double product of the rounded
// operands; returns C for bit comparisons.
template <class S>
std::vector<float> check(HostPrecision precision, std::size_t m, std::size_t n, std::size_t k, bool ta, bool tb,
                         bool accumulate) {
  CAPTURE(S::mr);
  CAPTURE(S::nv);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(ta);
  CAPTURE(tb);
  const Operand a(1, m, k, ta), b(2, k, n, tb);
  const std::size_t ldc = n + 1;
  std::vector<float> c(m * ldc);
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = float(value(3, i));
  const std::vector<float> before = c;
  std::vector<int> seen(m * n, 0);
  bf::gemm_with<S>(precision, m, n, k, a.ref, b.ref, c.data(), ldc, accumulate,
                   [&](std::size_t i, std::size_t j0, float* p, std::size_t count) {
                     CHECK(p == c.data() + i * ldc + j0);
                     for (std::size_t j = 0; j < count; ++j) ++seen[i * n + j0 + j];
                   });
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double want = accumulate ? double(before[i * ldc + j]) : 0.0, scale = std::abs(want);
      for (std::size_t p = 0; p < k; ++p) {
        const double t = rounded(a.at(i, p)) * rounded(b.at(p, j));
        want += t;
        scale += std::abs(t);
      }
      CHECK(seen[i * n + j] == 1);
      CHECK(std::abs(double(c[i * ldc + j]) - want) <= 6e-8 * double(k + 4) * (scale + 1e-30));
    }
  return c;
}

template <class S>
void check_shape(HostPrecision precision) {
  for (std::size_t m : {std::size_t(1), S::mr - 1, S::mr + 1, 2 * S::mr + 3})
    for (std::size_t n : {std::size_t(1), S::nr - 1, S::nr + 5})
      for (std::size_t k : {1u, 2u, 7u, 16u, 33u, 64u, 301u}) check<S>(precision, m, n, k, false, false, false);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) check<S>(precision, 37, 70, 1111, ta, tb, true);  // several k-blocks
}

#if FUSEDP_HOST_AVX512_BF16
// Another library's tile shapes on this thread (rows of 4 and 16 bytes), as oneDNN in the same process
// might leave them between two fusedp GEMMs.
[[gnu::target("amx-tile")]] void load_foreign_tile_config() {
  struct alignas(64) Config {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t bytes_per_row[16] = {16, 16, 16, 16, 16, 16, 16, 16};
    std::uint8_t rows[16] = {4, 4, 4, 4, 4, 4, 4, 4};
  };
  static constexpr Config config{};
  _tile_loadconfig(&config);
}
#endif

}  // namespace

TEST_CASE("bf16 pairs: the even k in the low half, rounded to nearest even, odd k padded with zero") {
  CHECK(bf::pair(1.0f, -2.0f) == 0xc0003f80u);
  CHECK(bf::low(bf::pair(1.00390625f, 0.0f)) == 1.0f);         // halfway: to even
  CHECK(bf::low(bf::pair(1.01171875f, 0.0f)) == 1.015625f);   // halfway: to even, upwards
  using S = bf::tile_at<0>;
  const Operand a(1, 3, 5, false);
  std::vector<bf::Pair> pa(bf::packed_a_size<S>(3, 5), 0xdeadbeefu);
  bf::pack_a<S>(a.ref, 0, 3, 0, 5, pa.data());
  for (std::size_t q = 0; q < 3; ++q)
    for (std::size_t i = 0; i < S::mr; ++i) {
      const bf::Pair p = pa[q * S::mr + i];
      if (i >= 3) {
        CHECK(p == 0u);
        continue;
      }
      CHECK(double(bf::low(p)) == rounded(a.at(i, 2 * q)));
      CHECK(double(bf::high(p)) == (2 * q + 1 < 5 ? rounded(a.at(i, 2 * q + 1)) : 0.0));
    }
  const Operand b(2, 5, 3, true);
  std::vector<bf::Pair> pb(bf::packed_b_size<S>(5, 3), 0xdeadbeefu);
  bf::pack_b<S>(b.ref, 0, 5, 0, 3, pb.data());
  for (std::size_t q = 0; q < 3; ++q)
    for (std::size_t j = 0; j < S::nr; ++j) {
      const bf::Pair p = pb[q * S::nr + j];
      if (j >= 3) {
        CHECK(p == 0u);
        continue;
      }
      CHECK(double(bf::low(p)) == rounded(b.at(2 * q, j)));
      CHECK(double(bf::high(p)) == (2 * q + 1 < 5 ? rounded(b.at(2 * q + 1, j)) : 0.0));
    }
}

TEST_CASE("the emulated bf16 GEMM equals the double product of the rounded operands") {
  check_shape<bf::tile_at<0>>(HostPrecision::bf16_emulated);
  check_shape<bf::tile_at<1>>(HostPrecision::bf16_emulated);
  check_shape<bf::tile_at<2>>(HostPrecision::bf16_emulated);
  check_shape<bf::tile_at<3>>(HostPrecision::bf16_emulated);
}

TEST_CASE("AVX-512 BF16 gives the emulation's bits (where the CPU has it)") {
  if (!fusedp::cpu_features().avx512_bf16) {
    MESSAGE("this CPU has no AVX-512 BF16: the hardware kernel is not run here");
    return;
  }
  auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CHECK(same_bits(check<bf::tile_at<0>>(HostPrecision::bf16, 37, 70, 1111, ta, tb, true),
                      check<bf::tile_at<0>>(HostPrecision::bf16_emulated, 37, 70, 1111, ta, tb, true)));
      CHECK(same_bits(check<bf::tile_at<2>>(HostPrecision::bf16, 13, 64, 96, ta, tb, false),
                      check<bf::tile_at<2>>(HostPrecision::bf16_emulated, 13, 64, 96, ta, tb, false)));
    }
  check_shape<bf::tile_at<1>>(HostPrecision::bf16);
  check_shape<bf::tile_at<3>>(HostPrecision::bf16);
}

TEST_CASE("AMX tiles: the A panel's blocks of 16 rows x 16 pairs, whole B tiles of zero pairs past k") {
  using S = bf::AmxTile<1>;
  for (const bool ta : {false, true}) {
    CAPTURE(ta);
    const std::size_t m = 19, k = 37;  // two panels, the second 3 rows; 19 pairs padded to 32
    const Operand a(1, m, k, ta);
    std::vector<bf::Pair> pa(bf::packed_a_size<S>(m, k), 0xdeadbeefu);
    REQUIRE(pa.size() == 32 * 32);
    bf::pack_a<S>(a.ref, 0, m, 0, k, pa.data());
    for (std::size_t p = 0; p < 2; ++p)
      for (std::size_t i = 0; i < 16; ++i)
        for (std::size_t q = 0; q < 32; ++q) {
          const bf::Pair got = pa[p * 32 * 16 + q / 16 * 256 + i * 16 + q % 16];
          const std::size_t row = p * 16 + i;
          const double even = row < m && 2 * q < k ? rounded(a.at(row, 2 * q)) : 0.0;
          const double odd = row < m && 2 * q + 1 < k ? rounded(a.at(row, 2 * q + 1)) : 0.0;
          CHECK(double(bf::low(got)) == even);
          CHECK(double(bf::high(got)) == odd);
        }
    const Operand b(2, k, 21, ta);
    std::vector<bf::Pair> pb(bf::packed_b_size<S>(k, 21), 0xdeadbeefu);
    REQUIRE(pb.size() == 32 * 32);  // two panels of 16 columns, 32 pairs each
    bf::pack_b<S>(b.ref, 0, k, 0, 21, pb.data());
    for (std::size_t t = 0; t < 2; ++t)
      for (std::size_t q = 0; q < 32; ++q)
        for (std::size_t j = 0; j < 16; ++j) {
          const bf::Pair got = pb[t * 32 * 16 + q * 16 + j];
          const std::size_t col = t * 16 + j;
          CHECK(double(bf::low(got)) == (col < 21 && 2 * q < k ? rounded(b.at(2 * q, col)) : 0.0));
          CHECK(double(bf::high(got)) == (col < 21 && 2 * q + 1 < k ? rounded(b.at(2 * q + 1, col)) : 0.0));
        }
  }
}

TEST_CASE("the AVX-512 packs round as to_bf16: ties, the largest float, infinities, NaN payloads") {
  if (!bf::detail::vector_packing()) {
    MESSAGE("this CPU packs without AVX-512: the scalar pair() is all there is");
    return;
  }
  const std::uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                                    0xff800000u, 0x7f800001u, 0x7fbfffffu, 0xffc00001u, 0x00000001u, 0x80008000u,
                                    0x00018000u, 0x00000000u, 0x80000000u, 0x7f7f8000u};
  const std::size_t k = 40, n = 40;  // every value at every lane of a row, a column and a run
  std::vector<float> values(k * n);
  for (std::size_t i = 0; i < values.size(); ++i)
    values[i] = std::bit_cast<float>(specials[(i * 7 + i / 16) % std::size(specials)]);
  auto same = [](bf::Pair got, float even, float odd) {
    return got == (std::uint32_t(fusedp::kernels::to_bf16(even)) | (std::uint32_t(fusedp::kernels::to_bf16(odd)) << 16));
  };
  using V = bf::tile_at<0>;
  using A = bf::AmxTile<4>;
  std::vector<bf::Pair> rows(bf::packed_b_size<V>(k, n)), cols(bf::packed_b_size<V>(k, n)), run(bf::packed_a_size<A>(n, k));
  bf::pack_b<V>(kh::row_major(values.data(), n), 0, k, 0, n, rows.data());                  // pairs_of_rows
  bf::pack_b<V>(kh::MatrixRef<float>{values.data(), 1, k}, 0, k, 0, n, cols.data());      // pairs_of_columns
  bf::pack_a<A>(kh::row_major(values.data(), k), 0, n, 0, k, run.data());                  // pairs_of_run
  std::size_t checked = 0;
  for (std::size_t q = 0; q < k / 2; ++q)
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t panel = j / V::nr * (k / 2) * V::nr + q * V::nr + j % V::nr;
      CHECK(same(rows[panel], values[2 * q * n + j], values[(2 * q + 1) * n + j]));
      CHECK(same(cols[panel], values[j * k + 2 * q], values[j * k + 2 * q + 1]));
      const std::size_t at = j / 16 * bf::panel_pairs<A>(k) * 16 + q / 16 * 256 + j % 16 * 16 + q % 16;
      CHECK(same(run[at], values[j * k + 2 * q], values[j * k + 2 * q + 1]));
      ++checked;
    }
  CHECK(checked == 800);
}

TEST_CASE("choose_tile: AMX shapes only where asked and 16 or more deep") {
  CHECK(bf::choose_tile(64, 1024, 576, false) < bf::amx_first);
  CHECK(bf::choose_tile(64, 1024, 15, true) < bf::amx_first);
  CHECK(bf::choose_tile(64, 1024, 16, true) == bf::amx_first);      // 16 x 64: no padding
  CHECK(bf::choose_tile(64, 16, 576, true) == bf::amx_first + 1);   // 16 x 16 where n is 16
  bf::with_tile(bf::amx_first, []<class S>() { CHECK((S::amx && S::nr == 64)); });
  bf::with_tile(bf::amx_first + 1, []<class S>() { CHECK((S::amx && S::nr == 16)); });
  bf::with_tile(3, []<class S>() { CHECK(!S::amx); });
}

TEST_CASE("AMX tiles: the product against double, on every edge of tiles, pairs and k-blocks (where the CPU has them)") {
  if (!fusedp::amx_usable()) {
    MESSAGE("this CPU has no AMX (or the OS did not grant it): the tile kernel is not run here");
    return;
  }
  // The tiles add a row's products in their own order (not VDPBF16PS's, so not the emulation's
  // bits): check() holds them to the same bound against the exact sum.
  check_shape<bf::AmxTile<4>>(HostPrecision::bf16);
  check_shape<bf::AmxTile<1>>(HostPrecision::bf16);
#if FUSEDP_HOST_AVX512_BF16
  load_foreign_tile_config();  // each GEMM loads its own tile shapes
#endif
  for (bool ta : {false, true})
    for (bool tb : {false, true}) check<bf::AmxTile<4>>(HostPrecision::bf16, 70, 130, 2000, ta, tb, true);
  // And from operands packed whole (a conv's weights), accumulating and not.
  using S = bf::AmxTile<4>;
  const std::size_t m = 40, n = 70, k = 99;
  const Operand a(6, m, k, false), b(7, k, n, false);
  std::vector<bf::Pair> pa(bf::packed_a_size<S>(m, k)), pb(bf::packed_b_size<S>(k, n));
  bf::pack_a<S>(a.ref, 0, m, 0, k, pa.data());
  bf::pack_b<S>(b.ref, 0, k, 0, n, pb.data());
  std::vector<float> packed(m * n, 0.5f), plain(m * n, 0.5f);
  bf::gemm_packed<S>(HostPrecision::bf16, m, n, k, pa.data(), pb.data(), packed.data(), n, true);
  bf::gemm_with<S>(HostPrecision::bf16, m, n, k, a.ref, b.ref, plain.data(), n, true);
  CHECK(std::memcmp(packed.data(), plain.data(), packed.size() * sizeof(float)) == 0);
  CHECK_THROWS_WITH_AS(bf::gemm_with<S>(HostPrecision::bf16_emulated, m, n, k, a.ref, b.ref, plain.data(), n, false),
                       doctest::Contains("AMX"), fusedp::InvalidArgument);
}

TEST_CASE("gemm_at_precision: bf16 split over threads gives one thread's bits; fp32 stays gemm()") {
  const std::size_t m = 70, n = 300, k = 257;
  const Operand a(4, m, k, false), b(5, k, n, true);
  std::vector<float> one(m * n), two(m * n), fp32(m * n), plain(m * n);
  if (fusedp::amx_usable()) {  // the tiles too
    const fusedp::Host tiles_one{1, HostPrecision::bf16}, tiles_two{2, HostPrecision::bf16};
    REQUIRE(tiles_two.bf16_tiles());
    kh::gemm_at_precision(tiles_one, m, n, k, a.ref, b.ref, one.data(), n, false);
    kh::gemm_at_precision(tiles_two, m, n, k, a.ref, b.ref, two.data(), n, false);
    CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
  }
  const fusedp::Host one_thread{1, HostPrecision::bf16_emulated}, two_threads{2, HostPrecision::bf16_emulated};
  kh::gemm_at_precision(one_thread, m, n, k, a.ref, b.ref, one.data(), n, false);
  kh::gemm_at_precision(two_threads, m, n, k, a.ref, b.ref, two.data(), n, false);
  CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
  const fusedp::Host host{2};
  CHECK(host.precision() == HostPrecision::fp32);
  kh::gemm_at_precision(host, m, n, k, a.ref, b.ref, fp32.data(), n, false);
  kh::gemm(host, m, n, k, a.ref, b.ref, plain.data(), n, false);
  CHECK(std::memcmp(fp32.data(), plain.data(), fp32.size() * sizeof(float)) == 0);
  // The bf16 result is not the fp32 one: the operands' rounding shows.
  double most = 0;
  for (std::size_t i = 0; i < one.size(); ++i) most = std::max(most, std::abs(double(one[i]) - double(fp32[i])));
  CHECK(most > 1e-4);
}

TEST_CASE("Host precision: bf16 where the CPU has AVX-512 BF16, else a message that names what is missing") {
  if (fusedp::cpu_features().avx512_bf16) {
    const fusedp::Host host{1, fusedp::precision::Bf16{}};
    CHECK(host.precision() == HostPrecision::bf16);
    CHECK(host.with_precision(HostPrecision::fp32).precision() == HostPrecision::fp32);
    // AMX tiles: on by default where the CPU has them, only at precision bf16, and can be turned off.
    CHECK(host.bf16_tiles() == fusedp::amx_usable());
    CHECK(!host.with_bf16_tiles(false).bf16_tiles());
    if (fusedp::amx_usable()) CHECK(host.with_bf16_tiles(false).with_bf16_tiles(true).bf16_tiles());
    CHECK(!host.with_precision(HostPrecision::bf16_emulated).bf16_tiles());
    CHECK(!fusedp::Host(1).bf16_tiles());
    if (!fusedp::amx_usable())
      CHECK_THROWS_WITH_AS((void)host.with_bf16_tiles(true), doctest::Contains("AMX"), fusedp::InvalidArgument);
  } else {
    CHECK_THROWS_WITH_AS(fusedp::Host(1, fusedp::precision::Bf16{}), doctest::Contains("AVX-512 BF16"),
                         fusedp::InvalidArgument);
  }
  CHECK(fusedp::Host(1, fusedp::precision::Fp32{}).precision() == HostPrecision::fp32);
  CHECK(std::string(fusedp::to_string(HostPrecision::bf16_emulated)) == "bf16 (emulated)");
}
