// Tests of include/fusedp/train/progress.hpp: the progress line of a run whose output is not a terminal
// (a log file): a line each tenth of the epoch and at its end, and reports outside an epoch's steps.
#include "fusedp/train/progress.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <string>

namespace {
namespace ft = fusedp::train;

// What `f` wrote to a temporary file (not a terminal, so one line per report).
template <class F>
std::string written(F&& f) {
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  f(out);
  std::rewind(out);
  std::string text;
  for (int c; (c = std::fgetc(out)) != EOF;) text += char(c);
  std::fclose(out);
  return text;
}

std::size_t lines(const std::string& s) {
  std::size_t n = 0;
  for (char c : s) n += c == '\n' ? 1 : 0;
  return n;
}
}  // namespace

TEST_CASE("a log gets a line each tenth of the epoch and at its end") {
  const std::string log = written([](std::FILE* out) {
    ft::ProgressLine p{out};
    p.start_epoch(1, 3, 100);
    for (std::size_t s = 1; s <= 100; ++s) p.update(s, 0.5, s * 8);
  });
  CHECK(lines(log) == 10);
  CHECK(log.find("epoch 1/3  step 10/100") != std::string::npos);
  CHECK(log.find("step 100/100") != std::string::npos);
  CHECK(log.find("ETA 0s\n") != std::string::npos);
}

TEST_CASE("reports outside an epoch's steps return, as the epoch's last line") {
  // An epoch of 0 steps, or no start_epoch: the tenths loop never ended.
  const std::string none = written([](std::FILE* out) {
    ft::ProgressLine p{out};
    p.update(1, 0.0, 0);
    p.start_epoch(2, 2, 0);
    p.update(0, 0.0, 0);
  });
  CHECK(lines(none) == 2);
  // Past the end: the ETA is 0, not the wrapped count of steps left.
  const std::string past = written([](std::FILE* out) {
    ft::ProgressLine p{out};
    p.start_epoch(1, 1, 4);
    p.update(5, 0.25, 40);
  });
  CHECK(past.find("step 5/4") != std::string::npos);
  CHECK(past.find("ETA 0s") != std::string::npos);
}
