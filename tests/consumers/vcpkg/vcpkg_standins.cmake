# Stand-ins for the vcpkg helpers that ports/fusedp/portfile.cmake calls, for machines without the
# vcpkg tool (it cannot be downloaded where CI runs). Each does the equivalent real work on this
# machine: a real CMake configure, install, and the checks vcpkg makes. Used by check_port.cmake.
#
# Set by the caller, as vcpkg sets them for a portfile: PORT, VERSION, TARGET_TRIPLET,
# CURRENT_PACKAGES_DIR, CURRENT_BUILDTREES_DIR; and for the stand-ins: STANDIN_SOURCE_DIR (what
# vcpkg_from_github "downloads"), STANDIN_GENERATOR, STANDIN_MAKE_PROGRAM, STANDIN_CXX_COMPILER.

# vcpkg_from_github(OUT_SOURCE_PATH <var> REPO <owner/name> REF <ref> SHA512 <hash> [HEAD_REF <b>])
#   Real: downloads the GitHub archive of REF, checks SHA512, extracts it under buildtrees.
#   Here: the arguments are checked and the release files of STANDIN_SOURCE_DIR are "extracted"
#   (copied) under buildtrees, so the port builds from a clean tree as it would from the archive.
function(vcpkg_from_github)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "OUT_SOURCE_PATH;REPO;REF;SHA512;HEAD_REF;GITHUB_HOST;AUTHORIZATION_TOKEN;FILE_DISAMBIGUATOR" "PATCHES")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "vcpkg_from_github: unexpected arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  foreach(required IN ITEMS OUT_SOURCE_PATH REPO REF SHA512)
    if(NOT DEFINED arg_${required} OR arg_${required} STREQUAL "")
      message(FATAL_ERROR "vcpkg_from_github: ${required} is required")
    endif()
  endforeach()
  if(NOT arg_REPO MATCHES "^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    message(FATAL_ERROR "vcpkg_from_github: REPO must be <owner>/<name>, not '${arg_REPO}'")
  endif()
  if(NOT arg_SHA512 MATCHES "^(0|[0-9a-f]+)$")
    message(FATAL_ERROR "vcpkg_from_github: SHA512 must be a lowercase hex digest (or 0), not '${arg_SHA512}'")
  endif()
  if(arg_PATCHES)
    message(FATAL_ERROR "vcpkg_from_github stand-in: PATCHES are not supported (the port needs none)")
  endif()
  string(REPLACE "/" "-" ref_dir "${arg_REF}")
  set(source "${CURRENT_BUILDTREES_DIR}/src/${ref_dir}")
  file(REMOVE_RECURSE "${source}")
  file(MAKE_DIRECTORY "${source}")
  foreach(item IN ITEMS CMakeLists.txt LICENSE cmake include)
    file(COPY "${STANDIN_SOURCE_DIR}/${item}" DESTINATION "${source}")
  endforeach()
  message(STATUS "vcpkg_from_github stand-in: ${arg_REPO}@${arg_REF} -> ${source} (copied from ${STANDIN_SOURCE_DIR})")
  set(${arg_OUT_SOURCE_PATH} "${source}" PARENT_SCOPE)
endfunction()

# vcpkg_cmake_configure(SOURCE_PATH <dir> [OPTIONS ...] [OPTIONS_RELEASE ...] [OPTIONS_DEBUG ...])
#   Real: configures <dir> for each build type (only release when VCPKG_BUILD_TYPE is release)
#   under buildtrees with vcpkg's toolchain, prefix CURRENT_PACKAGES_DIR. Here the same configure
#   with the options vcpkg always adds; only release-only ports are supported.
function(vcpkg_cmake_configure)
  cmake_parse_arguments(PARSE_ARGV 0 arg "WINDOWS_USE_MSBUILD;NO_CHARSET_FLAG;DISABLE_PARALLEL_CONFIGURE"
    "SOURCE_PATH;GENERATOR;LOGFILE_BASE" "OPTIONS;OPTIONS_RELEASE;OPTIONS_DEBUG;MAYBE_UNUSED_VARIABLES")
  if(NOT arg_SOURCE_PATH OR NOT EXISTS "${arg_SOURCE_PATH}/CMakeLists.txt")
    message(FATAL_ERROR "vcpkg_cmake_configure: SOURCE_PATH '${arg_SOURCE_PATH}' holds no CMakeLists.txt")
  endif()
  if(NOT VCPKG_BUILD_TYPE STREQUAL "release")
    message(FATAL_ERROR "vcpkg_cmake_configure stand-in: only ports with VCPKG_BUILD_TYPE release are supported")
  endif()
  set(build_dir "${CURRENT_BUILDTREES_DIR}/${TARGET_TRIPLET}-rel")
  file(REMOVE_RECURSE "${build_dir}")
  set(command "${CMAKE_COMMAND}" -S "${arg_SOURCE_PATH}" -B "${build_dir}" -G "${STANDIN_GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${STANDIN_CXX_COMPILER}"
    -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}"
    -DCMAKE_INSTALL_BINDIR=bin -DCMAKE_INSTALL_LIBDIR=lib
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON
    -DCMAKE_EXPORT_NO_PACKAGE_REGISTRY=ON -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
    ${arg_OPTIONS} ${arg_OPTIONS_RELEASE})
  if(STANDIN_MAKE_PROGRAM)
    list(APPEND command "-DCMAKE_MAKE_PROGRAM=${STANDIN_MAKE_PROGRAM}")
  endif()
  execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "vcpkg_cmake_configure stand-in: configuring ${arg_SOURCE_PATH} failed")
  endif()
  # vcpkg warns about port OPTIONS that the project never reads; the stand-in fails on them, so that
  # the port passes no option fusedp's CMakeLists.txt has dropped or misspelt.
  set(port_variables "")
  foreach(option IN LISTS arg_OPTIONS arg_OPTIONS_RELEASE)
    if(option MATCHES "^-D([A-Za-z0-9_]+)")
      list(APPEND port_variables "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  if(out MATCHES "Manually-specified variables were not used by the project:\n\n(([ \t]+[A-Za-z0-9_]+\n)+)")
    string(REGEX MATCHALL "[A-Za-z0-9_]+" unused "${CMAKE_MATCH_1}")
    foreach(variable IN LISTS unused)
      if(variable IN_LIST port_variables)
        message(FATAL_ERROR "vcpkg_cmake_configure stand-in: the port passes -D${variable}, which the project never reads")
      endif()
    endforeach()
  endif()
  set_property(GLOBAL PROPERTY _standin_build_dir "${build_dir}")
endfunction()

# vcpkg_cmake_install(): real: builds the `install` target of each configured build type.
function(vcpkg_cmake_install)
  get_property(build_dir GLOBAL PROPERTY _standin_build_dir)
  if(NOT build_dir)
    message(FATAL_ERROR "vcpkg_cmake_install: call vcpkg_cmake_configure first")
  endif()
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${build_dir}" --target install
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "vcpkg_cmake_install stand-in: the install target failed")
  endif()
endfunction()

# vcpkg_cmake_config_fixup([PACKAGE_NAME <name>] [CONFIG_PATH <path>])
#   Real: moves the CMake package from CONFIG_PATH to share/<name>, rewrites absolute paths and
#   deletes the debug copy. fusedp installs straight into share/fusedp with relocatable files, so
#   this stand-in checks that nothing needs doing: the package is where vcpkg wants it and no file
#   names an absolute path of the packaging machine.
function(vcpkg_cmake_config_fixup)
  cmake_parse_arguments(PARSE_ARGV 0 arg "DO_NOT_DELETE_PARENT_CONFIG_PATH;NO_PREFIX_CORRECTION;TOOLS_PATH"
    "PACKAGE_NAME;CONFIG_PATH" "")
  if(NOT arg_PACKAGE_NAME)
    set(arg_PACKAGE_NAME "${PORT}")
  endif()
  if(NOT arg_CONFIG_PATH)
    set(arg_CONFIG_PATH "share/${arg_PACKAGE_NAME}")
  endif()
  if(NOT arg_CONFIG_PATH STREQUAL "share/${arg_PACKAGE_NAME}")
    message(FATAL_ERROR "vcpkg_cmake_config_fixup stand-in: moving ${arg_CONFIG_PATH} to share/${arg_PACKAGE_NAME} "
      "is not supported (fusedp needs no move)")
  endif()
  set(dir "${CURRENT_PACKAGES_DIR}/${arg_CONFIG_PATH}")
  if(NOT EXISTS "${dir}/${arg_PACKAGE_NAME}Config.cmake" AND NOT EXISTS "${dir}/${arg_PACKAGE_NAME}-config.cmake")
    message(FATAL_ERROR "vcpkg_cmake_config_fixup: no ${arg_PACKAGE_NAME}Config.cmake in ${dir}")
  endif()
  get_property(build_dir GLOBAL PROPERTY _standin_build_dir)
  file(GLOB files "${dir}/*.cmake")
  foreach(file IN LISTS files)
    file(READ "${file}" text)
    foreach(path IN ITEMS "${CURRENT_PACKAGES_DIR}" "${CURRENT_BUILDTREES_DIR}" "${STANDIN_SOURCE_DIR}" "${build_dir}")
      string(FIND "${text}" "${path}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "vcpkg_cmake_config_fixup stand-in: ${file} names the absolute path ${path}; "
          "the package would not be relocatable")
      endif()
    endforeach()
  endforeach()
  file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/share")
endfunction()

# vcpkg_install_copyright(FILE_LIST <file>...): real: writes share/<port>/copyright from the files.
function(vcpkg_install_copyright)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "COMMENT" "FILE_LIST")
  if(NOT arg_FILE_LIST)
    message(FATAL_ERROR "vcpkg_install_copyright: FILE_LIST is required")
  endif()
  set(text "")
  if(arg_COMMENT)
    string(APPEND text "${arg_COMMENT}\n\n")
  endif()
  list(LENGTH arg_FILE_LIST count)
  foreach(file IN LISTS arg_FILE_LIST)
    if(NOT EXISTS "${file}")
      message(FATAL_ERROR "vcpkg_install_copyright: ${file} does not exist")
    endif()
    file(READ "${file}" content)
    if(count GREATER 1)
      get_filename_component(name "${file}" NAME)
      string(APPEND text "${name}:\n\n")
    endif()
    string(APPEND text "${content}")
  endforeach()
  file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright" "${text}")
endfunction()
