// parallel_bench: time of one data-parallel train step of the seed networks with Parallel<> on Host,
// with replicas in this process (--replicas N) or one replica per MPI rank (under mpirun, --mpi).
// Each replica gets --batch samples (weak scaling, as DDP tutorials measure), so the global batch is
// N x batch. Prints the median step time and images/s of the global batch, on rank 0.
//
//   parallel_bench --net lenet --replicas 2 --threads-per-replica 1
//   mpirun -np 3 parallel_bench --net lenet --mpi --threads-per-replica 1
#include "../tests/support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

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

struct Options {
  std::string net = "lenet";
  std::size_t batch = 64;
  int replicas = 1;
  int threads_per_replica = 1;
  int steps = 50;
  int warmup = 5;
  bool mpi = false;
  std::string update = "fused";  // the fused update (each bucket after its sum) or one pass after the last
};

template <class P>
int time_steps(P& dp, const Options& o, const char* mode) {
  using Net = typename P::model_type::network;
  const std::size_t global = o.batch * dp.world_size();
  std::vector<float> x(global * Net::input_shape::size);
  std::vector<std::int32_t> y(global);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(7, 0, i) - 1;
  for (std::size_t i = 0; i < global; ++i) y[i] = std::int32_t(i % 10);
  fp::Sgd opt{{.lr = 0.01f, .momentum = 0.9f}};
  dp.use_fused_update(o.update == "fused");
  std::vector<double> ms;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
    const auto t1 = std::chrono::steady_clock::now();
    if (s >= o.warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  if (dp.is_root())
    std::printf("fusedp Parallel %s  %s  %zu replicas x batch %zu  %d threads each  update %s  %.3f ms/step  %.0f images/s\n",
                mode, o.net.c_str(), dp.world_size(), o.batch, o.threads_per_replica, o.update.c_str(), median,
                double(global) / (median * 1e-3));
  return 0;
}

template <class Net>
int run(const Options& o, [[maybe_unused]] int argc, [[maybe_unused]] char** argv) {
  using P = fp::Parallel<Net, fp::Host, fp::reduce::AllReduce<fp::Bucket<1 << 20>, fp::Overlap>>;
  if (o.mpi) {
#if FUSEDP_WITH_MPI
    fp::MpiWorld world(&argc, &argv);
    P dp{world, fp::seed(1), {.threads = o.threads_per_replica}};
    return time_steps(dp, o, "mpi");
#else
    std::fprintf(stderr, "parallel_bench: --mpi needs a build with MPI (fusedp::mpi)\n");
    return 1;
#endif
  }
  P dp{fp::replicas(o.replicas, o.threads_per_replica), fp::seed(1)};
  return time_steps(dp, o, "in-process");
}

int main(int argc, char** argv) {
  CLI::App app{"Time data-parallel Host train steps of the seed networks"};
  Options o;
  app.add_option("--net", o.net, "lenet or cifar")->check(CLI::IsMember({"lenet", "cifar"}))->capture_default_str();
  app.add_option("--batch", o.batch, "samples per replica")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--replicas", o.replicas, "replicas in this process")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--threads-per-replica", o.threads_per_replica, "Host threads of each replica")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_flag("--mpi", o.mpi, "one replica per MPI rank (run under mpirun)");
  app.add_option("--update", o.update, "fused: each bucket updated after its sum; pass: one pass after the last")
      ->check(CLI::IsMember({"fused", "pass"}))
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
    return o.net == "lenet" ? run<LeNet>(o, argc, argv) : run<CifarCnn>(o, argc, argv);
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "parallel_bench: error: %s\n", e.what());
    return 1;
  }
}
