#pragma once
// Reader for IDX files (MNIST, Fashion-MNIST), plain or gzip-compressed, and the image/label dataset they form
// (Dataset, mean_std and normalize live in dataset.hpp, included here).
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/data/dataset.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace fusedp::data {

/// Largest payload `read_idx` accepts. A header is untrusted input: without a cap, four bytes of
/// dimensions could ask for exabytes. 4 GiB is 90 times the MNIST training images.
inline constexpr std::uint64_t idx_max_payload_bytes = std::uint64_t{1} << 32;

/// The contents of one IDX file of unsigned bytes: its dimensions, outermost first, and the payload
/// in row-major order (`data.size()` is the product of `dims`).
struct IdxArray {
  std::vector<std::size_t> dims;
  std::vector<std::uint8_t> data;
};

namespace detail {

struct GzCloser {
  void operator()(gzFile_s* f) const noexcept { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// zlib prefixes its messages with the path it was opened with; DataError adds the path already.
inline std::string zlib_message(gzFile f, const std::string& path, int* code) {
  std::string message = gzerror(f, code);
  const std::string prefix = path + ": ";
  if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  return message;
}

// Turns a pending zlib error into a DataError. Called after every read, because gzread reports a
// truncated gzip stream (Z_BUF_ERROR) only through gzerror, returning what it decoded so far.
inline void check_gz(gzFile f, const std::string& path) {
  int code = Z_OK;
  const std::string message = zlib_message(f, path, &code);
  switch (code) {
    case Z_OK:
      return;
    case Z_BUF_ERROR:
      throw DataError(path, "gzip stream is truncated (zlib: " + message + ")");
    case Z_DATA_ERROR:
      throw DataError(path, "gzip data is corrupt (zlib: " + message + ")");
    case Z_MEM_ERROR:
      throw DataError(path, "out of memory while decompressing gzip data");
    case Z_ERRNO: {
      const int err = errno;
      throw DataError(path, "read failed: " + std::generic_category().message(err));
    }
    default:
      throw DataError(path, "read failed (zlib error " + std::to_string(code) + ": " + message + ")");
  }
}

// Reads up to `n` bytes into `dst`; fewer only at the end of the data.
inline std::size_t read_some(gzFile f, std::uint8_t* dst, std::size_t n, const std::string& path) {
  constexpr std::size_t step = std::size_t{1} << 20;  // gzread takes an unsigned and returns an int
  std::size_t done = 0;
  while (done < n) {
    const auto ask = static_cast<unsigned>(std::min(n - done, step));
    const int got = gzread(f, dst + done, ask);
    check_gz(f, path);
    if (got < 0) throw DataError(path, "read failed (gzread returned " + std::to_string(got) + ")");
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  check_gz(f, path);
  return done;
}

inline std::uint32_t big_endian_u32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

inline std::string hex_byte(unsigned value) {
  constexpr char digits[] = "0123456789ABCDEF";
  return std::string("0x") + digits[(value >> 4) & 0xF] + digits[value & 0xF];
}

inline const char* idx_type_name(unsigned type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return nullptr;
  }
}

inline std::string join_dims(const std::vector<std::size_t>& dims) {
  std::string s;
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? " x " : "") + std::to_string(dims[i]);
  return s;
}

}  // namespace detail

/// Reads an IDX file of unsigned bytes, plain or gzip-compressed. Throws DataError naming the file
/// and the problem for anything that is not a well-formed IDX file of at most 4 dimensions.
[[nodiscard]] inline IdxArray read_idx(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw DataError(path, "file does not exist");
  if (fs::is_directory(status)) throw DataError(path, "is a directory, not an IDX file");
  // A FIFO, socket or device would block or never end; only a regular file holds an IDX file.
  if (!fs::is_regular_file(status)) throw DataError(path, "is not a regular file (expected an IDX file)");

  detail::GzFile file{gzopen(path.c_str(), "rb")};
  if (!file) {
    const int err = errno;
    throw DataError(path, "cannot open file: " + std::generic_category().message(err));
  }
  gzbuffer(file.get(), 1u << 17);  // larger than zlib's 8 KiB default: fewer reads of big files

  // Header: two zero bytes, the element type, the number of dimensions.
  std::uint8_t magic[4] = {};
  const std::size_t magic_got = detail::read_some(file.get(), magic, 4, path);
  if (magic_got == 0) throw DataError(path, "file is empty (no IDX header)");
  if (magic_got < 4)
    throw DataError(path, "file is truncated inside the IDX header: expected 4 bytes, found " +
                              std::to_string(magic_got));
  if (magic[0] != 0 || magic[1] != 0)
    throw DataError(path, "not an IDX file: bad magic, first bytes are " + detail::hex_byte(magic[0]) + " " +
                              detail::hex_byte(magic[1]) + ", expected 0x00 0x00");
  const unsigned type = magic[2];
  if (type != 0x08) {
    const char* name = detail::idx_type_name(type);
    throw DataError(path, std::string("unsupported IDX element type ") + detail::hex_byte(type) +
                              (name ? std::string(" (") + name + ")" : std::string(" (unknown type)")) +
                              "; only 0x08 (unsigned byte) is supported");
  }
  const unsigned ndim = magic[3];
  if (ndim < 1 || ndim > 4)
    throw DataError(path, "IDX header gives " + std::to_string(ndim) + " dimensions; expected 1 to 4");

  std::uint8_t dim_bytes[16] = {};
  const std::size_t dim_got = detail::read_some(file.get(), dim_bytes, 4 * ndim, path);
  if (dim_got < 4 * ndim)
    throw DataError(path, "file is truncated inside the dimension sizes: expected " +
                              std::to_string(4 * ndim) + " bytes, found " + std::to_string(dim_got));

  IdxArray out;
  out.dims.resize(ndim);
  std::uint64_t total = 1;
  for (unsigned i = 0; i < ndim; ++i) {
    const std::uint32_t d = detail::big_endian_u32(dim_bytes + 4 * i);
    if (d == 0) throw DataError(path, "dimension " + std::to_string(i) + " is 0; every dimension must be > 0");
    out.dims[i] = d;
    // total <= 2^32 before this step and d < 2^32, so the product fits in 64 bits; checked anyway.
    if (total > std::numeric_limits<std::uint64_t>::max() / d || total * d > idx_max_payload_bytes)
      throw DataError(path, "IDX header claims a payload that is too large: dimensions " +
                                detail::join_dims(out.dims) + (i + 1 < ndim ? " x ..." : "") +
                                " exceed the limit of " + std::to_string(idx_max_payload_bytes) + " bytes");
    total *= d;
  }
  if (total > std::uint64_t{std::numeric_limits<std::size_t>::max()})
    throw DataError(path, "payload of " + std::to_string(total) + " bytes does not fit in memory");
  const auto expected = static_cast<std::size_t>(total);

  // The header is not trusted for allocation: grow with the bytes that actually arrive, so a tiny
  // file claiming gigabytes fails after reading what it has, having reserved little.
  constexpr std::size_t reserve_cap = std::size_t{64} << 20;
  constexpr std::size_t chunk = std::size_t{4} << 20;
  out.data.reserve(std::min(expected, reserve_cap));
  std::size_t found = 0;
  while (found < expected) {
    const std::size_t want = std::min(expected - found, chunk);
    out.data.resize(found + want);
    const std::size_t got = detail::read_some(file.get(), out.data.data() + found, want, path);
    found += got;
    if (got < want) break;
  }
  if (found < expected)
    throw DataError(path, "truncated payload: dimensions " + detail::join_dims(out.dims) + " need " +
                              std::to_string(expected) + " bytes, found " + std::to_string(found));

  // Extra bytes mean the header and the data disagree; count them for the message, up to a bound.
  constexpr std::size_t count_cap = std::size_t{1} << 20;
  std::vector<std::uint8_t> extra(4096);
  std::size_t trailing = 0;
  while (trailing < count_cap) {
    const std::size_t got = detail::read_some(file.get(), extra.data(), extra.size(), path);
    trailing += got;
    if (got < extra.size()) break;
  }
  if (trailing > 0)
    throw DataError(path, "trailing bytes after the payload: expected " + std::to_string(expected) +
                              " bytes, found " + (trailing >= count_cap ? "at least " : "") +
                              std::to_string(trailing) + " more");
  return out;
}

/// Loads an images file (count, rows, cols) and a labels file (count) into a Dataset of one
/// channel, pixels scaled to [0,1]. Every label must be below `classes`.
[[nodiscard]] inline Dataset load_idx_pair(const std::string& images_path, const std::string& labels_path,
                                           std::size_t classes = 10) {
  require(classes > 0, "load_idx_pair: classes must be > 0");
  const IdxArray images = read_idx(images_path);
  if (images.dims.size() != 3)
    throw DataError(images_path, "images file must have 3 dimensions (count, rows, cols), found " +
                                     std::to_string(images.dims.size()) + " (" + detail::join_dims(images.dims) +
                                     ")");
  const IdxArray labels = read_idx(labels_path);
  if (labels.dims.size() != 1)
    throw DataError(labels_path, "labels file must have 1 dimension (count), found " +
                                     std::to_string(labels.dims.size()) + " (" + detail::join_dims(labels.dims) +
                                     ")");
  if (images.dims[0] != labels.dims[0])
    throw DataError(images_path, "count mismatch: images file holds " + std::to_string(images.dims[0]) +
                                     " images but labels file " + labels_path + " holds " +
                                     std::to_string(labels.dims[0]) + " labels");

  Dataset ds;
  ds.count = images.dims[0];
  ds.channels = 1;
  ds.height = images.dims[1];
  ds.width = images.dims[2];
  ds.classes = classes;

  ds.labels.resize(ds.count);
  for (std::size_t i = 0; i < ds.count; ++i) {
    const std::uint8_t label = labels.data[i];
    if (label >= classes)
      throw DataError(labels_path, "label at index " + std::to_string(i) + " is " + std::to_string(label) +
                                       ", out of range 0.." + std::to_string(classes - 1));
    ds.labels[i] = label;
  }

  // One channel, so the IDX row-major (count, rows, cols) order already is NCHW. Dividing (not
  // multiplying by 1/255) gives the same floats as torchvision's ToTensor.
  ds.images.resize(images.data.size());
  std::transform(images.data.begin(), images.data.end(), ds.images.begin(),
                 [](std::uint8_t x) { return static_cast<float>(x) / 255.0f; });
  return ds;
}

/// Loads the train or test split of MNIST or Fashion-MNIST from `dir`, which holds the files under
/// their original names (`train-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, ...), plain or with a
/// `.gz` suffix — the layout of the original downloads and of Debian's dataset-fashion-mnist
/// (/usr/share/datasets/fashion-mnist).
[[nodiscard]] inline Dataset load_mnist(const std::string& dir, Split split) {
  namespace fs = std::filesystem;
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const std::string images_name = prefix + "-images-idx3-ubyte";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  const std::string looked_for = images_name + "[.gz] and " + labels_name + "[.gz]";

  std::error_code ec;
  const auto dir_status = fs::status(dir, ec);
  if (!fs::exists(dir_status)) throw DataError(dir, "dataset folder does not exist (looked for " + looked_for + ")");
  if (!fs::is_directory(dir_status))
    throw DataError(dir, "is not a folder (expected a folder holding " + looked_for + ")");

  // The plain file is preferred when both exist: it reads faster and is what a user unpacked.
  auto find = [&](const std::string& name) {
    for (const std::string& candidate : {name, name + ".gz"}) {
      const fs::path p = fs::path(dir) / candidate;
      std::error_code e;
      if (fs::is_regular_file(p, e)) return p.string();
    }
    throw DataError(dir, "no file " + name + " or " + name + ".gz in the dataset folder (it should hold " +
                             looked_for + ")");
  };
  const std::string images_path = find(images_name);
  const std::string labels_path = find(labels_name);
  return load_idx_pair(images_path, labels_path, 10);
}

}  // namespace fusedp::data
