#pragma once
// A 64-bit digest of where a network's stages lie and in which elements (a Layout for stage_args:
// Sequential, a Cuda workspace, a residual block's InnerLayout), and of what its layers decide inside
// (a residual block's inner layouts and fused add). CudaPlanFingerprint (net/cuda_plan.hpp) hashes a
// Cuda model's plan with it, so that the device code of a .cu file can be compared with its host code:
// nvcc's front end and the host compiler each evaluate these compile-time facts, and have disagreed
// (net/residual.hpp: adds_before_epilogue).
//
// A layer with a plan of its own says so with
//     template <class In, class Epi, class P, class X, class Y>
//     static constexpr std::uint64_t cuda_plan_fingerprint;
// (input shape In, epilogue Epi, precision P, its input stored as X and its output as Y).
#include "fusedp/net/sequential.hpp"
#include "fusedp/net/stage_binding.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace fusedp::detail {

/// Stage S's own plan digest under P with elements X, Y (0 for a layer without one).
template <class S, class P, class X, class Y>
constexpr std::uint64_t stage_plan_fingerprint() {
  if constexpr (requires {
                  S::layer::template cuda_plan_fingerprint<typename S::in, typename S::epilogue, P, X, Y>;
                })
    return S::layer::template cuda_plan_fingerprint<typename S::in, typename S::epilogue, P, X, Y>;
  else
    return 0;
}

/// Adds Layout's regions of Net (every StagePlan field and the total), each stage's input, output, add,
/// output-gradient and input-gradient element, and each stage's own plan (stage_plan_fingerprint) to `f`.
template <class Net, class Layout, class P>
constexpr void hash_layout(Fnv1a& f) {
  f.word(Net::stage_count);
  f.word(Layout::activation_elements);
  for (const StagePlan& p : Layout::stage_plan) {
    f.word(p.aliases_input);
    f.word(p.out_offset);
    f.word(p.saves_z);
    f.word(p.z_offset);
    f.word(p.weight);
    f.word(p.bias);
    f.word(p.state);
    f.word(p.has_state);
  }
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    const auto stage = [&]<std::size_t J>(std::integral_constant<std::size_t, J>) {
      using E = stage_elements<Layout, J>;
      f.word(sizeof(typename E::input));
      f.word(sizeof(typename E::output));
      f.word(sizeof(typename E::add));
      f.word(sizeof(typename E::dy));
      f.word(sizeof(typename E::dx));
      f.word(stage_plan_fingerprint<typename Net::template stage<J>, P, typename E::input, typename E::output>());
    };
    (stage(std::integral_constant<std::size_t, I>{}), ...);
  }(std::make_index_sequence<Net::stage_count>{});
}

}  // namespace fusedp::detail
