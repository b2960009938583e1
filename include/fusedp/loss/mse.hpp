#pragma once
// MSE: mean squared error over all outputs of the batch (torch.nn.MSELoss with reduction='mean').
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/loss.hpp"

#include <cmath>
#include <cstddef>
#include <span>

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
};

}  // namespace fusedp
