#pragma once
// Epoch order and batch assembly for in-memory datasets: a permutation drawn from (seed, epoch) with the
// counter-based RNG, and gathering the samples of one batch into contiguous buffers.
#include "fusedp/core/error.hpp"
#include "fusedp/core/rng.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace fusedp::data {

namespace detail {
// High 64 bits of a 64 x 64-bit product, from 32-bit halves (portable; no __int128).
constexpr std::uint64_t mul_high(std::uint64_t a, std::uint64_t b) {
  const std::uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const std::uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
  const std::uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
  return hi_hi + (hi_lo >> 32) + (cross >> 32);
}
}  // namespace detail

/// Writes the order of `order.size()` samples in `epoch` into `order`: a Fisher-Yates shuffle driven by
/// (seed, epoch), the same on every machine and every run. Allocates nothing.
inline void permutation_into(std::span<std::size_t> order, std::uint64_t seed, std::uint64_t epoch) {
  std::iota(order.begin(), order.end(), std::size_t(0));
  const std::uint64_t stream = rng::stream(rng::Purpose::sampler, epoch);
  for (std::size_t i = order.size(); i > 1; --i) {
    const rng::Block b = rng::bits(seed, stream, i);
    const std::uint64_t r = (std::uint64_t(b.v[0]) << 32) | b.v[1];
    // Multiply-shift maps 64 random bits onto [0, i); the bias is below i / 2^64.
    const auto j = std::size_t(detail::mul_high(r, i));
    std::swap(order[i - 1], order[j]);
  }
}

/// The order of `n` samples in `epoch` (see permutation_into).
[[nodiscard]] inline std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> order(n);
  permutation_into(order, seed, epoch);
  return order;
}

/// Copies the samples `indices` (each `sample_size` values) and their labels into `images` and
/// `labels`, which must hold exactly indices.size() samples.
template <class T>
void gather(std::span<const T> all_images, std::span<const std::int32_t> all_labels, std::size_t sample_size,
            std::span<const std::size_t> indices, std::span<T> images, std::span<std::int32_t> labels) {
  require(images.size() == indices.size() * sample_size && labels.size() == indices.size(),
          "gather: output buffers hold ", images.size(), " values and ", labels.size(), " labels for ",
          indices.size(), " samples of ", sample_size);
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const std::size_t s = indices[i];
    require(s < all_labels.size() && (s + 1) * sample_size <= all_images.size(), "gather: sample ", s,
            " is out of range (", all_labels.size(), " samples)");
    std::memcpy(images.data() + i * sample_size, all_images.data() + s * sample_size, sample_size * sizeof(T));
    labels[i] = all_labels[s];
  }
}

}  // namespace fusedp::data
