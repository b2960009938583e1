// Under mpirun: a rank that never arrives at start-up makes the others stop within the timeout with a
// message, instead of hanging (the test passes when that message is printed).
#include <fusedp/fusedp.hpp>
#include <fusedp/parallel/parallel.hpp>

#include <chrono>
#include <thread>

namespace fp = fusedp;
using Net = fp::Sequential<fp::Input<6>, fp::Linear<3>>;

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  if (world.rank() == world.size() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // never arrives in time
    return 0;
  }
  fp::Parallel<Net, fp::Host> dp{world, fp::seed(1), {.threads = 1, .timeout = std::chrono::milliseconds(1500)}};
  return 0;  // not reached: the start-up check aborts the job
}
