#pragma once
// Precision policies: the arithmetic of a space's GEMMs and what its activations are stored in. The
// same names on both spaces: Cuda takes one as a type (CudaSpace<precision::Tf32>), Host as a
// constructor argument (Host{threads, precision::Bf16{}}), because every Host kernel serves both with
// one compiled instance and which instructions run is known only once the CPU is.
#include "fusedp/core/config.hpp"

namespace fusedp::precision {

/// float storage; GEMMs on tensor cores with operands rounded to TF32 (10-bit mantissa, round to
/// nearest) and fp32 accumulation. The default, as PyTorch's allow_tf32 for convolutions.
struct Tf32 {
  static constexpr const char* name = "tf32";
};
/// float storage; GEMMs with exact fp32 fused multiply-adds (no tensor cores). The Host's default.
struct Fp32 {
  static constexpr const char* name = "fp32";
};
/// Mixed precision: GEMM operands rounded to bfloat16 on their way into shared memory (Cuda) or into
/// the packed panels (Host), fp32 accumulation; fp32 master weights, gradients and optimizer state.
/// Activations and activation gradients are stored as bf16 values (net/activation_storage.hpp; the
/// logits and the loss stay fp32). The Host keeps them in float elements and rounds after each stage.
/// The Cuda kernels round as they write, and store in 16-bit elements, half the bytes, the tensors
/// every reader of which takes them (a group output only GEMMs and sinks read, a dz a sink writes past
/// a ReLU, an output whose writer and reader declare 16-bit kernels: Conv2d, BatchNorm, Residual, also
/// inside blocks); the Cuda workspace is sized for that (net/cuda_plan.hpp, net/residual.hpp). Pooling
/// and dropout tensors and the gradient buffers are still bf16 values in float elements (issue 17).
struct Bf16 {
  static constexpr const char* name = "bf16";
};

}  // namespace fusedp::precision
