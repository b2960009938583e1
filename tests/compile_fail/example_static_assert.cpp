// Sanity check of the compile-fail harness itself (tests/CMakeLists.txt, cmake/run_compile_fail.cmake):
// this snippet must fail to compile, and the compiler output must match each `expect:` regex.
// expect: compile-fail harness works
// expect: static assertion failed
#include <fusedp/core/config.hpp>

template <class T>
inline constexpr bool false_v = false;

template <class T>
void instantiate_me() {
  static_assert(false_v<T>, "fusedp compile-fail harness works");
}

int main() { instantiate_me<int>(); }
