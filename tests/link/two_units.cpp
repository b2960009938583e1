// One program, two translation units, two include paths (see units.hpp): both units agree on what
// Parallel<Net, Host> is, and objects made by one are used by the other with the same results.
#include <doctest/doctest.h>

#include "units.hpp"

using namespace link_test;

TEST_CASE("the include path does not change Parallel<Net, Host>") {
  const Facts a = mpi_unit::facts();
  const Facts b = plain_unit::facts();
  // The premise of the test: one unit really has <mpi.h> on its path, the other not.
  REQUIRE(a.mpi_header_seen);
  REQUIRE_FALSE(b.mpi_header_seen);
  CHECK(a.with_mpi == 0);
  CHECK(b.with_mpi == 0);
  CHECK(a.size_of_parallel == b.size_of_parallel);
  CHECK(a.align_of_parallel == b.align_of_parallel);
}

TEST_CASE("a Parallel made in one unit trains the same when driven by the other") {
  TrainerPtr x = mpi_unit::make_trainer();
  TrainerPtr y = plain_unit::make_trainer();
  for (std::uint64_t s = 0; s < 5; ++s) {
    const float lx = plain_unit::train_step(*x, s);  // made by the MPI unit, stepped by the plain one
    const float ly = mpi_unit::train_step(*y, s);    // and the other way round
    CHECK(lx == ly);
  }
  CHECK(mpi_unit::params(*x) == plain_unit::params(*y));
  CHECK(mpi_unit::params(*y) == plain_unit::params(*x));
}
