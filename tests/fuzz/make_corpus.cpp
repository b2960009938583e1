// Writes the seed corpora of the fuzz targets into <out>/{idx,cifar,safetensors,checkpoint}/: small
// valid files of every kind each reader accepts, so that mutation starts from inputs that reach the
// deepest checks. Built and run by tests/fuzz/run.sh; regressions live in tests/fuzz/corpus/.
#include "fusedp/data/cifar.hpp"
#include "fusedp/layers/input.hpp"
#include "fusedp/layers/linear.hpp"
#include "fusedp/loss/softmax_cross_entropy.hpp"
#include "fusedp/net/model.hpp"
#include "fusedp/optim/adam.hpp"
#include "fusedp/optim/sgd.hpp"
#include "fusedp/train/checkpoint.hpp"

#include "fuzz_common.hpp"

#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fp = fusedp;
namespace ft = fusedp::train;
namespace fs = std::filesystem;
using fusedp_fuzz::Bytes;
using fusedp_fuzz::join;

using Net = fp::Sequential<fp::Input<4>, fp::Linear<3>>;
using Model = fp::Model<Net, fp::Host>;

fs::path out;

void put(const std::string& target, const std::string& name, const Bytes& b) {
  fs::create_directories(out / target);
  std::ofstream f(out / target / name, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!f) throw std::runtime_error("cannot write " + (out / target / name).string());
}

Bytes read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

Bytes cat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Bytes gzip(const Bytes& in) {
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  Bytes o(deflateBound(&z, uLong(in.size())) + 32);
  z.next_in = const_cast<Bytef*>(in.data());
  z.avail_in = uInt(in.size());
  z.next_out = o.data();
  z.avail_out = uInt(o.size());
  deflate(&z, Z_FINISH);
  o.resize(z.total_out);
  deflateEnd(&z);
  return o;
}

Bytes idx(const std::vector<std::uint32_t>& dims, std::uint8_t step, std::uint8_t modulo = 0) {
  Bytes b = {0, 0, 0x08, std::uint8_t(dims.size())};
  std::size_t n = 1;
  for (std::uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(std::uint8_t(d >> s));
    n *= d;
  }
  for (std::size_t i = 0; i < n; ++i) b.push_back(std::uint8_t(modulo ? i % modulo : i * step));
  return b;
}

void idx_seeds() {
  const Bytes images = idx({3, 4, 4}, 17), labels = idx({3}, 0, 10), cube = idx({2, 2, 2, 2}, 5);
  put("idx", "images", images);
  put("idx", "labels", labels);
  put("idx", "cube4d", cube);
  put("idx", "images.gz", gzip(images));
  put("idx", "labels.gz", gzip(labels));
  put("idx", "pair", join({images, labels}));
  put("idx", "pair.gz", join({gzip(images), gzip(labels)}));
  put("idx", "pair-mixed", join({gzip(images), labels}));
}

void cifar_seeds() {
  Bytes one(fp::data::cifar10_record_bytes);
  for (std::size_t i = 0; i < one.size(); ++i) one[i] = std::uint8_t(i * 13);
  one[0] = 3;
  put("cifar", "one-record", one);
  Bytes two = cat(one, one);
  two[fp::data::cifar10_record_bytes] = 9;
  put("cifar", "two-records", two);
}

Bytes raw_safetensors(const std::string& header, const Bytes& data) {
  Bytes b(8);
  for (int i = 0; i < 8; ++i) b[std::size_t(i)] = std::uint8_t(std::uint64_t(header.size()) >> (8 * i));
  b.insert(b.end(), header.begin(), header.end());
  return cat(b, data);
}

void safetensors_seeds() {
  const std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 5.0f, 6.0f}, b = {0.5f};
  const std::vector<ft::TensorToWrite> tensors = {{"layer.weight", {2, 3}, a}, {"layer.bias", {1}, b}};
  const Bytes fusedp_file = ft::encode_safetensors(tensors, {{"format", "pt"}, {"fusedp.kind", "weights"}});
  put("safetensors", "fusedp-checksum-repaired", cat({1}, fusedp_file));
  put("safetensors", "fusedp-checksum-as-is", cat({0}, fusedp_file));
  // As PyTorch's safetensors writes: no checksum, several dtypes, a scalar, an empty tensor.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"f":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("h":{"dtype":"F16","shape":[2,1],"data_offsets":[8,12]},"i":{"dtype":"I8","shape":[],"data_offsets":[12,13]},)"
      R"("e":{"dtype":"BOOL","shape":[0,4],"data_offsets":[13,13]},"d":{"dtype":"F64","shape":[1],"data_offsets":[13,21]}})";
  Bytes data(21);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::uint8_t(i * 29 + 1);
  put("safetensors", "torch-like", cat({0}, raw_safetensors(header, data)));
  put("safetensors", "empty-header", cat({0}, raw_safetensors("{}", {})));
}

std::vector<float> inputs() { return {0.1f, -0.2f, 0.3f, 0.4f, -1.0f, 0.5f, 0.25f, 0.0f}; }
std::vector<std::int32_t> labels() { return {0, 2}; }

ft::TrainingState state() {
  ft::TrainingState s;
  s.epochs_done = 2;
  s.batches_done = 1;
  s.samples_done = 2;
  s.data_seed = 7;
  s.dataset_size = 100;
  s.batch_size = 2;
  s.extra["note"] = "seed";
  return s;
}

template <class Opt>
void checkpoint_seeds(const std::string& tag, const Opt& opt, std::uint8_t extra_flags) {
  const fs::path dir = out / ("tmp-" + tag);
  fs::remove_all(dir);
  Model m{fp::seed(5), fp::Host{1}};
  const auto x = inputs();
  const auto y = labels();
  if (tag != "fresh") (void)m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  ft::save_checkpoint(dir.string(), m, state());
  const Bytes st = read(dir / ft::state_file_name), w = read(dir / ft::weights_file_name);
  const std::uint8_t fix = 1 | 2 | 4;
  put("checkpoint", tag, cat({std::uint8_t(fix | extra_flags)}, join({st, w})));
  put("checkpoint", tag + "-round-trip", cat({std::uint8_t(fix | 8 | extra_flags)}, join({st, w})));
  put("checkpoint", tag + "-checksums-as-is", cat({extra_flags}, join({st, w})));
  put("checkpoint", tag + "-state-only", cat({std::uint8_t(fix | extra_flags)}, st));

  // A save interrupted between its two renames: the committed state, the previous weights, and the
  // fsync'd temporary weights the state names.
  (void)m.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  ft::detail::save_checkpoint(dir.string(), m, state(), ft::detail::SaveStop::after_commit);
  const Bytes st2 = read(dir / ft::state_file_name), tmp = read(dir / (std::string(ft::weights_file_name) + ".tmp"));
  put("checkpoint", tag + "-interrupted", cat({std::uint8_t(fix | 32 | extra_flags)}, join({st2, w, tmp})));
  put("checkpoint", tag + "-interrupted-round-trip", cat({std::uint8_t(fix | 8 | 32 | extra_flags)}, join({st2, w, tmp})));
  fs::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output folder>\n", argv[0]);
    return 2;
  }
  out = argv[1];
  idx_seeds();
  cifar_seeds();
  safetensors_seeds();
  checkpoint_seeds("sgd", fp::Sgd{{.lr = 0.1f, .momentum = 0.9f}}, 0);
  checkpoint_seeds("fresh", fp::Sgd{{.lr = 0.1f, .momentum = 0.9f}}, 0);
  checkpoint_seeds("adam", fp::Adam{{.lr = 0.01f}}, 16);
  return 0;
}
