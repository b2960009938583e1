#pragma once
// The Cuda execution space: one device and a stream. Compiled only by nvcc (FUSEDP_HAS_CUDA); under a
// host compiler this header declares nothing, so Host-only programs never need the CUDA toolkit.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace fusedp {

namespace detail {
inline void cuda_check(cudaError_t code, const char* call) {
  if (code != cudaSuccess) {
    std::string message = cudaGetErrorString(code);
    if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorUnsupportedPtxVersion)
      message += " (this build does not target the device's architecture: set CMAKE_CUDA_ARCHITECTURES)";
    if (code == cudaErrorInsufficientDriver) message += " (the installed driver is older than this CUDA runtime)";
    throw DeviceError(call, int(code), message);
  }
}
}  // namespace detail

/// Checks a CUDA runtime call; a failure throws DeviceError naming the call, the code and the reason.
#define FUSEDP_CUDA_CHECK(call) ::fusedp::detail::cuda_check((call), #call)

/// Owning device memory on the current device. Move-only; zeroed on allocation.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    FUSEDP_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    data_ = static_cast<T*>(p);
    FUSEDP_CUDA_CHECK(cudaMemset(data_, 0, n * sizeof(T)));
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

/// Number of usable CUDA devices; 0 when there is no device or no driver (never throws).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// One CUDA device and the stream its work is queued on. Copies share the stream.
struct Cuda {
  template <class T>
  using buffer = DeviceBuffer<T>;
  static constexpr const char* name = "Cuda";

  /// Selects `device` and creates a non-blocking stream on it. Throws DeviceError when the device does
  /// not exist, with the number of devices found.
  explicit Cuda(int device = 0) : device_(device) {
    const int count = cuda_device_count();
    if (device < 0 || device >= count)
      throw DeviceError("Cuda(" + std::to_string(device) + ")", int(cudaErrorInvalidDevice),
                        "no such device: " + std::to_string(count) + " CUDA device(s) found");
    FUSEDP_CUDA_CHECK(cudaSetDevice(device));
    cudaStream_t s = nullptr;
    FUSEDP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = std::shared_ptr<CUstream_st>(s, [](cudaStream_t p) { cudaStreamDestroy(p); });
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }
  /// Makes this space's device current on the calling thread.
  void activate() const { FUSEDP_CUDA_CHECK(cudaSetDevice(device_)); }
  /// Waits for all work queued on the stream and reports any asynchronous error.
  void synchronize() const { FUSEDP_CUDA_CHECK(cudaStreamSynchronize(stream_.get())); }

 private:
  int device_;
  std::shared_ptr<CUstream_st> stream_;
};

}  // namespace fusedp
#endif  // FUSEDP_HAS_CUDA
