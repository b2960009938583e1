#pragma once
// Per-sample transforms of the DataLoader: random crop with zero padding and horizontal flip (as
// torchvision's RandomCrop(size, padding) and RandomHorizontalFlip on the raw image), then
// normalization (torchvision's Normalize). The random draws of a sample are a pure function of
// (seed, epoch, sample index) through the counter-based RNG, so they do not depend on which thread
// prepares the sample, on the batch it falls in, or on the rank.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fusedp::data {

/// Random augmentation of training images. Default: none.
struct Augment {
  std::size_t crop_padding = 0;  ///< pad each side with zeros, then crop the original size at a random offset
  bool flip = false;             ///< mirror left-right with probability 1/2

  [[nodiscard]] bool enabled() const noexcept { return crop_padding > 0 || flip; }
};

/// (x - mean[c]) / stddev[c] per channel c, applied after augmentation (so padding becomes
/// -mean/stddev, as in torchvision). One value applies to every channel; empty means none.
struct Normalization {
  std::vector<float> mean;
  std::vector<float> stddev;

  [[nodiscard]] bool enabled() const noexcept { return !mean.empty(); }
  /// Throws InvalidArgument unless both are empty, or both hold 1 or `channels` values, finite, stddev > 0.
  void validate(std::size_t channels) const {
    require(mean.size() == stddev.size(), "Normalization: ", mean.size(), " means but ", stddev.size(), " stddevs");
    require(mean.empty() || mean.size() == 1 || mean.size() == channels, "Normalization: ", mean.size(),
            " values for images of ", channels, " channels (give 1 or ", channels, ")");
    for (std::size_t c = 0; c < mean.size(); ++c) {
      require(std::isfinite(mean[c]), "Normalization: mean[", c, "] is not finite");
      require(std::isfinite(stddev[c]) && stddev[c] > 0, "Normalization: stddev[", c, "] must be finite and > 0, got ",
              stddev[c]);
    }
  }
};

/// The random choices for one sample: the crop's top-left corner in the padded image, and the flip.
struct AugmentDraw {
  std::size_t dy = 0, dx = 0;
  bool flip = false;
};

/// Draws sample `index`'s crop and flip for `epoch` under `seed`.
[[nodiscard]] inline AugmentDraw draw_augment(const Augment& a, std::uint64_t seed, std::uint64_t epoch,
                                              std::uint64_t index) {
  AugmentDraw d;
  if (!a.enabled()) return d;
  const rng::Block b = rng::bits(seed, rng::stream(rng::Purpose::data, epoch), index);
  const std::uint64_t offsets = 2 * std::uint64_t(a.crop_padding) + 1;  // [0, 2 * padding]
  // Multiply-shift maps 32 random bits onto [0, offsets); the bias is below offsets / 2^32.
  d.dy = std::size_t((std::uint64_t(b.v[0]) * offsets) >> 32);
  d.dx = std::size_t((std::uint64_t(b.v[1]) * offsets) >> 32);
  d.flip = a.flip && (b.v[2] >> 31) != 0;
  return d;
}

/// Writes the augmented, normalized sample `src` (C, H, W) into `dst` (C, H, W).
inline void transform_sample(const float* FUSEDP_RESTRICT src, float* FUSEDP_RESTRICT dst, std::size_t channels,
                             std::size_t height, std::size_t width, const Augment& a, const AugmentDraw& d,
                             const Normalization& n) {
  const std::size_t pad = a.crop_padding;
  for (std::size_t c = 0; c < channels; ++c) {
    const bool norm = n.enabled();
    const float mean = norm ? n.mean[n.mean.size() == 1 ? 0 : c] : 0.0f;
    const float stddev = norm ? n.stddev[n.stddev.size() == 1 ? 0 : c] : 1.0f;
    // Divide rather than multiply by 1/stddev: the same floats as torchvision's Normalize.
    auto value = [&](float x) { return norm ? (x - mean) / stddev : x; };
    const float zero = value(0.0f);
    const float* plane = src + c * height * width;
    float* out = dst + c * height * width;
    for (std::size_t y = 0; y < height; ++y) {
      float* row = out + y * width;
      // Output (y, x) comes from padded (y + dy, x' + dx) with x' = x or width - 1 - x; the original
      // image starts at (pad, pad) of the padded one.
      const std::ptrdiff_t sy = std::ptrdiff_t(y + d.dy) - std::ptrdiff_t(pad);
      if (sy < 0 || sy >= std::ptrdiff_t(height)) {
        for (std::size_t x = 0; x < width; ++x) row[x] = zero;
        continue;
      }
      const float* in = plane + std::size_t(sy) * width;
      for (std::size_t x = 0; x < width; ++x) {
        const std::size_t xc = d.flip ? width - 1 - x : x;
        const std::ptrdiff_t sx = std::ptrdiff_t(xc + d.dx) - std::ptrdiff_t(pad);
        row[x] = (sx < 0 || sx >= std::ptrdiff_t(width)) ? zero : value(in[sx]);
      }
    }
  }
}

}  // namespace fusedp::data
