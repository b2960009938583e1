// Tests of include/fusedp/data/idx.hpp: IDX round trips (plain and gzip) and every bad-input case.
#include "fusedp/data/idx.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <initializer_list>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using fusedp::DataError;
using fusedp::data::Dataset;
using fusedp::data::IdxArray;
using fusedp::data::Split;

using Bytes = std::vector<std::uint8_t>;

// A fresh folder per test case, removed afterwards, so cases never see each other's files.
struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path = fs::temp_directory_path() /
           ("fusedp_idx_test_" + std::to_string(stamp) + "_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] std::string file(const std::string& name) const { return (path / name).string(); }
};

Bytes idx_header(std::uint8_t type, const std::vector<std::uint32_t>& dims) {
  Bytes b = {0x00, 0x00, type, static_cast<std::uint8_t>(dims.size())};
  for (std::uint32_t d : dims) {
    b.push_back(static_cast<std::uint8_t>(d >> 24));
    b.push_back(static_cast<std::uint8_t>(d >> 16));
    b.push_back(static_cast<std::uint8_t>(d >> 8));
    b.push_back(static_cast<std::uint8_t>(d));
  }
  return b;
}

Bytes idx_file(const std::vector<std::uint32_t>& dims, const Bytes& payload) {
  Bytes b = idx_header(0x08, dims);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

Bytes iota_bytes(std::size_t n, std::uint8_t start = 0) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(start + i * 7);
  return b;
}

void write_plain(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void write_gz(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

Bytes read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Runs `f`, which must throw DataError; returns its message (empty when it did not throw one).
template <class F>
std::string data_error_of(F&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL_CHECK("expected DataError, got another exception: " << e.what());
    return {};
  }
  FAIL_CHECK("expected DataError, nothing was thrown");
  return {};
}

// The message must name the file and say what is wrong with it.
void check_read_fails(const std::string& path, std::initializer_list<const char*> words) {
  const std::string message = data_error_of([&] { (void)fusedp::data::read_idx(path); });
  INFO("message: " << message);
  CHECK(contains(message, path));
  for (const char* w : words) CHECK_MESSAGE(contains(message, w), "missing word: " << w);
}

}  // namespace

TEST_CASE("read_idx round-trips plain and gzip files of 1 to 4 dimensions") {
  TempDir tmp;
  const std::vector<std::vector<std::uint32_t>> shapes = {{5}, {3, 4}, {3, 2, 4}, {2, 3, 1, 2}};
  for (const auto& dims : shapes) {
    std::size_t n = 1;
    for (auto d : dims) n *= d;
    const Bytes payload = iota_bytes(n, 3);
    const std::string suffix = std::to_string(dims.size());
    const std::string plain = tmp.file("plain" + suffix), gz = tmp.file("packed" + suffix + ".gz");
    write_plain(plain, idx_file(dims, payload));
    write_gz(gz, idx_file(dims, payload));
    for (const std::string& path : {plain, gz}) {
      CAPTURE(path);
      const IdxArray a = fusedp::data::read_idx(path);
      REQUIRE(a.dims.size() == dims.size());
      for (std::size_t i = 0; i < dims.size(); ++i) CHECK(a.dims[i] == dims[i]);
      CHECK(a.data == payload);
    }
  }
}

TEST_CASE("read_idx reads a payload larger than its internal chunk") {
  TempDir tmp;
  const std::vector<std::uint32_t> dims = {9, 1000, 1000};  // 9 MB: several 4 MiB chunks
  const Bytes payload = iota_bytes(9'000'000, 1);
  write_gz(tmp.file("big.gz"), idx_file(dims, payload));
  const IdxArray a = fusedp::data::read_idx(tmp.file("big.gz"));
  CHECK(a.data == payload);
}

TEST_CASE("read_idx rejects bad files with a DataError naming the file and the problem") {
  TempDir tmp;

  SUBCASE("nonexistent file") { check_read_fails(tmp.file("missing"), {"does not exist"}); }

  SUBCASE("a directory") {
    fs::create_directory(tmp.path / "dir");
    check_read_fails(tmp.file("dir"), {"directory"});
  }

  SUBCASE("a FIFO is refused, not waited on") {
    const std::string fifo = tmp.file("fifo");
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    // Read in another thread: a reader that opened the FIFO would wait for a writer forever. After
    // 5 s the test becomes that writer (opening without blocking, then closing), so the reader sees
    // an empty file and the test fails instead of hanging.
    auto reading = std::async(std::launch::async, [&]() -> std::string {
      try {
        (void)fusedp::data::read_idx(fifo);
      } catch (const DataError& e) {
        return e.what();
      } catch (const std::exception& e) {
        return std::string("another exception: ") + e.what();
      }
      return "no exception";
    });
    bool blocked = false;
    if (reading.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      blocked = true;
      while (reading.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready) {
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0) ::close(fd);
      }
    }
    const std::string message = reading.get();
    INFO("message: " << message);
    CHECK_FALSE(blocked);
    CHECK(contains(message, fifo));
    CHECK(contains(message, "not a regular file"));
  }

  SUBCASE("empty file, plain and gzip") {
    write_plain(tmp.file("empty"), {});
    check_read_fails(tmp.file("empty"), {"empty"});
    write_gz(tmp.file("empty.gz"), {});
    check_read_fails(tmp.file("empty.gz"), {"empty"});
  }

  SUBCASE("header cut short") {
    write_plain(tmp.file("short"), {0x00, 0x00, 0x08});
    check_read_fails(tmp.file("short"), {"truncated", "header"});
    write_plain(tmp.file("short_dims"), {0x00, 0x00, 0x08, 0x03, 0x00, 0x00, 0x00, 0x02, 0x00});
    check_read_fails(tmp.file("short_dims"), {"truncated", "dimension"});
  }

  SUBCASE("wrong magic") {
    Bytes b = idx_file({4}, iota_bytes(4));
    b[0] = 0x12;
    b[1] = 0x34;
    write_plain(tmp.file("magic"), b);
    check_read_fails(tmp.file("magic"), {"magic", "0x12 0x34"});
  }

  SUBCASE("wrong type byte") {
    Bytes b = idx_header(0x0D, {4});
    b.resize(b.size() + 16);  // four float32 values
    write_plain(tmp.file("float"), b);
    check_read_fails(tmp.file("float"), {"type", "0x0D", "float32"});
    Bytes u = idx_header(0x42, {4});
    u.resize(u.size() + 4);
    write_plain(tmp.file("unknown"), u);
    check_read_fails(tmp.file("unknown"), {"type", "0x42", "unknown"});
  }

  SUBCASE("ndim 0 and 5") {
    write_plain(tmp.file("ndim0"), {0x00, 0x00, 0x08, 0x00, 0x01, 0x02});
    check_read_fails(tmp.file("ndim0"), {"0 dimensions"});
    write_plain(tmp.file("ndim5"), idx_file({1, 1, 1, 1, 2}, iota_bytes(2)));
    check_read_fails(tmp.file("ndim5"), {"5 dimensions"});
  }

  SUBCASE("a zero dimension") {
    write_plain(tmp.file("zero"), idx_file({3, 0, 2}, {}));
    check_read_fails(tmp.file("zero"), {"dimension 1 is 0"});
  }

  SUBCASE("truncated payload, plain and gzip") {
    const Bytes b = idx_file({2, 3, 4}, iota_bytes(20));  // 24 needed
    write_plain(tmp.file("trunc"), b);
    check_read_fails(tmp.file("trunc"), {"truncated", "24 bytes", "found 20"});
    write_gz(tmp.file("trunc.gz"), b);
    check_read_fails(tmp.file("trunc.gz"), {"truncated", "24 bytes", "found 20"});
  }

  SUBCASE("trailing bytes") {
    write_plain(tmp.file("trail"), idx_file({2, 3}, iota_bytes(9)));
    check_read_fails(tmp.file("trail"), {"trailing", "expected 6 bytes", "3 more"});
    write_gz(tmp.file("trail.gz"), idx_file({2, 3}, iota_bytes(9)));
    check_read_fails(tmp.file("trail.gz"), {"trailing", "3 more"});
  }

  SUBCASE("a header claiming a huge payload in a tiny file fails fast") {
    // Over the 4 GiB cap, and overflowing 32 bits on the way: refused from the header alone.
    write_plain(tmp.file("huge"), idx_file({0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, iota_bytes(8)));
    check_read_fails(tmp.file("huge"), {"too large"});
    write_plain(tmp.file("huge3"), idx_file({60000, 28000, 28000}, iota_bytes(8)));
    check_read_fails(tmp.file("huge3"), {"too large"});
    // Just under the cap: accepted by the header check, so it must be read incrementally and
    // found short, without allocating what the header claims.
    write_plain(tmp.file("almost"), idx_file({1, 65536, 65535}, iota_bytes(10)));
    check_read_fails(tmp.file("almost"), {"truncated", "4294901760 bytes", "found 10"});
    write_gz(tmp.file("almost.gz"), idx_file({1, 65536, 65535}, iota_bytes(10)));
    check_read_fails(tmp.file("almost.gz"), {"truncated", "4294901760 bytes", "found 10"});
  }

  SUBCASE("corrupt gzip: a gzip header then garbage") {
    Bytes b = {0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03};
    for (int i = 0; i < 64; ++i) b.push_back(static_cast<std::uint8_t>(0xff - i));
    write_plain(tmp.file("garbage.gz"), b);
    check_read_fails(tmp.file("garbage.gz"), {"gzip", "corrupt"});
  }

  SUBCASE("gzip stream cut short") {
    write_gz(tmp.file("whole.gz"), idx_file({64, 64}, iota_bytes(64 * 64)));
    Bytes b = read_raw(tmp.file("whole.gz"));
    REQUIRE(b.size() > 40);
    b.resize(b.size() / 2);
    write_plain(tmp.file("cut.gz"), b);
    check_read_fails(tmp.file("cut.gz"), {"gzip", "truncated"});
  }

  SUBCASE("gzip checksum mismatch") {
    write_gz(tmp.file("crc.gz"), idx_file({16}, iota_bytes(16)));
    Bytes b = read_raw(tmp.file("crc.gz"));
    b[b.size() - 8] ^= 0x5a;  // first byte of the CRC-32 trailer
    write_plain(tmp.file("crc.gz"), b);
    check_read_fails(tmp.file("crc.gz"), {"gzip", "corrupt"});
  }
}

TEST_CASE("load_idx_pair builds an NCHW float dataset in [0,1]") {
  TempDir tmp;
  const Bytes pixels = {0, 255, 51, 102, 1, 254,  //
                        10, 20, 30, 40, 50, 60,   //
                        7, 7, 7, 7, 7, 7};
  const Bytes labels = {9, 0, 3};
  write_plain(tmp.file("img"), idx_file({3, 2, 3}, pixels));
  write_gz(tmp.file("lbl.gz"), idx_file({3}, labels));

  const Dataset ds = fusedp::data::load_idx_pair(tmp.file("img"), tmp.file("lbl.gz"));
  CHECK(ds.count == 3);
  CHECK(ds.channels == 1);
  CHECK(ds.height == 2);
  CHECK(ds.width == 3);
  CHECK(ds.classes == 10);
  REQUIRE(ds.images.size() == pixels.size());
  for (std::size_t i = 0; i < pixels.size(); ++i) CHECK(ds.images[i] == static_cast<float>(pixels[i]) / 255.0f);
  CHECK(ds.images[0] == 0.0f);
  CHECK(ds.images[1] == 1.0f);
  CHECK(ds.labels == std::vector<std::int32_t>{9, 0, 3});

  const Dataset few = fusedp::data::load_idx_pair(tmp.file("img"), tmp.file("lbl.gz"), 12);
  CHECK(few.classes == 12);
}

TEST_CASE("load_idx_pair rejects inconsistent image and label files") {
  TempDir tmp;
  const std::string img = tmp.file("images"), lbl = tmp.file("labels");

  SUBCASE("count mismatch names both files and both counts") {
    write_plain(img, idx_file({4, 2, 2}, iota_bytes(16)));
    write_plain(lbl, idx_file({3}, {1, 2, 3}));
    const std::string m = data_error_of([&] { (void)fusedp::data::load_idx_pair(img, lbl); });
    INFO("message: " << m);
    CHECK(contains(m, img));
    CHECK(contains(m, lbl));
    CHECK(contains(m, "mismatch"));
    CHECK(contains(m, "4 images"));
    CHECK(contains(m, "3 labels"));
  }

  SUBCASE("label out of range names the file, the index and the value") {
    write_plain(img, idx_file({5, 2, 2}, iota_bytes(20)));
    write_plain(lbl, idx_file({5}, {0, 9, 4, 12, 1}));
    const std::string m = data_error_of([&] { (void)fusedp::data::load_idx_pair(img, lbl); });
    INFO("message: " << m);
    CHECK(contains(m, lbl));
    CHECK(contains(m, "index 3"));
    CHECK(contains(m, "is 12"));
    CHECK(contains(m, "range"));
    // The same labels are valid with more classes; label 9 is not with 5.
    CHECK_NOTHROW((void)fusedp::data::load_idx_pair(img, lbl, 13));
    const std::string m5 = data_error_of([&] { (void)fusedp::data::load_idx_pair(img, lbl, 5); });
    CHECK(contains(m5, "index 1"));
  }

  SUBCASE("wrong number of dimensions") {
    write_plain(img, idx_file({4, 4}, iota_bytes(16)));
    write_plain(lbl, idx_file({4}, {1, 2, 3, 4}));
    std::string m = data_error_of([&] { (void)fusedp::data::load_idx_pair(img, lbl); });
    CHECK(contains(m, img));
    CHECK(contains(m, "3 dimensions"));

    write_plain(img, idx_file({4, 2, 2}, iota_bytes(16)));
    write_plain(lbl, idx_file({4, 1}, {1, 2, 3, 4}));
    m = data_error_of([&] { (void)fusedp::data::load_idx_pair(img, lbl); });
    CHECK(contains(m, lbl));
    CHECK(contains(m, "1 dimension"));
  }

  SUBCASE("zero classes is an invalid argument") {
    write_plain(img, idx_file({1, 1, 1}, {5}));
    write_plain(lbl, idx_file({1}, {0}));
    CHECK_THROWS_AS((void)fusedp::data::load_idx_pair(img, lbl, 0), fusedp::InvalidArgument);
  }
}

TEST_CASE("load_mnist finds plain or gzip files by their standard names") {
  TempDir tmp;
  // Train split plain, test split gzip'd, as the two common layouts.
  write_plain(tmp.file("train-images-idx3-ubyte"), idx_file({2, 2, 2}, iota_bytes(8)));
  write_plain(tmp.file("train-labels-idx1-ubyte"), idx_file({2}, {4, 5}));
  write_gz(tmp.file("t10k-images-idx3-ubyte.gz"), idx_file({3, 1, 2}, iota_bytes(6)));
  write_gz(tmp.file("t10k-labels-idx1-ubyte.gz"), idx_file({3}, {7, 8, 9}));

  const Dataset train = fusedp::data::load_mnist(tmp.path.string(), Split::train);
  CHECK(train.count == 2);
  CHECK(train.labels == std::vector<std::int32_t>{4, 5});
  const Dataset test = fusedp::data::load_mnist(tmp.path.string(), Split::test);
  CHECK(test.count == 3);
  CHECK(test.height == 1);
  CHECK(test.width == 2);
  CHECK(test.labels == std::vector<std::int32_t>{7, 8, 9});

  SUBCASE("the plain file wins when both exist") {
    write_plain(tmp.file("train-images-idx3-ubyte.gz"), {0x1f, 0x8b, 0xff});  // would fail if read
    CHECK(fusedp::data::load_mnist(tmp.path.string(), Split::train).count == 2);
  }

  SUBCASE("a missing file names the folder and the names looked for") {
    fs::remove(tmp.path / "t10k-labels-idx1-ubyte.gz");
    const std::string m = data_error_of([&] { (void)fusedp::data::load_mnist(tmp.path.string(), Split::test); });
    INFO("message: " << m);
    CHECK(contains(m, tmp.path.string()));
    CHECK(contains(m, "t10k-labels-idx1-ubyte"));
    CHECK(contains(m, "t10k-labels-idx1-ubyte.gz"));
  }

  SUBCASE("a missing folder names the folder and the names looked for") {
    const std::string dir = tmp.file("no_such_folder");
    const std::string m = data_error_of([&] { (void)fusedp::data::load_mnist(dir, Split::train); });
    INFO("message: " << m);
    CHECK(contains(m, dir));
    CHECK(contains(m, "does not exist"));
    CHECK(contains(m, "train-images-idx3-ubyte"));
    CHECK(contains(m, "train-labels-idx1-ubyte"));
  }

  SUBCASE("a file where the folder should be") {
    const std::string m =
        data_error_of([&] { (void)fusedp::data::load_mnist(tmp.file("train-labels-idx1-ubyte"), Split::train); });
    CHECK(contains(m, "not a folder"));
  }
}

TEST_CASE("mean_std and normalize") {
  Dataset ds;
  ds.images = {0.0f, 0.25f, 0.5f, 1.0f};
  ds.count = 1;
  ds.channels = 1;
  ds.height = 2;
  ds.width = 2;
  const auto [mean, stddev] = fusedp::data::mean_std(ds);
  CHECK(mean == doctest::Approx(0.4375));
  // sqrt((0.4375^2 + 0.1875^2 + 0.0625^2 + 0.5625^2) / 4), the population std
  CHECK(stddev == doctest::Approx(0.369755).epsilon(1e-5));
  fusedp::data::normalize(ds, mean, stddev);
  const auto [m2, s2] = fusedp::data::mean_std(ds);
  CHECK(m2 == doctest::Approx(0.0).epsilon(1e-6));
  CHECK(s2 == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(ds.images[0] == (0.0f - mean) / stddev);

  CHECK_THROWS_AS(fusedp::data::normalize(ds, 0.0f, 0.0f), fusedp::InvalidArgument);
  CHECK_THROWS_AS(fusedp::data::normalize(ds, 0.0f, -1.0f), fusedp::InvalidArgument);
  CHECK_THROWS_AS((void)fusedp::data::mean_std(Dataset{}), fusedp::InvalidArgument);
}

TEST_CASE("Fashion-MNIST test split from Debian's dataset-fashion-mnist") {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::is_directory(dir)) {
    MESSAGE("skipped: " << dir << " is absent (apt-get install dataset-fashion-mnist)");
    return;
  }
  const Dataset ds = fusedp::data::load_mnist(dir, Split::test);
  CHECK(ds.count == 10'000);
  CHECK(ds.channels == 1);
  CHECK(ds.height == 28);
  CHECK(ds.width == 28);
  CHECK(ds.classes == 10);
  REQUIRE(ds.images.size() == 10'000u * 28 * 28);
  REQUIRE(ds.labels.size() == 10'000u);

  std::array<std::size_t, 10> per_class{};
  bool labels_in_range = true;
  for (std::int32_t l : ds.labels) {
    if (l < 0 || l > 9) {
      labels_in_range = false;
      continue;
    }
    ++per_class[static_cast<std::size_t>(l)];
  }
  CHECK(labels_in_range);
  for (std::size_t c = 0; c < 10; ++c) {
    CAPTURE(c);
    CHECK(per_class[c] > 0);
  }

  float lo = 1.0f, hi = 0.0f;
  for (float x : ds.images) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  CHECK(lo == 0.0f);
  CHECK(hi == 1.0f);
  const auto [mean, stddev] = fusedp::data::mean_std(ds);
  // Fashion-MNIST pixels are mostly dark background: mean about 0.29, std about 0.35.
  CHECK(mean > 0.2f);
  CHECK(mean < 0.4f);
  CHECK(stddev > 0.25f);
  CHECK(stddev < 0.45f);
}
