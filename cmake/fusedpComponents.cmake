# fusedp's optional components and what each needs from the machine. Installed beside
# fusedpConfig.cmake; also used by the build tree (add_subdirectory, FetchContent) and by the Conan
# package's CMake build module, so that all three give the same targets:
#
#   fusedp::fusedp  headers, C++20, threads, zlib; Host only, needs no CUDA     (always)
#   fusedp::cuda    fusedp::fusedp + CUDA::cudart + CCCL (Thrust, CUB, libcu++ of the CUDA Toolkit)
#                   + NCCL::NCCL                                                 (component cuda)
#   fusedp::mpi     fusedp::fusedp + MPI::MPI_CXX                                (component mpi)
#
# Each component also defines the macro that switches its part of the headers on, for every
# translation unit that links it (include/fusedp/core/config.hpp): fusedp::cuda FUSEDP_WITH_NCCL=1,
# fusedp::mpi FUSEDP_WITH_MPI=1. The headers never guess them from the include path.
#
# Nothing here is decided when fusedp is packaged: a component's dependencies are looked up on the
# machine that configures the consumer, so one header-only package serves machines with and
# without CUDA.

include_guard(GLOBAL)

# _fusedp_component_definitions(<component> <var>): the compile definitions fusedp::<component> carries.
function(_fusedp_component_definitions component var)
  if(component STREQUAL "cuda")
    set(${var} FUSEDP_WITH_NCCL=1 PARENT_SCOPE)
  elseif(component STREQUAL "mpi")
    set(${var} FUSEDP_WITH_MPI=1 PARENT_SCOPE)
  else()
    set(${var} "" PARENT_SCOPE)
  endif()
endfunction()

# _fusedp_find_cuda(<libs_var> <missing_var>)
#   Looks for the CUDA Toolkit, its CCCL and NCCL. On success <libs_var> lists what fusedp::cuda
#   links and <missing_var> is empty; otherwise <missing_var> says what is missing and what to do.
function(_fusedp_find_cuda libs_var missing_var)
  set(${libs_var} "" PARENT_SCOPE)
  set(${missing_var} "" PARENT_SCOPE)

  if(NOT TARGET CUDA::cudart)
    find_package(CUDAToolkit QUIET)
  endif()
  if(NOT TARGET CUDA::cudart)
    string(CONCAT missing
      "the CUDA Toolkit (CUDA runtime and CCCL) was not found. Install it, or point CMake at it "
      "with -DCUDAToolkit_ROOT=<toolkit folder> (the folder holding bin/nvcc). fusedp::fusedp "
      "(Host only) needs no CUDA: ask for no component to build without it.")
    set(${missing_var} "${missing}" PARENT_SCOPE)
    return()
  endif()
  set(libs CUDA::cudart)

  # CCCL as the toolkit ships it: its CMake package (CUDA 12.x and later), else the headers in the
  # toolkit's include folder, which CUDA::cudart already puts on the include path.
  if(NOT TARGET CCCL::CCCL)
    set(cccl_hints)
    if(CUDAToolkit_LIBRARY_DIR)
      list(APPEND cccl_hints "${CUDAToolkit_LIBRARY_DIR}/cmake")
    endif()
    find_package(CCCL CONFIG QUIET HINTS ${cccl_hints})
  endif()
  if(TARGET CCCL::CCCL)
    list(APPEND libs CCCL::CCCL)
  else()
    get_target_property(cudart_includes CUDA::cudart INTERFACE_INCLUDE_DIRECTORIES)
    set(have_thrust FALSE)
    foreach(dir IN LISTS cudart_includes)
      if(EXISTS "${dir}/thrust/version.h" AND EXISTS "${dir}/cub/version.cuh")
        set(have_thrust TRUE)
      endif()
    endforeach()
    if(NOT have_thrust)
      list(JOIN cudart_includes ", " cudart_includes)
      string(CONCAT missing
        "CCCL (Thrust, CUB and libcu++, part of the CUDA Toolkit) was found neither as a CMake "
        "package (CCCL_DIR, or lib/cmake/cccl in the toolkit) nor as headers in "
        "${cudart_includes}. Use a complete CUDA Toolkit.")
      set(${missing_var} "${missing}" PARENT_SCOPE)
      return()
    endif()
  endif()

  if(NOT TARGET NCCL::NCCL)
    list(PREPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_FUNCTION_LIST_DIR}")
    find_package(NCCL QUIET)
  endif()
  if(NOT TARGET NCCL::NCCL)
    string(CONCAT missing
      "NCCL (nccl.h and libnccl) was not found, neither in the CUDA Toolkit nor in the system "
      "paths. Install it (NVIDIA's libnccl-dev package) or set NCCL_ROOT to the folder holding "
      "include/nccl.h and lib/libnccl.so.")
    set(${missing_var} "${missing}" PARENT_SCOPE)
    return()
  endif()
  list(APPEND libs NCCL::NCCL)
  set(${libs_var} "${libs}" PARENT_SCOPE)
endfunction()

# _fusedp_find_mpi(<libs_var> <missing_var>): likewise for MPI with its C++ bindings.
function(_fusedp_find_mpi libs_var missing_var)
  set(${libs_var} "" PARENT_SCOPE)
  set(${missing_var} "" PARENT_SCOPE)
  if(NOT TARGET MPI::MPI_CXX)
    find_package(MPI QUIET COMPONENTS CXX)
  endif()
  if(NOT TARGET MPI::MPI_CXX)
    string(CONCAT missing
      "MPI for C++ (mpi.h, libmpi and the mpicxx wrapper) was not found. Install an MPI "
      "implementation (Debian: apt-get install libopenmpi-dev) or set MPI_HOME to it.")
    set(${missing_var} "${missing}" PARENT_SCOPE)
    return()
  endif()
  set(${libs_var} MPI::MPI_CXX PARENT_SCOPE)
endfunction()

# _fusedp_provide_components()
#   Called by a package configuration file after fusedp::fusedp exists. For each component in
#   fusedp_FIND_COMPONENTS: creates the IMPORTED target fusedp::<component> when its dependencies
#   are found, and sets fusedp_<component>_FOUND. A required component that cannot be provided
#   sets fusedp_FOUND to FALSE and fusedp_NOT_FOUND_MESSAGE to what is missing, so that
#   find_package(fusedp REQUIRED COMPONENTS ...) stops the configuration with that message.
function(_fusedp_provide_components)
  set(not_found "")
  foreach(component IN LISTS fusedp_FIND_COMPONENTS)
    set(libs "")
    set(missing "")
    if(component STREQUAL "cuda")
      _fusedp_find_cuda(libs missing)
    elseif(component STREQUAL "mpi")
      _fusedp_find_mpi(libs missing)
    else()
      set(missing "there is no such component; fusedp's components are cuda and mpi.")
    endif()

    if(missing STREQUAL "")
      if(NOT TARGET fusedp::${component})
        add_library(fusedp::${component} INTERFACE IMPORTED)
        _fusedp_component_definitions(${component} definitions)
        set_target_properties(fusedp::${component} PROPERTIES
          INTERFACE_LINK_LIBRARIES "fusedp::fusedp;${libs}"
          INTERFACE_COMPILE_DEFINITIONS "${definitions}")
      endif()
      set(fusedp_${component}_FOUND TRUE PARENT_SCOPE)
    else()
      set(fusedp_${component}_FOUND FALSE PARENT_SCOPE)
      if(fusedp_FIND_REQUIRED_${component})
        string(APPEND not_found "fusedp component '${component}' (fusedp::${component}): ${missing}\n")
      elseif(NOT fusedp_FIND_QUIETLY)
        message(STATUS "fusedp: optional component '${component}' is not available: ${missing}")
      endif()
    endif()
  endforeach()

  if(NOT not_found STREQUAL "")
    set(fusedp_FOUND FALSE PARENT_SCOPE)
    set(fusedp_NOT_FOUND_MESSAGE "${not_found}" PARENT_SCOPE)
  endif()
endfunction()
