#pragma once
// Pointwise activation functors and the epilogue chain that applies them after an anchor op. These are
// the math both spaces share: the Host loops and the Cuda kernels call the same functions.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/precision.hpp"
#include "fusedp/kernels/bf16.hpp"

#include <cmath>
#include <type_traits>

namespace fusedp::kernels {

// Each activation provides:
//   T operator()(T x)             the function
//   T derivative(T x, T y)        f'(x), where y = f(x); an op whose derivative needs only y says so
//   from_output                   true when derivative() reads only y (then x need not be saved)

struct Relu {
  static constexpr bool from_output = true;
  template <class T>
  FUSEDP_HD T operator()(T x) const { return x < T(0) ? T(0) : x; }  // NaN stays NaN, as in PyTorch
  template <class T>
  FUSEDP_HD T derivative(T /*x*/, T y) const { return y > T(0) ? T(1) : T(0); }
};

/// max(x, 0) + slope * min(x, 0). With a positive slope the sign of y is the sign of x.
template <float Slope>
struct LeakyRelu {
  static constexpr bool from_output = Slope > 0.0f;
  template <class T>
  FUSEDP_HD T operator()(T x) const { return x > T(0) ? x : T(Slope) * x; }
  template <class T>
  FUSEDP_HD T derivative(T x, T y) const {
    if constexpr (from_output) return y > T(0) ? T(1) : T(Slope);
    else return x > T(0) ? T(1) : T(Slope);
  }
};

struct Tanh {
  static constexpr bool from_output = true;
  template <class T>
  FUSEDP_HD T operator()(T x) const {
    using std::tanh;
    return tanh(x);
  }
  template <class T>
  FUSEDP_HD T derivative(T /*x*/, T y) const { return T(1) - y * y; }
};

struct Sigmoid {
  static constexpr bool from_output = true;
  template <class T>
  FUSEDP_HD T operator()(T x) const {
    using std::exp;
    return T(1) / (T(1) + exp(-x));
  }
  template <class T>
  FUSEDP_HD T derivative(T /*x*/, T y) const { return y * (T(1) - y); }
};

/// GELU with the exact erf form (PyTorch's default, approximate='none').
struct Gelu {
  static constexpr bool from_output = false;
  template <class T>
  FUSEDP_HD T operator()(T x) const {
    using std::erf;
    return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
  }
  template <class T>
  FUSEDP_HD T derivative(T x, T /*y*/) const {
    using std::erf;
    using std::exp;
    const T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
    const T pdf = exp(T(-0.5) * x * x) * T(0.39894228040143267794);
    return cdf + x * pdf;
  }
};

/// The identity: the epilogue of an anchor followed by no activation.
struct Identity {
  static constexpr bool from_output = true;
  template <class T>
  FUSEDP_HD T operator()(T x) const { return x; }
  template <class T>
  FUSEDP_HD T derivative(T, T) const { return T(1); }
};

/// The pointwise ops that ride behind an anchor op, applied in order.
/// saves_input: backward needs the value before the chain (z), not only the stage's output (y).
template <class... Ops>
struct Epilogue {
  static constexpr bool empty = sizeof...(Ops) == 0;
  static constexpr bool saves_input = sizeof...(Ops) > 1 || (... || !Ops::from_output);

  template <class T>
  FUSEDP_HD static T apply(T z) {
    ((z = Ops{}(z)), ...);
    return z;
  }

  /// d(chain)/dz at z, given y = apply(z). Recomputes the intermediate values of a longer chain.
  template <class T>
  FUSEDP_HD static T derivative(T z, T y) {
    if constexpr (sizeof...(Ops) == 0) {
      return T(1);
    } else if constexpr (sizeof...(Ops) == 1) {
      return (Ops{}.derivative(z, y), ...);
    } else {
      T d = T(1), x = z;
      ((d *= Ops{}.derivative(x, Ops{}(x)), x = Ops{}(x)), ...);
      return d;
    }
  }
};

/// Whether Epi's derivative is 0 or 1 wherever it is taken (no activation, or ReLU): dz = dy * Epi' is
/// then exactly a bf16 value whenever dy is one.
template <class Epi>
inline constexpr bool derivative_is_mask = std::is_same_v<Epi, Epilogue<>> || std::is_same_v<Epi, Epilogue<Relu>>;

/// The element a Cuda gradient sink (kernels/cuda/gradient_sink.cuh) stores dz in for a stage below with
/// epilogue Epi, on a space of precision P: BFloat16 where the model stores its activation gradients in
/// bf16 (P is Bf16: the sink rounds the gradient it receives) and Epi's derivative is a mask, so dz is a
/// bf16 value already; float otherwise. The GEMMs that read it round their operands to bf16 (P is Bf16)
/// and sum the bias gradient from the values themselves, so 16 bits change no bit of their results.
/// Here, not in the CUDA header, because the Cuda workspace sizes its gradient buffers by it
/// (net/cuda_plan.hpp), which g++ alone computes.
template <class P, class Epi>
using received_dz_element =
    std::conditional_t<std::is_same_v<P, precision::Bf16> && derivative_is_mask<Epi>, BFloat16, float>;

}  // namespace fusedp::kernels
