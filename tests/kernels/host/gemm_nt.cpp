// tests include/fusedp/kernels/host/gemm_nt.hpp: C = A B^T with k contiguous in both operands, against a
// naive double-precision product: sizes at and around the register tile's edges (4 rows of A, 6 of B),
// k below, at and past a vector and a k-block (two passes), leading dimensions wider than k, accumulate,
// the epilogue after the last pass only, and use_nt's choice on the products it was measured on.
#include <fusedp/kernels/host/gemm_nt.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

namespace kh = fusedp::kernels::host;
using kernel_test::value;

namespace {

template <class T>
void check_nt(std::size_t m, std::size_t n, std::size_t k, bool accumulate) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(accumulate);
  const std::size_t lda = k + 5, ldb = k + 3, ldc = n + 2;
  std::vector<T> a(m * lda), b(n * ldb), c(m * ldc);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = T(value(1, i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = T(value(2, i));
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = T(value(3, i));
  const std::vector<T> before = c;
  std::vector<int> epilogue_calls(m * n, 0);
  kh::gemm_nt(m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, accumulate,
              [&](std::size_t i, std::size_t j0, T* p, std::size_t count) {
                CHECK(p == c.data() + i * ldc + j0);
                for (std::size_t j = 0; j < count; ++j) {
                  ++epilogue_calls[i * n + j0 + j];
                  p[j] = p[j] * T(2);  // seen in the result: runs once, after the last pass
                }
              });
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double want = accumulate ? double(before[i * ldc + j]) : 0.0;
      double scale = std::abs(want);
      for (std::size_t p = 0; p < k; ++p) {
        want += double(a[i * lda + p]) * double(b[j * ldb + p]);
        scale += std::abs(double(a[i * lda + p]) * double(b[j * ldb + p]));
      }
      CHECK(epilogue_calls[i * n + j] == 1);
      CHECK(std::abs(double(c[i * ldc + j]) - 2 * want) <= 2 * 4e-7 * double(k + 8) * (scale + 1));
    }
    for (std::size_t j = n; j < ldc; ++j) CHECK(c[i * ldc + j] == before[i * ldc + j]);  // padding untouched
  }
}

}  // namespace

TEST_CASE("gemm_nt equals the double product at the tile's edges, across vectors and k-blocks") {
  for (std::size_t m : {1u, 3u, 4u, 5u, 9u})
    for (std::size_t n : {1u, 5u, 6u, 7u, 13u})
      for (std::size_t k : {1u, 15u, 16u, 33u, 1024u, 1027u, 2100u}) check_nt<float>(m, n, k, false);
  check_nt<float>(64, 27, 1024, true);  // CIFAR conv1's weight gradient, added to the sum so far
  check_nt<float>(6, 25, 576, true);
  check_nt<double>(7, 11, 70, true);
}

TEST_CASE("use_nt: dot products where one side is narrow, the packed GEMM where both are wide") {
  CHECK(kh::use_nt(64, 27, 1024));    // CIFAR conv1 dW: 86 against 39 GFLOP/s
  CHECK(kh::use_nt(6, 25, 576));      // LeNet conv1 dW
  CHECK_FALSE(kh::use_nt(128, 576, 256));  // CIFAR conv2 dW
  CHECK_FALSE(kh::use_nt(64, 1024, 8192)); // CIFAR fc1 forward
  CHECK_FALSE(kh::use_nt(64, 576, 1024));  // ResNet-18 stage 1
}
