# The vcpkg port, checked without the vcpkg tool (not installable where CI runs). Included by
# run_consumer.cmake (CONSUMER=vcpkg), whose helpers run/configure/build_and_run it uses:
#   1. the manifests are strict JSON with the fields vcpkg requires (check_manifests.py);
#   2. ports/fusedp/portfile.cmake runs with stand-ins for vcpkg's helpers that do the real
#      configure and install (vcpkg_standins.cmake), twice: as the overlay port inside this
#      checkout, and copied out of it, where it takes the vcpkg_from_github path;
#   3. each package tree is header-only: no lib/, bin/ or debug/, the CMake package, usage and
#      copyright in share/fusedp/;
#   4. the manifest-mode example (tests/consumers/vcpkg) builds against the package and trains,
#      found through CMAKE_PREFIX_PATH as vcpkg's toolchain file would find it.

if(NOT PYTHON)
  message(FATAL_ERROR "[vcpkg] python3 is needed to check the manifests")
endif()
run("check manifests" "${PYTHON}" "${CONSUMERS_DIR}/vcpkg/check_manifests.py" "${FUSEDP_SOURCE_DIR}")
message(STATUS "[vcpkg] ${last_output}")

file(READ "${FUSEDP_SOURCE_DIR}/ports/fusedp/vcpkg.json" _port_manifest)
string(JSON _port_version GET "${_port_manifest}" "version-semver")

# run_portfile(<port dir> <packages dir>): the portfile in a fresh scope, as vcpkg runs it.
function(run_portfile port_dir packages_dir)
  set(PORT fusedp)
  set(VERSION "${_port_version}")
  set(TARGET_TRIPLET x64-linux)
  set(CURRENT_PACKAGES_DIR "${packages_dir}")
  set(CURRENT_BUILDTREES_DIR "${WORK_DIR}/buildtrees/${PORT}")
  set(STANDIN_SOURCE_DIR "${FUSEDP_SOURCE_DIR}")
  set(STANDIN_GENERATOR "${GENERATOR}")
  set(STANDIN_MAKE_PROGRAM "${MAKE_PROGRAM}")
  set(STANDIN_CXX_COMPILER "${CXX_COMPILER}")
  file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}" "${CURRENT_BUILDTREES_DIR}")
  include("${CONSUMERS_DIR}/vcpkg/vcpkg_standins.cmake")
  message(STATUS "[vcpkg] running ${port_dir}/portfile.cmake")
  include("${port_dir}/portfile.cmake")

  foreach(forbidden IN ITEMS lib bin debug tools)
    if(EXISTS "${packages_dir}/${forbidden}")
      message(FATAL_ERROR "[vcpkg] the header-only package has a ${forbidden}/ folder: ${packages_dir}/${forbidden}")
    endif()
  endforeach()
  foreach(file IN ITEMS include/fusedp/fusedp.hpp share/fusedp/fusedpConfig.cmake share/fusedp/fusedpConfigVersion.cmake
                        share/fusedp/fusedpTargets.cmake share/fusedp/fusedpComponents.cmake
                        share/fusedp/FindNCCL.cmake share/fusedp/usage share/fusedp/copyright)
    if(NOT EXISTS "${packages_dir}/${file}")
      message(FATAL_ERROR "[vcpkg] the package has no ${file}")
    endif()
  endforeach()
  file(GLOB top RELATIVE "${packages_dir}" "${packages_dir}/*")
  list(SORT top)
  if(NOT top STREQUAL "include;share")
    message(FATAL_ERROR "[vcpkg] the package holds ${top}; a header-only port holds include/ and share/ only")
  endif()
  file(GLOB share RELATIVE "${packages_dir}/share" "${packages_dir}/share/*")
  if(NOT share STREQUAL "fusedp")
    message(FATAL_ERROR "[vcpkg] share/ holds ${share}; everything belongs in share/fusedp/")
  endif()
  message(STATUS "[vcpkg] package tree ${packages_dir}: include/ and share/fusedp/ only")
endfunction()

# 2-3. In the checkout (overlay use), then out of it (registry use: vcpkg_from_github).
run_portfile("${FUSEDP_SOURCE_DIR}/ports/fusedp" "${WORK_DIR}/packages/fusedp_x64-linux")
file(COPY "${FUSEDP_SOURCE_DIR}/ports/fusedp" DESTINATION "${WORK_DIR}/registry/ports")
run_portfile("${WORK_DIR}/registry/ports/fusedp" "${WORK_DIR}/registry-packages/fusedp_x64-linux")

# 4. The manifest-mode example against the package, with only that package on CMAKE_PREFIX_PATH.
configure("${WORK_DIR}/example" "${CONSUMERS_DIR}/vcpkg" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/packages/fusedp_x64-linux")
file(STRINGS "${WORK_DIR}/example/CMakeCache.txt" _fusedp_dir REGEX "^fusedp_DIR:")
if(NOT _fusedp_dir STREQUAL "fusedp_DIR:PATH=${WORK_DIR}/packages/fusedp_x64-linux/share/fusedp")
  message(FATAL_ERROR "[vcpkg] the example found the wrong fusedp package: ${_fusedp_dir}")
endif()
build_and_run("${WORK_DIR}/example" TRAIN_ONLY)
