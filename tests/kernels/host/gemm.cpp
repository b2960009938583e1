// The Host GEMM (include/fusedp/kernels/host/gemm.hpp) against a naive double-precision product: every
// tile shape of the target, every operand layout (row-major, transposed, both), sizes that are
// multiples of nothing (edges of tiles, of vectors and of k-blocks), accumulate and epilogue, packed
// operands, A read in place, and the split over threads.
#include <fusedp/kernels/host/gemm.hpp>

#include <doctest/doctest.h>

#include "test_values.hpp"

#include <atomic>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kh = fusedp::kernels::host;

namespace {

using kernel_test::value;

using kernel_test::Operand;

// Relative tolerance of a k-long float dot product of values in [-1, 1].
template <class T>
double tolerance(std::size_t k) {
  return (sizeof(T) == 4 ? 2e-6 : 1e-14) * double(k + 8);
}

template <class T>
void check_against_reference(std::size_t m, std::size_t n, std::size_t k, const Operand<T>& a, const Operand<T>& b,
                             const std::vector<T>& c0, const std::vector<T>& c, std::size_t ldc, bool accumulate,
                             double bias_scale) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double ref = accumulate ? double(c0[i * ldc + j]) : 0.0;
      double mag = std::abs(ref);
      for (std::size_t p = 0; p < k; ++p) {
        ref += a.at(i, p) * b.at(p, j);
        mag += std::abs(a.at(i, p) * b.at(p, j));
      }
      ref += bias_scale * double(i + 2 * j);
      if (std::abs(double(c[i * ldc + j]) - ref) > tolerance<T>(k) * (mag + 1.0)) ++bad;
    }
  // Columns past n (ldc > n) are never written.
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = n; j < ldc; ++j)
      if (c[i * ldc + j] != c0[i * ldc + j]) ++bad;
  CHECK(bad == 0);
}

// Runs `run(a, b, c, accumulate, epilogue)` for both operand layouts, with and without accumulation
// and epilogue, and compares with the reference.
// With a_row_major, only the layouts whose A is row-major (what gemm_a_in_place takes).
template <class T, class Run>
void check_all_layouts(std::size_t m, std::size_t n, std::size_t k, Run run, bool a_row_major = false) {
  for (int layout = 0; layout < 4; ++layout)
    for (int mode = 0; mode < 3; ++mode) {
      const bool ta = layout & 1, tb = layout & 2, accumulate = mode == 1, with_epi = mode == 2;
      if (a_row_major && ta) continue;
      CAPTURE(m);
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(ta);
      CAPTURE(tb);
      CAPTURE(mode);
      const Operand<T> a(1, m, k, ta), b(2, k, n, tb);
      const std::size_t ldc = n + 5;
      std::vector<T> c0(m * ldc);
      for (std::size_t i = 0; i < c0.size(); ++i) c0[i] = T(value(3, i));
      std::vector<T> c = c0;
      // The epilogue adds i + 2j, so a wrong (i, j) shows up; it must see each element once.
      // Threads touch disjoint elements; the pointer check is counted, not asserted, off the main thread.
      std::vector<int> seen(m * n, 0);
      std::atomic<int> misplaced{0};
      auto epi = [&](std::size_t i, std::size_t j0, T* p, std::size_t count) {
        if (p != c.data() + i * ldc + j0) ++misplaced;
        for (std::size_t j = 0; j < count; ++j) {
          p[j] += T(double(i + 2 * (j0 + j)));
          ++seen[i * n + j0 + j];
        }
      };
      if (with_epi) run(a.ref, b.ref, c.data(), ldc, accumulate, epi);
      else run(a.ref, b.ref, c.data(), ldc, accumulate, kh::NoEpilogue{});
      REQUIRE(misplaced == 0);
      check_against_reference(m, n, k, a, b, c0, c, ldc, accumulate, with_epi ? 1.0 : 0.0);
      if (with_epi) {
        std::size_t wrong = 0;
        for (int s : seen) wrong += s != 1;
        CHECK(wrong == 0);
      }
    }
}

// Sizes around the tile edges of every shape: 1, primes, one past a vector, k-blocks split unevenly.
constexpr std::size_t sizes[][3] = {{1, 1, 1},   {1, 17, 3},   {5, 1, 9},    {7, 13, 5},    {13, 33, 17},
                                    {17, 31, 65}, {29, 70, 200}, {37, 129, 401}, {64, 100, 577},
                                    {9, 40, 2100},   // k beyond one packed block (pack_blocks L1 blocks;
                                                     // where vectors are wide enough to make L1 blocks
                                                     // shorter than k / pack_blocks)
                                    {7, 700, 300},   // n beyond one block of B: A packed whole, once
                                    {5, 300, 2100}};  // ... and k beyond one packed block

}  // namespace

TEST_CASE_TEMPLATE("gemm_with every tile shape matches a double reference", T, float, double) {
  for (const auto& s : sizes) {
    for (std::size_t shape = 0; shape < kh::detail::shapes.size(); ++shape) {
      CAPTURE(shape);
      kh::with_tile(shape, [&]<class S>() {
        check_all_layouts<T>(s[0], s[1], s[2], [&](auto a, auto b, T* c, std::size_t ldc, bool acc, const auto& epi) {
          kh::gemm_with<S>(s[0], s[1], s[2], a, b, c, ldc, acc, epi);
        });
      });
    }
  }
}

TEST_CASE_TEMPLATE("gemm_packed on whole packed operands matches a double reference", T, float, double) {
  for (const auto& s : sizes) {
    const std::size_t m = s[0], n = s[1], k = s[2];
    kh::with_tile(kh::choose_tile<T>(m, n), [&]<class S>() {
      check_all_layouts<T>(m, n, k, [&](auto a, auto b, T* c, std::size_t ldc, bool acc, const auto& epi) {
        std::vector<T> pa(kh::packed_a_size<S, T>(m, k)), pb(kh::packed_b_size<S, T>(k, n));
        kh::pack_a<S>(a, 0, m, 0, k, pa.data());
        kh::pack_b<S>(b, 0, k, 0, n, pb.data());
        kh::gemm_packed<S>(m, n, k, pa.data(), pb.data(), c, ldc, acc, epi);
      });
    });
  }
}

TEST_CASE_TEMPLATE("gemm split over threads matches a double reference", T, float, double) {
  // Large enough to be split (rows or columns), odd enough to leave edges in every thread's part.
  constexpr std::size_t big[][3] = {{67, 300, 41}, {300, 23, 47}, {64, 1030, 77}, {130, 130, 130}};
  for (int threads = 1; threads <= 3; ++threads) {
    CAPTURE(threads);
    const fusedp::Host host{threads};
    for (const auto& s : big)
      check_all_layouts<T>(s[0], s[1], s[2], [&](auto a, auto b, T* c, std::size_t ldc, bool acc, const auto& epi) {
        kh::gemm(host, s[0], s[1], s[2], a, b, c, ldc, acc, epi);
      });
  }
}

TEST_CASE_TEMPLATE("gemm_with reading A in place matches a double reference", T, float, double) {
  for (const auto& s : sizes)
    for (std::size_t shape = 0; shape < kh::detail::shapes.size(); ++shape) {
      CAPTURE(shape);
      kh::with_tile(shape, [&]<class S>() {
        check_all_layouts<T>(s[0], s[1], s[2], [&](auto a, auto b, T* c, std::size_t ldc, bool acc, const auto& epi) {
          kh::gemm_with<S, true>(s[0], s[1], s[2], a, b, c, ldc, acc, epi);
        }, true);
      });
    }
}

TEST_CASE_TEMPLATE("gemm_a_in_place split over threads matches a double reference and gemm bit for bit", T, float,
                   double) {
  // Tall A over a few columns (a linear layer's W against a batch), with edge rows in each thread;
  // fewer row blocks than threads.
  constexpr std::size_t big[][3] = {{301, 64, 530}, {1030, 7, 41}, {67, 300, 41}, {20, 64, 300}};
  std::vector<std::vector<T>> one_thread;
  for (int threads = 1; threads <= 3; ++threads) {
    CAPTURE(threads);
    const fusedp::Host host{threads};
    for (std::size_t c = 0; c < std::size(big); ++c) {
      const auto& s = big[c];
      check_all_layouts<T>(s[0], s[1], s[2], [&](auto a, auto b, T* c, std::size_t ldc, bool acc, const auto& epi) {
        kh::gemm_a_in_place(host, s[0], s[1], s[2], a, b, c, ldc, acc, epi);
      }, true);
      // Same tile shape and k-blocks as the packed path: the same sums in the same order.
      const Operand<T> a(1, s[0], s[2], false), b(2, s[2], s[1], true);
      std::vector<T> packed(s[0] * s[1]), in_place(s[0] * s[1]);
      kh::gemm(host, s[0], s[1], s[2], a.ref, b.ref, packed.data(), s[1], false);
      kh::gemm_a_in_place(host, s[0], s[1], s[2], a.ref, b.ref, in_place.data(), s[1], false);
      CHECK(packed == in_place);
      // ... and the same bits on any number of threads.
      if (threads == 1) one_thread.push_back(in_place);
      else CHECK(in_place == one_thread[c]);
    }
  }
}

TEST_CASE("gemm_a_in_place refuses an A that is not row-major") {
  const Operand<float> a(1, 4, 5, true), b(2, 5, 3, false);
  std::vector<float> c(12, 1.0f);
  const std::vector<float> before = c;
  CHECK_THROWS_WITH_AS(kh::gemm_a_in_place(fusedp::Host{1}, 4, 3, 5, a.ref, b.ref, c.data(), 3, false),
                       doctest::Contains("must be row-major"), std::invalid_argument);
  CHECK(c == before);
}

TEST_CASE("k = 0 gives zero (or the old C) and still runs the epilogue") {
  std::vector<float> c(6, 5.0f);
  const float none = 0;
  int rows = 0;
  kh::gemm<float>(2, 3, 0, kh::row_major(&none, 0), kh::row_major(&none, 3), c.data(), 3, false,
                  [&](std::size_t, std::size_t, float*, std::size_t count) { rows += int(count == 3); });
  CHECK(rows == 2);
  for (float v : c) CHECK(v == 0.0f);
}

TEST_CASE("choose_tile is a pure function that prefers shapes wasting less padding") {
  static_assert(kh::choose_tile<float>(64, 256) == kh::choose_tile<float>(64, 256));
  for (std::size_t m : {1u, 6u, 16u, 54u, 128u, 1024u})
    for (std::size_t n : {10u, 100u, 576u, 8192u}) {
      const std::size_t s = kh::choose_tile<float>(m, n);
      REQUIRE(s < kh::detail::shapes.size());
    }
}
