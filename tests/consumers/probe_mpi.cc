// Built against fusedp::mpi by the consumer projects where it exists: proves the target brings MPI
// and switches fusedp's MPI part on (FUSEDP_WITH_MPI), so MpiWorld exists.
// MPI_Get_library_version may be called before MPI_Init, so this runs without mpirun.
#include <fusedp/fusedp.hpp>

#include <mpi.h>

#include <cstdio>
#include <type_traits>

static_assert(FUSEDP_WITH_MPI == 1, "fusedp::mpi must define FUSEDP_WITH_MPI=1");
static_assert(std::is_class_v<fusedp::MpiWorld>);

int main() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(version, &length) != MPI_SUCCESS) return 1;
  std::printf("fusedp::mpi: %.60s\n", version);
  return 0;
}
