// Tests of include/fusedp/data/loader.hpp and augment.hpp: batches in sampler order, the last batch
// kept or dropped, augmentation against a direct pad-crop-flip reference, normalization, determinism
// with and without prefetch, resuming at a batch, and no allocation per batch.
#include "fusedp/data/loader.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <set>
#include <thread>
#include <vector>

// Counts every allocation of the process (the loader's worker thread included). g++ sees the
// replaced operators inlined into std::allocator and warns that free() meets new; they do match.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
namespace {
std::atomic<std::size_t> allocations{0};
}
void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

namespace fd = fusedp::data;
using fd::Augment;
using fd::DataLoader;
using fd::Dataset;
using fd::DistributedSampler;

// n samples of C x H x W with distinct values, labels i % 10.
Dataset images(std::size_t n, std::size_t c = 3, std::size_t h = 6, std::size_t w = 5) {
  std::vector<float> x(n * c * h * w);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(i % 1000) / 1000.0f + 0.001f;
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::int32_t(i % 10);
  return fd::make_dataset(std::move(x), std::move(y), c, h, w, 10);
}

struct Epoch {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<std::int32_t>> labels;
  std::vector<std::vector<std::size_t>> indices;
  bool operator==(const Epoch&) const = default;
};

Epoch run_epoch(DataLoader& loader, std::uint64_t epoch, fd::EpochPosition start = {}, bool jitter = false) {
  loader.set_epoch(epoch, start);
  Epoch e;
  std::size_t expect = 0;
  while (auto b = loader.next()) {
    REQUIRE(b->index == expect++);
    e.images.emplace_back(b->images.begin(), b->images.end());
    e.labels.emplace_back(b->labels.begin(), b->labels.end());
    e.indices.emplace_back(b->indices.begin(), b->indices.end());
    if (jitter) std::this_thread::sleep_for(std::chrono::microseconds((b->index * 37) % 200));
  }
  REQUIRE(expect == loader.batches());
  return e;
}

// The transform written the obvious way: pad into a bigger image, crop, flip, normalize.
std::vector<float> reference(const Dataset& d, std::size_t s, const Augment& a, const fd::AugmentDraw& draw,
                             const fd::Normalization& n) {
  const std::size_t C = d.channels, H = d.height, W = d.width, p = a.crop_padding;
  const std::size_t PH = H + 2 * p, PW = W + 2 * p;
  std::vector<float> padded(C * PH * PW, 0.0f);
  for (std::size_t c = 0; c < C; ++c)
    for (std::size_t y = 0; y < H; ++y)
      for (std::size_t x = 0; x < W; ++x)
        padded[(c * PH + y + p) * PW + x + p] = d.images[s * C * H * W + (c * H + y) * W + x];
  std::vector<float> out(C * H * W);
  for (std::size_t c = 0; c < C; ++c)
    for (std::size_t y = 0; y < H; ++y)
      for (std::size_t x = 0; x < W; ++x) {
        const float v = padded[(c * PH + y + draw.dy) * PW + x + draw.dx];
        const std::size_t ox = draw.flip ? W - 1 - x : x;
        const float m = n.enabled() ? n.mean[n.mean.size() == 1 ? 0 : c] : 0.0f;
        const float sd = n.enabled() ? n.stddev[n.stddev.size() == 1 ? 0 : c] : 1.0f;
        out[(c * H + y) * W + ox] = n.enabled() ? (v - m) / sd : v;
      }
  return out;
}

}  // namespace

TEST_CASE("batches follow the sampler's order; the last smaller batch is kept or dropped") {
  const Dataset d = images(23);
  DistributedSampler sampler{23, 1, 0, {.seed = 5}};
  for (std::size_t prefetch : {0u, 1u, 3u}) {
    CAPTURE(prefetch);
    DataLoader keep{d, sampler, {.batch = 5, .prefetch = prefetch}};
    CHECK(keep.batches() == 5);
    const Epoch e = run_epoch(keep, 2);
    sampler.set_epoch(2);
    std::vector<std::size_t> all;
    for (const auto& i : e.indices) all.insert(all.end(), i.begin(), i.end());
    CHECK(all == std::vector<std::size_t>(sampler.indices().begin(), sampler.indices().end()));
    CHECK(e.indices.back().size() == 3);
    for (std::size_t b = 0; b < e.indices.size(); ++b)
      for (std::size_t i = 0; i < e.indices[b].size(); ++i) {
        const std::size_t s = e.indices[b][i];
        CHECK(e.labels[b][i] == d.labels[s]);
        CHECK(std::equal(e.images[b].begin() + std::ptrdiff_t(i * 90), e.images[b].begin() + std::ptrdiff_t(i * 90 + 90),
                         d.images.begin() + std::ptrdiff_t(s * 90)));
      }

    DataLoader drop{d, sampler, {.batch = 5, .drop_last = true, .prefetch = prefetch}};
    CHECK(drop.batches() == 4);
    const Epoch e2 = run_epoch(drop, 2);
    CHECK(e2.indices.size() == 4);
    CHECK(std::equal(e2.indices.begin(), e2.indices.end(), e.indices.begin()));
  }
}

TEST_CASE("a rank's loader batches its shard") {
  const Dataset d = images(10);
  std::set<std::size_t> seen;
  for (std::size_t r = 0; r < 3; ++r) {
    DataLoader loader{d, DistributedSampler{10, 3, r, {.seed = 1}}, {.batch = 2}};
    CHECK(loader.batches() == 2);  // 4 samples per rank (padded), 2 batches of 2
    const Epoch e = run_epoch(loader, 0);
    for (const auto& b : e.indices) seen.insert(b.begin(), b.end());
  }
  CHECK(seen.size() == 10);
}

TEST_CASE("augmentation is the pad-crop-flip of torchvision, then normalization") {
  const Dataset d = images(40, 3, 6, 5);
  const Augment a{.crop_padding = 2, .flip = true};
  const fd::Normalization n{{0.5f, 0.4f, 0.3f}, {0.2f, 0.25f, 0.3f}};
  DataLoader loader{d, {.batch = 8, .prefetch = 1, .augment = a, .normalize = n, .seed = 77}, {.seed = 3}};
  const Epoch e = run_epoch(loader, 4);
  std::set<std::pair<std::size_t, std::size_t>> offsets;
  int flips = 0, samples = 0;
  for (std::size_t b = 0; b < e.indices.size(); ++b)
    for (std::size_t i = 0; i < e.indices[b].size(); ++i) {
      const std::size_t s = e.indices[b][i];
      const fd::AugmentDraw draw = fd::draw_augment(a, 77, 4, s);
      CHECK(draw.dy <= 4);
      CHECK(draw.dx <= 4);
      offsets.insert({draw.dy, draw.dx});
      flips += draw.flip;
      ++samples;
      const std::vector<float> ref = reference(d, s, a, draw, n);
      CHECK(std::equal(ref.begin(), ref.end(), e.images[b].begin() + std::ptrdiff_t(i * 90)));
    }
  CHECK(offsets.size() > 10);  // many of the 25 offsets occur
  CHECK(flips > 5);
  CHECK(flips < samples - 5);
  // padding becomes (0 - mean) / stddev: some sample has it
  bool padded = false;
  for (const auto& img : e.images)
    for (float v : img) padded = padded || v == (0.0f - 0.5f) / 0.2f;
  CHECK(padded);
}

TEST_CASE("the same seed gives the same batches, with prefetch on or off, whatever the timing") {
  const Dataset d = images(57);
  auto make = [&](std::size_t prefetch, std::uint64_t seed) {
    return std::make_unique<DataLoader>(
        d, DistributedSampler{57, 2, 1, {.seed = seed}},
        fd::LoaderOptions{.batch = 4, .prefetch = prefetch, .augment = {.crop_padding = 1, .flip = true},
                          .normalize = {{0.5f}, {0.25f}}, .seed = seed});
  };
  auto inline_loader = make(0, 11);
  const Epoch e1 = run_epoch(*inline_loader, 1);
  const Epoch e2 = run_epoch(*inline_loader, 2);
  CHECK(e1 != e2);  // a new epoch, a new order and new draws
  for (std::size_t prefetch : {1u, 2u, 5u}) {
    CAPTURE(prefetch);
    auto p = make(prefetch, 11);
    CHECK(run_epoch(*p, 1, {}, true) == e1);
    CHECK(run_epoch(*p, 2) == e2);
    CHECK(run_epoch(*p, 1) == e1);  // epochs can be revisited
  }
  auto other = make(1, 12);
  CHECK(run_epoch(*other, 1) != e1);
}

TEST_CASE("set_epoch at a position continues where a checkpoint left off; abandoning an epoch is safe") {
  const Dataset d = images(30);
  DataLoader loader{d, {.batch = 4, .prefetch = 2, .augment = {.flip = true}, .seed = 1}, {.seed = 2}};
  const Epoch full = run_epoch(loader, 3);
  CHECK(loader.position() == fd::EpochPosition{30});  // the end of the epoch: its last batch of 2 included
  const Epoch tail = run_epoch(loader, 3, {20});  // after 5 batches of 4
  REQUIRE(tail.indices.size() == full.indices.size() - 5);
  CHECK(std::equal(tail.images.begin(), tail.images.end(), full.images.begin() + 5));
  CHECK(std::equal(tail.indices.begin(), tail.indices.end(), full.indices.begin() + 5));
  // take two batches of epoch 4, then switch: the worker's prefetched batches of epoch 4 are dropped
  loader.set_epoch(4);
  (void)loader.next();
  (void)loader.next();
  CHECK(loader.batches_given() == 2);
  CHECK(loader.position() == fd::EpochPosition{8});
  CHECK(run_epoch(loader, 3) == full);
  // at the end of an epoch next() keeps returning nothing
  CHECK_FALSE(loader.next().has_value());
  CHECK_FALSE(loader.next().has_value());
  loader.set_epoch(5);
  (void)loader.next();
  // the destructor stops the worker mid-epoch
}

TEST_CASE("regression datasets yield float targets") {
  std::vector<float> x(20), t(10);
  for (std::size_t i = 0; i < 10; ++i) {
    x[2 * i] = float(i);
    x[2 * i + 1] = -float(i);
    t[i] = float(i) * 0.5f;
  }
  const Dataset d = fd::make_regression_dataset(x, t, 2, 1);
  DataLoader loader{d, {.batch = 3}, {.seed = 4}};
  loader.set_epoch(0);
  std::size_t n = 0;
  while (auto b = loader.next()) {
    CHECK(b->labels.empty());
    REQUIRE(b->targets.size() == b->size());
    for (std::size_t i = 0; i < b->size(); ++i) {
      CHECK(b->targets[i] == float(b->indices[i]) * 0.5f);
      CHECK(b->images[2 * i] == float(b->indices[i]));
    }
    n += b->size();
  }
  CHECK(n == 10);
}

TEST_CASE("after the first epoch, batches allocate nothing (prefetch on and off)") {
  const Dataset d = images(200, 3, 8, 8);
  for (std::size_t prefetch : {0u, 1u, 2u}) {
    CAPTURE(prefetch);
    const std::size_t at_start = allocations.load();
    DataLoader loader{d, DistributedSampler{200, 2, 0, {.seed = 1}},
                      {.batch = 16, .prefetch = prefetch, .augment = {.crop_padding = 2, .flip = true},
                       .normalize = {{0.5f, 0.5f, 0.5f}, {0.2f, 0.2f, 0.2f}}}};
    CHECK(allocations.load() > at_start);  // the counter sees the loader's own allocations
    double sum = 0;
    loader.set_epoch(1);
    while (auto b = loader.next()) sum += b->images[0];
    const std::size_t before = allocations.load();
    for (std::uint64_t epoch = 2; epoch <= 4; ++epoch) {
      loader.set_epoch(epoch);
      while (auto b = loader.next()) sum += b->images[0];
    }
    const std::size_t during = allocations.load() - before;
    CHECK(during == 0);
    CHECK(sum != 0);
  }
}

TEST_CASE("bad loader arguments are InvalidArgument") {
  const Dataset d = images(10);
  CHECK_THROWS_WITH_AS(DataLoader(d, DistributedSampler{9}, {}), doctest::Contains("sampler is for 9 samples"),
                       fusedp::InvalidArgument);
  CHECK_THROWS_WITH_AS(DataLoader(d, {.batch = 0}), doctest::Contains("batch must be > 0"), fusedp::InvalidArgument);
  CHECK_THROWS_WITH_AS(DataLoader(d, {.normalize = {{0.5f, 0.5f}, {1.0f, 1.0f}}}),
                       doctest::Contains("2 values for images of 3 channels"), fusedp::InvalidArgument);
  CHECK_THROWS_WITH_AS(DataLoader(d, {.normalize = {{0.5f}, {0.0f}}}), doctest::Contains("stddev[0] must be"),
                       fusedp::InvalidArgument);
  DataLoader ok{d, {.batch = 4}};
  CHECK_THROWS_WITH_AS(ok.set_epoch(0, {11}), doctest::Contains("a start at sample 11 of an epoch of 10"),
                       fusedp::InvalidArgument);
  Dataset broken = d;
  broken.labels[3] = 10;
  CHECK_THROWS_WITH_AS(DataLoader(broken, {}), doctest::Contains("label of sample 3 is 10"), fusedp::DataError);
}
