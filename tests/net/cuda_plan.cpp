// tests include/fusedp/net/cuda_plan.hpp where g++ alone can: the Cuda plan is a compile-time fact of
// the network type, so it is checked here without nvcc (tests/gpu/mlp.cu holds the seed networks'
// plans; this file what naming layers must not change).
#include <doctest/doctest.h>

#include <fusedp/layers/named.hpp>
#include <fusedp/net/cuda_plan.hpp>

#include <cstddef>
#include <utility>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;

namespace {

inline constexpr char conv1[] = "conv1";
inline constexpr char pool1[] = "pool1";
inline constexpr char conv2[] = "conv2";
inline constexpr char pool2[] = "pool2";
inline constexpr char fc1[] = "fc1";
inline constexpr char fc2[] = "fc2";
inline constexpr char fc3[] = "fc3";

// LeNet with every layer that has parameters or a window under a name (checkpoint keys as a PyTorch
// module with named children would have them).
using NamedLeNet =
    fp::Sequential<fp::Input<1, 28, 28>, fp::Named<conv1, fp::Conv2d<6, 5>>, fp::ReLU, fp::Named<pool1, fp::MaxPool2d<2>>,
                   fp::Named<conv2, fp::Conv2d<16, 3>>, fp::ReLU, fp::Named<pool2, fp::MaxPool2d<2>>, fp::Flatten,
                   fp::Named<fc1, fp::Linear<120>>, fp::ReLU, fp::Named<fc2, fp::Linear<60>>, fp::ReLU,
                   fp::Named<fc3, fp::Linear<10>>>;

// Whether two plans have the same groups (kind, first and last stage) and the same fused gradient
// boundaries.
template <class A, class B>
constexpr bool same_plan() {
  if (A::group_count != B::group_count) return false;
  for (std::size_t i = 0; i < A::group_count; ++i)
    if (A::summary[i].kind != B::summary[i].kind || A::summary[i].first != B::summary[i].first ||
        A::summary[i].last != B::summary[i].last)
      return false;
  return [&]<std::size_t... G>(std::index_sequence<G...>) {
    return ((A::template receives_dz<G> == B::template receives_dz<G> &&
             A::template dz_receiver<G> == B::template dz_receiver<G>) && ...);
  }(std::make_index_sequence<A::group_count>{});
}

template <class P>
using Named = fp::CudaPlan<NamedLeNet, P>;
template <class P>
using Plain = fp::CudaPlan<seed_networks::LeNet, P>;

// Before Named was seen through, a named conv lost its max-pool fusion and a named Linear run its
// fused MLP and every fused gradient boundary.
static_assert(same_plan<Named<fp::precision::Tf32>, Plain<fp::precision::Tf32>>());
static_assert(same_plan<Named<fp::precision::Fp32>, Plain<fp::precision::Fp32>>());
static_assert(Named<fp::precision::Tf32>::summary[0].kind == fp::CudaGroupKind::conv_maxpool);
static_assert(Named<fp::precision::Tf32>::summary[4].kind == fp::CudaGroupKind::mlp);

}  // namespace

TEST_CASE("a named layer is planned on Cuda as the layer itself") {
  CHECK(same_plan<Named<fp::precision::Tf32>, Plain<fp::precision::Tf32>>());
  CHECK(same_plan<Named<fp::precision::Fp32>, Plain<fp::precision::Fp32>>());
  CHECK(Named<fp::precision::Tf32>::receives_dz<0>);
  CHECK(Named<fp::precision::Tf32>::receives_dz<1>);
}
