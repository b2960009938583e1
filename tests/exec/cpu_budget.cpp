// tests include/fusedp/exec/cpu_budget.hpp: the CPUs a process may use (affinity mask, cgroup quota,
// ranks of its machine), and the Host pool that fits them (more parts than CPUs run on fewer threads).
#include <doctest/doctest.h>

#include <fusedp/exec/cpu_budget.hpp>
#include <fusedp/exec/host.hpp>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <latch>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>
#include <unistd.h>

namespace fs = std::filesystem;
using fusedp::CpuBudget;
using fusedp::Host;

namespace {

CpuBudget budget(int online, int affinity, double quota, int ranks) {
  CpuBudget b;
  b.online = online;
  b.affinity = affinity;
  b.quota = quota;
  b.local_ranks = ranks;
  return b;
}

// A fake /proc/self/cgroup and cgroup tree in a fresh folder.
struct FakeCgroups {
  fs::path root = fs::temp_directory_path() / ("fusedp_cgroup_" + std::to_string(::getpid()));
  FakeCgroups() {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~FakeCgroups() { fs::remove_all(root); }
  void write(const std::string& rel, const std::string& text) const {
    const fs::path p = root / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  [[nodiscard]] fusedp::detail::CpuSources sources() const {
    fusedp::detail::CpuSources s;
    s.proc_self_cgroup = (root / "self_cgroup").string();
    s.cgroup_root = (root / "sys").string();
    s.getenv = [](const char*) -> const char* { return nullptr; };
    return s;
  }
};

// Restricts this thread (and the threads it starts) to the first `n` CPUs it may use; restores on exit.
struct AffinityScope {
  cpu_set_t saved{};
  bool ok = false;
  explicit AffinityScope(int n) {
    CPU_ZERO(&saved);
    if (sched_getaffinity(0, sizeof saved, &saved) != 0) return;
    cpu_set_t narrow;
    CPU_ZERO(&narrow);
    int taken = 0;
    for (int c = 0; c < CPU_SETSIZE && taken < n; ++c)
      if (CPU_ISSET(c, &saved)) {
        CPU_SET(c, &narrow);
        ++taken;
      }
    ok = taken == n && sched_setaffinity(0, sizeof narrow, &narrow) == 0;
  }
  ~AffinityScope() {
    if (ok) sched_setaffinity(0, sizeof saved, &saved);
  }
};

}  // namespace

TEST_CASE("per_process: the affinity mask shared by the ranks that hold it, the quota by all ranks") {
  CHECK(budget(2, 2, 0, 1).usable() == 2);
  CHECK(budget(2, 1, 0, 1).usable() == 1);  // taskset -c 0
  CHECK(budget(16, 16, 0, 4).usable() == 4);  // 4 unbound ranks split the machine
  CHECK(budget(16, 1, 0, 4).usable() == 1);   // each rank bound to a core of its own
  CHECK(budget(16, 8, 0, 4).usable() == 4);   // bound to a socket of 8 shared by 2 ranks
  CHECK(budget(16, 16, 0, 64).usable() == 1); // more ranks than CPUs: still one each
  CHECK(budget(64, 64, 4, 1).usable() == 4);  // a container's quota of 4 CPUs
  CHECK(budget(64, 64, 1.5, 1).usable() == 2);
  CHECK(budget(64, 64, 0.2, 1).usable() == 1);
  CHECK(budget(64, 64, 4, 2).usable() == 2);
  CHECK(budget(64, 2, 8, 1).usable() == 2);   // the smaller of mask and quota
  CHECK(budget(16, 16, 0, 1).per_process(4) == 4);
  CHECK(budget(2, 1, 1.5, 2).limits() ==
        "its affinity mask allows 1 of 2 CPUs, its cgroup's quota 1.5 CPUs, shared by the 2 processes of this job "
        "on this machine");
}

TEST_CASE("the cgroup quota: v2 cpu.max and v1 cfs, the smallest along the path, none when unlimited") {
  const FakeCgroups cg;
  SUBCASE("v2, the process's own cgroup") {
    cg.write("self_cgroup", "0::/job/step\n");
    cg.write("sys/job/step/cpu.max", "150000 100000\n");
    cg.write("sys/job/cpu.max", "max 100000\n");
    CHECK(fusedp::detail::cgroup_quota(cg.sources()) == doctest::Approx(1.5));
  }
  SUBCASE("v2, a parent's limit binds") {
    cg.write("self_cgroup", "0::/job/step\n");
    cg.write("sys/job/step/cpu.max", "max 100000\n");
    cg.write("sys/job/cpu.max", "300000 100000\n");
    cg.write("sys/cpu.max", "800000 100000\n");
    CHECK(fusedp::detail::cgroup_quota(cg.sources()) == doctest::Approx(3.0));
  }
  SUBCASE("v2 without a limit anywhere, and missing files") {
    cg.write("self_cgroup", "0::/a/b\n");
    cg.write("sys/a/cpu.max", "max 100000\n");
    CHECK(fusedp::detail::cgroup_quota(cg.sources()) == 0);
  }
  SUBCASE("v1, the cpu controller among others") {
    cg.write("self_cgroup", "12:memory:/m\n4:cpu,cpuacct:/docker/abc\n");
    cg.write("sys/cpu/docker/abc/cpu.cfs_quota_us", "200000\n");
    cg.write("sys/cpu/docker/abc/cpu.cfs_period_us", "100000\n");
    cg.write("sys/cpu/docker/cpu.cfs_quota_us", "-1\n");
    cg.write("sys/cpu/docker/cpu.cfs_period_us", "100000\n");
    CHECK(fusedp::detail::cgroup_quota(cg.sources()) == doctest::Approx(2.0));
  }
  SUBCASE("no /proc/self/cgroup at all") { CHECK(fusedp::detail::cgroup_quota(cg.sources()) == 0); }
}

TEST_CASE("ranks of this machine from the launcher's environment") {
  fusedp::detail::CpuSources s;
  s.getenv = [](const char* name) -> const char* {
    return std::string(name) == "OMPI_COMM_WORLD_LOCAL_SIZE" ? "3" : nullptr;
  };
  CHECK(fusedp::detail::launcher_local_ranks(s) == 3);
  s.getenv = [](const char* name) -> const char* { return std::string(name) == "MPI_LOCALNRANKS" ? "2" : nullptr; };
  CHECK(fusedp::detail::launcher_local_ranks(s) == 2);
  s.getenv = [](const char* name) -> const char* {
    return std::string(name) == "OMPI_COMM_WORLD_LOCAL_SIZE" ? "garbage" : nullptr;
  };
  CHECK(fusedp::detail::launcher_local_ranks(s) == 1);
  s.getenv = [](const char*) -> const char* { return nullptr; };
  CHECK(fusedp::detail::launcher_local_ranks(s) == 1);
}

TEST_CASE("the process's own budget: its affinity mask counts, not the machine") {
  const CpuBudget whole = fusedp::cpu_budget();
  CHECK(whole.affinity >= 1);
  CHECK(whole.affinity <= whole.online);
  const AffinityScope one(1);
  REQUIRE(one.ok);
  const CpuBudget narrow = fusedp::cpu_budget();
  CHECK(narrow.affinity == 1);
  CHECK(narrow.usable() == 1);
  CHECK(Host{}.threads() == 1);
}

TEST_CASE("more threads than CPUs: the parts of a region run on one thread per CPU, with the same split") {
  const AffinityScope one(1);
  REQUIRE(one.ok);
  const int notes_before = fusedp::detail::host_fit_notes().load();
  const Host host{16};
  CHECK(host.threads() == 16);
  CHECK(host.cpu_threads() == 1);
  CHECK(fusedp::detail::host_fit_notes().load() == notes_before + 1);
  // Every part once, with its own range and index, all on the caller's thread.
  std::vector<int> seen(1000, 0);
  std::set<std::thread::id> ids;
  std::map<int, std::pair<std::size_t, std::size_t>> ranges;
  host.parallel_for(1000, [&](std::size_t b, std::size_t e, int t) {
    for (std::size_t i = b; i < e; ++i) ++seen[i];
    ids.insert(std::this_thread::get_id());
    ranges[t] = {b, e};
  });
  for (int s : seen) CHECK(s == 1);
  CHECK(ids == std::set<std::thread::id>{std::this_thread::get_id()});
  REQUIRE(ranges.size() == 16);
  for (int t = 0; t < 16; ++t) {
    CHECK(ranges[t].first == 1000u * std::size_t(t) / 16);
    CHECK(ranges[t].second == 1000u * std::size_t(t + 1) / 16);
  }
  std::atomic<int> calls{0};
  host.run_on_all([&](int) { ++calls; });
  CHECK(calls == 16);
  // The lowest part's error wins, as with one thread per part.
  CHECK_THROWS_WITH_AS(host.parallel_for(16, [](std::size_t, std::size_t, int t) {
    if (t % 5 == 3) throw std::runtime_error("part " + std::to_string(t));
  }),
                       "part 3", std::runtime_error);
  const Host again{8};
  CHECK(fusedp::detail::host_fit_notes().load() == notes_before + 2);  // counted; printed only for the first
}

TEST_CASE("a pool with fewer threads than parts: runners share the parts and steal the rest") {
  // Two runners for five parts where the machine has two CPUs; one runner otherwise.
  const Host host{5};
  CHECK(host.threads() == 5);
  CHECK(host.cpu_threads() == std::min(5, fusedp::cpu_budget().usable()));
  for (int round = 0; round < 200; ++round) {
    std::vector<std::atomic<int>> seen(5);
    host.parallel_for(5, [&](std::size_t b, std::size_t e, int t) {
      CHECK(e == b + 1);
      CHECK(std::size_t(t) == b);
      seen[std::size_t(t)].fetch_add(1);
    });
    for (auto& s : seen) CHECK(s.load() == 1);
  }
}

TEST_CASE("a dedicated Host gives each part a thread of its own even beyond the CPUs") {
  const AffinityScope one(1);
  REQUIRE(one.ok);
  const Host host = Host::dedicated(3);
  CHECK(host.threads() == 3);
  CHECK(host.cpu_threads() == 3);
  // Each body waits for the others: only threads of their own can get past the latch.
  for (int round = 0; round < 50; ++round) {
    std::latch all(3);
    std::atomic<int> through{0};
    host.run_on_all([&](int) {
      all.arrive_and_wait();
      ++through;
    });
    CHECK(through == 3);
  }
}

TEST_CASE("the note says what was asked for, what the process may use, and what runs") {
  const CpuBudget b = budget(2, 1, 0, 1);
  CHECK(fusedp::detail::host_fit_note(16, 1, b) ==
        "fusedp: Host: 16 threads asked for, but this process may use 1 CPU (its affinity mask allows 1 of 2 "
        "CPUs); each region still splits into 16 parts, as on 16 CPUs, run by 1 thread");
  CHECK(fusedp::detail::host_fit_note(3, 3, b) ==
        "fusedp: Host: 3 threads asked for, but this process may use 1 CPU (its affinity mask allows 1 of 2 "
        "CPUs); its 3 threads sleep instead of spinning while they wait");
}
