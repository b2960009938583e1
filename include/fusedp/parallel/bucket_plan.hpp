#pragma once
// The compile-time bucket plan: the flat gradient buffer cut into contiguous buckets in reverse layer
// order (the order backward finishes them), each tagged with the stage after which it is complete;
// computed at compile time for a capacity given by the Bucket<bytes> policy, or at run time for one
// given at construction (ParallelOptions::bucket_bytes).
#include "fusedp/core/shape.hpp"
#include "fusedp/net/sequential.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>
#include <vector>

namespace fusedp::parallel {

/// One bucket: elements [begin, end) of the flat gradient buffer, complete once backward has finished
/// stage `ready_after` (backward runs the stages from last to first).
struct GradientBucket {
  std::size_t begin;
  std::size_t end;
  std::size_t ready_after;
};

namespace detail {
template <class Net>
constexpr std::size_t stage_first(std::size_t i) {
  std::size_t first = 0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((I == i ? (first = Net::template stage<I>::first, 0) : 0), ...);
  }(std::make_index_sequence<Net::stage_count>{});
  return first;
}
template <class Net>
constexpr std::size_t stage_of_layer(std::size_t layer) {
  std::size_t s = 0;
  for (std::size_t i = 0; i < Net::stage_count; ++i)
    if (stage_first<Net>(i) <= layer) s = i;
  return s;
}
/// The plan of Net's buckets of at most `bytes` (0: one bucket) of `element_bytes` each: the buckets in
/// the order backward completes them, and their count.
template <class Net>
constexpr auto plan_buckets(std::size_t bytes_cap, std::size_t element_bytes) {
  constexpr auto& layout = Net::param_layout;
  std::array<GradientBucket, layout.size() == 0 ? 1 : layout.size()> b{};
  std::size_t count = 0;
  if (layout.size() == 0) return std::pair{b, count};
  // Walk tensors from the last to the first; close a bucket when the next tensor would overflow it.
  std::size_t hi = layout.size();  // one past the highest tensor of the open bucket
  std::size_t bytes = 0;
  for (std::size_t k = layout.size(); k-- > 0;) {
    const std::size_t t_bytes = align_elements(layout[k].size) * element_bytes;
    if (bytes_cap != 0 && bytes > 0 && bytes + t_bytes > bytes_cap) {
      const std::size_t lo = k + 1;
      b[count++] = {layout[lo].offset, layout[hi - 1].offset + align_elements(layout[hi - 1].size),
                    stage_of_layer<Net>(layout[lo].layer)};
      hi = lo;
      bytes = 0;
    }
    bytes += t_bytes;
  }
  b[count++] = {layout[0].offset, layout[hi - 1].offset + align_elements(layout[hi - 1].size),
                stage_of_layer<Net>(layout[0].layer)};
  return std::pair{b, count};
}
}  // namespace detail

/// Buckets of at most `Bytes` (0: one bucket for the whole buffer) of elements of `ElementBytes`.
/// @tparam Net the Sequential
/// @tparam Bytes bucket capacity in bytes; a tensor larger than that is a bucket of its own
/// @tparam ElementBytes bytes of one gradient element (4 for float)
template <class Net, std::size_t Bytes, std::size_t ElementBytes = 4>
struct BucketPlan {
 private:
  static constexpr auto plan_ = detail::plan_buckets<Net>(Bytes, ElementBytes);

 public:
  static constexpr std::size_t count = plan_.second;
  /// Buckets in the order backward completes them (the last layers' first).
  static constexpr std::array<GradientBucket, count> buckets = [] {
    std::array<GradientBucket, count> r{};
    for (std::size_t i = 0; i < count; ++i) r[i] = plan_.first[i];
    return r;
  }();
};

/// The same plan at run time, for a capacity chosen at run time (ParallelOptions::bucket_bytes).
template <class Net>
std::vector<GradientBucket> bucket_plan(std::size_t bytes, std::size_t element_bytes = 4) {
  const auto p = detail::plan_buckets<Net>(bytes, element_bytes);
  return {p.first.begin(), p.first.begin() + std::ptrdiff_t(p.second)};
}

}  // namespace fusedp::parallel
