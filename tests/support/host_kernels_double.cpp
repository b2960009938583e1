// The tests' prebuilt Host kernels in double (kernels/host/instances.hpp); host_kernels_float.cpp
// holds the float ones, so the two compile side by side.
#include "fusedp/kernels/host/conv2d.hpp"
#include "fusedp/kernels/host/linear.hpp"

namespace fusedp::kernels::host {
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_CONV2D_INSTANCE, , double)
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_LINEAR_INSTANCE, , double)
}  // namespace fusedp::kernels::host
