"""Conan 2 recipe for fusedp, a header-only library.

`conan create .` packages this checkout: the headers and fusedp's CMake files, installed by its own
CMakeLists.txt. Consumers use CMakeDeps: find_package(fusedp) and the target fusedp::fusedp;
find_package(fusedp COMPONENTS cuda mpi) adds fusedp::cuda and fusedp::mpi, built from the CUDA
Toolkit, NCCL and MPI of the consumer's machine (none of them comes from Conan). zlib, nlohmann-json and threads
come from the system as well, found by CMake, so the recipe has no requirements and works with no
remote.
"""
import os
import re

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load, rmdir

required_conan_version = ">=2.0"


class FusedpConan(ConanFile):
    name = "fusedp"
    description = ("Header-only C++20/CUDA library for training neural networks on CPUs and GPUs "
                   "with data parallelism (NCCL, MPI)")
    license = "MIT"
    topics = ("deep-learning", "neural-networks", "cuda", "nccl", "mpi", "header-only")
    package_type = "header-library"
    # Needed to run CMake's install; package_id() drops them: one package serves every configuration.
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "CMakeLists.txt", "LICENSE", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        # The one place the version is written: the FUSEDP_VERSION_* macros.
        header = load(self, os.path.join(self.recipe_folder, "include", "fusedp", "core", "config.hpp"))
        parts = []
        for part in ("MAJOR", "MINOR", "PATCH"):
            match = re.search(rf"^#define FUSEDP_VERSION_{part}\s+(\d+)\s*$", header, re.MULTILINE)
            if not match:
                raise ValueError(f"include/fusedp/core/config.hpp defines no FUSEDP_VERSION_{part}")
            parts.append(match.group(1))
        self.version = ".".join(parts)

    def layout(self):
        cmake_layout(self)

    def package_id(self):
        self.info.clear()

    def generate(self):
        tc = CMakeToolchain(self)
        # Packaging compiles nothing and needs neither CUDA nor MPI (the components find them on
        # the consumer's machine).
        tc.cache_variables["FUSEDP_BUILD_TESTS"] = False
        tc.cache_variables["FUSEDP_BUILD_EXAMPLES"] = False
        tc.cache_variables["FUSEDP_BUILD_BENCHMARKS"] = False
        tc.cache_variables["FUSEDP_ENABLE_CUDA"] = False
        tc.cache_variables["FUSEDP_ENABLE_MPI"] = False
        tc.cache_variables["FUSEDP_INSTALL"] = True
        tc.generate()

    def build(self):
        CMake(self).configure()

    def package(self):
        CMake(self).install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "fusedpConan.cmake", os.path.join(self.source_folder, "cmake"),
             os.path.join(self.package_folder, "share", "fusedp"))
        rmdir(self, os.path.join(self.package_folder, "share", "doc"))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "fusedp")
        self.cpp_info.set_property("cmake_target_name", "fusedp::fusedp")
        # Semantic versioning: while the major version is 0, only the same 0.y is compatible.
        major = str(self.version).split(".", 1)[0]
        self.cpp_info.set_property("cmake_config_version_compat",
                                   "SameMinorVersion" if major == "0" else "SameMajorVersion")
        self.cpp_info.set_property("cmake_build_modules", [os.path.join("share", "fusedp", "fusedpConan.cmake")])
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
