// train_step_gpu: times fusedp's Cuda train step (forward, loss, backward, optimizer; recorded as a
// CUDA graph after the first step) for the networks of benchmarks/gpu/check.sh. Data lives on the
// device; each step is bracketed by CUDA events on the model's stream; warm-up steps first, then the
// median of the timed steps. Prints one line per configuration:
//
//   RESULT impl=fusedp net=lenet batch=128 precision=tf32 median_ms=0.123 images_per_s=1040000 graphs=1 loss=2.30 host_ms=0.031 queued_ms=0.101 floor_mb=7.5
//
// floor_mb is the step's fused minimum of memory traffic from the type (CostModel::step_traffic_floor,
// net/cost.hpp: SGD with momentum, activations in 16 bits under bf16, the wide build's too: the floor is
// the design's, not the build's), which check.sh hands to kernel_times.py to set ncu's DRAM bytes
// against; none for ResNet-18, which that model does not cover.
// median_ms brackets each step with events as it is submitted, so where the host takes longer to submit
// a step than the GPU to run it, it measures the host. Two more figures tell which: host_ms, the host's
// wall time to submit one step (the mean over the timed steps), and queued_ms, the GPU's time per step
// when the steps wait in the stream's queue behind a kernel that holds the GPU until all are submitted
// (the mean over as many steps, two events in all): what the GPU needs, without the host's pace.
// --no-queued skips that second timing (queued_ms=0): under a profiler, which serializes every launch,
// the hold would last minutes.
//
//   train_step_gpu --all                       the set check.sh runs
//   train_step_gpu --net mlp64 --batch 16384 [--steps 100] [--warmup 10] [--precision tf32|fp32|bf16]
//                  [--separate-update] [--no-dependent-launch] [--serial-backward] [--no-queued]
//
// --separate-update: the optimizer as one pass over every parameter after backward, not applied by
// the weight-gradient GEMMs (Model::use_fused_update(false)); the lines say impl=fusedp-separate-update.
// --no-dependent-launch: every kernel launched the plain way, each waiting for the one before it to
// finish before it is scheduled (kernels::cuda::set_dependent_launch(false), the same as
// FUSEDP_CUDA_DEPENDENT_LAUNCH=off); the lines say impl=fusedp-no-pdl.
// --serial-backward: each weight-gradient GEMM after its layer's input gradient on the model's stream,
// not beside the next layer's (Model::use_backward_branches(false)); the lines say impl=fusedp-serial.
// FUSEDP_CUDA_SPLIT_REDUCTION=kernel: the parts of split-K GEMMs added up by a second kernel, never by
// the GEMM's last block per tile (kernels/cuda/gemm_dispatch.cuh); the lines say impl=fusedp-split-kernel.
// FUSEDP_CUDA_SPLIT_REDUCTION=gemm: always by the GEMM's last block, however long its chain of loads (by
// default only up to kernels::cuda::split_tile_reduction_trips); the lines say impl=fusedp-split-gemm.
//
// Built with -DFUSEDP_CUDA_MMA_LAYERS=1 (benchmarks/gpu/prebuild.sh's train_step_gpu_mma) the layers'
// GEMMs run on the tensor-core mainloop (kernels/cuda/gemm_dispatch.cuh) and the lines say
// impl=fusedp-mma; FUSEDP_CUDA_GEMM=wmma runs the same binary on WMMA (impl=fusedp). Built with
// -DFUSEDP_CUDA_FUSED_GRADIENTS=0 (train_step_gpu_unfused) every layer forms its own dz, as before the
// fused gradient boundaries (net/cuda_plan.hpp), and the lines say impl=fusedp-unfused. Built with
// -DFUSEDP_CUDA_NARROW_OUTPUTS=0 as well as train_step_gpu_mma's flags (train_step_gpu_wide), a BF16
// model keeps every stage output and gradient in fp32 elements (the same values; net/cuda_plan.hpp), and the lines
// say impl=fusedp-mma-wide.
//
// Only TF32 is compiled in by default (one precision keeps the build of this one file near a minute);
// -DFUSEDP_BENCH_BF16=1 adds bf16 for lenet, cifar (issue 17's BF16 targets; impl=...-bf16 in the
// RESULT line) and resnet18, -DFUSEDP_BENCH_ALL_PRECISIONS=1 fp32 and bf16 for every network;
// -DFUSEDP_BENCH_ONLY_BF16=1 builds bf16 for lenet and cifar and nothing else (train_step_gpu_wide: a
// binary a quarter the size, for the device tool's 64 MiB).
//
// Written and compiled without a GPU; its numbers exist only once someone runs it on one.
#include "../../tests/support/fusedp_core.hpp"
#include <fusedp/net/cost.hpp>

#if FUSEDP_BENCH_ONLY_BF16 && !FUSEDP_BENCH_BF16
#undef FUSEDP_BENCH_BF16
#define FUSEDP_BENCH_BF16 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>
#include "../../tests/support/seed_networks.hpp"

#ifndef FUSEDP_BENCH_ALL_PRECISIONS
#define FUSEDP_BENCH_ALL_PRECISIONS 0
#endif

namespace fp = fusedp;

namespace {

using seed_networks::LeNet;
using seed_networks::CifarCnn;
using seed_networks::Mlp;
using ResNet18 = fp::models::ResNet18Cifar<10>;

struct Options {
  int steps = 100;
  int warmup = 10;
  bool separate_update = false;
  bool no_dependent_launch = false;
  bool serial_backward = false;
  bool queued = true;
};

// Keeps the GPU busy for about `cycles` clock cycles, so that work submitted meanwhile queues up.
__global__ void hold_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Net, class Space, class Loss, class Target>
void run(const char* name, std::size_t batch, const Options& o, const Loss& loss, const std::vector<Target>& targets) {
  Space space{0};
  fp::Model<Net, Space> model{fp::seed(1), space};
  model.use_fused_update(!o.separate_update);
  model.use_backward_branches(!o.serial_backward);
  fp::Sgd opt{{.lr = 0.01f, .momentum = 0.9f}};
  std::vector<float> x(batch * Net::input_shape::size);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(7, 0, i) - 1;
  fp::DeviceBuffer<float> xd(x.size());
  fp::DeviceBuffer<Target> td(targets.size());
  fp::copy_async(xd.data(), x.data(), x.size(), space.stream());
  fp::copy_async(td.data(), targets.data(), targets.size(), space.stream());
  space.synchronize();
  const fp::DeviceSpan<const float> xs{xd.data(), xd.size()};
  const fp::DeviceSpan<const Target> ts{td.data(), td.size()};

  for (int s = 0; s < o.warmup; ++s) model.train_step_async(xs, ts, loss, opt);
  space.synchronize();
  std::vector<cudaEvent_t> start(std::size_t(o.steps)), stop(std::size_t(o.steps));
  for (int s = 0; s < o.steps; ++s) {
    FUSEDP_CUDA_CHECK(cudaEventCreate(&start[std::size_t(s)]));
    FUSEDP_CUDA_CHECK(cudaEventCreate(&stop[std::size_t(s)]));
  }
  const auto host_start = std::chrono::steady_clock::now();
  for (int s = 0; s < o.steps; ++s) {
    FUSEDP_CUDA_CHECK(cudaEventRecord(start[std::size_t(s)], space.stream()));
    model.train_step_async(xs, ts, loss, opt);
    FUSEDP_CUDA_CHECK(cudaEventRecord(stop[std::size_t(s)], space.stream()));
  }
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count() / o.steps;
  space.synchronize();
  // The same number of steps queued behind hold_kernel: held for ten times what submitting them took
  // above (at least 20 ms at 2 GHz), so the GPU runs them back to back at its own pace.
  double queued_ms = 0;
  if (o.queued) {
    cudaEvent_t first, last;
    FUSEDP_CUDA_CHECK(cudaEventCreate(&first));
    FUSEDP_CUDA_CHECK(cudaEventCreate(&last));
    const double hold_ms = std::clamp(10 * host_ms * o.steps, 20.0, 2000.0);
    hold_kernel<<<1, 1, 0, space.stream()>>>((long long)(hold_ms * 2e6));
    FUSEDP_CUDA_CHECK(cudaGetLastError());
    FUSEDP_CUDA_CHECK(cudaEventRecord(first, space.stream()));
    const auto submit_start = std::chrono::steady_clock::now();
    for (int s = 0; s < o.steps; ++s) model.train_step_async(xs, ts, loss, opt);
    FUSEDP_CUDA_CHECK(cudaEventRecord(last, space.stream()));
    const double submit_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - submit_start).count();
    // Still held once everything is submitted: the first event has not happened yet.
    const bool held = cudaEventQuery(first) == cudaErrorNotReady;
    space.synchronize();
    float t = 0;
    FUSEDP_CUDA_CHECK(cudaEventElapsedTime(&t, first, last));
    queued_ms = double(t) / o.steps;
    cudaEventDestroy(first);
    cudaEventDestroy(last);
    if (!held)
      std::printf("NOTE %s: the hold kernel ended before the %d queued steps were submitted (%.1f ms): "
                  "queued_ms includes host time\n", name, o.steps, submit_ms);
  }
  std::vector<double> ms(std::size_t(o.steps));
  for (int s = 0; s < o.steps; ++s) {
    float t = 0;
    FUSEDP_CUDA_CHECK(cudaEventElapsedTime(&t, start[std::size_t(s)], stop[std::size_t(s)]));
    ms[std::size_t(s)] = t;
    cudaEventDestroy(start[std::size_t(s)]);
    cudaEventDestroy(stop[std::size_t(s)]);
  }
  const float l = model.last_loss();
  const double med = median(ms);
  const bool mma = fp::kernels::cuda::layers_have_mma &&
                   fp::kernels::cuda::gemm_mainloop_from_environment() == fp::kernels::cuda::GemmMainloop::mma;
  // The build's name, and "-bf16" for a BF16 run (report.py compares it with PyTorch's bf16 modes).
  const std::string impl =
      std::string(!fp::cuda_fused_gradients ? "fusedp-unfused"
                  : o.separate_update       ? "fusedp-separate-update"
                  : o.no_dependent_launch   ? "fusedp-no-pdl"
                  : o.serial_backward       ? "fusedp-serial"
                  : fp::kernels::cuda::split_reduction_from_environment() == fp::kernels::cuda::SplitReduction::kernel
                      ? "fusedp-split-kernel"
                  : fp::kernels::cuda::split_reduction_from_environment() == fp::kernels::cuda::SplitReduction::gemm
                      ? "fusedp-split-gemm"
                  : mma ? (fp::cuda_narrow_outputs ? "fusedp-mma" : "fusedp-mma-wide")
                        : "fusedp") +
      (std::is_same_v<typename Space::precision, fp::precision::Bf16> ? "-bf16" : "");
  // The step's fused minimum of DRAM traffic (net/cost.hpp; SGD with momentum, 16-bit activations under
  // BF16), which check.sh hands to kernel_times.py; none for a network the traffic model does not cover.
  char floor[48] = "";
  if constexpr (fp::CostModel<Net>::has_traffic_floor) {
    constexpr std::size_t a = std::is_same_v<typename Space::precision, fp::precision::Bf16> ? 2 : 4;
    std::snprintf(floor, sizeof floor, " floor_mb=%.1f", double(fp::CostModel<Net>::step_traffic_floor(batch, 1, a).total()) / 1e6);
  }
  std::printf("RESULT impl=%s net=%s batch=%zu precision=%s median_ms=%.4f images_per_s=%.0f graphs=%d loss=%.4f "
              "host_ms=%.4f queued_ms=%.4f%s\n",
              impl.c_str(), name, batch, Space::precision::name, med, double(batch) / (med * 1e-3),
              model.last_step_replayed() ? 1 : 0, double(l), host_ms, queued_ms, floor);
  if (!model.graph_failure().empty()) std::printf("NOTE %s: graph recording failed: %s\n", name, model.graph_failure().c_str());
  if (!model.graph_plain_reason().empty())
    std::printf("NOTE %s: graphs recorded without programmatic dependent launch, after: %s\n", name,
                model.graph_plain_reason().c_str());
  std::fflush(stdout);
}

template <class Space>
void run_net(const std::string& net, std::size_t batch, const Options& o) {
  auto labels = [&](std::size_t classes) {
    std::vector<std::int32_t> y(batch);
    for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % classes);
    return y;
  };
  auto targets = [&](std::size_t n) {
    std::vector<float> t(batch * n);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = fp::rng::uniform(8, 0, i);
    return t;
  };
  if (net == "lenet") run<LeNet, Space>("lenet", batch, o, fp::SoftmaxCrossEntropy{}, labels(10));
  else if (net == "cifar") run<CifarCnn, Space>("cifar", batch, o, fp::SoftmaxCrossEntropy{}, labels(10));
  else if (net == "mlp64") run<Mlp<64>, Space>("mlp64", batch, o, fp::MSE{}, targets(64));
  else if (net == "mlp128") run<Mlp<128>, Space>("mlp128", batch, o, fp::MSE{}, targets(128));
  else if (net == "resnet18") run<ResNet18, Space>("resnet18", batch, o, fp::SoftmaxCrossEntropy{}, labels(10));
  else throw fp::InvalidArgument("unknown --net " + net + " (lenet, cifar, mlp64, mlp128, resnet18)");
}

#if FUSEDP_BENCH_BF16 && !FUSEDP_BENCH_ALL_PRECISIONS
// The two networks of issue 17's BF16 targets, and (except in the ONLY_BF16 build) ResNet-18, whose
// BatchNorm and block tensors are 16-bit under BF16: three networks' kernels, not five.
#if FUSEDP_BENCH_ONLY_BF16
constexpr bool bench_bf16_resnet = false;
#else
constexpr bool bench_bf16_resnet = true;
#endif
void run_bf16_net(const std::string& net, std::size_t batch, const Options& o) {
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(i % 10);
  if (net == "lenet") run<LeNet, fp::CudaBf16>("lenet", batch, o, fp::SoftmaxCrossEntropy{}, y);
#if !FUSEDP_BENCH_ONLY_BF16
  else if (net == "resnet18") run<ResNet18, fp::CudaBf16>("resnet18", batch, o, fp::SoftmaxCrossEntropy{}, y);
#endif
  else run<CifarCnn, fp::CudaBf16>("cifar", batch, o, fp::SoftmaxCrossEntropy{}, y);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string net, precision = "tf32";
  std::size_t batch = 0;
  bool all = false;
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_step_gpu: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--all") all = true;
    else if (a == "--net") net = value();
    else if (a == "--batch") batch = std::size_t(std::strtoull(value().c_str(), nullptr, 10));
    else if (a == "--steps") o.steps = std::atoi(value().c_str());
    else if (a == "--warmup") o.warmup = std::atoi(value().c_str());
    else if (a == "--precision") precision = value();
    else if (a == "--separate-update") o.separate_update = true;
    else if (a == "--no-dependent-launch") o.no_dependent_launch = true;
    else if (a == "--serial-backward") o.serial_backward = true;
    else if (a == "--no-queued") o.queued = false;
    else {
      std::fprintf(stderr,
                   "usage: train_step_gpu --all | --net lenet|cifar|mlp64|mlp128|resnet18 --batch N "
                   "[--steps 100] [--warmup 10] [--precision tf32|fp32|bf16] [--separate-update] "
                   "[--no-dependent-launch] [--serial-backward] [--no-queued]\n");
      return 2;
    }
  }
  if (o.steps < 1 || o.warmup < 0 || (!all && (net.empty() || batch == 0))) {
    std::fprintf(stderr, "train_step_gpu: give --all, or --net and --batch (steps >= 1)\n");
    return 2;
  }
  if (fp::cuda_device_count() == 0) {
    std::fprintf(stderr, "train_step_gpu: no CUDA device: %s\n", fp::cuda_unavailable_reason().c_str());
    return 77;
  }
  if (o.no_dependent_launch) fp::kernels::cuda::set_dependent_launch(false);
  int failures = 0;
  auto one = [&](const std::string& n, std::size_t b) {
    try {
#if FUSEDP_BENCH_ALL_PRECISIONS
      if (precision == "fp32") return run_net<fp::CudaFp32>(n, b, o);
      if (precision == "bf16") return run_net<fp::CudaBf16>(n, b, o);
#elif FUSEDP_BENCH_BF16
      if (precision == "bf16" && (n == "lenet" || n == "cifar" || (bench_bf16_resnet && n == "resnet18")))
        return run_bf16_net(n, b, o);
#endif
#if !FUSEDP_BENCH_ONLY_BF16
      if (precision == "tf32") return run_net<fp::Cuda>(n, b, o);
#endif
      throw fp::InvalidArgument("--precision " + precision + " is not built in for --net " + n +
                                " (tf32; -DFUSEDP_BENCH_BF16=1 adds bf16 for lenet, cifar and resnet18, "
                                "-DFUSEDP_BENCH_ALL_PRECISIONS=1 fp32 and bf16 for every net, which "
                                "triples the compile time; -DFUSEDP_BENCH_ONLY_BF16=1 has bf16 for lenet "
                                "and cifar only)");
    } catch (const std::exception& e) {
      std::printf("FAILED impl=fusedp net=%s batch=%zu: %s\n", n.c_str(), b, e.what());
      std::fflush(stdout);
      ++failures;
    }
  };
  if (all) {
    for (const auto& [n, b] : std::vector<std::pair<std::string, std::size_t>>{
             {"lenet", 128}, {"cifar", 128}, {"mlp64", 1 << 14}, {"mlp64", 1 << 18}, {"mlp128", 1 << 14}, {"mlp128", 1 << 18},
             {"resnet18", 256}})
      one(n, b);
  } else {
    one(net, batch);
  }
  return failures == 0 ? 0 : 1;
}
