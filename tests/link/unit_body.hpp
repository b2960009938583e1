// The body of mpi_unit.cpp and plain_unit.cpp: the same code, compiled under two include paths.
#pragma once
#include "units.hpp"

#include <fusedp/loss/softmax_cross_entropy.hpp>
#include <fusedp/optim/sgd.hpp>
#include <fusedp/parallel/parallel.hpp>
#include <fusedp/core/rng.hpp>

#if __has_include(<mpi.h>)
#define LINK_TEST_MPI_HEADER_SEEN true
#else
#define LINK_TEST_MPI_HEADER_SEEN false
#endif
#ifndef FUSEDP_WITH_MPI  // before the build decided (the test's "before" run); config.hpp defines it now
#define FUSEDP_WITH_MPI 0
#endif

namespace link_test {

struct Trainer {
  fusedp::Parallel<Net, fusedp::Host, fusedp::Deterministic> parallel{fusedp::replicas(2, 1), fusedp::seed(5)};
};

namespace LINK_TEST_UNIT {
Facts facts() {
  return {sizeof(Trainer), alignof(Trainer), LINK_TEST_MPI_HEADER_SEEN, FUSEDP_WITH_MPI};
}
TrainerPtr make_trainer() { return TrainerPtr(new Trainer); }
float train_step(Trainer& t, std::uint64_t step) {
  std::vector<float> x(4 * Net::input_shape::size);
  std::vector<std::int32_t> y(4);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(2 * fusedp::rng::uniform(21, step, i) - 1);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::int32_t(fusedp::rng::uniform(22, step, i) * 3);
  fusedp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  return t.parallel.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                               fusedp::SoftmaxCrossEntropy{}, opt);
}
std::vector<float> params(const Trainer& t) {
  const auto p = t.parallel.model(1).params();
  return {p.begin(), p.end()};
}
}  // namespace LINK_TEST_UNIT

}  // namespace link_test
