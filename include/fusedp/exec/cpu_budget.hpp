#pragma once
// How many CPUs this process may use: what the Host space's default thread count comes from.
//
// `std::thread::hardware_concurrency` counts the machine's CPUs, not the ones a process is given:
// `taskset -c 0`, a batch system's binding, a container's CPU quota and the other ranks of an MPI job
// on the same machine all leave it unchanged. Measured on the 2-core machine (LeNet, Fashion-MNIST,
// one epoch under `taskset -c 0`): the machine's count (2 threads) trained at 15,600 images/s, one
// thread at 24,300. So the budget is
//   affinity  the CPUs in this process's affinity mask (sched_getaffinity),
//   quota     the cgroup's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`,
//             the smallest along the process's cgroup path), in CPUs, when one is set,
//   ranks     the processes of this job on the machine (the launcher's environment: Open MPI's
//             OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS, PMIx's PMIX_LOCAL_SIZE), who share
//             the budget: a quota is split among all of them, an affinity mask among those that share
//             it (a launcher that binds each rank to its own cores gives each its own mask).
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace fusedp {

/// The CPUs a process may use, and why.
struct CpuBudget {
  int online = 1;       ///< CPUs of the machine
  int affinity = 1;     ///< CPUs in this process's affinity mask
  double quota = 0;     ///< CPUs the cgroup quota allows; 0 when there is none
  int local_ranks = 1;  ///< processes of this job on the machine (1 outside a launcher)

  /// CPUs for each of `ranks` processes of one job on this machine; at least 1.
  [[nodiscard]] int per_process(int ranks) const noexcept {
    ranks = std::max(ranks, 1);
    // Ranks spread evenly over the machine: about ranks x affinity / online of them share this mask.
    const int sharing = std::clamp(int(std::ceil(double(ranks) * affinity / std::max(online, 1) - 1e-9)), 1, ranks);
    int cpus = std::max(1, affinity / sharing);
    if (quota > 0) cpus = std::min(cpus, std::max(1, int(std::lround(quota / ranks))));
    return cpus;
  }
  /// CPUs for this process.
  [[nodiscard]] int usable() const noexcept { return per_process(local_ranks); }

  /// What limits the budget, for messages: "its affinity mask allows 1 of 2 CPUs".
  [[nodiscard]] std::string limits() const {
    std::ostringstream s;
    s << "its affinity mask allows " << affinity << " of " << online << " CPU" << (online == 1 ? "" : "s");
    if (quota > 0) s << ", its cgroup's quota " << quota << " CPU" << (quota == 1 ? "" : "s");
    if (local_ranks > 1) s << ", shared by the " << local_ranks << " processes of this job on this machine";
    return s.str();
  }
};

namespace detail {

// Where the budget is read from; tests point it at a fake cgroup tree and environment.
struct CpuSources {
  std::string proc_self_cgroup = "/proc/self/cgroup";
  std::string cgroup_root = "/sys/fs/cgroup";
  const char* (*getenv)(const char*) = [](const char* name) -> const char* { return std::getenv(name); };
};

inline bool read_two_numbers(const std::string& path, std::string& a, std::string& b) {
  std::ifstream in(path);
  return bool(in >> a) && bool(in >> b);
}
inline bool read_one_number(const std::string& path, long long& v) {
  std::ifstream in(path);
  return bool(in >> v);
}

// The cgroup quota in CPUs (0 when none), the smallest along the cgroup path from the process's own
// cgroup to the root: a limit anywhere above also binds.
inline double cgroup_quota(const CpuSources& src) {
  std::ifstream in(src.proc_self_cgroup);
  std::string line;
  double best = 0;
  auto take = [&](double cpus) {
    if (cpus > 0 && (best == 0 || cpus < best)) best = cpus;
  };
  while (std::getline(in, line)) {
    // "hierarchy-ID:controller-list:path": v2 is "0::/path"; v1 names cpu among the controllers.
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    const bool v2 = line.compare(0, first, "0") == 0 && controllers.empty();
    bool v1_cpu = false;
    for (std::size_t b = 0; b <= controllers.size();) {
      const auto e = std::min(controllers.find(',', b), controllers.size());
      if (controllers.compare(b, e - b, "cpu") == 0) v1_cpu = true;
      b = e + 1;
    }
    if (!v2 && !v1_cpu) continue;
    for (;;) {
      const std::string dir = src.cgroup_root + (v2 ? "" : "/cpu") + (path == "/" ? "" : path);
      if (v2) {
        std::string max, period;
        if (read_two_numbers(dir + "/cpu.max", max, period) && max != "max")
          take(std::strtod(max.c_str(), nullptr) / std::max(1.0, std::strtod(period.c_str(), nullptr)));
      } else {
        long long q = 0, p = 0;
        if (read_one_number(dir + "/cpu.cfs_quota_us", q) && read_one_number(dir + "/cpu.cfs_period_us", p) && q > 0 &&
            p > 0)
          take(double(q) / double(p));
      }
      if (path.empty() || path == "/") break;
      const auto slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return best;
}

inline int launcher_local_ranks(const CpuSources& src) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE"})
    if (const char* v = src.getenv(name)) {
      const long n = std::strtol(v, nullptr, 10);
      if (n >= 1 && n <= 1 << 20) return int(n);
    }
  return 1;
}

inline CpuBudget read_cpu_budget(const CpuSources& src) {
  CpuBudget b;
  b.online = int(std::max(1u, std::thread::hardware_concurrency()));
  b.affinity = b.online;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) b.affinity = std::clamp(CPU_COUNT(&set), 1, b.online);
#endif
  b.quota = cgroup_quota(src);
  b.local_ranks = launcher_local_ranks(src);
  return b;
}

}  // namespace detail

/// The CPUs this process may use now (read each call: the mask and the quota can change).
[[nodiscard]] inline CpuBudget cpu_budget() { return detail::read_cpu_budget({}); }

}  // namespace fusedp
