#pragma once
// Checked CUDA runtime calls (nvcc only): FUSEDP_CUDA_CHECK and FUSEDP_CUDA_CHECK_LAUNCH turn a failure
// into a DeviceError naming the call, the code and the reason (with what to do where the reason is
// known: the architecture not built, no driver, out of memory).
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"

#include <cuda_runtime.h>

#include <string>

namespace fusedp {

namespace detail {
inline void cuda_check(cudaError_t code, const char* call) {
  if (code != cudaSuccess) {
    std::string message = cudaGetErrorString(code);
    if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorUnsupportedPtxVersion ||
        code == cudaErrorInvalidDeviceFunction)
      message += " (this build does not target the device's architecture: set CMAKE_CUDA_ARCHITECTURES)";
    if (code == cudaErrorInsufficientDriver) message += " (no NVIDIA driver is loaded, or it is older than this CUDA runtime)";
    if (code == cudaErrorMemoryAllocation) message += " (out of device memory)";
    throw DeviceError(call, int(code), message);
  }
}

// Architectures this translation unit was compiled for, as nvcc lists them (e.g. "800,900"; the
// list holds commas, hence the variadic stringizing).
#if defined(__CUDA_ARCH_LIST__)
#define FUSEDP_DETAIL_STR2(...) #__VA_ARGS__
#define FUSEDP_DETAIL_STR(...) FUSEDP_DETAIL_STR2(__VA_ARGS__)
inline constexpr const char* built_architectures = FUSEDP_DETAIL_STR(__CUDA_ARCH_LIST__);
#undef FUSEDP_DETAIL_STR
#undef FUSEDP_DETAIL_STR2
#else
inline constexpr const char* built_architectures = "unknown";
#endif

// An empty kernel: whether the device can load it tells whether this build targets the device.
template <int = 0>
__global__ void probe_kernel() {}
}  // namespace detail

/// Checks a CUDA runtime call; a failure throws DeviceError naming the call, the code and the reason.
#define FUSEDP_CUDA_CHECK(call) ::fusedp::detail::cuda_check((call), #call)

/// Checks the launch just made with <<<...>>> (bad configuration, too much shared memory, no kernel
/// image for the device); `what` names the kernel. Asynchronous faults surface at the next checked
/// synchronization.
#define FUSEDP_CUDA_CHECK_LAUNCH(what) ::fusedp::detail::cuda_check(cudaGetLastError(), "launch of " what)

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
