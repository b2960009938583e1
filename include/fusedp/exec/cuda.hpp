#pragma once
// The Cuda execution space: one device, a stream, and the precision its GEMMs run in. Under a host
// compiler this header declares only the precision tags (exec/precision.hpp); everything
// else is compiled by nvcc alone (FUSEDP_HAS_CUDA), so Host-only programs never need the CUDA toolkit.
#include "fusedp/core/config.hpp"
#include "fusedp/exec/precision.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda_check.hpp"
#include "fusedp/exec/cuda_event.hpp"
#include "fusedp/exec/cuda_trace.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace fusedp {

/// Owning device memory on the current device. Move-only; zeroed on allocation. Running out of memory
/// throws DeviceError with the size asked for and the memory free on the device.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    const cudaError_t code = cudaMalloc(&p, n * sizeof(T));
    if (code != cudaSuccess) {
      (void)cudaGetLastError();
      std::size_t free = 0, total = 0;
      std::string where;
      if (cudaMemGetInfo(&free, &total) == cudaSuccess)
        where = ", " + std::to_string(free >> 20) + " MiB free of " + std::to_string(total >> 20) + " MiB";
      else
        (void)cudaGetLastError();
      throw DeviceError("cudaMalloc(" + std::to_string(n * sizeof(T)) + " bytes)", int(code),
                        std::string(cudaGetErrorString(code)) + ": could not allocate " + std::to_string(n) + " x " +
                            std::to_string(sizeof(T)) + " bytes (" + std::to_string((n * sizeof(T)) >> 20) + " MiB)" +
                            where);
    }
    data_ = static_cast<T*>(p);
    try {
      FUSEDP_CUDA_CHECK(cudaMemset(data_, 0, n * sizeof(T)));
      // cudaMemset runs on the default stream, which does not order against the non-blocking streams
      // of CudaSpace: wait for it, so no kernel ever sees the buffer before it is zero.
      FUSEDP_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    } catch (...) {
      release();  // no destructor runs for an object whose constructor throws
      throw;
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] std::span<T> span() noexcept { return {data_, size_}; }
  [[nodiscard]] std::span<const T> span() const noexcept { return {data_, size_}; }

 private:
  void release() noexcept {
    if (data_) cudaFree(data_);  // cannot throw from a destructor; a failure here is reported by the next call
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Page-locked host memory (cudaMallocHost): the host end of asynchronous copies. Move-only, zeroed.
template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    FUSEDP_CUDA_CHECK(cudaMallocHost(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
    for (std::size_t i = 0; i < n; ++i) data_[i] = T{};
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }

  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] std::span<T> span() noexcept { return {data_, size_}; }
  [[nodiscard]] std::span<const T> span() const noexcept { return {data_, size_}; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  void release() noexcept {
    if (data_) cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A view of device memory: values that already live on the device (a batch a loader copied there).
/// A distinct type, so a device pointer is never taken for host memory by overload resolution.
template <class T>
struct DeviceSpan {
  T* data = nullptr;
  std::size_t size = 0;
};

/// Number of usable CUDA devices; 0 when there is no device or no driver (never throws).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Why there is no usable device, in words ("" when there is one): for skip messages and errors.
inline std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t code = cudaGetDeviceCount(&n);
  if (code != cudaSuccess) {
    (void)cudaGetLastError();
    std::string why = cudaGetErrorString(code);
    if (code == cudaErrorInsufficientDriver) why += " (no NVIDIA driver is loaded, or it is older than this CUDA runtime)";
    return why + " (cudaGetDeviceCount code " + std::to_string(int(code)) + ")";
  }
  if (n == 0) return "no CUDA device found";
  return "";
}

/// Makes `device` current on the calling thread while it lives, and gives the caller's device back at its
/// end (as PyTorch's CUDAGuard does): an object bound to one device works whichever device its caller
/// made current, and leaves that one current. Where the device is current already it costs one
/// cudaGetDevice and changes nothing. Not copyable or movable: it belongs to one scope of one thread.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    int current = 0;
    FUSEDP_CUDA_CHECK(cudaGetDevice(&current));
    if (current == device) return;
    FUSEDP_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  }
  ~CudaDeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);  // a destructor cannot throw; the device was valid
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int previous_ = -1;  // the caller's device, where this scope changed it
};

/// Copies n values between host and device (or within the device) on `stream`. With pinned host memory
/// the copy is asynchronous; with ordinary (pageable) memory CUDA may stage it synchronously.
template <class T>
void copy_async(T* dst, const T* src, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  FUSEDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDefault, stream));
}

/// Counters in device memory that belong to a stream: a kernel that counts its blocks' arrivals (a
/// split-K GEMM whose last block per tile adds the partial products, kernels/cuda/gemm.cuh) uses them,
/// and its last block sets them back to zero, so between kernels they are all zero. Only kernels ordered
/// on that one stream may use them. `reduction_trip_limit`: the longest chain of round trips to L2 that
/// a GEMM's last block per tile may walk to add up the tile's parts with them (a longer reduction goes to
/// a kernel of its own; kernels/cuda/gemm.cuh, tile_reduction_trips and reduces_in_gemm); no limit unless
/// the caller sets one (the layers' targets do: kernels/cuda/gemm_dispatch.cuh, split_arrivals).
struct ArrivalCounters {
  unsigned* data = nullptr;
  std::size_t count = 0;
  int reduction_trip_limit = std::numeric_limits<int>::max();
};

/// A device's memory in bytes (CudaSpace::memory).
struct DeviceMemory {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// One CUDA device, the stream its work is queued on, and the precision of its GEMMs. Copies share the
/// stream (and its arrival counters). `Cuda` (TF32) is the usual choice; CudaSpace<precision::Fp32> computes exactly in fp32.
/// @tparam Precision precision::Tf32, precision::Fp32 or precision::Bf16
template <class Precision = precision::Tf32>
struct CudaSpace {
  static_assert(std::is_same_v<Precision, precision::Tf32> || std::is_same_v<Precision, precision::Fp32> ||
                    std::is_same_v<Precision, precision::Bf16>,
                "fusedp::CudaSpace<Precision>: Precision must be precision::Tf32, precision::Fp32 or precision::Bf16");
  template <class T>
  using buffer = DeviceBuffer<T>;
  using precision = Precision;
  static constexpr const char* name = "Cuda";

  /// Selects `device` and creates a non-blocking stream on it. Throws DeviceError when the device does
  /// not exist (with the number found and why), or when this build has no code for its architecture.
  explicit CudaSpace(int device = 0) : device_(device) {
    const int count = cuda_device_count();
    if (device < 0 || device >= count) {
      const std::string why = count == 0 ? cuda_unavailable_reason() : std::to_string(count) + " CUDA device(s) found";
      throw DeviceError("Cuda(" + std::to_string(device) + ")", int(cudaErrorInvalidDevice), "no such device: " + why);
    }
    FUSEDP_CUDA_CHECK(cudaSetDevice(device));
    cudaDeviceProp prop{};
    FUSEDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    cudaFuncAttributes attr{};
    const cudaError_t probe = cudaFuncGetAttributes(&attr, detail::probe_kernel<>);
    if (probe != cudaSuccess) {
      (void)cudaGetLastError();
      throw DeviceError("Cuda(" + std::to_string(device) + ")", int(probe),
                        std::string(cudaGetErrorString(probe)) + ": device " + prop.name + " is sm_" +
                            std::to_string(prop.major) + std::to_string(prop.minor) +
                            " but this program was built for compute architectures " + detail::built_architectures +
                            " (set CMAKE_CUDA_ARCHITECTURES, e.g. to native)");
    }
    sm_count_ = prop.multiProcessorCount;
    shared_optin_ = std::size_t(prop.sharedMemPerBlockOptin);
    arch_ = prop.major * 10 + prop.minor;
    stream_ = CudaStream::make().shared();
    arrivals_ = std::make_shared<DeviceBuffer<unsigned>>(arrival_counter_count);  // zeroed
  }

  /// The same device and stream with another precision policy.
  template <class Other>
  explicit CudaSpace(const CudaSpace<Other>& other)
      : device_(other.device()),
        sm_count_(other.sm_count()),
        shared_optin_(other.shared_memory_per_block()),
        arch_(other.architecture()),
        stream_(other.shared_stream()),
        arrivals_(other.shared_arrivals()) {}

  /// Counters of the stream (ArrivalCounters): 16,384, 64 KiB of device memory, one per output tile of
  /// the largest split-K GEMM they serve (a larger one reduces in a kernel of its own).
  static constexpr std::size_t arrival_counter_count = 16384;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }
  [[nodiscard]] const std::shared_ptr<CUstream_st>& shared_stream() const noexcept { return stream_; }
  /// The stream's arrival counters.
  [[nodiscard]] ArrivalCounters arrival_counters() const noexcept {
    return arrivals_ ? ArrivalCounters{arrivals_->data(), arrivals_->size()} : ArrivalCounters{};
  }
  [[nodiscard]] const std::shared_ptr<DeviceBuffer<unsigned>>& shared_arrivals() const noexcept { return arrivals_; }
  /// Streaming multiprocessors: split-K GEMMs size their grids by it.
  [[nodiscard]] int sm_count() const noexcept { return sm_count_; }
  /// Largest dynamic shared memory one block may opt in to, in bytes.
  [[nodiscard]] std::size_t shared_memory_per_block() const noexcept { return shared_optin_; }
  /// Compute capability as major * 10 + minor (90 for an H100 or H200).
  [[nodiscard]] int architecture() const noexcept { return arch_; }
  /// Makes this space's device current on the calling thread.
  void activate() const { FUSEDP_CUDA_CHECK(cudaSetDevice(device_)); }
  /// Makes this space's device current until the returned scope ends, then the caller's again.
  [[nodiscard]] CudaDeviceScope enter() const { return CudaDeviceScope(device_); }
  /// Waits for all work queued on the stream and reports any asynchronous error.
  void synchronize() const { FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream_.get())); }
  /// The device's memory now (cudaMemGetInfo): what is free for new allocations and the whole.
  [[nodiscard]] DeviceMemory memory() const {
    const CudaDeviceScope scope(device_);
    DeviceMemory m;
    FUSEDP_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
    return m;
  }

 private:
  int device_;
  int sm_count_ = 0;
  std::size_t shared_optin_ = 0;
  int arch_ = 0;
  std::shared_ptr<CUstream_st> stream_;
  std::shared_ptr<DeviceBuffer<unsigned>> arrivals_;
};

/// The default Cuda space: TF32 tensor cores, fp32 everywhere else. `fp::Cuda{0}` is device 0.
using Cuda = CudaSpace<precision::Tf32>;
/// Exact fp32 GEMMs (no tensor cores).
using CudaFp32 = CudaSpace<precision::Fp32>;
/// BF16 GEMM operands with fp32 master weights.
using CudaBf16 = CudaSpace<precision::Bf16>;

template <class S>
struct is_cuda_space : std::false_type {};
template <class P>
struct is_cuda_space<CudaSpace<P>> : std::true_type {};
/// Whether S is some CudaSpace<P>.
template <class S>
inline constexpr bool is_cuda_space_v = is_cuda_space<S>::value;

/// The Cuda space's work is queued on its stream: CUDA events time it (exec/cuda_trace.hpp).
template <class P>
struct trace::SpaceSpans<CudaSpace<P>> {
  static CudaScope open(const CudaSpace<P>& space, const char* name, Kind kind, std::int64_t index = -1) noexcept {
    return CudaScope(space.stream(), name, kind, index);
  }
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
