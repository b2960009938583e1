#pragma once
// How the library's kernels are launched: `launch<kernel>(...)` for every one of them, with programmatic
// dependent launch (PDL) where the device and the kernel's image allow it, and the launch shapes of the
// elementwise kernels (grid-stride loops over n elements).
//
// Programmatic dependent launch (sm_90 and later): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled while the kernel before it on the
// stream still runs, once every block of that one has executed griddepcontrol.launch_dependents; it
// must then execute griddepcontrol.wait before it touches memory the earlier kernel writes, which waits
// until that kernel has completed and its writes are visible. A step of small kernels (LeNet's: ~15,
// each a few microseconds) spends much of its time between kernels, on the next kernel's launch and
// ramp; with PDL those overlap the previous kernel's last wave (issue 17).
//
// The contract that keeps this exact: every kernel `launch` starts begins with kernel_prologue(),
// which waits first and then lets the next kernel launch. Waiting first, in every kernel, makes the
// order transitive: a kernel completes only after the one before it completed, so a kernel that reads
// what two launches earlier wrote still sees it, and memory copies, events and host reads after a
// kernel see everything before it. tests/kernels/cuda/kernel_prologue.cpp checks that every __global__
// function in include/fusedp begins with it and that nothing there launches with <<<...>>>.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <string>
#include <string_view>

namespace fusedp::kernels::cuda {

/// FUSEDP_CUDA_DEPENDENT_LAUNCH's text: "on"/"1" or "off"/"0"; null or empty means on. Anything else is
/// an InvalidArgument naming the variable and the value.
[[nodiscard]] inline bool parse_dependent_launch(const char* value) {
  const std::string_view v = value ? value : "";
  if (v.empty() || v == "on" || v == "1") return true;
  if (v == "off" || v == "0") return false;
  throw InvalidArgument("FUSEDP_CUDA_DEPENDENT_LAUNCH is '" + std::string(v) +
                        "'; it must be 'on', 'off', '1' or '0' (or unset: on)");
}

}  // namespace fusedp::kernels::cuda

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda_check.hpp"
#include "fusedp/exec/cuda_graph.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdlib>

namespace fusedp::kernels::cuda {

/// Threads per block of the elementwise kernels.
inline constexpr int elementwise_threads = 256;

/// Blocks for n elements: one element per thread up to 2^16 blocks (16.7 M threads, far beyond what
/// any device runs at once), then the grid-stride loop takes over.
inline unsigned elementwise_blocks(std::size_t n) {
  const std::size_t blocks = (n + elementwise_threads - 1) / elementwise_threads;
  return unsigned(std::clamp<std::size_t>(blocks, 1, std::size_t(1) << 16));
}

/// The first index of this thread and the stride of a grid-stride loop.
__device__ FUSEDP_ALWAYS_INLINE std::size_t grid_index() {
  return std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ FUSEDP_ALWAYS_INLINE std::size_t grid_stride() { return std::size_t(gridDim.x) * blockDim.x; }

/// The first statement of every kernel `launch` starts: waits until the kernel before it on the stream
/// has completed and its writes are visible (griddepcontrol.wait; returns at once when that kernel was
/// not a programmatic dependency), then lets the next kernel be scheduled (launch_dependents). Nothing
/// on devices before sm_90, where launches are ordered the plain way.
__device__ FUSEDP_ALWAYS_INLINE void kernel_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

namespace detail {
// A failed call on the way to launching `what` throws DeviceError naming the launch, after clearing the
// error (a launch error is not sticky: the runtime is left clean for the caller).
inline void check_launch(cudaError_t code, const char* what) {
  if (code == cudaSuccess) return;
  (void)cudaGetLastError();
  fusedp::detail::cuda_check(code, (std::string("launch of ") + what).c_str());
}

inline std::atomic<bool>& dependent_launch_flag() {
  static std::atomic<bool> on{parse_dependent_launch(std::getenv("FUSEDP_CUDA_DEPENDENT_LAUNCH"))};
  return on;
}

// Whether Kernel's image on the current device was compiled for sm_90 or later, so that its
// kernel_prologue holds the griddepcontrol instructions (PTX generated for an older architecture and
// compiled by the driver for this one does not): cudaFuncAttributes::ptxVersion, asked once per kernel
// and device.
// A failure (no image for the device, no device) throws as the launch itself would: naming `what`.
template <auto Kernel>
[[nodiscard]] bool image_has_prologue(const char* what) {
  constexpr int max_devices = 64;
  static std::array<std::atomic<signed char>, max_devices> known{};  // 0 not asked, 1 yes, -1 no
  int device = 0;
  check_launch(cudaGetDevice(&device), what);
  if (device < 0 || device >= max_devices) return false;
  signed char k = known[std::size_t(device)].load(std::memory_order_relaxed);
  if (k == 0) {
    cudaFuncAttributes a{};
    check_launch(cudaFuncGetAttributes(&a, Kernel), what);
    k = a.ptxVersion >= 90 ? 1 : -1;
    known[std::size_t(device)].store(k, std::memory_order_relaxed);
  }
  return k > 0;
}
}  // namespace detail

/// Whether `launch` uses programmatic dependent launch where it can (default: FUSEDP_CUDA_DEPENDENT_LAUNCH,
/// on when unset). For comparisons (benchmarks/gpu/train_step_gpu --no-dependent-launch); the results are
/// the same bits either way.
[[nodiscard]] inline bool dependent_launch() noexcept {
  return detail::dependent_launch_flag().load(std::memory_order_relaxed);
}
/// Turns programmatic dependent launch on or off for the launches that follow (a CUDA graph recorded
/// before keeps the edges it was recorded with; Model's step graphs are recorded again).
inline void set_dependent_launch(bool on) noexcept {
  detail::dependent_launch_flag().store(on, std::memory_order_relaxed);
}

/// Whether `launch` makes Kernel's launches on the current device programmatic dependent launches: on,
/// no PlainLaunchScope on the calling thread (exec/cuda_graph.hpp: a graph recorded plain), and the
/// kernel's image there compiled for sm_90 or later (tests ask, to say what they checked).
template <auto Kernel>
[[nodiscard]] bool launches_dependently(const char* what = "a kernel") {
  return dependent_launch() && !plain_launches_here() && detail::image_has_prologue<Kernel>(what);
}

/// Launches Kernel(args...) on `stream` over `grid` x `block` threads with `smem` bytes of dynamic shared
/// memory; as a programmatic dependent launch where dependent_launch() is on and the kernel's image on
/// this device is for sm_90 or later. Kernel must begin with kernel_prologue(). A failed launch throws
/// DeviceError naming `what`; faults while it runs surface at the next checked synchronization.
template <auto Kernel, class... Args>
void launch(const char* what, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (launches_dependently<Kernel>(what)) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  detail::check_launch(cudaLaunchKernelEx(&config, Kernel, args...), what);
}

}  // namespace fusedp::kernels::cuda
#endif  // FUSEDP_HAS_CUDA
