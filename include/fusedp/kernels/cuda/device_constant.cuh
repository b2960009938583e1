#pragma once
// A compile-time constant as a translation unit's device code holds it. nvcc compiles every .cu file
// twice: its own front end evaluates the templates for the device code, the host compiler (g++, clang,
// MSVC) evaluates them again for the host code. Where the two disagree on a constant, the host launches
// kernels planned one way that the device code instantiated another. The Cuda model reads its plan's
// fingerprint this way once, when it is built, and compares it with the host's (net/cuda_model.hpp).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/exec/cuda_check.hpp"
#include "fusedp/kernels/cuda/launch.cuh"

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedp::kernels::cuda {

namespace detail {
template <class Fact>
__global__ void device_constant_kernel(std::uint64_t* out) {
  kernel_prologue();
  *out = Fact::value;
}
}  // namespace detail

/// Fact::value (a std::uint64_t) as the device code of this translation unit evaluated it, read back
/// through `stream` (waits for the stream). Throws DeviceError where the device cannot run the kernel.
template <class Fact>
[[nodiscard]] std::uint64_t device_constant(cudaStream_t stream) {
  DeviceBuffer<std::uint64_t> out(1);
  launch<detail::device_constant_kernel<Fact>>("device_constant_kernel", 1, 1, 0, stream, out.data());
  std::uint64_t value = 0;
  copy_async(&value, out.data(), 1, stream);
  FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return value;
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
