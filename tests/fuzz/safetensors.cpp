// libFuzzer target: include/fusedp/train/safetensors.hpp (parse_safetensors from memory,
// read_safetensors from a file, SafetensorsFile::read_f32).
//
// Input: one flag byte, then the file. Flag bit 0 repairs fusedp's checksum after mutation (see
// checksum_fixup.hpp). Checked:
//   - parse_safetensors and read_safetensors of the same bytes agree, and either throw a DataError
//     naming the file or return a file whose tensors lie inside the data, contiguous, each as large
//     as its dtype and shape say;
//   - read_f32 copies every F32 tensor into a buffer of its size and refuses any other size or dtype
//     with a DataError;
//   - a file of F32 tensors written again with encode_safetensors parses to the same tensors.
#include "fusedp/train/safetensors.hpp"

#include "checksum_fixup.hpp"
#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

using namespace fusedp_fuzz;
namespace ft = fusedp::train;

constexpr const char* name = "fuzz.safetensors";

void check_file(const ft::SafetensorsFile& f) {
  const auto header = header_of(f.bytes);
  check(header.has_value() && f.data_start == 8 + header->size() && f.data_start <= f.bytes.size(),
        "data_start disagrees with the header length");
  const std::size_t data_size = f.bytes.size() - f.data_start;
  std::size_t at = 0;
  for (const ft::SafetensorsTensor& t : f.tensors) {
    check(t.begin == at && t.begin <= t.end && t.end <= data_size, "tensor '" + t.name + "' lies outside the data");
    at = t.end;
    const std::size_t elem = ft::detail::dtype_bytes(t.dtype);
    check(elem > 0, "tensor '" + t.name + "' has an unknown dtype but was accepted");
    std::size_t n = 1;
    for (std::size_t d : t.shape) n *= d;  // cannot overflow: the parser checked it
    check(n * elem == t.end - t.begin, "tensor '" + t.name + "' is not as large as its shape says");

    const std::size_t floats = (t.end - t.begin) / sizeof(float);
    std::vector<float> out(floats + 1);
    const bool read = expect_data_error([&] { f.read_f32(t, {out.data(), floats}); }, {name});
    check(read == (t.dtype == "F32"), "read_f32 of tensor '" + t.name + "' (" + t.dtype + ") " +
                                          (read ? "succeeded" : "failed"));
    if (read)
      check(std::memcmp(out.data(), f.bytes.data() + f.data_start + t.begin, t.end - t.begin) == 0,
            "read_f32 copied other bytes than the tensor's");
    check(!expect_data_error([&] { f.read_f32(t, {out.data(), floats + 1}); }, {name}),
          "read_f32 into a buffer of the wrong size succeeded");
  }
  check(at == data_size, "the tensors do not cover the data");
}

// Every tensor F32: encode the values again and parse them back.
void check_round_trip(const ft::SafetensorsFile& f) {
  std::vector<std::vector<float>> values;
  std::vector<ft::TensorToWrite> tensors;
  values.reserve(f.tensors.size());
  for (const ft::SafetensorsTensor& t : f.tensors) {
    if (t.dtype != "F32") return;
    values.emplace_back((t.end - t.begin) / sizeof(float));
    f.read_f32(t, values.back());
    tensors.push_back({t.name, t.shape, values.back()});
  }
  std::vector<std::pair<std::string, std::string>> meta;
  for (const auto& [k, v] : f.metadata)
    if (k != ft::checksum_key) meta.emplace_back(k, v);
  const Bytes again = ft::encode_safetensors(tensors, meta);
  std::optional<ft::SafetensorsFile> g;
  if (!expect_data_error([&] { g = ft::parse_safetensors(name, again); }, {}))
    fail("a re-encoded file does not parse");
  check(g->tensors.size() == f.tensors.size(), "the re-encoded file has another tensor count");
  for (const ft::SafetensorsTensor& t : f.tensors) {
    const ft::SafetensorsTensor* u = g->find(t.name);
    check(u && u->shape == t.shape && u->dtype == "F32", "tensor '" + t.name + "' changed in the round trip");
    check(std::memcmp(f.bytes.data() + f.data_start + t.begin, g->bytes.data() + g->data_start + u->begin,
                      t.end - t.begin) == 0,
          "the values of tensor '" + t.name + "' changed in the round trip");
  }
  for (const auto& [k, v] : meta) check(g->meta(k) && *g->meta(k) == v, "metadata '" + k + "' changed in the round trip");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static MemFile file("fuzz.safetensors");
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  Bytes bytes(data + 1, data + size);
  if (flags & 1) (void)fix_checksum(bytes);

  std::optional<ft::SafetensorsFile> f;
  expect_data_error([&] { f = ft::parse_safetensors(name, bytes); }, {name});

  file.write(bytes);
  std::optional<ft::SafetensorsFile> g;
  expect_data_error([&] { g = ft::read_safetensors(file.path()); }, {file.path()});
  check(f.has_value() == g.has_value(), "parse_safetensors and read_safetensors disagree");
  if (!f) return 0;

  check(f->bytes == bytes && g->bytes == bytes, "the parsed file does not hold the input's bytes");
  check(f->tensors.size() == g->tensors.size() && f->metadata == g->metadata && f->crc32 == g->crc32,
        "parse_safetensors and read_safetensors read different contents");
  check_file(*f);
  check_round_trip(*f);
  return 0;
}
