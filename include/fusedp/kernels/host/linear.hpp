#pragma once
// Linear on the Host: y = Epi(x W^T + b) over the batch with W (out, in) as PyTorch, GEMMs split over
// threads at the Host's precision, bias and activation in the GEMM epilogue. A large W is read in
// place by the forward rather than packed (linear_weights_in_place).
#include "fusedp/core/config.hpp"
#include "fusedp/core/buffer.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/host/gemm.hpp"
#include "fusedp/kernels/host/gemm_bf16.hpp"
#include "fusedp/kernels/host/instances.hpp"

#include <cstddef>

namespace fusedp::kernels::host {

/// Whether linear_forward reads W in place, as y^T = W x^T, rather than packing it for y = x W^T: when
/// W outgrows L2 and the batch reuses each of its elements only a few times, packing moves every element
/// once more than the multiplication reads it. CIFAR fc1 (1024 x 8192, 32 MB) at batch 64: 6.2 -> 3.9 ms
/// on two threads (gemm_bench); LeNet's and ResNet-18's heads fit L2 and keep the packed path. The
/// threads split W's rows, so there must be enough of them (a 10-way head over a wide input stays
/// packed and split by the batch).
inline bool linear_weights_in_place(std::size_t batch, std::size_t in, std::size_t out, std::size_t bytes,
                                    int threads) {
  return in * out * bytes > (std::size_t(1) << 20) && batch <= 256 && out >= 16 * std::size_t(threads);
}

/// y (batch, out) = Epi(x (batch, in) W^T + b); z receives x W^T + b when the epilogue needs it.
template <class Epi, class T>
void linear_forward(const Host& host, std::size_t batch, std::size_t in, std::size_t out, const T* w, const T* b,
                    const T* x, T* y, T* z) {
  if (host.precision() == HostPrecision::fp32 && linear_weights_in_place(batch, in, out, sizeof(T), host.threads())) {
    // y^T (out, batch) = W (out, in) x^T (in, batch) into the calling thread's scratch; the epilogue
    // writes each finished row of y^T into a column of y (and z).
    thread_local HostBuffer<T> yt;
    yt.reserve_discard(out * batch);
    gemm_a_in_place(host, out, batch, in, row_major(w, in), row_major(x, in).transposed(), yt.data(), batch, false,
                    [&](std::size_t o, std::size_t n0, T* p, std::size_t cnt) {
                      for (std::size_t j = 0; j < cnt; ++j) {
                        const T v = p[j] + b[o];
                        if constexpr (Epi::saves_input) z[(n0 + j) * out + o] = v;
                        y[(n0 + j) * out + o] = Epi::apply(v);
                      }
                    });
    return;
  }
  gemm_at_precision(host, batch, out, in, row_major(x, in), MatrixRef<T>{w, 1, in}, y, out, false,
       [&](std::size_t i, std::size_t j0, T* p, std::size_t cnt) {
         if constexpr (Epi::saves_input) {
           T* zp = z + i * out + j0;
           for (std::size_t j = 0; j < cnt; ++j) {
             zp[j] = p[j] + b[j0 + j];
             p[j] = Epi::apply(zp[j]);
           }
         } else {
           for (std::size_t j = 0; j < cnt; ++j) p[j] = Epi::apply(p[j] + b[j0 + j]);
         }
       });
}

/// Backward of linear_forward: dy is overwritten with dz = dy * Epi'; dw, db are set; dx is skipped
/// when null.
template <class Epi, class T>
void linear_backward(const Host& host, std::size_t batch, std::size_t in, std::size_t out, const T* w, const T* x,
                     const T* y, const T* z, T* dy, T* dx, T* dw, T* db) {
  // dz = dy * Epi' and db = column sums of dz in one pass, threads over blocks of columns.
  auto dz_and_db = [&](std::size_t j0, std::size_t j1, int) {
    for (std::size_t j = j0; j < j1; ++j) db[j] = T(0);
    for (std::size_t n = 0; n < batch; ++n) {
      T* row = dy + n * out;
      if constexpr (!Epi::empty) {
        const T* yr = y + n * out;
        const T* zr = z ? z + n * out : yr;
        for (std::size_t j = j0; j < j1; ++j) row[j] *= Epi::derivative(zr[j], yr[j]);
      }
      for (std::size_t j = j0; j < j1; ++j) db[j] += row[j];
    }
  };
  // Below ~64 K values one thread is done before a parallel region would start.
  if (batch * out < (std::size_t(1) << 16)) dz_and_db(0, out, 0);
  else host.parallel_for(out, dz_and_db);
  // dW (out, in) = dz^T (out, batch) x (batch, in)
  gemm_at_precision(host, out, in, batch, MatrixRef<T>{dy, 1, out}, row_major(x, in), dw, in, false);
  // dx (batch, in) = dz (batch, out) W (out, in)
  if (dx) gemm_at_precision(host, batch, in, out, row_major<T>(dy, out), row_major(w, in), dx, in, false);
}

// The instances a build may compile once (kernels/host/instances.hpp).
#define FUSEDP_HOST_LINEAR_INSTANCE(prefix, Epi, T)                                                        \
  prefix template void linear_forward<Epi, T>(const Host&, std::size_t, std::size_t, std::size_t, const T*, \
                                              const T*, const T*, T*, T*);                                 \
  prefix template void linear_backward<Epi, T>(const Host&, std::size_t, std::size_t, std::size_t, const T*, \
                                               const T*, const T*, const T*, T*, T*, T*, T*);
#if FUSEDP_HOST_KERNELS_PREBUILT
FUSEDP_HOST_KERNEL_INSTANCES(FUSEDP_HOST_LINEAR_INSTANCE, extern)
#endif

}  // namespace fusedp::kernels::host
