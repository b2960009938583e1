#pragma once
// The Host execution space: the CPU with a fixed pool of worker threads.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/trace.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace fusedp {

namespace detail {

// A non-owning callable reference: a parallel region must not allocate, and std::function may.
class TaskRef {
 public:
  TaskRef() noexcept = default;
  template <class F>
  explicit TaskRef(F& f) noexcept : obj_(&f), call_([](void* o, int t) { (*static_cast<F*>(o))(t); }) {}
  void operator()(int t) const { call_(obj_, t); }

 private:
  void* obj_ = nullptr;
  void (*call_)(void*, int) = nullptr;
};

// Tells the core a spin loop is waiting (x86 `pause`), so a spinning thread yields pipeline resources
// and power; a plain loop elsewhere.
inline void cpu_relax() noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_ia32_pause();
#endif
}

// A fixed pool that runs one parallel region at a time. The caller's thread takes part as worker 0,
// so a pool of one thread runs everything inline.
//
// Costs that shape it (measured on a 2-core KVM guest, LeNet at batch 64 has ~30 regions per train
// step of 10-50 us each): a wake-up through a condition variable costs more than many regions, so
// workers spin for a while (spin_ns) before they sleep, and the caller bumps an atomic generation
// without taking a lock unless a worker sleeps. On a busy machine a worker can be descheduled for
// milliseconds; a region that allows it (parallel_for) lets the caller run the part of a worker that
// has not started yet, with that worker's index, so the result and the scratch slots used are the
// same, only the thread differs. run_on_all keeps one index per thread.
class ThreadPool {
 public:
  // How long an idle worker spins before sleeping: longer than the gap between two regions of a
  // train step, short enough not to burn a core between steps.
  static constexpr std::int64_t spin_ns = 200'000;

  explicit ThreadPool(int threads) : threads_(threads), claimed_(std::size_t(std::max(threads, 1))) {
    for (auto& c : claimed_) c.store(0, std::memory_order_relaxed);
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    {
      std::lock_guard lock(mutex_);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] int size() const noexcept { return threads_; }

  // Runs fn(thread) for every thread index, 0 on the caller's thread, and returns when all finished.
  // steal: the caller may run indices whose worker has not started them yet.
  void run(TaskRef fn, bool steal) {
    if (threads_ == 1) {
      fn(0);
      return;
    }
    std::lock_guard region(region_);  // one region at a time, whoever calls
    task_ = fn;
    remaining_.store(threads_ - 1, std::memory_order_relaxed);
    const std::uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
    generation_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      {
        std::lock_guard lock(mutex_);
      }
      wake_.notify_all();
    }
    std::exception_ptr error;
    try {
      fn(0);
    } catch (...) {
      error = std::current_exception();
    }
    if (steal)
      for (int t = 1; t < threads_; ++t)
        if (claim(t, g)) execute(t, error);
    for (int spin = 0; remaining_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < 4096) cpu_relax();
      else std::this_thread::yield();
    }
    std::exception_ptr worker_error;
    {
      std::lock_guard lock(mutex_);
      worker_error = std::exchange(worker_error_, nullptr);
    }
    if (!error) error = worker_error;
    if (error) std::rethrow_exception(error);
  }

 private:
  // Index t of generation g is run by exactly one thread: the one that moves claimed_[t] to g.
  bool claim(int t, std::uint64_t g) noexcept {
    std::uint64_t seen = claimed_[std::size_t(t)].load(std::memory_order_relaxed);
    while (seen < g)
      if (claimed_[std::size_t(t)].compare_exchange_weak(seen, g, std::memory_order_acq_rel)) return true;
    return false;
  }

  // Runs index t of the current region; the first exception is kept in `error`.
  void execute(int t, std::exception_ptr& error) noexcept {
    try {
      task_(t);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }

  void work(int t) {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto start = std::chrono::steady_clock::now();
        for (int spin = 1; g == seen; ++spin) {
          cpu_relax();
          g = generation_.load(std::memory_order_acquire);
          if (spin % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(spin_ns)) break;
        }
      }
      if (g == seen) {
        std::unique_lock lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      if (!claim(t, g)) continue;  // the caller ran this index already
      std::exception_ptr error;
      try {
        task_(t);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) {
        std::lock_guard lock(mutex_);
        if (!worker_error_) worker_error_ = error;
      }
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex region_;
  std::mutex mutex_;  // guards sleeping and worker_error_
  std::condition_variable wake_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::atomic<std::uint64_t>> claimed_;
  TaskRef task_;
  std::exception_ptr worker_error_;
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
    pool_->run(detail::TaskRef(fn), false);
  }

  /// Splits [0, n) into one contiguous range per thread and calls fn(begin, end, thread) for
  /// non-empty ranges. The split depends only on n and threads(), so results are reproducible. A
  /// range whose worker is late may run on the caller's thread, still with its own `thread` index.
  template <class F>
  void parallel_for(std::size_t n, F&& fn) const {
    const auto t = static_cast<std::size_t>(threads());
    if (t == 1 || n <= 1) {
      if (n > 0) fn(std::size_t(0), n, 0);
      return;
    }
    auto part = [&](int thread) {
      const std::size_t begin = n * std::size_t(thread) / t, end = n * (std::size_t(thread) + 1) / t;
      if (begin < end) fn(begin, end, thread);
    };
    pool_->run(detail::TaskRef(part), true);
  }

 private:
  std::shared_ptr<detail::ThreadPool> pool_;
};

/// The Host space's work is done when its calls return: the host clock times it.
template <>
struct trace::SpaceSpans<Host> {
  static Scope open(const Host&, const char* name, Kind kind, std::int64_t index = -1) noexcept {
    return Scope(name, kind, index);
  }
};

}  // namespace fusedp
