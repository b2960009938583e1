// Every GEMM stage kernel against the unfused Host reference: Linear and Conv2d forward and backward
// with several epilogues, and Conv2d with max-pooling fused, on fresh random inputs at sizes that are
// not multiples of any tile, outputs poisoned (NaN) before the run. One test body per stage, run for
// each space: Host (float; a check of the harness), Cuda in fp32, TF32 and BF16. The reference is the
// Host kernels in double; bounds per precision are in gpu_test.hpp.
//
// Backward is checked against the Host backward fed the *same* saved tensors the space produced (its
// y, z, pooled values and argmax): a TF32 forward flips the sign of a few near-zero pre-activations and
// the winner of a few near-tied pooling windows, and comparing gradients across such flips would
// measure the flips (about 2% in norm for TF32), not the kernels.
#include "gpu_test.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace fp = fusedp;
using namespace gpu_test;
using fp::kernels::Epilogue;

namespace {

template <class Space>
std::size_t scratch_for_host_or(const Space& space, std::size_t host_elements, std::size_t cuda_elements) {
  if constexpr (fp::is_cuda_space_v<Space>) return cuda_elements;
  else return std::size_t(space.threads()) * host_elements;
}

// Runs `Layer` (an anchor) forward and backward at input shape In with epilogue Epi on Space and on
// Host in double; compares y, z, dx, dw, db.
template <class Space, class Layer, class In, class Epi>
void check_stage(std::size_t batch, std::uint64_t stream) {
  using Out = typename Layer::template output<In>;
  constexpr auto specs = fp::params_of<Layer, In>();
  const std::size_t nx = batch * In::size, ny = batch * Out::size, nw = specs[0].size, nb = specs[1].size;
  const auto x = random_values(nx, stream), w = random_values(nw, stream + 1, -0.5f, 0.5f);
  const auto b = random_values(nb, stream + 2), dy = random_values(ny, stream + 3);

  // Reference: the Host stage in double.
  const fp::Host host{0};
  std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end()),
      dyd(dy.begin(), dy.end());
  std::vector<double> y_ref(ny), z_ref(ny), dx_ref(nx), dw_ref(nw), db_ref(nb);
  std::vector<double> host_scratch(std::size_t(host.threads()) * fp::host_scratch_of<Layer, In>() + 1);
  fp::StageArgs<fp::Host, double> r{host,          batch,         xd.data(),     y_ref.data(),
                                    Epi::saves_input ? z_ref.data() : nullptr, wd.data(), bd.data(), dyd.data(),
                                    dx_ref.data(), dw_ref.data(), db_ref.data(), host_scratch.data(),
                                    true,          1,             1,             1};
  Layer::template forward<In, Epi>(r);

  // The space under test, float, outputs poisoned.
  const Space space = make_space<Space>();
  auto xs = upload(space, x), ws = upload(space, w), bs = upload(space, b), dys = upload(space, dy);
  auto ys = poisoned<float>(space, ny), zs = poisoned<float>(space, Epi::saves_input ? ny : 0);
  auto dxs = poisoned<float>(space, nx), dws = poisoned<float>(space, nw), dbs = poisoned<float>(space, nb);
  std::size_t cuda_scratch = 0;
  if constexpr (fp::is_cuda_space_v<Space>) cuda_scratch = Layer::template cuda_scratch<In>(batch, space.sm_count());
  auto scratch = poisoned<float>(space, scratch_for_host_or(space, fp::host_scratch_of<Layer, In>(), cuda_scratch) + 1);
  fp::StageArgs<Space, float> a{space,     batch,      xs.data(),  ys.data(),      Epi::saves_input ? zs.data() : nullptr,
                                ws.data(), bs.data(),  dys.data(), dxs.data(),     dws.data(),
                                dbs.data(), scratch.data(), true,  1,              1,
                                1};
  Layer::template forward<In, Epi>(a);
  const auto y = download(space, ys);
  FUSEDP_CHECK_CLOSE(y, y_ref, bound<Space>(1), "y");
  std::vector<float> z;
  if constexpr (Epi::saves_input) {
    z = download(space, zs);
    FUSEDP_CHECK_CLOSE(z, z_ref, bound<Space>(1), "z");
  }
  Layer::template backward<In, Epi>(a);

  // The reference backward from the space's own y and z.
  std::vector<double> ys_d(y.begin(), y.end()), zs_d(z.begin(), z.end());
  r.y = ys_d.data();
  r.z = Epi::saves_input ? zs_d.data() : nullptr;
  Layer::template backward<In, Epi>(r);
  FUSEDP_CHECK_CLOSE(download(space, dxs), dx_ref, bound<Space>(1), "dx");
  FUSEDP_CHECK_CLOSE(download(space, dws), dw_ref, bound<Space>(1), "dW");
  FUSEDP_CHECK_CLOSE(download(space, dbs), db_ref, bound<Space>(1), "db");
}

// Conv2d + Epi then MaxPool2d<K> on Space, fused where the space fuses them (Cuda), against the Host
// conv stage and pool stage in double.
template <class Space, class Conv, class In, class Epi, int K>
void check_conv_maxpool(std::size_t batch, std::uint64_t stream) {
  using Pool = fp::MaxPool2d<K>;
  using Mid = typename Conv::template output<In>;
  using Out = typename Pool::template output<Mid>;
  constexpr auto specs = fp::params_of<Conv, In>();
  const std::size_t nx = batch * In::size, nm = batch * Mid::size, ny = batch * Out::size;
  const std::size_t nw = specs[0].size, nb = specs[1].size;
  const auto x = random_values(nx, stream), w = random_values(nw, stream + 1, -0.5f, 0.5f);
  const auto b = random_values(nb, stream + 2), dy = random_values(ny, stream + 3);

  const fp::Host host{0};
  std::vector<double> xd(x.begin(), x.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end()),
      dyd(dy.begin(), dy.end());
  std::vector<double> mid(nm), dmid(nm), y_ref(ny), dx_ref(nx), dw_ref(nw), db_ref(nb);
  std::vector<double> host_scratch(std::size_t(host.threads()) * fp::host_scratch_of<Conv, In>() + 1);
  fp::StageArgs<fp::Host, double> rc{host, batch,          xd.data(),     mid.data(),    nullptr,
                                     wd.data(), bd.data(), dmid.data(),   dx_ref.data(), dw_ref.data(),
                                     db_ref.data(), host_scratch.data(), true, 1,        1,
                                     1};
  fp::StageArgs<fp::Host, double> rp{host,    batch,   mid.data(), y_ref.data(), nullptr, nullptr, nullptr, dyd.data(),
                                     dmid.data(), nullptr, nullptr, nullptr,     true,    1,       1,       2};
  Conv::template forward<In, Epi>(rc);
  Pool::template forward<Mid, Epilogue<>>(rp);

  const Space space = make_space<Space>();
  auto xs = upload(space, x), ws = upload(space, w), bs = upload(space, b), dys = upload(space, dy);
  auto mids = poisoned<float>(space, nm), dmids = poisoned<float>(space, nm), ys = poisoned<float>(space, ny);
  auto dxs = poisoned<float>(space, nx), dws = poisoned<float>(space, nw), dbs = poisoned<float>(space, nb);
  std::size_t cuda_scratch = 0;
  if constexpr (fp::is_cuda_space_v<Space>) cuda_scratch = Conv::template cuda_scratch<In>(batch, space.sm_count());
  auto scratch = poisoned<float>(space, scratch_for_host_or(space, fp::host_scratch_of<Conv, In>(), cuda_scratch) + 1);
  fp::StageArgs<Space, float> ac{space,      batch,     xs.data(),   mids.data(), nullptr,
                                 ws.data(),  bs.data(), dmids.data(), dxs.data(), dws.data(),
                                 dbs.data(), scratch.data(), true,   1,           1,
                                 1};
  if constexpr (fp::is_cuda_space_v<Space>) {
    // the fused path: pooled values and one argmax byte per window (kept in the conv output's memory)
    auto* argmax = reinterpret_cast<std::uint8_t*>(mids.data());
    Conv::template forward_maxpool<In, Epi, K>(ac, ys.data(), argmax);
    const auto y = download(space, ys);
    FUSEDP_CHECK_CLOSE(y, y_ref, bound<Space>(1), "pooled y");
    const auto arg = download(space, std::span<const std::uint8_t>(argmax, ny));
    for (std::size_t i = 0; i < ny; ++i) REQUIRE_MESSAGE(arg[i] < K * K, "argmax byte " << int(arg[i]) << " at " << i);
    Conv::template backward_maxpool<In, Epi, K>(ac, dys.data(), ys.data(), argmax);
    // The reference: the gradient of the conv output from the space's own pooled values and winners,
    // then the Host conv backward (Epi' already applied, so with an empty epilogue).
    std::fill(dmid.begin(), dmid.end(), 0.0);
    const std::size_t ph = Out::height, pw = Out::width;
    for (std::size_t p = 0; p < batch * Mid::channels; ++p)
      for (std::size_t py = 0; py < ph; ++py)
        for (std::size_t px = 0; px < pw; ++px) {
          const std::size_t j = (p * ph + py) * pw + px;
          const std::size_t oy = py * K + arg[j] / K, ox = px * K + arg[j] % K;
          dmid[(p * Mid::height + oy) * Mid::width + ox] = double(dy[j]) * Epi::derivative(double(y[j]), double(y[j]));
        }
    rc.dy = dmid.data();
    Conv::template backward<In, Epilogue<>>(rc);
  } else {
    fp::StageArgs<Space, float> ap{space,  batch,   mids.data(), ys.data(), nullptr, nullptr,     nullptr, dys.data(),
                                   dmids.data(), nullptr, nullptr, nullptr, true,    1,           1,       2};
    Conv::template forward<In, Epi>(ac);
    Pool::template forward<Mid, Epilogue<>>(ap);
    FUSEDP_CHECK_CLOSE(download(space, ys), y_ref, bound<Space>(1), "pooled y");
    Pool::template backward<Mid, Epilogue<>>(ap);
    Conv::template backward<In, Epi>(ac);
    // The reference as on Cuda, through the float forward's own winners (the first maximum of each
    // window in scan order, as the Host pooling picks) and pooled values: in double, a near tie closer
    // than fp32 can pick another winner (seed 18288174198987476507 did, once in a few hundred runs).
    const auto m = download(space, mids);
    const auto y = download(space, ys);
    std::fill(dmid.begin(), dmid.end(), 0.0);
    const std::size_t ph = Out::height, pw = Out::width;
    for (std::size_t p = 0; p < batch * Mid::channels; ++p)
      for (std::size_t py = 0; py < ph; ++py)
        for (std::size_t px = 0; px < pw; ++px) {
          std::size_t best = (p * Mid::height + py * K) * Mid::width + px * K;
          for (std::size_t e = 0; e < std::size_t(K * K); ++e) {
            const std::size_t at = (p * Mid::height + py * K + e / K) * Mid::width + px * K + e % K;
            if (m[at] > m[best]) best = at;
          }
          const std::size_t j = (p * ph + py) * pw + px;
          dmid[best] = double(dy[j]) * Epi::derivative(double(y[j]), double(y[j]));
        }
    rc.dy = dmid.data();
    Conv::template backward<In, Epilogue<>>(rc);
  }
  FUSEDP_CHECK_CLOSE(download(space, dxs), dx_ref, bound<Space>(1), "dx");
  FUSEDP_CHECK_CLOSE(download(space, dws), dw_ref, bound<Space>(1), "dW");
  FUSEDP_CHECK_CLOSE(download(space, dbs), db_ref, bound<Space>(1), "db");
}

using fp::kernels::Gelu;
using fp::kernels::Relu;
using fp::kernels::Tanh;

}  // namespace

#define FUSEDP_ALL_SPACES fp::Host, fp::CudaFp32, fp::Cuda, fp::CudaBf16

TEST_CASE_TEMPLATE("Linear stage matches the Host reference", Space, FUSEDP_ALL_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  SUBCASE("ReLU, 77 x 45 -> 37") { check_stage<Space, fp::Linear<37>, fp::Shape<45, 1, 1>, Epilogue<Relu>>(77, 100); }
  SUBCASE("GELU (saves z), 300 x 130 -> 70") {
    check_stage<Space, fp::Linear<70>, fp::Shape<130, 1, 1>, Epilogue<Gelu>>(300, 110);
  }
  SUBCASE("no activation, 1000 x 13 -> 9 (split-K weight gradient)") {
    check_stage<Space, fp::Linear<9>, fp::Shape<13, 1, 1>, Epilogue<>>(1000, 120);
  }
}

TEST_CASE_TEMPLATE("Conv2d stage matches the Host reference", Space, FUSEDP_ALL_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  SUBCASE("3x11x9, 5 filters 3x3, stride 2, pad 1, ReLU") {
    check_stage<Space, fp::Conv2d<5, 3, 2, 1>, fp::Shape<3, 11, 9>, Epilogue<Relu>>(7, 200);
  }
  SUBCASE("4x10x12, 33 filters 5x5, GELU") {
    check_stage<Space, fp::Conv2d<33, 5>, fp::Shape<4, 10, 12>, Epilogue<Gelu>>(5, 210);
  }
}

TEST_CASE_TEMPLATE("Conv2d + MaxPool2d fused matches the Host conv and pool stages", Space, FUSEDP_ALL_SPACES) {
  FUSEDP_GPU_REQUIRE_DEVICE_FOR(Space);
  SUBCASE("3x13x11 (odd output: floor-mode remainder), 7 filters 3x3 pad 1, ReLU, pool 2") {
    check_conv_maxpool<Space, fp::Conv2d<7, 3, 1, 1>, fp::Shape<3, 13, 11>, Epilogue<Relu>, 2>(5, 300);
  }
  SUBCASE("LeNet's first stage: 1x28x28, 6 filters 5x5, ReLU, pool 2") {
    check_conv_maxpool<Space, fp::Conv2d<6, 5>, fp::Shape<1, 28, 28>, Epilogue<Relu>, 2>(19, 310);
  }
}
