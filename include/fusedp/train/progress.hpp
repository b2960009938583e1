#pragma once
// A progress line for training loops: on a terminal one line updated in place (at most every 100 ms),
// elsewhere (a log file, CI) a plain line at each tenth of the epoch.
#include "fusedp/core/config.hpp"

#include <chrono>
#include <cstdio>
#include <string>
#include <unistd.h>

namespace fusedp::train {

class ProgressLine {
 public:
  using clock = std::chrono::steady_clock;

  /// @param unit what the rate counts ("images" per second; "samples" for non-image data)
  explicit ProgressLine(std::FILE* out = stdout, const char* unit = "images")
      : out_(out), unit_(unit), terminal_(isatty(fileno(out)) != 0) {}

  /// Starts an epoch of `steps` steps.
  void start_epoch(std::size_t epoch, std::size_t epochs, std::size_t steps) {
    epoch_ = epoch;
    epochs_ = epochs;
    steps_ = steps;
    next_tenth_ = 1;
    start_ = last_ = clock::now();
  }

  /// Reports step `done` (1-based) with the running mean loss and the samples seen this epoch.
  void update(std::size_t done, double loss, std::size_t samples) {
    const auto now = clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    // Past the epoch's steps (an epoch of 0 steps, or no start_epoch) every report is the last one.
    const bool finished = done >= steps_;
    if (terminal_) {
      if (!finished && now - last_ < std::chrono::milliseconds(100)) return;
    } else {
      if (done * 10 < next_tenth_ * steps_ && !finished) return;
      while (steps_ > 0 && next_tenth_ * steps_ <= done * 10) ++next_tenth_;
    }
    last_ = now;
    const double rate = elapsed > 0 ? double(samples) / elapsed : 0.0;
    const double eta = done > 0 && !finished ? elapsed * double(steps_ - done) / double(done) : 0.0;
    std::fprintf(out_, "%sepoch %zu/%zu  step %zu/%zu  loss %.4f  %.0f %s/s  ETA %.0fs%s", terminal_ ? "\r\033[K" : "",
                 epoch_, epochs_, done, steps_, loss, rate, unit_, eta, terminal_ ? "" : "\n");
    std::fflush(out_);
  }

  /// Ends the epoch's line (on a terminal) with a final message.
  void finish(const std::string& message) {
    std::fprintf(out_, "%s%s\n", terminal_ ? "\r\033[K" : "", message.c_str());
    std::fflush(out_);
  }

 private:
  std::FILE* out_;
  const char* unit_;
  bool terminal_;
  std::size_t epoch_ = 0, epochs_ = 0, steps_ = 0, next_tenth_ = 1;
  clock::time_point start_, last_;
};

}  // namespace fusedp::train
