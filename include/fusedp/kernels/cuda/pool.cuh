#pragma once
// Pooling on Cuda when it is not fused into the conv before it (average pooling, overlapping windows,
// windows that do not tile a GEMM block, pooling after a non-conv stage): one thread per output in
// forward; in backward one thread per input pixel that gathers from every window containing it (no
// atomics, so the result is deterministic), finding each window's maximum again as Host does.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/conv_geometry.hpp"
#include "fusedp/kernels/pool_op.hpp"

#include <cstddef>

namespace fusedp::kernels::cuda {

namespace detail {
// The pooled value of the window at (oy, ox) of one plane and, for max, the index of the first
// maximum in scan order (NaN wins), exactly as kernels::host::detail::pool_window.
template <PoolOp Op, int K, int S>
__device__ FUSEDP_ALWAYS_INLINE float pool_window(const float* plane, int in_w, int oy, int ox, int& arg) {
  const float* w0 = plane + (oy * S) * in_w + ox * S;
  if constexpr (Op == PoolOp::max) {
    float best = w0[0];
    int at = 0;
    for (int ky = 0; ky < K; ++ky)
      for (int kx = 0; kx < K; ++kx) {
        const float v = w0[ky * in_w + kx];
        if (v > best || v != v) {
          best = v;
          at = ky * in_w + kx;
        }
      }
    arg = (oy * S) * in_w + ox * S + at;
    return best;
  } else {
    float s = 0.0f;
    for (int ky = 0; ky < K; ++ky)
      for (int kx = 0; kx < K; ++kx) s += w0[ky * in_w + kx];
    arg = 0;
    return s * (1.0f / float(K * K));
  }
}

// Plain extents (ConvGeometry's member functions are host-only constexpr).
struct PoolExtents {
  int in_h, in_w, out_h, out_w;
};

template <PoolOp Op, int K, int S, class Epi>
__global__ void pool_forward_kernel(PoolExtents g, std::size_t outputs, const float* x, float* y, float* z,
                                    bool bf16) {
  kernel_prologue();
  const std::size_t out_plane = std::size_t(g.out_h) * g.out_w, in_plane = std::size_t(g.in_h) * g.in_w;
  for (std::size_t i = grid_index(); i < outputs; i += grid_stride()) {
    const std::size_t plane = i / out_plane;
    const int o = int(i - plane * out_plane), oy = o / g.out_w, ox = o - oy * g.out_w;
    int arg = 0;
    const float v = pool_window<Op, K, S>(x + plane * in_plane, g.in_w, oy, ox, arg);
    if constexpr (Epi::saves_input) z[i] = v;
    y[i] = stored_value(Epi::apply(v), bf16);
  }
}

template <PoolOp Op, int K, int S, class Epi>
__global__ void pool_backward_kernel(PoolExtents g, std::size_t inputs, const float* x, const float* y,
                                     const float* z, const float* dy, float* dx, bool bf16) {
  kernel_prologue();
  const std::size_t out_plane = std::size_t(g.out_h) * g.out_w, in_plane = std::size_t(g.in_h) * g.in_w;
  for (std::size_t i = grid_index(); i < inputs; i += grid_stride()) {
    const std::size_t plane = i / in_plane;
    const int p = int(i - plane * in_plane), iy = p / g.in_w, ix = p - iy * g.in_w;
    const float* xp = x + plane * in_plane;
    const std::size_t out0 = plane * out_plane;
    // The windows (oy, ox) with oy*S <= iy < oy*S + K, likewise for x.
    const int oy0 = iy >= K ? (iy - K) / S + 1 : 0, oy1 = min(iy / S, g.out_h - 1);
    const int ox0 = ix >= K ? (ix - K) / S + 1 : 0, ox1 = min(ix / S, g.out_w - 1);
    float sum = 0.0f;
    for (int oy = oy0; oy <= oy1; ++oy)
      for (int ox = ox0; ox <= ox1; ++ox) {
        const std::size_t o = out0 + std::size_t(oy) * g.out_w + ox;
        float d = dy[o];
        if constexpr (Epi::saves_input) d *= Epi::derivative(z[o], y[o]);
        else if constexpr (!Epi::empty) d *= Epi::derivative(y[o], y[o]);
        if constexpr (Op == PoolOp::max) {
          int arg = 0;
          (void)pool_window<Op, K, S>(xp, g.in_w, oy, ox, arg);
          if (arg == p) sum += d;
        } else {
          sum += d * (1.0f / float(K * K));
        }
      }
    dx[i] = stored_value(sum, bf16);
  }
}
}  // namespace detail

/// y = Epi(pool(x)) over K x K windows with stride S (NCHW, floor mode); z = pool(x) when Epi saves it.
/// `bf16`: y stored as bf16 values.
template <PoolOp Op, int K, int S, class Epi>
void pool_forward(cudaStream_t stream, const ConvGeometry& g, std::size_t batch, const float* x, float* y,
                  float* z, bool bf16 = false) {
  const std::size_t n = batch * g.out_size();
  if (n == 0) return;
  const detail::PoolExtents e{g.in_h, g.in_w, g.out_h, g.out_w};
  launch<detail::pool_forward_kernel<Op, K, S, Epi>>("pool_forward_kernel", elementwise_blocks(n), elementwise_threads,
                                                     0, stream, e, n, x, y, z, bf16);
}

/// dx = pool^T(dy * Epi'); dy is not changed. `bf16`: dx stored as bf16 values.
template <PoolOp Op, int K, int S, class Epi>
void pool_backward(cudaStream_t stream, const ConvGeometry& g, std::size_t batch, const float* x, const float* y,
                   const float* z, const float* dy, float* dx, bool bf16 = false) {
  const std::size_t n = batch * g.in_size();
  if (n == 0) return;
  const detail::PoolExtents e{g.in_h, g.in_w, g.out_h, g.out_w};
  launch<detail::pool_backward_kernel<Op, K, S, Epi>>("pool_backward_kernel", elementwise_blocks(n),
                                                      elementwise_threads, 0, stream, e, n, x, y, z, dy, dx, bf16);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
