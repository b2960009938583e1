#pragma once
// An in-memory dataset: samples (count, C, H, W) as float with a class label or a regression target
// each, checked once when made so that loaders and gathers never read out of bounds.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace fusedp::data {

/// Samples of one split. `images` is (count, channels, height, width) — for non-image data use
/// (count, features, 1, 1) — values as loaded (in [0,1] from the readers). Each sample has either a
/// class label (`labels`, classification) or `target_size` float targets (`targets`, regression).
struct Dataset {
  std::vector<float> images;
  std::vector<std::int32_t> labels;
  std::size_t count = 0;
  std::size_t channels = 0;
  std::size_t height = 0;
  std::size_t width = 0;
  std::size_t classes = 0;
  std::vector<float> targets;    // (count, target_size); empty for classification
  std::size_t target_size = 0;   // 0 for classification

  /// Values per sample (channels x height x width).
  [[nodiscard]] std::size_t sample_size() const noexcept { return channels * height * width; }
  /// True when the samples carry float targets rather than class labels.
  [[nodiscard]] bool regression() const noexcept { return target_size > 0; }
};

enum class Split { train, test };

/// Checks that `ds` is consistent: buffer sizes agree with the count and shape, labels are below
/// `classes`, targets are finite. Throws DataError naming `name` (a path or "in-memory dataset").
inline void validate(const Dataset& ds, const std::string& name) {
  auto fail = [&](const std::string& problem) { throw DataError(name, problem); };
  if (ds.count == 0) fail("holds no samples");
  if (ds.channels == 0 || ds.height == 0 || ds.width == 0)
    fail("sample shape " + std::to_string(ds.channels) + "x" + std::to_string(ds.height) + "x" +
         std::to_string(ds.width) + " has a zero dimension");
  // A shape whose product wraps around would pass the size check below with the wrong sample size.
  if (ds.channels > std::numeric_limits<std::size_t>::max() / ds.height ||
      ds.channels * ds.height > std::numeric_limits<std::size_t>::max() / ds.width)
    fail("sample shape " + std::to_string(ds.channels) + "x" + std::to_string(ds.height) + "x" +
         std::to_string(ds.width) + " has more values than a size_t counts");
  const std::size_t sample = ds.sample_size();
  if (ds.images.size() / sample != ds.count || ds.images.size() % sample != 0)
    fail(std::to_string(ds.images.size()) + " input values are not " + std::to_string(ds.count) + " samples of " +
         std::to_string(sample));
  if (ds.regression()) {
    if (!ds.labels.empty()) fail("has both labels and regression targets");
    if (ds.targets.size() / ds.target_size != ds.count || ds.targets.size() % ds.target_size != 0)
      fail(std::to_string(ds.targets.size()) + " target values are not " + std::to_string(ds.count) +
           " samples of " + std::to_string(ds.target_size));
    for (std::size_t i = 0; i < ds.targets.size(); ++i)
      if (!std::isfinite(ds.targets[i]))
        fail("target " + std::to_string(i % ds.target_size) + " of sample " + std::to_string(i / ds.target_size) +
             " is not finite");
  } else {
    if (!ds.targets.empty()) fail("has " + std::to_string(ds.targets.size()) + " targets but target_size 0");
    if (ds.classes == 0) fail("classes is 0 (a classification dataset needs at least one class)");
    if (ds.labels.size() != ds.count)
      fail(std::to_string(ds.labels.size()) + " labels for " + std::to_string(ds.count) + " samples");
    for (std::size_t i = 0; i < ds.count; ++i)
      if (ds.labels[i] < 0 || std::size_t(ds.labels[i]) >= ds.classes)
        fail("label of sample " + std::to_string(i) + " is " + std::to_string(ds.labels[i]) + ", out of range 0.." +
             std::to_string(ds.classes - 1));
  }
}

/// A classification dataset from arrays already in memory: `images` (count, C, H, W), one label
/// in [0, classes) per sample. Validated (throws DataError naming `name`).
[[nodiscard]] inline Dataset make_dataset(std::vector<float> images, std::vector<std::int32_t> labels,
                                          std::size_t channels, std::size_t height, std::size_t width,
                                          std::size_t classes, const std::string& name = "in-memory dataset") {
  Dataset ds;
  ds.count = labels.size();
  ds.images = std::move(images);
  ds.labels = std::move(labels);
  ds.channels = channels;
  ds.height = height;
  ds.width = width;
  ds.classes = classes;
  validate(ds, name);
  return ds;
}

/// A regression dataset: `inputs` (count, features) and `targets` (count, target_size).
[[nodiscard]] inline Dataset make_regression_dataset(std::vector<float> inputs, std::vector<float> targets,
                                                     std::size_t features, std::size_t target_size,
                                                     const std::string& name = "in-memory dataset") {
  require(features > 0 && target_size > 0, "make_regression_dataset: features and target_size must be > 0");
  Dataset ds;
  ds.count = targets.size() / target_size;
  ds.images = std::move(inputs);
  ds.targets = std::move(targets);
  ds.channels = features;
  ds.height = 1;
  ds.width = 1;
  ds.target_size = target_size;
  validate(ds, name);
  return ds;
}

/// Samples [first, first + n) of `ds` as a new dataset.
[[nodiscard]] inline Dataset subset(const Dataset& ds, std::size_t first, std::size_t n) {
  require(first <= ds.count && n <= ds.count - first, "subset: samples [", first, ", ", first + n, ") of a dataset of ",
          ds.count);
  Dataset out = ds;  // shape fields
  const std::size_t sample = ds.sample_size();
  out.count = n;
  out.images.assign(ds.images.begin() + std::ptrdiff_t(first * sample),
                    ds.images.begin() + std::ptrdiff_t((first + n) * sample));
  if (ds.regression()) {
    out.targets.assign(ds.targets.begin() + std::ptrdiff_t(first * ds.target_size),
                       ds.targets.begin() + std::ptrdiff_t((first + n) * ds.target_size));
  } else {
    out.labels.assign(ds.labels.begin() + std::ptrdiff_t(first), ds.labels.begin() + std::ptrdiff_t(first + n));
  }
  return out;
}

/// Mean and (population) standard deviation of all pixels, accumulated in double.
[[nodiscard]] inline std::pair<float, float> mean_std(const Dataset& ds) {
  require(!ds.images.empty(), "mean_std: the dataset holds no pixels");
  const auto n = static_cast<double>(ds.images.size());
  double sum = 0.0;
  for (float x : ds.images) sum += x;
  const double mean = sum / n;
  // Two passes: the one-pass sum of squares loses digits once the data is already centred.
  double squares = 0.0;
  for (float x : ds.images) squares += (x - mean) * (x - mean);
  return {static_cast<float>(mean), static_cast<float>(std::sqrt(squares / n))};
}

/// Per-channel mean and (population) standard deviation, as the constants of torchvision's
/// Normalize are computed (CIFAR-10: about 0.491, 0.482, 0.447 and 0.247, 0.243, 0.262).
[[nodiscard]] inline std::pair<std::vector<float>, std::vector<float>> channel_mean_std(const Dataset& ds) {
  const std::size_t plane = ds.height * ds.width;
  require(ds.count > 0 && plane > 0 && ds.images.size() == ds.count * ds.channels * plane,
          "channel_mean_std: the dataset holds no pixels or its buffer does not match its shape");
  std::vector<float> mean(ds.channels), stddev(ds.channels);
  const double n = double(ds.count) * double(plane);
  for (std::size_t c = 0; c < ds.channels; ++c) {
    double sum = 0.0;
    for (std::size_t i = 0; i < ds.count; ++i) {
      const float* p = ds.images.data() + (i * ds.channels + c) * plane;
      for (std::size_t k = 0; k < plane; ++k) sum += p[k];
    }
    const double m = sum / n;
    double squares = 0.0;
    for (std::size_t i = 0; i < ds.count; ++i) {
      const float* p = ds.images.data() + (i * ds.channels + c) * plane;
      for (std::size_t k = 0; k < plane; ++k) squares += (p[k] - m) * (p[k] - m);
    }
    mean[c] = float(m);
    stddev[c] = float(std::sqrt(squares / n));
  }
  return {mean, stddev};
}

/// Replaces every pixel x by (x - mean) / stddev, as torchvision's Normalize does.
inline void normalize(Dataset& ds, float mean, float stddev) {
  require(std::isfinite(mean), "normalize: mean must be finite, got ", mean);
  require(std::isfinite(stddev) && stddev > 0.0f, "normalize: stddev must be finite and > 0, got ", stddev);
  // Divide rather than multiply by 1/stddev, so results match torchvision's bit for bit.
  for (float& x : ds.images) x = (x - mean) / stddev;
}

}  // namespace fusedp::data
