// Tests of include/fusedp/data/cifar.hpp on generated CIFAR-10 binary batches: layout, concatenation
// of the five training batches, the archive's subfolder, and every bad-input case.
#include "fusedp/data/cifar.hpp"

#include "temp_dir.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace {

using fusedp::DataError;
using fusedp::data::Dataset;
using fusedp::data::Split;
using fusedp_test::Bytes;
using fusedp_test::TempDir;
using fusedp_test::write_bytes;

constexpr std::size_t record = 3073;

// Record r of a generated batch tagged `tag`: label (tag + r) % 10, pixel i = (tag * 31 + r * 7 + i) % 256.
Bytes batch(std::size_t records, std::size_t tag) {
  Bytes b;
  for (std::size_t r = 0; r < records; ++r) {
    b.push_back(std::uint8_t((tag + r) % 10));
    for (std::size_t i = 0; i < 3072; ++i) b.push_back(std::uint8_t((tag * 31 + r * 7 + i) % 256));
  }
  return b;
}

float pixel(std::size_t tag, std::size_t r, std::size_t i) { return float((tag * 31 + r * 7 + i) % 256) / 255.0f; }

void write_split(const TempDir& dir, const std::string& sub = "") {
  const std::string base = sub.empty() ? dir.path.string() : (dir.path / sub).string();
  std::filesystem::create_directories(base);
  for (std::size_t k = 1; k <= 5; ++k) write_bytes(base + "/data_batch_" + std::to_string(k) + ".bin", batch(k, k));
  write_bytes(base + "/test_batch.bin", batch(4, 9));
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no DataError)";
}

}  // namespace

TEST_CASE("read_cifar10_batch: labels and CHW pixels in [0,1], as the file lays them out") {
  TempDir dir("fusedp_cifar");
  write_bytes(dir.file("b.bin"), batch(3, 4));
  const Dataset ds = fusedp::data::read_cifar10_batch(dir.file("b.bin"));
  REQUIRE(ds.count == 3);
  CHECK(ds.channels == 3);
  CHECK(ds.height == 32);
  CHECK(ds.width == 32);
  CHECK(ds.classes == 10);
  REQUIRE(ds.images.size() == 3 * 3072);
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(ds.labels[r] == std::int32_t((4 + r) % 10));
    // red plane first, then green, then blue; each 32 rows of 32
    for (std::size_t i : {std::size_t(0), std::size_t(31), std::size_t(1024), std::size_t(2047), std::size_t(3071)})
      CHECK(ds.images[r * 3072 + i] == pixel(4, r, i));
  }
  // the conversion is the one of torchvision's ToTensor: byte / 255
  CHECK(ds.images[5] == float((4 * 31 + 5) % 256) / 255.0f);
}

TEST_CASE("load_cifar10 concatenates data_batch_1..5 in order and reads test_batch") {
  TempDir dir("fusedp_cifar");
  write_split(dir);
  const Dataset train = fusedp::data::load_cifar10(dir.path.string(), Split::train);
  CHECK(train.count == 1 + 2 + 3 + 4 + 5);
  // the first record of data_batch_3 follows the 1 + 2 records of batches 1 and 2
  CHECK(train.labels[3] == 3);
  CHECK(train.images[3 * 3072 + 10] == pixel(3, 0, 10));
  CHECK(train.labels[14] == std::int32_t((5 + 4) % 10));  // last record of data_batch_5
  const Dataset test = fusedp::data::load_cifar10(dir.path.string(), Split::test);
  CHECK(test.count == 4);
  CHECK(test.labels[1] == 0);
  fusedp::data::validate(train, "train");
  fusedp::data::validate(test, "test");
}

TEST_CASE("load_cifar10 also finds the archive's folder cifar-10-batches-bin") {
  TempDir dir("fusedp_cifar");
  write_split(dir, "cifar-10-batches-bin");
  CHECK(fusedp::data::load_cifar10(dir.path.string(), Split::train).count == 15);
  CHECK(fusedp::data::load_cifar10(dir.path.string(), Split::test).count == 4);
}

TEST_CASE("CIFAR-10 reader rejects bad files with a DataError naming the file and the problem") {
  TempDir dir("fusedp_cifar");
  const std::string f = dir.file("data_batch_1.bin");

  SUBCASE("empty") {
    write_bytes(f, {});
    const std::string m = error_of([&] { (void)fusedp::data::read_cifar10_batch(f); });
    CHECK(m.find(f) != std::string::npos);
    CHECK(m.find("empty") != std::string::npos);
  }
  SUBCASE("truncated: size not a multiple of 3073") {
    Bytes b = batch(2, 0);
    b.resize(b.size() - 5);
    write_bytes(f, b);
    const std::string m = error_of([&] { (void)fusedp::data::read_cifar10_batch(f); });
    CHECK(m.find(f) != std::string::npos);
    CHECK(m.find("not a multiple of the 3073-byte") != std::string::npos);
    CHECK(m.find("1 whole records and 3068 bytes left over") != std::string::npos);
  }
  SUBCASE("too short for one record") {
    write_bytes(f, Bytes(100, 1));
    CHECK(error_of([&] { (void)fusedp::data::read_cifar10_batch(f); }).find("not a multiple") != std::string::npos);
  }
  SUBCASE("label out of range names the record") {
    Bytes b = batch(3, 0);
    b[2 * record] = 10;
    write_bytes(f, b);
    const std::string m = error_of([&] { (void)fusedp::data::read_cifar10_batch(f); });
    CHECK(m.find(f) != std::string::npos);
    CHECK(m.find("record 2 (byte offset 6146) has label 10; CIFAR-10 labels are 0..9") != std::string::npos);
    b[2 * record] = 255;
    write_bytes(f, b);
    CHECK(error_of([&] { (void)fusedp::data::read_cifar10_batch(f); }).find("has label 255") != std::string::npos);
  }
  SUBCASE("an IDX or other file of the wrong size") {
    write_bytes(f, Bytes{0x00, 0x00, 0x08, 0x03, 0, 0, 0, 1, 0, 0, 0, 28, 0, 0, 0, 28});
    CHECK(error_of([&] { (void)fusedp::data::read_cifar10_batch(f); }).find("not a CIFAR-10 binary batch") !=
          std::string::npos);
  }
  SUBCASE("missing file, folder instead of file") {
    CHECK(error_of([&] { (void)fusedp::data::read_cifar10_batch(f); }).find("does not exist") != std::string::npos);
    std::filesystem::create_directories(f);
    CHECK(error_of([&] { (void)fusedp::data::read_cifar10_batch(f); }).find("not a regular file") !=
          std::string::npos);
  }
  SUBCASE("a failed append leaves the dataset unchanged") {
    Dataset ds = fusedp::data::read_cifar10_batch((write_bytes(f, batch(2, 1)), f));
    Bytes bad = batch(2, 0);
    bad[record] = 42;
    write_bytes(dir.file("bad.bin"), bad);
    CHECK_THROWS_AS(fusedp::data::append_cifar10_batch(dir.file("bad.bin"), ds), DataError);
    CHECK(ds.count == 2);
    CHECK(ds.images.size() == 2 * 3072);
    CHECK(ds.labels.size() == 2);
  }
}

TEST_CASE("load_cifar10 lists the missing batches, where it looked, and where to download") {
  TempDir dir("fusedp_cifar");
  SUBCASE("empty folder") {
    const std::string m = error_of([&] { (void)fusedp::data::load_cifar10(dir.path.string(), Split::train); });
    CHECK(m.find(dir.path.string()) != std::string::npos);
    CHECK(m.find("missing CIFAR-10 training batches: data_batch_1.bin, data_batch_2.bin, data_batch_3.bin, "
                 "data_batch_4.bin, data_batch_5.bin") != std::string::npos);
    CHECK(m.find("cifar-10-batches-bin") != std::string::npos);
    CHECK(m.find("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz") != std::string::npos);
  }
  SUBCASE("one batch missing") {
    write_split(dir);
    std::filesystem::remove(dir.file("data_batch_3.bin"));
    const std::string m = error_of([&] { (void)fusedp::data::load_cifar10(dir.path.string(), Split::train); });
    CHECK(m.find("missing CIFAR-10 training batches: data_batch_3.bin (") != std::string::npos);
    CHECK(fusedp::data::load_cifar10(dir.path.string(), Split::test).count == 4);
  }
  SUBCASE("test batch missing") {
    const std::string m = error_of([&] { (void)fusedp::data::load_cifar10(dir.path.string(), Split::test); });
    CHECK(m.find("missing CIFAR-10 test batches: test_batch.bin") != std::string::npos);
  }
  SUBCASE("folder does not exist, or is a file") {
    const std::string none = dir.file("nowhere");
    CHECK(error_of([&] { (void)fusedp::data::load_cifar10(none, Split::train); }).find("does not exist") !=
          std::string::npos);
    write_bytes(none, batch(1, 0));
    CHECK(error_of([&] { (void)fusedp::data::load_cifar10(none, Split::train); }).find("is not a folder") !=
          std::string::npos);
  }
  SUBCASE("a bad batch inside the folder is named") {
    write_split(dir);
    Bytes b = batch(4, 4);
    b.pop_back();
    write_bytes(dir.file("data_batch_4.bin"), b);
    const std::string m = error_of([&] { (void)fusedp::data::load_cifar10(dir.path.string(), Split::train); });
    CHECK(m.find("data_batch_4.bin: size 12291 bytes is not a multiple") != std::string::npos);
  }
}
