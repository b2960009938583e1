#pragma once
// SoftmaxCrossEntropy: softmax, the mean cross-entropy over the batch and dlogits in one pass
// (torch.nn.CrossEntropyLoss with reduction='mean', and its label_smoothing).
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/kernels/loss.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

#if FUSEDP_HAS_CUDA
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/loss.cuh"
#endif

namespace fusedp {

struct SoftmaxCrossEntropy {
  /// PyTorch's label_smoothing: the target is (1 - eps) onehot + eps / classes. In [0, 1].
  float label_smoothing = 0.0f;

  /// Targets are class indices.
  template <class T>
  using target = std::int32_t;
  static constexpr const char* name = "SoftmaxCrossEntropy";

  /// Checks every label before any work is done, so a bad batch changes nothing.
  static void validate(std::span<const std::int32_t> labels, std::size_t batch, std::size_t classes) {
    require(labels.size() == batch, "SoftmaxCrossEntropy: ", labels.size(), " labels for a batch of ", batch);
    for (std::size_t i = 0; i < labels.size(); ++i)
      require(labels[i] >= 0 && std::size_t(labels[i]) < classes, "SoftmaxCrossEntropy: label ", labels[i],
              " at index ", i, " is outside [0, ", classes, ")");
  }

  /// Mean loss over the batch; when dlogits is not null, the gradient of that mean.
  template <class T>
  T operator()(const Host&, std::size_t batch, std::size_t classes, const T* logits, const std::int32_t* labels,
               T* dlogits) const {
    check_options();
    const T scale = T(1) / T(batch);
    T sum = T(0);
    for (std::size_t n = 0; n < batch; ++n)
      sum += kernels::softmax_cross_entropy_row(logits + n * classes, int(classes), labels[n],
                                                dlogits ? dlogits + n * classes : nullptr, scale,
                                                T(label_smoothing));
    return sum * scale;
  }

#if FUSEDP_HAS_CUDA
  /// Queues the loss on the space's stream: the mean loss lands in out.value and dlogits (when not
  /// null) receives its gradient; a label out of range sets *out.bad_target (labels already on the
  /// device cannot be checked before the step).
  template <class P>
  void enqueue(const CudaSpace<P>& space, std::size_t batch, std::size_t classes, const float* logits,
               const std::int32_t* labels, float* dlogits, const kernels::cuda::LossOutput& out) const {
    check_options();
    kernels::cuda::softmax_cross_entropy(space.stream(), batch, classes, logits, labels, dlogits, out,
                                         label_smoothing);
  }
#endif

  void check_options() const {
    require(label_smoothing >= 0.0f && label_smoothing <= 1.0f,
            "SoftmaxCrossEntropy: label_smoothing must lie in [0, 1], got ", label_smoothing);
  }
};

/// Number of rows whose largest logit is at the label.
template <class T>
std::size_t count_correct(std::span<const T> logits, std::span<const std::int32_t> labels) {
  require(!labels.empty() && logits.size() % labels.size() == 0, "count_correct: ", logits.size(),
          " logits do not split into ", labels.size(), " rows");
  const std::size_t classes = logits.size() / labels.size();
  std::size_t correct = 0;
  for (std::size_t n = 0; n < labels.size(); ++n)
    correct += kernels::argmax_row(logits.data() + n * classes, int(classes)) == labels[n];
  return correct;
}

}  // namespace fusedp
