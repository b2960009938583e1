// Under mpirun: a traced Parallel of one replica per rank (exec/trace.hpp). Tracing changes no result
// bit; the spans of the replica's lane nest inside its steps; every bucket's reduction is on the comm
// lane; the trace each rank writes is Chrome trace JSON. With Overlap the reductions started during
// backward are partly hidden behind it (the overlap figure is positive: backward's convolutions outlast
// a small bucket's reduction); without it every reduction blocks and the figure is exactly 0.
// argv[1]: a folder for the traces (rank r writes trace.rank<r>.json).
#include "../support/fusedp_core.hpp"
#include <fusedp/exec/trace.hpp>
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace tr = fusedp::trace;
using Net = fp::Sequential<fp::Input<8, 24, 24>, fp::Conv2d<16, 3, 1, 1>, fp::ReLU, fp::Conv2d<16, 3, 1, 1>, fp::ReLU,
                           fp::MaxPool2d<2>, fp::Flatten, fp::Linear<32>, fp::ReLU, fp::Linear<10>>;
constexpr std::size_t in = Net::input_shape::size;
constexpr std::size_t batch = 16;
constexpr int steps = 5;

template <class P>
std::vector<float> train(const fp::MpiWorld& world) {
  P dp{world, fp::seed(9), {.threads = 1}};
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  for (std::uint64_t step = 0; step < steps; ++step) {
    std::vector<float> x(batch * in);
    std::vector<std::int32_t> y(batch);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(41, step, i) - 1;
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fp::rng::uniform(42, step, i) * 10);
    (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  }
  const auto p = dp.model().params();
  return {p.begin(), p.end()};
}

bool nests(const std::vector<tr::Span>& spans, std::uint32_t lane) {
  for (const tr::Span& s : spans) {
    if (s.lane != lane) continue;
    bool in_step = s.kind == tr::Kind::step;
    for (const tr::Span& o : spans) {
      if (o.lane != lane) continue;
      const bool disjoint = s.end_ns <= o.begin_ns || o.end_ns <= s.begin_ns;
      const bool held = o.begin_ns <= s.begin_ns && s.end_ns <= o.end_ns;
      const bool holds = s.begin_ns <= o.begin_ns && o.end_ns <= s.end_ns;
      if (!disjoint && !held && !holds) return false;
      if (o.kind == tr::Kind::step && held) in_step = true;
    }
    if (!in_step) return false;
  }
  return true;
}

// Trains traced and untraced; checks what the trace holds; returns the overlap figure.
template <class P>
double check(const fp::MpiWorld& world, const std::string& dir, const char* name) {
  const int rank = world.rank();
  const std::vector<float> plain = train<P>(world);
  tr::Recorder recorder(rank, world.size(), "test");
  std::vector<float> traced;
  {
    const tr::Session on(recorder);
    traced = train<P>(world);
  }
  const std::string what = std::string(name) + ": ";
  mpi_test::check(plain.size() == traced.size() &&
                      std::memcmp(plain.data(), traced.data(), plain.size() * sizeof(float)) == 0,
                  rank, what + "tracing changed the parameters");
  const std::vector<tr::Span> spans = recorder.spans();
  const auto count = [&](tr::Kind k, std::uint32_t lane) {
    return std::count_if(spans.begin(), spans.end(), [&](const tr::Span& s) { return s.kind == k && s.lane == lane; });
  };
  const std::size_t buckets = fp::parallel::bucket_plan<Net>(P::bucket_bytes({}), sizeof(float)).size();
  mpi_test::check(buckets > 1, rank, what + "one bucket only");
  mpi_test::check(count(tr::Kind::step, 0) == steps, rank, what + "steps traced: " + std::to_string(count(tr::Kind::step, 0)));
  mpi_test::check(count(tr::Kind::backward, 0) == steps * 5, rank, what + "backward stages traced");
  mpi_test::check(count(tr::Kind::reduce, tr::comm_lane) == std::ptrdiff_t(steps * buckets), rank,
                  what + "reductions traced: " + std::to_string(count(tr::Kind::reduce, tr::comm_lane)));
  mpi_test::check(nests(spans, 0), rank, what + "the replica's spans do not nest inside its steps");
  const std::string path = dir + "/" + name + ".rank" + std::to_string(rank) + ".json";
  recorder.write(path);
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  try {
    const nlohmann::json j = nlohmann::json::parse(text.str());
    mpi_test::check(j["traceEvents"].size() > spans.size(), rank, what + "the file holds fewer events than spans");
    mpi_test::check(j["otherData"]["fusedp"]["rank"] == rank, rank, what + "the file names another rank");
  } catch (const std::exception& e) {
    mpi_test::check(false, rank, what + path + " is not JSON: " + e.what());
  }
  return recorder.overlap().overlap();
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  const std::string dir = argc > 1 ? argv[1] : ".";
  try {
    const double blocking = check<fp::Parallel<Net, fp::Host, fp::Bucket<8192>>>(world, dir, "blocking");
    mpi_test::check(blocking == 0.0, world.rank(), "without Overlap the overlap is " + std::to_string(blocking));
    const double overlapped = check<fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<8192>>>(world, dir, "overlap");
    mpi_test::check(overlapped > 0.0, world.rank(), "with Overlap the overlap is " + std::to_string(overlapped));
    std::printf("rank %d: overlap %.1f%% of reduction time hidden behind backward with Overlap, %.1f%% without\n",
                world.rank(), 100 * overlapped, 100 * blocking);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    return 1;
  }
  return mpi_test::failures == 0 ? 0 : 1;
}
