#pragma once
// Parallel<Net, Space, Policies...>: data-parallel training. Replicas of one Model each take a shard of
// the batch, compute gradients, and the gradients are combined as the policies say before the update.
// Two process models: replicas in this process (threads; DataParallel style), or one replica per MPI
// rank (mpirun; DistributedDataParallel style, across machines through mpirun's host list).
//
// This header holds the primary template and includes the specializations:
//   parallel/host_parallel.hpp  Parallel<Net, Host, ...>: in-process replicas or MPI ranks
//   parallel/cuda_parallel.hpp  Parallel<Net, CudaSpace<P>, ...>: NCCL, compiled by nvcc where the build
//                               asks for NCCL (FUSEDP_WITH_NCCL, fusedp::cuda)
// Both reduce with one BucketReducer (parallel/reducer.hpp) over a GradientChannel: in-process, MPI
// or NCCL.
#include "fusedp/core/config.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/parallel/options.hpp"
#include "fusedp/parallel/policy.hpp"

#include <type_traits>

namespace fusedp {

/// Data-parallel training of Net on Space with the given policies (see parallel/policy.hpp). Defined for
/// Host (parallel/host_parallel.hpp) and, under nvcc with NCCL, for every CudaSpace
/// (parallel/cuda_parallel.hpp).
/// @tparam Net a Sequential<...>
/// @tparam Space the execution space of every replica
/// @tparam Policies scatter, reduce, comm and knob tags, in any order
template <Network Net, class Space, class... Policies>
class Parallel {
  static_assert(sizeof(Space) == 0,
                "fusedp::Parallel: no data-parallel replicas for this space here. Host is always available; "
                "replicas on the Cuda space need nvcc and NCCL (link fusedp::cuda, which defines FUSEDP_WITH_NCCL)");
};

}  // namespace fusedp

#include "fusedp/parallel/host_parallel.hpp"
#include "fusedp/parallel/cuda_parallel.hpp"
