// train_step_bench: times Host train steps of the seed networks (LeNet of the MNIST tutorial, the CNN
// of the CIFAR-10 tutorial) and of ResNet-18 (CIFAR form) with SGD + momentum and cross-entropy:
// warm-up, then the median of the timed steps. Prints ms/step, images/s and the achieved GFLOP/s of the
// convolutions and GEMMs (the cost model's count).
//
//   train_step_bench --net lenet --batch 64 --threads 2 --steps 200 [--trace FILE]
//
// --trace records the steps' spans (exec/trace.hpp) and writes them to FILE: the same binary with and
// without it measures what tracing costs a step. --mode predict times Model::predict on the batch
// instead (evaluation: BatchNorm with its running statistics, folded into the conv before it).
#include "../tests/support/fusedp_core.hpp"

#include "../tests/support/seed_networks.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <optional>
#include <cstdio>
#include <string>
#include <vector>

namespace fp = fusedp;

using LeNet = seed_networks::LeNet;
using CifarCnn = seed_networks::CifarCnn;
using ResNet18 = fp::models::ResNet18Cifar<10>;

template <class Net>
int bench(std::size_t batch, int threads, int steps, int warmup, const std::string& trace, fp::HostPrecision precision,
          bool predict) {
  fp::trace::Recorder recorder;
  std::optional<fp::trace::Session> session;
  if (!trace.empty()) session.emplace(recorder);
  fp::Host host{threads, precision};
  fp::Model<Net, fp::Host> model{fp::seed(1), host};
  fp::Sgd opt{{.lr = 0.01f, .momentum = 0.9f}};
  std::vector<float> x(batch * Net::input_shape::size);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(7, 0, i) - 1;
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % Net::output_shape::size);
  std::vector<double> ms;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (predict) (void)model.predict(x);
    else (void)model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
    const auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  // Model FLOPs of a train step (net/cost.hpp: the GEMMs of forward, input and weight gradients).
  const double flops = predict ? fp::CostModel<Net>::forward_flops : fp::CostModel<Net>::train_flops;
  const double gflops = flops * double(batch) / (median * 1e-3) / 1e9;
  std::printf("fusedp  %s  batch %zu  threads %d  %.3f ms/%s  %.0f images/s  %.1f GFLOP/s%s\n",
              fp::to_string(precision), batch, host.threads(), median, predict ? "predict" : "step",
              double(batch) / (median * 1e-3), gflops, trace.empty() ? "" : "  (traced)");
  if (!trace.empty()) {
    session.reset();
    recorder.write(trace);
    std::printf("trace: %s, %zu spans (%.1f per step)\n", trace.c_str(), recorder.size(),
                double(recorder.size()) / double(warmup + steps));
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Time fusedp Host train steps of the seed networks"};
  std::string net = "lenet";
  std::size_t batch = 64;
  int threads = 2, steps = 100, warmup = 10;
  std::string trace;
  app.add_option("--net", net, "lenet, cifar or resnet18")
      ->check(CLI::IsMember({"lenet", "cifar", "resnet18"}))
      ->capture_default_str();
  app.add_option("--batch", batch, "samples per step")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--threads", threads, "CPU threads (0: one per core)")->check(CLI::Range(0, 1024))->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_option("--trace", trace, "record the steps' spans and write them to this Chrome trace file");
  std::string mode = "train";
  app.add_option("--mode", mode, "time train steps, or predict (evaluation) calls")
      ->check(CLI::IsMember({"train", "predict"}))
      ->capture_default_str();
  std::string precision = "fp32";
  app.add_option("--precision", precision, "the Host's precision: fp32, bf16 (AVX-512 BF16 GEMMs, bf16-stored activations) or bf16-emulated")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-emulated"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    (void)app.exit(e);
    return 1;
  }
  try {
    const fp::HostPrecision p = precision == "bf16"            ? fp::HostPrecision::bf16
                                : precision == "bf16-emulated" ? fp::HostPrecision::bf16_emulated
                                                               : fp::HostPrecision::fp32;
    if (net == "lenet") return bench<LeNet>(batch, threads, steps, warmup, trace, p, mode == "predict");
    if (net == "cifar") return bench<CifarCnn>(batch, threads, steps, warmup, trace, p, mode == "predict");
    return bench<ResNet18>(batch, threads, steps, warmup, trace, p, mode == "predict");
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "train_step_bench: error: %s\n", e.what());
    return 1;
  }
}
