# cmake -DFUSEDP_CF_ARGS=<args file> -P run_compile_fail.cmake
#   Used by fusedp_compile_fail_test (FusedpCompileFail.cmake). Succeeds only when the snippet does
#   not compile and the compiler output matches every expected regex; otherwise prints why, with
#   the compiler's output.

cmake_minimum_required(VERSION 3.25)

if(NOT FUSEDP_CF_ARGS OR NOT EXISTS "${FUSEDP_CF_ARGS}")
  message(FATAL_ERROR "run_compile_fail.cmake: pass -DFUSEDP_CF_ARGS=<file written by fusedp_compile_fail_test>")
endif()
include("${FUSEDP_CF_ARGS}")

if(NOT EXISTS "${FUSEDP_CF_SOURCE}")
  message(FATAL_ERROR "compile-fail: source ${FUSEDP_CF_SOURCE} does not exist")
endif()
if(NOT FUSEDP_CF_REGEX_COUNT GREATER 0)
  message(FATAL_ERROR "compile-fail: ${FUSEDP_CF_SOURCE} states no expected output; "
    "add at least one comment line `// expect: <regex>`")
endif()

set(include_flags)
foreach(dir IN LISTS FUSEDP_CF_INCLUDE_DIRS)
  list(APPEND include_flags "-I${dir}")
endforeach()
list(JOIN include_flags " " include_flags_text)
set(command_line "${FUSEDP_CF_COMPILER} -std=c++20 -fsyntax-only ${include_flags_text} ${FUSEDP_CF_SOURCE}")

# LC_ALL=C: plain ASCII quotes in g++'s messages, whatever the caller's locale.
execute_process(
  COMMAND "${CMAKE_COMMAND}" -E env LC_ALL=C
          "${FUSEDP_CF_COMPILER}" -std=c++20 -fsyntax-only ${include_flags} "${FUSEDP_CF_SOURCE}"
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output)

# message() without a mode prints as it is (no re-wrapping), so the compiler output stays readable.
if(rc EQUAL 0)
  message("command: ${command_line}\ncompiler output:\n${output}")
  message(FATAL_ERROR "compile-fail: ${FUSEDP_CF_SOURCE} COMPILED, but it must not")
endif()

set(missing "")
math(EXPR last "${FUSEDP_CF_REGEX_COUNT} - 1")
foreach(i RANGE ${last})
  if(NOT output MATCHES "${FUSEDP_CF_REGEX_${i}}")
    string(APPEND missing "  ${FUSEDP_CF_REGEX_${i}}\n")
  endif()
endforeach()
if(NOT missing STREQUAL "")
  message("command: ${command_line}\ncompiler output:\n${output}")
  message("expected regexes the output does not match:\n${missing}")
  message(FATAL_ERROR "compile-fail: ${FUSEDP_CF_SOURCE} failed to compile, as it should, "
    "but not with the expected message")
endif()
message(STATUS "compile-fail: ${FUSEDP_CF_SOURCE} failed as expected; ${FUSEDP_CF_REGEX_COUNT} regex(es) matched")
