// Shared by the multi-process tests: a check that counts failures and names them, on every rank.
#pragma once
#include <cstdio>
#include <string>

namespace mpi_test {
inline int failures = 0;
inline void check(bool ok, int rank, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  }
}
}  // namespace mpi_test
