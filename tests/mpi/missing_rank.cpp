// Under mpirun: a rank that never arrives at start-up makes the others stop within the timeout with a
// message naming it, instead of hanging (tests/mpi/expect_run.cmake checks the message, the exit
// status and the time).
#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include <chrono>
#include <cstdio>
#include <thread>

namespace fp = fusedp;
using Net = fp::Sequential<fp::Input<6>, fp::Linear<3>>;

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  if (world.rank() == world.size() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // never arrives in time
    return 0;
  }
  try {
    fp::Parallel<Net, fp::Host> dp{world, fp::seed(1), {.threads = 1, .timeout = std::chrono::milliseconds(1500)}};
  } catch (const fp::DeviceError& e) {
    std::fprintf(stderr, "rank %d: caught: %s\n", world.rank(), e.what());
    return 2;  // the MpiWorld aborts the job when it goes
  }
  std::fprintf(stderr, "rank %d: the start-up check passed without the last rank\n", world.rank());
  return 3;
}
