// BatchNorm, residual blocks and ResNet-18 on Cuda against the Host model in double: gradients,
// outputs (evaluation mode: the running statistics), parameters and running statistics after SGD
// steps. Bounds as in gpu_test.hpp, with ReLU decisions that rounding can flip (discrete).
#include "gpu_test.hpp"

#include <fusedp/kernels/cuda/batch_norm_split.hpp>

#include <array>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>

namespace fp = fusedp;
using namespace gpu_test;

namespace {

// A stem, an identity block and a projection block, as a ResNet's stages have them.
using SmallResNet = fp::Sequential<fp::Input<3, 8, 8>, fp::Named<fp::models::names::conv1, fp::Conv2d<8, 3, 1, 1, fp::no_bias>>,
                                   fp::Named<fp::models::names::bn1, fp::BatchNorm2d<>>, fp::ReLU,
                                   fp::Named<fp::models::names::layer1_0, fp::models::BasicBlock<8, 1, false>>, fp::ReLU,
                                   fp::Named<fp::models::names::layer2_0, fp::models::BasicBlock<16, 2, true>>, fp::ReLU,
                                   fp::GlobalAvgPool2d, fp::Flatten, fp::Named<fp::models::names::fc, fp::Linear<10>>>;
// BatchNorm1d and a BatchNorm with a saved epilogue input, no blocks.
using NormMlp = fp::Sequential<fp::Input<3, 6, 6>, fp::Conv2d<6, 3, 1, 0, fp::no_bias>, fp::BatchNorm2d<0.2>,
                               fp::Tanh, fp::GELU, fp::Flatten, fp::Linear<32>, fp::BatchNorm1d<>, fp::ReLU,
                               fp::Linear<10>>;
// BatchNorm's training passes split over several blocks a channel (kernels/cuda/batch_norm_split.hpp):
// 32 x 32 planes at batch 9 are 9,216 values a channel, two chunks whose boundary cuts a sample. The
// first BatchNorm has no parameters and no dx to write; the block's last one adds the shortcut.
using SplitNorm = fp::Sequential<fp::Input<2, 32, 32>, fp::BatchNorm2d<0.1, 1e-5, false>, fp::ReLU,
                                 fp::Conv2d<4, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                                 fp::models::BasicBlock<4, 1, false>, fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten,
                                 fp::Linear<10>>;
static_assert(fp::kernels::cuda::BatchNormSplit::training(9, 4, 32 * 32).chunks == 2);

template <class Space, class Net>
void compare_buffers(std::size_t batch, std::uint64_t stream) {
  const auto x = random_values(batch * Net::input_shape::size, stream);
  const std::vector<double> xd(x.begin(), x.end());
  const auto y = labels_for(batch, 10, stream + 1);
  fp::Model<Net, fp::Host, double> ref{fp::seed(5), fp::Host{0}};
  fp::Model<Net, Space> m{fp::seed(5), make_space<Space>()};
  fp::Sgd o1{{.lr = 0.05f, .momentum = 0.9f}}, o2 = o1;
  for (int s = 0; s < 3; ++s) {
    (void)ref.train_step(std::span<const double>(xd), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    (void)m.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
  }
  const std::vector<float> buffers = buffers_on_host(m);
  for (const fp::StateTensor& t : Net::state_layout) {
    if (t.kind != fp::StateKind::buffer) continue;
    FUSEDP_CHECK_CLOSE(std::span<const float>(buffers.data() + t.offset, t.size),
                       std::span<const double>(ref.buffers().data() + t.offset, t.size), gradient_bound<Space>(8, true),
                       t.name.c_str() << " after 3 steps");
  }
}

// SyncBatchNorm's sums for two replicas in two threads of this process, through host memory: each
// side hands its values over, both add them in the same order (the same bits), and each copies the
// sum back. On Cuda the values are device memory on the given stream. What Parallel's communicators
// do with NCCL or MPI, without needing two devices.
struct PairSum {
  std::barrier<> meet{2};
  std::array<std::vector<double>, 2> values;
  struct Side {
    PairSum* pair;
    int rank;
    bool device;
  };
  static void sum(void* context, double* v, std::size_t n, void* stream) {
    const Side& side = *static_cast<Side*>(context);
    PairSum& p = *side.pair;
    std::vector<double>& mine = p.values[std::size_t(side.rank)];
    mine.resize(n);
#if FUSEDP_HAS_CUDA
    if (side.device) {
      FUSEDP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
      FUSEDP_CUDA_CHECK(cudaMemcpy(mine.data(), v, n * sizeof(double), cudaMemcpyDeviceToHost));
    } else
#endif
      std::copy(v, v + n, mine.begin());
    p.meet.arrive_and_wait();
    std::vector<double> total(n);
    for (std::size_t i = 0; i < n; ++i) total[i] = p.values[0][i] + p.values[1][i];
    p.meet.arrive_and_wait();
#if FUSEDP_HAS_CUDA
    if (side.device) {
      // On the model's stream, and waited for: a plain cudaMemcpy from pageable memory runs on the legacy
      // stream, which the model's non-blocking streams do not wait for, and may return before the values
      // reach the device (review, 2026-12-06).
      FUSEDP_CUDA_CHECK(cudaMemcpyAsync(v, total.data(), n * sizeof(double), cudaMemcpyHostToDevice,
                                        static_cast<cudaStream_t>(stream)));
      FUSEDP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
      return;
    }
#endif
    (void)stream;
    std::copy(total.begin(), total.end(), v);
  }
};

}  // namespace

#define FUSEDP_NORM_SPACES fp::Host, fp::CudaFp32, fp::Cuda

namespace {
// Two models of networks that compute alike, made from one seed: three SGD steps on one batch (of
// `in` values a sample, from random stream `stream`), then a prediction of it, give the same bits.
template <class A, class B>
void train_alike(A& a, B& b, std::size_t batch, std::size_t in, std::uint64_t stream) {
  const auto x = random_values(batch * in, stream);
  const auto y = labels_for(batch, 10, stream + 1);
  fp::Sgd o1{{.lr = 0.1f, .momentum = 0.9f}}, o2 = o1;
  for (int s = 0; s < 3; ++s) {
    const float la = a.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    const float lb = b.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
    CHECK(la == lb);
  }
  CHECK(params_on_host(a) == params_on_host(b));
  CHECK(buffers_on_host(a) == buffers_on_host(b));
  const auto pa = a.predict(std::span<const float>(x));
  const auto pb = b.predict(std::span<const float>(x));
  CHECK(std::vector<float>(pa.begin(), pa.end()) == std::vector<float>(pb.begin(), pb.end()));
}
}  // namespace

TEST_CASE_TEMPLATE("BatchNorm2d, BatchNorm1d and their epilogues match the Host model in double", Space,
                   FUSEDP_NORM_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, NormMlp, fp::SoftmaxCrossEntropy>(40, labels_for(40, 10, 3), 4, true, 50);
  compare_buffers<Space, NormMlp>(40, 52);
}

TEST_CASE_TEMPLATE("BatchNorm split over several blocks a channel, without parameters or dx, matches the Host model "
                   "in double", Space, FUSEDP_NORM_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, SplitNorm, fp::SoftmaxCrossEntropy>(9, labels_for(9, 10, 5), 8, true, 64);
  compare_buffers<Space, SplitNorm>(9, 66);
}

TEST_CASE_TEMPLATE("residual blocks with identity and projection shortcuts match the Host model in double", Space,
                   FUSEDP_NORM_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  compare_with_host_double<Space, SmallResNet, fp::SoftmaxCrossEntropy>(24, labels_for(24, 10, 4), 8, true, 60);
  compare_buffers<Space, SmallResNet>(24, 62);
}

// BatchNorm2d that runs in passes of its own: a block whose body ends in it adds in a separate pass, and
// evaluation does not fold it into the conv before it.
struct SeparateNorm : fp::BatchNorm2d<> {
  static constexpr bool adds_before_epilogue = false;
  static constexpr bool folds_into_previous = false;
};
using FusedBlocks = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1, fp::no_bias>, fp::BatchNorm2d<>, fp::ReLU,
                                   fp::models::BasicBlock<16, 2, true>, fp::ReLU, fp::models::BasicBlock<16, 1, false>,
                                   fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<10>>;
using SeparateBlocks = fp::Sequential<
    fp::Input<3, 8, 8>, fp::Conv2d<8, 3, 1, 1, fp::no_bias>, SeparateNorm, fp::ReLU,
    fp::Residual<fp::Conv2d<16, 3, 2, 1, fp::no_bias>, SeparateNorm, fp::ReLU, fp::Conv2d<16, 3, 1, 1, fp::no_bias>,
                 SeparateNorm, fp::Projection<fp::Conv2d<16, 1, 2, 0, fp::no_bias>, SeparateNorm>>,
    fp::ReLU,
    fp::Residual<fp::Conv2d<16, 3, 1, 1, fp::no_bias>, SeparateNorm, fp::ReLU, fp::Conv2d<16, 3, 1, 1, fp::no_bias>,
                 SeparateNorm, fp::IdentityShortcut>,
    fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<10>>;

TEST_CASE_TEMPLATE("the block's add in BatchNorm's pass and BatchNorm folded into the conv in evaluation give the "
                   "bits of separate passes",
                   Space, FUSEDP_NORM_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  static_assert(fp::detail::folds_next<FusedBlocks, 0>() && !fp::detail::folds_next<SeparateBlocks, 0>());
  const std::size_t batch = 6;
  fp::Model<FusedBlocks, Space> fused{fp::seed(8), make_space<Space>()};
  fp::Model<SeparateBlocks, Space> separate{fp::seed(8), make_space<Space>()};
  train_alike(fused, separate, batch, FusedBlocks::input_shape::size, 100);
}

namespace {
// A layer a Bf16 model keeps in fp32 elements (it declares no 16-bit kernels): the same kernels, on the
// same bf16 values, its tensors and their gradients in fp32 elements.
template <class L>
struct Wide : L {
  template <class In>
  static constexpr bool cuda_reads_16bit = false;
  template <class In, class Epi>
  static constexpr bool cuda_writes_16bit = false;
  template <class In, class Epi>
  static constexpr bool cuda_reads_16bit_gradient = false;
  template <class In>
  static constexpr bool cuda_writes_16bit_gradient = false;
};
template <class L>
using Same = L;
// A stem, a projection block, an identity block and a bottleneck block (1x1, 3x3 with stride 2 and 1x1
// convs, the last two reading 16-bit inputs), each layer and block wrapped in W.
template <template <class> class W>
using BlocksOf = fp::Sequential<
    fp::Input<3, 8, 8>, W<fp::Conv2d<8, 3, 1, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::ReLU,
    W<fp::Residual<W<fp::Conv2d<16, 3, 2, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::ReLU,
                   W<fp::Conv2d<16, 3, 1, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>,
                   fp::Projection<W<fp::Conv2d<16, 1, 2, 0, fp::no_bias>>, W<fp::BatchNorm2d<>>>>>,
    fp::ReLU,
    W<fp::Residual<W<fp::Conv2d<16, 3, 1, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::ReLU,
                   W<fp::Conv2d<16, 3, 1, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::IdentityShortcut>>,
    fp::ReLU,
    W<fp::Residual<W<fp::Conv2d<8, 1, 1, 0, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::ReLU,
                   W<fp::Conv2d<8, 3, 2, 1, fp::no_bias>>, W<fp::BatchNorm2d<>>, fp::ReLU,
                   W<fp::Conv2d<24, 1, 1, 0, fp::no_bias>>, W<fp::BatchNorm2d<>>,
                   fp::Projection<W<fp::Conv2d<24, 1, 2, 0, fp::no_bias>>, W<fp::BatchNorm2d<>>>>>,
    fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<10>>;
using NarrowBlocks = BlocksOf<Same>;
using WideBlocks = BlocksOf<Wide>;
template <class Net, std::size_t I>
using body_narrow = typename Net::template stage<I>::layer::template body_layout<typename Net::template stage<I>::in,
                                                                                 fp::precision::Bf16>;
// NarrowBlocks stores its stem's outputs, its blocks' outputs but the last (which average pooling reads),
// and inside the blocks their convs' and inner BatchNorms' outputs (and the projections' convs') in 16
// bits; WideBlocks the same values in fp32 elements.
constexpr bool on = fp::cuda_narrow_outputs;
template <class Net, std::size_t G>
constexpr bool group_narrow = fp::CudaPlan<Net, fp::precision::Bf16>::template narrow_output<G>;
static_assert(fp::CudaPlan<NarrowBlocks, fp::precision::Bf16>::group_count == 8);
static_assert(group_narrow<NarrowBlocks, 0> == on && group_narrow<NarrowBlocks, 1> == on &&
              group_narrow<NarrowBlocks, 2> == on && group_narrow<NarrowBlocks, 3> == on &&
              !group_narrow<NarrowBlocks, 4>);
static_assert(!group_narrow<WideBlocks, 0> && !group_narrow<WideBlocks, 1> && !group_narrow<WideBlocks, 2> &&
              !group_narrow<WideBlocks, 3> && !group_narrow<WideBlocks, 4>);
static_assert(body_narrow<NarrowBlocks, 2>::narrow == std::array<bool, 4>{on, on, on, false});
static_assert(body_narrow<NarrowBlocks, 4>::narrow == std::array<bool, 6>{on, on, on, on, on, false});
static_assert(body_narrow<WideBlocks, 2>::narrow == std::array<bool, 4>{});
static_assert(body_narrow<WideBlocks, 3>::narrow == std::array<bool, 4>{});
static_assert(body_narrow<WideBlocks, 4>::narrow == std::array<bool, 6>{});
// And their gradients: NarrowBlocks the input gradients of its BatchNorm and of its blocks (read by the
// stem's conv, the BatchNorm past its ReLU, the block before) and those inside its blocks in 16 bits.
template <class Net, std::size_t I>
constexpr bool dx_narrow = sizeof(typename fp::CudaWorkspace<Net, fp::precision::Bf16>::template dx_element<I>) == 2;
template <class Net, std::size_t I>
constexpr bool inner_gradients_narrow =
    sizeof(typename Net::template stage<I>::layer::template inner_gradient_element<typename Net::template stage<I>::in,
                                                                                    fp::precision::Bf16>) == 2;
static_assert(!dx_narrow<NarrowBlocks, 0> && dx_narrow<NarrowBlocks, 1> == on && dx_narrow<NarrowBlocks, 2> == on &&
              dx_narrow<NarrowBlocks, 3> == on && dx_narrow<NarrowBlocks, 4> == on && !dx_narrow<NarrowBlocks, 5>);
static_assert(inner_gradients_narrow<NarrowBlocks, 2> == on && inner_gradients_narrow<NarrowBlocks, 4> == on);
static_assert(!dx_narrow<WideBlocks, 1> && !dx_narrow<WideBlocks, 2> && !dx_narrow<WideBlocks, 3> &&
              !dx_narrow<WideBlocks, 4> && !inner_gradients_narrow<WideBlocks, 2> &&
              !inner_gradients_narrow<WideBlocks, 4>);
// nvcc's front end and g++ must agree on a block's plan (both evaluate these): a requires-expression in
// the lambda that computed fused_add made nvcc's false where g++'s was true (2026-12-07).
static_assert(fp::models::BasicBlock<64, 1, false>::fused_add<fp::Shape<64, 32, 32>> &&
              fp::models::BasicBlock<128, 2, true>::fused_add<fp::Shape<64, 32, 32>>);
using S16 = fp::Shape<16, 4, 4>;
static_assert(!fp::reads_16bit_input<Wide<fp::Conv2d<16, 3, 2, 1, fp::no_bias>>, S16>() &&
              !fp::reads_16bit_input<Wide<fp::Conv2d<16, 1, 2, 0, fp::no_bias>>, S16>() &&
              !fp::reads_16bit_input<Wide<fp::Conv2d<8, 1, 1, 0, fp::no_bias>>, S16>() &&
              !fp::reads_16bit_input<Wide<fp::Conv2d<24, 1, 2, 0, fp::no_bias>>, S16>() &&
              fp::reads_16bit_input<fp::Conv2d<16, 1, 2, 0, fp::no_bias>, S16>());

// Gradients (and running statistics) of two replicas that share their BatchNorms' sums (SyncBatchNorm's
// passes, through PairSum) over shards of `first` and batch - first samples (6 and 4).
template <class Net, class Space, std::size_t batch = 10, std::size_t first = 6>
std::array<std::vector<float>, 4> synchronized_shards(const std::vector<float>& x, const std::vector<std::int32_t>& y) {
  constexpr std::size_t in = Net::input_shape::size;
  std::array<fp::Model<Net, Space>, 2> replicas{fp::Model<Net, Space>{fp::seed(6), make_space<Space>()},
                                                fp::Model<Net, Space>{fp::seed(6), make_space<Space>()}};
  PairSum pair;
  std::array<PairSum::Side, 2> sides{PairSum::Side{&pair, 0, fp::is_cuda_space_v<Space>},
                                     PairSum::Side{&pair, 1, fp::is_cuda_space_v<Space>}};
  const std::span<const float> xs(x);
  const std::span<const std::int32_t> ys(y);
  {
    std::jthread second([&] {
      (void)replicas[1].compute_gradients(xs.subspan(first * in), ys.subspan(first), fp::SoftmaxCrossEntropy{}, {},
                                          batch, fp::ReplicaSum{&sides[1], &PairSum::sum});
    });
    (void)replicas[0].compute_gradients(xs.first(first * in), ys.first(first), fp::SoftmaxCrossEntropy{}, {}, batch,
                                        fp::ReplicaSum{&sides[0], &PairSum::sum});
  }
  return {grads_on_host(replicas[0]), grads_on_host(replicas[1]), buffers_on_host(replicas[0]),
          buffers_on_host(replicas[1])};
}
}  // namespace

namespace {
// A stem and a projection block whose BatchNorms run in passes of their own (SeparateNorm): the block
// adds in a pass of its own, which reads its body's and projection's fp32 outputs, and its first layers
// read the stem's 16-bit output.
template <template <class> class W>
using SeparateOf = fp::Sequential<
    fp::Input<3, 8, 8>, W<fp::Conv2d<8, 3, 1, 1, fp::no_bias>>, W<SeparateNorm>, fp::ReLU,
    W<fp::Residual<W<fp::Conv2d<16, 3, 2, 1, fp::no_bias>>, W<SeparateNorm>, fp::ReLU,
                   W<fp::Conv2d<16, 3, 1, 1, fp::no_bias>>, W<SeparateNorm>,
                   fp::Projection<W<fp::Conv2d<16, 1, 2, 0, fp::no_bias>>, W<SeparateNorm>>>>,
    fp::ReLU, fp::GlobalAvgPool2d, fp::Flatten, fp::Linear<10>>;
static_assert(group_narrow<SeparateOf<Same>, 1> == on && !group_narrow<SeparateOf<Same>, 2> &&
              !group_narrow<SeparateOf<Wide>, 1>);

// Narrow and Wide (the same network, Wide's layers declaring no 16-bit kernels) train, evaluate and
// synchronize their BatchNorms to the same bits on a Bf16 model.
template <class Narrow, class WideNet>
void same_bits_as_wide() {
  fp::Model<Narrow, fp::CudaBf16> narrow{fp::seed(9), make_space<fp::CudaBf16>()};
  fp::Model<WideNet, fp::CudaBf16> wide{fp::seed(9), make_space<fp::CudaBf16>()};
  train_alike(narrow, wide, 12, Narrow::input_shape::size, 110);
  // And the 16-bit layout is the smaller one.
  CHECK((narrow.memory_use().workspace < wide.memory_use().workspace) == fp::cuda_narrow_outputs);

  // SyncBatchNorm's separate passes over 16-bit inputs: the same bits too.
  const auto xs = random_values(10 * Narrow::input_shape::size, 112);
  const auto ys = labels_for(10, 10, 113);
  const auto sn = synchronized_shards<Narrow, fp::CudaBf16>(xs, ys);
  const auto sw = synchronized_shards<WideNet, fp::CudaBf16>(xs, ys);
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(sn[i] == sw[i]);
  }
}
}  // namespace

TEST_CASE("a Bf16 model's 16-bit BatchNorm and block tensors give the bits of the same values in fp32 elements") {
  // Training (the typed BatchNorm passes, the convs' 16-bit operands in both GEMMs of backward, the add
  // reading a 16-bit block input) and evaluation (the conv epilogue that folds a BatchNorm writing 16
  // bits, its add read in 16 bits).
  FUSEDP_GPU_REQUIRE_DEVICE();
  {
    INFO("a projection, an identity and a bottleneck block, each adding in its last BatchNorm's pass");
    same_bits_as_wide<NarrowBlocks, WideBlocks>();
  }
  {
    INFO("a block adding in a pass of its own after a 16-bit stem");
    same_bits_as_wide<SeparateOf<Same>, SeparateOf<Wide>>();
  }
}

TEST_CASE("ResNet-18 trains on Cuda: the loss of a repeated batch falls and stays finite") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  using R = fp::models::ResNet18Cifar<10>;
  const std::size_t batch = 32;
  const auto x = random_values(batch * R::input_shape::size, 70);
  const auto y = labels_for(batch, 10, 71);
  fp::Model<R, fp::Cuda> m{fp::seed(1), make_space<fp::Cuda>()};
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  float first = 0, last = 0;
  for (int s = 0; s < 8; ++s) {
    last = m.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, opt);
    if (s == 0) first = last;
    REQUIRE(std::isfinite(last));
  }
  CHECK(last < 0.5f * first);
}

namespace {
template <class Net, class Space, std::size_t batch, std::size_t first>
void synchronized_like_one(std::uint64_t stream) {
  constexpr std::size_t in = Net::input_shape::size;
  const auto x = random_values(batch * in, stream);
  const auto y = labels_for(batch, 10, stream + 1);
  const std::span<const float> xs(x);
  const std::span<const std::int32_t> ys(y);
  fp::Model<Net, Space> one{fp::seed(6), make_space<Space>()};
  (void)one.compute_gradients(xs, ys, fp::SoftmaxCrossEntropy{});
  const auto shards = synchronized_shards<Net, Space, batch, first>(x, y);  // both replicas' gradients, then buffers
  std::vector<float> sum = shards[0];
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += shards[1][i];
  const std::vector<float> want = grads_on_host(one);
  FUSEDP_CHECK_CLOSE(std::span<const float>(sum), std::span<const float>(want), 1e-4, "summed gradient");
  // The running statistics of each replica are those of the whole batch.
  for (std::size_t r = 2; r < 4; ++r) {
    FUSEDP_CHECK_CLOSE(shards[r], buffers_on_host(one), 1e-5, "running statistics");
  }
  // Without the sums each shard's own statistics give another gradient (the check above can fail).
  fp::Model<Net, Space> alone{fp::seed(6), make_space<Space>()};
  (void)alone.compute_gradients(xs.first(first * in), ys.first(first), fp::SoftmaxCrossEntropy{}, {}, batch);
  CHECK(relative_error(grads_on_host(alone), shards[0]) > 1e-3);
}
}  // namespace

TEST_CASE_TEMPLATE("SyncBatchNorm's passes: two replicas' shards compute what one model computes on the whole batch",
                   Space, fp::Host, fp::CudaFp32) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  synchronized_like_one<NormMlp, Space, 10, 6>(80);  // shards of 6 and 4
  // Shards of 18 and 10 samples of 32 x 32 split their BatchNorms into 4 and 2 chunks a channel on Cuda:
  // the replicas' totals, not their partials, are added up.
  static_assert(fp::kernels::cuda::BatchNormSplit::training(18, 4, 32 * 32).chunks == 4 &&
                fp::kernels::cuda::BatchNormSplit::training(10, 4, 32 * 32).chunks == 2);
  synchronized_like_one<SplitNorm, Space, 28, 18>(82);
}

// Issue 17: with BatchNorm and blocks, the GEMMs update the stem conv and the classifier and one pass the
// rest (blocks, BatchNorm): bit for bit what the separate pass over everything gives.
TEST_CASE_TEMPLATE("a ResNet's tensors updated in their GEMMs and the pass over the rest match the separate pass",
                   Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  using Net = SmallResNet;
  static_assert(fp::CudaPlan<Net, typename Space::precision>::rest_run_count > 0);
  const std::size_t batch = 12;
  const auto x = random_values(batch * Net::input_shape::size, 95);
  const auto y = labels_for(batch, 10, 96);
  fp::Model<Net, Space> fused{fp::seed(8), make_space<Space>()}, separate{fp::seed(8), make_space<Space>()};
  separate.use_fused_update(false);
  fp::Sgd o{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f, .decay = fp::Decay::weights}};
  fp::Sgd o1 = o, o2 = o;
  for (int s = 0; s < 3; ++s) {
    const float a = fused.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
    const float b = separate.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
    CHECK(a == b);
  }
  CHECK(params_on_host(fused) == params_on_host(separate));
  std::vector<float> s1(fused.optimizer_state().size()), s2(s1.size());
  fused.copy_optimizer_state_to_host(s1);
  separate.copy_optimizer_state_to_host(s2);
  CHECK(s1 == s2);
}

// Issue 17: backward's weight gradients on the side stream (net/backward_cursor.hpp) with BatchNorm steps,
// blocks and the pass over the rest between them: bit for bit the serial order, under AdamW.
TEST_CASE_TEMPLATE("a ResNet's and a normalized MLP's concurrent weight gradients give the bits of the serial order",
                   Space, fp::CudaFp32, fp::Cuda) {
  FUSEDP_GPU_REQUIRE_DEVICE();
  const auto run = []<class Net>(std::size_t batch, std::uint64_t stream) {
    const auto x = random_values(batch * Net::input_shape::size, stream);
    const auto y = labels_for(batch, Net::output_shape::size, stream + 1);
    fp::Model<Net, Space> branched{fp::seed(9), make_space<Space>()}, serial{fp::seed(9), make_space<Space>()};
    serial.use_backward_branches(false);
    fp::AdamW o1{{.lr = 1e-3f, .weight_decay = 0.01f}}, o2 = o1;
    for (int s = 0; s < 3; ++s) {
      float a = 0;
      {
        // Every forked weight gradient held back ~0.1 ms: a missing wait would let the BatchNorm and
        // block steps overwrite what it reads.
        const HeldBranches held;
        a = branched.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o1);
      }
      const float b = serial.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o2);
      CHECK(a == b);
    }
    CHECK(params_on_host(branched) == params_on_host(serial));
    CHECK(grads_on_host(branched) == grads_on_host(serial));
    std::vector<float> s1(branched.optimizer_state().size()), s2(s1.size());
    branched.copy_optimizer_state_to_host(s1);
    serial.copy_optimizer_state_to_host(s2);
    CHECK(s1 == s2);
  };
  run.template operator()<SmallResNet>(12, 97);
  run.template operator()<NormMlp>(10, 99);
}

TEST_CASE_TEMPLATE("Decay::weights on each space: the weights decay, BatchNorm and biases do not", Space, fp::Host,
                   fp::CudaFp32) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  using Net = NormMlp;
  const std::size_t batch = 16;
  const auto x = random_values(batch * Net::input_shape::size, 90);
  const auto y = labels_for(batch, 10, 91);
  // Host in float is the reference (Decay::weights there is held bit for bit by tests/optim/decay.cpp);
  // Cuda runs its graph path (train_step with a plain Sgd), the runs read in the optimizer kernel.
  fp::Model<Net, fp::Host> ref{fp::seed(7), fp::Host{0}};
  fp::Model<Net, Space> m{fp::seed(7), make_space<Space>()}, all{fp::seed(7), make_space<Space>()};
  fp::Sgd o{{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.5f, .decay = fp::Decay::weights}};
  fp::Sgd o_ref = o, o_m = o, o_all = o;
  o_all.options.decay = fp::Decay::all;
  for (int s = 0; s < 3; ++s) {
    (void)ref.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o_ref);
    (void)m.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o_m);
    (void)all.train_step(std::span<const float>(x), std::span(y), fp::SoftmaxCrossEntropy{}, o_all);
  }
  const std::vector<float> want(ref.params().begin(), ref.params().end());
  FUSEDP_CHECK_CLOSE(params_on_host(m), want, 1e-4, "parameters after 3 steps with Decay::weights");
  CHECK(relative_error(params_on_host(all), want) > 1e-3);  // decaying everything lands elsewhere
}
