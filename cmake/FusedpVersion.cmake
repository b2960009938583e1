# Reads fusedp's version from the FUSEDP_VERSION_* macros of include/fusedp/core/config.hpp, the one
# place it is written, into FUSEDP_VERSION (for project(VERSION)), FUSEDP_VERSION_MAJOR/MINOR/PATCH.
# Included before project(), so it uses nothing that needs a language.

set(_fusedp_config_header "${CMAKE_CURRENT_LIST_DIR}/../include/fusedp/core/config.hpp")
file(STRINGS "${_fusedp_config_header}" _fusedp_version_lines
  REGEX "^#define FUSEDP_VERSION_(MAJOR|MINOR|PATCH|STRING)[ \t]")
foreach(_fusedp_part IN ITEMS MAJOR MINOR PATCH)
  set(FUSEDP_VERSION_${_fusedp_part} "")
  foreach(_fusedp_line IN LISTS _fusedp_version_lines)
    if(_fusedp_line MATCHES "^#define FUSEDP_VERSION_${_fusedp_part}[ \t]+([0-9]+)[ \t]*$")
      set(FUSEDP_VERSION_${_fusedp_part} "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  if(FUSEDP_VERSION_${_fusedp_part} STREQUAL "")
    message(FATAL_ERROR "fusedp: no '#define FUSEDP_VERSION_${_fusedp_part} <number>' in ${_fusedp_config_header}")
  endif()
endforeach()
set(FUSEDP_VERSION "${FUSEDP_VERSION_MAJOR}.${FUSEDP_VERSION_MINOR}.${FUSEDP_VERSION_PATCH}")

# The string macro must say the same as the numbers.
set(_fusedp_version_string "")
foreach(_fusedp_line IN LISTS _fusedp_version_lines)
  if(_fusedp_line MATCHES "^#define FUSEDP_VERSION_STRING[ \t]+\"([^\"]*)\"")
    set(_fusedp_version_string "${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT _fusedp_version_string STREQUAL FUSEDP_VERSION)
  message(FATAL_ERROR "fusedp: ${_fusedp_config_header} says FUSEDP_VERSION_STRING \"${_fusedp_version_string}\" "
    "but its MAJOR/MINOR/PATCH macros say ${FUSEDP_VERSION}")
endif()

unset(_fusedp_config_header)
unset(_fusedp_version_lines)
unset(_fusedp_version_string)
unset(_fusedp_part)
unset(_fusedp_line)
