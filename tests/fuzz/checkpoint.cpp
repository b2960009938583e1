// libFuzzer target: include/fusedp/train/checkpoint.hpp (read_training_state, load_checkpoint,
// load_weights, and the recovery of an interrupted save that save_checkpoint performs).
//
// Input: one flag byte, then up to three parts cut at the separator (fuzz_common.hpp): the training
// state, the weights, and the temporary weights of an interrupted save; each part present becomes
// training_state.safetensors, model.safetensors, model.safetensors.tmp in a fresh folder, a missing
// one no file. Flags, applied after mutation (see checksum_fixup.hpp):
//   bit 0  repair the checksum of both weights files
//   bit 1  make the state's "weights.crc32" name the weights (bit 5: the temporary weights)
//   bit 2  repair the state's checksum (after bit 1)
//   bit 3  after a successful load, save the model again and load that back (a round trip)
//   bit 4  an Adam model instead of Sgd with momentum
// Checked: every call returns or throws a DataError naming a file of the folder; a failed load
// leaves the model exactly as it was; load_checkpoint succeeds only where read_training_state does
// and returns the same state; a successful load survives a save and reload unchanged.
#include "fusedp/layers/input.hpp"
#include "fusedp/layers/linear.hpp"
#include "fusedp/net/model.hpp"
#include "fusedp/optim/adam.hpp"
#include "fusedp/optim/sgd.hpp"
#include "fusedp/train/checkpoint.hpp"

#include "checksum_fixup.hpp"
#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace fusedp_fuzz;
namespace fp = fusedp;
namespace ft = fusedp::train;
namespace fs = std::filesystem;

using Net = fp::Sequential<fp::Input<4>, fp::Linear<3>>;
using Model = fp::Model<Net, fp::Host>;

// Compared bit for bit: a checkpoint may hold NaNs, and they must come back as they were.
std::vector<std::uint32_t> bits(std::span<const float> v) {
  std::vector<std::uint32_t> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size_bytes());
  return out;
}

struct Snapshot {
  std::vector<std::uint32_t> params, state;
  std::string optimizer;
  std::uint64_t steps = 0, optimizer_steps = 0;
  explicit Snapshot(const Model& m)
      : params(bits(m.params())),
        state(bits(m.optimizer_state())),
        optimizer(m.optimizer_name() ? m.optimizer_name() : ""),
        steps(m.steps()),
        optimizer_steps(m.optimizer_steps()) {}
  bool operator==(const Snapshot&) const = default;
};

// Every field but the version, which a save stamps with this fusedp's (a file without one loads).
bool same_state(const ft::TrainingState& a, const ft::TrainingState& b) {
  return a.epochs_done == b.epochs_done && a.batches_done == b.batches_done && a.samples_done == b.samples_done && a.data_seed == b.data_seed &&
         a.dataset_size == b.dataset_size && a.batch_size == b.batch_size && a.world_size == b.world_size &&
         a.extra == b.extra && a.model_seed == b.model_seed && a.steps == b.steps &&
         a.optimizer_steps == b.optimizer_steps && a.optimizer == b.optimizer && a.fingerprint == b.fingerprint;
}

void write_file(const std::string& path, const Bytes& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail("cannot write " + path);
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) fail("cannot write " + path);
  std::fclose(f);
}

template <class Opt>
void run(const std::string& dir, const Opt& opt, bool round_trip) {
  static const fp::Host host{1};  // copies share its pool
  std::optional<ft::TrainingState> read;
  expect_data_error([&] { read = ft::read_training_state(dir); }, {dir});

  // As a resuming program does: the model is made from the seed the state gives.
  Model model{fp::seed(read ? read->model_seed : 0), host};
  const Snapshot before(model);
  std::optional<ft::TrainingState> loaded;
  expect_data_error([&] { loaded = ft::load_checkpoint(dir, model, opt); }, {dir});
  if (!loaded) {
    check(Snapshot(model) == before, "a failed load_checkpoint changed the model");
  } else {
    check(read.has_value(), "load_checkpoint accepted a folder that read_training_state refused");
    check(same_state(*read, *loaded) && read->version == loaded->version,
          "load_checkpoint and read_training_state return different states");
  }

  Model other{fp::seed(1), host};
  const Snapshot other_before(other);
  const std::string weights = dir + "/" + ft::weights_file_name;
  if (!expect_data_error([&] { ft::load_weights(weights, other); }, {weights}))
    check(Snapshot(other) == other_before, "a failed load_weights changed the model");

  if (loaded && round_trip) {
    const Snapshot after_load(model);
    if (!expect_data_error([&] { ft::save_checkpoint(dir, model, *loaded); }, {}))
      fail("saving a loaded checkpoint failed");
    Model again{fp::seed(loaded->model_seed), host};
    std::optional<ft::TrainingState> reloaded;
    if (!expect_data_error([&] { reloaded = ft::load_checkpoint(dir, again, opt); }, {}))
      fail("a checkpoint saved from a loaded one does not load");
    check(Snapshot(again) == after_load, "a checkpoint changed in a save and reload");
    check(same_state(*loaded, *reloaded), "the training state changed in a save and reload");
    check(reloaded->version == FUSEDP_VERSION_STRING, "a save did not record this fusedp's version");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static ScratchDir scratch;
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::vector<Bytes> parts = split({data + 1, size - 1}, 3);

  const std::string dir = scratch.file("ckpt");
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directory(dir, ec);
  if (ec) fail("cannot make " + dir + ": " + ec.message());

  std::optional<std::uint32_t> crc[3];
  if (flags & 1)
    for (std::size_t i = 1; i < parts.size(); ++i) crc[i] = fix_checksum(parts[i]);
  const std::size_t named = (flags & 32) ? 2 : 1;
  if ((flags & 2) && parts.size() > named) {
    std::optional<std::uint32_t> c = crc[named];
    if (!c) {  // the checksum the file has, whether right or not
      ft::SafetensorsFile f;
      if (expect_data_error([&] { f = ft::parse_safetensors("part", parts[named]); }, {"part"})) c = f.crc32;
    }
    if (c) (void)set_meta_digits(parts[0], "weights.crc32", ft::detail::hex32(*c));
  }
  if (flags & 4) (void)fix_checksum(parts[0]);

  write_file(dir + "/" + ft::state_file_name, parts[0]);
  if (parts.size() > 1) write_file(dir + "/" + ft::weights_file_name, parts[1]);
  if (parts.size() > 2) write_file(dir + "/" + ft::weights_file_name + ".tmp", parts[2]);

  const bool round_trip = flags & 8;
  if (flags & 16)
    run(dir, fp::Adam{{.lr = 0.01f}}, round_trip);
  else
    run(dir, fp::Sgd{{.lr = 0.1f, .momentum = 0.9f}}, round_trip);
  return 0;
}
