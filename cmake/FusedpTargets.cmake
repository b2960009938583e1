# Helpers for the project's own targets (tests, examples, benchmarks). Nothing here touches the
# INTERFACE target `fusedp`: a consumer gets no flags from fusedp except the C++20 requirement.

include_guard(GLOBAL)

# A single-config generator with no build type would compile the tests at -O0; the Host space is
# meant to be measured against PyTorch, so default to Release (-O3 -DNDEBUG with g++ and nvcc).
if(PROJECT_IS_TOP_LEVEL AND NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  message(STATUS "fusedp: no CMAKE_BUILD_TYPE given, using Release")
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type (Debug, Release, RelWithDebInfo, MinSizeRel)" FORCE)
endif()

# fusedp_configure_target(<target>)
#   Warnings for C++ sources (and the host side of CUDA sources), -march=native when FUSEDP_NATIVE
#   is ON, and -O3 when the build type is empty (fusedp used as a subproject without one).
function(fusedp_configure_target target)
  target_compile_features(${target} PRIVATE cxx_std_20)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(FUSEDP_NATIVE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-march=native>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>)
  endif()
  if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
    target_compile_options(${target} PRIVATE -O3)
  endif()
endfunction()
