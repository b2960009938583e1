# fusedp is header-only: one release configuration, headers and a CMake package, nothing to build.
set(VCPKG_BUILD_TYPE release)

# Used as an overlay port from a fusedp checkout (vcpkg --overlay-ports=<checkout>/ports), the port
# packages that checkout. vcpkg's ABI hash covers the port's files only, so after editing the
# checkout remove the consumer's vcpkg_installed/ (or bump "port-version") to repackage it.
# Copied into a registry, it downloads the tagged release instead; fill in SHA512 at release time
# (vcpkg prints the archive's hash when given 0).
get_filename_component(FUSEDP_CHECKOUT "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(EXISTS "${FUSEDP_CHECKOUT}/include/fusedp/fusedp.hpp" AND EXISTS "${FUSEDP_CHECKOUT}/CMakeLists.txt")
  set(SOURCE_PATH "${FUSEDP_CHECKOUT}")
else()
  vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO fusedp/fusedp
    REF "v${VERSION}"
    SHA512 0
    HEAD_REF main
  )
endif()

# CUDA, NCCL and MPI are not needed to package fusedp: its cuda and mpi components look for them
# when a consumer asks for them, on the consumer's machine.
vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DFUSEDP_BUILD_TESTS=OFF
    -DFUSEDP_BUILD_EXAMPLES=OFF
    -DFUSEDP_BUILD_BENCHMARKS=OFF
    -DFUSEDP_ENABLE_CUDA=OFF
    -DFUSEDP_ENABLE_MPI=OFF
    -DFUSEDP_INSTALL=ON
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME fusedp CONFIG_PATH share/fusedp)

# The license goes to share/fusedp/copyright, vcpkg's place for it.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
