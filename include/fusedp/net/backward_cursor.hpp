#pragma once
// BackwardCursor: where each step of backward reads its gradient and writes the one it passes down,
// which scratch it uses, and, where a step's weight-gradient GEMM runs on a side stream beside the
// next step (exec/cuda_branch.hpp), when that branch is waited for and when its stages are reported.
//
// In order (no side stream), two gradient buffers alternate and every step uses the one scratch: each
// step's kernels follow the previous step's on one stream.
//
// Branched, step s reads buffer s mod 3 and writes s+1 mod 3, with scratch half s mod 2. A step that
// forks its weight gradient W_s leaves it running while the next step s+1 runs on the model's stream:
// s+1 writes buffer s+2 and scratch half s+1, neither of which W_s reads (it reads buffer s, the
// stored activations and half s, and writes only its own layer's weights, gradients and optimizer
// state). Once step s+1 is queued, the model's stream waits for W_s: the step after, s+2, writes
// buffer s mod 3 and half s mod 2 again. The side stream runs its weight gradients one after the
// other, and each is marked under its own slot (s mod 2), so waiting for W_s does not wait for W_s+1.
//
// Stages are reported (`on_stage_done(i)`: a reducer may start a bucket after it) only once the model's
// stream has waited for their weight gradients, in the order the steps reported them.
//
// The caller says before it queues a step that the step forks (will_fork); the cursor then refuses a
// step_done, or a stage reported before the step_branched that marks the fork (std::logic_error): a
// fork nobody waits for, or a reducer started before its weights' gradients, cannot pass silently. If
// backward throws midway, the destructor still makes the model's stream wait for the branch. No CUDA here:
// Side is anything with mark(slot) and join(slot) (tests/net/backward_cursor.cpp checks the protocol on
// the CPU with a model of two streams).
#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace fusedp {

/// The gradient buffers, scratch and branch joins of one backward pass.
/// @tparam T the value type of the buffers
/// @tparam Side mark(int slot): marks what the side stream has queued so far; join(int slot): makes the
///         model's stream wait for what slot marked
/// @tparam StageDone callable with a stage index
template <class T, class Side, class StageDone>
class BackwardCursor {
 public:
  /// `buffers`: three gradient buffers where `side` is not null, else the first two; gradient 0 holds
  /// the loss's gradient. `scratch`: two halves of `scratch_stride` elements where `side` is not null.
  BackwardCursor(std::array<T*, 3> buffers, T* scratch, std::size_t scratch_stride, const Side* side,
                 StageDone& on_stage_done) noexcept
      : buffers_(buffers), scratch_(scratch), stride_(scratch_stride), side_(side), done_(on_stage_done) {}
  BackwardCursor(const BackwardCursor&) = delete;
  BackwardCursor& operator=(const BackwardCursor&) = delete;
  /// Waits for a branch still pending (backward threw before finish), and for a fork not yet marked
  /// (it threw between will_fork and step_branched): nothing queued later on the model's stream may
  /// overtake them, and a graph being recorded ends with the side stream joined.
  ~BackwardCursor() {
    if (!pending_ && !forking_) return;
    try {
      if (forking_) {
        side_->mark(int(steps_ % 2));
        side_->join(int(steps_ % 2));  // after everything the side stream holds, the pending branch too
      } else {
        side_->join(pending_slot_);
      }
    } catch (...) {  // already unwinding from the error that matters
    }
  }

  /// Whether steps may fork their weight gradients onto the side stream.
  [[nodiscard]] const Side* side() const noexcept { return side_; }
  /// The gradient the current step reads.
  [[nodiscard]] T* dy() const noexcept { return buffers_[current_]; }
  /// Where the current step writes the gradient it passes down.
  [[nodiscard]] T* dx() const noexcept { return buffers_[next()]; }
  /// The current step's scratch.
  [[nodiscard]] T* scratch() const noexcept {
    return side_ != nullptr ? scratch_ + std::size_t(steps_ % 2) * stride_ : scratch_;
  }
  /// Steps queued so far.
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }

  /// The current step is about to fork its weight gradient onto the side stream: it must end with
  /// step_branched.
  void will_fork() {
    if (side_ == nullptr) fail("will_fork without a side stream");
    forking_ = true;
  }

  /// Stage `i`'s gradients are queued (the StageDone of StageBinding::backward_stage_between): told on
  /// at once, unless a branch is still to be waited for; then held until it is.
  void operator()(std::size_t i) {
    if (forking_) fail("a stage reported before its forked step was marked (step_branched)");
    if (!pending_) {
      done_(i);
      return;
    }
    if (held_count_ == held_.size()) flush();  // early, so only less concurrent: still in order
    if (pending_) held_[held_count_++] = i;
    else done_(i);
  }

  /// The current step is queued, all of it on the model's stream: waits for an earlier branch and
  /// reports its stages, then moves to the next step.
  void step_done() {
    if (forking_) fail("step_done after will_fork: the fork would never be waited for");
    flush();
    advance();
  }
  /// The current step is queued with its weight gradient forked onto the side stream: marks it, waits
  /// for an earlier branch, and moves on; the stages reported after this (the step's own) are held
  /// until the next step is queued.
  void step_branched() {
    if (!forking_) fail("step_branched without will_fork");
    forking_ = false;
    const int slot = int(steps_ % 2);
    side_->mark(slot);
    flush();
    pending_ = true;
    pending_slot_ = slot;
    advance();
  }
  /// Backward is queued: waits for the last branch and reports what is held.
  void finish() {
    if (forking_) fail("finish after will_fork without step_branched");
    flush();
  }

 private:
  [[noreturn]] static void fail(const char* what) { throw std::logic_error(std::string("fusedp::BackwardCursor: ") + what); }
  [[nodiscard]] int count() const noexcept { return side_ != nullptr ? 3 : 2; }
  [[nodiscard]] int next() const noexcept { return (current_ + 1) % count(); }
  void advance() noexcept {
    current_ = next();
    ++steps_;
  }
  void flush() {
    if (!pending_) return;
    side_->join(pending_slot_);
    pending_ = false;
    const std::size_t n = held_count_;
    held_count_ = 0;
    for (std::size_t k = 0; k < n; ++k) done_(held_[k]);
  }

  std::array<T*, 3> buffers_;
  T* scratch_;
  std::size_t stride_;
  const Side* side_;
  StageDone& done_;
  int current_ = 0;
  std::size_t steps_ = 0;
  bool pending_ = false;
  bool forking_ = false;
  int pending_slot_ = 0;
  std::array<std::size_t, 16> held_{};
  std::size_t held_count_ = 0;
};

}  // namespace fusedp
