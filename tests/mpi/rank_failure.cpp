// Under mpirun: a rank that dies or stops responding in the middle of training makes every other
// rank fail within the collective timeout, with a message naming it, and the whole job end; a rank
// that is only slow (less than the timeout) does not. Run by tests/mpi/expect_run.cmake, which
// checks the exit code, the messages and the time mpirun took.
//
//   test_mpi_rank_failure <mode> <policy> <timeout ms>
//     mode    kill  rank 1 raises SIGKILL after 3 steps
//             hang  rank 1 stops calling MPI after 3 steps (sleeps, then exits after 30 s)
//             slow  rank 1 sleeps 1.5 s before step 4, then every rank finishes 6 steps (exit 0)
//             truncate  a broadcast whose counts differ between ranks (an MPI error on the
//                   receivers), then an all-reduce: the error is a DeviceError naming the call on
//                   the receivers, and the root, waiting in the next collective, learns of it
//     policy  allreduce (a small network: MPI_Iallreduce), ring (a larger one: the ring all-reduce),
//             overlap (buckets started during backward, waited after), deterministic (all-gather),
//             zero (reduce-scatter + all-gather of blocks)
//
// Survivors print "rank R: caught: <what>" and return 2 (the MpiWorld then aborts the job).
#include "../support/fusedp_core.hpp"
#include <fusedp/parallel/parallel.hpp>

#include "mpi_check.hpp"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace fp = fusedp;
using Net = fp::Sequential<fp::Input<6>, fp::Linear<32>, fp::ReLU, fp::Linear<32>, fp::ReLU, fp::Linear<3>>;
using Small = fp::Sequential<fp::Input<6>, fp::Linear<8>, fp::ReLU, fp::Linear<3>>;  // 83 values: MPI_Iallreduce
using Wide = fp::Sequential<fp::Input<6>, fp::Linear<512>, fp::ReLU, fp::Linear<3>>;  // 5123 values: the ring

constexpr int victim = 1;
constexpr int steps_before = 3;

template <class P>
int train(const fp::MpiWorld& world, const std::string& mode, std::chrono::milliseconds timeout) {
  const int rank = world.rank();
  P dp{world, fp::seed(3), {.threads = 1, .timeout = timeout}};
  constexpr std::size_t n = 8;
  std::vector<float> x(n * 6);
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(7, 0, i);
  for (std::size_t i = 0; i < n; ++i) y[i] = std::int32_t(i % 3);
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  const int steps = mode == "slow" ? 6 : 1000;
  for (int step = 0; step < steps; ++step) {
    if (rank == victim && step == steps_before) {
      if (mode == "kill") {
        std::fflush(nullptr);
        std::raise(SIGKILL);
      } else if (mode == "hang") {
        std::fprintf(stderr, "rank %d: stops calling MPI\n", rank);
        std::this_thread::sleep_for(std::chrono::seconds(30));
        std::_Exit(0);
      } else if (mode == "slow") {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      }
    }
    (void)dp.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  }
  if (rank == 0) std::printf("%d steps done\n", steps);
  return 0;
}

// A broadcast of 1000 values from rank 0 that the others receive as 10: MPI reports a truncation on
// them. Then every rank sums a value.
int truncate(const fp::MpiWorld& world, std::chrono::milliseconds timeout) {
  const fp::parallel::MpiCommunicator comm(world, timeout);
  std::vector<float> v(1000, 1.0f);
  comm.broadcast(v.data(), world.rank() == 0 ? v.size() : 10, 0);
  double one = 1;
  comm.all_reduce_sum(&one, 1);
  return 0;
}

int run(const fp::MpiWorld& world, const std::string& mode, const std::string& policy, std::chrono::milliseconds t) {
  if (mode == "truncate") return truncate(world, t);
  // scatter::Even (the same global batch on every rank): a step's first collective is then the
  // gradients' reduction, the one each policy names.
  if (policy == "allreduce") return train<fp::Parallel<Small, fp::Host>>(world, mode, t);
  if (policy == "ring") return train<fp::Parallel<Wide, fp::Host>>(world, mode, t);
  if (policy == "overlap")
    return train<fp::Parallel<Net, fp::Host, fp::reduce::AllReduce<fp::Bucket<512>, fp::Overlap>>>(world, mode, t);
  if (policy == "deterministic") return train<fp::Parallel<Net, fp::Host, fp::Deterministic>>(world, mode, t);
  if (policy == "zero") return train<fp::Parallel<Net, fp::Host, fp::reduce::ReduceScatter<>>>(world, mode, t);
  std::fprintf(stderr, "unknown policy '%s'\n", policy.c_str());
  return 64;
}

// FUSEDP_COLLECTIVE_TIMEOUT: read in seconds, and a malformed value is an error naming it.
void check_timeout_variable(int rank) {
  const char* saved = std::getenv("FUSEDP_COLLECTIVE_TIMEOUT");
  const std::string keep = saved ? saved : "";
  ::setenv("FUSEDP_COLLECTIVE_TIMEOUT", "2.5", 1);
  mpi_test::check(fp::collective_timeout(std::chrono::milliseconds(7)) == std::chrono::milliseconds(2500), rank,
                  "FUSEDP_COLLECTIVE_TIMEOUT=2.5 is not 2500 ms");
  for (const char* bad : {"abc", "-1", "0", "5s", "nan"}) {
    ::setenv("FUSEDP_COLLECTIVE_TIMEOUT", bad, 1);
    std::string message;
    try {
      (void)fp::collective_timeout(std::chrono::milliseconds(7));
    } catch (const fp::InvalidArgument& e) {
      message = e.what();
    }
    mpi_test::check(message.find("FUSEDP_COLLECTIVE_TIMEOUT='" + std::string(bad) + "'") != std::string::npos, rank,
                    "a malformed FUSEDP_COLLECTIVE_TIMEOUT was not refused by name: '" + message + "'");
  }
  ::unsetenv("FUSEDP_COLLECTIVE_TIMEOUT");
  mpi_test::check(fp::collective_timeout(std::chrono::milliseconds(7)) == std::chrono::milliseconds(7), rank,
                  "without FUSEDP_COLLECTIVE_TIMEOUT the program's timeout is not used");
  if (saved) ::setenv("FUSEDP_COLLECTIVE_TIMEOUT", keep.c_str(), 1);
}

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s kill|hang|slow|truncate allreduce|ring|overlap|deterministic|zero <timeout ms>\n",
                 argv[0]);
    return 64;
  }
  const std::string mode = argv[1], policy = argv[2];
  const auto timeout = std::chrono::milliseconds(std::atoll(argv[3]));
  if (mode == "slow") check_timeout_variable(world.rank());
  try {
    const int rc = run(world, mode, policy, timeout);
    return rc != 0 ? rc : mpi_test::failures == 0 ? 0 : 1;
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "rank %d: caught: %s\n", world.rank(), e.what());
    return 2;
  }
}
