#pragma once
// MSE: mean squared error over all outputs of the batch (torch.nn.MSELoss with reduction='mean').
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/loss.hpp"

#include <cmath>
#include <cstddef>
#include <span>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/loss.cuh"
#endif

namespace fusedp {

struct MSE {
  /// Targets have the network's output shape.
  template <class T>
  using target = T;
  static constexpr const char* name = "MSE";

  template <class T>
  static void validate(std::span<const T> targets, std::size_t batch, std::size_t outputs) {
    require(targets.size() == batch * outputs, "MSE: ", targets.size(), " targets for a batch of ", batch, " x ",
            outputs, " outputs");
    for (std::size_t i = 0; i < targets.size(); ++i)
      require(std::isfinite(targets[i]), "MSE: target ", i, " is not finite");
  }

  template <class T>
  T operator()(const Host&, std::size_t batch, std::size_t outputs, const T* y, const T* targets, T* dy) const {
    const T scale = T(1) / T(batch * outputs);
    T sum = T(0);
    for (std::size_t n = 0; n < batch; ++n)
      sum += kernels::squared_error_row(y + n * outputs, targets + n * outputs, int(outputs),
                                        dy ? dy + n * outputs : nullptr, scale);
    return sum * scale;
  }

#if FUSEDP_HAS_CUDA
  /// Queues the loss on the space's stream: the mean loss lands in out.value, dy (when not null)
  /// receives its gradient.
  template <class P>
  void enqueue(const CudaSpace<P>& space, std::size_t batch, std::size_t outputs, const float* y,
               const float* targets, float* dy, const kernels::cuda::LossOutput& out) const {
    kernels::cuda::mean_squared_error(space.stream(), batch, outputs, y, targets, dy, out);
  }
#endif
};

}  // namespace fusedp
