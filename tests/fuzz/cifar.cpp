// libFuzzer target: include/fusedp/data/cifar.hpp (read_cifar10_batch, append_cifar10_batch).
//
// The input is a CIFAR-10 binary batch as it would lie on disk. Checked:
//   - read_cifar10_batch returns a Dataset that passes fusedp::data::validate, holding exactly the
//     file's records, or throws a DataError naming the file;
//   - append_cifar10_batch onto a Dataset that already holds a record leaves it unchanged when it
//     throws, and adds exactly the file's records when it does not.
#include "fusedp/data/cifar.hpp"

#include "fuzz_common.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace {

using namespace fusedp_fuzz;
using fusedp::data::Dataset;

bool same(const Dataset& a, const Dataset& b) {
  return a.images == b.images && a.labels == b.labels && a.count == b.count && a.channels == b.channels &&
         a.height == b.height && a.width == b.width && a.classes == b.classes;
}

Dataset one_record() {
  Dataset d;
  d.count = 1;
  d.channels = 3;
  d.height = 32;
  d.width = 32;
  d.classes = 10;
  d.labels = {7};
  d.images.assign(3 * 32 * 32, 0.5f);
  return d;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static MemFile file("cifar.bin");
  static const Dataset base = one_record();
  file.write({data, size});

  Dataset ds;
  const bool ok = expect_data_error([&] { ds = fusedp::data::read_cifar10_batch(file.path()); }, {file.path()});
  if (ok) {
    check(size % fusedp::data::cifar10_record_bytes == 0, "a batch whose size is not whole records was accepted");
    check(ds.count == size / fusedp::data::cifar10_record_bytes, "the record count differs from the file size");
    expect_data_error([&] { fusedp::data::validate(ds, "loaded batch"); }, {});
    for (float v : ds.images) check(v >= 0.0f && v <= 1.0f, "a pixel outside [0, 1]");
  }

  Dataset grown = base;
  const bool appended = expect_data_error([&] { fusedp::data::append_cifar10_batch(file.path(), grown); }, {file.path()});
  check(appended == ok, "read_cifar10_batch and append_cifar10_batch disagree about the file");
  if (appended) {
    check(grown.count == base.count + ds.count, "append added the wrong number of records");
    check(std::equal(base.images.begin(), base.images.end(), grown.images.begin()), "append changed earlier samples");
    check(std::equal(ds.images.begin(), ds.images.end(), grown.images.begin() + std::ptrdiff_t(base.images.size())),
          "append and read disagree about the pixels");
  } else {
    check(same(grown, base), "a failed append changed the Dataset");
  }
  return 0;
}
