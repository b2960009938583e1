// The tests' prebuilt Host kernels in float (kernels/host/instances.hpp); host_kernels_double.cpp
// holds the double ones, so the two compile side by side.
#include "fusedp/kernels/host/conv2d.hpp"
#include "fusedp/kernels/host/linear.hpp"

namespace fusedp::kernels::host {
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_CONV2D_INSTANCE, , float)
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_LINEAR_INSTANCE, , float)
}  // namespace fusedp::kernels::host
