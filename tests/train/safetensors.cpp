// Tests of include/fusedp/train/safetensors.hpp: the byte layout, files written elsewhere (no fusedp
// metadata), the checksum catching a flip of any single byte, and every structural problem.
#include "fusedp/train/safetensors.hpp"

#include "../data/temp_dir.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

namespace ft = fusedp::train;
using fusedp::DataError;
using fusedp_test::Bytes;
using fusedp_test::read_bytes;
using fusedp_test::TempDir;
using fusedp_test::write_bytes;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no DataError)";
}

// A safetensors file as another writer makes it: a header given as text, then raw data.
Bytes raw_file(const std::string& header, const Bytes& data) {
  Bytes b(8 + header.size() + data.size());
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) b[std::size_t(i)] = std::uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), b.begin() + 8);
  std::copy(data.begin(), data.end(), b.begin() + 8 + std::ptrdiff_t(header.size()));
  return b;
}

Bytes floats(std::initializer_list<float> v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), std::data(v), b.size());
  return b;
}

const std::vector<float> a_values = {1, 2, 3, 4, 5, 6};
const std::vector<float> b_values = {-0.5f};

Bytes sample() {
  const std::vector<ft::TensorToWrite> t = {{"0.weight", {2, 3}, a_values}, {"0.bias", {1}, b_values}};
  return ft::encode_safetensors(t, {{"format", "pt"}, {"fusedp.kind", "test"}});
}

}  // namespace

TEST_CASE("encode_safetensors writes the reference layout") {
  const Bytes b = sample();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[std::size_t(i)];
  REQUIRE(8 + n + 28 == b.size());  // 7 floats of data
  CHECK((8 + n) % 8 == 0);          // data 8-byte aligned, header padded with spaces
  const std::string header(b.begin() + 8, b.begin() + 8 + std::ptrdiff_t(n));
  CHECK(header.rfind("{\"__metadata__\":{\"format\":\"pt\",\"fusedp.kind\":\"test\",\"fusedp.crc32\":\"", 0) == 0);
  CHECK(header.find("\"0.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}") != std::string::npos);
  CHECK(header.find("\"0.bias\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[24,28]}") != std::string::npos);
  float first = 0, last = 0;
  std::memcpy(&first, b.data() + 8 + n, 4);
  std::memcpy(&last, b.data() + 8 + n + 24, 4);
  CHECK(first == 1.0f);
  CHECK(last == -0.5f);
}

TEST_CASE("read_safetensors round-trips and verifies the checksum") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("a.safetensors");
  const std::vector<ft::TensorToWrite> t = {{"0.weight", {2, 3}, a_values}, {"0.bias", {1}, b_values}};
  ft::write_safetensors(path, t, {{"note", "h\u00e9llo \"quoted\"\n"}});
  const ft::SafetensorsFile f = ft::read_safetensors(path);
  CHECK(f.crc32.has_value());
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].name == "0.weight");
  CHECK(f.tensors[0].shape == std::vector<std::size_t>{2, 3});
  CHECK(*f.meta("note") == "h\u00e9llo \"quoted\"\n");
  std::vector<float> w(6);
  f.read_f32(*f.find("0.weight"), w);
  CHECK(w == a_values);
  std::vector<float> wrong(5);
  CHECK_THROWS_WITH_AS(f.read_f32(*f.find("0.weight"), wrong), doctest::Contains("holds 6 values, expected 5"),
                       DataError);
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST_CASE("files from other writers (no checksum, any key order, padding) are read") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("torch.safetensors");
  // the Python package sorts differently and pads with spaces; metadata is optional
  const std::string header =
      "{\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}, "
      "\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}    ";
  write_bytes(path, raw_file(header, floats({1, 2, 3})));
  const ft::SafetensorsFile f = ft::read_safetensors(path);
  CHECK_FALSE(f.crc32.has_value());
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].name == "a");  // in data order
  std::vector<float> v(1);
  f.read_f32(*f.find("b"), v);
  CHECK(v[0] == 3.0f);
  // a zero-sized tensor and an empty file body are fine
  write_bytes(path, raw_file("{\"e\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]}}", {}));
  CHECK(ft::read_safetensors(path).tensors.size() == 1);
}

TEST_CASE("a flip of any single byte is detected") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("a.safetensors");
  const Bytes good = sample();
  CHECK_NOTHROW((void)ft::parse_safetensors("in memory", good));
  std::size_t undetected = 0;
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (std::uint8_t mask : {std::uint8_t(0x01), std::uint8_t(0x80), std::uint8_t(0xFF)}) {
      Bytes bad = good;
      bad[i] ^= mask;
      try {
        (void)ft::parse_safetensors("in memory", std::move(bad));
        ++undetected;
        MESSAGE("undetected: byte " << i << " ^ " << int(mask));
      } catch (const DataError&) {
      }
    }
  }
  CHECK(undetected == 0);
  write_bytes(path, good);
  CHECK_NOTHROW((void)ft::read_safetensors(path));
  // a flipped data byte is reported as a checksum mismatch, naming the file
  Bytes bad = good;
  bad[bad.size() - 3] ^= 0x10;
  write_bytes(path, bad);
  const std::string m = error_of([&] { (void)ft::read_safetensors(path); });
  CHECK(m.rfind(path + ": checksum mismatch", 0) == 0);
}

TEST_CASE("every truncation is detected") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("a.safetensors");
  const Bytes good = sample();
  std::size_t undetected = 0;
  for (std::size_t n = 0; n < good.size(); ++n) {
    try {
      (void)ft::parse_safetensors("in memory", Bytes(good.begin(), good.begin() + std::ptrdiff_t(n)));
      ++undetected;
      MESSAGE("undetected: truncated to " << n << " bytes");
    } catch (const DataError&) {
    }
  }
  CHECK(undetected == 0);
  write_bytes(path, Bytes(good.begin(), good.end() - 4));
  CHECK(error_of([&] { (void)ft::read_safetensors(path); }).find("file is truncated") != std::string::npos);
}

TEST_CASE("structural problems are DataErrors naming the file and the problem") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("x.safetensors");
  auto check = [&](const Bytes& b, const std::string& expected) {
    write_bytes(path, b);
    const std::string m = error_of([&] { (void)ft::read_safetensors(path); });
    CAPTURE(m);
    CHECK(m.rfind(path + ": ", 0) == 0);
    CHECK(m.find(expected) != std::string::npos);
  };
  const Bytes data = floats({1, 2});
  check({}, "file is empty");
  check({1, 2, 3}, "too short for the 8-byte header length");
  write_bytes(path, raw_file("{}", {}));  // an empty header is valid
  CHECK_NOTHROW((void)ft::read_safetensors(path));
  Bytes huge = raw_file("{}", {});
  huge[7] = 0x7F;
  check(huge, "exceeds the limit");
  Bytes longer = raw_file("{}", {});
  longer[0] = 50;
  check(longer, "the header needs 50 bytes");
  check(raw_file("[1, 2]", {}), "does not start with '{'");
  check(raw_file("\x89PNG....", {}), "does not start with '{'");
  check(raw_file("{\"a\": ", {}), "header is not valid JSON");
  check(raw_file("{\"a\": 1}", {}), "tensor 'a' is not an object");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2]}}", data), "has no data_offsets");
  check(raw_file("{\"a\": {\"dtype\": \"Q7\", \"shape\": [2], \"data_offsets\": [0, 8]}}", data), "unknown dtype 'Q7'");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}}", data),
        "not a non-negative integer");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", data),
        "needs 12 bytes, its data_offsets span 8");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 16]}}", data),
        "file is truncated: tensor 'a' ends at byte 16");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}", data), "end before they begin");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
                 "\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
                 data),
        "expected 4 (tensors must be contiguous and not overlap)");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", data),
        "4 bytes after the last tensor");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 8]}}", data),
        "shape whose size overflows");
  check(raw_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8], \"x\": 1}}", data),
        "unknown field 'x'");
  check(raw_file("{\"__metadata__\": {\"k\": 3}}", {}), "metadata value of 'k' is not a string");
  check(raw_file("{\"__metadata__\": {\"fusedp.version\": \"0.1.0\"}}", {}), "has fusedp metadata but no checksum");
  check(raw_file("{\"__metadata__\": {\"fusedp.crc32\": \"xyz\"}}", {}), "checksum field is malformed");
  CHECK(error_of([&] { (void)ft::read_safetensors(dir.file("none")); }).find("does not exist") != std::string::npos);
  CHECK(error_of([&] { (void)ft::read_safetensors(dir.path.string()); }).find("not a regular file") !=
        std::string::npos);
}

TEST_CASE("a header nested deeper than the format's 3 levels is refused as it is parsed") {
  TempDir dir("fusedp_st");
  const std::string path = dir.file("deep.safetensors");
  auto message = [&](const std::string& header) {
    write_bytes(path, raw_file(header, {}));
    return error_of([&] { (void)ft::read_safetensors(path); });
  };
  // One level too deep, in a tensor and in the metadata.
  std::string m = message(R"({"a": {"dtype": "F32", "shape": [[2]], "data_offsets": [0, 8]}})");
  CAPTURE(m);
  CHECK(m.rfind(path + ": ", 0) == 0);
  CHECK(m.find("nests JSON deeper than the 3 levels") != std::string::npos);
  m = message(R"({"__metadata__": {"k": {"x": []}}})");
  CHECK(m.find("nests JSON deeper than the 3 levels") != std::string::npos);
  // A crafted header of a million nested arrays (well-formed JSON, 2 MB): refused at the fourth
  // level, not after a document of a million arrays was built and found not to be a tensor.
  const std::size_t levels = 1'000'000;
  m = message("{\"a\": " + std::string(levels, '[') + std::string(levels, ']') + "}");
  CHECK(m.rfind(path + ": ", 0) == 0);
  CHECK(m.find("nests JSON deeper than the 3 levels") != std::string::npos);
  // Three levels are what the format uses, and read.
  write_bytes(path, raw_file(R"({"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                             floats({1, 2})));
  CHECK_NOTHROW((void)ft::read_safetensors(path));
}
