// Traces of a Model<Net, Cuda> (exec/cuda_trace.hpp): a step launched directly records each stage's
// forward and backward, the loss and the optimizer's pass (where one runs), timed by CUDA events,
// inside its step; a step replayed from a graph records its step alone; tracing changes no result bit.
#include "gpu_test.hpp"

#include <fusedp/exec/trace.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fp = fusedp;
namespace tr = fusedp::trace;
using namespace gpu_test;

namespace {
using Net = fp::Sequential<fp::Input<3, 8, 8>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<32>, fp::ReLU, fp::Linear<10>>;

template <class M>
void train(M& m, int steps) {
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> x = random_values(16 * Net::input_shape::size, 300 + std::uint64_t(s));
    const std::vector<std::int32_t> y = labels_for(16, 10, 400 + std::uint64_t(s));
    (void)m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  }
}

std::vector<float> params_of(fp::Model<Net, fp::Cuda>& m) {
  std::vector<float> p(Net::param_storage);
  m.copy_params_to_host(p);
  return p;
}
}  // namespace

TEST_CASE("a traced Cuda model: event-timed spans nested in their steps, the same bits as untraced") {
  FUSEDP_GPU_REQUIRE_DEVICE();
  for (const bool graphs : {false, true}) {
    CAPTURE(graphs);
    fp::Model<Net, fp::Cuda> plain{fp::seed(6), fp::Cuda{0}};
    fp::Model<Net, fp::Cuda> traced{fp::seed(6), fp::Cuda{0}};
    plain.use_graphs(graphs);
    traced.use_graphs(graphs);
    train(plain, 4);
    tr::Recorder r;
    {
      const tr::Session on(r);
      train(traced, 4);
    }
    const std::vector<float> a = params_of(plain), b = params_of(traced);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    const std::vector<tr::Span> spans = r.spans();
    const auto count = [&](tr::Kind k) {
      return std::count_if(spans.begin(), spans.end(), [&](const tr::Span& s) { return s.kind == k; });
    };
    CHECK(count(tr::Kind::step) == 4);
    // Launched directly: every step's stages. With graphs: the first step runs directly, the second is
    // recorded (not timed), the rest replay (one span each).
    const std::ptrdiff_t direct = graphs ? 1 : 4;
    CHECK(count(tr::Kind::loss) == direct);
    // Every tensor of Net is updated in its weight gradient's GEMM (issue 17): no optimizer pass runs,
    // so no optimizer span; the separate pass has one.
    static_assert(fp::CudaPlan<Net, fp::precision::Tf32>::rest_run_count == 0);
    CHECK(count(tr::Kind::optimizer) == 0);
    CHECK(count(tr::Kind::forward) >= 3 * direct);
    CHECK(count(tr::Kind::backward) >= 3 * direct);
    for (const tr::Span& s : spans) {
      CHECK(s.end_ns >= s.begin_ns);
      if (s.kind == tr::Kind::step) continue;
      const bool in_step = std::any_of(spans.begin(), spans.end(), [&](const tr::Span& o) {
        return o.kind == tr::Kind::step && o.begin_ns <= s.begin_ns && s.end_ns <= o.end_ns;
      });
      CHECK(in_step);
    }
  }
}
