#pragma once
// Division by a run-time constant without a divide instruction: the implicit-GEMM loaders split a
// flat row or column index into (image, channel, y, x) for every element they load, and an integer
// division costs tens of instructions on a GPU. Host code computes the same quotients (tests check
// them against `/`), so this header compiles with any C++ compiler.
#include "fusedp/core/config.hpp"

#include <cstdint>

namespace fusedp::kernels::cuda {

/// n / d and n % d for 0 <= n < 2^31 and 1 <= d < 2^31, by a multiply-high and a shift
/// (Granlund and Montgomery, PLDI'94): with l = ceil(log2 d) and m = ceil(2^(31+l) / d),
/// n / d = (n * m) >> (31 + l) for every n < 2^31.
class FastDiv {
 public:
  constexpr FastDiv() = default;
  FUSEDP_HD constexpr explicit FastDiv(int d) : d_(d) {
    if (d <= 1) return;  // d == 1: the quotient is n itself (mul_ == 0 marks it)
    int l = 0;
    while ((std::uint64_t(1) << l) < std::uint64_t(d)) ++l;
    const std::uint64_t p = std::uint64_t(1) << (31 + l);
    mul_ = std::uint32_t((p + std::uint64_t(d) - 1) / std::uint64_t(d));
    shift_ = l - 1;  // applied after taking the high 32 bits: 31 + l - 32
  }

  [[nodiscard]] FUSEDP_HD constexpr int divisor() const { return d_; }

  [[nodiscard]] FUSEDP_HD int div(int n) const {
    if (mul_ == 0) return n;
    return int(mul_hi(std::uint32_t(n), mul_) >> shift_);
  }
  [[nodiscard]] FUSEDP_HD int mod(int n) const { return n - div(n) * d_; }
  /// Quotient and remainder at once.
  FUSEDP_HD void divmod(int n, int& q, int& r) const {
    q = div(n);
    r = n - q * d_;
  }

 private:
  FUSEDP_HD static std::uint32_t mul_hi(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __umulhi(a, b);
#else
    return std::uint32_t((std::uint64_t(a) * b) >> 32);
#endif
  }

  int d_ = 1;
  std::uint32_t mul_ = 0;
  int shift_ = 0;
};

}  // namespace fusedp::kernels::cuda
