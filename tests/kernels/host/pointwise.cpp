// tests include/fusedp/kernels/host/pointwise.hpp: the rounding pass of bf16-stored activations, bit for
// bit kernels::round_bf16 on every kind of float (it was rewritten without branches so that it
// vectorizes).
#include <fusedp/kernels/host/pointwise.hpp>

#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <vector>

TEST_CASE("round_to_bf16 rounds as round_bf16: ties, carries into the exponent, infinities, NaN payloads") {
  const std::uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                                    0xff800000u, 0x7f800001u, 0x7fbfffffu, 0xffc00001u, 0x00000001u, 0x80008000u,
                                    0x00018000u, 0x00000000u, 0x80000000u, 0x7f7f8000u};
  std::vector<std::uint32_t> bits;
  for (const std::uint32_t s : specials) bits.push_back(s);
  // And a sweep over the low halves and exponents, from a fixed generator.
  std::uint32_t state = 12345u;
  for (int i = 0; i < 100003; ++i) {
    state = state * 1664525u + 1013904223u;
    bits.push_back(state);
  }
  for (const int threads : {1, 3}) {
    CAPTURE(threads);
    std::vector<float> values(bits.size());
    for (std::size_t i = 0; i < bits.size(); ++i) values[i] = std::bit_cast<float>(bits[i]);
    fusedp::kernels::host::round_to_bf16(fusedp::Host{threads}, values.size(), values.data());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < bits.size(); ++i)
      wrong += std::bit_cast<std::uint32_t>(values[i]) !=
               std::bit_cast<std::uint32_t>(fusedp::kernels::round_bf16(std::bit_cast<float>(bits[i])));
    CHECK(wrong == 0);
  }
}
