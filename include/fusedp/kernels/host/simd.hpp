#pragma once
// Vectors for the Host kernels: GCC/Clang vector extensions at the width the compiler targets
// (AVX-512: 64 bytes, AVX/AVX2: 32, SSE and NEON: 16), and "vectors" of one lane, the same code
// compiled as scalars, for compilers without them (nvcc's host pass, MSVC) or when FUSEDP_SCALAR is
// defined (to test that path). No intrinsics: every operation here lowers to the target's
// instructions or to scalar code.
#include "fusedp/core/config.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// GCC turns a copy loop into a call to memcpy, which costs more than the copy itself for the short
// runs of im2col and packing (rows of 10-32 floats): on LeNet's first conv the calls took a quarter of
// im2col's time. Functions that copy short runs opt out.
//
// GCC's predictive commoning keeps values loaded in one iteration for the next (image[r + kx] is
// image[(r + 1) + (kx - 1)]) and then broadcasts them from registers, one shuffle each on the single
// shuffle port; a broadcast from memory rides in the FMA's load for free. Kernels that broadcast
// from memory opt out (LeNet's first conv ran at half speed with it).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define FUSEDP_NO_LIBCALL_LOOPS __attribute__((optimize("no-tree-loop-distribute-patterns")))
#define FUSEDP_BROADCAST_LOADS __attribute__((optimize("no-predictive-commoning")))
#else
#define FUSEDP_NO_LIBCALL_LOOPS
#define FUSEDP_BROADCAST_LOADS
#endif


namespace fusedp::kernels::host::simd {

#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && !defined(FUSEDP_SCALAR)
#define FUSEDP_VECTOR_EXTENSIONS 1
#if defined(__AVX512F__)
inline constexpr std::size_t vector_bytes = 64;
inline constexpr int vector_registers = 32;
#elif defined(__AVX__)
inline constexpr std::size_t vector_bytes = 32;
inline constexpr int vector_registers = 16;
#elif defined(__aarch64__) || defined(__ARM_NEON)
inline constexpr std::size_t vector_bytes = 16;
inline constexpr int vector_registers = 32;
#else
inline constexpr std::size_t vector_bytes = 16;
inline constexpr int vector_registers = 16;
#endif
// Through a class: GCC drops a vector_size attribute written on an alias template in deduced contexts.
template <class T, std::size_t W>
struct vec_of {
  typedef T type __attribute__((vector_size(W * sizeof(T))));
};
template <class T>
struct vec_of<T, 1> {
  using type = T;
};
/// W lanes of T (W a power of two); narrower than the target's vector where a row is short.
template <class T, std::size_t W>
using vec_n = typename vec_of<T, W>::type;
template <class T>
inline constexpr std::size_t lanes = vector_bytes / sizeof(T);
#else
#define FUSEDP_VECTOR_EXTENSIONS 0
inline constexpr std::size_t vector_bytes = 0;
inline constexpr int vector_registers = 0;
template <class T, std::size_t W>
using vec_n = T;
template <class T>
inline constexpr std::size_t lanes = 1;
#endif

/// The target's vector of T.
template <class T>
using vec = vec_n<T, lanes<T>>;

template <class V, class T>
FUSEDP_ALWAYS_INLINE V load_as(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
FUSEDP_ALWAYS_INLINE vec<T> load(const T* p) {
  return load_as<vec<T>>(p);
}
template <class T, class V>
FUSEDP_ALWAYS_INLINE void store(T* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}
/// The first n (< lanes) elements of p, the rest zero.
template <class T>
FUSEDP_ALWAYS_INLINE vec<T> load_first(const T* p, std::size_t n) {
  alignas(sizeof(vec<T>)) T tmp[lanes<T>] = {};
  for (std::size_t l = 0; l < n; ++l) tmp[l] = p[l];
  return load(tmp);
}

/// Calls f.template operator()<W>(offset) over [0, n) in chunks of W = lanes, then one chunk of each
/// smaller power of two that n's remainder needs (12 floats under AVX-512: 8 then 4). Short rows
/// stay vectorized without masks, and no loop is left for the compiler to turn into a library call.
template <class T, class F>
FUSEDP_ALWAYS_INLINE void for_chunks(std::size_t n, F&& f) {
  constexpr std::size_t L = lanes<T>;
  std::size_t i = 0;
  for (; i + L <= n; i += L) f.template operator()<L>(i);
  [&]<std::size_t... B>(std::index_sequence<B...>) {
    (
        [&] {
          constexpr std::size_t w = L >> (B + 1);
          if (w > 0 && (n - i) >= w) {
            f.template operator()<(w > 0 ? w : 1)>(i);
            i += w;
          }
        }(),
        ...);
  }(std::make_index_sequence<std::size_t(std::countr_zero(L))>{});
}

/// dst[0, n) = src[0, n).
template <class T>
FUSEDP_ALWAYS_INLINE void copy(T* FUSEDP_RESTRICT dst, const T* FUSEDP_RESTRICT src, std::size_t n) {
  for_chunks<T>(n, [&]<std::size_t W>(std::size_t i) { store(dst + i, load_as<vec_n<T, W>>(src + i)); });
}
/// dst[0, n) = 0.
template <class T>
FUSEDP_ALWAYS_INLINE void zero(T* dst, std::size_t n) {
  for_chunks<T>(n, [&]<std::size_t W>(std::size_t i) { store(dst + i, vec_n<T, W>{}); });
}

#if FUSEDP_VECTOR_EXTENSIONS
/// Lanes of the same width as T's, holding comparison results (all ones or all zeros).
template <class V>
using mask_of = decltype(V{} < V{});

/// Where m is set a, else b (bitwise, so NaN payloads pass unchanged).
template <class V>
FUSEDP_ALWAYS_INLINE V select(mask_of<V> m, V a, V b) {
  using M = mask_of<V>;
  return V((M(a) & m) | (M(b) & ~m));
}
#endif

namespace detail {
#if FUSEDP_VECTOR_EXTENSIONS
// One level of the butterfly transpose on rows a and b = a's partner s rows below: lanes whose bit s is
// set take the partner's values (see transpose()).
template <std::size_t S, class V, std::size_t... L>
FUSEDP_ALWAYS_INLINE void butterfly(V& a, V& b, std::index_sequence<L...>) {
  constexpr std::size_t n = sizeof...(L);
  const V lo = __builtin_shufflevector(a, b, ((L & S) ? n + L - S : L)...);
  const V hi = __builtin_shufflevector(a, b, ((L & S) ? n + L : L + S)...);
  a = lo;
  b = hi;
}
#endif
}  // namespace detail

/// Transposes a W x W block held in registers (W = the target's lanes unless given): rows[r][l]
/// becomes rows[l][r]. log2(W) butterfly levels of two-source shuffles, W shuffles each (64 for 16
/// floats): a transposing pack costs about a quarter of a shuffle per element instead of a scalar
/// load and store.
template <class T, std::size_t W = lanes<T>>
FUSEDP_ALWAYS_INLINE void transpose(vec_n<T, W>* rows) {
#if FUSEDP_VECTOR_EXTENSIONS
  if constexpr (W > 1) {
    [&]<std::size_t... S>(std::index_sequence<S...>) {
      (
          [&] {
            constexpr std::size_t s = std::size_t(1) << S;
            FUSEDP_UNROLL(16)
            for (std::size_t r = 0; r < W; ++r)
              if (!(r & s)) detail::butterfly<s>(rows[r], rows[r + s], std::make_index_sequence<W>{});
          }(),
          ...);
    }(std::make_index_sequence<std::size_t(std::countr_zero(W))>{});
  }
#else
  (void)rows;
#endif
}

/// dst[0, n) += src[0, n).
template <class T>
FUSEDP_ALWAYS_INLINE void accumulate(T* FUSEDP_RESTRICT dst, const T* FUSEDP_RESTRICT src, std::size_t n) {
  for_chunks<T>(n, [&]<std::size_t W>(std::size_t i) {
    using V = vec_n<T, W>;
    store(dst + i, V(load_as<V>(dst + i) + load_as<V>(src + i)));
  });
}

}  // namespace fusedp::kernels::host::simd
