// DeviceLoader (data/device_loader.hpp): the batches that arrive on the device are the host loader's,
// bit for bit, for every epoch, with a resume in the middle of one; the copy stream never overwrites a
// slot the model's stream still reads (a slow kernel on the compute stream would expose it); training
// from device batches gives exactly the parameters that training from the host batches gives.
#include "gpu_test.hpp"

#include <fusedp/data/device_loader.hpp>
#include <fusedp/data/loader.hpp>

#include <vector>

namespace fp = fusedp;
namespace fd = fusedp::data;
using namespace gpu_test;

namespace {

using Small = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                             fp::Linear<10>>;

fd::Dataset images(std::size_t n) {
  std::vector<float> x = random_values(n * 3 * 8 * 8, 70, 0.0f, 1.0f);
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::int32_t((i * 7) % 10);
  return fd::make_dataset(std::move(x), std::move(y), 3, 8, 8, 10);
}

fd::LoaderOptions options() {
  return {.batch = 16, .prefetch = 2, .augment = {.crop_padding = 2, .flip = true}, .seed = 5};
}

// Spins on the device for about `cycles` clock ticks: makes the compute stream slow, so a copy that
// did not wait for it would overwrite a slot before the kernel that reads it runs.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Sums a batch on the device after the spin: what the compute stream sees of the slot.
__global__ void checksum(const float* x, std::size_t n, const std::int32_t* y, std::size_t m, double* out) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += double(x[i]) * double(i % 13 + 1);
  for (std::size_t i = 0; i < m; ++i) s += double(y[i]) * 1000.0;
  *out = s;
}

double host_checksum(std::span<const float> x, std::span<const std::int32_t> y) {
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += double(x[i]) * double(i % 13 + 1);
  for (std::size_t i = 0; i < y.size(); ++i) s += double(y[i]) * 1000.0;
  return s;
}

}  // namespace

TEST_CASE("DeviceLoader delivers the host loader's batches, bit for bit, every epoch and after a resume") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fd::Dataset data = images(150);  // 10 batches of 16, the last of 6
  const fp::Cuda space{0};
  fd::DataLoader host{data, fd::DistributedSampler{data.count, 2, 1, {.shuffle = true, .seed = 9}}, options()};
  fd::DeviceLoader device{data, fd::DistributedSampler{data.count, 2, 1, {.shuffle = true, .seed = 9}}, options(),
                          space};
  CHECK(device.batches() == host.batches());
  for (std::uint64_t epoch = 1; epoch <= 3; ++epoch) {
    const fd::EpochPosition first{epoch == 2 ? std::size_t(3 * 16 * 2) : 0};  // after 3 batches of 16 on 2 ranks
    host.set_epoch(epoch, first);
    device.set_epoch(epoch, first);
    std::size_t count = 0;
    while (auto h = host.next()) {
      auto d = device.next();
      REQUIRE(d.has_value());
      CHECK(d->index == h->index);
      CHECK(d->size() == h->size());
      CHECK(device.position() == host.position());
      space.synchronize();  // next() ordered the copy before the space's stream
      CHECK(download(space, std::span<const float>(d->images.data, d->images.size)) ==
            std::vector<float>(h->images.begin(), h->images.end()));
      CHECK(download(space, std::span<const std::int32_t>(d->labels.data, d->labels.size)) ==
            std::vector<std::int32_t>(h->labels.begin(), h->labels.end()));
      CHECK(d->targets.size == 0);
      ++count;
    }
    CHECK_FALSE(device.next().has_value());
    CHECK(count == host.batches());  // the rest of the epoch after `first`
    CHECK(device.position() == fd::EpochPosition{data.count});
  }
}

TEST_CASE("DeviceLoader: a slow compute stream never sees a slot overwritten") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fd::Dataset data = images(200);
  const fp::Cuda space{0};
  fd::DataLoader host{data, options(), {.shuffle = true, .seed = 3}};
  fd::DeviceLoader device{data, options(), space, {.shuffle = true, .seed = 3}};
  host.set_epoch(1);
  device.set_epoch(1);
  const std::size_t n = device.batches();
  fp::DeviceBuffer<double> sums(n);
  std::vector<double> want;
  // Everything is queued without a host wait: each batch's checksum runs after a long spin, while the
  // loader copies the next batches into the slots.
  while (auto d = device.next()) {
    spin<<<1, 1, 0, space.stream()>>>(2'000'000);
    checksum<<<1, 1, 0, space.stream()>>>(d->images.data, d->images.size, d->labels.data, d->labels.size,
                                          sums.data() + d->index);
    auto h = host.next();
    REQUIRE(h.has_value());
    want.push_back(host_checksum(h->images, h->labels));
  }
  FUSEDP_CUDA_CHECK(cudaGetLastError());
  space.synchronize();
  CHECK(download(space, std::span<const double>(sums.data(), n)) == want);
}

TEST_CASE_TEMPLATE("training from device batches equals training from host batches", Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const fd::Dataset data = images(120);
  fp::Model<Small, Space> a{fp::seed(8), make_space<Space>()}, b{fp::seed(8), make_space<Space>()};
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1;
  fd::DataLoader host{data, options(), {.shuffle = true, .seed = 4}};
  fd::DeviceLoader device{data, options(), b.space(), {.shuffle = true, .seed = 4}};
  for (std::uint64_t epoch = 1; epoch <= 2; ++epoch) {
    host.set_epoch(epoch);
    device.set_epoch(epoch);
    while (auto h = host.next()) {
      const float la = a.train_step(h->images, h->labels, fp::SoftmaxCrossEntropy{}, o1);
      auto d = device.next();
      REQUIRE(d.has_value());
      b.train_step_async(d->images, d->labels, fp::SoftmaxCrossEntropy{}, o2);
      CHECK(b.last_loss() == la);
    }
  }
  CHECK(params_on_host(a) == params_on_host(b));
}
