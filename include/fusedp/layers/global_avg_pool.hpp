#pragma once
// GlobalAvgPool2d: the mean over each channel's plane, (C, H, W) -> (C, 1, 1), as PyTorch's
// nn.AdaptiveAvgPool2d(1) (ResNet's last pooling).
#include "fusedp/core/shape.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/global_pool.hpp"
#include "fusedp/layers/layer.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/global_pool.cuh"
#endif

namespace fusedp {

struct GlobalAvgPool2d {
  static constexpr LayerKind kind = LayerKind::anchor;
  static constexpr bool absorbs_epilogue = true;
  static constexpr const char* name = "GlobalAvgPool2d";

  template <class In>
  static constexpr bool accepts = true;
  template <class In>
  using expected = In;
  template <class In>
  using output = Shape<In::channels, 1, 1>;

  template <class In, class Epi, class T>
  static void forward(const StageArgs<Host, T>& a) {
    kernels::host::global_avg_pool_forward<Epi>(a.space, a.batch * In::channels, std::size_t(In::height * In::width),
                                                a.x, a.y, a.z);
  }
  template <class In, class Epi, class T>
  static void backward(const StageArgs<Host, T>& a) {
    if (a.dx == nullptr) return;  // first layer: no parameters, nothing to compute
    kernels::host::global_avg_pool_backward<Epi>(a.space, a.batch * In::channels,
                                                 std::size_t(In::height * In::width), a.y, a.z, a.dy, a.dx);
  }

#if FUSEDP_HAS_CUDA
  template <class In, class Epi, class T, class P>
  static void forward(const StageArgs<CudaSpace<P>, T>& a) {
    kernels::cuda::global_avg_pool_forward<Epi>(a.space.stream(), a.batch * In::channels, In::height * In::width, a.x,
                                                a.y, a.z, a.bf16_y);
  }
  template <class In, class Epi, class T, class P>
  static void backward(const StageArgs<CudaSpace<P>, T>& a) {
    if (a.dx == nullptr) return;
    kernels::cuda::global_avg_pool_backward<Epi>(a.space.stream(), a.batch * In::channels, In::height * In::width,
                                                 a.y, a.z, a.dy, a.dx, a.bf16_dx);
  }
#endif
};

}  // namespace fusedp
