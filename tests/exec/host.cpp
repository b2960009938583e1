// tests include/fusedp/exec/host.hpp: the Host space's thread pool, run_on_all and parallel_for.
#include <doctest/doctest.h>

#include <fusedp/core/error.hpp>
#include <fusedp/exec/host.hpp>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using fusedp::Host;

TEST_CASE("parallel_for covers [0, n) exactly once with contiguous, ordered ranges") {
  for (int threads = 1; threads <= 4; ++threads) {
    const Host host{threads};
    REQUIRE(host.threads() == threads);
    for (std::size_t n : {0u, 1u, 2u, 3u, 5u, 1000u}) {
      CAPTURE(threads);
      CAPTURE(n);
      std::vector<std::atomic<int>> hits(n);
      std::vector<std::pair<std::size_t, std::size_t>> ranges(std::size_t(threads), {0, 0});
      std::atomic<int> calls{0}, bad_thread{0}, empty_ranges{0};
      host.parallel_for(n, [&](std::size_t begin, std::size_t end, int thread) {
        ++calls;
        if (thread < 0 || thread >= threads) {
          ++bad_thread;
          return;
        }
        if (begin >= end) ++empty_ranges;
        ranges[std::size_t(thread)] = {begin, end};
        for (std::size_t i = begin; i < end; ++i) hits[i].fetch_add(1);
      });
      CHECK(bad_thread == 0);
      CHECK(empty_ranges == 0);
      CHECK(calls == int(std::min<std::size_t>(n, std::size_t(threads))));
      bool once = true;
      for (auto& h : hits) once = once && h.load() == 1;
      CHECK(once);
      // Ranges ascend with the thread number (the split is a function of n and threads only).
      std::size_t next = 0;
      for (int t = 0; t < threads; ++t) {
        auto [b, e] = ranges[std::size_t(t)];
        if (b == e) continue;
        CHECK(b == next);
        next = e;
      }
      CHECK(next == n);
    }
  }
}

TEST_CASE("parallel_for splits the same way every time") {
  const Host host{3};
  std::vector<std::size_t> first(3), second(3);
  host.parallel_for(100, [&](std::size_t b, std::size_t, int t) { first[std::size_t(t)] = b; });
  host.parallel_for(100, [&](std::size_t b, std::size_t, int t) { second[std::size_t(t)] = b; });
  CHECK(first == second);
  CHECK(first == std::vector<std::size_t>{0, 33, 66});
}

TEST_CASE("run_on_all calls each thread once, the caller's thread as thread 0") {
  for (int threads = 1; threads <= 4; ++threads) {
    for (const Host& host : {Host{threads}, Host::dedicated(threads)}) {
      CAPTURE(threads);
      CAPTURE(host.cpu_threads());
      auto seen = std::vector<std::atomic<int>>(std::size_t(threads));
      auto ids = std::vector<std::thread::id>(std::size_t(threads));
      host.run_on_all([&](int t) {
        seen[std::size_t(t)].fetch_add(1);
        ids[std::size_t(t)] = std::this_thread::get_id();
      });
      for (auto& s : seen) CHECK(s.load() == 1);
      CHECK(ids[0] == std::this_thread::get_id());
      // Each thread its own when there are CPUs enough, or when dedicated.
      if (host.cpu_threads() == threads)
        for (int a = 0; a < threads; ++a)
          for (int b = a + 1; b < threads; ++b) CHECK(ids[std::size_t(a)] != ids[std::size_t(b)]);
    }
  }
}

TEST_CASE("many short regions in a row all complete") {
  const Host host{4};
  std::atomic<long> total{0};
  for (int r = 0; r < 2000; ++r)
    host.parallel_for(10, [&](std::size_t b, std::size_t e, int) { total += long(e - b); });
  CHECK(total == 20000);
}

TEST_CASE("an exception in a worker reaches the caller, and the pool stays usable") {
  for (int threads = 2; threads <= 4; ++threads) {
    const Host host{threads};
    for (int thrower = 0; thrower < threads; ++thrower) {
      CAPTURE(threads);
      CAPTURE(thrower);
      bool caught = false;
      try {
        host.parallel_for(100, [&](std::size_t, std::size_t, int t) {
          if (t == thrower) throw std::runtime_error("boom from " + std::to_string(t));
        });
      } catch (const std::runtime_error& e) {
        caught = true;
        CHECK(std::string(e.what()) == "boom from " + std::to_string(thrower));
      }
      CHECK(caught);
      std::atomic<int> count{0};
      host.parallel_for(100, [&](std::size_t b, std::size_t e, int) { count += int(e - b); });
      CHECK(count == 100);
    }
  }
}

// When the caller's thread (thread 0) and a worker both throw, the caller's exception is rethrown;
// the worker's must be dropped, not kept for the next region, which has nothing to do with it.
TEST_CASE("exceptions of one region never leak into the next one") {
  for (int threads = 2; threads <= 4; ++threads) {
    CAPTURE(threads);
    const Host host{threads};
    CHECK_THROWS_AS(host.run_on_all([](int) { throw std::logic_error("all"); }), std::logic_error);
    std::atomic<int> ran{0};
    CHECK_NOTHROW(host.run_on_all([&](int) { ++ran; }));
    CHECK(ran == threads);
    CHECK_NOTHROW(host.parallel_for(100, [](std::size_t, std::size_t, int) {}));
  }
}

TEST_CASE("an exception with a single thread propagates directly") {
  const Host host{1};
  CHECK_THROWS_AS(host.parallel_for(5, [](std::size_t, std::size_t, int) { throw std::out_of_range("x"); }),
                  std::out_of_range);
}

TEST_CASE("thread counts: negative throws, 0 means one per usable CPU, copies share the pool") {
  CHECK_THROWS_AS(Host{-1}, fusedp::InvalidArgument);
  CHECK_THROWS_WITH_AS(Host{-3}, doctest::Contains("-3"), fusedp::InvalidArgument);
  const Host automatic{0};
  CHECK(automatic.threads() == fusedp::cpu_budget().usable());
  CHECK(automatic.cpu_threads() == automatic.threads());
  const Host a{3};
  const Host b = a;  // NOLINT(performance-unnecessary-copy-initialization): copying is what is tested
  CHECK(b.threads() == 3);
  std::atomic<int> n{0};
  b.run_on_all([&](int) { ++n; });
  CHECK(n == 3);
  CHECK(std::string(Host::name) == "Host");
}

TEST_CASE("a pool is destroyed cleanly right after use and when never used") {
  for (int i = 0; i < 20; ++i) {
    const Host host{3};
    if (i % 2 == 0) host.parallel_for(3, [](std::size_t, std::size_t, int) {});
  }
  CHECK(true);
}
