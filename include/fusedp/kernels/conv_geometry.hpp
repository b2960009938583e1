#pragma once
// The geometry of a 2-d convolution or pooling window over one sample (NCHW), shared by the Host and
// Cuda kernels and by the layers that describe them. Nothing here knows how a space computes it: the
// scratch a Host kernel lays out for a geometry is kernels/host/conv2d.hpp's ConvScratch.
#include "fusedp/core/config.hpp"

#include <cstddef>

namespace fusedp::kernels {

/// Input (channels, height, width), square kernel with stride and zero padding, and the output it
/// gives (channels, height, width).
struct ConvGeometry {
  int in_channels, in_h, in_w, kernel, stride, pad, out_channels, out_h, out_w;
  [[nodiscard]] constexpr std::size_t in_size() const { return std::size_t(in_channels) * in_h * in_w; }
  [[nodiscard]] constexpr std::size_t out_pixels() const { return std::size_t(out_h) * out_w; }
  [[nodiscard]] constexpr std::size_t out_size() const { return std::size_t(out_channels) * out_pixels(); }
  [[nodiscard]] constexpr std::size_t patch() const { return std::size_t(in_channels) * kernel * kernel; }
  // A 1x1 kernel with stride 1 and no padding reads the input as its own im2col matrix.
  [[nodiscard]] constexpr bool direct() const { return kernel == 1 && stride == 1 && pad == 0; }
};

}  // namespace fusedp::kernels
