// stage_bench: where a Host train step's time goes. Runs each kernel call of a train step of the seed
// networks (the stages of their fusion plan, forward and backward, and the SGD update) on its own,
// with the shapes of the real step, and prints the median time of each and its share of their sum.
//
//   stage_bench --net cifar --batch 64 --threads 2 --reps 20
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
};

std::vector<float> filled(std::size_t n, std::size_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 2 * float(fp::rng::uniform(seed, 0, i)) - 1;
  return v;
}

// Buffers of one conv + ReLU + 2x2 max-pool block and its stages.
struct ConvBlock {
  fp::kernels::ConvGeometry conv, pool;
  std::size_t batch;
  std::vector<float> w, b, x, y, pooled, dpooled, dy, dx, dw, db, scratch;
  ConvBlock(int c, int h, int wd, int k, int pad, int o, std::size_t batch_, int threads)
      : conv{c, h, wd, k, 1, pad, o, h + 2 * pad - k + 1, wd + 2 * pad - k + 1},
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

}  // namespace

int main(int argc, char** argv) {
  std::string net = "cifar";
  std::size_t batch = 64;
  int threads = 2, reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--net")) net = argv[i + 1];
    else if (!std::strcmp(argv[i], "--batch")) batch = std::size_t(std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
  }
  const fp::Host host{threads};
  std::vector<Stage> fwd, bwd;
  std::vector<ConvBlock> convs;
  std::vector<LinearBlock> linears;
  convs.reserve(2);
  linears.reserve(3);
  std::size_t params = 0;
  if (net == "lenet") {
    convs.emplace_back(1, 28, 28, 5, 0, 6, batch, threads);
    convs.emplace_back(6, 12, 12, 3, 0, 16, batch, threads);
    linears.emplace_back(400, 120, true, batch);
    linears.emplace_back(120, 60, true, batch);
    linears.emplace_back(60, 10, false, batch);
  } else {
    convs.emplace_back(3, 32, 32, 3, 1, 64, batch, threads);
    convs.emplace_back(64, 16, 16, 3, 1, 128, batch, threads);
    linears.emplace_back(8192, 1024, true, batch);
    linears.emplace_back(1024, 10, false, batch);
  }
  std::vector<Stage> bwd_conv, bwd_lin;
  for (std::size_t i = 0; i < convs.size(); ++i) {
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

  std::printf("%s, batch %zu, %d threads: median of %d runs per stage\n", net.c_str(), batch, host.threads(), reps);
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
    med[s] = t[t.size() / 2];
    total += med[s];
  }
  for (std::size_t s = 0; s < all.size(); ++s) {
    std::printf("%-16s %9.3f ms %5.1f%%", all[s].name.c_str(), med[s], 100 * med[s] / total);
    if (all[s].flops > 0) std::printf("  %7.1f GFLOP/s", all[s].flops / (med[s] * 1e-3) / 1e9);
    std::printf("\n");
  }
  std::printf("%-16s %9.3f ms\n", "sum", total);
  return 0;
}
