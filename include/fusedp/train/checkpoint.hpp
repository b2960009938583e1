#pragma once
// Checkpoints. Two kinds of files, both in the safetensors layout (train/safetensors.hpp):
//
//   weights         one F32 tensor per parameter and per BatchNorm buffer (running_mean, running_var,
//                   num_batches_tracked as a scalar), named and shaped as PyTorch's state_dict of the
//                   equivalent module ("0.weight", "3.bias", "layer1.0.bn1.running_mean", ...), so
//                   `model.load_state_dict(load_file(path))` works; metadata: fusedp version,
//                   network fingerprint, checksum. PyTorch-written files (no fusedp metadata; an I64
//                   num_batches_tracked) load too.
//   training state  the optimizer's state per parameter ("0.weight.momentum_buffer", "0.weight.exp_avg",
//                   ...) and, as metadata, the optimizer's name, the step counters, the epoch and
//                   sampler position, the seeds, the dataset size, batch and world size, the
//                   fingerprint, the version and the checksum of the weights file it belongs to.
//
// save_checkpoint(dir, ...) writes both into the folder `dir` (model.safetensors and
// training_state.safetensors). A crash at any moment leaves a usable checkpoint: both files are
// first written to temporaries and fsync'd; renaming the training state commits the save; the weights
// are renamed after it. A loader that finds the committed state but the previous weights (a crash
// between the two renames) takes the fsync'd temporary weights the state names by checksum, and the
// next save finishes the rename first. Everything is read and verified (checksums, network,
// optimizer, shapes) before the model is touched; any problem is a DataError naming the file.
// Host and Cuda models read and write the same files (a device model's tensors are staged through
// host memory), so a run can be saved on a GPU and resumed on the CPU, or the other way round.
#include "fusedp/core/config.hpp"
#include "fusedp/core/error.hpp"
#include "fusedp/exec/host.hpp"
#include "fusedp/exec/trace.hpp"
#include "fusedp/layers/layer.hpp"
#include "fusedp/net/sequential.hpp"
#include "fusedp/train/durable_file.hpp"
#include "fusedp/train/safetensors.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedp::train {

inline constexpr const char* weights_file_name = "model.safetensors";
inline constexpr const char* state_file_name = "training_state.safetensors";
/// Version of the checkpoint layout; a file of a newer layout is refused with a clear message.
inline constexpr int checkpoint_format = 1;

/// Where a run stands, saved beside the weights. The caller sets the first group; save_checkpoint
/// fills the second from the model.
struct TrainingState {
  std::uint64_t epochs_done = 0;    ///< epochs completed
  std::uint64_t batches_done = 0;   ///< steps of the next epoch already trained
  /// Samples of the next epoch's global order already visited by all ranks together: the sampler
  /// position (data::EpochPosition, DataLoader::position) a resumed run starts from, at any world size.
  /// Left 0 with batches_done > 0 (a program written before it), in a file as in a save, or absent
  /// from a checkpoint, it is batches_done x batch_size x world_size (at most dataset_size).
  std::uint64_t samples_done = 0;
  std::uint64_t data_seed = 0;      ///< seed of the sampler and the augmentation
  std::uint64_t dataset_size = 0;   ///< training samples (a resumed run must see the same data)
  std::uint64_t batch_size = 0;     ///< samples per batch (per rank)
  std::uint64_t world_size = 1;     ///< ranks that trained together
  std::map<std::string, std::string> extra;  ///< anything else the program wants back (stored as "user.<key>")

  std::uint64_t model_seed = 0;       ///< Model::seed() (initialization and dropout masks)
  std::uint64_t steps = 0;            ///< Model::steps()
  std::uint64_t optimizer_steps = 0;  ///< Model::optimizer_steps()
  std::string optimizer;              ///< name of the optimizer whose state is saved ("" before any step)
  std::uint64_t fingerprint = 0;      ///< Net::fingerprint
  std::string version;                ///< fusedp version that wrote the checkpoint
};

namespace detail {

inline std::string hex64(std::uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The position of `s`'s batches_done steps of batch_size samples on world_size ranks, at most the
// epoch (a program that sets only batches_done, and checkpoints written before samples_done).
inline std::uint64_t samples_of_batches(const TrainingState& s) {
  std::uint64_t per_step = 0, samples = 0;
  if (__builtin_mul_overflow(s.batch_size, s.world_size, &per_step) ||
      __builtin_mul_overflow(s.batches_done, per_step, &samples))
    return s.dataset_size;
  return std::min(samples, s.dataset_size);
}

// samples_done as the state means it: a 0 beside batches_done > 0 stands for the batches' samples.
// Applied by both the writer and the reader, so a state survives a save and reload unchanged.
inline void fill_samples_done(TrainingState& s) {
  if (s.samples_done == 0 && s.batches_done > 0) s.samples_done = samples_of_batches(s);
}

inline std::uint64_t parse_u64(const SafetensorsFile& f, const std::string& key, bool hex = false) {
  const std::string* s = f.meta(key);
  if (!s) throw DataError(f.path, "metadata field '" + key + "' is missing");
  const std::string digits = hex ? (s->rfind("0x", 0) == 0 ? s->substr(2) : std::string()) : *s;
  const char* allowed = hex ? "0123456789abcdef" : "0123456789";
  if (digits.empty() || digits.size() > (hex ? 16u : 20u) || digits.find_first_not_of(allowed) != std::string::npos)
    throw DataError(f.path, "metadata field '" + key + "' is '" + *s + "', not a" + (hex ? " 0x-hex" : "n unsigned") +
                                " number");
  std::uint64_t v = 0;
  for (char c : digits) {
    const std::uint64_t d = std::uint64_t(c >= 'a' ? c - 'a' + 10 : c - '0');
    const std::uint64_t base = hex ? 16 : 10;
    if (v > (std::numeric_limits<std::uint64_t>::max() - d) / base)
      throw DataError(f.path, "metadata field '" + key + "' is '" + *s + "', out of range");
    v = v * base + d;
  }
  return v;
}

// A CRC-32 stored as 8 lowercase hex digits, as the files' own "fusedp.crc32".
inline std::uint32_t parse_crc32(const SafetensorsFile& f, const std::string& key) {
  const std::string* s = f.meta(key);
  if (!s) throw DataError(f.path, "metadata field '" + key + "' is missing");
  if (s->size() != 8 || s->find_first_not_of("0123456789abcdef") != std::string::npos)
    throw DataError(f.path, "metadata field '" + key + "' is '" + *s + "', not 8 hex digits");
  return static_cast<std::uint32_t>(std::stoul(*s, nullptr, 16));
}

/// The PyTorch state_dict key of a parameter or buffer ("3.weight", "layer1.0.bn1.running_var").
inline std::string tensor_name(const ParamTensor& t) { return t.name.c_str(); }
inline std::string tensor_name(const StateTensor& t) { return t.name.c_str(); }
template <class Tensor>
std::vector<std::size_t> tensor_shape(const Tensor& t) {
  std::vector<std::size_t> shape;
  for (int i = 0; i < t.rank; ++i) shape.push_back(std::size_t(t.dims[std::size_t(i)]));
  return shape;
}
inline std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// Names of the optimizer's state slots, as torch.optim calls them where fusedp knows the optimizer.
inline std::vector<std::string> slot_names(const std::string& optimizer, std::size_t slots) {
  if (optimizer == "Sgd" && slots == 1) return {"momentum_buffer"};
  if ((optimizer == "Adam" || optimizer == "AdamW") && slots == 2) return {"exp_avg", "exp_avg_sq"};
  std::vector<std::string> names;
  for (std::size_t s = 0; s < slots; ++s) names.push_back("slot" + std::to_string(s));
  return names;
}

template <class Model>
constexpr void check_model() {
  static_assert(std::is_same_v<typename Model::value_type, float>,
                "fusedp checkpoints hold float32 parameters: use a Model<Net, Space, float>");
}

// A model's parameters and optimizer state as host memory: a Host model's own spans; a device model's
// (Model<Net, Cuda>) copied into `staging`. Writing them back goes through load_params and
// load_optimizer_state there.
template <class Model>
inline constexpr bool on_host = std::is_same_v<typename Model::space_type, Host>;

template <class Model>
std::span<const float> host_params(const Model& model, std::vector<float>& staging) {
  if constexpr (on_host<Model>) {
    return model.params();
  } else {
    staging.resize(model.params().size());
    model.copy_params_to_host(staging);
    return staging;
  }
}
template <class Model>
std::span<const float> host_buffers(const Model& model, std::vector<float>& staging) {
  if constexpr (on_host<Model>) {
    return model.buffers();
  } else {
    staging.resize(model.buffers().size());
    model.copy_buffers_to_host(staging);
    return staging;
  }
}
template <class Model>
std::span<const float> host_optimizer_state(const Model& model, std::vector<float>& staging) {
  if constexpr (on_host<Model>) {
    return model.optimizer_state();
  } else {
    staging.resize(model.optimizer_state().size());
    model.copy_optimizer_state_to_host(staging);
    return staging;
  }
}
template <class Model>
void store_params(Model& model, std::span<const float> values) {
  if constexpr (on_host<Model>) std::memcpy(model.params().data(), values.data(), values.size() * sizeof(float));
  else model.load_params(values);
}
template <class Opt, class Model>
void store_optimizer_state(Model& model, std::span<const float> values) {
  if constexpr (on_host<Model>) {
    const std::span<float> dst = model.template optimizer_state<Opt>();
    require(dst.size() == values.size(), "load_checkpoint: ", values.size(), " optimizer state values for ",
            dst.size());
    std::memcpy(dst.data(), values.data(), values.size() * sizeof(float));
  } else {
    model.template load_optimizer_state<Opt>(values);
  }
}

// The buffers a checkpoint holds: BatchNorm's running statistics, not what forward leaves for backward.
constexpr bool saved_buffer(const StateTensor& t) {
  return t.kind == StateKind::buffer;
}

/// What a weights file gave: each parameter's entry in param_layout order, and the state buffer's
/// values (the file's buffers; zero for the transient tensors, which forward writes before use).
struct MatchedWeights {
  std::vector<const SafetensorsTensor*> params;
  std::vector<float> buffers;
};

// Checks that `f` holds exactly the parameters and buffers of Net (names, dtypes, shapes) and, when it
// says which network wrote it, that it is Net.
template <class Net>
MatchedWeights match_weights(const SafetensorsFile& f) {
  if (const std::string* kind = f.meta("fusedp.kind"); kind && *kind != "weights")
    throw DataError(f.path, "is a fusedp " + *kind + " file, not a weights file");
  if (f.meta("fusedp.fingerprint")) {
    const std::uint64_t fp = parse_u64(f, "fusedp.fingerprint", true);
    if (fp != Net::fingerprint)
      throw DataError(f.path, "is a checkpoint of another network: its fingerprint is " + hex64(fp) +
                                  ", this network's is " + hex64(Net::fingerprint));
  }
  std::size_t expected = Net::param_layout.size();
  for (const StateTensor& t : Net::state_layout) expected += saved_buffer(t) ? 1 : 0;
  MatchedWeights m;
  for (const ParamTensor& t : Net::param_layout) {
    const std::string name = tensor_name(t);
    const SafetensorsTensor* e = f.find(name);
    if (!e)
      throw DataError(f.path, "has no tensor '" + name + "' (" + std::to_string(f.tensors.size()) +
                                  " tensors in the file; this network has " + std::to_string(expected) + ")");
    if (e->dtype != "F32") throw DataError(f.path, "tensor '" + name + "' has dtype " + e->dtype + ", expected F32");
    if (e->shape != tensor_shape(t))
      throw DataError(f.path, "tensor '" + name + "' has shape " + shape_text(e->shape) + ", this network needs " +
                                  shape_text(tensor_shape(t)));
    m.params.push_back(e);
  }
  m.buffers.assign(Net::state_storage, 0.0f);
  for (const StateTensor& t : Net::state_layout) {
    float* dst = m.buffers.data() + t.offset;
    if (!saved_buffer(t)) continue;
    const std::string name = tensor_name(t);
    const SafetensorsTensor* e = f.find(name);
    if (!e)
      throw DataError(f.path, "has no tensor '" + name + "' (a BatchNorm running statistic of this network; " +
                                  std::to_string(f.tensors.size()) + " tensors in the file, this network has " +
                                  std::to_string(expected) + ")");
    if (e->shape != tensor_shape(t))
      throw DataError(f.path, "tensor '" + name + "' has shape " + shape_text(e->shape) + ", this network needs " +
                                  shape_text(tensor_shape(t)));
    if (t.rank == 0) dst[0] = float(f.read_scalar(*e));
    else f.read_f32(*e, {dst, t.size});
  }
  if (f.tensors.size() != expected) {
    for (const auto& e : f.tensors) {
      bool known = false;
      for (const ParamTensor& t : Net::param_layout) known = known || tensor_name(t) == e.name;
      for (const StateTensor& t : Net::state_layout) known = known || (saved_buffer(t) && tensor_name(t) == e.name);
      if (!known) throw DataError(f.path, "has a tensor '" + e.name + "' that this network does not have");
    }
  }
  return m;
}

template <class Net>
std::vector<std::pair<std::string, std::string>> common_metadata(const char* kind) {
  return {{"format", "pt"},
          {"fusedp.version", FUSEDP_VERSION_STRING},
          {"fusedp.format", std::to_string(checkpoint_format)},
          {"fusedp.kind", kind},
          {"fusedp.fingerprint", hex64(Net::fingerprint)}};
}

/// Host views of everything a checkpoint holds of a model (or of a data-parallel run, whose optimizer
/// state was gathered from its replicas).
struct ModelImage {
  std::span<const float> params;           // param_storage values
  std::span<const float> buffers;          // state_storage values
  std::span<const float> optimizer_state;  // slots x param_storage values; empty before the first step
  const char* optimizer = nullptr;         // the optimizer that owns the state (nullptr: none)
  std::uint64_t seed = 0;
  std::uint64_t steps = 0;
  std::uint64_t optimizer_steps = 0;
};

/// The image of `model`: a Host model's own memory, a device model's copied into `staging`.
template <class Model>
ModelImage model_image(const Model& model, std::vector<float> (&staging)[3]) {
  check_model<Model>();
  return {host_params(model, staging[0]),
          host_buffers(model, staging[1]),
          host_optimizer_state(model, staging[2]),
          model.optimizer_name(),
          model.seed(),
          model.steps(),
          model.optimizer_steps()};
}

template <class Net>
std::vector<std::uint8_t> encode_weights(std::span<const float> params, std::span<const float> buffers,
                                         std::uint32_t* crc = nullptr) {
  std::vector<TensorToWrite> tensors;
  for (const ParamTensor& t : Net::param_layout)
    tensors.push_back({tensor_name(t), tensor_shape(t), params.subspan(t.offset, t.size)});
  for (const StateTensor& t : Net::state_layout)
    if (saved_buffer(t)) tensors.push_back({tensor_name(t), tensor_shape(t), buffers.subspan(t.offset, t.size)});
  return encode_safetensors(tensors, common_metadata<Net>("weights"), crc);
}

inline void check_format(const SafetensorsFile& f) {
  if (!f.meta("fusedp.format")) return;
  const std::uint64_t format = parse_u64(f, "fusedp.format");
  if (format != std::uint64_t(checkpoint_format))
    throw DataError(f.path, "was written in checkpoint format " + std::to_string(format) + " (fusedp " +
                                (f.meta("fusedp.version") ? *f.meta("fusedp.version") : std::string("?")) +
                                "); this fusedp " FUSEDP_VERSION_STRING " reads format " +
                                std::to_string(checkpoint_format));
}

inline TrainingState parse_state(const SafetensorsFile& f) {
  if (!f.crc32) throw DataError(f.path, "has no checksum; not a fusedp training-state file");
  const std::string* kind = f.meta("fusedp.kind");
  if (!kind || *kind != "training_state")
    throw DataError(f.path, "is not a fusedp training-state file (kind '" + (kind ? *kind : std::string()) + "')");
  check_format(f);
  TrainingState s;
  s.epochs_done = parse_u64(f, "epochs_done");
  s.batches_done = parse_u64(f, "batches_done");
  s.data_seed = parse_u64(f, "data_seed");
  s.dataset_size = parse_u64(f, "dataset_size");
  s.batch_size = parse_u64(f, "batch_size");
  s.world_size = parse_u64(f, "world_size");
  if (f.meta("samples_done")) s.samples_done = parse_u64(f, "samples_done");
  fill_samples_done(s);
  if (s.samples_done > s.dataset_size)
    throw DataError(f.path, "says " + std::to_string(s.samples_done) + " samples of an epoch of " +
                                std::to_string(s.dataset_size) + " were visited");
  s.model_seed = parse_u64(f, "model_seed");
  s.steps = parse_u64(f, "steps");
  s.optimizer_steps = parse_u64(f, "optimizer_steps");
  s.fingerprint = parse_u64(f, "fusedp.fingerprint", true);
  s.optimizer = f.meta("optimizer") ? *f.meta("optimizer") : throw DataError(f.path, "metadata field 'optimizer' is missing");
  s.version = f.meta("fusedp.version") ? *f.meta("fusedp.version") : std::string();
  for (const auto& [key, value] : f.metadata)
    if (key.rfind("user.", 0) == 0) s.extra[key.substr(5)] = value;
  return s;
}

// Reads the weights that belong to the committed training state: the weights file, or the fsync'd
// temporary of a save interrupted between its two renames. Returns nothing when neither matches.
inline std::optional<SafetensorsFile> committed_weights(const std::string& dir, std::uint32_t crc) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / weights_file_name).string();
  std::optional<DataError> main_error;
  try {
    SafetensorsFile main = read_safetensors(path);
    if (main.crc32 == crc) return main;
  } catch (const DataError& e) {
    main_error = e;
  }
  const std::string tmp = path + ".tmp";
  if (std::error_code ec; fs::exists(tmp, ec)) {
    try {
      SafetensorsFile t = read_safetensors(tmp);
      if (t.crc32 == crc) return t;
    } catch (const DataError&) {
    }
  }
  if (main_error) throw *main_error;
  return std::nullopt;
}

// Finishes a save interrupted after its commit: moves the temporary weights into place.
inline void finish_interrupted_save(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string state_path = (fs::path(dir) / state_file_name).string();
  const std::string weights_path = (fs::path(dir) / weights_file_name).string();
  if (std::error_code ec; !fs::exists(state_path, ec) || !fs::exists(weights_path + ".tmp", ec)) return;
  try {
    const SafetensorsFile state = read_safetensors(state_path);
    const std::uint32_t crc = parse_crc32(state, "weights.crc32");
    bool main_ok = false;
    try {
      main_ok = read_safetensors(weights_path).crc32 == crc;
    } catch (const DataError&) {
    }
    if (main_ok) return;
    if (read_safetensors(weights_path + ".tmp").crc32 != crc) return;
  } catch (const DataError&) {
    return;  // nothing recoverable; the new save replaces it
  }
  rename_over(weights_path + ".tmp", weights_path);
  fsync_directory(dir);
}

/// Where a simulated crash stops save_checkpoint (tests only).
enum class SaveStop { never, after_temporaries, after_commit };

template <class Net>
void save_image(const std::string& dir, const ModelImage& image, TrainingState state, SaveStop stop) {
  namespace fs = std::filesystem;
  require(state.samples_done <= state.dataset_size, "save_checkpoint: samples_done (", state.samples_done,
          ") exceeds the epoch's ", state.dataset_size, " samples (dataset_size)");
  fill_samples_done(state);
  {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec || !fs::is_directory(dir, ec))
      throw DataError(dir, "cannot create the checkpoint folder" + (ec ? ": " + ec.message() : std::string()));
  }
  finish_interrupted_save(dir);

  std::uint32_t weights_crc = 0;
  const std::vector<std::uint8_t> weights = encode_weights<Net>(image.params, image.buffers, &weights_crc);

  state.model_seed = image.seed;
  state.steps = image.steps;
  state.optimizer_steps = image.optimizer_steps;
  state.optimizer = image.optimizer ? image.optimizer : "";
  state.fingerprint = Net::fingerprint;
  state.version = FUSEDP_VERSION_STRING;
  auto meta = common_metadata<Net>("training_state");
  auto add = [&](const std::string& k, std::uint64_t v) { meta.emplace_back(k, std::to_string(v)); };
  meta.emplace_back("optimizer", state.optimizer);
  add("steps", state.steps);
  add("optimizer_steps", state.optimizer_steps);
  add("epochs_done", state.epochs_done);
  add("batches_done", state.batches_done);
  add("samples_done", state.samples_done);
  add("data_seed", state.data_seed);
  add("model_seed", state.model_seed);
  add("dataset_size", state.dataset_size);
  add("batch_size", state.batch_size);
  add("world_size", state.world_size);
  meta.emplace_back("weights.crc32", detail::hex32(weights_crc));
  for (const auto& [key, value] : state.extra) meta.emplace_back("user." + key, value);

  const std::span<const float> opt_state = image.optimizer_state;
  const std::size_t slots = opt_state.size() / Net::param_storage;
  const std::vector<std::string> names = slot_names(state.optimizer, slots);
  std::vector<TensorToWrite> tensors;
  for (std::size_t s = 0; s < slots; ++s)
    for (const ParamTensor& t : Net::param_layout)
      tensors.push_back({tensor_name(t) + "." + names[s], tensor_shape(t),
                         opt_state.subspan(s * Net::param_storage + t.offset, t.size)});
  const std::vector<std::uint8_t> state_bytes = encode_safetensors(tensors, meta);

  const std::string weights_path = (fs::path(dir) / weights_file_name).string();
  const std::string state_path = (fs::path(dir) / state_file_name).string();
  write_synced(weights_path + ".tmp", weights);
  try {
    write_synced(state_path + ".tmp", state_bytes);
  } catch (...) {
    ::unlink((weights_path + ".tmp").c_str());
    throw;
  }
  // The folder is synced before each rename: the temporaries' names must be durable before the state
  // that names the weights by checksum is, and the commit before the weights replace the old ones
  // (after a power loss either order could otherwise leave a folder mixing two saves).
  fsync_directory(dir);
  if (stop == SaveStop::after_temporaries) return;
  rename_over(state_path + ".tmp", state_path);  // the commit
  fsync_directory(dir);
  if (stop == SaveStop::after_commit) return;
  rename_over(weights_path + ".tmp", weights_path);
  fsync_directory(dir);
}

template <class Model>
void save_checkpoint(const std::string& dir, const Model& model, const TrainingState& state, SaveStop stop) {
  std::vector<float> staging[3];
  save_image<typename Model::network>(dir, model_image(model, staging), state, stop);
}

}  // namespace detail

/// Writes the parameters of `model` to `path` as a safetensors file PyTorch can load into the
/// equivalent nn.Sequential (atomically: a failure leaves an existing file as it was).
template <class Model>
void save_weights(const std::string& path, const Model& model) {
  detail::check_model<Model>();
  std::vector<float> staging[2];
  const std::vector<std::uint8_t> bytes = detail::encode_weights<typename Model::network>(
      detail::host_params(model, staging[0]), detail::host_buffers(model, staging[1]));
  write_file_atomically(path, bytes);
}

/// Loads parameters (and BatchNorm buffers) from a safetensors file written by save_weights or by
/// PyTorch (F32 tensors named as the module's state_dict). The model is changed only when everything checks out: the
/// checksum (if any), the network fingerprint (if any), every tensor's name, dtype and shape, and
/// no tensor this network lacks.
template <class Model>
void load_weights(const std::string& path, Model& model) {
  detail::check_model<Model>();
  using Net = typename Model::network;
  const SafetensorsFile f = read_safetensors(path);
  detail::check_format(f);
  const detail::MatchedWeights found = detail::match_weights<Net>(f);
  std::vector<float> staged(Net::param_storage, 0.0f);  // padding stays zero
  for (std::size_t i = 0; i < found.params.size(); ++i) {
    const ParamTensor& t = Net::param_layout[i];
    f.read_f32(*found.params[i], {staged.data() + t.offset, t.size});
  }
  detail::store_params(model, staged);
  model.load_buffers(found.buffers);
}

/// Saves `model` (weights, optimizer state, step counters) and `state` into the folder `dir`
/// (created if needed). See the top of this header for how a crash at any point is survived.
template <class Model>
void save_checkpoint(const std::string& dir, const Model& model, const TrainingState& state) {
  const trace::Scope span("save checkpoint", trace::Kind::checkpoint);
  detail::save_checkpoint(dir, model, state, detail::SaveStop::never);
}

namespace detail {
inline SafetensorsFile read_state_file(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw DataError(dir, fs::exists(dir, ec) ? "is not a checkpoint folder (expected a folder holding " +
                                                   std::string(weights_file_name) + " and " + state_file_name + ")"
                                             : "checkpoint folder does not exist");
  return read_safetensors((fs::path(dir) / state_file_name).string());
}
}  // namespace detail

/// Reads and verifies the training state in checkpoint folder `dir` without touching any model: to
/// learn the seed a model must be constructed with, or the epoch to resume from.
[[nodiscard]] inline TrainingState read_training_state(const std::string& dir) {
  return detail::parse_state(detail::read_state_file(dir));
}

namespace detail {

/// A checkpoint read and verified for network Net and optimizer Opt, in host memory.
struct LoadedCheckpoint {
  TrainingState state;
  std::vector<float> params;           // param_storage values (padding zero)
  std::vector<float> buffers;          // state_storage values
  std::vector<float> optimizer_state;  // Opt::state_slots x param_storage values; empty: saved before any step
};

/// Reads and verifies everything in checkpoint folder `dir` for a run of Net from model seed `seed`
/// with optimizer Opt; throws DataError naming the file and the problem otherwise.
template <class Net, class Opt>
LoadedCheckpoint read_checkpoint(const std::string& dir, std::uint64_t seed) {
  namespace fs = std::filesystem;
  const std::string state_path = (fs::path(dir) / state_file_name).string();
  const SafetensorsFile sf = read_state_file(dir);
  LoadedCheckpoint c;
  c.state = parse_state(sf);
  const TrainingState& state = c.state;
  if (state.fingerprint != Net::fingerprint)
    throw DataError(state_path, "is a checkpoint of another network: its fingerprint is " + hex64(state.fingerprint) +
                                    ", this network's is " + hex64(Net::fingerprint));
  if (state.model_seed != seed)
    throw DataError(state_path, "was trained from model seed " + std::to_string(state.model_seed) +
                                    "; this model has seed " + std::to_string(seed) + " (construct it with fusedp::seed(" +
                                    std::to_string(state.model_seed) + "); read_training_state gives the seed)");
  if (!state.optimizer.empty() && state.optimizer != Opt::name)
    throw DataError(state_path, "holds the state of optimizer " + state.optimizer + "; this run uses " + Opt::name);

  // The optimizer state: Opt::state_slots tensors per parameter, or none before the first step.
  const std::size_t slots = state.optimizer.empty() ? 0 : Opt::state_slots;
  const std::vector<std::string> names = slot_names(state.optimizer, slots);
  if (sf.tensors.size() != slots * Net::param_layout.size())
    throw DataError(state_path, "holds " + std::to_string(sf.tensors.size()) + " optimizer tensors, expected " +
                                    std::to_string(slots * Net::param_layout.size()) + " (" + std::to_string(slots) +
                                    " per parameter tensor)");
  c.optimizer_state.assign(slots * Net::param_storage, 0.0f);
  for (std::size_t s = 0; s < slots; ++s) {
    for (const ParamTensor& t : Net::param_layout) {
      const std::string name = tensor_name(t) + "." + names[s];
      const SafetensorsTensor* e = sf.find(name);
      if (!e) throw DataError(state_path, "has no optimizer tensor '" + name + "'");
      if (e->shape != tensor_shape(t))
        throw DataError(state_path, "optimizer tensor '" + name + "' has shape " + shape_text(e->shape) +
                                        ", this network needs " + shape_text(tensor_shape(t)));
      sf.read_f32(*e, {c.optimizer_state.data() + s * Net::param_storage + t.offset, t.size});
    }
  }

  const std::uint32_t crc = parse_crc32(sf, "weights.crc32");
  const std::optional<SafetensorsFile> wf = committed_weights(dir, crc);
  const std::string weights_path = (fs::path(dir) / weights_file_name).string();
  if (!wf)
    throw DataError(weights_path, "does not belong to " + state_path + " (its checksum differs from the one the "
                                      "training state records): the folder mixes two saves");
  MatchedWeights found = match_weights<Net>(*wf);
  c.params.assign(Net::param_storage, 0.0f);
  for (std::size_t i = 0; i < found.params.size(); ++i) {
    const ParamTensor& t = Net::param_layout[i];
    wf->read_f32(*found.params[i], {c.params.data() + t.offset, t.size});
  }
  c.buffers = std::move(found.buffers);
  return c;
}

/// Puts a verified checkpoint's parameters, buffers and step counters into `model`; the optimizer
/// state is the caller's (a data-parallel run shards it).
template <class Model>
void store_model(Model& model, const LoadedCheckpoint& c) {
  store_params(model, c.params);
  model.load_buffers(c.buffers);
}

}  // namespace detail

/// Loads the checkpoint in folder `dir` into `model` for training on with `opt`: parameters,
/// optimizer state and step counters. Returns the saved TrainingState (epoch, sampler position,
/// seeds...) for the caller to continue from. Throws DataError, with the model untouched, when a
/// file is missing, truncated or corrupt, was written for another network, with another
/// optimizer or model seed, or when the weights do not belong to the training state.
template <class Model, class Opt>
TrainingState load_checkpoint(const std::string& dir, Model& model, const Opt& opt) {
  detail::check_model<Model>();
  (void)opt;
  detail::LoadedCheckpoint c = detail::read_checkpoint<typename Model::network, Opt>(dir, model.seed());
  // Everything checked: now change the model.
  detail::store_model(model, c);
  if (!c.optimizer_state.empty()) {
    detail::store_optimizer_state<Opt>(model, c.optimizer_state);
  } else if (model.optimizer_name() != nullptr) {
    // Saved before the first step: Opt starts from zeros, in Opt's size (the state the model holds may
    // be another optimizer's, of another size).
    c.optimizer_state.assign(Opt::state_slots * Model::network::param_storage, 0.0f);
    detail::store_optimizer_state<Opt>(model, c.optimizer_state);
  }
  model.set_step_counters(c.state.steps, c.state.optimizer_steps);
  return c.state;
}

}  // namespace fusedp::train
