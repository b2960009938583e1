// Inputs of the Host kernel tests: a deterministic value in [-1, 1) for element i of operand `which`
// (a hash, so neighbours are unrelated and no two operands repeat each other), and GEMM operands of them.
#pragma once

#include <fusedp/kernels/host/gemm.hpp>

#include <cstddef>
#include <vector>

namespace kernel_test {

inline double value(std::size_t which, std::size_t i) {
  std::size_t h = (i + 1) * 0x9E3779B97F4A7C15ull + which * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 32;
  return double(h % 2001) / 1000.0 - 1.0;
}

/// A rows x cols GEMM operand of value(which, ...), stored row-major or (transposed) column-major,
/// with a leading dimension larger than needed so that strides are not the matrix width.
template <class T>
struct Operand {
  std::vector<T> data;
  fusedp::kernels::host::MatrixRef<T> ref;
  Operand(std::size_t which, std::size_t rows, std::size_t cols, bool transposed) {
    const std::size_t ld = (transposed ? rows : cols) + 3;
    data.resize(ld * (transposed ? cols : rows));
    for (std::size_t i = 0; i < data.size(); ++i) data[i] = T(value(which, i));
    ref = transposed ? fusedp::kernels::host::MatrixRef<T>{data.data(), 1, ld}
                     : fusedp::kernels::host::MatrixRef<T>{data.data(), ld, 1};
  }
  [[nodiscard]] double at(std::size_t i, std::size_t j) const {
    return double(ref.data[i * ref.row_stride + j * ref.col_stride]);
  }
};

}  // namespace kernel_test
