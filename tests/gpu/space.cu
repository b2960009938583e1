// The Cuda space and its memory: clear errors without a device, for a bad device index, for running
// out of memory and for a bad launch; zeroed buffers and copies; FastDiv on the device.
#include "gpu_test.hpp"

#include <fusedp/kernels/cuda/fast_div.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace fp = fusedp;

namespace {
__global__ void divide_kernel(const int* divisors, const int* numbers, int count, int* quotients, int* remainders) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  const fp::kernels::cuda::FastDiv f(divisors[i]);
  f.divmod(numbers[i], quotients[i], remainders[i]);
}
__global__ void empty_kernel() {}
}  // namespace

TEST_CASE("a missing or bad device is a DeviceError that says why") {
  const int count = fp::cuda_device_count();
  if (count == 0) {
    // This branch runs on machines without a GPU: the error must name the reason.
    try {
      fp::Cuda c{0};
      FAIL("Cuda{0} constructed without a device");
    } catch (const fp::DeviceError& e) {
      const std::string what = e.what();
      MESSAGE("without a device: " << what);
      CHECK(what.find("no such device") != std::string::npos);
      CHECK(what.find(fp::cuda_unavailable_reason()) != std::string::npos);
    }
    return;
  }
  try {
    fp::Cuda c{count};
    FAIL("Cuda{count} constructed");
  } catch (const fp::DeviceError& e) {
    CHECK(std::string(e.what()).find("CUDA device(s) found") != std::string::npos);
  }
  CHECK_THROWS_AS(fp::Cuda{-1}, fp::DeviceError);
}

TEST_CASE("the space describes its device") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Cuda c{0};
  CHECK(c.sm_count() > 0);
  CHECK(c.architecture() >= 50);
  CHECK(c.shared_memory_per_block() >= 48 * 1024);
  MESSAGE("device 0: sm_" << c.architecture() << ", " << c.sm_count() << " SMs, "
                          << c.shared_memory_per_block() << " bytes of shared memory per block");
  // another precision on the same device and stream
  const fp::CudaFp32 exact(c);
  CHECK(exact.stream() == c.stream());
}

TEST_CASE("running out of device memory is a DeviceError with the size asked for") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Cuda c{0};
  const std::size_t n = std::size_t(1) << 46;  // 256 TiB of floats
  try {
    fp::DeviceBuffer<float> b(n);
    FAIL("allocated 256 TiB");
  } catch (const fp::DeviceError& e) {
    const std::string what = e.what();
    MESSAGE(what);
    CHECK(what.find(std::to_string(n * sizeof(float)) + " bytes") != std::string::npos);
    CHECK(what.find("MiB free") != std::string::npos);
  }
  // and the device still works afterwards
  fp::DeviceBuffer<float> small(16);
  CHECK(small.size() == 16);
}

TEST_CASE("a launch that cannot run is reported by the launch check") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Cuda c{0};
  empty_kernel<<<1, 4096, 0, c.stream()>>>();  // more threads than any device allows in a block
  CHECK_THROWS_AS(FUSEDP_CUDA_CHECK_LAUNCH("empty_kernel"), fp::DeviceError);
  empty_kernel<<<1, 32, 0, c.stream()>>>();
  CHECK_NOTHROW(FUSEDP_CUDA_CHECK_LAUNCH("empty_kernel"));
  c.synchronize();
}

TEST_CASE("device buffers start zeroed and copies round-trip") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Cuda c{0};
  fp::DeviceBuffer<float> d(1000);
  const auto zeros = gpu_test::download(c, d);
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](float v) { return v == 0.0f; }));
  const auto values = gpu_test::random_values(1000, 1);
  fp::PinnedBuffer<float> pinned(1000);
  std::copy(values.begin(), values.end(), pinned.data());
  fp::copy_async(d.data(), pinned.data(), 1000, c.stream());
  CHECK(gpu_test::download(c, d) == values);
}

TEST_CASE("FastDiv on the device agrees with the host") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fp::Cuda c{0};
  std::vector<int> divisors, numbers;
  for (int d = 1; d < 600; ++d)
    for (int n : {0, 1, d - 1, d, 7 * d + 3, 65535, 1 << 20, (1 << 30) + 5, 0x7fffffff}) {
      divisors.push_back(d);
      numbers.push_back(n);
    }
  const int count = int(divisors.size());
  auto dd = gpu_test::upload(c, divisors), dn = gpu_test::upload(c, numbers);
  fp::DeviceBuffer<int> q(divisors.size()), r(divisors.size());
  divide_kernel<<<(count + 255) / 256, 256, 0, c.stream()>>>(dd.data(), dn.data(), count, q.data(), r.data());
  FUSEDP_CUDA_CHECK_LAUNCH("divide_kernel");
  const auto qh = gpu_test::download(c, q), rh = gpu_test::download(c, r);
  for (int i = 0; i < count; ++i) {
    REQUIRE_MESSAGE(qh[std::size_t(i)] == numbers[std::size_t(i)] / divisors[std::size_t(i)],
                    numbers[std::size_t(i)] << " / " << divisors[std::size_t(i)]);
    REQUIRE(rh[std::size_t(i)] == numbers[std::size_t(i)] % divisors[std::size_t(i)]);
  }
}
