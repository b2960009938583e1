#pragma once
// Per-element optimizer updates shared by both spaces, with PyTorch's semantics (torch.optim.SGD,
// Adam, AdamW). One fused pass over the flat parameter buffer applies them; with decay_all false the
// weight decay applies only to the elements that DecayRuns names (the network's GEMM weights), the
// rest take the same update without it.
#include "fusedp/core/config.hpp"

#include <cmath>
#include <cstddef>
#include <cstring>

namespace fusedp::kernels {

template <class T>
struct SgdStep {
  T lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first;  // PyTorch starts the momentum buffer as the first gradient itself
  bool decay_all = true;  // false: weight decay only where DecayRuns says (Decay::weights)

  /// The update with its branches decided at compile time (Host loops over ranges with them, so the
  /// loop has no branch and vectorizes); the same expressions as operator(), so the same bits.
  template <bool Decay, bool Momentum, bool First, bool Nesterov>
  FUSEDP_HD void apply(T& p, T g, T& buf) const {
    if constexpr (Decay) g += weight_decay * p;
    if constexpr (Momentum) {
      buf = First ? g : momentum * buf + (T(1) - dampening) * g;
      g = Nesterov ? g + momentum * buf : buf;
    }
    p -= lr * g;
  }

  FUSEDP_HD void operator()(T& p, T g, T& buf) const {
    if (weight_decay != T(0)) g += weight_decay * p;
    if (momentum != T(0)) {
      buf = first ? g : momentum * buf + (T(1) - dampening) * g;
      g = nesterov ? g + momentum * buf : buf;
    }
    p -= lr * g;
  }

  /// Calls f.template operator()<Decay, Momentum, First, Nesterov>() with this update's flags.
  template <class F>
  void with_flags(F&& f) const {
    const bool decay = weight_decay != T(0), mom = momentum != T(0);
    auto nest = [&]<bool D, bool M>() {
      if constexpr (!M) {
        f.template operator()<D, false, false, false>();
      } else if (first) {
        if (nesterov) f.template operator()<D, true, true, true>();
        else f.template operator()<D, true, true, false>();
      } else {
        if (nesterov) f.template operator()<D, true, false, true>();
        else f.template operator()<D, true, false, false>();
      }
    };
    if (decay) {
      if (mom) nest.template operator()<true, true>();
      else nest.template operator()<true, false>();
    } else {
      if (mom) nest.template operator()<false, true>();
      else nest.template operator()<false, false>();
    }
  }
};

template <class T>
struct AdamStep {
  T lr, beta1, beta2, eps, weight_decay;
  bool decoupled;   // AdamW: decay the weights, not the gradient
  T bias1, bias2;   // 1 - beta^t for the step t being taken
  bool decay_all = true;  // false: weight decay only where DecayRuns says (Decay::weights)

  FUSEDP_HD void operator()(T& p, T g, T& m, T& v) const {
    using std::sqrt;
    if (decoupled) p *= T(1) - lr * weight_decay;
    else if (weight_decay != T(0)) g += weight_decay * p;
    m = beta1 * m + (T(1) - beta1) * g;
    v = beta2 * v + (T(1) - beta2) * g * g;
    const T denom = sqrt(v) / sqrt(bias2) + eps;
    p -= (lr / bias1) * m / denom;
  }
};

/// The same update without weight decay (for the elements Decay::weights leaves out).
template <class Op>
FUSEDP_HD Op without_decay(Op op) {
  op.weight_decay = decltype(op.weight_decay)(0);
  return op;
}

namespace detail {
template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;  // float members: +0 and -0 differ, a NaN equals itself
}
}  // namespace detail

/// Whether two steps hold the same numbers bit for bit (their padding aside): a Cuda model rewrites the
/// device copy of its step only when the next one differs (SGD at a constant learning rate: from the
/// second step on, never).
// identical() names every field; a field added to a step must be added there too.
static_assert(sizeof(SgdStep<float>) == 4 * sizeof(float) + 4, "SgdStep changed: update identical()");
static_assert(sizeof(AdamStep<float>) == 9 * sizeof(float), "AdamStep changed: update identical()");

template <class T>
[[nodiscard]] bool identical(const SgdStep<T>& a, const SgdStep<T>& b) {
  using detail::same_bits;
  return same_bits(a.lr, b.lr) && same_bits(a.momentum, b.momentum) && same_bits(a.dampening, b.dampening) &&
         same_bits(a.weight_decay, b.weight_decay) && a.nesterov == b.nesterov && a.first == b.first &&
         a.decay_all == b.decay_all;
}
template <class T>
[[nodiscard]] bool identical(const AdamStep<T>& a, const AdamStep<T>& b) {
  using detail::same_bits;
  return same_bits(a.lr, b.lr) && same_bits(a.beta1, b.beta1) && same_bits(a.beta2, b.beta2) &&
         same_bits(a.eps, b.eps) && same_bits(a.weight_decay, b.weight_decay) && a.decoupled == b.decoupled &&
         same_bits(a.bias1, b.bias1) && same_bits(a.bias2, b.bias2) && a.decay_all == b.decay_all;
}

/// An SgdStep or an AdamStep, which one decided at run time: the update a weight-gradient GEMM applies
/// in its epilogue on Cuda (issue 17: the optimizer fused into the gradient's final reduction). A
/// kind that is data keeps the GEMMs compiled once, not once per optimizer; every thread of a launch
/// takes the same branch, so the choice costs a uniform compare next to the memory the update waits
/// for. Each kind runs its step's own operator(), so the bits are those of the separate pass.
template <class T>
struct AnyStep {
  enum class Kind : unsigned { sgd, adam };
  Kind kind = Kind::sgd;
  SgdStep<T> sgd{};
  AdamStep<T> adam{};

  static AnyStep of(const SgdStep<T>& s) { return {Kind::sgd, s, {}}; }
  static AnyStep of(const AdamStep<T>& a) { return {Kind::adam, {}, a}; }
  /// Whether the step decays every parameter (Decay::all), not only the GEMM weights.
  [[nodiscard]] FUSEDP_HD bool decays_all() const { return kind == Kind::sgd ? sgd.decay_all : adam.decay_all; }
  /// Whether an optimizer whose update<T>() returns Op can be applied this way.
  template <class Op>
  static constexpr bool holds = requires(const Op& op) { AnyStep::of(op); };
};

/// Whether a and b hold the same kind and the same numbers of it, bit for bit.
template <class T>
[[nodiscard]] bool identical(const AnyStep<T>& a, const AnyStep<T>& b) {
  using Kind = typename AnyStep<T>::Kind;
  return a.kind == b.kind && (a.kind == Kind::sgd ? identical(a.sgd, b.sgd) : identical(a.adam, b.adam));
}

/// Where a tensor's update goes when the kernel that finishes its gradient applies it: the step (device
/// memory on Cuda, rewritten before a training step whose numbers differ from the last one's, so that
/// one recorded graph serves every step),
/// the tensor's parameters and its optimizer state (slot s of element i at state[s * stride + i]), and
/// whether it is a GEMM weight (decays: what Decay::weights decays) or a bias (the step's decay only
/// under Decay::all). A default-constructed target is inactive: the kernel only stores the gradient.
template <class T>
struct UpdateTarget {
  const AnyStep<T>* step = nullptr;
  T* params = nullptr;
  T* state = nullptr;
  std::size_t stride = 0;  // elements between state slots (the network's param_storage)
  bool decays = true;

  [[nodiscard]] FUSEDP_HD bool active() const { return step != nullptr; }
  /// The same target for the tensor `offset` elements further into the flat buffers, a GEMM weight
  /// (`weight`) or a bias.
  [[nodiscard]] FUSEDP_HD UpdateTarget at(std::size_t offset, bool weight = true) const {
    return step ? UpdateTarget{step, params + offset, state + offset, stride, weight} : UpdateTarget{};
  }
  /// The step, read once by a kernel before its loop (a local copy: the stores to params and state
  /// cannot make the compiler read it again).
  [[nodiscard]] FUSEDP_HD AnyStep<T> load() const { return *step; }
  /// Element i has its finished gradient g: the optimizer's update of parameter i with step `s`
  /// (load()), as the separate pass applies it: with the step's decay where DecayRuns would say the
  /// element decays.
  FUSEDP_HD void apply(const AnyStep<T>& s, std::size_t i, T g) const {
    const bool decay = decays || s.decays_all();
    if (s.kind == AnyStep<T>::Kind::sgd) {
      if (decay) s.sgd(params[i], g, state[i]);
      else without_decay(s.sgd)(params[i], g, state[i]);
    } else {
      if (decay) s.adam(params[i], g, state[i], state[stride + i]);
      else without_decay(s.adam)(params[i], g, state[i], state[stride + i]);
    }
  }
};

/// What a layer's weight-gradient kernels apply as they finish its gradients: the update of its weight
/// and of its bias (either inactive).
template <class T>
struct LayerUpdate {
  UpdateTarget<T> weight{};
  UpdateTarget<T> bias{};
};

/// Runs [begin, end) of a flat buffer, in order, numbered consecutively: element j of the runs is
/// element index(j) of the buffer. What a pass over "everything but" some tensors walks (the update of
/// the parameters whose gradient GEMMs did not apply it). `bounds` holds 2 * count offsets, `prefix`
/// count + 1 (prefix[k]: elements in the runs before run k; prefix[count] the total). `elements` is that
/// total held by value: the arrays may be device memory, which the host that sizes the launch cannot read.
struct ElementRuns {
  const std::size_t* bounds = nullptr;
  const std::size_t* prefix = nullptr;
  std::size_t count = 0;
  std::size_t elements = 0;

  ElementRuns() = default;
  // All four, so that no caller leaves the count at zero (which would skip every element).
  FUSEDP_HD constexpr ElementRuns(const std::size_t* bounds_, const std::size_t* prefix_, std::size_t count_,
                                  std::size_t elements_)
      : bounds(bounds_), prefix(prefix_), count(count_), elements(elements_) {}

  [[nodiscard]] FUSEDP_HD std::size_t size() const { return elements; }
  [[nodiscard]] FUSEDP_HD std::size_t index(std::size_t j) const {
    std::size_t lo = 0, hi = count;  // the last run with prefix <= j
    while (hi - lo > 1) {
      const std::size_t mid = (lo + hi) / 2;
      if (prefix[mid] <= j) lo = mid;
      else hi = mid;
    }
    return bounds[2 * lo] + (j - prefix[lo]);
  }
};

/// Where weight decay applies in a part of the flat parameter buffer: `count` runs [bounds[2k],
/// bounds[2k + 1]) of offsets into the whole buffer, in order (Sequential::weight_runs, in the
/// space's memory); element i of the part is element base + i of the whole (a ZeRO-1 block).
struct DecayRuns {
  const std::size_t* bounds = nullptr;
  std::size_t count = 0;
  std::size_t base = 0;
  bool given = false;  // false: the caller did not say (only an update that decays everything may run)

  // The first run that ends after element i of the part.
  FUSEDP_HD std::size_t run_after(std::size_t i) const {
    const std::size_t g = base + i;
    std::size_t lo = 0, hi = count;
    while (lo < hi) {
      const std::size_t mid = (lo + hi) / 2;
      if (bounds[2 * mid + 1] <= g) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
  /// Whether element i of the part decays (a binary search over the runs).
  FUSEDP_HD bool decays(std::size_t i) const {
    const std::size_t k = run_after(i);
    return k < count && bounds[2 * k] <= base + i;
  }
};

/// Calls f(j0, j1, decays) for the consecutive pieces of elements [i0, i1) of a part that decay or do
/// not (the Host's loops: one search per chunk, not per element).
template <class F>
void for_decay_pieces(const DecayRuns& r, std::size_t i0, std::size_t i1, F&& f) {
  std::size_t k = r.run_after(i0);
  for (std::size_t i = i0; i < i1;) {
    if (k == r.count) {
      f(i, i1, false);
      return;
    }
    const std::size_t begin = r.bounds[2 * k], end = r.bounds[2 * k + 1];  // of the whole buffer
    if (r.base + i < begin) {
      const std::size_t j = begin - r.base < i1 ? begin - r.base : i1;
      f(i, j, false);
      i = j;
    } else {
      const std::size_t j = end - r.base < i1 ? end - r.base : i1;
      f(i, j, true);
      i = j;
      ++k;
    }
  }
}

/// Applies `op` to elements [i0, i1), with or without its weight decay as `runs` say. `each(o, j0, j1)`
/// applies update o to the elements [j0, j1).
template <class Op, class Each>
void apply_with_decay(const Op& op, const DecayRuns& runs, std::size_t i0, std::size_t i1, Each&& each) {
  if (op.decay_all || op.weight_decay == decltype(op.weight_decay)(0)) {
    if (i0 < i1) each(op, i0, i1);
    return;
  }
  const Op plain = without_decay(op);
  for_decay_pieces(runs, i0, i1, [&](std::size_t j0, std::size_t j1, bool decays) {
    if (j0 < j1) each(decays ? op : plain, j0, j1);
  });
}

}  // namespace fusedp::kernels
