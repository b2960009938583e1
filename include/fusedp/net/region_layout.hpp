#pragma once
// A Sequential's per-sample activation layout with some regions resized: the same regions in the same
// order (each stage's output, then what it saves for backward), those given a size of their own taking
// it, the others Net's. Two layouts are made so on Cuda: the model's workspace (net/cuda_plan.hpp:
// CudaWorkspace, where a fused conv + max-pool's conv region holds argmax bytes and a 16-bit output half
// its floats) and a residual block's inner networks (net/residual.hpp: InnerLayout, their 16-bit
// outputs; the block's own saved region in the model's workspace is then the sum of theirs).
#include "fusedp/core/shape.hpp"
#include "fusedp/net/sequential.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>

namespace fusedp::detail {

/// Net's stage_plan and activation_elements, with stage i's output region `out[i]` floats a sample and
/// its saved region `saved[i]` floats (each rounded up by align_elements) where those are not 0, else as
/// large as Net's. All zeros give Net's own layout.
template <class Net>
constexpr std::pair<std::array<StagePlan, Net::stage_count>, std::size_t> resized_layout(
    const std::array<std::size_t, Net::stage_count>& out, const std::array<std::size_t, Net::stage_count>& saved) {
  // Net places each stage's output, then its saved values, one after the other: a region runs to the
  // start of the next one.
  const auto region_end = [](std::size_t start) {
    std::size_t end = Net::activation_elements;
    for (const StagePlan& p : Net::stage_plan) {
      if (!p.aliases_input && p.out_offset > start) end = std::min(end, p.out_offset);
      if (p.saves_z && p.z_offset > start) end = std::min(end, p.z_offset);
    }
    return end;
  };
  std::array<StagePlan, Net::stage_count> r = Net::stage_plan;
  std::size_t offset = 0;
  for (std::size_t i = 0; i < Net::stage_count; ++i) {
    const StagePlan& p = Net::stage_plan[i];
    if (!p.aliases_input) {
      r[i].out_offset = offset;
      offset += out[i] != 0 ? align_elements(out[i]) : region_end(p.out_offset) - p.out_offset;
    }
    if (p.saves_z) {
      r[i].z_offset = offset;
      offset += saved[i] != 0 ? align_elements(saved[i]) : region_end(p.z_offset) - p.z_offset;
    }
  }
  return {r, offset};
}

}  // namespace fusedp::detail
