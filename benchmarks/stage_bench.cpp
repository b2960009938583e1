// stage_bench: where a Host train step's time goes. Runs each kernel call of a train step of the seed
// networks (the stages of their fusion plan, forward and backward, and the SGD update) on its own,
// with the shapes of the real step, and prints the median time of each and its share of their sum.
//
//   stage_bench --net cifar|lenet|resnet18 --batch 64 --threads 2 --reps 20 --precision fp32|bf16
//
// ResNet-18 (CIFAR form) is listed by its distinct shapes: each conv shape and BatchNorm size once,
// with how often a step runs it (xN); the share and the sum count every run.
#include "../tests/support/fusedp_core.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace kh = fusedp::kernels::host;
using Relu = fp::kernels::Epilogue<fp::kernels::Relu>;
using None = fp::kernels::Epilogue<>;
float* const no_z = nullptr;  // no saved pre-activation (ReLU reads its output)

namespace {

struct Stage {
  std::string name;
  double flops;
  std::function<void()> run;
  int count = 1;  // runs per train step
};

std::vector<float> filled(std::size_t n, std::size_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 2 * float(fp::rng::uniform(seed, 0, i)) - 1;
  return v;
}

// Buffers of one conv + ReLU + 2x2 max-pool block and its stages, or (add_plain) of one conv without
// bias or epilogue, as before a BatchNorm.
struct ConvBlock {
  fp::kernels::ConvGeometry conv, pool;
  std::size_t batch;
  std::vector<float> w, b, x, y, pooled, dpooled, dy, dx, dw, db, scratch;
  ConvBlock(int c, int h, int wd, int k, int pad, int o, std::size_t batch_, int threads, int stride = 1)
      : conv{c, h, wd, k, stride, pad, o, (h + 2 * pad - k) / stride + 1, (wd + 2 * pad - k) / stride + 1},
        pool{o, conv.out_h, conv.out_w, 2, 2, 0, o, conv.out_h / 2, conv.out_w / 2},
        batch(batch_),
        w(filled(conv.out_channels * conv.patch(), 1)),
        b(filled(std::size_t(o), 2)),
        x(filled(batch * conv.in_size(), 3)),
        y(batch * conv.out_size()),
        pooled(batch * pool.out_size()),
        dpooled(filled(batch * pool.out_size(), 4)),
        dy(batch * conv.out_size()),
        dx(batch * conv.in_size()),
        dw(w.size()),
        db(b.size()),
        scratch(std::size_t(threads) * fp::kernels::host::ConvScratch{conv}.per_thread()) {}
  void add_plain(std::vector<Stage>& fwd, std::vector<Stage>& bwd, const fp::Host& host, const std::string& name,
                 bool first, int count) {
    const double macs = double(batch) * double(conv.out_size()) * double(conv.patch());
    std::fill(dy.begin(), dy.end(), 0.5f);
    fwd.push_back({name + " fwd", 2 * macs, [this, &host] {
                     kh::conv2d_forward<None>(host, conv, batch, w.data(), no_z, x.data(), y.data(), no_z,
                                              scratch.data());
                   }, count});
    bwd.push_back({name + " bwd", (first ? 2 : 4) * macs, [this, &host, first] {
                     kh::conv2d_backward<None>(host, conv, batch, w.data(), x.data(), y.data(), no_z, dy.data(),
                                               first ? no_z : dx.data(), dw.data(), no_z, scratch.data());
                   }, count});
  }
  void add(std::vector<Stage>& fwd, std::vector<Stage>& bwd, const fp::Host& host, const std::string& name,
           bool first) {
    const double macs = double(batch) * double(conv.out_size()) * double(conv.patch());
    fwd.push_back({name + " conv fwd", 2 * macs, [this, &host] {
                     kh::conv2d_forward<Relu>(host, conv, batch, w.data(), b.data(), x.data(), y.data(), no_z,
                                              scratch.data());
                   }});
    fwd.push_back({name + " pool fwd", 0, [this, &host] {
                     kh::pool_forward<fp::kernels::PoolOp::max, 2, 2, None>(host, pool, batch, y.data(), pooled.data(), no_z);
                   }});
    bwd.push_back({name + " pool bwd", 0, [this, &host] {
                     kh::pool_backward<fp::kernels::PoolOp::max, 2, 2, None>(host, pool, batch, y.data(), pooled.data(), no_z,
                                                                     dpooled.data(), dy.data());
                   }});
    bwd.push_back({name + " conv bwd", (first ? 2 : 4) * macs, [this, &host, first] {
                     kh::conv2d_backward<Relu>(host, conv, batch, w.data(), x.data(), y.data(), no_z, dy.data(),
                                               first ? no_z : dx.data(), dw.data(), db.data(), scratch.data());
                   }});
  }
};

struct LinearBlock {
  std::size_t batch, in, out;
  bool relu;
  std::vector<float> w, b, x, y, dy, dx, dw, db;
  LinearBlock(std::size_t in_, std::size_t out_, bool relu_, std::size_t batch_)
      : batch(batch_), in(in_), out(out_), relu(relu_), w(filled(in * out, 5)), b(filled(out, 6)),
        x(filled(batch * in, 7)), y(batch * out), dy(filled(batch * out, 8)), dx(batch * in), dw(w.size()),
        db(b.size()) {}
  void add(std::vector<Stage>& fwd, std::vector<Stage>& bwd, const fp::Host& host, const std::string& name) {
    const double macs = double(batch) * double(in) * double(out);
    fwd.push_back({name + " fwd", 2 * macs, [this, &host] {
                     if (relu) kh::linear_forward<Relu>(host, batch, in, out, w.data(), b.data(), x.data(), y.data(), no_z);
                     else kh::linear_forward<None>(host, batch, in, out, w.data(), b.data(), x.data(), y.data(), no_z);
                   }});
    bwd.insert(bwd.begin(), {name + " bwd", 4 * macs, [this, &host] {
                 if (relu)
                   kh::linear_backward<Relu>(host, batch, in, out, w.data(), x.data(), y.data(), no_z, dy.data(),
                                             dx.data(), dw.data(), db.data());
                 else
                   kh::linear_backward<None>(host, batch, in, out, w.data(), x.data(), y.data(), no_z, dy.data(),
                                             dx.data(), dw.data(), db.data());
               }});
  }
};

// One BatchNorm2d + ReLU over (batch, channels, plane) values, training mode.
struct NormBlock {
  kh::BatchNormGeometry g;
  fp::kernels::BatchNormState s;
  std::vector<float> gamma, beta, state, x, y, dy, dx, dgamma, dbeta;
  NormBlock(std::size_t batch, std::size_t channels, std::size_t plane)
      : g{batch, channels, plane}, s{channels, fp::align_elements(channels), fp::align_elements(1)},
        gamma(filled(channels, 11)), beta(filled(channels, 12)), state(4 * s.aligned + s.scalar),
        x(filled(batch * channels * plane, 13)), y(x.size()), dy(filled(x.size(), 14)), dx(x.size()),
        dgamma(channels), dbeta(channels) {}
  void add(std::vector<Stage>& fwd, std::vector<Stage>& bwd, const fp::Host& host, const std::string& name, int count) {
    fwd.push_back({name + " fwd", 0, [this, &host] {
                     kh::batch_norm_forward<Relu>(host, g, s, true, 0.1, 1e-5, gamma.data(), beta.data(), state.data(),
                                                  x.data(), y.data(), no_z);
                   }, count});
    bwd.push_back({name + " bwd", 0, [this, &host] {
                     // keep_dz false, as a model's BatchNorm outside a block's last stage runs
                     kh::batch_norm_backward<Relu>(host, g, s, gamma.data(), state.data(), x.data(), y.data(), no_z,
                                                   dy.data(), dx.data(), dgamma.data(), dbeta.data(), {}, nullptr,
                                                   false, false);
                   }, count});
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string net = "cifar", precision = "fp32";
  std::size_t batch = 64;
  int threads = 2, reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--net")) net = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::size_t(std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--precision")) precision = argv[i + 1];
  }
  if (precision != "fp32" && precision != "bf16") {
    std::fprintf(stderr, "stage_bench: --precision is fp32 or bf16, not %s\n", precision.c_str());
    return 2;
  }
  if (precision == "bf16" && !fp::cpu_features().avx512_bf16) {
    std::fprintf(stderr, "stage_bench: --precision bf16 needs a CPU with AVX-512 BF16\n");
    return 2;
  }
  const fp::Host host{threads, precision == "bf16" ? fp::HostPrecision::bf16 : fp::HostPrecision::fp32};
  std::vector<Stage> fwd, bwd, bwd_conv_resnet;
  std::vector<ConvBlock> convs;
  std::vector<LinearBlock> linears;
  std::vector<NormBlock> norms;
  convs.reserve(16);  // the stages point into these: no reallocation
  norms.reserve(5);
  linears.reserve(3);
  std::size_t params = 0;
  if (net == "lenet") {
    convs.emplace_back(1, 28, 28, 5, 0, 6, batch, threads);
    convs.emplace_back(6, 12, 12, 3, 0, 16, batch, threads);
    linears.emplace_back(400, 120, true, batch);
    linears.emplace_back(120, 60, true, batch);
    linears.emplace_back(60, 10, false, batch);
  } else if (net == "resnet18") {
    // (channels, size, stride, runs per step): the stem, then per stage its first conv (stride 2 from
    // layer2 on), the other 3x3 convs, and the 1x1 stride-2 projection.
    struct Shape { int c, hw, k, stride, pad, o, count; const char* name; };
    const Shape shapes[] = {{3, 32, 3, 1, 1, 64, 1, "stem 3x3"},       {64, 32, 3, 1, 1, 64, 4, "l1 3x3"},
                            {64, 32, 3, 2, 1, 128, 1, "l2 3x3/2"},     {128, 16, 3, 1, 1, 128, 3, "l2 3x3"},
                            {64, 32, 1, 2, 0, 128, 1, "l2 1x1/2"},     {128, 16, 3, 2, 1, 256, 1, "l3 3x3/2"},
                            {256, 8, 3, 1, 1, 256, 3, "l3 3x3"},       {128, 16, 1, 2, 0, 256, 1, "l3 1x1/2"},
                            {256, 8, 3, 2, 1, 512, 1, "l4 3x3/2"},     {512, 4, 3, 1, 1, 512, 3, "l4 3x3"},
                            {256, 8, 1, 2, 0, 512, 1, "l4 1x1/2"}};
    for (const Shape& q : shapes) {
      convs.emplace_back(q.c, q.hw, q.hw, q.k, q.pad, q.o, batch, threads, q.stride);
      convs.back().add_plain(fwd, bwd_conv_resnet, host, q.name, q.stride == 1 && q.c == 3, q.count);
    }
    params = 11'173'962;  // the whole network's, for the update
    // BatchNorms after the stem and each conv (5 in layer1 with the stem's, 5 in each later stage with
    // the projection's).
    const std::size_t bn[][3] = {{64, 1024, 5}, {128, 256, 5}, {256, 64, 5}, {512, 16, 5}};
    for (const auto& q : bn) {
      norms.emplace_back(batch, q[0], q[1]);
      norms.back().add(fwd, bwd_conv_resnet, host, "bn " + std::to_string(q[0]) + "x" + std::to_string(q[1]), int(q[2]));
    }
  } else {
    convs.emplace_back(3, 32, 32, 3, 1, 64, batch, threads);
    convs.emplace_back(64, 16, 16, 3, 1, 128, batch, threads);
    linears.emplace_back(8192, 1024, true, batch);
    linears.emplace_back(1024, 10, false, batch);
  }
  std::vector<Stage> bwd_conv = bwd_conv_resnet, bwd_lin;
  for (std::size_t i = 0; net != "resnet18" && i < convs.size(); ++i) {
    std::vector<Stage> b;
    convs[i].add(fwd, b, host, "conv" + std::to_string(i + 1), i == 0);
    bwd_conv.insert(bwd_conv.begin(), b.begin(), b.end());
    params += convs[i].w.size() + convs[i].b.size();
  }
  for (std::size_t i = 0; i < linears.size(); ++i) {
    linears[i].add(fwd, bwd_lin, host, "fc" + std::to_string(i + 1));
    params += linears[i].w.size() + linears[i].b.size();
  }
  std::vector<float> p(filled(params, 9)), g(filled(params, 10)), m(params);
  fp::Sgd opt{{.lr = 0.01f, .momentum = 0.9f}};
  std::vector<Stage> all = fwd;
  all.insert(all.end(), bwd_lin.begin(), bwd_lin.end());
  all.insert(all.end(), bwd_conv.begin(), bwd_conv.end());
  std::uint64_t step = 0;
  all.push_back({"sgd step", 0, [&] { opt.step(host, p.data(), g.data(), m.data(), params, ++step); }});

  std::printf("%s, batch %zu, %d threads, %s: median of %d runs per stage\n", net.c_str(), batch, host.threads(),
              precision.c_str(), reps);
  std::vector<double> med(all.size());
  double total = 0;
  for (std::size_t s = 0; s < all.size(); ++s) {
    std::vector<double> t;
    all[s].run();
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      all[s].run();
      t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    med[s] = t[t.size() / 2] * all[s].count;
    total += med[s];
  }
  for (std::size_t s = 0; s < all.size(); ++s) {
    const std::string name = all[s].count > 1 ? all[s].name + " x" + std::to_string(all[s].count) : all[s].name;
    std::printf("%-20s %9.3f ms %5.1f%%", name.c_str(), med[s], 100 * med[s] / total);
    if (all[s].flops > 0) std::printf("  %7.1f GFLOP/s", all[s].flops * all[s].count / (med[s] * 1e-3) / 1e9);
    std::printf("\n");
  }
  std::printf("%-20s %9.3f ms\n", "sum", total);
  return 0;
}
