#pragma once
// Conv2d on Cuda as implicit GEMMs over NCHW activations and OIHW weights (PyTorch's layouts, kept so
// weights and activations move between the spaces and PyTorch unchanged):
//   forward   C (batch*OH*OW, O) = im2col(x) (rows: output pixels, k: C*K*K) W^T,  + bias, activation
//   dx        C (batch*H*W, C)   = dz gathered per input pixel (k: O*K*K) W,        stored to dx
//   dW, db    C (O, C*K*K)       = dz (k: batch*OH*OW) im2col(x),  row sums = db,   split over k
// No im2col matrix is ever written: the loaders compute each element's source address (with FastDiv).
// With a following MaxPool2d<K> (stride K) the forward GEMM enumerates output pixels window by window,
// so a block tile holds whole windows and the epilogue writes only the pooled value and the index of
// the maximum inside its window (one byte). Backward first writes dz densely from those (one coalesced
// pass), then both GEMMs read it as plain values; where the stage above is a Conv2d or Linear, its
// input-gradient GEMM writes that dense dz itself through a sink (gradient_sink.cuh) and this pass
// does not run (conv2d_backward_to with a StoredGradient).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/kernels/batch_norm.hpp"
#include "fusedp/kernels/cuda/fast_div.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/cuda/gemm_dispatch.cuh"
#include "fusedp/kernels/cuda/launch.cuh"
#include "fusedp/kernels/cuda/gradient_sink.cuh"
#include "fusedp/kernels/conv_geometry.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp::kernels::cuda {

/// A convolution's geometry with its divisors prepared for the loaders.
struct ConvShape {
  int c, h, w, k, stride, pad, o, oh, ow;
  int hw, ohw, kk, patch;
  FastDiv div_w, div_hw, div_ow, div_ohw, div_k, div_kk, div_stride;

  ConvShape() = default;
  FUSEDP_HD explicit ConvShape(const ConvGeometry& g)
      : c(g.in_channels), h(g.in_h), w(g.in_w), k(g.kernel), stride(g.stride), pad(g.pad), o(g.out_channels),
        oh(g.out_h), ow(g.out_w), hw(g.in_h * g.in_w), ohw(g.out_h * g.out_w), kk(g.kernel * g.kernel),
        patch(g.in_channels * g.kernel * g.kernel), div_w(g.in_w), div_hw(g.in_h * g.in_w), div_ow(g.out_w),
        div_ohw(g.out_h * g.out_w), div_k(g.kernel), div_kk(g.kernel * g.kernel), div_stride(g.stride) {}

  /// &x[img, ch, oy*s - p + ky, ox*s - p + kx] for patch index q = (ch, ky, kx); null in the padding.
  /// E: the stored element (float, or BFloat16 in a 16-bit workspace).
  template <class E>
  FUSEDP_HD const E* gather_address(const E* x, int img, int oy, int ox, int q) const {
    return gather_address(window(x, img, oy, ox), q);
  }
  /// A window of im2col's row: the image's first channel plane and the input position of the window's
  /// top-left tap, so that a gather needs only the patch index's division (a row cursor).
  template <class E>
  struct Window {
    const E* plane;
    int iy0, ix0;
  };
  template <class E>
  FUSEDP_HD Window<E> window(const E* x, int img, int oy, int ox) const {
    return {x + std::size_t(img) * c * hw, oy * stride - pad, ox * stride - pad};
  }
  /// gather_address through a window: &x[img, ch, iy0 + ky, ix0 + kx], null in the padding.
  template <class E>
  FUSEDP_HD const E* gather_address(const Window<E>& win, int q) const {
    int ch = 0, r = 0, ky = 0, kx = 0;
    div_kk.divmod(q, ch, r);
    div_k.divmod(r, ky, kx);
    const int iy = win.iy0 + ky, ix = win.ix0 + kx;
    if (iy < 0 || iy >= h || ix < 0 || ix >= w) return nullptr;
    return win.plane + std::size_t(ch) * hw + std::size_t(iy) * w + ix;
  }
  /// The value gather_address points at; 0 in the padding.
  template <class E>
  FUSEDP_HD float gather(const E* x, int img, int oy, int ox, int q) const {
    const E* a = gather_address(x, img, oy, ox, q);
    return a != nullptr ? to_float(*a) : 0.0f;
  }
};

/// dz of an unfused conv stage: dy * Epi'(z, y) at (img, channel, oy, ox).
template <class Epi>
struct ConvGradient {
  static constexpr bool epilogue_is_identity = Epi::empty;
  const float* dy;
  const float* y;
  const float* z;
  int o, ohw, ow;
  FUSEDP_HD float operator()(int img, int ch, int oy, int ox) const {
    const std::size_t i = (std::size_t(img) * o + ch) * ohw + std::size_t(oy) * ow + ox;
    if constexpr (Epi::empty) return dy[i];
    else if constexpr (Epi::saves_input) return dy[i] * Epi::derivative(z[i], y[i]);
    else return dy[i] * Epi::derivative(y[i], y[i]);
  }
};

/// dz of a conv stage whose max-pooling was fused in: nonzero only at the maximum of each window, where
/// it is dpool * Epi'(pooled value) (Epi reads only its output there, which is the pooled value). With
/// `bf16`, dpool is first rounded as the pooling's stored input gradient would be (it is already a bf16
/// value unless the pooling is the network's output and dpool the logits' gradient).
template <class Epi, int Kp>
struct PooledConvGradient {
  const float* dpool;
  const float* pooled;
  const std::uint8_t* argmax;
  int o, ph, pw;
  bool bf16 = false;
  FUSEDP_HD float operator()(int img, int ch, int oy, int ox) const {
    const int py = oy / Kp, px = ox / Kp;
    if (py >= ph || px >= pw) return 0.0f;
    const std::size_t j = (std::size_t(img) * o + ch) * (std::size_t(ph) * pw) + std::size_t(py) * pw + px;
    if (argmax[j] != (oy - py * Kp) * Kp + (ox - px * Kp)) return 0.0f;
    const float d = stored_value(dpool[j], bf16);
    if constexpr (Epi::empty) return d;
    else return d * Epi::derivative(pooled[j], pooled[j]);
  }
};

/// dz stored densely as (batch, O, OH, OW) elements E (float, or BFloat16 in a 16-bit workspace): what
/// the backward GEMMs read once materialize_dz has run.
template <class E>
struct StoredGradientOf {
  using element = E;
  const E* dz;
  int o, ohw, ow;
  FUSEDP_HD const E* address(int img, int ch, int oy, int ox) const {
    return dz + (std::size_t(img) * o + ch) * ohw + std::size_t(oy) * ow + ox;
  }
  FUSEDP_HD float operator()(int img, int ch, int oy, int ox) const { return to_float(*address(img, ch, oy, ox)); }
};
using StoredGradient = StoredGradientOf<float>;

/// A dz source the tensor-core mainloop can copy from: one stored in memory.
template <class Dz>
concept AddressableGradient = requires(const Dz& d) {
  typename Dz::element;
  { d.address(0, 0, 0, 0) } -> std::same_as<const typename Dz::element*>;
  { d.dz } -> std::convertible_to<const typename Dz::element*>;
  { d.o } -> std::convertible_to<int>;
  { d.ohw } -> std::convertible_to<int>;
};

/// Whether Dz is a dz stored densely (of either element): the GEMMs read it in place.
template <class Dz>
inline constexpr bool is_stored_gradient = false;
template <class E>
inline constexpr bool is_stored_gradient<StoredGradientOf<E>> = true;

/// Whether conv2d_backward_to writes Dz densely into the front of its scratch before the GEMMs (a dz with
/// an activation's derivative or an unpooling in it), rather than reading it in place (a stored dz, or dy
/// itself where the epilogue is empty).
template <class Dz>
constexpr bool forms_dense_dz() {
  if constexpr (is_stored_gradient<Dz>) return false;
  else if constexpr (requires { Dz::epilogue_is_identity; }) return !Dz::epilogue_is_identity;
  else return true;
}

namespace detail {
// The element a dz operand copies: its stored element where it has one (float where it is computed
// on the fly, which the tensor-core mainloop does not copy).
template <class Dz>
struct gradient_element {
  using type = float;
};
template <AddressableGradient Dz>
struct gradient_element<Dz> {
  using type = typename Dz::element;
};
}  // namespace detail

/// out[(img, ch, oy, ox)] = dz(img, ch, oy, ox) over the whole (batch, O, OH, OW) gradient, coalesced.
template <class Dz>
__global__ void materialize_dz_kernel(const Dz dz, int n, FastDiv div_ohw, FastDiv div_ow, FastDiv div_o, float* out) {
  kernel_prologue();
  // The index in size_t: n may lie within a grid's stride of 2^31.
  for (std::size_t j = grid_index(); j < std::size_t(n); j += grid_stride()) {
    const int i = int(j);
    int t = 0, pix = 0, img = 0, ch = 0, oy = 0, ox = 0;
    div_ohw.divmod(i, t, pix);
    div_o.divmod(t, img, ch);
    div_ow.divmod(pix, oy, ox);
    out[i] = dz(img, ch, oy, ox);
  }
}

/// Forward A operand: im2col(x) of stored elements E, rows = output pixels (img, oy, ox), k = patch
/// index. `source` (the tensor-core mainloop's one-element gathers) is the element's address, null in
/// the padding.
template <class E>
struct Im2colRowsOf {
  using element = E;
  const E* x;
  ConvShape s;
  static constexpr bool k_fastest = false;
  static constexpr int copy_floats = 1;
  /// Row cursor: output pixel m's window, computed once per row (gemm_mma.cuh hoists it per thread).
  FUSEDP_HD ConvShape::Window<E> row_cursor(int m) const {
    int img = 0, pix = 0, oy = 0, ox = 0;
    s.div_ohw.divmod(m, img, pix);
    s.div_ow.divmod(pix, oy, ox);
    return s.window(x, img, oy, ox);
  }
  FUSEDP_HD const E* source(const ConvShape::Window<E>& win, int q) const { return s.gather_address(win, q); }
  FUSEDP_HD const E* source(int m, int q) const { return source(row_cursor(m), q); }
  FUSEDP_HD const E* base() const { return x; }
  FUSEDP_HD float at(int m, int q) const {
    const E* a = source(m, q);
    return a != nullptr ? to_float(*a) : 0.0f;
  }
};
using Im2colRows = Im2colRowsOf<float>;

/// Forward A operand when max-pooling of window Kp is fused: rows enumerate the pooling windows and,
/// inside each, the Kp x Kp output pixels in scan order; pixels outside every window are skipped.
template <int Kp, class E = float>
struct PooledIm2colRows {
  using element = E;
  const E* x;
  ConvShape s;
  int ph, pw;
  FastDiv div_pw, div_phw;
  static constexpr bool k_fastest = false;
  static constexpr int copy_floats = 1;
  FUSEDP_HD ConvShape::Window<E> row_cursor(int m) const {
    const int win = m / (Kp * Kp), e = m % (Kp * Kp);
    int img = 0, wp = 0, py = 0, px = 0;
    div_phw.divmod(win, img, wp);
    div_pw.divmod(wp, py, px);
    return s.window(x, img, py * Kp + e / Kp, px * Kp + e % Kp);
  }
  FUSEDP_HD const E* source(const ConvShape::Window<E>& win, int q) const { return s.gather_address(win, q); }
  FUSEDP_HD const E* source(int m, int q) const { return source(row_cursor(m), q); }
  FUSEDP_HD const E* base() const { return x; }
  FUSEDP_HD float at(int m, int q) const {
    const E* a = source(m, q);
    return a != nullptr ? to_float(*a) : 0.0f;
  }
};

/// Epilogue of an unfused conv forward: y[img, o, pixel] = Epi(C + b), z likewise before Epi.
/// Evaluation with a BatchNorm folded in (fold.mean set): y = Epi(normalize(C + b) + add), each value
/// normalized as batch_norm_eval_kernel would (the same operations, so the same bits), `add` (a residual
/// block's shortcut, null when none) in y's layout, nothing saved. `bf16`: y stored as bf16 values, in
/// elements Y (float, or BFloat16 where the plan stores this output in 16 bits); z is fp32; `add` of
/// elements A (likewise).
template <class Epi, class Y = float, class A = float>
struct ConvBiasActivation {
  Y* y;
  float* z;
  const float* bias;
  int m, n, ohw;
  FastDiv div_ohw;
  BatchNormFold<float> fold{};  // mean null: no BatchNorm folded in
  const A* add = nullptr;
  bool bf16 = false;
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int /*split*/, int tid) const {
    for_each_in_tile<TileT, true>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      int img = 0, pix = 0;
      div_ohw.divmod(gm, img, pix);
      const std::size_t i = (std::size_t(img) * n + gn) * ohw + pix;
      const float v = c[lm * ldc + ln] + (bias ? bias[gn] : 0.0f);  // no bias: Conv2d<..., no_bias>
      if (fold.mean != nullptr) {
        const float u = fold.channel(std::size_t(gn)).normalize(v);
        store_element(y + i, stored_value(Epi::apply(add ? u + to_float(add[i]) : u), bf16));
        return;
      }
      if constexpr (Epi::saves_input) z[i] = v;
      store_element(y + i, stored_value(Epi::apply(v), bf16));
    });
  }
};

/// Epilogue of a conv forward with max-pooling fused: for each window in the tile and each channel,
/// the maximum of Epi(C + b) over the window (the first maximum in scan order; NaN wins, as on Host and
/// in PyTorch) to pooled[img, o, py, px] and its position in the window to argmax. With `bf16` the values
/// are compared as stored, rounded to bf16: the winner of a separate pooling over the stored conv output.
/// Y: pooled's element (float, or BFloat16 where the plan stores it in 16 bits).
template <class Epi, int Kp, class Y = float>
struct ConvBiasActivationMaxPool {
  Y* pooled;
  std::uint8_t* argmax;
  const float* bias;
  int windows, n, phw;  // windows: batch * ph * pw
  FastDiv div_phw;
  bool bf16 = false;
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int /*split*/, int tid) const {
    constexpr int kk = Kp * Kp, wins = TileT::bm / kk;
    static_assert(TileT::bm % kk == 0, "fused max-pooling needs whole windows in a block tile");
    const int w0 = m0 / kk;
    for (int idx = tid; idx < wins * TileT::bn; idx += TileT::threads) {
      const int lw = idx % wins, ln = idx / wins;
      const int gw = w0 + lw, gn = n0 + ln;
      if (gw >= windows || gn >= n) continue;
      const float b = bias ? bias[gn] : 0.0f;
      float best = stored_value(Epi::apply(c[(lw * kk) * ldc + ln] + b), bf16);
      int at = 0;
      for (int e = 0; e < kk; ++e) {
        const float v = stored_value(Epi::apply(c[(lw * kk + e) * ldc + ln] + b), bf16);
        if (v > best || v != v) {
          best = v;
          at = e;
        }
      }
      int img = 0, wp = 0;
      div_phw.divmod(gw, img, wp);
      const std::size_t j = (std::size_t(img) * n + gn) * phw + wp;
      store_element(pooled + j, best);
      argmax[j] = std::uint8_t(at);
    }
  }
};

/// dx A operand: rows = input pixels (img, iy, ix), k = (o, ky, kx); the dz element that weight tap
/// (ky, kx) carries from output (oy, ox) to this pixel, or 0 where no output pixel reads it.
template <class Dz>
struct ConvGradientGather {
  using element = typename detail::gradient_element<Dz>::type;
  Dz dz;
  ConvShape s;
  static constexpr bool k_fastest = false;
  static constexpr int copy_floats = 1;
  /// Row cursor: input pixel m as (image, iy + pad, ix + pad).
  struct Pixel {
    int img, py, px;
  };
  FUSEDP_HD Pixel row_cursor(int m) const {
    int img = 0, pix = 0, iy = 0, ix = 0;
    s.div_hw.divmod(m, img, pix);
    s.div_w.divmod(pix, iy, ix);
    return {img, iy + s.pad, ix + s.pad};
  }
  /// The output pixel (img, ch, oy, ox) whose dz element (pixel, q) is, or false where none is.
  FUSEDP_HD bool locate(const Pixel& at_pixel, int q, int& img, int& ch, int& oy, int& ox) const {
    int r = 0, ky = 0, kx = 0;
    img = at_pixel.img;
    s.div_kk.divmod(q, ch, r);
    s.div_k.divmod(r, ky, kx);
    const int ty = at_pixel.py - ky, tx = at_pixel.px - kx;
    if (ty < 0 || tx < 0) return false;
    int ry = 0, rx = 0;
    s.div_stride.divmod(ty, oy, ry);
    s.div_stride.divmod(tx, ox, rx);
    return ry == 0 && rx == 0 && oy < s.oh && ox < s.ow;
  }
  FUSEDP_HD float at(int m, int q) const {
    int img = 0, ch = 0, oy = 0, ox = 0;
    return locate(row_cursor(m), q, img, ch, oy, ox) ? dz(img, ch, oy, ox) : 0.0f;
  }
  FUSEDP_HD const element* source(const Pixel& at_pixel, int q) const
    requires AddressableGradient<Dz>
  {
    int img = 0, ch = 0, oy = 0, ox = 0;
    return locate(at_pixel, q, img, ch, oy, ox) ? dz.address(img, ch, oy, ox) : nullptr;
  }
  FUSEDP_HD const element* source(int m, int q) const
    requires AddressableGradient<Dz>
  {
    return source(row_cursor(m), q);
  }
  FUSEDP_HD const element* base() const
    requires AddressableGradient<Dz>
  {
    return dz.dz;
  }
};

/// dx B operand: at(ch, (o, ky, kx)) = W[o, ch, ky, kx].
struct ConvWeightsByInput {
  using element = float;
  const float* w;
  ConvShape s;
  static constexpr bool k_fastest = true;
  static constexpr int copy_floats = 1;
  /// k cursor: q = (o, ky, kx) as the offset of W[o, 0, ky, kx]; each input channel adds kk.
  struct Tap {
    std::size_t offset;
  };
  FUSEDP_HD Tap k_cursor(int q) const {
    int oc = 0, r = 0;
    s.div_kk.divmod(q, oc, r);
    return {std::size_t(oc) * s.c * s.kk + r};
  }
  FUSEDP_HD const float* source(int ch, const Tap& t) const { return w + t.offset + std::size_t(ch) * s.kk; }
  FUSEDP_HD const float* source(int ch, int q) const { return source(ch, k_cursor(q)); }
  FUSEDP_HD const float* base() const { return w; }
  FUSEDP_HD float at(int ch, int q) const { return *source(ch, q); }
};

/// dW A operand: at(o, (img, oy, ox)) = dz.
template <class Dz>
struct ConvGradientRows {
  using element = typename detail::gradient_element<Dz>::type;
  Dz dz;
  ConvShape s;
  static constexpr bool k_fastest = true;
  static constexpr int copy_floats = 1;
  FUSEDP_HD float at(int oc, int kidx) const {
    int img = 0, pix = 0, oy = 0, ox = 0;
    s.div_ohw.divmod(kidx, img, pix);
    s.div_ow.divmod(pix, oy, ox);
    return dz(img, oc, oy, ox);
  }
  /// k cursor: output pixel kidx = (img, pix) as the offset of dz[img, 0, pix] in the stored dz's own
  /// layout (its o and ohw, which the conv's shape also divides by); each channel adds ohw.
  struct Pixel {
    std::size_t offset;
  };
  FUSEDP_HD Pixel k_cursor(int kidx) const
    requires AddressableGradient<Dz>
  {
    int img = 0, pix = 0;
    s.div_ohw.divmod(kidx, img, pix);
    return {std::size_t(img) * dz.o * dz.ohw + pix};
  }
  FUSEDP_HD const element* source(int oc, const Pixel& at_pixel) const
    requires AddressableGradient<Dz>
  {
    return dz.dz + at_pixel.offset + std::size_t(oc) * dz.ohw;
  }
  FUSEDP_HD const element* source(int oc, int kidx) const
    requires AddressableGradient<Dz>
  {
    return source(oc, k_cursor(kidx));
  }
  FUSEDP_HD const element* base() const
    requires AddressableGradient<Dz>
  {
    return dz.dz;
  }
};

/// dW B operand: at(patch index, (img, oy, ox)) = im2col(x) of stored elements E.
template <class E>
struct Im2colColumnsOf {
  using element = E;
  const E* x;
  ConvShape s;
  static constexpr bool k_fastest = true;
  static constexpr int copy_floats = 1;
  /// k cursor: output pixel kidx's window.
  FUSEDP_HD ConvShape::Window<E> k_cursor(int kidx) const {
    int img = 0, pix = 0, oy = 0, ox = 0;
    s.div_ohw.divmod(kidx, img, pix);
    s.div_ow.divmod(pix, oy, ox);
    return s.window(x, img, oy, ox);
  }
  FUSEDP_HD const E* source(int q, const ConvShape::Window<E>& win) const { return s.gather_address(win, q); }
  FUSEDP_HD const E* source(int q, int kidx) const { return source(q, k_cursor(kidx)); }
  FUSEDP_HD const E* base() const { return x; }
  FUSEDP_HD float at(int q, int kidx) const {
    const E* a = source(q, kidx);
    return a != nullptr ? to_float(*a) : 0.0f;
  }
};
using Im2colColumns = Im2colColumnsOf<float>;

/// Epilogue of dx: the sink receives C at dx's flat index (img, ch, pixel); StoreSink stores it there.
template <class Sink = StoreSink>
struct ConvInputStore {
  Sink sink;
  int m, n, hw;
  FastDiv div_hw;
  template <class TileT>
  FUSEDP_HD void apply(const float* c, int ldc, int m0, int n0, int /*split*/, int tid) const {
    for_each_in_tile<TileT, true>(tid, m0, n0, m, n, [&](int lm, int ln, int gm, int gn) {
      int img = 0, pix = 0;
      div_hw.divmod(gm, img, pix);
      sink.put((std::size_t(img) * n + gn) * hw + pix, c[lm * ldc + ln]);
    });
  }
};

/// Checks that the flat indices of this convolution fit the 31 bits the loaders use.
inline void check_conv_extent(const ConvGeometry& g, std::size_t batch) {
  const std::size_t in = batch * g.in_size(), out = batch * g.out_size();
  require(in < (std::size_t(1) << 31) && out < (std::size_t(1) << 31) && g.patch() * g.out_channels < (std::size_t(1) << 31),
          "Conv2d on Cuda: a batch of ", batch, " needs indices beyond 2^31 (", in, " input and ", out,
          " output values); use smaller batches");
}

/// The implicit GEMM of a Conv2d forward: rows are output pixels, columns output channels.
/// With `fold` (evaluation), the BatchNorm after the conv and `add` run in its epilogue. E, Y, A: x's,
/// y's and add's stored elements.
template <class Epi, class E, class Y, class A = float>
GemmProblem<Im2colRowsOf<E>, Rows, ConvBiasActivation<Epi, Y, A>> conv2d_forward_problem(
    const ConvShape& s, int batch, const float* w, const float* b, const E* x, Y* y, float* z,
    const BatchNormFold<float>* fold = nullptr, const std::type_identity_t<A>* add = nullptr, bool bf16 = false) {
  const int m = batch * s.ohw;
  ConvBiasActivation<Epi, Y, A> epi{y, z, b, m, s.o, s.ohw, s.div_ohw};
  epi.bf16 = bf16;
  if (fold != nullptr) {
    epi.fold = *fold;
    epi.add = add;
  }
  return {m, s.o, s.patch, s.patch, Im2colRowsOf<E>{x, s}, Rows{w, s.patch}, epi, nullptr};
}

/// The implicit GEMM of a Conv2d forward with MaxPool2d<Kp> (stride Kp) fused: rows are the output
/// pixels of whole pooling windows, window by window. E, Y: x's and pooled's stored elements.
template <class Epi, int Kp, class E, class Y>
GemmProblem<PooledIm2colRows<Kp, E>, Rows, ConvBiasActivationMaxPool<Epi, Kp, Y>> conv2d_maxpool_problem(
    const ConvShape& s, int batch, const float* w, const float* b, const E* x, Y* pooled,
    std::uint8_t* argmax, bool bf16 = false) {
  const int ph = s.oh / Kp, pw = s.ow / Kp;
  const int windows = batch * ph * pw;
  const PooledIm2colRows<Kp, E> a{x, s, ph, pw, FastDiv(pw), FastDiv(ph * pw)};
  const ConvBiasActivationMaxPool<Epi, Kp, Y> epi{pooled, argmax, b, windows, s.o, ph * pw, FastDiv(ph * pw), bf16};
  return {windows * Kp * Kp, s.o, s.patch, s.patch, a, Rows{w, s.patch}, epi, nullptr};
}

/// The implicit GEMM of a Conv2d input gradient: rows are input pixels, columns input channels; each
/// value goes to `sink` (gradient_sink.cuh) at its flat index in the (batch, C, H, W) input gradient.
template <class Dz, class Sink>
GemmProblem<ConvGradientGather<Dz>, ConvWeightsByInput, ConvInputStore<Sink>> conv2d_dx_problem_to(
    const ConvShape& s, int batch, const Dz& dz, const float* w, const Sink& sink) {
  const int m = batch * s.hw;
  return {m, s.c, s.o * s.kk, s.o * s.kk, ConvGradientGather<Dz>{dz, s}, ConvWeightsByInput{w, s},
          ConvInputStore<Sink>{sink, m, s.c, s.hw, s.div_hw}, nullptr};
}
/// The implicit GEMM of a Conv2d input gradient stored to dx (batch, C, H, W).
template <class Dz>
GemmProblem<ConvGradientGather<Dz>, ConvWeightsByInput, ConvInputStore<>> conv2d_dx_problem(const ConvShape& s,
                                                                                             int batch, const Dz& dz,
                                                                                             const float* w, float* dx) {
  return conv2d_dx_problem_to(s, batch, dz, w, StoreSink{dx});
}

/// The operands of a Conv2d weight gradient: dW (O, C*K*K) = sum over (img, oy, ox) of dz im2col(x),
/// x of stored elements E.
template <class Dz, class E = float>
struct ConvWeightGradientOperands {
  int m, n, k;
  ConvGradientRows<Dz> a;
  Im2colColumnsOf<E> b;
};
template <class Dz, class E>
ConvWeightGradientOperands<Dz, E> conv2d_dw_operands(const ConvShape& s, int batch, const Dz& dz, const E* x) {
  return {s.o, s.patch, batch * s.ohw, ConvGradientRows<Dz>{dz, s}, Im2colColumnsOf<E>{x, s}};
}

/// Forward of Conv2d (no pooling fused) on `t`. Tiles: GemmTiles<out channels>. With `fold`
/// (evaluation), the BatchNorm after it and `add` (a residual block's shortcut, or null) run in its
/// epilogue. `bf16`: y stored as bf16 values. X, Y, A: x's, y's and add's stored elements (float, or
/// BFloat16 in a 16-bit workspace).
template <class Epi, class Tiles, class P, class X, class Y, class A = float>
void conv2d_forward(const GemmTarget& t, const ConvGeometry& g, int batch, const float* w, const float* b,
                    const X* x, Y* y, float* z, const BatchNormFold<float>* fold = nullptr,
                    const std::type_identity_t<A>* add = nullptr, bool bf16 = false) {
  require(add == nullptr || fold != nullptr, "conv2d_forward on Cuda: an add needs a folded BatchNorm");
  check_conv_extent(g, std::size_t(batch));
  launch_layer_gemm<Tiles, P>(
      conv2d_forward_problem<Epi, X, Y, A>(ConvShape(g), batch, w, b, x, y, z, fold, add, bf16), 1, t);
}

/// Forward of Conv2d followed by MaxPool2d<Kp> (stride Kp): writes only the pooled output and the
/// position of each window's maximum. Tiles: GemmTiles<out channels>, whose BM must hold whole windows.
/// `bf16`: the pooled values stored (and compared) as bf16 values. X, Y: x's and pooled's stored elements.
template <class Epi, int Kp, class Tiles, class P, class X, class Y>
void conv2d_maxpool_forward(const GemmTarget& t, const ConvGeometry& g, int batch, const float* w, const float* b,
                            const X* x, Y* pooled, std::uint8_t* argmax, bool bf16 = false) {
  static_assert(Tiles::wmma::bm % (Kp * Kp) == 0 && Tiles::mma::bm % (Kp * Kp) == 0,
                "conv2d_maxpool_forward: the tile does not hold whole pooling windows");
  static_assert(Kp * Kp <= 256, "conv2d_maxpool_forward: the window index must fit a byte");
  check_conv_extent(g, std::size_t(batch));
  launch_layer_gemm<Tiles, P>(conv2d_maxpool_problem<Epi, Kp>(ConvShape(g), batch, w, b, x, pooled, argmax, bf16), 1,
                              t);
}

/// Floats of scratch the dense dz of a backward pass takes (rounded up to keep what follows aligned).
inline std::size_t conv2d_dz_floats(const ConvGeometry& g, int batch) {
  const std::size_t n = std::size_t(batch) * g.out_channels * g.out_pixels();
  return (n + 63) / 64 * 64;
}

/// Scratch (floats) of the conv backward passes: the dense dz where `dense_dz` (forms_dense_dz of the
/// source backward reads), then the weight gradient's split-K partial sums. TilesW: GemmTiles<C*K*K>.
template <class TilesW>
std::size_t conv2d_backward_scratch(const ConvGeometry& g, int batch, int sm_count, bool dense_dz) {
  return (dense_dz ? conv2d_dz_floats(g, batch) : 0) +
         layer_weight_gradient_scratch<TilesW>(g.out_channels, int(g.patch()), batch * int(g.out_pixels()), sm_count);
}

/// The two GEMMs of a conv backward pass reading dz from `dz`, the input gradient to `sink` (none when
/// the sink is not active: the first layer). The input gradient's GEMM reads w, so it runs first: an
/// active `update` changes w (and b) in the weight gradient's GEMM. X: x's stored element.
template <class TilesX, class TilesW, class P, class Dz, class X, class Sink>
void conv2d_backward_gemms(const GemmTarget& t, const ConvShape& s, int batch, const Dz& dz, const float* w,
                           const X* x, const Sink& sink, float* dw, float* db, float* scratch,
                           const LayerUpdate<float>& update) {
  if (sink.active()) launch_layer_gemm<TilesX, P>(conv2d_dx_problem_to(s, batch, dz, w, sink), 1, t);
  const auto ops = conv2d_dw_operands(s, batch, dz, x);
  layer_weight_gradient<TilesW, P>(t, ops.m, ops.n, ops.k, ops.a, ops.b, dw, db, scratch, update);
}

/// Backward of Conv2d given its dz source: the input gradient to `sink` (StoreSink{dx}, or the stage
/// below's ActivationSink / UnpoolSink, which then receives its dz), dW and db set, not accumulated.
///   StoredGradient (dz already dense: the stage above wrote it through a sink) and a ConvGradient
///   without an activation (dz is dy) are read in place;
///   ConvGradient and PooledConvGradient are first written densely into `scratch` by one coalesced
///   pass (unpooling, ReLU mask and activation derivative evaluated once per element, not once per
///   GEMM tile that reads it).
/// `scratch`: conv2d_backward_scratch floats (with dense_dz = forms_dense_dz<Dz>()). TilesX: GemmTiles<C>,
/// TilesW: GemmTiles<C*K*K>. An active
/// `update` applies the optimizer to w and b as dW and db are finished (they are still written). X: x's
/// stored element (float, or BFloat16 in a 16-bit workspace).
template <class TilesX, class TilesW, class P, class Dz, class X, class Sink>
void conv2d_backward_to(const GemmTarget& t, const ConvGeometry& g, int batch, const Dz& dz, const float* w,
                        const X* x, const Sink& sink, float* dw, float* db, float* scratch,
                        const LayerUpdate<float>& update = {}) {
  check_conv_extent(g, std::size_t(batch));
  const ConvShape s(g);
  if constexpr (!forms_dense_dz<Dz>()) {
    // The scratch holds the partial sums alone.
    if constexpr (is_stored_gradient<Dz>)
      conv2d_backward_gemms<TilesX, TilesW, P>(t, s, batch, dz, w, x, sink, dw, db, scratch, update);
    else
      conv2d_backward_gemms<TilesX, TilesW, P>(t, s, batch, StoredGradient{dz.dy, s.o, s.ohw, s.ow}, w, x, sink, dw,
                                               db, scratch, update);
  } else {
    require(scratch != nullptr, "conv2d_backward: needs conv2d_backward_scratch floats of scratch");
    float* gemm_scratch = scratch + conv2d_dz_floats(g, batch);
    const int n = batch * s.o * s.ohw;
    const int blocks = std::min((n + 255) / 256, 65535);
    launch<materialize_dz_kernel<Dz>>("materialize_dz_kernel", blocks, 256, 0, t.stream, dz, n, s.div_ohw, s.div_ow,
                                      FastDiv(s.o), scratch);
    conv2d_backward_gemms<TilesX, TilesW, P>(t, s, batch, StoredGradient{scratch, s.o, s.ohw, s.ow}, w, x, sink, dw,
                                             db, gemm_scratch, update);
  }
}

/// conv2d_backward_to with the input gradient stored to dx (none when dx is null).
template <class TilesX, class TilesW, class P, class Dz>
void conv2d_backward(const GemmTarget& t, const ConvGeometry& g, int batch, const Dz& dz, const float* w,
                     const float* x, float* dx, float* dw, float* db, float* scratch) {
  conv2d_backward_to<TilesX, TilesW, P>(t, g, batch, dz, w, x, StoreSink{dx}, dw, db, scratch);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
