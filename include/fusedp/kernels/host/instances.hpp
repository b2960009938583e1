#pragma once
// The closed set of Host kernel instances that a build may compile once instead of in every
// translation unit: the conv2d and linear entry points (kernels/host/conv2d.hpp, linear.hpp) for the
// single-activation epilogues, in float and double.
//
// Why: those two entry points pull in the GEMM tiles, Winograd and the bf16 packing, which are about
// 90% of what g++ -O3 optimizes for a translation unit holding a Host model (tests/net/model.cpp:
// 47 of its 52 s are "opt and generate", and kernels::host is 1.1 of its 1.2 MB of code), the same
// code in every unit since the kernels take their shapes at run time.
//
// How: with FUSEDP_HOST_KERNELS_PREBUILT defined to 1, conv2d.hpp and linear.hpp declare these
// instances `extern template`, and one translation unit of the program defines them with the same
// compiler flags (this repository's programs link src/host_kernels_*.cpp, built once). Any other
// epilogue or element type is instantiated where it is used, as always. The machine code is the same
// either way; only the unit that compiles it changes, so mixing units with and without the macro is
// safe (an explicit instantiation and an implicit one of the same function are both mergeable).
#include "fusedp/kernels/activation.hpp"

#ifndef FUSEDP_HOST_KERNELS_PREBUILT
#define FUSEDP_HOST_KERNELS_PREBUILT 0
#endif

/// X(prefix, Epi, T) for each epilogue of the set, element type T. prefix is `extern` (a declaration)
/// or empty (the definition).
#define FUSEDP_HOST_KERNEL_EPILOGUES(X, prefix, T)                      \
  X(prefix, ::fusedp::kernels::Epilogue<>, T)                           \
  X(prefix, ::fusedp::kernels::Epilogue<::fusedp::kernels::Relu>, T)    \
  X(prefix, ::fusedp::kernels::Epilogue<::fusedp::kernels::Tanh>, T)    \
  X(prefix, ::fusedp::kernels::Epilogue<::fusedp::kernels::Sigmoid>, T) \
  X(prefix, ::fusedp::kernels::Epilogue<::fusedp::kernels::Gelu>, T)

/// X(prefix, Epi, T) for every pair of the set.
#define FUSEDP_HOST_KERNEL_INSTANCES(X, prefix)  \
  FUSEDP_HOST_KERNEL_EPILOGUES(X, prefix, float) \
  FUSEDP_HOST_KERNEL_EPILOGUES(X, prefix, double)
