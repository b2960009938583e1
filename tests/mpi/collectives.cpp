// Under mpirun: every collective of MpiCommunicator (include/fusedp/parallel/mpi.hpp) gives the
// values MPI's blocking collectives give, for sizes on both sides of the ring all-reduce's threshold
// and counts that do not divide by the number of ranks; the ring gives every rank the same bits.
#include <fusedp/parallel/mpi.hpp>

#include "mpi_check.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace fp = fusedp;

namespace {

// A value that differs by rank and index, exact in float (small integers and halves).
float value(int rank, std::size_t i) { return float((i * 7 + std::size_t(rank) * 3) % 101) * 0.5f - 20.0f; }

// Whether every rank holds the same bytes.
bool same_everywhere(const fp::MpiWorld& world, const void* data, std::size_t bytes) {
  std::vector<unsigned char> all(bytes * std::size_t(world.size()));
  MPI_Allgather(data, int(bytes), MPI_BYTE, all.data(), int(bytes), MPI_BYTE, world.comm());
  for (int r = 1; r < world.size(); ++r)
    if (std::memcmp(all.data(), all.data() + bytes * std::size_t(r), bytes) != 0) return false;
  return true;
}

void check_all_reduce(const fp::MpiWorld& world, const fp::parallel::MpiCommunicator& comm, std::size_t n) {
  const int rank = world.rank();
  const std::string at = "all_reduce_sum of " + std::to_string(n) + " ";
  // Floats whose sums are exact: any order gives the same bits as MPI_Allreduce.
  std::vector<float> mine(n), ref(n);
  for (std::size_t i = 0; i < n; ++i) mine[i] = ref[i] = value(rank, i);
  MPI_Allreduce(MPI_IN_PLACE, ref.data(), int(n), MPI_FLOAT, MPI_SUM, world.comm());
  comm.all_reduce_sum(mine.data(), n);
  mpi_test::check(std::memcmp(mine.data(), ref.data(), n * sizeof(float)) == 0, rank, at + "floats differ from MPI_Allreduce");
  // Inexact sums: within rounding of the reference, and the same bits on every rank.
  std::vector<double> d(n), dref(n);
  for (std::size_t i = 0; i < n; ++i) d[i] = dref[i] = 1.0 / double(i + 3 + std::size_t(rank));
  MPI_Allreduce(MPI_IN_PLACE, dref.data(), int(n), MPI_DOUBLE, MPI_SUM, world.comm());
  comm.all_reduce_sum(d.data(), n);
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(d[i] - dref[i]) / std::abs(dref[i]));
  mpi_test::check(worst <= 1e-15, rank, at + "doubles off by " + std::to_string(worst));
  mpi_test::check(same_everywhere(world, d.data(), n * sizeof(double)), rank, at + "doubles differ between ranks");
  std::vector<std::uint64_t> u(n);
  for (std::size_t i = 0; i < n; ++i) u[i] = i * 1000 + std::uint64_t(rank);
  comm.all_reduce_sum(u.data(), n);
  const auto p = std::uint64_t(world.size());
  bool exact = true;
  for (std::size_t i = 0; i < n; ++i) exact = exact && u[i] == i * 1000 * p + p * (p - 1) / 2;
  mpi_test::check(exact, rank, at + "uint64 sums are wrong");
}

// broadcast, reduce_sum (to the first and the last rank), all_gather, all_gather_blocks,
// reduce_scatter_blocks, of `n` values.
void check_others(const fp::MpiWorld& world, const fp::parallel::MpiCommunicator& comm, std::size_t n) {
  const int rank = world.rank(), size = world.size();
  const std::string at = " of " + std::to_string(n);
  std::vector<float> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = value(rank, i);
  comm.broadcast(b.data(), n, size - 1);
  bool ok = true;
  for (std::size_t i = 0; i < n; ++i) ok = ok && b[i] == value(size - 1, i);
  mpi_test::check(ok, rank, "broadcast from the last rank" + at);

  for (int root : {0, size - 1}) {
    std::vector<float> s(n);
    for (std::size_t i = 0; i < n; ++i) s[i] = value(rank, i);
    comm.reduce_sum(s.data(), n, root);
    ok = true;
    for (std::size_t i = 0; i < n; ++i) {
      float want = value(rank, i);  // the others' values are unchanged
      if (rank == root) {
        want = 0;
        for (int r = 0; r < size; ++r) want += value(r, i);
      }
      ok = ok && s[i] == want;
    }
    mpi_test::check(ok, rank, "reduce_sum to rank " + std::to_string(root) + at);
  }

  std::vector<float> all(n * std::size_t(size));
  for (std::size_t i = 0; i < n; ++i) b[i] = value(rank, i);
  comm.all_gather(b.data(), all.data(), n, "test");
  ok = true;
  for (int r = 0; r < size; ++r)
    for (std::size_t i = 0; i < n; ++i) ok = ok && all[std::size_t(r) * n + i] == value(r, i);
  mpi_test::check(ok, rank, "all_gather" + at);

  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  // Uneven blocks: rank r's share grows with r (weights 1, 2, 3, ...).
  const std::size_t weights = std::size_t(size) * std::size_t(size + 1) / 2;
  for (int r = 0, at_weight = 0; r < size; at_weight += r + 1, ++r) {
    displs[std::size_t(r)] = int(n * std::size_t(at_weight) / weights);
    counts[std::size_t(r)] = int(n * std::size_t(at_weight + r + 1) / weights) - displs[std::size_t(r)];
  }
  std::vector<float> blocks(n, -1.0f);
  for (int i = 0; i < counts[std::size_t(rank)]; ++i)
    blocks[std::size_t(displs[std::size_t(rank)] + i)] = value(rank, std::size_t(i));
  comm.all_gather_blocks(blocks.data(), counts, displs);
  ok = true;
  for (int r = 0; r < size; ++r)
    for (int i = 0; i < counts[std::size_t(r)]; ++i) ok = ok && blocks[std::size_t(displs[std::size_t(r)] + i)] == value(r, std::size_t(i));
  mpi_test::check(ok, rank, "all_gather_blocks" + at);

  std::vector<float> g(n), scratch(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = value(rank, i);
  comm.reduce_scatter_blocks(g.data(), counts, displs, scratch.data());
  ok = true;
  for (std::size_t i = 0; i < n; ++i) {
    const bool own = int(i) >= displs[std::size_t(rank)] && int(i) < displs[std::size_t(rank)] + counts[std::size_t(rank)];
    float want = value(rank, i);
    if (own) {
      want = 0;
      for (int r = 0; r < size; ++r) want += value(r, i);
    }
    ok = ok && g[i] == want;
  }
  mpi_test::check(ok, rank, "reduce_scatter_blocks (the rest keeps this rank's values)" + at);
}

}  // namespace

int main(int argc, char** argv) {
  fp::MpiWorld world(&argc, &argv);
  const int rank = world.rank(), size = world.size();
  const fp::parallel::MpiCommunicator comm(world, std::chrono::milliseconds(30000));
  // 1, 5: MPI_Iallreduce; 512 x size floats: the ring's threshold exactly (2048 bytes a block);
  // odd counts: blocks of unequal length.
  for (std::size_t n : {std::size_t(1), std::size_t(5), std::size_t(512) * std::size_t(size) - 1,
                        std::size_t(512) * std::size_t(size), std::size_t(1000003)})
    check_all_reduce(world, comm, n);

  // The others on both sides of the rings' threshold (2 KiB a rank): 101 values go to Open MPI's
  // non-blocking collectives, 100003 to fusedp's rings.
  for (std::size_t n : {std::size_t(101), std::size_t(100003)}) check_others(world, comm, n);

  // Started all-reduces, finished by wait_all.
  std::vector<float> x(3000), y(7);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(rank, i);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = value(rank, i + 5);
  std::vector<MPI_Request> requests;
  comm.start_all_reduce_sum(x.data(), x.size(), requests);
  comm.start_all_reduce_sum(y.data(), y.size(), requests);
  comm.wait_all(requests);
  bool ok = requests.empty();
  for (std::size_t i = 0; i < x.size(); ++i) {
    float want = 0;
    for (int r = 0; r < size; ++r) want += value(r, i);
    ok = ok && x[i] == want;
  }
  for (std::size_t i = 0; i < y.size(); ++i) {
    float want = 0;
    for (int r = 0; r < size; ++r) want += value(r, i + 5);
    ok = ok && y[i] == want;
  }
  mpi_test::check(ok, rank, "start_all_reduce_sum + wait_all");

  mpi_test::check(!world.failed(), rank, "the world is marked failed");
  if (rank == 0 && mpi_test::failures == 0) std::printf("every collective agrees with MPI's blocking ones\n");
  return mpi_test::failures == 0 ? 0 : 1;
}
