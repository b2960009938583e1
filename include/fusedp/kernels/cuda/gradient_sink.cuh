#pragma once
// Where an input-gradient GEMM (or the fused MLP's backward kernel, kernels/cuda/mlp.cuh) puts its
// values: the stage below a Conv2d, a Linear or a fused MLP needs, from the
// gradient dy of its output, the gradient dz before its epilogue (dy * Epi'), unpooled through the
// one-byte argmax when its max-pooling was fused into its forward. Without a sink that is a pass of
// its own over the whole gradient (conv2d.cuh's materialize_dz_kernel, or the on-the-fly expansion in
// linear.cuh's loaders); with one, the dx GEMM's epilogue writes dz directly and the stage below reads
// it as plain stored values (issue 17: one pass and one launch fewer per such boundary, and stored dz
// is what the tensor-core mainloop's copies can read).
//
// A sink is a small FUSEDP_HD functor: put(i, v) receives the GEMM's value v for flat element i of
// the lower stage's output gradient in that stage's layout (NCHW, or (batch, features)). Each sink
// computes exactly what the unfused pass computes from the same v (the same float operations), so the
// two paths give the same bits (tests/gpu/emulation.cu). Where the model stores its activation
// gradients in bf16 (`bf16`, net/activation_storage.hpp), a sink first rounds v to bf16, the value the
// unfused pass would have read stored, then forms dz from it in fp32 as that pass does. A dz that is
// then a bf16 value (received_dz_element: the epilogue's derivative is a mask) is stored in 16 bits,
// BFloat16, and the stage below's GEMMs read it so: the same values in half the bytes. The output of the
// stage below, which a sink reads for the derivative, is read as the element the plan stores it in (Y:
// float, or BFloat16 where CudaPlan::narrow_output).
//
//   StoreSink            dy itself (no fusion: what the stage below then reads as its dy)
//   ActivationSink<Epi>  dz = v * Epi'(z, y) at i (a Conv2d or Linear below with an activation)
//   UnpoolSink<Epi, Kp>  the K x K window of dz around pooled element i: v * Epi'(pooled) at the
//                        window's argmax, 0 at its other pixels and at the pixels no window covers
//                        (a Conv2d below whose MaxPool2d<Kp> was fused into its forward)
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/precision.hpp"
#include "fusedp/kernels/activation.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/fast_div.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp::kernels::cuda {

/// The element a sink stores dz in (kernels/activation.hpp, which g++ alone reads too).
using kernels::received_dz_element;

/// The value itself, stored at i as E: the input gradient as the layer below receives it unfused (in 16
/// bits where the model stores that gradient so: the bf16 value `bf16` rounds it to, exactly).
template <class E>
struct StoreSinkOf {
  E* out;
  bool bf16 = false;
  [[nodiscard]] FUSEDP_HD bool active() const { return out != nullptr; }
  FUSEDP_HD void put(std::size_t i, float v) const { store_element(out + i, stored_value(v, bf16)); }
};
using StoreSink = StoreSinkOf<float>;

/// dz = v * Epi'(z, y) at i: the gradient before the epilogue of the layer below (y its output, stored
/// as Y: float, or BFloat16 where the plan stores that output in 16 bits, CudaPlan::output_element; z
/// its pre-activation values where Epi saves them, fp32), as EpilogueGradient and ConvGradient compute
/// it, stored as E (received_dz_element).
template <class Epi, class E = float, class Y = float>
struct ActivationSink {
  E* dz;
  const Y* y;
  const float* z;
  bool bf16 = false;
  [[nodiscard]] FUSEDP_HD bool active() const { return dz != nullptr; }
  FUSEDP_HD void put(std::size_t i, float value) const {
    const float v = stored_value(value, bf16);
    if constexpr (Epi::empty) {
      store_element(dz + i, v);
    } else {
      const float yi = to_float(y[i]);
      if constexpr (Epi::saves_input) store_element(dz + i, v * Epi::derivative(z[i], yi));
      else store_element(dz + i, v * Epi::derivative(yi, yi));
    }
  }
};

/// The dense dz (batch, C, OH, OW) of a conv whose max-pooling (window and stride Kp) was fused, from
/// the gradient v of pooled element i = (plane, py, px): as PooledConvGradient reads it, v * Epi'(pooled)
/// at the window's argmax and 0 at its other pixels. The last window of a row (column) also zeroes
/// the pixels after it that no window covers (OW % Kp of them), so every element of dz is written once.
/// Stored as E (received_dz_element); the pooled values read as Y (float, or BFloat16 where the plan
/// stores them in 16 bits: CudaPlan::output_element).
template <class Epi, int Kp, class E = float, class Y = float>
struct UnpoolSink {
  E* dz = nullptr;
  const Y* pooled = nullptr;
  const std::uint8_t* argmax = nullptr;
  int oh = 0, ow = 0, ph = 0, pw = 0;  // the conv's output and the pooled planes
  FastDiv div_phw, div_pw;
  bool bf16 = false;

  UnpoolSink() = default;
  FUSEDP_HD UnpoolSink(E* dz_, const Y* pooled_, const std::uint8_t* argmax_, int oh_, int ow_,
                       bool bf16_ = false)
      : dz(dz_), pooled(pooled_), argmax(argmax_), oh(oh_), ow(ow_), ph(oh_ / Kp), pw(ow_ / Kp),
        div_phw((oh_ / Kp) * (ow_ / Kp)), div_pw(ow_ / Kp), bf16(bf16_) {}

  [[nodiscard]] FUSEDP_HD bool active() const { return dz != nullptr; }
  FUSEDP_HD void put(std::size_t i, float v) const {
    int plane = 0, r = 0, py = 0, px = 0;
    div_phw.divmod(int(i), plane, r);
    div_pw.divmod(r, py, px);
    float g = stored_value(v, bf16);
    if constexpr (!Epi::empty) {
      const float p = to_float(pooled[i]);
      g = g * Epi::derivative(p, p);
    }
    const int at = argmax[i];
    const int y0 = py * Kp, x0 = px * Kp;
    const int y1 = py + 1 == ph ? oh : y0 + Kp, x1 = px + 1 == pw ? ow : x0 + Kp;
    E* base = dz + std::size_t(plane) * oh * ow;
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) {
        const bool inside = y - y0 < Kp && x - x0 < Kp;
        store_element(base + std::size_t(y) * ow + x, inside && (y - y0) * Kp + (x - x0) == at ? g : 0.0f);
      }
  }
};

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
