# cmake -DCONSUMER=<name> -DWORK_DIR=<scratch> -DFUSEDP_SOURCE_DIR=<checkout>
#       -DFUSEDP_BINARY_DIR=<configured fusedp build> -DGENERATOR=<gen> -DMAKE_PROGRAM=<prog>
#       -DCXX_COMPILER=<c++> -DEXPECT_CUDA=ON|OFF -DEXPECT_MPI=ON|OFF [-DPYTHON=<python3>]
#       -P run_consumer.cmake
#
# Builds one downstream project the way a user would and runs what it built; tests/consumers/
# CMakeLists.txt registers one ctest per consumer. WORK_DIR is emptied first. EXPECT_CUDA/MPI say
# that the fusedp build found CUDA with NCCL, or MPI, so the consumers must get fusedp::cuda or
# fusedp::mpi too. A consumer whose tool is missing (conan) prints the skip marker that ctest
# turns into "Skipped", unless the environment sets FUSEDP_REQUIRE_ALL_CONSUMERS=1 (CI does).
#
#   find_package      cmake --install into WORK_DIR/prefix; a project uses find_package(fusedp)
#   add_subdirectory  a project adds the checkout with add_subdirectory
#   fetchcontent      a project fetches an archive of the checkout by a file:// URL (CUDA off)
#   plain             the C++ compiler with -I<checkout>/include, no CMake
#   components        find_package(fusedp COMPONENTS ...) with CUDA, NCCL or MPI hidden
#   vcpkg             the port's portfile through stand-ins for vcpkg's helpers, then the
#                     manifest-mode example built against the package it produced
#   conan             conan create of the checkout, offline, in a private CONAN_HOME

cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS CONSUMER WORK_DIR FUSEDP_SOURCE_DIR FUSEDP_BINARY_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()
set(CONSUMERS_DIR "${FUSEDP_SOURCE_DIR}/tests/consumers")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# The optimization level of consumer builds: each compiles one header-heavy TU; -O1 keeps that
# short while still being a build a user could ship.
set(CONSUMER_CXX_FLAGS "-O1")

# run(<step> <command>...): runs a command in WORK_DIR; on failure prints its output and stops.
function(run step)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "[${CONSUMER}] ${step}: ${shown}")
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${WORK_DIR}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "[${CONSUMER}] ${step} failed (exit ${rc})")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# configure(<build dir> <source dir> <cmake -D args>...)
function(configure build_dir source_dir)
  set(args -S "${source_dir}" -B "${build_dir}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}"
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
  if(MAKE_PROGRAM)
    list(APPEND args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  run("configure ${source_dir}" "${CMAKE_COMMAND}" ${args} ${ARGN})
  set(last_output "${last_output}" PARENT_SCOPE)
endfunction()

# build_and_run(<build dir> [TRAIN_ONLY]): builds, runs train_tiny, and the component probes;
# unless TRAIN_ONLY, fusedp::cuda and fusedp::mpi must have been provided where EXPECT_CUDA /
# EXPECT_MPI say the machine has them.
function(build_and_run build_dir)
  run("build" "${CMAKE_COMMAND}" --build "${build_dir}")
  run("run train_tiny" "${build_dir}/train_tiny")
  message(STATUS "[${CONSUMER}] ${last_output}")
  if(ARGN STREQUAL "TRAIN_ONLY")
    return()
  endif()
  foreach(component IN ITEMS cuda mpi)
    string(TOUPPER "${component}" upper)
    if(EXISTS "${build_dir}/probe_${component}")
      run("run probe_${component}" "${build_dir}/probe_${component}")
      message(STATUS "[${CONSUMER}] ${last_output}")
    elseif(EXPECT_${upper})
      message(FATAL_ERROR "[${CONSUMER}] fusedp's own build has fusedp::${component}, but this consumer got no "
        "fusedp::${component} target")
    else()
      message(STATUS "[${CONSUMER}] no fusedp::${component} on this machine; its probe is not built")
    endif()
  endforeach()
endfunction()

# install_fusedp(<prefix>): cmake --install of the configured fusedp build.
function(install_fusedp prefix)
  run("install fusedp" "${CMAKE_COMMAND}" --install "${FUSEDP_BINARY_DIR}" --prefix "${prefix}")
  foreach(file IN ITEMS include/fusedp/fusedp.hpp include/fusedp/core/config.hpp
                        share/fusedp/fusedpConfig.cmake share/fusedp/fusedpConfigVersion.cmake
                        share/fusedp/fusedpTargets.cmake share/fusedp/fusedpComponents.cmake
                        share/fusedp/FindNCCL.cmake share/doc/fusedp/LICENSE)
    if(NOT EXISTS "${prefix}/${file}")
      message(FATAL_ERROR "[${CONSUMER}] the install has no ${file}")
    endif()
  endforeach()
endfunction()

# expect_configure_failure(<build dir> <source dir> <regex> <cmake -D args>...)
function(expect_configure_failure build_dir source_dir regex)
  file(REMOVE_RECURSE "${build_dir}")
  execute_process(
    COMMAND "${CMAKE_COMMAND}" -S "${source_dir}" -B "${build_dir}" -G "${GENERATOR}"
            "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${ARGN}
    WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REPLACE ";" " " shown "${ARGN}")
  if(rc EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "[${CONSUMER}] configuring with ${shown} SUCCEEDED, but it must fail")
  endif()
  # CMake wraps long messages; compare with the line breaks and indentation removed.
  string(REGEX REPLACE "[\r\n]+ *" " " flat "${out}")
  if(NOT flat MATCHES "${regex}")
    message("${out}")
    message(FATAL_ERROR "[${CONSUMER}] configuring with ${shown} failed, as it must, but its output does not "
      "match: ${regex}")
  endif()
  message(STATUS "[${CONSUMER}] configuring with ${shown} fails as it must: ${CMAKE_MATCH_0}")
endfunction()

function(skip_or_fail why)
  if("$ENV{FUSEDP_REQUIRE_ALL_CONSUMERS}" STREQUAL "1")
    message(FATAL_ERROR "[${CONSUMER}] ${why} (FUSEDP_REQUIRE_ALL_CONSUMERS=1)")
  endif()
  message(STATUS "fusedp-consumer-skipped: ${why}")
endfunction()

# -------------------------------------------------------------------------------------------------
if(CONSUMER STREQUAL "find_package")
  install_fusedp("${WORK_DIR}/prefix")
  configure("${WORK_DIR}/build" "${CONSUMERS_DIR}/find_package" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  # The package found must be the one just installed, and the headers must come from it.
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" fusedp_dir REGEX "^fusedp_DIR:")
  if(NOT fusedp_dir STREQUAL "fusedp_DIR:PATH=${WORK_DIR}/prefix/share/fusedp")
    message(FATAL_ERROR "[${CONSUMER}] found the wrong fusedp package: ${fusedp_dir}")
  endif()
  file(READ "${WORK_DIR}/build/compile_commands.json" commands)
  string(FIND "${commands}" "${WORK_DIR}/prefix/include" at_prefix)
  string(FIND "${commands}" "${FUSEDP_SOURCE_DIR}/include" at_source)
  if(at_prefix EQUAL -1 OR NOT at_source EQUAL -1)
    message(FATAL_ERROR "[${CONSUMER}] the consumer does not compile against the installed headers")
  endif()
  build_and_run("${WORK_DIR}/build")

elseif(CONSUMER STREQUAL "add_subdirectory")
  configure("${WORK_DIR}/build" "${CONSUMERS_DIR}/add_subdirectory" "-DFUSEDP_SOURCE_DIR=${FUSEDP_SOURCE_DIR}")
  build_and_run("${WORK_DIR}/build")

elseif(CONSUMER STREQUAL "fetchcontent")
  # What a release archive holds: the build files, the headers and the license. No tests/,
  # examples/ or benchmarks/, which fusedp's CMakeLists.txt must not need.
  file(READ "${FUSEDP_SOURCE_DIR}/include/fusedp/core/config.hpp" header)
  string(REGEX MATCH "FUSEDP_VERSION_STRING \"([^\"]+)\"" _ "${header}")
  set(tree "fusedp-${CMAKE_MATCH_1}")
  file(MAKE_DIRECTORY "${WORK_DIR}/archive/${tree}")
  foreach(item IN ITEMS CMakeLists.txt LICENSE cmake include)
    file(COPY "${FUSEDP_SOURCE_DIR}/${item}" DESTINATION "${WORK_DIR}/archive/${tree}")
  endforeach()
  execute_process(COMMAND "${CMAKE_COMMAND}" -E tar czf "${WORK_DIR}/${tree}.tar.gz" "${tree}"
    WORKING_DIRECTORY "${WORK_DIR}/archive" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[${CONSUMER}] cannot pack ${tree}.tar.gz")
  endif()
  # fusedp's own options work from the consumer's command line: CUDA off here (add_subdirectory
  # covers the build tree's fusedp::cuda), so the consumer must get no fusedp::cuda.
  configure("${WORK_DIR}/build" "${CONSUMERS_DIR}/fetchcontent" "-DFUSEDP_URL=file://${WORK_DIR}/${tree}.tar.gz"
            -DFUSEDP_ENABLE_CUDA=OFF)
  set(EXPECT_CUDA OFF)
  build_and_run("${WORK_DIR}/build")
  if(EXISTS "${WORK_DIR}/build/probe_cuda")
    message(FATAL_ERROR "[${CONSUMER}] -DFUSEDP_ENABLE_CUDA=OFF, yet the consumer got fusedp::cuda")
  endif()

elseif(CONSUMER STREQUAL "plain")
  # No CMake at all: one compiler call, as a Makefile or a shell script would make it.
  separate_arguments(flags UNIX_COMMAND "${CONSUMER_CXX_FLAGS}")
  run("compile" "${CXX_COMPILER}" -std=c++20 ${flags} -Wall -Wextra "-I${FUSEDP_SOURCE_DIR}/include"
      "${CONSUMERS_DIR}/train_tiny.cc" -o "${WORK_DIR}/train_tiny" -pthread)
  if(NOT last_output STREQUAL "")
    message(STATUS "[${CONSUMER}] compiler output:\n${last_output}")
  endif()
  run("run train_tiny" "${WORK_DIR}/train_tiny")
  message(STATUS "[${CONSUMER}] ${last_output}")

elseif(CONSUMER STREQUAL "components")
  install_fusedp("${WORK_DIR}/prefix")
  set(project "${CONSUMERS_DIR}/components")
  set(prefix "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  set(no_cuda -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)

  # Without CUDA, a consumer asking for no component configures, builds and trains.
  configure("${WORK_DIR}/no_cuda" "${project}" ${prefix} ${no_cuda} "-DFUSEDP_COMPONENTS=")
  build_and_run("${WORK_DIR}/no_cuda" TRAIN_ONLY)

  # Asking for what the machine cannot provide stops at configure time and says what is missing.
  expect_configure_failure("${WORK_DIR}/cuda" "${project}"
    "fusedp component 'cuda' \\(fusedp::cuda\\): the CUDA Toolkit \\(CUDA runtime and CCCL\\) was not found"
    ${prefix} ${no_cuda} -DFUSEDP_COMPONENTS=cuda)
  if(EXPECT_CUDA)
    # The toolkit is here: hide NCCL alone.
    expect_configure_failure("${WORK_DIR}/nccl" "${project}"
      "fusedp component 'cuda' \\(fusedp::cuda\\): NCCL \\(nccl.h and libnccl\\) was not found"
      ${prefix} -DCMAKE_DISABLE_FIND_PACKAGE_NCCL=ON -DFUSEDP_COMPONENTS=cuda)
  endif()
  expect_configure_failure("${WORK_DIR}/mpi" "${project}"
    "fusedp component 'mpi' \\(fusedp::mpi\\): MPI for C\\+\\+ .* was not found"
    ${prefix} -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DFUSEDP_COMPONENTS=mpi)
  expect_configure_failure("${WORK_DIR}/unknown" "${project}"
    "fusedp component 'tpu' \\(fusedp::tpu\\): there is no such component"
    ${prefix} -DFUSEDP_COMPONENTS=tpu)
  # A version outside 0.1.x is refused (semantic versioning of a 0.y release).
  expect_configure_failure("${WORK_DIR}/version" "${CONSUMERS_DIR}/components"
    "fusedp.*0\\.1\\.[0-9]+"
    ${prefix} -DFUSEDP_COMPONENTS= -DFUSEDP_CONSUMER_VERSION=0.2)

  # Where the machine does have them, asking for them succeeds.
  set(have "")
  if(EXPECT_CUDA)
    list(APPEND have cuda)
  endif()
  if(EXPECT_MPI)
    list(APPEND have mpi)
  endif()
  if(have)
    list(JOIN have "," have_arg)
    configure("${WORK_DIR}/have" "${project}" ${prefix} "-DFUSEDP_COMPONENTS=${have_arg}")
    message(STATUS "[${CONSUMER}] COMPONENTS ${have} configure where the machine has them")
  endif()

elseif(CONSUMER STREQUAL "vcpkg")
  include("${CONSUMERS_DIR}/vcpkg/check_port.cmake")

elseif(CONSUMER STREQUAL "conan")
  include("${CONSUMERS_DIR}/conan.cmake")

else()
  message(FATAL_ERROR "run_consumer.cmake: unknown CONSUMER '${CONSUMER}'")
endif()
