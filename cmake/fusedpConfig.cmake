# find_package(fusedp [<version>] [REQUIRED] [COMPONENTS cuda mpi] [OPTIONAL_COMPONENTS cuda mpi])
#
#   fusedp::fusedp  always: the headers, C++20, threads, zlib and nlohmann-json (Host only; no CUDA)
#   fusedp::cuda    component cuda: adds the CUDA runtime, CCCL and NCCL of this machine
#   fusedp::mpi     component mpi:  adds MPI (C++)
#
# A component the machine cannot provide makes a REQUIRED find_package stop with a message that
# says what is missing. Versions: 0.y.z releases are compatible only within the same 0.y (see
# fusedpConfigVersion.cmake).

if(CMAKE_VERSION VERSION_LESS 3.20)
  set(fusedp_FOUND FALSE)
  set(fusedp_NOT_FOUND_MESSAGE "fusedp needs CMake 3.20 or newer in the consuming project; this is ${CMAKE_VERSION}.")
  return()
endif()

include(CMakeFindDependencyMacro)
find_dependency(Threads)
find_dependency(ZLIB)
find_dependency(nlohmann_json 3.2)

include("${CMAKE_CURRENT_LIST_DIR}/fusedpTargets.cmake")
include("${CMAKE_CURRENT_LIST_DIR}/fusedpComponents.cmake")
_fusedp_provide_components()
