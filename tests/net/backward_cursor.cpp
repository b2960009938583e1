// tests include/fusedp/net/backward_cursor.hpp on the CPU: backward's steps are played against a model
// of two CUDA streams (vector clocks: an event record, a stream wait on it, program order), each step's
// kernels declaring what they read and write, as net/cuda_groups.hpp queues them. Checked: no two
// kernels on different streams touch the same memory unordered (one writing); every stage is reported
// once, last first, after all its kernels on both streams; each step reads what the step before wrote;
// and a forked weight gradient really runs beside the next step (not ordered against it).
#include <doctest/doctest.h>

#include <fusedp/net/backward_cursor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

enum Stream : int { main_stream = 0, side_stream = 1 };
using Clock = std::array<std::size_t, 2>;  // ops of each stream ordered before the next op

struct Op {
  std::string name;
  int stream;
  std::size_t index;
  Clock after;  // the ops of each stream this one waits for
  std::set<int> reads, writes;
  std::size_t stage;
};

Clock join_clocks(const Clock& a, const Clock& b) { return {std::max(a[0], b[0]), std::max(a[1], b[1])}; }

// Two streams with events between them.
class Streams {
 public:
  void run(int stream, std::string name, std::set<int> reads, std::set<int> writes, std::size_t stage) {
    const std::size_t index = count_[stream]++;
    ops.push_back({std::move(name), stream, index, clock_[stream], std::move(reads), std::move(writes), stage});
    clock_[stream][stream] = index + 1;
  }
  // The side stream waits for what the model's stream has queued (the fork in layer_weight_gradient).
  void fork() { clock_[side_stream] = join_clocks(clock_[side_stream], clock_[main_stream]); }
  void mark(int slot) { marks_[slot] = clock_[side_stream]; }
  void join(int slot) { clock_[main_stream] = join_clocks(clock_[main_stream], marks_[slot]); }
  // What an event recorded on the model's stream now would cover (a reducer's bucket).
  [[nodiscard]] Clock now() const { return clock_[main_stream]; }

  [[nodiscard]] static bool before(const Op& a, const Op& b) { return b.after[a.stream] > a.index; }
  std::vector<Op> ops;

 private:
  std::array<Clock, 2> clock_{};
  std::array<std::size_t, 2> count_{};
  std::array<Clock, 2> marks_{};
};

struct FakeSide {
  Streams* streams;
  void mark(int slot) const { streams->mark(slot); }
  void join(int slot) const { streams->join(slot); }
};

struct Report {
  std::size_t stage;
  Clock covered;
};
struct Reports {
  Streams* streams;
  std::vector<Report> list;
  void operator()(std::size_t stage) { list.push_back({stage, streams->now()}); }
};

// Memory names: a buffer or scratch half by its address; a stage's input activation and its weights.
constexpr int activation(std::size_t stage) { return 1000 + int(stage); }
constexpr int weights(std::size_t stage) { return 2000 + int(stage); }

struct Memory {
  std::array<float, 3> gradients{};
  std::array<float, 2> scratch{};
  int id(const float* p) const {
    for (int k = 0; k < 3; ++k)
      if (p == &gradients[k]) return k;
    for (int k = 0; k < 2; ++k)
      if (p == &scratch[k]) return 10 + k;
    FAIL("an address outside the buffers");
    return -1;
  }
};

// A backward pass from the top: 'G' a Conv2d or Linear (input gradient, then its weight gradient,
// forked when branched), 'P' a conv with its fused max-pooling (two stages), 'S' a step of other
// kernels (BatchNorm, a pooling, a residual block, the fused MLP: all on the model's stream; may write
// its dy in place), 'R' a reshape (no kernel). The last letter is stage 0 (no input gradient).
struct Played {
  Streams streams;
  std::vector<Report> reports;
  std::vector<std::pair<int, int>> reads_writes;  // per step: the gradient it read, the one it wrote
  std::vector<std::size_t> branched_steps;        // the op index of each forked weight gradient
  std::vector<std::size_t> next_dgrads;           // and of the next step's first kernel
  std::vector<bool> may_overlap;                  // whether the cursor held that branch's stages (at most 16)
};

Played play(const std::string& net, bool branched) {
  Played out;
  Memory mem;
  FakeSide side{&out.streams};
  Reports reports{&out.streams, {}};
  std::size_t stage_count = 0;
  for (char c : net) stage_count += c == 'P' ? 2 : 1;
  {
    fusedp::BackwardCursor<float, FakeSide, Reports> cur(
        {&mem.gradients[0], &mem.gradients[1], &mem.gradients[2]}, &mem.scratch[0], 1, branched ? &side : nullptr,
        reports);
    std::size_t stage = stage_count;
    std::size_t pending_wgrad = 0;
    bool waiting_next = false;
    std::size_t held = 0;
    for (std::size_t k = 0; k < net.size(); ++k) {
      const char c = net[k];
      stage -= c == 'P' ? 2 : 1;
      const std::size_t i = stage;  // the step's (lower) stage
      const int dy = mem.id(cur.dy()), dx = mem.id(cur.dx()), scratch = mem.id(cur.scratch());
      const bool first = i == 0;
      if (c == 'R') {
        cur(i);
        held += waiting_next;
        continue;
      }
      if (waiting_next) {
        out.next_dgrads.push_back(out.streams.ops.size());
        out.branched_steps.push_back(pending_wgrad);
        out.may_overlap.push_back(held <= 16);
        waiting_next = false;
      }
      out.reads_writes.emplace_back(dy, first ? -1 : dx);
      if (c == 'S') {
        std::set<int> writes{dy, scratch};  // in place, and its scratch
        if (!first) writes.insert(dx);
        out.streams.run(main_stream, "step", {dy, activation(i)}, writes, i);
        cur(i);
        cur.step_done();
        continue;
      }
      // 'G' and 'P': dz materialized into scratch (or read where it is stored: dy), the input gradient
      // (none for stage 0), then dW with its split-K partial sums in scratch: forked where branched,
      // except stage 0's, which has no input gradient to run beside (net/cuda_groups.hpp: branched<I>).
      out.streams.run(main_stream, "dz", {dy}, {scratch}, i);
      if (!first) out.streams.run(main_stream, "dgrad", {dy, scratch, weights(i)}, {dx}, i);
      const bool fork = branched && !first;
      if (fork) cur.will_fork();
      const int wgrad_stream = fork ? side_stream : main_stream;
      if (fork) out.streams.fork();
      pending_wgrad = out.streams.ops.size();
      out.streams.run(wgrad_stream, "wgrad", {dy, scratch, activation(i)}, {weights(i), scratch}, i);
      if (fork) {
        cur.step_branched();
        waiting_next = true;
        held = c == 'P' ? 2 : 1;
      } else {
        cur.step_done();
      }
      if (c == 'P') cur(i + 1);
      cur(i);
    }
    cur.finish();
  }
  // What follows backward on the model's stream (the pass over the rest of the parameters, the next
  // step's forward and loss) touches everything.
  std::set<int> all{0, 1, 2, 10, 11};
  for (std::size_t i = 0; i < stage_count; ++i) {
    all.insert(activation(i));
    all.insert(weights(i));
  }
  out.streams.run(main_stream, "after backward", all, all, stage_count);
  out.reports = reports.list;
  return out;
}

void check_played(const Played& p, std::size_t stage_count) {
  const auto& ops = p.streams.ops;
  // No unordered conflicting pair.
  std::size_t conflicts = 0;
  for (std::size_t a = 0; a < ops.size(); ++a)
    for (std::size_t b = a + 1; b < ops.size(); ++b) {
      const Op& x = ops[a];
      const Op& y = ops[b];
      if (x.stream == y.stream) continue;
      bool clash = false;
      for (int w : x.writes) clash = clash || y.reads.count(w) || y.writes.count(w);
      for (int w : y.writes) clash = clash || x.reads.count(w);
      if (clash && !Streams::before(x, y) && !Streams::before(y, x)) {
        ++conflicts;
        MESSAGE("unordered: " << x.name << " of stage " << x.stage << " and " << y.name << " of stage " << y.stage);
      }
    }
  CHECK(conflicts == 0);
  // Every stage once, last first, after all of its kernels.
  REQUIRE(p.reports.size() == stage_count);
  for (std::size_t k = 0; k < p.reports.size(); ++k) {
    CHECK(p.reports[k].stage == stage_count - 1 - k);
    for (const Op& op : ops)
      if (op.stage == p.reports[k].stage) CHECK(p.reports[k].covered[op.stream] > op.index);
  }
  // Each step reads what the step before it wrote.
  for (std::size_t k = 1; k < p.reads_writes.size(); ++k) CHECK(p.reads_writes[k].first == p.reads_writes[k - 1].second);
  CHECK(p.reads_writes.front().first == 0);  // the loss's gradient
}

std::size_t stages_of(const std::string& net) {
  std::size_t n = 0;
  for (char c : net) n += c == 'P' ? 2 : 1;
  return n;
}

const char* const networks[] = {
    "GGGRPP",                   // LeNet without the fused MLP (Fp32, Bf16): fc3 fc2 fc1, flatten, conv2+pool, conv1+pool
    "SGRPP",                    // LeNet: the fused MLP, fc1, flatten, the two conv + pool
    "GSGSSGSGRG",               // BatchNorm, residual blocks and poolings between GEMM layers
    "GRRRRRRRRRRRRRRRRRRRRRG",  // more reshapes after a branch than the cursor holds
    "GGGGG",
    "G",
    "GR",    // an MLP on images: its last branch waited for by finish() alone
    "GGSR",  // likewise, after a step on the model's stream
    "PR",
};

// What a cursor runs against in the tests of its refusals: the recorded streams, a side stream and a
// report list over them, three gradient buffers and two scratch halves of one float.
struct CursorSetting {
  Streams streams;
  FakeSide side{&streams};
  Reports reports{&streams, {}};
  std::array<float, 3> g{};
  float scratch[2]{};
};

}  // namespace

TEST_CASE("backward in order: two buffers alternate, one scratch, every stage reported at once") {
  for (const char* net : networks) {
    CAPTURE(net);
    const Played p = play(net, false);
    check_played(p, stages_of(net));
    for (const Op& op : p.streams.ops) CHECK(op.stream == main_stream);
    for (const auto& [dy, dx] : p.reads_writes) CHECK((dy < 2 && dx < 2));
  }
}

TEST_CASE("branched backward: weight gradients beside the next step, no race, stages after their branch") {
  for (const char* net : networks) {
    CAPTURE(net);
    const Played p = play(net, true);
    check_played(p, stages_of(net));
    // Each forked weight gradient is unordered against the next step's first kernel (they can overlap),
    // unless more stages came between them than the cursor holds (then it waited early).
    REQUIRE(p.branched_steps.size() == p.next_dgrads.size());
    for (std::size_t k = 0; k < p.branched_steps.size(); ++k) {
      const Op& w = p.streams.ops[p.branched_steps[k]];
      const Op& d = p.streams.ops[p.next_dgrads[k]];
      CAPTURE(k);
      CHECK((!Streams::before(w, d) && !Streams::before(d, w)) == p.may_overlap[k]);
    }
    std::size_t side_ops = 0;
    for (const Op& op : p.streams.ops) side_ops += op.stream == side_stream;
    const std::string n = net;
    const bool stage0_gemm = n.back() == 'G' || n.back() == 'P';
    CHECK(side_ops == std::size_t(std::count(n.begin(), n.end(), 'G') + std::count(n.begin(), n.end(), 'P')) -
                          (stage0_gemm ? 1 : 0));
  }
}

TEST_CASE_FIXTURE(CursorSetting, "the cursor refuses a fork nobody waits for, and a stage reported before its fork is marked") {
  using Cursor = fusedp::BackwardCursor<float, FakeSide, Reports>;
  {
    Cursor cur({&g[0], &g[1], &g[2]}, scratch, 1, &side, reports);
    cur.will_fork();
    CHECK_THROWS_AS(cur.step_done(), std::logic_error);
  }
  {
    Cursor cur({&g[0], &g[1], &g[2]}, scratch, 1, &side, reports);
    cur.will_fork();
    CHECK_THROWS_AS(cur(3), std::logic_error);
    CHECK(reports.list.empty());
  }
  {
    Cursor cur({&g[0], &g[1], &g[2]}, scratch, 1, &side, reports);
    CHECK_THROWS_AS(cur.step_branched(), std::logic_error);
    cur.will_fork();
    CHECK_THROWS_AS(cur.finish(), std::logic_error);
  }
  {
    Cursor cur({&g[0], &g[1], nullptr}, scratch, 1, nullptr, reports);
    CHECK_THROWS_AS(cur.will_fork(), std::logic_error);
  }
}

TEST_CASE_FIXTURE(CursorSetting,
                  "a cursor left with a branch pending or a fork unmarked (backward threw) makes the model's stream wait") {
  {
    fusedp::BackwardCursor<float, FakeSide, Reports> cur({&g[0], &g[1], &g[2]}, scratch, 1, &side, reports);
    cur.will_fork();
    streams.run(main_stream, "dgrad", {0}, {1}, 1);
    streams.fork();
    streams.run(side_stream, "wgrad", {0}, {weights(1)}, 1);
    cur.step_branched();
    cur(1);
    // an exception leaves here
  }
  streams.run(main_stream, "next forward", {weights(1)}, {0}, 0);
  CHECK(Streams::before(streams.ops[1], streams.ops[2]));
  CHECK(reports.list.empty());  // a stage is not reported by an unwinding backward

  // Thrown after the fork, before step_branched marked it: still waited for.
  {
    fusedp::BackwardCursor<float, FakeSide, Reports> cur({&g[0], &g[1], &g[2]}, scratch, 1, &side, reports);
    cur.will_fork();
    streams.fork();
    streams.run(side_stream, "wgrad", {1}, {weights(2)}, 2);
  }
  streams.run(main_stream, "next forward", {weights(2)}, {1}, 0);
  CHECK(Streams::before(streams.ops[3], streams.ops[4]));
}
