// Built against fusedp::cuda by the consumer projects where it exists, with the C++ compiler (no
// nvcc): proves the target brings the CUDA runtime, CCCL and NCCL headers and libraries. Needs no
// GPU to run.
#include <fusedp/fusedp.hpp>

#include <cub/version.cuh>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <thrust/version.h>

#include <cstdio>

static_assert(FUSEDP_WITH_NCCL == 1, "fusedp::cuda must define FUSEDP_WITH_NCCL=1");

int main() {
  int runtime = 0;
  int nccl = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess || ncclGetVersion(&nccl) != ncclSuccess) {
    std::printf("fusedp::cuda: cannot query the CUDA runtime or NCCL version\n");
    return 1;
  }
  std::printf("fusedp::cuda: CUDA runtime %d, NCCL %d, Thrust %d, CUB %d\n", runtime, nccl, THRUST_VERSION,
              CUB_VERSION);
  return 0;
}
