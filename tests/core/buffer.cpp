// tests include/fusedp/core/buffer.hpp: HostBuffer (alignment, zeroing, moves, growth) and TensorView.
#include <doctest/doctest.h>

#include <fusedp/core/buffer.hpp>
#include <fusedp/core/shape.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

using fusedp::HostBuffer;
using fusedp::TensorView;

static_assert(!std::is_copy_constructible_v<HostBuffer<float>>);
static_assert(!std::is_copy_assignable_v<HostBuffer<float>>);
static_assert(std::is_nothrow_move_constructible_v<HostBuffer<float>>);
static_assert(std::is_nothrow_move_assignable_v<HostBuffer<float>>);

TEST_CASE_TEMPLATE("HostBuffer is aligned to alignment_bytes and zero-initialized", T, float, double, std::int32_t) {
  for (std::size_t n : {1u, 3u, 17u, 1000u, 4097u}) {
    HostBuffer<T> b(n);
    REQUIRE(b.data() != nullptr);
    CHECK(b.size() == n);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % fusedp::alignment_bytes == 0);
    bool all_zero = true;
    for (std::size_t i = 0; i < n; ++i) all_zero = all_zero && b[i] == T(0);
    CHECK(all_zero);
    CHECK(b.span().size() == n);
    CHECK(b.span().data() == b.data());
  }
}

TEST_CASE("an empty HostBuffer holds nothing") {
  HostBuffer<float> a;
  CHECK(a.data() == nullptr);
  CHECK(a.size() == 0);
  HostBuffer<float> b(0);
  CHECK(b.data() == nullptr);
  CHECK(b.size() == 0);
  CHECK(b.span().empty());
}

TEST_CASE("HostBuffer moves take the memory and leave the source empty") {
  HostBuffer<float> a(10);
  for (std::size_t i = 0; i < 10; ++i) a[i] = float(i) + 0.5f;
  float* p = a.data();

  HostBuffer<float> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == 10);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK(a.size() == 0);
  CHECK(b[9] == 9.5f);

  HostBuffer<float> c(3);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.size() == 10);
  CHECK(b.data() == nullptr);  // NOLINT(bugprone-use-after-move)
  CHECK(b.size() == 0);
  CHECK(c[0] == 0.5f);

  // Self-move keeps the contents.
  HostBuffer<float>& self = c;
  c = std::move(self);
  CHECK(c.data() == p);
  CHECK(c.size() == 10);

  // A moved-from buffer can be reused.
  b = HostBuffer<float>(4);
  CHECK(b.size() == 4);
  CHECK(b[3] == 0.0f);
}

TEST_CASE("reserve_discard grows only when needed") {
  HostBuffer<double> b(8);
  b[0] = 1.0;
  double* p = b.data();
  b.reserve_discard(8);
  CHECK(b.data() == p);
  b.reserve_discard(5);
  CHECK(b.data() == p);
  CHECK(b.size() == 8);
  CHECK(b[0] == 1.0);
  b.reserve_discard(100);
  CHECK(b.size() == 100);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % fusedp::alignment_bytes == 0);
  CHECK(b[0] == 0.0);  // contents are not kept; the new memory is zeroed
  CHECK(b[99] == 0.0);
}

TEST_CASE("const HostBuffer gives const access") {
  HostBuffer<float> b(4);
  b[2] = 7.0f;
  const HostBuffer<float>& c = b;
  static_assert(std::is_same_v<decltype(c.data()), const float*>);
  static_assert(std::is_same_v<decltype(c.span()), std::span<const float>>);
  CHECK(c[2] == 7.0f);
  CHECK(c.span()[2] == 7.0f);
}

TEST_CASE("TensorView indexes row-major") {
  HostBuffer<float> b(2 * 3 * 4);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(i);
  TensorView<float, 3> v(b.data(), {2, 3, 4});
  CHECK(v.size() == 24);
  CHECK(v.extent(0) == 2);
  CHECK(v.extent(1) == 3);
  CHECK(v.extent(2) == 4);
  CHECK(v.extents() == std::array<std::size_t, 3>{2, 3, 4});
  CHECK(v.data() == b.data());
  CHECK(v.span().size() == 24);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) CHECK(v(i, j, k) == float((i * 3 + j) * 4 + k));

  v(1, 2, 3) = -1.0f;
  CHECK(b[23] == -1.0f);

  // One row of the first dimension: a (3, 4) view at offset 12.
  auto row = v[1];
  static_assert(std::is_same_v<decltype(row), TensorView<float, 2>>);
  CHECK(row.data() == b.data() + 12);
  CHECK(row.extent(0) == 3);
  CHECK(row.extent(1) == 4);
  CHECK(row(0, 1) == 13.0f);
  auto cell_row = row[2];
  static_assert(std::is_same_v<decltype(cell_row), TensorView<float, 1>>);
  CHECK(cell_row(3) == -1.0f);
  CHECK(cell_row.size() == 4);
}

TEST_CASE("TensorView of const data is read-only, and a default view is empty") {
  const float data[6] = {1, 2, 3, 4, 5, 6};
  TensorView<const float, 2> v(data, {2, 3});
  static_assert(std::is_same_v<decltype(v(0, 0)), const float&>);
  CHECK(v(1, 0) == 4.0f);
  CHECK(v[1](2) == 6.0f);
  TensorView<float, 2> e;
  CHECK(e.data() == nullptr);
  CHECK(e.size() == 0);
}

TEST_CASE("Shape and the aligned element count") {
  using S = fusedp::Shape<3, 7, 9>;
  static_assert(S::size == 189);
  static_assert(!S::is_flat);
  static_assert(fusedp::Shape<10, 1, 1>::is_flat);
  static_assert(fusedp::align_elements_count == fusedp::alignment_bytes / sizeof(float));
  static_assert(fusedp::align_elements(0) == 0);
  static_assert(fusedp::align_elements(1) == fusedp::align_elements_count);
  static_assert(fusedp::align_elements(fusedp::align_elements_count) == fusedp::align_elements_count);
  static_assert(fusedp::align_elements(fusedp::align_elements_count + 1) == 2 * fusedp::align_elements_count);
  static_assert(fusedp::window_out(28, 5, 1, 0) == 24);
  static_assert(fusedp::window_out(7, 3, 2, 1) == 4);
  static_assert(fusedp::window_out(9, 3, 2, 1) == 5);
  static_assert(fusedp::window_out(4, 5, 1, 0) == 0);
  static_assert(fusedp::window_out(4, 5, 1, 1) == 2);
  CHECK(S::channels == 3);
}
