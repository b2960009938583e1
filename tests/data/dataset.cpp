// Tests of include/fusedp/data/dataset.hpp: in-memory datasets (classification and regression), their
// validation, subsets and per-channel statistics.
#include "fusedp/data/dataset.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {
using fusedp::DataError;
using fusedp::data::Dataset;
}  // namespace

TEST_CASE("make_dataset holds arrays already in memory and checks them") {
  const Dataset ds = fusedp::data::make_dataset(std::vector<float>(4 * 2 * 3 * 3, 0.5f), {0, 1, 2, 1}, 2, 3, 3, 3);
  CHECK(ds.count == 4);
  CHECK(ds.sample_size() == 18);
  CHECK_FALSE(ds.regression());

  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(10), {0, 1}, 1, 2, 3, 2),
                       "in-memory dataset: 10 input values are not 2 samples of 6", DataError);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(12), {0, 2}, 1, 2, 3, 2, "mine"),
                       "mine: label of sample 1 is 2, out of range 0..1", DataError);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(6), {-1}, 1, 2, 3, 2),
                       doctest::Contains("is -1, out of range"), DataError);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset({}, {}, 1, 2, 3, 2), doctest::Contains("holds no samples"),
                       DataError);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(6), {0}, 1, 2, 3, 0),
                       doctest::Contains("classes is 0"), DataError);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(6), {0}, 0, 2, 3, 2),
                       doctest::Contains("has a zero dimension"), DataError);
  // Shapes whose product wraps around: to 0 (a division by zero), or to 4, which 4 values matched.
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_dataset(std::vector<float>(4), {0}, std::size_t(1) << 62, 4, 1, 2),
                       doctest::Contains("has more values than a size_t counts"), DataError);
  CHECK_THROWS_WITH_AS(
      (void)fusedp::data::make_dataset(std::vector<float>(4), {0}, (std::size_t(1) << 63) + 1, 2, 2, 2),
      doctest::Contains("has more values than a size_t counts"), DataError);
}

TEST_CASE("make_regression_dataset: float targets, checked finite") {
  const Dataset ds = fusedp::data::make_regression_dataset({0, 1, 2, 3, 4, 5}, {0.5f, -1.0f, 2.0f}, 2, 1);
  CHECK(ds.count == 3);
  CHECK(ds.regression());
  CHECK(ds.sample_size() == 2);
  CHECK_THROWS_WITH_AS((void)fusedp::data::make_regression_dataset({0, 1, 2, 3}, {0.5f, -1.0f, 2.0f}, 2, 1),
                       doctest::Contains("4 input values are not 3 samples of 2"), DataError);
  CHECK_THROWS_WITH_AS(
      (void)fusedp::data::make_regression_dataset({0, 1}, {std::numeric_limits<float>::quiet_NaN()}, 2, 1),
      doctest::Contains("target 0 of sample 0 is not finite"), DataError);
}

TEST_CASE("subset copies a range of samples") {
  const Dataset ds = fusedp::data::make_dataset({0, 1, 2, 3, 4, 5}, {0, 1, 0}, 2, 1, 1, 2);
  const Dataset s = fusedp::data::subset(ds, 1, 2);
  CHECK(s.count == 2);
  CHECK(s.images == std::vector<float>{2, 3, 4, 5});
  CHECK(s.labels == std::vector<std::int32_t>{1, 0});
  CHECK_THROWS_AS((void)fusedp::data::subset(ds, 2, 2), fusedp::InvalidArgument);
}

TEST_CASE("channel_mean_std gives each channel's mean and population deviation") {
  // two samples, channel 0 all 1 and 3, channel 1 values 0,2,4,6
  const Dataset ds = fusedp::data::make_dataset({1, 1, 0, 2, 3, 3, 4, 6}, {0, 0}, 2, 1, 2, 1);
  const auto [mean, stddev] = fusedp::data::channel_mean_std(ds);
  REQUIRE(mean.size() == 2);
  CHECK(mean[0] == doctest::Approx(2.0));
  CHECK(stddev[0] == doctest::Approx(1.0));
  CHECK(mean[1] == doctest::Approx(3.0));
  CHECK(stddev[1] == doctest::Approx(std::sqrt(5.0)));
}
