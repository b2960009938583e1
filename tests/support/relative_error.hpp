#pragma once
// The relative L2 distance of `got` from `want` (the absolute distance when `want` is all zeros): how
// the data-parallel tests compare a replica's buffers with a reference model's.
#include <cmath>
#include <cstddef>
#include <span>

namespace test_support {

inline double relative_error(std::span<const float> got, std::span<const float> want) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    n += double(want[i]) * want[i];
  }
  return n == 0 ? std::sqrt(d) : std::sqrt(d / n);
}

}  // namespace test_support
