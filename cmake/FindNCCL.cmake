# FindNCCL: NVIDIA's collective communication library (CMake's CUDAToolkit module has no NCCL target).
# Installed beside fusedpConfig.cmake; fusedp's `cuda` component uses it.
#
#   find_package(NCCL [version] [REQUIRED])
#
# Imported target: NCCL::NCCL (nccl.h and the shared libnccl).
# Result variables: NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES.
# Cache variables: NCCL_INCLUDE_DIR, NCCL_LIBRARY.
#
# Where it looks, in order: NCCL_ROOT (CMake or environment variable), NCCL_HOME and NCCL_DIR in the
# environment, the CUDA Toolkit (CUDAToolkit_ROOT, CUDA_PATH, or the toolkit found by
# find_package(CUDAToolkit)), then the system paths. A pip-installed NCCL (PyTorch's nvidia-nccl-cu*
# wheel: .../site-packages/nvidia/nccl) is found with NCCL_ROOT pointing there; it ships only
# libnccl.so.2, which is searched for by that name too.

include(FindPackageHandleStandardArgs)

set(_nccl_hints)
foreach(_nccl_dir IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "$ENV{NCCL_HOME}" "$ENV{NCCL_DIR}"
                           "${CUDAToolkit_ROOT}" "$ENV{CUDAToolkit_ROOT}" "$ENV{CUDA_PATH}")
  if(_nccl_dir)
    list(APPEND _nccl_hints "${_nccl_dir}")
  endif()
endforeach()
if(CUDAToolkit_INCLUDE_DIRS)
  foreach(_nccl_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
    cmake_path(GET _nccl_dir PARENT_PATH _nccl_parent)
    list(APPEND _nccl_hints "${_nccl_parent}")
  endforeach()
endif()
if(CUDAToolkit_LIBRARY_DIR)
  cmake_path(GET CUDAToolkit_LIBRARY_DIR PARENT_PATH _nccl_parent)
  list(APPEND _nccl_hints "${_nccl_parent}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_hints}
  PATH_SUFFIXES include)

find_library(NCCL_LIBRARY
  NAMES nccl libnccl.so.2
  HINTS ${_nccl_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
    REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_nccl_part IN ITEMS MAJOR MINOR PATCH)
    set(NCCL_VERSION_${_nccl_part} "")
    foreach(_nccl_line IN LISTS _nccl_version_lines)
      if(_nccl_line MATCHES "^#define NCCL_${_nccl_part}[ \t]+([0-9]+)")
        set(NCCL_VERSION_${_nccl_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT NCCL_VERSION_MAJOR STREQUAL "")
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE
    "Looked for nccl.h and libnccl. Set NCCL_ROOT to the folder holding include/nccl.h and lib/libnccl.so (Debian/Ubuntu with NVIDIA's repository: apt-get install libnccl-dev).")

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
unset(_nccl_dir)
unset(_nccl_parent)
unset(_nccl_version_lines)
unset(_nccl_part)
unset(_nccl_line)
