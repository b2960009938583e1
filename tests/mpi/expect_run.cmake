# Runs a command (mpirun ...) and checks how it ended: cmake -P expect_run.cmake with
#   -DCOMMAND=<;-list>    the command line
#   -DEXPECT=zero|nonzero|any  the exit status expected
#   -DWITHIN=<seconds>    the command must end within this many seconds (it is killed at twice that)
#   -DMATCH=<;-list>      regular expressions that must each match the output (stdout and stderr,
#                         its lines joined by '|', so that [^|]* stays within one line)
#   -DNOMATCH=<;-list>    regular expressions that must not match it
#   -DENV=<;-list>        NAME=value pairs set for the command
# The output is kept in <CMAKE_CURRENT_BINARY_DIR>/<NAME>.log (-DNAME) and its end printed on failure.
cmake_minimum_required(VERSION 3.25)

# add_test passes the lists with their semicolons escaped.
foreach(list COMMAND MATCH NOMATCH ENV)
  string(REPLACE "\\;" ";" ${list} "${${list}}")
endforeach()

foreach(pair IN LISTS ENV)
  string(REGEX MATCH "^([^=]+)=(.*)$" _ "${pair}")
  set(ENV{${CMAKE_MATCH_1}} "${CMAKE_MATCH_2}")
endforeach()

math(EXPR _kill_after "${WITHIN} * 2")
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err
                TIMEOUT ${_kill_after})
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
set(_all "${_out}\n${_err}")
string(REPLACE "\n" "|" _flat "${_all}")
if(NAME)
  file(WRITE "${NAME}.log" "${_all}")
endif()

set(_problems "")
if(NOT _rc MATCHES "^-?[0-9]+$")
  list(APPEND _problems "did not end by itself: ${_rc}")
elseif(EXPECT STREQUAL "zero" AND NOT _rc EQUAL 0)
  list(APPEND _problems "exit status ${_rc}, expected 0")
elseif(EXPECT STREQUAL "nonzero" AND _rc EQUAL 0)
  list(APPEND _problems "exit status 0, expected a failure")
endif()
if(_took GREATER WITHIN)
  list(APPEND _problems "took ${_took} s, more than ${WITHIN} s")
endif()
foreach(re IN LISTS MATCH)
  if(NOT _flat MATCHES "${re}")
    list(APPEND _problems "no match for '${re}'")
  endif()
endforeach()
foreach(re IN LISTS NOMATCH)
  if(_flat MATCHES "${re}")
    list(APPEND _problems "unexpected match for '${re}'")
  endif()
endforeach()

if(_problems)
  string(LENGTH "${_all}" _n)
  if(_n GREATER 6000)
    math(EXPR _from "${_n} - 6000")
    string(SUBSTRING "${_all}" ${_from} -1 _all)
  endif()
  list(JOIN _problems "\n  " _text)
  message(FATAL_ERROR "${_all}\n--- ${COMMAND}\nFAILED after ${_took} s:\n  ${_text}")
endif()
message(STATUS "ok: exit status ${_rc} after ${_took} s")
