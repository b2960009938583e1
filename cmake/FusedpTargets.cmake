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
#   Warnings for C++ sources (and the host side of CUDA sources), -march=native for C++ sources when
#   FUSEDP_NATIVE is ON, and -O3 when the build type is empty (fusedp used as a subproject without one).
#   CUDA sources keep the host compiler's default target: the Host kernels are scalar in an nvcc
#   translation unit anyway (kernels/host/simd.hpp), and with AVX-512 in -march (x86-64-v4, native on
#   an AVX-512 Xeon) nvcc 13.0's cudafe++ crashes with a segmentation fault on the examples' _cuda
#   translation units (seen 2026-12-03: x86-64-v3 passes, x86-64-v4 and cooperlake crash).
function(fusedp_configure_target target)
  target_compile_features(${target} PRIVATE cxx_std_20)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(FUSEDP_NATIVE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
  if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
    target_compile_options(${target} PRIVATE -O3)
  endif()
endfunction()
