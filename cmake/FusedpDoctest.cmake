# Provides the INTERFACE target `fusedp_doctest` (doctest as a SYSTEM include, so neither g++ nor
# nvcc warns inside it). Tests include it as <doctest/doctest.h>.
#
# Where doctest comes from, first match wins:
#   1. FUSEDP_DOCTEST_DIR, when given: a folder holding doctest.h;
#   2. an installed package (Debian's doctest-dev ships a CMake config `doctest`);
#   3. the git-ignored vendored copy third_party/doctest/doctest.h (GPU machines have no package).

include_guard(GLOBAL)

set(FUSEDP_DOCTEST_DIR "" CACHE PATH "Folder holding doctest.h (empty: installed package, then third_party/doctest)")

if(TARGET fusedp_doctest)
  return()
endif()

add_library(fusedp_doctest INTERFACE)

set(_fusedp_doctest_header "")
if(FUSEDP_DOCTEST_DIR)
  if(NOT EXISTS "${FUSEDP_DOCTEST_DIR}/doctest.h")
    message(FATAL_ERROR "fusedp: FUSEDP_DOCTEST_DIR=${FUSEDP_DOCTEST_DIR} holds no doctest.h")
  endif()
  set(_fusedp_doctest_header "${FUSEDP_DOCTEST_DIR}/doctest.h")
else()
  find_package(doctest CONFIG QUIET)
  if(TARGET doctest::doctest)
    get_target_property(_fusedp_doctest_inc doctest::doctest INTERFACE_INCLUDE_DIRECTORIES)
    target_include_directories(fusedp_doctest SYSTEM INTERFACE ${_fusedp_doctest_inc})
    message(STATUS "fusedp: doctest ${doctest_VERSION} from ${doctest_DIR}")
  else()
    find_path(_fusedp_doctest_sys_inc doctest/doctest.h)
    if(_fusedp_doctest_sys_inc)
      target_include_directories(fusedp_doctest SYSTEM INTERFACE "${_fusedp_doctest_sys_inc}")
      message(STATUS "fusedp: doctest from ${_fusedp_doctest_sys_inc}")
    elseif(EXISTS "${PROJECT_SOURCE_DIR}/third_party/doctest/doctest.h")
      set(_fusedp_doctest_header "${PROJECT_SOURCE_DIR}/third_party/doctest/doctest.h")
    else()
      message(FATAL_ERROR
        "fusedp: doctest not found. Install it (Debian: apt-get install doctest-dev), put its single "
        "header at third_party/doctest/doctest.h, pass -DFUSEDP_DOCTEST_DIR=<folder with doctest.h>, "
        "or configure with -DFUSEDP_BUILD_TESTS=OFF.")
    endif()
  endif()
endif()

if(_fusedp_doctest_header)
  # Copy the single header into a doctest/ folder in the build tree so that <doctest/doctest.h>
  # works whatever the vendored folder is called.
  set(_fusedp_doctest_inc "${PROJECT_BINARY_DIR}/_deps/doctest/include")
  configure_file("${_fusedp_doctest_header}" "${_fusedp_doctest_inc}/doctest/doctest.h" COPYONLY)
  target_include_directories(fusedp_doctest SYSTEM INTERFACE "${_fusedp_doctest_inc}")
  message(STATUS "fusedp: doctest from ${_fusedp_doctest_header}")
endif()
