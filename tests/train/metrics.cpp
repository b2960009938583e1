// Tests of include/fusedp/train/metrics.hpp: JSON lines, and continuing the file of a resumed run.
#include "fusedp/train/metrics.hpp"

#include "../data/temp_dir.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>

namespace {
namespace ft = fusedp::train;
using fusedp_test::TempDir;

std::string text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
}  // namespace

TEST_CASE("one JSON object per line; NaN becomes null; strings are escaped") {
  TempDir dir("fusedp_metrics");
  const std::string path = dir.file("m.jsonl");
  {
    ft::MetricsWriter w{path};
    CHECK(w.enabled());
    w.write({{"epoch", 1LL}, {"loss", 0.5}, {"bad", std::nan("")}, {"name", std::string("a\"b\n")}});
  }
  CHECK(text(path) == "{\"epoch\": 1, \"loss\": 0.5, \"bad\": null, \"name\": \"a\\\"b\\u000a\"}\n");
  ft::MetricsWriter off;
  CHECK_FALSE(off.enabled());
  off.write({{"epoch", 1LL}});  // does nothing
  CHECK_THROWS_AS(ft::MetricsWriter(dir.file("no/such/folder/m.jsonl")), fusedp::DataError);
}

TEST_CASE("resume keeps the epochs a checkpoint holds and drops later ones") {
  TempDir dir("fusedp_metrics");
  const std::string path = dir.file("m.jsonl");
  {
    ft::MetricsWriter w{path};
    w.write({{"run", std::string("lenet")}});
    for (long long e = 1; e <= 12; ++e) w.write({{"epoch", e}, {"loss", 1.0 / double(e)}});
  }
  {
    // the checkpoint was taken after epoch 10; epochs 11 and 12 are trained again
    ft::MetricsWriter w = ft::MetricsWriter::resume(path, 10);
    w.write({{"epoch", 11LL}, {"loss", 0.25}});
  }
  const std::string t = text(path);
  CHECK(t.find("{\"run\": \"lenet\"}\n{\"epoch\": 1, ") == 0);
  CHECK(t.find("{\"epoch\": 10, ") != std::string::npos);
  CHECK(t.find("{\"epoch\": 12") == std::string::npos);
  CHECK(t.find("{\"epoch\": 11, \"loss\": 0.25}\n") != std::string::npos);
  CHECK(t.find("{\"epoch\": 11, \"loss\": 0.0909") == std::string::npos);
  // a missing file starts empty
  ft::MetricsWriter fresh = ft::MetricsWriter::resume(dir.file("new.jsonl"), 3);
  fresh.write({{"epoch", 4LL}});
  CHECK(text(dir.file("new.jsonl")) == "{\"epoch\": 4}\n");
}

TEST_CASE("resume drops a last line the interrupted run did not finish") {
  TempDir dir("fusedp_metrics");
  const std::string path = dir.file("m.jsonl");
  const auto resumed = [&](const std::string& before) {
    std::ofstream(path, std::ios::binary) << before;
    ft::MetricsWriter w = ft::MetricsWriter::resume(path, 11);
    w.write({{"epoch", 12LL}});
    return text(path);
  };
  // Torn in the middle of its epoch number, or of the key, or after the epoch it names: no newline.
  CHECK(resumed("{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 1") == "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 12}\n");
  CHECK(resumed("{\"epoch\": 1, \"loss\": 1}\n{\"epo") == "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 12}\n");
  CHECK(resumed("{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 2, \"lo") == "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 12}\n");
  // The zeros a lost write leaves.
  CHECK(resumed(std::string("{\"epoch\": 1, \"loss\": 1}\n") + std::string(6, '\0') + "\n") ==
        "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 12}\n");
  // A finished last line stays.
  CHECK(resumed("{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 2, \"loss\": 0.5}\n") ==
        "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 2, \"loss\": 0.5}\n{\"epoch\": 12}\n");
}
