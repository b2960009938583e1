# fusedp_find_cli11(<found_var> <what>)
#   Makes CLI11::CLI11 available in the calling directory: Debian's libcli11-dev ships a CMake
#   package; otherwise the bare header CLI/CLI.hpp is looked for. Sets <found_var> to TRUE or FALSE;
#   when CLI11 is missing it warns that <what> (e.g. "examples") are not built.
#   Used by examples/ and benchmarks/.

include_guard(GLOBAL)

function(fusedp_find_cli11 found_var what)
  if(NOT TARGET CLI11::CLI11)
    find_package(CLI11 CONFIG QUIET)
  endif()
  if(NOT TARGET CLI11::CLI11)
    find_path(FUSEDP_CLI11_INCLUDE CLI/CLI.hpp)
    if(FUSEDP_CLI11_INCLUDE)
      add_library(CLI11::CLI11 INTERFACE IMPORTED)
      target_include_directories(CLI11::CLI11 INTERFACE "${FUSEDP_CLI11_INCLUDE}")
    endif()
  endif()
  if(TARGET CLI11::CLI11)
    set(${found_var} TRUE PARENT_SCOPE)
  else()
    message(WARNING "fusedp: CLI11 not found (Debian: apt-get install libcli11-dev); ${what} are not built")
    set(${found_var} FALSE PARENT_SCOPE)
  endif()
endfunction()
