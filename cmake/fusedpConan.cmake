# Conan build module (conanfile.py copies it into the package's share/fusedp/ and lists it in
# cmake_build_modules). Conan's CMakeDeps generates fusedp's find_package file and the target
# fusedp::fusedp (the headers) from the recipe, then includes this file to add what a recipe cannot
# say, so that a Conan consumer gets what fusedpConfig.cmake gives everyone else: C++20, threads,
# zlib and nlohmann-json from the system, and the cuda and mpi components.

if(NOT TARGET fusedp::fusedp)
  message(FATAL_ERROR "fusedpConan.cmake: included before Conan defined fusedp::fusedp")
endif()

get_target_property(_fusedp_conan_done fusedp::fusedp _FUSEDP_CONAN_MODULE)
if(NOT _fusedp_conan_done)
  find_package(Threads REQUIRED)
  find_package(ZLIB REQUIRED)
  find_package(nlohmann_json 3.2 REQUIRED)
  set_property(TARGET fusedp::fusedp APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_20)
  set_property(TARGET fusedp::fusedp APPEND PROPERTY INTERFACE_LINK_LIBRARIES Threads::Threads ZLIB::ZLIB
                                                                             nlohmann_json::nlohmann_json)
  set_property(TARGET fusedp::fusedp PROPERTY _FUSEDP_CONAN_MODULE TRUE)
endif()
unset(_fusedp_conan_done)

include("${CMAKE_CURRENT_LIST_DIR}/fusedpComponents.cmake")
_fusedp_provide_components()
