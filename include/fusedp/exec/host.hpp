#pragma once
// The Host execution space: the CPU with a fixed pool of worker threads.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <optional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fusedp {

namespace detail {

// A non-owning callable reference: a parallel region must not allocate, and std::function may.
class TaskRef {
 public:
  template <class F>
  explicit TaskRef(F& f) noexcept : obj_(&f), call_([](void* o, int t) { (*static_cast<F*>(o))(t); }) {}
  void operator()(int t) const { call_(obj_, t); }

 private:
  void* obj_;
  void (*call_)(void*, int);
};

// A fixed pool that runs one parallel region at a time. The caller's thread takes part as worker 0,
// so a pool of one thread runs everything inline. Workers spin briefly before sleeping: a train step
// runs dozens of short regions, and a wake-up through the condition variable alone costs more than
// many of them (LeNet at batch 64 has regions of 10-50 us).
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(threads) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] int size() const noexcept { return threads_; }

  // Runs fn(thread) on every thread of the pool, 0 on the caller's, and returns when all finished.
  void run(TaskRef fn) {
    if (threads_ == 1) {
      fn(0);
      return;
    }
    std::lock_guard region(region_);  // one region at a time, whoever calls
    task_ = fn;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    std::exception_ptr error;
    try {
      fn(0);
    } catch (...) {
      error = std::current_exception();
    }
    while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    task_.reset();
    {
      // Always take the worker's error, so it cannot resurface in a later region.
      std::lock_guard lock(mutex_);
      std::exception_ptr worker = std::exchange(worker_error_, nullptr);
      if (!error) error = std::move(worker);
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  void work(int t) {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t g = generation_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < 20000; ++spin) g = generation_.load(std::memory_order_acquire);
      if (g == seen) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_) return;
      try {
        (*task_)(t);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!worker_error_) worker_error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex region_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::optional<TaskRef> task_;
  std::exception_ptr worker_error_;
  bool stop_ = false;
};

}  // namespace detail

/// The CPU: runs every layer with a pool of threads. Copies share the pool.
struct Host {
  template <class T>
  using buffer = HostBuffer<T>;
  static constexpr const char* name = "Host";

  /// @param threads worker threads including the caller's; 0 means one per hardware thread.
  explicit Host(int threads = 0) {
    require(threads >= 0, "Host: thread count must be >= 0 (0 = one per hardware thread), got ", threads);
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    pool_ = std::make_shared<detail::ThreadPool>(threads);
  }

  [[nodiscard]] int threads() const noexcept { return pool_->size(); }

  /// Runs fn(thread) once on each thread of the pool (thread in [0, threads())).
  template <class F>
  void run_on_all(F&& fn) const {  // NOLINT: fn is only borrowed
    pool_->run(detail::TaskRef(fn));
  }

  /// Splits [0, n) into one contiguous range per thread and calls fn(begin, end, thread) for
  /// non-empty ranges. The split depends only on n and threads(), so results are reproducible.
  template <class F>
  void parallel_for(std::size_t n, F&& fn) const {
    const auto t = static_cast<std::size_t>(threads());
    if (t == 1 || n <= 1) {
      if (n > 0) fn(std::size_t(0), n, 0);
      return;
    }
    run_on_all([&](int thread) {
      const std::size_t begin = n * std::size_t(thread) / t, end = n * (std::size_t(thread) + 1) / t;
      if (begin < end) fn(begin, end, thread);
    });
  }

 private:
  std::shared_ptr<detail::ThreadPool> pool_;
};

}  // namespace fusedp
