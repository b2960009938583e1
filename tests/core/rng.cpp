// tests include/fusedp/core/rng.hpp: Philox4x32-10 against the Random123 known-answer vectors, the
// mapping of (seed, stream, index) onto counter and key, and the uniform floats drawn from it.
#include <doctest/doctest.h>

#include <fusedp/core/rng.hpp>

#include <cmath>
#include <cstdint>
#include <set>

namespace rng = fusedp::rng;

namespace {
void check_block(const rng::Block& got, std::uint32_t a, std::uint32_t b, std::uint32_t c, std::uint32_t d) {
  CHECK(got.v[0] == a);
  CHECK(got.v[1] == b);
  CHECK(got.v[2] == c);
  CHECK(got.v[3] == d);
}
}  // namespace

TEST_CASE("philox4x32-10 matches the Random123 known-answer vectors (kat_vectors)") {
  SUBCASE("counter 0, key 0") {
    check_block(rng::philox4x32(rng::Block{{0, 0, 0, 0}}, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
  }
  SUBCASE("counter and key all ones") {
    check_block(rng::philox4x32(rng::Block{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu,
                                0xffffffffu),
                0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu);
  }
  SUBCASE("counter and key from the digits of pi") {
    check_block(rng::philox4x32(rng::Block{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u,
                                0x299f31d0u),
                0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
  }
}

TEST_CASE("philox4x32 is usable in constant expressions") {
  constexpr rng::Block b = rng::philox4x32(rng::Block{{0, 0, 0, 0}}, 0, 0);
  constexpr float u = rng::uniform(42, 7, 3);
  CHECK(b.v[0] == 0x6627e8d5u);
  CHECK(u == rng::uniform(42, 7, 3));
}

TEST_CASE("bits() maps index to counter words 0-1, stream to words 2-3 and seed to the key") {
  const std::uint64_t seed = 0x299f31d0a4093822ull;
  const std::uint64_t stream = 0x0370734413198a2eull;
  const std::uint64_t index = 0x85a308d3243f6a88ull;
  check_block(rng::bits(seed, stream, index), 0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
  check_block(rng::bits(0, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
}

TEST_CASE("uniform(seed, stream, i) is word i % 4 of block i / 4, as a 24-bit float") {
  for (std::uint64_t i = 0; i < 64; ++i) {
    const rng::Block b = rng::bits(5, 9, i / 4);
    CHECK(rng::uniform(5, 9, i) == rng::to_unit_float(b.v[i % 4]));
  }
  CHECK(rng::to_unit_float(0) == 0.0f);
  CHECK(rng::to_unit_float(0xffffffffu) == 1.0f - 1.0f / 16777216.0f);
  CHECK(rng::to_unit_float(0xffffffffu) < 1.0f);
  CHECK(rng::to_unit_float(0x80000000u) == 0.5f);
}

TEST_CASE("uniform() lies in [0, 1) with mean about 1/2 and variance about 1/12") {
  constexpr std::uint64_t n = 200'000;
  double sum = 0, sum_sq = 0;
  float lo = 1, hi = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const float u = rng::uniform(1234, rng::stream(rng::Purpose::test, 0), i);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
    sum_sq += double(u) * u;
  }
  CHECK(lo >= 0.0f);
  CHECK(hi < 1.0f);
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  // Standard error of the mean: sqrt(1/12 / n) = 6.5e-4; 5 sigma is 3.2e-3.
  CHECK(std::abs(mean - 0.5) < 3.3e-3);
  CHECK(std::abs(var - 1.0 / 12.0) < 2e-3);
  // Every bucket of ten holds its share (n/10 = 20000; standard deviation ~134; 6 sigma bound).
  int buckets[10] = {};
  for (std::uint64_t i = 0; i < n; ++i) ++buckets[int(rng::uniform(99, 3, i) * 10)];
  for (int b : buckets) CHECK(std::abs(b - 20000) < 800);
}

TEST_CASE("streams, seeds and indices give different numbers; the same arguments the same number") {
  std::set<float> seen;
  for (std::uint64_t s = 0; s < 4; ++s)
    for (std::uint64_t st = 0; st < 4; ++st) seen.insert(rng::uniform(s, st, 0));
  CHECK(seen.size() == 16);
  CHECK(rng::uniform(7, 1, 1000) == rng::uniform(7, 1, 1000));
  CHECK(rng::uniform(7, 1, 1000) != rng::uniform(7, 1, 1001));
  CHECK(rng::uniform(7, 1, 1000) != rng::uniform(8, 1, 1000));
  // The upper 32 bits of seed, stream and index all matter.
  CHECK(rng::uniform(7ull << 32, 1, 0) != rng::uniform(0, 1, 0));
  CHECK(rng::uniform(7, 1ull << 40, 0) != rng::uniform(7, 0, 0));
  CHECK(rng::uniform(7, 1, 4ull << 33) != rng::uniform(7, 1, 0));
}

TEST_CASE("stream() keeps purposes apart") {
  using rng::Purpose;
  CHECK(rng::stream(Purpose::init, 3) != rng::stream(Purpose::dropout, 3));
  CHECK(rng::stream(Purpose::data, 0) != rng::stream(Purpose::sampler, 0));
  CHECK((rng::stream(Purpose::init, 0) >> 56) == 1);
  CHECK((rng::stream(Purpose::test, 12345) >> 56) == 5);
  CHECK((rng::stream(Purpose::test, 12345) & 0xffffff) == 12345);
}

TEST_CASE("seed() wraps a value") {
  constexpr fusedp::Seed s = fusedp::seed(42);
  static_assert(s.value == 42);
  CHECK(fusedp::Seed{}.value == 0);
}
