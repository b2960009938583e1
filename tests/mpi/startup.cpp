// Under mpirun: ranks started with a different network or different settings all fail at start-up
// with a message naming what differs, instead of hanging or training wrongly. Also: ranks agree on
// the step count, and evaluation counts every sample exactly once.
#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace fp = fusedp;
using Net = fp::Sequential<fp::Input<6>, fp::Linear<8>, fp::ReLU, fp::Linear<3>>;
using Other = fp::Sequential<fp::Input<6>, fp::Linear<9>, fp::ReLU, fp::Linear<3>>;

template <class P>
std::string startup_error(const fp::MpiWorld& world, fp::ParallelOptions options) {
  try {
    P dp{world, fp::seed(1), options};
    return "";
  } catch (const fp::InvalidArgument& e) {
    return e.what();
  }
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  const int rank = world.rank(), last = world.size() - 1;

  // A flag that differs on the last rank (agree_on carries a hash of the flags).
  const std::string flags = startup_error<fp::Parallel<Net, fp::Host>>(world, {.threads = 1, .agree_on = rank == last ? 7u : 5u});
  mpi_test::check(flags.find("agree_on value") != std::string::npos, rank, "different flags not reported: '" + flags + "'");
  // A different network on the last rank: every rank must throw, none may hang.
  std::string net;
  if (rank == last) net = startup_error<fp::Parallel<Other, fp::Host>>(world, {.threads = 1});
  else net = startup_error<fp::Parallel<Net, fp::Host>>(world, {.threads = 1});
  mpi_test::check(net.find("network fingerprint") != std::string::npos, rank, "different network not reported: '" + net + "'");
  // Different policies.
  std::string pol;
  if (rank == last) pol = startup_error<fp::Parallel<Net, fp::Host, fp::Sum>>(world, {.threads = 1});
  else pol = startup_error<fp::Parallel<Net, fp::Host>>(world, {.threads = 1});
  mpi_test::check(pol.find("policy hash") != std::string::npos, rank, "different policies not reported: '" + pol + "'");

  // Matching ranks start; steps per epoch agree on the smallest; evaluation counts each sample once.
  fp::Parallel<Net, fp::Host> dp{world, fp::seed(1), {.threads = 1}};
  mpi_test::check(dp.agree_steps(std::size_t(10 + rank)) == 10, rank, "agree_steps is not the minimum");
  constexpr std::size_t total = 10;
  std::vector<float> x(total * 6);
  std::vector<std::int32_t> y(total);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(2, 0, i);
  for (std::size_t i = 0; i < total; ++i) y[i] = std::int32_t(i % 3);
  // Rank r evaluates samples r, r + world, ... (no padding: some ranks have one sample fewer).
  std::vector<float> mx;
  std::vector<std::int32_t> my;
  for (std::size_t i = std::size_t(rank); i < total; i += std::size_t(world.size())) {
    mx.insert(mx.end(), x.begin() + std::ptrdiff_t(i * 6), x.begin() + std::ptrdiff_t(i * 6 + 6));
    my.push_back(y[i]);
  }
  const auto g = dp.evaluate(std::span<const float>(mx), std::span<const std::int32_t>(my), fp::SoftmaxCrossEntropy{});
  const auto e = dp.model().evaluate(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{});
  mpi_test::check(g.count == total, rank, "evaluation counted " + std::to_string(g.count) + " samples, not 10");
  mpi_test::check(std::abs(g.loss() - e.loss) <= 1e-6 * e.loss, rank, "distributed evaluation loss differs");
  mpi_test::check(g.correct == fp::count_correct(e.outputs, std::span<const std::int32_t>(y)), rank,
                  "distributed evaluation accuracy differs");

  // The host names the start-up check carries, and how a message names ranks with them (the
  // multihost tests see them in a real message).
  using fp::detail::rank_list;
  const auto same = [&](const std::string& got, const std::string& want) {
    mpi_test::check(got == want, rank, "rank_list gave '" + got + "', expected '" + want + "'");
  };
  same(rank_list({1}), "rank 1");
  same(rank_list({0, 1, 2}), "ranks 0, 1 and 2");
  same(rank_list({1}, {"a", "b"}), "rank 1 (on b)");
  same(rank_list({2, 3}, {"a", "a", "b", "b"}), "ranks 2 and 3 (on b)");
  same(rank_list({1, 3}, {"a", "b", "a", "c"}), "ranks 1 (on b) and 3 (on c)");
  const std::string long_name(300, 'h');
  for (const std::string& name : {std::string("node-7"), long_name, std::string()}) {
    fp::parallel::detail::RunIdentity id{1, 2, 3, 2, 4, 1, 0, 1, name};
    const std::vector<std::string> hosts =
        fp::parallel::detail::check_same_run(id, 2, [](const std::uint64_t* mine, std::uint64_t* all, std::size_t n) {
          std::copy(mine, mine + n, all);
          std::copy(mine, mine + n, all + n);
        });
    const std::string want = name.substr(0, 255);
    mpi_test::check(hosts.size() == 2 && hosts[0] == want && hosts[1] == want, rank,
                    "check_same_run did not return the host name '" + want.substr(0, 20) + "...' of each rank");
  }
  mpi_test::check(fp::detail::processor_name() != "", rank, "MPI_Get_processor_name gave no name");
  // A rank whose replicas run backward's weight gradients in order while rank 0's branch them (a Cuda
  // Parallel's ParallelOptions::backward_branches) is named, as every other difference is.
  {
    const fp::parallel::detail::RunIdentity id{1, 2, 3, 2, 4, 1, 0, 1, "node"};
    std::string message;
    try {
      (void)fp::parallel::detail::check_same_run(id, 2, [](const std::uint64_t* mine, std::uint64_t* all, std::size_t n) {
        std::copy(mine, mine + n, all);
        std::copy(mine, mine + n, all + n);
        all[n + 9] = 0;  // rank 1: backward_branches = false
      });
    } catch (const fp::InvalidArgument& e) {
      message = e.what();
    }
    mpi_test::check(message.find("rank 1 has backward branches setting 0, rank 0 has 1") != std::string::npos, rank,
                    "a different backward_branches was not reported: '" + message + "'");
  }

  if (rank == 0 && mpi_test::failures == 0) std::printf("start-up mismatches reported on every rank; evaluation exact\n");
  return mpi_test::failures == 0 ? 0 : 1;
}
