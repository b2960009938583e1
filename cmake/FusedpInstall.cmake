# install(): the headers and a relocatable CMake package in <prefix>/share/fusedp:
#   fusedpConfig.cmake         find_package entry point; components cuda and mpi
#   fusedpConfigVersion.cmake  ARCH_INDEPENDENT (header-only: any 32/64-bit consumer may use it)
#   fusedpTargets.cmake        the exported fusedp::fusedp
#   fusedpComponents.cmake     fusedp::cuda and fusedp::mpi, made on the consumer's machine
#   FindNCCL.cmake             NCCL::NCCL for the cuda component
# share/fusedp is both a place find_package searches and the layout vcpkg expects, so the vcpkg
# port needs no relocation. Nothing goes to lib/ or bin/.
#
# Version compatibility: semantic versioning lets anything change between 0.y releases, so while
# the major version is 0 a request for 0.y accepts only 0.y.z (SameMinorVersion); from 1.0 on,
# any later release with the same major version (SameMajorVersion).

include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FUSEDP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/fusedp"
  CACHE STRING "Where fusedp's CMake package files are installed, relative to the prefix")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/fusedp"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh" PATTERN "*.h" PATTERN "*.inl")

install(TARGETS fusedp EXPORT fusedpTargets)
install(EXPORT fusedpTargets
  NAMESPACE fusedp::
  DESTINATION "${FUSEDP_INSTALL_CMAKEDIR}"
  FILE fusedpTargets.cmake)

if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_fusedp_compatibility SameMinorVersion)
else()
  set(_fusedp_compatibility SameMajorVersion)
endif()
write_basic_package_version_file("${PROJECT_BINARY_DIR}/fusedpConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY ${_fusedp_compatibility}
  ARCH_INDEPENDENT)

install(FILES
    "${PROJECT_SOURCE_DIR}/cmake/fusedpConfig.cmake"
    "${PROJECT_BINARY_DIR}/fusedpConfigVersion.cmake"
    "${PROJECT_SOURCE_DIR}/cmake/fusedpComponents.cmake"
    "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
  DESTINATION "${FUSEDP_INSTALL_CMAKEDIR}")

install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DOCDIR}")
