// tests include/fusedp/exec/trace.hpp: the recorder, its Chrome trace JSON, and the spans a Host model
// and a Parallel of replicas record (they nest and cover the step; tracing changes no result bit; the
// overlap figure of reductions that block is 0).
#include <doctest/doctest.h>

#include "../support/fusedp_core.hpp"
#include <fusedp/exec/trace.hpp>
#include <fusedp/parallel/parallel.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace fp = fusedp;
namespace tr = fusedp::trace;

namespace {

using Net = fp::Sequential<fp::Input<2, 10, 10>, fp::Conv2d<4, 3, 1, 1>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten,
                           fp::Linear<24>, fp::Tanh, fp::Linear<5>>;

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};

Batch batch_of(std::size_t size, std::uint64_t step) {
  Batch b{std::vector<float>(size * Net::input_shape::size), std::vector<std::int32_t>(size)};
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = 2 * fp::rng::uniform(21, step, i) - 1;
  for (std::size_t i = 0; i < size; ++i) b.y[i] = std::int32_t(fp::rng::uniform(22, step, i) * 5);
  return b;
}

template <class Trainer>
void train(Trainer& t, std::size_t size, int steps) {
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch_of(size, std::uint64_t(s));
    (void)t.train_step(std::span<const float>(b.x), std::span<const std::int32_t>(b.y), fp::SoftmaxCrossEntropy{}, opt);
  }
}

// Trains `plain` untraced and `traced` under a session of `r`, on the same batches.
template <class Trainer>
void train_both(Trainer& plain, Trainer& traced, tr::Recorder& r, std::size_t size, int steps) {
  train(plain, size, steps);
  const tr::Session on(r);
  train(traced, size, steps);
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// Every span of `lane` that is not a step lies inside one step span of that lane, and the spans of a
// lane nest: two spans either are disjoint or one holds the other.
void check_nesting(const std::vector<tr::Span>& spans, std::uint32_t lane) {
  std::vector<tr::Span> mine;
  for (const tr::Span& s : spans)
    if (s.lane == lane) mine.push_back(s);
  REQUIRE(!mine.empty());
  for (const tr::Span& s : mine) {
    const std::string name = s.name;
    CAPTURE(name);
    CAPTURE(s.begin_ns);
    CAPTURE(s.end_ns);
    CHECK(s.end_ns >= s.begin_ns);
    for (const tr::Span& o : mine) {
      const bool disjoint = s.end_ns <= o.begin_ns || o.end_ns <= s.begin_ns;
      const bool s_holds_o = s.begin_ns <= o.begin_ns && o.end_ns <= s.end_ns;
      const bool o_holds_s = o.begin_ns <= s.begin_ns && s.end_ns <= o.end_ns;
      CHECK((disjoint || s_holds_o || o_holds_s));
    }
    if (s.kind != tr::Kind::step) {
      const bool in_step = std::any_of(mine.begin(), mine.end(), [&](const tr::Span& o) {
        return o.kind == tr::Kind::step && o.begin_ns <= s.begin_ns && s.end_ns <= o.end_ns;
      });
      CHECK(in_step);
    }
  }
}

std::size_t count(const std::vector<tr::Span>& spans, tr::Kind k, std::uint32_t lane) {
  return std::size_t(std::count_if(spans.begin(), spans.end(),
                                   [&](const tr::Span& s) { return s.kind == k && s.lane == lane; }));
}

}  // namespace

TEST_CASE("without a session nothing is recorded; one session at a time") {
  tr::Recorder r;
  { const tr::Scope s("nothing", tr::Kind::step); }
  CHECK(tr::active() == nullptr);
  CHECK(r.size() == 0);
  {
    const tr::Session on(r);
    CHECK(tr::active() == &r);
    tr::Recorder other;
    CHECK_THROWS_AS(tr::Session{other}, fp::InvalidArgument);
    { const tr::Scope s("something", tr::Kind::data); }
  }
  CHECK(tr::active() == nullptr);
  CHECK(r.size() == 1);
}

TEST_CASE("the trace is Chrome trace JSON: complete events, async reductions, named lanes") {
  tr::Recorder r(1, 2, "host \"a\"");
  r.add({"Conv2d", tr::Kind::forward, 0, 1000, 3000, 1, 0});
  r.add({"bucket", tr::Kind::reduce, tr::comm_lane, 2000, 5000, 0, 4096});
  r.add({"step", tr::Kind::step, 0, 500, 6000, 7, 0});
  r.name_lane(0, "main\n");
  const nlohmann::json j = nlohmann::json::parse(r.json());
  CHECK(j["otherData"]["fusedp"]["rank"] == 1);
  CHECK(j["otherData"]["fusedp"]["world"] == 2);
  CHECK(j["otherData"]["fusedp"]["host"] == "host \"a\"");
  std::map<std::string, int> phases;
  for (const auto& e : j["traceEvents"]) {
    phases[e["ph"].get<std::string>()]++;
    CHECK(e["pid"] == 1);
    if (e["ph"] == "X" && e["cat"] == "forward") {
      CHECK(e["name"] == "Conv2d 1");
      CHECK(e["ts"].get<double>() == doctest::Approx(1.0));
      CHECK(e["dur"].get<double>() == doctest::Approx(2.0));
      CHECK(e["args"]["layer"] == 1);
    }
    if (e["ph"] == "b") {
      CHECK(e["args"]["bytes"] == 4096);
      CHECK(e["tid"] == tr::comm_lane);
    }
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == 0) CHECK(e["args"]["name"] == "main\n");
  }
  CHECK(phases["X"] == 2);
  CHECK(phases["b"] == 1);
  CHECK(phases["e"] == 1);
  CHECK(phases["M"] == 2 + 2 * 2);  // the process's name and order, each lane's name and order
}

TEST_CASE("a traced write to a folder that does not exist names the file") {
  tr::Recorder r;
  CHECK_THROWS_WITH_AS(r.write("/nonexistent-folder/trace.json"),
                       doctest::Contains("/nonexistent-folder/trace.json"), fp::DataError);
}

TEST_CASE("a Model's traced step: each stage forward and backward, loss and optimizer, inside the step") {
  fp::Model<Net, fp::Host> plain{fp::seed(5), fp::Host{1}};
  fp::Model<Net, fp::Host> traced{fp::seed(5), fp::Host{1}};
  tr::Recorder r;
  train_both(plain, traced, r, 6, 3);
  CHECK(same_bits(plain.params(), traced.params()));
  CHECK(same_bits(plain.optimizer_state(), traced.optimizer_state()));
  const std::vector<tr::Span> spans = r.spans();
  // Stages that run: Conv2d (+ReLU), MaxPool2d, Linear (+Tanh), Linear; Flatten aliases its input.
  CHECK(count(spans, tr::Kind::step, 0) == 3);
  CHECK(count(spans, tr::Kind::forward, 0) == 3 * 4);
  CHECK(count(spans, tr::Kind::backward, 0) == 3 * 4);
  CHECK(count(spans, tr::Kind::loss, 0) == 3);
  CHECK(count(spans, tr::Kind::optimizer, 0) == 3);
  check_nesting(spans, 0);
  // The step numbers of the model (1, 2, 3), and stages named by layer and index.
  std::vector<std::int64_t> steps;
  for (const tr::Span& s : spans)
    if (s.kind == tr::Kind::step) steps.push_back(s.index);
  CHECK(steps == std::vector<std::int64_t>{1, 2, 3});
  const auto first_forward = std::find_if(spans.begin(), spans.end(), [](const tr::Span& s) { return s.kind == tr::Kind::forward; });
  REQUIRE(first_forward != spans.end());
  CHECK(std::string(first_forward->name) == "Conv2d");
  CHECK(first_forward->index == 1);
  // The first step's spans as they end: forward of layers 1, 3, 5, 7 (Conv2d, MaxPool2d, Linear,
  // Linear; Flatten at 4 runs nothing), the loss, backward in reverse (as 100 + layer), the optimizer.
  std::vector<std::int64_t> first_step;
  for (const tr::Span& s : spans) {
    if (s.kind == tr::Kind::step) break;
    first_step.push_back(s.kind == tr::Kind::forward ? s.index : s.kind == tr::Kind::backward ? 100 + s.index : -int(s.kind));
  }
  CHECK(first_step == std::vector<std::int64_t>{1, 3, 5, 7, -int(tr::Kind::loss), 107, 105, 103, 101,
                                                -int(tr::Kind::optimizer)});
}

TEST_CASE("two replicas traced: a lane each, every bucket's reduction, nothing hidden when reductions block") {
  using P = fp::Parallel<Net, fp::Host, fp::Overlap, fp::Bucket<256>>;
  P plain{fp::replicas(2, 1), fp::seed(5)};
  P traced{fp::replicas(2, 1), fp::seed(5)};
  tr::Recorder r;
  train_both(plain, traced, r, 8, 3);
  CHECK(same_bits(plain.model(0).params(), traced.model(0).params()));
  CHECK(same_bits(plain.model(1).params(), traced.model(1).params()));
  const std::vector<tr::Span> spans = r.spans();
  const std::size_t buckets = fp::parallel::bucket_plan<Net>(256, sizeof(float)).size();
  REQUIRE(buckets > 1);
  for (std::uint32_t lane = 0; lane < 2; ++lane) {
    CAPTURE(lane);
    CHECK(count(spans, tr::Kind::step, lane) == 3);
    CHECK(count(spans, tr::Kind::backward, lane) == 3 * 4);
    CHECK(count(spans, tr::Kind::reduce, tr::comm_lane + lane) == 3 * buckets);
    CHECK(count(spans, tr::Kind::wait, lane) == 3 * buckets);
    CHECK(count(spans, tr::Kind::collective, lane) == 3);  // the loss sum
    check_nesting(spans, lane);
  }
  // In one process the reductions block the replica: no reduction time is hidden.
  const tr::OverlapFigure f = r.overlap();
  CHECK(f.reduce_seconds > 0);
  CHECK(f.exposed_seconds == doctest::Approx(f.reduce_seconds));
  CHECK(f.overlap() == 0.0);
  // The bytes of every bucket, summed over a step, are the whole gradient.
  std::uint64_t bytes = 0;
  for (const tr::Span& s : spans)
    if (s.kind == tr::Kind::reduce && s.lane == tr::comm_lane) bytes += s.bytes;
  CHECK(bytes == 3 * Net::param_storage * sizeof(float));
  CHECK(nlohmann::json::parse(r.json()).contains("traceEvents"));
}

TEST_CASE("ZeRO-1 and a sharded run traced: the optimizer, the parameter gather and the counts") {
  using P = fp::Parallel<Net, fp::Host, fp::scatter::Sharded, fp::reduce::ReduceScatter<>>;
  P plain{fp::replicas(2, 1), fp::seed(5)};
  P traced{fp::replicas(2, 1), fp::seed(5)};
  tr::Recorder r;
  train_both(plain, traced, r, 8, 2);
  CHECK(same_bits(plain.model(0).params(), traced.model(0).params()));
  const std::vector<tr::Span> spans = r.spans();
  for (std::uint32_t lane = 0; lane < 2; ++lane) {
    CHECK(count(spans, tr::Kind::optimizer, lane) == 2);
    CHECK(count(spans, tr::Kind::collective, lane) == 2 * 3);  // counts, parameter gather, loss sum
    CHECK(count(spans, tr::Kind::reduce, tr::comm_lane + lane) == 2);  // one reduce-scatter per step
    check_nesting(spans, lane);
  }
}
