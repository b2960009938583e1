#pragma once
// Checkpoints of a data-parallel run: save_checkpoint and load_checkpoint take a Parallel as they take
// a Model, and write and read the same two files (train/checkpoint.hpp), whatever the world size and
// the reduce policy. With reduce::ReduceScatter (ZeRO-1) the optimizer state lives in blocks, one per
// replica: saving gathers every block into the state one Model would hold; loading gives each replica
// its block of the current world size, so a run saved by N replicas (or ranks) resumes with M.
//
// Both are collectives under MPI: every rank calls them. Rank 0 writes (the folder must be visible to
// every rank only for loading); every rank learns whether the save succeeded, so a failed write throws
// on every rank, and the previous checkpoint stays intact. Loading reads and verifies the files on
// every rank, and every rank learns that all of them read the same checkpoint, before any replica
// changes.
#include "fusedp/exec/trace.hpp"
#include "fusedp/parallel/parallel.hpp"
#include "fusedp/train/checkpoint.hpp"

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace fusedp::train {

namespace detail {
template <class Net, class Space, class... P>
void save_checkpoint(const std::string& dir, Parallel<Net, Space, P...>& dp, const TrainingState& state,
                     SaveStop stop) {
  const std::vector<float> full = dp.gather_optimizer_state();  // a collective: before any rank may fail
  std::exception_ptr error;
  if (dp.is_root()) {
    try {
      std::vector<float> staging[3];
      ModelImage image = model_image(dp.model(0), staging);
      image.optimizer_state = full;
      save_image<Net>(dir, image, state, stop);
    } catch (...) {
      error = std::current_exception();
    }
  }
  const bool saved = dp.all_ranks(!error);
  if (error) std::rethrow_exception(error);
  if (!saved)
    throw DataError(dir, "rank 0 could not save the checkpoint (its error names the cause); the previous "
                         "checkpoint in this folder is unchanged");
}
}  // namespace detail

/// Saves a data-parallel run (its parameters, BatchNorm buffers, the whole optimizer state and the
/// step counters) and `state` into the folder `dir`, in the files a Model's checkpoint has. A
/// collective under MPI; rank 0 writes.
template <class Net, class Space, class... P>
void save_checkpoint(const std::string& dir, Parallel<Net, Space, P...>& dp, const TrainingState& state) {
  const trace::Scope span("save checkpoint", trace::Kind::checkpoint);
  detail::save_checkpoint(dir, dp, state, detail::SaveStop::never);
}

/// Loads a checkpoint (written by a Model or by a Parallel of any world size and reduce policy) into
/// every replica of `dp` for training on with `opt`; under ReduceScatter each replica takes its block
/// of the optimizer state. Returns the saved TrainingState. Throws DataError, with no replica changed,
/// when the files do not belong to this run (see load_checkpoint of a Model).
template <class Net, class Space, class... P, class Opt>
TrainingState load_checkpoint(const std::string& dir, Parallel<Net, Space, P...>& dp, const Opt& opt) {
  (void)opt;
  detail::check_model<typename Parallel<Net, Space, P...>::model_type>();
  // Every rank reads and verifies; all of them must succeed, and have read the same checkpoint (a
  // rank that sees another folder, or an older view of it, would train on apart), before any changes.
  detail::LoadedCheckpoint c;
  std::exception_ptr error;
  try {
    c = detail::read_checkpoint<Net, Opt>(dir, dp.model(0).seed());
  } catch (...) {
    error = std::current_exception();
  }
  const bool all_read = dp.all_ranks(!error);
  if (error) std::rethrow_exception(error);
  if (!all_read)
    throw DataError(dir, "another rank could not read this checkpoint (its error names the cause); no replica "
                         "changed");
  fusedp::detail::Fnv1a f;
  f.word(c.state.steps);
  f.word(c.state.optimizer_steps);
  f.word(c.state.samples_done);
  f.word(c.state.epochs_done);
  for (float v : c.params) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    f.word(bits);
  }
  const std::size_t mine = std::size_t(f.h);
  const bool same = dp.agree_steps(mine) == mine && dp.agree_steps(~mine) == ~mine;  // the least and the most
  if (!dp.all_ranks(same))
    throw DataError(dir, "the ranks read different checkpoints from this folder (is it the same folder on every "
                         "machine, and written completely?); no replica changed");
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) detail::store_model(dp.model(r), c);
  dp.template load_optimizer_state<Opt>(c.optimizer_state);
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) dp.model(r).set_step_counters(c.state.steps, c.state.optimizer_steps);
  return c.state;
}

}  // namespace fusedp::train
