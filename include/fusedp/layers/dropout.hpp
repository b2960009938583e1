#pragma once
// Dropout<P>: zeroes each element with probability P in training and scales the rest by 1/(1-P);
// the identity in evaluation. The mask is drawn from the counter-based RNG and recomputed in backward.
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/dropout.hpp"
#include "fusedp/kernels/host/pointwise.hpp"
#include "fusedp/layers/layer.hpp"

#include <array>
#include <bit>
#include <cstdint>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/pointwise.cuh"
#endif

namespace fusedp {

/// @tparam P probability of zeroing an element, in [0, 1)
template <float P = 0.5f>
struct Dropout {
  static_assert(P >= 0.0f && P < 1.0f, "Dropout<P>: P must be in [0, 1)");
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = false;
  static constexpr const char* name = "Dropout";
  static constexpr std::array<std::uint32_t, 1> attributes{std::bit_cast<std::uint32_t>(P)};
  template <class In>
  static constexpr bool accepts = true;
  template <class In>
  using expected = In;
  template <class In>
  using output = In;

  // Per layer and step; indexed by the element's place in the step's global batch (a.first_sample).
  template <class Space, class T>
  static kernels::DropoutMask mask(const StageArgs<Space, T>& a, std::size_t sample_size) {
    return {P, a.seed, rng::stream(rng::Purpose::dropout, (std::uint64_t(a.index) << 40) ^ a.step),
            std::uint64_t(a.first_sample) * sample_size};
  }
  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::dropout_forward(a.space, a.batch * In::size, mask(a, In::size), a.training, a.x, a.y);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    kernels::host::dropout_backward(a.space, a.batch * In::size, mask(a, In::size), a.dy, a.dx);
  }

#if FUSEDP_HAS_CUDA
  // The mask depends on the step number, which a launch takes as an argument: a CUDA graph recorded
  // once would replay the first step's mask, so models with Dropout launch their kernels directly.
  static constexpr bool cuda_graph_safe = false;
  template <class In, class Epi, class T, class Prec>
  static void forward(const StageArgs<CudaSpace<Prec>, T>& a) {
    kernels::cuda::dropout(a.space.stream(), a.batch * In::size, mask(a, In::size), a.training, a.x, a.y,
                           a.bf16_y);
  }
  template <class In, class Epi, class T, class Prec>
  static void backward(const StageArgs<CudaSpace<Prec>, T>& a) {
    kernels::cuda::dropout(a.space.stream(), a.batch * In::size, mask(a, In::size), true, a.dy, a.dx,
                           a.bf16_dx);
  }
#endif
};

}  // namespace fusedp
