// Two translation units of one program that both use Parallel<Net, Host>: mpi_unit.cpp is compiled
// with MPI's headers on its include path, plain_unit.cpp without. Neither is built with fusedp::mpi, so
// both must see the same in-process Parallel (the same layout and the same inline functions). Before
// FUSEDP_WITH_MPI came from the build, the first saw <mpi.h> and compiled another class under the
// same name: the program failed to link (MPI calls without libmpi) or, linked with MPI, broke the
// one-definition rule.
#pragma once

#include <fusedp/net/sequential.hpp>
#include <fusedp/layers/activation.hpp>
#include <fusedp/layers/input.hpp>
#include <fusedp/layers/linear.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace link_test {

using Net = fusedp::Sequential<fusedp::Input<6>, fusedp::Linear<8>, fusedp::Tanh, fusedp::Linear<3>>;

struct Facts {
  std::size_t size_of_parallel;   // sizeof(Parallel<Net, Host>) as this unit sees it
  std::size_t align_of_parallel;
  bool mpi_header_seen;           // whether <mpi.h> was on this unit's include path
  int with_mpi;                   // FUSEDP_WITH_MPI as this unit sees it
};

struct Trainer;  // a Parallel<Net, Host> with 2 replicas, made in one unit and used in the other
struct TrainerDeleter {
  void operator()(Trainer*) const;
};
using TrainerPtr = std::unique_ptr<Trainer, TrainerDeleter>;

namespace mpi_unit {
Facts facts();
TrainerPtr make_trainer();
float train_step(Trainer& t, std::uint64_t step);
std::vector<float> params(const Trainer& t);
}  // namespace mpi_unit

namespace plain_unit {
Facts facts();
TrainerPtr make_trainer();
float train_step(Trainer& t, std::uint64_t step);
std::vector<float> params(const Trainer& t);
}  // namespace plain_unit

}  // namespace link_test
