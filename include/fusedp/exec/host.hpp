#pragma once
// The Host execution space: the CPU with a fixed pool of worker threads.
#include "fusedp/core/buffer.hpp"
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cpu_budget.hpp"
#include "fusedp/exec/cpu_features.hpp"
#include "fusedp/exec/precision.hpp"
#include "fusedp/exec/trace.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
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

// A fixed pool that runs one parallel region at a time. A region has `parts` indices (the split of the
// work and the scratch slot of each piece depend only on them); `runners` threads run them, the
// caller's thread as runner 0, so a pool of one runner runs everything inline.
//
// Costs that shape it (measured on a 2-core KVM guest, LeNet at batch 64 has ~30 regions per train
// step of 10-50 us each): a wake-up through a condition variable costs more than many regions, so
// workers spin for a while (spin_ns) before they sleep, and the caller bumps an atomic generation
// without taking a lock unless a worker sleeps. On a busy machine a worker can be descheduled for
// milliseconds; a region that allows it (parallel_for) lets the caller run the part of a worker that
// has not started yet, with that worker's index, so the result and the scratch slots used are the
// same, only the thread differs.
//
// More parts than CPUs: Host gives such a pool one runner per CPU, each running its share of the
// parts and then any part not begun, so 16 parts on 1 CPU cost what the work costs (measured: LeNet
// under `taskset -c 0` with 16 threads took 17.2 s an epoch when each part had a spinning thread of
// its own, 2.5 s with 1 thread). A pool whose runners must each be a thread of their own (replicas
// that meet in collectives) and outnumber the CPUs does not spin: its threads sleep while they wait.
class ThreadPool {
 public:
  // How long an idle worker spins before sleeping: longer than the gap between two regions of a
  // train step, short enough not to burn a core between steps.
  static constexpr std::int64_t spin_ns = 200'000;

  // parts >= 1 indices per region, 1 <= runners <= parts threads; spin: idle threads spin before
  // they sleep (only when every runner has a CPU).
  ThreadPool(int parts, int runners, bool spin)
      : parts_(parts), runners_(runners), spin_(spin), claimed_(std::size_t(std::max(parts, 1))) {
    for (auto& c : claimed_) c.store(0, std::memory_order_relaxed);
    for (int w = 1; w < runners_; ++w) workers_.emplace_back([this, w] { work(w); });
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

  [[nodiscard]] int size() const noexcept { return parts_; }
  [[nodiscard]] int runners() const noexcept { return runners_; }

  // Runs fn(part) for every part, and returns when all finished; the error of the lowest part that
  // threw is rethrown. steal: a runner may run parts of others that have not begun (always when parts
  // outnumber runners).
  void run(TaskRef fn, bool steal) {
    if (runners_ == 1) {
      for (int t = 0; t < parts_; ++t) fn(t);
      return;
    }
    std::lock_guard region(region_);  // one region at a time, whoever calls
    task_ = fn;
    {
      std::lock_guard lock(mutex_);
      error_part_ = parts_;
      error_ = nullptr;
    }
    steal_.store(steal || parts_ > runners_, std::memory_order_relaxed);
    remaining_.store(parts_, std::memory_order_relaxed);
    const std::uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
    generation_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      {
        std::lock_guard lock(mutex_);
      }
      wake_.notify_all();
    }
    take_part(0, g);
    if (spin_) {
      for (int spin = 0; remaining_.load(std::memory_order_acquire) != 0; ++spin) {
        if (spin < 4096) cpu_relax();
        else std::this_thread::yield();
      }
    } else {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
    }
    std::exception_ptr error;
    {
      std::lock_guard lock(mutex_);
      error = std::exchange(error_, nullptr);
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  // Part t of generation g is run by exactly one thread: the one that moves claimed_[t] to g.
  bool claim(int t, std::uint64_t g) noexcept {
    std::uint64_t seen = claimed_[std::size_t(t)].load(std::memory_order_relaxed);
    while (seen < g)
      if (claimed_[std::size_t(t)].compare_exchange_weak(seen, g, std::memory_order_acq_rel)) return true;
    return false;
  }

  // Runner r's share of generation g: its own parts (r, r + runners, ...), then, when stealing, any
  // part not begun.
  void take_part(int r, std::uint64_t g) noexcept {
    for (int t = r; t < parts_; t += runners_)
      if (claim(t, g)) execute(t);
    if (steal_.load(std::memory_order_relaxed))
      for (int t = 0; t < parts_; ++t)
        if (claim(t, g)) execute(t);
  }

  void execute(int t) noexcept {
    try {
      task_(t);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (t < error_part_) {
        error_part_ = t;
        error_ = std::current_exception();
      }
    }
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1 && !spin_) {
      std::lock_guard lock(mutex_);
      done_.notify_one();
    }
  }

  void work(int r) {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen && spin_) {
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
      take_part(r, g);
    }
  }

  int parts_;
  int runners_;
  bool spin_;
  std::vector<std::thread> workers_;
  std::mutex region_;
  std::mutex mutex_;  // guards sleeping, the end of a region without spinning, and error_
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> steal_{false};
  std::vector<std::atomic<std::uint64_t>> claimed_;
  TaskRef task_;
  int error_part_ = 0;
  std::exception_ptr error_;
};

// The line said (once a process) when a Host is given more threads than its process has CPUs.
inline std::string host_fit_note(int asked, int runners, const CpuBudget& budget) {
  std::ostringstream s;
  const int cpus = budget.usable();
  s << "fusedp: Host: " << asked << " threads asked for, but this process may use " << cpus << " CPU"
    << (cpus == 1 ? "" : "s") << " (" << budget.limits() << "); ";
  if (runners < asked)
    s << "each region still splits into " << asked << " parts, as on " << asked << " CPUs, run by " << runners
      << " thread" << (runners == 1 ? "" : "s");
  else
    s << "its " << asked << " threads sleep instead of spinning while they wait";
  return s.str();
}

// How many Hosts were given more threads than CPUs in this process; the note is printed for the first.
inline std::atomic<int>& host_fit_notes() noexcept {
  static std::atomic<int> n{0};
  return n;
}

}  // namespace detail

/// A Host's precision policy, chosen at construction: the arithmetic of its GEMMs and, for a float
/// Model, what its activations and their gradients are stored as (net/activation_storage.hpp).
enum class HostPrecision : unsigned char {
  fp32,  ///< fp32 operands and fused multiply-adds (precision::Fp32, the default)
  bf16,  ///< operands rounded to bfloat16 as they are packed, fp32 sums (precision::Bf16): AMX tiles where
         ///< the CPU has them (Host::bf16_tiles), else VDPBF16PS;
         ///< a float Model's activations and their gradients stored as bf16 values (activation_storage.hpp)
  /// The bf16 arithmetic computed with fp32 instructions, bit for bit what VDPBF16PS computes on
  /// normal numbers, several times slower, with the same bf16 storage: for testing bf16 results on CPUs
  /// without AVX-512 BF16.
  bf16_emulated,
};

/// The name of a precision in messages and on command lines: "fp32", "bf16", "bf16 (emulated)".
[[nodiscard]] constexpr const char* to_string(HostPrecision p) noexcept {
  return p == HostPrecision::fp32 ? "fp32" : p == HostPrecision::bf16 ? "bf16" : "bf16 (emulated)";
}

/// The CPU: runs every layer with a pool of threads. Copies share the pool.
struct Host {
  template <class T>
  using buffer = HostBuffer<T>;
  static constexpr const char* name = "Host";

  /// @param threads the parts each parallel region splits into, one per thread; 0: one per CPU this
  ///        process may use (its affinity mask and cgroup quota, shared among the ranks of its machine:
  ///        cpu_budget()). More than that is allowed and says so once on stderr: the split (and so every
  ///        result) stays that of `threads` threads, run by one thread per CPU.
  explicit Host(int threads = 0) : Host(threads, false) {}

  /// A Host whose conv and linear GEMMs run at precision `P` (precision::Fp32 or precision::Bf16).
  /// Bf16 needs AVX-512 BF16 (VDPBF16PS); on a CPU without it this throws InvalidArgument saying so.
  template <class P>
  Host(int threads, P) : Host(threads, false) {
    static_assert(std::is_same_v<P, precision::Fp32> || std::is_same_v<P, precision::Bf16>,
                  "fusedp::Host: the Host's precisions are precision::Fp32 and precision::Bf16 (Tf32 is Cuda's)");
    if constexpr (std::is_same_v<P, precision::Bf16>) precision_ = checked(HostPrecision::bf16);
  }
  /// A Host at precision `p`; bf16 is checked as above.
  Host(int threads, HostPrecision p) : Host(threads, false) { precision_ = checked(p); }

  /// The precision of this Host's GEMMs.
  [[nodiscard]] HostPrecision precision() const noexcept { return precision_; }
  /// The same pool of threads at precision `p` (checked as the constructor checks it).
  [[nodiscard]] Host with_precision(HostPrecision p) const {
    Host h = *this;
    h.precision_ = checked(p);
    return h;
  }

  /// Whether this Host's bf16 GEMMs run on AMX tiles (TDPBF16PS) where a product is deep enough (16 or
  /// more along k): at precision bf16 on a CPU with AMX, unless with_bf16_tiles(false) turned them off.
  /// The tiles add the products of a row in another order than VDPBF16PS, so their bits differ from
  /// bf16_emulated's (within the same bound against the exact sum; kernels/host/gemm_bf16.hpp).
  [[nodiscard]] bool bf16_tiles() const noexcept {
    return precision_ == HostPrecision::bf16 && !tiles_off_ && amx_usable();
  }
  /// The same pool of threads with AMX tiles allowed or not: off gives VDPBF16PS's bits on any
  /// AVX-512 BF16 CPU; on throws InvalidArgument where the CPU or the OS offers no AMX (amx_usable).
  [[nodiscard]] Host with_bf16_tiles(bool on) const {
    if (on && !amx_usable())
      throw InvalidArgument(cpu_features().amx_bf16
                                ? "Host: AMX tiles (TDPBF16PS) asked for, but the OS did not grant their state to this process"
                                : "Host: AMX tiles (TDPBF16PS) asked for, but this CPU has none");
    Host h = *this;
    h.tiles_off_ = !on;
    return h;
  }

  /// A Host with one thread of its own per part even beyond the CPUs, for run_on_all bodies that wait
  /// for each other (replicas in one process meet in collectives). Beyond the CPUs they do not spin.
  [[nodiscard]] static Host dedicated(int threads) { return Host(threads, true); }

  /// The parts of each region (the thread count asked for).
  [[nodiscard]] int threads() const noexcept { return pool_->size(); }
  /// The threads that run them: threads(), or the CPUs this process may use when it asked for more.
  [[nodiscard]] int cpu_threads() const noexcept { return pool_->runners(); }

  /// Runs fn(thread) once for each thread in [0, threads()). Only a dedicated Host gives every call a
  /// thread of its own; elsewhere calls may share one, so they must not wait for each other.
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
  Host(int threads, bool dedicated) {
    require(threads >= 0, "Host: thread count must be >= 0 (0 = one per CPU this process may use), got ", threads);
    const CpuBudget budget = cpu_budget();
    const int cpus = budget.usable();
    if (threads == 0) threads = cpus;
    const int runners = dedicated ? threads : std::min(threads, cpus);
    if (threads > cpus && detail::host_fit_notes().fetch_add(1) == 0)
      std::fprintf(stderr, "%s\n", detail::host_fit_note(threads, runners, budget).c_str());
    pool_ = std::make_shared<detail::ThreadPool>(threads, runners, runners <= cpus);
  }

  static HostPrecision checked(HostPrecision p) {
    if (p != HostPrecision::bf16 || cpu_features().avx512_bf16) return p;
    const std::string why = !FUSEDP_X86_CPUID ? "this translation unit cannot use it (not x86-64 GCC or Clang, or "
                                                "compiled by nvcc, whose Host kernels are scalar)"
                            : cpu_features().avx512f ? "this CPU has AVX-512 without it"
                                                     : "this CPU has no AVX-512";
    throw InvalidArgument("Host: precision bf16 needs a CPU with AVX-512 BF16 (VDPBF16PS), and " + why +
                          "; use precision fp32 (or HostPrecision::bf16_emulated to check bf16 results slowly)");
  }

  std::shared_ptr<detail::ThreadPool> pool_;
  HostPrecision precision_ = HostPrecision::fp32;
  bool tiles_off_ = false;  // with_bf16_tiles(false)
};

/// The Host space's work is done when its calls return: the host clock times it.
template <>
struct trace::SpaceSpans<Host> {
  static Scope open(const Host&, const char* name, Kind kind, std::int64_t index = -1) noexcept {
    return Scope(name, kind, index);
  }
};

}  // namespace fusedp
