// The Host kernels' common instances in double (kernels/host/instances.hpp), compiled once for this
// repository's programs: the fusedp_host_kernels_double library of src/CMakeLists.txt.
#include "fusedp/kernels/host/conv2d.hpp"
#include "fusedp/kernels/host/linear.hpp"

namespace fusedp::kernels::host {
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_CONV2D_INSTANCE, , double)
FUSEDP_HOST_KERNEL_EPILOGUES(FUSEDP_HOST_LINEAR_INSTANCE, , double)
}  // namespace fusedp::kernels::host
