// Tests of include/fusedp/data/sampler.hpp: the properties PyTorch's DistributedSampler has (shards
// disjoint and covering, the same permutation on every rank, a new one each epoch, padding and
// drop_last counts) and the exact evaluation mode.
#include "fusedp/data/sampler.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <numeric>
#include <set>
#include <vector>

namespace {

using fusedp::InvalidArgument;
using fusedp::data::DistributedSampler;
using fusedp::data::SamplerOptions;

std::vector<std::vector<std::size_t>> shards(std::size_t n, std::size_t world, SamplerOptions o, std::uint64_t epoch) {
  std::vector<std::vector<std::size_t>> out;
  for (std::size_t r = 0; r < world; ++r) {
    DistributedSampler s{n, world, r, o};
    s.set_epoch(epoch);
    out.emplace_back(s.indices().begin(), s.indices().end());
  }
  return out;
}

// The global order every rank derived: interleave the shards back (rank r holds positions r, r + w, ...).
std::vector<std::size_t> interleave(const std::vector<std::vector<std::size_t>>& s) {
  std::vector<std::size_t> g;
  for (std::size_t j = 0; j < s[0].size(); ++j)
    for (const auto& shard : s)
      if (j < shard.size()) g.push_back(shard[j]);
  return g;
}

}  // namespace

TEST_CASE("world 1 without shuffle visits the dataset in order; with shuffle, a permutation") {
  DistributedSampler plain{10, 1, 0, {.shuffle = false}};
  const std::vector<std::size_t> in_order(plain.indices().begin(), plain.indices().end());
  std::vector<std::size_t> expected(10);
  std::iota(expected.begin(), expected.end(), 0u);
  CHECK(in_order == expected);

  DistributedSampler s{1000, 1, 0, {.seed = 7}};
  s.set_epoch(3);
  std::vector<std::size_t> v(s.indices().begin(), s.indices().end());
  CHECK(v != std::vector<std::size_t>(expected.begin(), expected.end()));
  // the same order as data::permutation, which lenet_mnist used before the sampler existed
  CHECK(v == fusedp::data::permutation(1000, 7, 3));
  std::sort(v.begin(), v.end());
  for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == i);
}

TEST_CASE("shards are disjoint, cover the dataset, and share one permutation per epoch") {
  for (std::size_t world : {1u, 2u, 3u, 4u, 7u}) {
    for (std::size_t n : {1u, 5u, 12u, 13u, 100u, 101u}) {
      if (n < world) continue;
      CAPTURE(world);
      CAPTURE(n);
      const SamplerOptions o{.shuffle = true, .seed = 42};
      const auto s = shards(n, world, o, 5);
      const std::size_t per_rank = (n + world - 1) / world;
      for (const auto& shard : s) CHECK(shard.size() == per_rank);  // equal counts by padding
      const std::vector<std::size_t> global = interleave(s);
      REQUIRE(global.size() == per_rank * world);
      // the first n positions are a permutation of the dataset: disjoint and covering
      std::vector<std::size_t> head(global.begin(), global.begin() + std::ptrdiff_t(n));
      std::sort(head.begin(), head.end());
      for (std::size_t i = 0; i < n; ++i) REQUIRE(head[i] == i);
      // padding repeats the permutation from its start, as PyTorch does
      for (std::size_t k = n; k < global.size(); ++k) CHECK(global[k] == global[k - n]);
      // every rank derived the same permutation: the one of world size 1
      DistributedSampler one{n, 1, 0, o};
      one.set_epoch(5);
      CHECK(std::equal(one.indices().begin(), one.indices().end(), global.begin()));
    }
  }
}

TEST_CASE("the permutation changes with the epoch and the seed, and is reproducible") {
  const SamplerOptions o{.seed = 1};
  CHECK(shards(50, 2, o, 0) == shards(50, 2, o, 0));
  CHECK(shards(50, 2, o, 0) != shards(50, 2, o, 1));
  CHECK(shards(50, 2, o, 1) != shards(50, 2, {.seed = 2}, 1));
  DistributedSampler s{50, 2, 1, o};
  s.set_epoch(1);
  const std::vector<std::size_t> first(s.indices().begin(), s.indices().end());
  s.set_epoch(2);
  s.set_epoch(1);
  CHECK(std::vector<std::size_t>(s.indices().begin(), s.indices().end()) == first);
  CHECK(s.epoch() == 1);
}

TEST_CASE("padding and drop_last counts, as torch.utils.data.DistributedSampler") {
  // (n, world) -> per-rank count with padding (ceil) and with drop_last (floor)
  struct Case {
    std::size_t n, world, padded, dropped;
  };
  for (const Case c : {Case{10, 3, 4, 3}, Case{9, 3, 3, 3}, Case{11, 4, 3, 2}, Case{3, 4, 1, 0}, Case{1, 1, 1, 1}}) {
    CAPTURE(c.n);
    CAPTURE(c.world);
    for (std::size_t r = 0; r < c.world; ++r) {
      CHECK(DistributedSampler(c.n, c.world, r, {}).num_samples() == c.padded);
      if (c.dropped > 0) {
        DistributedSampler d{c.n, c.world, r, {.drop_last = true}};
        CHECK(d.num_samples() == c.dropped);
        CHECK(d.total_size() == c.dropped * c.world);
      }
    }
    CHECK(DistributedSampler(c.n, c.world, 0, {}).total_size() == c.padded * c.world);
  }
  // drop_last: shards are disjoint, nothing repeats, the tail of the permutation is left out
  const auto s = shards(11, 4, {.seed = 3, .drop_last = true}, 2);
  const std::vector<std::size_t> global = interleave(s);
  CHECK(global.size() == 8);
  CHECK(std::set<std::size_t>(global.begin(), global.end()).size() == 8);
  const auto perm = fusedp::data::permutation(11, 3, 2);
  CHECK(std::equal(global.begin(), global.end(), perm.begin()));
  // more ranks than samples: padding repeats the few samples
  const auto tiny = shards(3, 4, {.shuffle = false}, 0);
  CHECK(interleave(tiny) == std::vector<std::size_t>{0, 1, 2, 0});
}

TEST_CASE("evaluation mode visits every sample exactly once across ranks") {
  for (std::size_t world : {1u, 2u, 3u, 5u, 8u}) {
    for (std::size_t n : {1u, 2u, 7u, 10u, 33u}) {
      CAPTURE(world);
      CAPTURE(n);
      for (bool shuffle : {false, true}) {
        const auto s = shards(n, world, {.shuffle = shuffle, .seed = 9, .evaluation = true}, 4);
        std::map<std::size_t, int> seen;
        std::size_t total = 0;
        for (std::size_t r = 0; r < world; ++r) {
          DistributedSampler one{n, world, r, {.shuffle = shuffle, .seed = 9, .evaluation = true}};
          CHECK(one.num_samples() == s[r].size());
          CHECK(one.num_samples_of(r) == s[r].size());
          // counts differ by at most one, lower ranks first
          CHECK(s[r].size() == n / world + (r < n % world ? 1 : 0));
          for (std::size_t i : s[r]) ++seen[i];
          total += s[r].size();
        }
        CHECK(total == n);
        CHECK(seen.size() == n);
        for (const auto& [i, count] : seen) CHECK(count == 1);
        CHECK(DistributedSampler(n, world, 0, {.evaluation = true}).total_size() == n);
      }
    }
  }
}

TEST_CASE("every rank can compute every rank's count, to agree on a step count") {
  DistributedSampler s{10, 4, 0, {.evaluation = true}};
  CHECK(s.num_samples_of(0) == 3);
  CHECK(s.num_samples_of(1) == 3);
  CHECK(s.num_samples_of(2) == 2);
  CHECK(s.num_samples_of(3) == 2);
  CHECK_THROWS_AS((void)s.num_samples_of(4), InvalidArgument);
  CHECK(s.world() == 4);
  CHECK(s.rank() == 0);
  CHECK(s.size() == 10);
}

// Elastic resume: n samples, N ranks take k steps of b samples each, then M ranks go on from the
// position those steps reached. Returns (visited before, visited after) as multisets.
struct Split {
  std::multiset<std::size_t> before, after;
  std::vector<std::vector<std::size_t>> after_shards;
};
Split resume_split(std::size_t n, std::size_t N, std::size_t M, std::size_t k, std::size_t b, SamplerOptions o,
                   std::uint64_t epoch) {
  Split out;
  for (std::size_t r = 0; r < N; ++r) {
    DistributedSampler s{n, N, r, o};
    s.set_epoch(epoch);
    REQUIRE(k * b <= s.num_samples());
    out.before.insert(s.indices().begin(), s.indices().begin() + std::ptrdiff_t(k * b));
  }
  const std::size_t position = k * b * N;
  for (std::size_t r = 0; r < M; ++r) {
    DistributedSampler s{n, M, r, o};
    s.set_epoch(epoch, {position});
    CHECK(s.start().samples == position);
    CHECK(s.num_samples() == s.num_samples_of(r));
    out.after.insert(s.indices().begin(), s.indices().end());
    out.after_shards.emplace_back(s.indices().begin(), s.indices().end());
  }
  return out;
}

TEST_CASE("resumed inside an epoch at another world size, each remaining sample is visited exactly once") {
  const SamplerOptions o{.seed = 5};
  for (std::size_t n : {10u, 23u, 30u, 64u})
    for (std::size_t N : {1u, 2u, 3u})
      for (std::size_t M : {1u, 2u, 3u, 4u, 7u})
        for (std::size_t b : {1u, 2u})
          for (std::size_t k : {std::size_t(1), n / N / (2 * b), n / N / b - 1}) {  // 1 step, a quarter, all but 1
            if (k == 0) continue;
            CAPTURE(n);
            CAPTURE(N);
            CAPTURE(M);
            CAPTURE(b);
            CAPTURE(k);
            const Split s = resume_split(n, N, M, k, b, o, 3);
            // the steps before the resume visited a prefix of the epoch's order: no sample twice
            CHECK(std::set<std::size_t>(s.before.begin(), s.before.end()).size() == s.before.size());
            // after it, every sample not visited before comes exactly once ...
            for (std::size_t i = 0; i < n; ++i)
              if (s.before.count(i) == 0) REQUIRE(s.after.count(i) == 1);
            // ... every rank has the same count, and the padding to it repeats samples visited before,
            // fewer than M of them (as the padding of a whole epoch repeats its head)
            std::size_t padding = 0;
            for (std::size_t i : std::set<std::size_t>(s.after.begin(), s.after.end()))
              if (s.before.count(i) != 0) padding += s.after.count(i);
            CHECK(padding < M);
            CHECK(s.after.size() == (n - k * b * N) + padding);
            for (const auto& shard : s.after_shards) CHECK(shard.size() == s.after_shards[0].size());
            if (M != N) continue;
            for (std::size_t r = 0; r < N; ++r) {  // the same world: each rank goes on with its own list
              DistributedSampler whole{n, N, r, o};
              whole.set_epoch(3);
              CHECK(std::equal(s.after_shards[r].begin(), s.after_shards[r].end(),
                               whole.indices().begin() + std::ptrdiff_t(k * b), whole.indices().end()));
              CHECK(s.after_shards[r].size() == whole.num_samples() - k * b);
            }
          }
}

TEST_CASE("drop_last and evaluation counts from a start; the end of the epoch leaves nothing") {
  DistributedSampler drop{30, 4, 1, {.drop_last = true}};
  drop.set_epoch(1, {8});  // 22 left: 5 per rank, 2 dropped
  CHECK(drop.num_samples() == 5);
  CHECK(drop.total_size() == 20);
  DistributedSampler eval{30, 4, 3, {.evaluation = true}};
  eval.set_epoch(0, {8});  // 22 left: 6, 6, 5, 5
  CHECK(eval.num_samples() == 5);
  CHECK(eval.num_samples_of(0) == 6);
  CHECK(eval.total_size() == 22);
  DistributedSampler done{30, 3, 2};
  done.set_epoch(2, {30});
  CHECK(done.num_samples() == 0);
  CHECK(done.indices().empty());
  done.set_epoch(2);  // back to a whole epoch
  CHECK(done.num_samples() == 10);
  CHECK_THROWS_WITH_AS(done.set_epoch(2, {31}), doctest::Contains("a start at sample 31 of an epoch of 30"),
                       InvalidArgument);
}

TEST_CASE("bad arguments are InvalidArgument with a message") {
  CHECK_THROWS_WITH_AS(DistributedSampler(0, 1, 0), doctest::Contains("empty"), InvalidArgument);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 0, 0), doctest::Contains("world size must be >= 1"), InvalidArgument);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 2, 2), doctest::Contains("rank 2 is not in [0, 2)"), InvalidArgument);
  CHECK_THROWS_WITH_AS(DistributedSampler(3, 4, 0, {.drop_last = true}), doctest::Contains("leaves nothing"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 2, 0, {.drop_last = true, .evaluation = true}),
                       doctest::Contains("cannot drop_last"), InvalidArgument);
}
