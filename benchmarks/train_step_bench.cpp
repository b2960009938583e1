// train_step_bench: times Host train steps of the seed networks (LeNet of the MNIST tutorial, the CNN
// of the CIFAR-10 tutorial) with SGD + momentum and cross-entropy: warm-up, then the median of the
// timed steps. Prints ms/step, images/s and the achieved GFLOP/s of the convolutions and GEMMs.
//
//   train_step_bench --net lenet --batch 64 --threads 2 --steps 200
#include "../tests/support/fusedp_core.hpp"

#include "../tests/support/seed_networks.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace fp = fusedp;

using LeNet = seed_networks::LeNet;
using CifarCnn = seed_networks::CifarCnn;

// Multiply-adds per sample of one forward pass through the conv and linear layers; a train step does
// three times as many (forward, input gradient, weight gradient), less the first layer's input gradient.
template <class Net>
double train_flops_per_sample() {
  double forward = 0, first = 0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          using S = typename Net::template stage<I>;
          if constexpr (S::has_params) {
            // weights x output pixels (a Linear has one "pixel")
            const double macs = double(fp::params_of<typename S::layer, typename S::in>()[0].size) *
                                double(S::out::height * S::out::width);
            forward += macs;
            if (I == 0) first = macs;
          }
        }(),
        ...);
  }(std::make_index_sequence<Net::stage_count>{});
  return 2.0 * (3.0 * forward - first);
}

template <class Net>
int bench(std::size_t batch, int threads, int steps, int warmup) {
  fp::Host host{threads};
  fp::Model<Net, fp::Host> model{fp::seed(1), host};
  fp::Sgd opt{{.lr = 0.01f, .momentum = 0.9f}};
  std::vector<float> x(batch * Net::input_shape::size);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(7, 0, i) - 1;
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % Net::output_shape::size);
  std::vector<double> ms;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
    const auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double gflops = train_flops_per_sample<Net>() * double(batch) / (median * 1e-3) / 1e9;
  std::printf("fusedp  batch %zu  threads %d  %.3f ms/step  %.0f images/s  %.1f GFLOP/s\n", batch, host.threads(),
              median, double(batch) / (median * 1e-3), gflops);
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Time fusedp Host train steps of the seed networks"};
  std::string net = "lenet";
  std::size_t batch = 64;
  int threads = 2, steps = 100, warmup = 10;
  app.add_option("--net", net, "lenet or cifar")->check(CLI::IsMember({"lenet", "cifar"}))->capture_default_str();
  app.add_option("--batch", batch, "samples per step")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--threads", threads, "CPU threads (0: one per core)")->check(CLI::Range(0, 1024))->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::Range(0, 1000000))->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    (void)app.exit(e);
    return 1;
  }
  try {
    return net == "lenet" ? bench<LeNet>(batch, threads, steps, warmup) : bench<CifarCnn>(batch, threads, steps, warmup);
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "train_step_bench: error: %s\n", e.what());
    return 1;
  }
}
