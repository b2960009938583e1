#pragma once
// Reader for the CIFAR-10 binary batches (https://www.cs.toronto.edu/~kriz/cifar.html): data_batch_1.bin
// .. data_batch_5.bin (training) and test_batch.bin, each a sequence of 3073-byte records: one label
// byte (0..9), then 1024 red, 1024 green and 1024 blue bytes of a 32x32 image in row-major order —
// already CHW, so a record becomes one NCHW sample as it is.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/data/dataset.hpp"

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

namespace fusedp::data {

inline constexpr std::size_t cifar10_side = 32;
inline constexpr std::size_t cifar10_channels = 3;
inline constexpr std::size_t cifar10_classes = 10;
/// Bytes of one record: the label and 3 x 32 x 32 pixels.
inline constexpr std::size_t cifar10_record_bytes = 1 + cifar10_channels * cifar10_side * cifar10_side;
/// Where the binary batches come from (a 162 MB archive holding the folder cifar-10-batches-bin).
inline constexpr const char* cifar10_url = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";
/// Largest batch file accepted: a standard one holds 10000 records (30.7 MB); this is 100 times that.
inline constexpr std::uintmax_t cifar10_max_file_bytes = std::uintmax_t{cifar10_record_bytes} * 1'000'000;

/// Class names in label order.
inline constexpr std::array<const char*, 10> cifar10_class_names = {
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"};

namespace detail {
struct FileCloser {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};
}  // namespace detail

/// Appends the records of one CIFAR-10 binary batch to `out` (3 x 32 x 32, pixels scaled to [0,1],
/// labels 0..9). Throws DataError naming the file for a missing, empty, truncated or oversized file
/// and for a label above 9; `out` is unchanged then.
inline void append_cifar10_batch(const std::string& path, Dataset& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw DataError(path, "file does not exist");
  if (!fs::is_regular_file(status)) throw DataError(path, "is not a regular file (expected a CIFAR-10 binary batch)");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) throw DataError(path, "cannot read the file size: " + ec.message());
  if (size == 0) throw DataError(path, "file is empty (a CIFAR-10 binary batch holds 3073-byte records)");
  if (size % cifar10_record_bytes != 0)
    throw DataError(path, "size " + std::to_string(size) + " bytes is not a multiple of the 3073-byte CIFAR-10 record "
                          "(1 label byte + 3072 pixel bytes): " + std::to_string(size / cifar10_record_bytes) +
                          " whole records and " + std::to_string(size % cifar10_record_bytes) +
                          " bytes left over; the file is truncated or not a CIFAR-10 binary batch");
  if (size > cifar10_max_file_bytes)
    throw DataError(path, "size " + std::to_string(size) + " bytes is larger than any CIFAR-10 batch (limit " +
                          std::to_string(cifar10_max_file_bytes) + ")");
  const auto records = static_cast<std::size_t>(size / cifar10_record_bytes);

  std::unique_ptr<std::FILE, detail::FileCloser> file{std::fopen(path.c_str(), "rb")};
  if (!file) {
    const int err = errno;
    throw DataError(path, "cannot open file: " + std::generic_category().message(err));
  }
  // Read and check everything before `out` changes, one record at a time into a staging buffer.
  constexpr std::size_t pixels = cifar10_record_bytes - 1;
  std::vector<float> images(records * pixels);
  std::vector<std::int32_t> labels(records);
  std::array<std::uint8_t, cifar10_record_bytes> record{};
  for (std::size_t r = 0; r < records; ++r) {
    const std::size_t got = std::fread(record.data(), 1, record.size(), file.get());
    if (got != record.size()) {
      // The size was checked, so only a file changing under us or an I/O error gets here.
      const int err = std::ferror(file.get()) ? errno : 0;
      throw DataError(path, "read failed at record " + std::to_string(r) + " (byte " +
                                std::to_string(r * cifar10_record_bytes + got) + ")" +
                                (err ? ": " + std::generic_category().message(err) : ": file shrank while reading"));
    }
    if (record[0] >= cifar10_classes)
      throw DataError(path, "record " + std::to_string(r) + " (byte offset " + std::to_string(r * cifar10_record_bytes) +
                                ") has label " + std::to_string(record[0]) + "; CIFAR-10 labels are 0..9");
    labels[r] = record[0];
    float* dst = images.data() + r * pixels;
    // Divide (not multiply by 1/255): the same floats as torchvision's ToTensor.
    for (std::size_t i = 0; i < pixels; ++i) dst[i] = static_cast<float>(record[1 + i]) / 255.0f;
  }
  if (out.count == 0) {
    out.images = std::move(images);
    out.labels = std::move(labels);
  } else {
    out.images.insert(out.images.end(), images.begin(), images.end());
    out.labels.insert(out.labels.end(), labels.begin(), labels.end());
  }
  out.count += records;
  out.channels = cifar10_channels;
  out.height = cifar10_side;
  out.width = cifar10_side;
  out.classes = cifar10_classes;
}

/// Reads one CIFAR-10 binary batch file into a Dataset.
[[nodiscard]] inline Dataset read_cifar10_batch(const std::string& path) {
  Dataset ds;
  append_cifar10_batch(path, ds);
  return ds;
}

/// The file names of a split: data_batch_1.bin .. data_batch_5.bin, or test_batch.bin.
[[nodiscard]] inline std::vector<std::string> cifar10_files(Split split) {
  if (split == Split::test) return {"test_batch.bin"};
  std::vector<std::string> names;
  for (int i = 1; i <= 5; ++i) names.push_back("data_batch_" + std::to_string(i) + ".bin");
  return names;
}

/// Loads the train (50000 images from the five data batches) or test (10000) split from `dir`, which
/// holds the binary batches, or the folder cifar-10-batches-bin that the archive extracts to. Every
/// file of the split must be there; a missing one is an error listing what was looked for.
[[nodiscard]] inline Dataset load_cifar10(const std::string& dir, Split split) {
  namespace fs = std::filesystem;
  const std::vector<std::string> names = cifar10_files(split);
  std::string looked_for;
  for (const std::string& n : names) looked_for += (looked_for.empty() ? "" : ", ") + n;
  const std::string hint = " (download " + std::string(cifar10_url) + " and extract it)";

  std::error_code ec;
  const auto status = fs::status(dir, ec);
  if (!fs::exists(status)) throw DataError(dir, "CIFAR-10 folder does not exist (looked for " + looked_for + ")" + hint);
  if (!fs::is_directory(status))
    throw DataError(dir, "is not a folder (expected a folder holding " + looked_for + ")" + hint);

  // The files themselves, or the archive's folder inside `dir`.
  fs::path base = dir;
  auto has_all = [&](const fs::path& p) {
    for (const std::string& n : names)
      if (std::error_code e; !fs::exists(p / n, e)) return false;
    return true;
  };
  if (!has_all(base) && has_all(base / "cifar-10-batches-bin")) base /= "cifar-10-batches-bin";
  std::string missing;
  for (const std::string& n : names)
    if (std::error_code e; !fs::exists(base / n, e)) missing += (missing.empty() ? "" : ", ") + n;
  if (!missing.empty())
    throw DataError(dir, "missing CIFAR-10 " + std::string(split == Split::train ? "training" : "test") +
                             " batches: " + missing + " (looked in " + dir + " and in " +
                             (fs::path(dir) / "cifar-10-batches-bin").string() + ")" + hint);

  Dataset ds;
  for (const std::string& n : names) append_cifar10_batch((base / n).string(), ds);
  return ds;
}

}  // namespace fusedp::data
