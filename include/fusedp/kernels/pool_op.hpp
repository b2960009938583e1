#pragma once
// Which reduction a pooling window applies; shared by the Host and Cuda pooling kernels and the layers.
namespace fusedp::kernels {

enum class PoolOp { max, average };

}  // namespace fusedp::kernels
