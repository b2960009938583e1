// Under mpirun: a NaN on one rank only makes every rank take the same decision: with
// nonfinite::Skip all ranks keep their parameters, with nonfinite::Stop all ranks throw NumericError
// (none is left waiting in a collective), for every reduce policy.
#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <limits>
#include <vector>

namespace fp = fusedp;
using Net = fp::Sequential<fp::Input<6>, fp::Linear<8>, fp::ReLU, fp::Linear<3>>;

template <class P>
void check_policy(const fp::MpiWorld& world, const char* name) {
  const int rank = world.rank(), last = world.size() - 1;
  P dp{world, fp::seed(1), {.threads = 1}};
  constexpr std::size_t n = 4;
  std::vector<float> x(n * 6);
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(5, std::uint64_t(rank), i);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::int32_t(i % 3);
  const fp::Guarded<fp::Sgd, fp::nonfinite::Skip> skip{{{.lr = 0.1f, .momentum = 0.9f}}, {.max_norm = 1.0f}};
  (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, skip);
  const std::vector<float> before(dp.model().params().begin(), dp.model().params().end());
  if (rank == last) x[0] = std::numeric_limits<float>::quiet_NaN();
  (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, skip);
  const bool kept = std::equal(before.begin(), before.end(), dp.model().params().begin());
  mpi_test::check(kept, rank, std::string(name) + ": Skip changed the parameters");
  const fp::Guarded<fp::Sgd> stop{{{.lr = 0.1f}}};
  bool threw = false;
  try {
    (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, stop);
  } catch (const fp::NumericError&) {
    threw = true;
  }
  mpi_test::check(threw, rank, std::string(name) + ": Stop did not throw on this rank");
  if (rank == 0 && kept && threw) std::printf("%-16s every rank skipped, then every rank stopped\n", name);
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  try {
    check_policy<fp::Parallel<Net, fp::Host, fp::scatter::Sharded>>(world, "AllReduce");
    check_policy<fp::Parallel<Net, fp::Host, fp::scatter::Sharded, fp::reduce::ReduceBroadcast<>>>(world, "ReduceBroadcast");
    check_policy<fp::Parallel<Net, fp::Host, fp::scatter::Sharded, fp::reduce::ReduceScatter<>>>(world, "ReduceScatter");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.what());
    return 1;
  }
  return mpi_test::failures == 0 ? 0 : 1;
}
