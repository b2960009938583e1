// Compiled with MPI's include folders on its path, but not as part of fusedp::mpi (tests/link/CMakeLists.txt).
#define LINK_TEST_UNIT mpi_unit
#include "unit_body.hpp"

// Deleting is done here, so a Trainer made by the other unit is destroyed by this unit's code.
void link_test::TrainerDeleter::operator()(Trainer* t) const { delete t; }
