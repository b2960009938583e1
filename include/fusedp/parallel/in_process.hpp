#pragma once
// Replicas in one process as ranks of a communicator (Host memory): InProcessGroup is what they share,
// InProcessCommunicator one replica's end of it, with the collectives of MpiCommunicator. Each replica
// runs on its own thread; a collective is a rendezvous of all of them: every replica publishes its
// buffer, then each sums (or copies) its own slice of the elements over all buffers, in rank order,
// and writes the result where it belongs; a second rendezvous ends it. The sums are therefore the same
// bits as a sum in rank order from 0, whatever the number of replicas.
//
// A replica that fails (an exception) breaks the group: replicas waiting in a collective, or arriving
// later, throw DeviceError instead of waiting forever; reset() mends it for the next step.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/kernels/bf16.hpp"
#include "fusedp/parallel/shards.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace fusedp::parallel {

/// What the replicas of one process share: a reusable rendezvous and the buffers they publish.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size) : size_(size), published_(std::size_t(size), nullptr) {
    require(size >= 1, "InProcessGroup: size must be >= 1, got ", size);
  }
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  [[nodiscard]] int size() const noexcept { return size_; }

  /// Waits until every replica has arrived (the arrival of the last one releases all).
  void arrive_and_wait() {
    std::unique_lock lock(mutex_);
    check_broken();
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || broken_; });
    if (generation_ == generation) check_broken();
  }
  /// Wakes every waiting replica with an error: one of them failed and will not arrive.
  void break_all() noexcept {
    std::lock_guard lock(mutex_);
    broken_ = true;
    cv_.notify_all();
  }
  /// Mends a broken group before the next step (no replica may be inside a collective).
  void reset() noexcept {
    std::lock_guard lock(mutex_);
    broken_ = false;
    arrived_ = 0;
  }

  void publish(int rank, void* data) noexcept { published_[std::size_t(rank)] = data; }
  template <class T>
  [[nodiscard]] T* buffer_of(int rank) const noexcept {
    return static_cast<T*>(published_[std::size_t(rank)]);
  }

 private:
  void check_broken() const {
    if (broken_)
      throw DeviceError("Parallel: in-process collective", 0, "another replica of this process failed during the step");
  }

  int size_;
  std::vector<void*> published_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool broken_ = false;
};

/// One replica's end of an InProcessGroup: collectives over the replicas of this process, on host
/// memory, every one of them called by every replica with the same arguments (but its own buffers).
class InProcessCommunicator {
 public:
  InProcessCommunicator(InProcessGroup& group, int rank) : group_(&group), rank_(rank) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return group_->size(); }

  /// Sums `n` values of every replica into `data` in place, in rank order: every replica gets the same bits.
  template <class T>
  void all_reduce_sum(T* data, std::size_t n) {
    exchange(data, [&](std::size_t i0, std::size_t i1) {
      for (std::size_t i = i0; i < i1; ++i) {
        T s = T(0);
        for (int r = 0; r < size(); ++r) s += group_->buffer_of<T>(r)[i];
        for (int r = 0; r < size(); ++r) group_->buffer_of<T>(r)[i] = s;
      }
    }, n);
  }
  /// Sums bf16 values (stored as uint16) in place, in rank order, rounding each partial sum.
  void all_reduce_sum_bf16(std::uint16_t* data, std::size_t n) {
    exchange(data, [&](std::size_t i0, std::size_t i1) {
      for (std::size_t i = i0; i < i1; ++i) {
        std::uint16_t s = group_->buffer_of<std::uint16_t>(0)[i];
        for (int r = 1; r < size(); ++r)
          s = kernels::to_bf16(kernels::from_bf16(s) + kernels::from_bf16(group_->buffer_of<std::uint16_t>(r)[i]));
        for (int r = 0; r < size(); ++r) group_->buffer_of<std::uint16_t>(r)[i] = s;
      }
    }, n);
  }
  /// The rank-order sum of every replica's `n` values into `data` of `root`; the others' data is unchanged.
  template <class T>
  void reduce_sum(T* data, std::size_t n, int root) {
    exchange(data, [&](std::size_t i0, std::size_t i1) {
      T* out = group_->buffer_of<T>(root);
      for (std::size_t i = i0; i < i1; ++i) {
        T s = T(0);
        for (int r = 0; r < size(); ++r) s += group_->buffer_of<T>(r)[i];
        out[i] = s;
      }
    }, n);
  }
  /// `root`'s `n` values into every replica's `data`.
  template <class T>
  void broadcast(T* data, std::size_t n, int root) {
    exchange(data, [&](std::size_t i0, std::size_t i1) {
      const T* from = group_->buffer_of<T>(root);
      for (int r = 0; r < size(); ++r)
        if (r != root) std::copy(from + i0, from + i1, group_->buffer_of<T>(r) + i0);
    }, n);
  }
  /// Every replica's `n` values, in rank order, into `all` (size() x n) of every replica.
  template <class T>
  void all_gather(const T* mine, T* all, std::size_t n) {
    T* own = all + n * std::size_t(rank_);
    if (own != mine) std::copy(mine, mine + n, own);
    exchange(all, [&](std::size_t, std::size_t) {
      // Replica r copies its own row into every other replica's `all`.
      const T* row = all + n * std::size_t(rank_);
      for (int r = 0; r < size(); ++r)
        if (r != rank_) std::copy(row, row + n, group_->buffer_of<T>(r) + n * std::size_t(rank_));
    }, n);
  }
  /// ZeRO-1: the rank-order sum of block r of every replica's `data` into replica r's block (in place);
  /// the rest of `data` keeps this replica's own values.
  void reduce_scatter_sum(float* data, const ZeroLayout& layout) {
    publish_and_wait(data);
    const Shard b = layout.block(std::size_t(rank_));
    for (std::size_t i = b.offset; i < b.offset + b.count; ++i) {
      float s = 0;
      for (int r = 0; r < size(); ++r) s += group_->buffer_of<float>(r)[i];
      scratch_.push_back(s);
    }
    group_->arrive_and_wait();  // every replica has read every block before any block is written
    std::copy(scratch_.begin(), scratch_.end(), data + b.offset);
    scratch_.clear();
  }
  /// ZeRO-1: every replica's block of `data` into every other replica's `data`.
  void all_gather_blocks(float* data, const ZeroLayout& layout) {
    publish_and_wait(data);
    const Shard b = layout.block(std::size_t(rank_));
    for (int r = 0; r < size(); ++r)
      if (r != rank_) std::copy(data + b.offset, data + b.offset + b.count, group_->buffer_of<float>(r) + b.offset);
    group_->arrive_and_wait();
  }

 private:
  void publish_and_wait(void* data) {
    group_->publish(rank_, data);
    group_->arrive_and_wait();
  }
  // Publishes `data`, runs `slice(i0, i1)` on this replica's share of [0, n) once every replica has
  // published, and waits until every replica is done.
  template <class Slice>
  void exchange(void* data, Slice&& slice, std::size_t n) {
    publish_and_wait(data);
    const auto w = std::size_t(size()), r = std::size_t(rank_);
    slice(n * r / w, n * (r + 1) / w);
    group_->arrive_and_wait();
  }

  InProcessGroup* group_;
  int rank_;
  std::vector<float> scratch_;  // reduce_scatter_sum: this replica's block, summed
};

}  // namespace fusedp::parallel
