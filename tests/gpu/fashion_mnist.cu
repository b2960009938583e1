// Training runs on Cuda that track a reference: LeNet from the same seed on the same batches, SGD with
// momentum, 400 steps of 64 (tests/support/tracking.hpp), Cuda (TF32) against Host, and BF16 against
// TF32 on the device.
#include "gpu_test.hpp"

#include "../support/seed_networks.hpp"
#include "../support/tracking.hpp"

namespace fp = fusedp;
using namespace gpu_test;
using seed_networks::LeNet;
using tracking::check_tracking;

TEST_CASE("LeNet trains on Cuda (TF32) as on Host: loss curves and accuracy agree") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const tracking::Data d = tracking::load(64 * 400, 2000);
  MESSAGE("data: " << d.source);
  fp::Model<LeNet, fp::Host> host{fp::seed(42), fp::Host{0}};
  fp::Model<LeNet, fp::Cuda> dev{fp::seed(42), fp::Cuda{0}};
  check_tracking(host, dev, d, "Host", "Cuda", 5e-3);
}

// Issue 17: BF16 on Cuda (GEMM operands, stored activations and their gradients in bf16; fp32 master
// weights, optimizer state, accumulation, loss and softmax) trains as TF32 does.
TEST_CASE("LeNet trains on Cuda in BF16 as in TF32: loss curves and accuracy agree") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const tracking::Data d = tracking::load(64 * 400, 2000);
  MESSAGE("data: " << d.source);
  fp::Model<LeNet, fp::Cuda> tf32{fp::seed(42), fp::Cuda{0}};
  fp::Model<LeNet, fp::CudaBf16> bf16{fp::seed(42), fp::CudaBf16{0}};
  check_tracking(tf32, bf16, d, "TF32", "BF16", tracking::bf16_first_bound);
}
