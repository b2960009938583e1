// Inputs of the Host kernel tests: a deterministic value in [-1, 1) for element i of operand `which`
// (a hash, so neighbours are unrelated and no two operands repeat each other).
#pragma once

#include <cstddef>

namespace kernel_test {

inline double value(std::size_t which, std::size_t i) {
  std::size_t h = (i + 1) * 0x9E3779B97F4A7C15ull + which * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 32;
  return double(h % 2001) / 1000.0 - 1.0;
}

}  // namespace kernel_test
