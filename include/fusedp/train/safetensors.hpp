#pragma once
// The safetensors format (https://github.com/huggingface/safetensors), which PyTorch programs read
// with a few lines or with the `safetensors` package:
//
//   8 bytes     N, the header length, unsigned little-endian
//   N bytes     a JSON object: per tensor "name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
//               and "__metadata__": {string: string}; padded with spaces
//   the rest    tensor data, little-endian, C order; offsets relative to the end of the header,
//               contiguous and covering the rest exactly
//
// Files fusedp writes carry a CRC-32 of the whole file in the metadata ("fusedp.crc32", 8 hex
// digits, computed with those 8 digits set to '0'), so one flipped byte anywhere is detected before
// anything is loaded. Every file read is untrusted: each problem is a DataError naming the file.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/train/durable_file.hpp"

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace fusedp::train {

/// Largest header accepted (the limit of the reference implementation).
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;
/// Deepest JSON nesting a header may have: the header object, a tensor's object, its shape or offsets.
inline constexpr int safetensors_max_header_depth = 3;
/// Metadata key of fusedp's checksum.
inline constexpr std::string_view checksum_key = "fusedp.crc32";

/// One tensor's entry in the header.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;  // byte offsets in the data section
};

/// A safetensors file read into memory and checked.
struct SafetensorsFile {
  std::string path;
  std::vector<std::uint8_t> bytes;  // the whole file
  std::size_t data_start = 0;       // 8 + header length
  std::vector<SafetensorsTensor> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  std::optional<std::uint32_t> crc32;  // the verified checksum, when the file has one

  [[nodiscard]] const SafetensorsTensor* find(std::string_view name) const {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  [[nodiscard]] const std::string* meta(const std::string& key) const {
    const auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  }
  /// The value of a one-element integer tensor (I64, as PyTorch saves num_batches_tracked) or F32.
  [[nodiscard]] double read_scalar(const SafetensorsTensor& t) const {
    const std::uint8_t* src = bytes.data() + data_start + t.begin;
    auto little = [&](int n) {
      std::uint64_t u = 0;
      for (int i = n - 1; i >= 0; --i) u = u << 8 | src[i];
      return u;
    };
    if (t.dtype == "I64" && t.end - t.begin == 8) return double(std::int64_t(little(8)));
    if (t.dtype == "F32" && t.end - t.begin == 4) return double(std::bit_cast<float>(std::uint32_t(little(4))));
    throw DataError(path, "tensor '" + t.name + "' has dtype " + t.dtype + " and " +
                              std::to_string(t.end - t.begin) + " bytes, expected one I64 or F32 value");
  }
  /// Copies F32 tensor `t` into `out`, which holds exactly its elements.
  void read_f32(const SafetensorsTensor& t, std::span<float> out) const {
    if (t.dtype != "F32") throw DataError(path, "tensor '" + t.name + "' has dtype " + t.dtype + ", expected F32");
    if (t.end - t.begin != out.size() * sizeof(float))
      throw DataError(path, "tensor '" + t.name + "' holds " + std::to_string((t.end - t.begin) / 4) +
                                " values, expected " + std::to_string(out.size()));
    const std::uint8_t* src = bytes.data() + data_start + t.begin;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(out.data(), src, out.size() * sizeof(float));
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) {
        const std::uint32_t u = std::uint32_t(src[4 * i]) | std::uint32_t(src[4 * i + 1]) << 8 |
                                std::uint32_t(src[4 * i + 2]) << 16 | std::uint32_t(src[4 * i + 3]) << 24;
        out[i] = std::bit_cast<float>(u);
      }
    }
  }
};

/// A tensor to write: its name, shape and float32 values (C order).
struct TensorToWrite {
  std::string name;
  std::vector<std::size_t> shape;
  std::span<const float> values;
};

namespace detail {

inline std::string hex32(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

inline std::size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

// CRC-32 (zlib's) of `bytes` with the n bytes at `hole` read as '0'.
inline std::uint32_t crc32_with_hole(std::span<const std::uint8_t> bytes, std::size_t hole, std::size_t n) {
  static constexpr char zeros[] = "00000000";
  uLong crc = ::crc32(0L, Z_NULL, 0);
  auto feed = [&](const void* p, std::size_t len) {
    const auto* b = static_cast<const Bytef*>(p);
    while (len > 0) {  // zlib takes a uInt length
      const auto step = static_cast<uInt>(std::min<std::size_t>(len, std::size_t{1} << 30));
      crc = ::crc32(crc, b, step);
      b += step;
      len -= step;
    }
  };
  feed(bytes.data(), hole);
  feed(zeros, n);
  feed(bytes.data() + hole + n, bytes.size() - hole - n);
  return static_cast<std::uint32_t>(crc);
}

// Where the 8 checksum digits sit in the header: after the one occurrence of "fusedp.crc32":".
inline std::optional<std::size_t> checksum_digits_at(std::span<const std::uint8_t> header, std::size_t header_offset) {
  constexpr std::string_view needle = "\"fusedp.crc32\":\"";
  static_assert(needle.substr(1, 12) == checksum_key);
  const std::string_view text(reinterpret_cast<const char*>(header.data()), header.size());
  const std::size_t at = text.find(needle);
  if (at == std::string_view::npos || text.find(needle, at + 1) != std::string_view::npos) return std::nullopt;
  if (at + needle.size() + 8 > text.size()) return std::nullopt;
  return header_offset + at + needle.size();
}

inline std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline std::vector<std::uint8_t> read_whole_file(const std::string& path, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) throw DataError(path, std::string(what) + " does not exist");
  if (!fs::is_regular_file(status)) throw DataError(path, std::string("is not a regular file (expected ") + what + ")");
  struct Closer {
    void operator()(std::FILE* f) const noexcept { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, Closer> f{std::fopen(path.c_str(), "rb")};
  if (!f) {
    const int err = errno;
    throw DataError(path, "cannot open the file: " + std::generic_category().message(err));
  }
  // Read what is there (not what the size said a moment ago): grows as the data arrives.
  std::vector<std::uint8_t> bytes;
  const std::uintmax_t size = fs::file_size(path, ec);
  if (!ec) bytes.reserve(static_cast<std::size_t>(std::min<std::uintmax_t>(size, std::uintmax_t{1} << 32)));
  std::uint8_t buf[1 << 16];
  for (;;) {
    const std::size_t got = std::fread(buf, 1, sizeof buf, f.get());
    bytes.insert(bytes.end(), buf, buf + got);
    if (got < sizeof buf) break;
  }
  if (std::ferror(f.get())) {
    const int err = errno;
    throw DataError(path, "read failed: " + std::generic_category().message(err));
  }
  return bytes;
}

}  // namespace detail

/// Checks the contents of a safetensors file held in memory (`path` names it in messages): the
/// header's length and JSON, every tensor's dtype, shape and offsets (contiguous, covering the data
/// exactly), the metadata (string values), and the checksum when the file has one. A file that says
/// it was written by fusedp (a "fusedp." metadata key) must have one.
[[nodiscard]] inline SafetensorsFile parse_safetensors(std::string path, std::vector<std::uint8_t> bytes) {
  using nlohmann::json;
  SafetensorsFile f;
  f.path = std::move(path);
  f.bytes = std::move(bytes);
  const std::string& path_ref = f.path;
  auto fail = [&](const std::string& problem) -> void { throw DataError(path_ref, problem); };
  const std::size_t size = f.bytes.size();
  if (size == 0) fail("file is empty (not a safetensors file)");
  if (size < 8) fail("file is truncated: " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  const std::uint64_t header_len = detail::read_u64_le(f.bytes.data());
  if (header_len > safetensors_max_header_bytes)
    fail("header length " + std::to_string(header_len) + " exceeds the limit of " +
         std::to_string(safetensors_max_header_bytes) + " bytes (not a safetensors file, or corrupt)");
  if (header_len > size - 8)
    fail("file is truncated: the header needs " + std::to_string(header_len) + " bytes, the file has " +
         std::to_string(size - 8) + " after the length");
  if (header_len < 2 || f.bytes[8] != '{')
    fail("not a safetensors file: the header does not start with '{'");
  f.data_start = 8 + std::size_t(header_len);
  const std::size_t data_size = size - f.data_start;

  // A valid header nests 3 levels deep (the object, a tensor, its shape); deeper nesting is refused
  // as it is met, before it is built: parsed whole, a 100 MB header of nested arrays would cost
  // about 40 bytes of memory per byte. The callback's depth counts the containers around the one
  // that starts.
  const json::parser_callback_t depth_limit = [&](int depth, json::parse_event_t event, json&) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= safetensors_max_header_depth)
      fail("header nests JSON deeper than the " + std::to_string(safetensors_max_header_depth) +
           " levels of the format (not a safetensors header)");
    return true;
  };
  json header;
  try {
    header = json::parse(f.bytes.begin() + 8, f.bytes.begin() + std::ptrdiff_t(f.data_start), depth_limit);
  } catch (const json::exception& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");

  bool from_fusedp = false;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) fail("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail("metadata value of '" + m.key() + "' is not a string");
        f.metadata[m.key()] = m.value().get<std::string>();
        if (m.key().rfind("fusedp.", 0) == 0) from_fusedp = true;
      }
      continue;
    }
    const std::string where = "tensor '" + key + "'";
    if (!v.is_object()) fail(where + " is not an object");
    for (auto field = v.begin(); field != v.end(); ++field)
      if (field.key() != "dtype" && field.key() != "shape" && field.key() != "data_offsets")
        fail(where + " has an unknown field '" + field.key() + "'");
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(where + " has no dtype string");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(where + " has no shape array");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail(where + " has no data_offsets [begin, end]");
    SafetensorsTensor t;
    t.name = key;
    t.dtype = v["dtype"].get<std::string>();
    const std::size_t elem = detail::dtype_bytes(t.dtype);
    if (elem == 0) fail(where + " has an unknown dtype '" + t.dtype + "'");
    bool empty = false, too_large = false;
    std::size_t bytes = elem;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned()) fail(where + " has a shape entry that is not a non-negative integer");
      const auto dim = d.get<std::uint64_t>();
      if (dim > std::numeric_limits<std::size_t>::max()) too_large = true;
      t.shape.push_back(std::size_t(dim));
      empty = empty || dim == 0;
      if (dim != 0 && bytes > std::numeric_limits<std::size_t>::max() / dim) too_large = true;
      if (!too_large) bytes *= std::size_t(dim);
    }
    if (empty) bytes = 0;
    else if (too_large) fail(where + " has a shape whose size overflows (the header is corrupt)");
    for (const json& o : v["data_offsets"])
      if (!o.is_number_unsigned()) fail(where + " has data_offsets that are not non-negative integers");
    const auto begin = v["data_offsets"][0].get<std::uint64_t>();
    const auto end = v["data_offsets"][1].get<std::uint64_t>();
    if (begin > end) fail(where + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] that end before they begin");
    if (end > data_size)
      fail("file is truncated: " + where + " ends at byte " + std::to_string(end) + " of the data, which holds " +
           std::to_string(data_size) + " bytes");
    if (end - begin != bytes)
      fail(where + " of dtype " + t.dtype + " and " + std::to_string(bytes / elem) + " elements needs " +
           std::to_string(bytes) + " bytes, its data_offsets span " + std::to_string(end - begin));
    t.begin = std::size_t(begin);
    t.end = std::size_t(end);
    f.tensors.push_back(std::move(t));
  }
  std::sort(f.tensors.begin(), f.tensors.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  std::size_t at = 0;
  for (const auto& t : f.tensors) {
    if (t.begin != at)
      fail("tensor '" + t.name + "' starts at data byte " + std::to_string(t.begin) + ", expected " +
           std::to_string(at) + " (tensors must be contiguous and not overlap)");
    at = t.end;
  }
  if (at != data_size)
    fail(std::to_string(data_size - at) + " bytes after the last tensor (the data section must end with it)");

  if (const std::string* stored = f.meta(std::string(checksum_key))) {
    const auto digits = detail::checksum_digits_at({f.bytes.data() + 8, std::size_t(header_len)}, 8);
    if (!digits || stored->size() != 8 || stored->find_first_not_of("0123456789abcdef") != std::string::npos)
      fail("the checksum field is malformed (the header is corrupt)");
    const std::uint32_t expected = detail::crc32_with_hole(f.bytes, *digits, 8);
    if (detail::hex32(expected) != *stored)
      fail("checksum mismatch: the file says crc32 " + *stored + ", its contents give " + detail::hex32(expected) +
           "; the file is corrupt (a changed or damaged byte)");
    f.crc32 = expected;
  } else if (from_fusedp) {
    fail("has fusedp metadata but no checksum (" + std::string(checksum_key) + "); the header is corrupt");
  }
  return f;
}

/// Reads `path` and checks it (see parse_safetensors).
[[nodiscard]] inline SafetensorsFile read_safetensors(const std::string& path) {
  return parse_safetensors(path, detail::read_whole_file(path, "safetensors file"));
}

/// The bytes of a safetensors file holding `tensors` (F32, in the given order) and `metadata`, with
/// fusedp's checksum added to the metadata. `crc` receives the checksum.
[[nodiscard]] inline std::vector<std::uint8_t> encode_safetensors(
    std::span<const TensorToWrite> tensors, const std::vector<std::pair<std::string, std::string>>& metadata,
    std::uint32_t* crc = nullptr) {
  using nlohmann::json;
  std::string header = "{\"__metadata__\":{";
  for (const auto& [key, value] : metadata) {
    require(key != checksum_key, "encode_safetensors: the metadata key ", key, " is reserved");
    header += json(key).dump();
    header += ':';
    header += json(value).dump();
    header += ',';
  }
  header += json(std::string(checksum_key)).dump();
  header += ":\"00000000\"}";
  std::size_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    std::size_t n = 1;
    for (std::size_t d : t.shape) n *= d;
    require(n == t.values.size(), "encode_safetensors: tensor ", t.name, " has ", t.values.size(),
            " values for its shape of ", n);
    // Appended piece by piece: g++ 12 warns (-Wrestrict, a false positive) on "literal" + string&&.
    header += ',';
    header += json(t.name).dump();
    header += ":{\"dtype\":\"F32\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i) header += ',';
      header += std::to_string(t.shape[i]);
    }
    header += "],\"data_offsets\":[";
    header += std::to_string(offset);
    header += ',';
    header += std::to_string(offset + 4 * n);
    header += "]}";
    offset += 4 * n;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the reference pads

  std::vector<std::uint8_t> bytes(8 + header.size() + offset);
  for (int i = 0; i < 8; ++i) bytes[std::size_t(i)] = std::uint8_t(std::uint64_t(header.size()) >> (8 * i));
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  std::uint8_t* data = bytes.data() + 8 + header.size();
  for (const TensorToWrite& t : tensors) {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(data, t.values.data(), t.values.size() * sizeof(float));
    } else {
      for (std::size_t i = 0; i < t.values.size(); ++i) {
        const auto u = std::bit_cast<std::uint32_t>(t.values[i]);
        for (int k = 0; k < 4; ++k) data[4 * i + std::size_t(k)] = std::uint8_t(u >> (8 * k));
      }
    }
    data += t.values.size() * sizeof(float);
  }
  const std::size_t digits = *detail::checksum_digits_at({bytes.data() + 8, header.size()}, 8);
  const std::uint32_t c = detail::crc32_with_hole(bytes, digits, 8);
  const std::string hex = detail::hex32(c);
  std::memcpy(bytes.data() + digits, hex.data(), 8);
  if (crc) *crc = c;
  return bytes;
}

/// Writes a safetensors file atomically (see write_file_atomically).
inline void write_safetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                              const std::vector<std::pair<std::string, std::string>>& metadata) {
  const std::vector<std::uint8_t> bytes = encode_safetensors(tensors, metadata);
  write_file_atomically(path, bytes);
}

}  // namespace fusedp::train
