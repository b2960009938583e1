// libFuzzer target: include/fusedp/data/idx.hpp (read_idx, load_idx_pair), plain and gzip.
//
// The input is an IDX file as it would lie on disk (gzip'd when it starts with 1f 8b). Checked:
//   - read_idx returns a well-formed array or throws a DataError naming the file;
//   - the same bytes gzip'd read the same (the same array, or a DataError too);
//   - when the input holds the separator, the two parts are an images and a labels file for
//     load_idx_pair, whose Dataset must pass fusedp::data::validate.
#include "fusedp/data/idx.hpp"

#include "fuzz_common.hpp"

#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace {

using namespace fusedp_fuzz;
using fusedp::data::IdxArray;

Bytes gzip(std::span<const std::uint8_t> in) {
  z_stream z{};
  check(deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK, "deflateInit2");
  Bytes out(deflateBound(&z, uLong(in.size())) + 32);
  z.next_in = const_cast<Bytef*>(in.data());
  z.avail_in = uInt(in.size());
  z.next_out = out.data();
  z.avail_out = uInt(out.size());
  check(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

void check_array(const IdxArray& a) {
  check(!a.dims.empty() && a.dims.size() <= 4, "read_idx returned " + std::to_string(a.dims.size()) + " dimensions");
  std::size_t n = 1;
  for (std::size_t d : a.dims) {
    check(d > 0, "read_idx returned a zero dimension");
    n *= d;
  }
  check(n == a.data.size(), "read_idx: the payload size is not the product of the dimensions");
}

std::optional<IdxArray> read(const MemFile& f) {
  std::optional<IdxArray> out;
  expect_data_error([&] { out = fusedp::data::read_idx(f.path()); }, {f.path()});
  if (out) check_array(*out);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static MemFile plain("idx"), zipped("idx.gz"), images("images"), labels("labels");
  const std::span<const std::uint8_t> input(data, size);

  plain.write(input);
  const std::optional<IdxArray> a = read(plain);

  // A file starting with gzip's magic is decoded by the plain read already; gzip'ing it again
  // would compare two different files.
  if (size < 2 || data[0] != 0x1f || data[1] != 0x8b) {
    zipped.write(gzip(input));
    const std::optional<IdxArray> b = read(zipped);
    check(a.has_value() == b.has_value(), a ? "the plain file reads, its gzip'd copy does not"
                                            : "the gzip'd copy reads, the plain file does not");
    if (a) check(a->dims == b->dims && a->data == b->data, "the plain file and its gzip'd copy read differently");
  }

  const std::vector<Bytes> parts = split(input, 2);
  if (parts.size() == 2) {
    images.write(parts[0]);
    labels.write(parts[1]);
    fusedp::data::Dataset ds;
    const bool ok = expect_data_error(
        [&] { ds = fusedp::data::load_idx_pair(images.path(), labels.path(), 10); }, {images.path(), labels.path()});
    if (ok) {
      expect_data_error([&] { fusedp::data::validate(ds, "loaded pair"); }, {});
      for (float v : ds.images) check(v >= 0.0f && v <= 1.0f, "a pixel outside [0, 1]");
    }
  }
  return 0;
}
