#pragma once
// The start-up check of a Parallel under MPI, written once for both spaces: every rank gathers what
// every other rank runs (library, network, parameter count, policies, world size, the program's
// agree_on value) and all fail together, naming each difference, when they are not the same run. The
// same exchange carries each rank's host name, so that a later message naming a rank that stopped
// responding can say on which machine it runs.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace fusedp::parallel::detail {

/// What a rank tells the others at start-up.
struct RunIdentity {
  std::uint64_t fingerprint;     // Net::fingerprint
  std::uint64_t param_count;     // Net::param_count
  std::uint64_t policy;          // Policy::hash (and the precision on Cuda)
  std::uint64_t world;           // world size as this rank sees it
  std::uint64_t agree_on;        // ParallelOptions::agree_on
  std::uint64_t accumulate = 1;  // ParallelOptions::accumulate
  std::uint64_t bucket_bytes = 0;  // ParallelOptions::bucket_bytes
  std::uint64_t backward_branches = 1;  // ParallelOptions::backward_branches (Cuda; 1 on Host)
  std::string host;              // the machine this rank runs on (MPI_Get_processor_name), for messages
};

/// Gathers every rank's identity with `gather(mine, all, n)` (a collective over `world` ranks that
/// cannot hang: it times out) and throws InvalidArgument on every rank when any differs from rank 0's.
/// Returns every rank's host name, in rank order (the first 255 bytes of each).
template <class Gather>
std::vector<std::string> check_same_run(const RunIdentity& id, std::size_t world, Gather&& gather) {
  constexpr std::size_t fields = 10, host_words = 32;  // a host name travels as 256 bytes
  std::array<std::uint64_t, fields + host_words> mine{0x66757365647031ull /* "fusedp1" */,
                                                      FUSEDP_VERSION_MAJOR * 10000ull + FUSEDP_VERSION_MINOR * 100ull,
                                                      id.fingerprint,
                                                      id.param_count,
                                                      id.policy,
                                                      id.world,
                                                      id.agree_on,
                                                      id.accumulate,
                                                      id.bucket_bytes,
                                                      id.backward_branches};
  std::memcpy(mine.data() + fields, id.host.data(), std::min(id.host.size(), host_words * 8 - 1));
  static constexpr const char* what[] = {"library",     "library version", "network fingerprint", "parameter count",
                                         "policy hash", "world size",      "agree_on value",      "accumulate count",
                                         "bucket bytes", "backward branches setting"};
  std::vector<std::uint64_t> all(mine.size() * world);
  gather(mine.data(), all.data(), mine.size());
  std::ostringstream diff;
  for (std::size_t r = 1; r < world; ++r)
    for (std::size_t k = 0; k < fields; ++k)
      if (all[r * mine.size() + k] != all[k])
        diff << "\n  rank " << r << " has " << what[k] << " " << all[r * mine.size() + k] << ", rank 0 has " << all[k];
  if (!diff.str().empty())
    throw InvalidArgument("Parallel: the ranks were not started with the same network and settings:" + diff.str());
  std::vector<std::string> hosts(world);
  for (std::size_t r = 0; r < world; ++r) {
    const char* name = reinterpret_cast<const char*>(all.data() + r * mine.size() + fields);
    hosts[r].assign(name, strnlen(name, host_words * 8));
  }
  return hosts;
}

}  // namespace fusedp::parallel::detail
