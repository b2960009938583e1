#pragma once
// Stand-alone pointwise stages on the Host: an activation chain that no anchor absorbed, dropout, and
// the rounding of bf16-stored activations.
#include "fusedp/core/config.hpp"
#include "fusedp/core/rng.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/kernels/dropout.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fusedp::kernels::host {

/// p[i] = p[i] rounded to the nearest bfloat16 (ties to even) for i < n, on the calling thread: a run
/// of bf16-stored values, rounded by the kernel that wrote it while it is in cache. Bit for bit
/// round_bf16, written without branches so that the loop vectorizes (it was 8% of a bf16 CIFAR-10 step
/// as a scalar loop).
inline void round_run(float* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = std::bit_cast<std::uint32_t>(p[i]);
    const std::uint32_t rounded = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;
    const std::uint32_t quiet = (v | 0x00400000u) & 0xffff0000u;  // a NaN stays a NaN
    p[i] = std::bit_cast<float>((v & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}
/// round_run where `round` and T is float (a kernel's bf16 stores); nothing otherwise.
template <class T>
void round_run_if(bool round, T* p, std::size_t n) {
  if constexpr (std::is_same_v<T, float>)
    if (round) round_run(p, n);
}
// Runs of this many values: a rounding kernel's stores, rounded while they are in cache.
inline constexpr std::size_t rounded_run = 4096;

/// y = Epi(x) elementwise over n values.
template <class Epi, class T>
void pointwise_forward(const Host& host, std::size_t n, const T* x, T* y) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) y[i] = Epi::apply(x[i]);
  });
}

/// dx = dy * Epi'(x).
template <class Epi, class T>
void pointwise_backward(const Host& host, std::size_t n, const T* x, const T* y, const T* dy, T* dx) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) dx[i] = dy[i] * Epi::derivative(x[i], y[i]);
  });
}

/// z = a + b and y = Epi(z) elementwise (a residual block's add and the activation after it); y stored
/// as bf16 values where bf16_y.
template <class Epi, class T>
void add_forward(const Host& host, std::size_t n, const T* a, const T* b, T* z, T* y, bool bf16_y = false) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t r = i0; r < i1; r += rounded_run) {
      const std::size_t end = std::min(i1, r + rounded_run);
      for (std::size_t i = r; i < end; ++i) {
        z[i] = a[i] + b[i];
        y[i] = Epi::apply(z[i]);
      }
      round_run_if(bf16_y, y + r, end - r);
    }
  });
}

/// dy *= Epi'(z) in place: the gradient before an epilogue.
template <class Epi, class T>
void epilogue_backward(const Host& host, std::size_t n, const T* z, const T* y, T* dy) {
  if constexpr (!Epi::empty)
    host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
      for (std::size_t i = i0; i < i1; ++i) dy[i] *= Epi::derivative(z[i], y[i]);
    });
}

/// dst = src, or dst += src when `accumulate`; dst stored as bf16 values where bf16_dst.
template <class T>
void copy_values(const Host& host, std::size_t n, const T* src, T* dst, bool accumulate, bool bf16_dst = false) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t r = i0; r < i1; r += rounded_run) {
      const std::size_t end = std::min(i1, r + rounded_run);
      if (accumulate)
        for (std::size_t i = r; i < end; ++i) dst[i] += src[i];
      else
        for (std::size_t i = r; i < end; ++i) dst[i] = src[i];
      round_run_if(bf16_dst, dst + r, end - r);
    }
  });
}

/// round_run over n floats on the Host's threads: a bf16-stored activation that its writer left in fp32.
inline void round_to_bf16(const Host& host, std::size_t n, float* p) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) { round_run(p + i0, i1 - i0); });
}

/// y = x * keep / (1 - p) in training, y = x otherwise. The mask is a function of (seed, stream, i),
/// so backward recomputes it instead of storing it.
template <class T>
void dropout_forward(const Host& host, std::size_t n, const DropoutMask& mask, bool training, const T* x, T* y) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) y[i] = training ? x[i] * T(mask.scale(i)) : x[i];
  });
}

template <class T>
void dropout_backward(const Host& host, std::size_t n, const DropoutMask& mask, const T* dy, T* dx) {
  host.parallel_for(n, [&](std::size_t i0, std::size_t i1, int) {
    for (std::size_t i = i0; i < i1; ++i) dx[i] = dy[i] * T(mask.scale(i));
  });
}

}  // namespace fusedp::kernels::host
