# Conan 2, offline: included by run_consumer.cmake (CONSUMER=conan), whose helpers it uses.
#   1. a private CONAN_HOME under WORK_DIR with a detected profile and no remote at all;
#   2. `conan create <checkout>` runs the recipe and test_package (a copy, so that nothing is
#      written into the checkout);
#   3. a CMakeDeps consumer of the created package gets the same components and messages as the
#      CMake package: no component without CUDA configures, COMPONENTS cuda without CUDA fails
#      clearly, COMPONENTS mpi configures where MPI is.

# The environment variable FUSEDP_CONAN may name the executable (.ci/run sets it); else PATH.
if(DEFINED ENV{FUSEDP_CONAN} AND NOT "$ENV{FUSEDP_CONAN}" STREQUAL "")
  set(CONAN_EXECUTABLE "$ENV{FUSEDP_CONAN}")
  if(NOT EXISTS "${CONAN_EXECUTABLE}")
    message(FATAL_ERROR "[conan] FUSEDP_CONAN=${CONAN_EXECUTABLE} does not exist")
  endif()
else()
  find_program(CONAN_EXECUTABLE conan)
endif()
if(NOT CONAN_EXECUTABLE)
  skip_or_fail("conan is not installed (pip install conan, or set FUSEDP_CONAN to its path)")
  return()
endif()

set(conan "${CMAKE_COMMAND}" -E env "CONAN_HOME=${WORK_DIR}/conan_home" "${CONAN_EXECUTABLE}")
run("conan version" ${conan} --version)
message(STATUS "[conan] ${last_output}")
run("conan profile detect" ${conan} profile detect --force)
run("remove the remotes" ${conan} remote remove "*")
run("list the remotes" ${conan} remote list)
if(NOT last_output MATCHES "^[ \n]*$")
  message(FATAL_ERROR "[conan] remotes left: ${last_output}")
endif()

file(COPY "${FUSEDP_SOURCE_DIR}/test_package" DESTINATION "${WORK_DIR}")
run("conan create" ${conan} create "${FUSEDP_SOURCE_DIR}" --test-folder "${WORK_DIR}/test_package")
string(REGEX MATCH "fusedp [0-9.]+ from Conan: MSE [^\n]*" trained "${last_output}")
if(NOT trained)
  message("${last_output}")
  message(FATAL_ERROR "[conan] test_package did not report training")
endif()
message(STATUS "[conan] test_package: ${trained}")

file(READ "${FUSEDP_SOURCE_DIR}/include/fusedp/core/config.hpp" header)
string(REGEX MATCH "FUSEDP_VERSION_STRING \"([^\"]+)\"" _ "${header}")
run("conan install" ${conan} install "--requires=fusedp/${CMAKE_MATCH_1}" -g CMakeDeps
    --output-folder "${WORK_DIR}/deps")

set(project "${CONSUMERS_DIR}/components")
set(deps "-DCMAKE_PREFIX_PATH=${WORK_DIR}/deps" -DCMAKE_BUILD_TYPE=Release)
# Configure only: test_package has already built and trained against the package.
configure("${WORK_DIR}/no_cuda" "${project}" ${deps} -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON "-DFUSEDP_COMPONENTS=")
if(NOT last_output MATCHES "Conan: Target declared 'fusedp::fusedp'")
  message("${last_output}")
  message(FATAL_ERROR "[conan] the consumer did not get fusedp from Conan's CMakeDeps files")
endif()
expect_configure_failure("${WORK_DIR}/cuda" "${project}"
  "fusedp component 'cuda' \\(fusedp::cuda\\): the CUDA Toolkit \\(CUDA runtime and CCCL\\) was not found"
  ${deps} -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DFUSEDP_COMPONENTS=cuda)
if(EXPECT_MPI)
  configure("${WORK_DIR}/mpi" "${project}" ${deps} -DFUSEDP_COMPONENTS=mpi)
  message(STATUS "[conan] COMPONENTS mpi configures where MPI is")
endif()
