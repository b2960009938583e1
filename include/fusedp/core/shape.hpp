#pragma once
// Compile-time shape of one sample: channels, height, width (the batch dimension is a run-time value).
#include "fusedp/core/config.hpp"

#include <cstddef>
#include <type_traits>

namespace fusedp {

/// Shape of one sample in NCHW order without the batch dimension. A flat vector is Shape<N, 1, 1>.
/// @tparam C channels (or features of a flat vector)
/// @tparam H height
/// @tparam W width
template <int C, int H, int W>
struct Shape {
  static_assert(C > 0 && H > 0 && W > 0, "Shape: every dimension must be positive");
  static constexpr int channels = C;
  static constexpr int height = H;
  static constexpr int width = W;
  static constexpr std::size_t size = std::size_t(C) * H * W;
  static constexpr bool is_flat = H == 1 && W == 1;
};

template <class S>
struct is_shape : std::false_type {};
template <int C, int H, int W>
struct is_shape<Shape<C, H, W>> : std::true_type {};

/// A type that is some Shape<C, H, W>.
template <class S>
concept ShapeType = is_shape<S>::value;

/// Output extent of a window of size `k`, stride `s`, padding `p` over an extent `n` (floor mode, as
/// PyTorch). Returns 0 when the window does not fit.
constexpr int window_out(int n, int k, int s, int p) {
  return n + 2 * p < k ? 0 : (n + 2 * p - k) / s + 1;
}

/// Elements every region of a flat buffer is rounded to: alignment_bytes of float (and twice that
/// of double), so offsets are the same whatever the scalar type.
inline constexpr std::size_t align_elements_count = alignment_bytes / sizeof(float);

/// Rounds `n` elements up to a multiple of align_elements_count.
constexpr std::size_t align_elements(std::size_t n) {
  return (n + align_elements_count - 1) / align_elements_count * align_elements_count;
}

}  // namespace fusedp
