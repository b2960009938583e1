// Tests of include/fusedp/train/checkpoint.hpp: weights and training-state round trips, files of another
// network, truncated or corrupted files, interrupted saves, and failed writes that must leave the
// previous checkpoint intact — with the model untouched whenever loading fails.
#include "fusedp/train/checkpoint.hpp"

#include "../data/temp_dir.hpp"

#include <doctest/doctest.h>
#include "../support/fusedp_core.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fp = fusedp;
namespace ft = fusedp::train;
namespace fs = std::filesystem;
using fp::DataError;
using fusedp_test::Bytes;
using fusedp_test::read_bytes;
using fusedp_test::TempDir;
using fusedp_test::write_bytes;

using Small = fp::Sequential<fp::Input<1, 8, 8>, fp::Conv2d<4, 3>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<10>>;
// the same parameter shapes, another network
using SmallTanh = fp::Sequential<fp::Input<1, 8, 8>, fp::Conv2d<4, 3>, fp::Tanh, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<10>>;
using Wider = fp::Sequential<fp::Input<1, 8, 8>, fp::Conv2d<5, 3>, fp::ReLU, fp::MaxPool2d<2>, fp::Flatten, fp::Linear<10>>;
using Model = fp::Model<Small, fp::Host>;

constexpr std::size_t batch = 8;

std::vector<float> inputs(std::uint64_t seed) {
  std::vector<float> x(batch * 64);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::rng::uniform(seed, 7, i) * 2 - 1;
  return x;
}
std::vector<std::int32_t> labels(std::uint64_t seed) {
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(fp::rng::uniform(seed, 8, i) * 10);
  return y;
}

template <class M, class Opt>
void train(M& model, Opt& opt, int steps, std::uint64_t data = 1) {
  for (int s = 0; s < steps; ++s) {
    const auto x = inputs(data + std::uint64_t(s));
    const auto y = labels(data + std::uint64_t(s));
    (void)model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  }
}

std::vector<float> copy(std::span<const float> s) { return {s.begin(), s.end()}; }

// Everything loading may change: parameters, optimizer state and name, counters.
struct Snapshot {
  std::vector<float> params, state;
  std::string optimizer;
  std::uint64_t steps, optimizer_steps;
  template <class M>
  explicit Snapshot(const M& m)
      : params(copy(m.params())),
        state(copy(m.optimizer_state())),
        optimizer(m.optimizer_name() ? m.optimizer_name() : ""),
        steps(m.steps()),
        optimizer_steps(m.optimizer_steps()) {}
  bool operator==(const Snapshot&) const = default;
};

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no DataError)";
}

ft::TrainingState state_at(std::uint64_t epochs) {
  ft::TrainingState s;
  s.epochs_done = epochs;
  s.batches_done = 3;
  s.data_seed = 99;
  s.dataset_size = 1000;
  s.batch_size = batch;
  s.world_size = 1;
  s.extra["note"] = "hello";
  return s;
}

}  // namespace

TEST_CASE("weights round-trip bit for bit, with PyTorch's names and shapes") {
  TempDir dir("fusedp_ckpt");
  Model a{fp::seed(1), fp::Host{1}};
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  train(a, opt, 3);
  const std::string path = dir.file("w.safetensors");
  ft::save_weights(path, a);

  const ft::SafetensorsFile f = ft::read_safetensors(path);
  REQUIRE(f.tensors.size() == 4);
  CHECK(f.find("0.weight")->shape == std::vector<std::size_t>{4, 1, 3, 3});
  CHECK(f.find("0.bias")->shape == std::vector<std::size_t>{4});
  CHECK(f.find("4.weight")->shape == std::vector<std::size_t>{10, 36});
  CHECK(f.find("4.bias")->shape == std::vector<std::size_t>{10});
  CHECK(*f.meta("fusedp.version") == FUSEDP_VERSION_STRING);
  CHECK(*f.meta("fusedp.fingerprint") == ft::detail::hex64(Small::fingerprint));
  CHECK(*f.meta("fusedp.kind") == "weights");

  Model b{fp::seed(2), fp::Host{1}};
  CHECK(copy(a.params()) != copy(b.params()));
  ft::load_weights(path, b);
  CHECK(copy(a.params()) == copy(b.params()));
  const auto x = inputs(50);
  CHECK(copy(a.predict(x)) == copy(b.predict(x)));
}

TEST_CASE("weights of another network, or damaged, are refused and the model is untouched") {
  TempDir dir("fusedp_ckpt");
  const std::string path = dir.file("w.safetensors");
  Model target{fp::seed(3), fp::Host{1}};
  fp::Sgd opt{{.lr = 0.1f, .momentum = 0.9f}};
  train(target, opt, 1);
  const Snapshot before(target);
  auto refused = [&](const std::string& expected) {
    const std::string m = error_of([&] { ft::load_weights(path, target); });
    CAPTURE(m);
    CHECK(m.find(expected) != std::string::npos);
    CHECK(Snapshot(target) == before);
  };

  SUBCASE("same shapes, another activation: the fingerprint differs") {
    fp::Model<SmallTanh, fp::Host> other{fp::seed(4), fp::Host{1}};
    ft::save_weights(path, other);
    refused("is a checkpoint of another network: its fingerprint is " + ft::detail::hex64(SmallTanh::fingerprint));
  }
  SUBCASE("other shapes") {
    fp::Model<Wider, fp::Host> other{fp::seed(4), fp::Host{1}};
    ft::save_weights(path, other);
    refused("another network");
  }
  SUBCASE("a file without fusedp metadata (as PyTorch writes) with a wrong shape, a missing or extra tensor") {
    fp::Model<Wider, fp::Host> wider{fp::seed(4), fp::Host{1}};
    Model small{fp::seed(4), fp::Host{1}};
    auto write = [&](auto& m, std::vector<std::string> drop, std::vector<std::string> add) {
      std::vector<ft::TensorToWrite> t;
      using Net = typename std::remove_cvref_t<decltype(m)>::network;
      for (const fp::ParamTensor& p : Net::param_layout) {
        const std::string name = ft::detail::tensor_name(p);
        if (std::find(drop.begin(), drop.end(), name) == drop.end())
          t.push_back({name, ft::detail::tensor_shape(p), m.params().subspan(p.offset, p.size)});
      }
      for (const auto& name : add) t.push_back({name, {1}, m.params().subspan(0, 1)});
      // a file PyTorch would write: strip fusedp's metadata by rewriting the header
      const Bytes b = ft::encode_safetensors(t, {});
      write_bytes(path, b);
    };
    write(wider, {}, {});
    refused("tensor '0.weight' has shape [5, 1, 3, 3], this network needs [4, 1, 3, 3]");
    write(small, {"4.bias"}, {});
    refused("has no tensor '4.bias'");
    write(small, {}, {"5.weight"});
    refused("has a tensor '5.weight' that this network does not have");
  }
  SUBCASE("truncated, flipped, empty, missing") {
    ft::save_weights(path, target);
    const Bytes good = read_bytes(path);
    write_bytes(path, Bytes(good.begin(), good.end() - 10));
    refused("file is truncated");
    Bytes flipped = good;
    flipped[good.size() / 2] ^= 0x04;
    write_bytes(path, flipped);
    refused("checksum mismatch");
    write_bytes(path, {});
    refused("file is empty");
    fs::remove(path);
    refused("does not exist");
  }
  SUBCASE("a training-state file is not a weights file") {
    ft::save_checkpoint(dir.file("ck"), target, state_at(1));
    const std::string m = error_of([&] { ft::load_weights(dir.file("ck/training_state.safetensors"), target); });
    CHECK(m.find("is a fusedp training_state file, not a weights file") != std::string::npos);
    CHECK(Snapshot(target) == before);
  }
}

TEST_CASE("a checkpoint restores parameters, optimizer state, counters and the training state") {
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");

  SUBCASE("Sgd with momentum") {
    Model a{fp::seed(5), fp::Host{2}};
    fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
    train(a, opt, 4);
    ft::save_checkpoint(ck, a, state_at(2));
    CHECK(fs::exists(ck + "/model.safetensors"));
    CHECK(fs::exists(ck + "/training_state.safetensors"));
    CHECK_FALSE(fs::exists(ck + "/model.safetensors.tmp"));
    CHECK_FALSE(fs::exists(ck + "/training_state.safetensors.tmp"));

    const ft::TrainingState peek = ft::read_training_state(ck);
    CHECK(peek.model_seed == 5);
    CHECK(peek.epochs_done == 2);
    CHECK(peek.optimizer == "Sgd");

    Model b{fp::seed(5), fp::Host{2}};
    const ft::TrainingState s = ft::load_checkpoint(ck, b, opt);
    CHECK(Snapshot(a) == Snapshot(b));
    CHECK(s.epochs_done == 2);
    CHECK(s.batches_done == 3);
    CHECK(s.samples_done == 3 * batch);  // left 0 by the program: the position of 3 batches on 1 rank
    CHECK(s.data_seed == 99);
    CHECK(s.dataset_size == 1000);
    CHECK(s.batch_size == batch);
    CHECK(s.world_size == 1);
    CHECK(s.steps == 4);
    CHECK(s.optimizer_steps == 4);
    CHECK(s.fingerprint == Small::fingerprint);
    CHECK(s.version == FUSEDP_VERSION_STRING);
    CHECK(s.extra.at("note") == "hello");
    // and training goes on identically
    train(a, opt, 2, 100);
    train(b, opt, 2, 100);
    CHECK(Snapshot(a) == Snapshot(b));
    // the optimizer state is stored under torch.optim's names
    const ft::SafetensorsFile f = ft::read_safetensors(ck + "/training_state.safetensors");
    CHECK(f.find("0.weight.momentum_buffer") != nullptr);
    CHECK(f.find("4.bias.momentum_buffer") != nullptr);
  }
  SUBCASE("Adam: moments and the bias-correction step count") {
    Model a{fp::seed(6), fp::Host{1}};
    fp::Adam opt{{.lr = 0.01f}};
    train(a, opt, 3);
    ft::save_checkpoint(ck, a, state_at(1));
    Model b{fp::seed(6), fp::Host{1}};
    (void)ft::load_checkpoint(ck, b, opt);
    CHECK(Snapshot(a) == Snapshot(b));
    train(a, opt, 3, 200);
    train(b, opt, 3, 200);
    CHECK(Snapshot(a) == Snapshot(b));
    const ft::SafetensorsFile f = ft::read_safetensors(ck + "/training_state.safetensors");
    CHECK(f.find("0.weight.exp_avg") != nullptr);
    CHECK(f.find("0.weight.exp_avg_sq") != nullptr);
  }
  SUBCASE("before the first step there is no optimizer state; loading clears the model's") {
    Model fresh{fp::seed(7), fp::Host{1}};
    ft::save_checkpoint(ck, fresh, state_at(0));
    Model used{fp::seed(7), fp::Host{1}};
    fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
    train(used, opt, 2);
    (void)ft::load_checkpoint(ck, used, opt);
    CHECK(copy(used.params()) == copy(fresh.params()));
    CHECK(used.steps() == 0);
    CHECK(used.optimizer_steps() == 0);
    for (float v : used.optimizer_state()) REQUIRE(v == 0.0f);
  }
}

// A state file whose samples_done is 0 (or absent) beside batches_done > 0 means the batches' samples,
// on reading as on saving, so the state survives a save and reload unchanged (found by fuzz_checkpoint:
// such a file read as 0 and came back as 3 x batch).
TEST_CASE("a checkpoint saved before the first step starts another optimizer from zeros, in its own size") {
  // The model trained with Adam (two slots); the checkpoint holds no optimizer state, and loads with Sgd
  // (one slot). The zeros were sized by the Adam state the model held: twice Sgd's, written past it.
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");
  Model fresh{fp::seed(9), fp::Host{1}};
  ft::save_checkpoint(ck, fresh, state_at(0));
  Model m{fp::seed(9), fp::Host{1}};
  fp::Adam adam{{.lr = 0.01f}};
  train(m, adam, 1);
  REQUIRE(m.optimizer_state().size() == 2 * Small::param_storage);
  const fp::Sgd sgd{{.lr = 0.05f, .momentum = 0.9f}};
  (void)ft::load_checkpoint(ck, m, sgd);
  CHECK(std::string(m.optimizer_name()) == "Sgd");
  CHECK(m.optimizer_state().size() == Small::param_storage);
  CHECK(std::all_of(m.optimizer_state().begin(), m.optimizer_state().end(), [](float v) { return v == 0.0f; }));
  CHECK(copy(m.params()) == copy(fresh.params()));
}

TEST_CASE("samples_done left 0 or absent in a file reads as the batches' position and round-trips") {
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");
  const std::string state_path = ck + "/training_state.safetensors";
  Model a{fp::seed(5), fp::Host{1}};
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  train(a, opt, 2);
  ft::save_checkpoint(ck, a, state_at(2));

  // The state file again, with samples_done set to `value` (removed when empty), checksum repaired.
  const ft::SafetensorsFile saved = ft::read_safetensors(state_path);
  auto rewrite = [&](const std::string& value) {
    std::vector<std::pair<std::string, std::string>> meta;
    for (const auto& [key, v] : saved.metadata)
      if (key != ft::checksum_key && key != "samples_done") meta.emplace_back(key, v);
    if (!value.empty()) meta.emplace_back("samples_done", value);
    std::vector<std::vector<float>> values;
    std::vector<ft::TensorToWrite> tensors;
    for (const ft::SafetensorsTensor& t : saved.tensors) {
      std::vector<float>& v = values.emplace_back((t.end - t.begin) / sizeof(float));
      std::memcpy(v.data(), saved.bytes.data() + saved.data_start + t.begin, t.end - t.begin);
    }
    for (std::size_t i = 0; i < saved.tensors.size(); ++i)
      tensors.push_back({saved.tensors[i].name, saved.tensors[i].shape, values[i]});
    write_bytes(state_path, ft::encode_safetensors(tensors, meta));
  };

  for (const std::string value : {"0", ""}) {
    CAPTURE(value);
    rewrite(value);
    Model b{fp::seed(5), fp::Host{1}};
    const ft::TrainingState s = ft::load_checkpoint(ck, b, opt);
    CHECK(s.batches_done == 3);
    CHECK(s.samples_done == 3 * batch);
    ft::save_checkpoint(ck, b, s);
    CHECK(ft::read_training_state(ck).samples_done == s.samples_done);
  }
  SUBCASE("a written position is kept as written, even one that disagrees with batches_done") {
    rewrite("5");
    CHECK(ft::read_training_state(ck).samples_done == 5);
  }
}

TEST_CASE("a bad checkpoint is refused before anything is loaded") {
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");
  Model a{fp::seed(8), fp::Host{1}};
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  train(a, opt, 2);
  ft::save_checkpoint(ck, a, state_at(1));
  const std::string state_path = ck + "/training_state.safetensors";
  const std::string weights_path = ck + "/model.safetensors";

  Model target{fp::seed(8), fp::Host{1}};
  train(target, opt, 1, 300);
  const Snapshot before(target);
  auto refused = [&](auto& model, auto& optimizer, const std::string& expected) {
    const Snapshot b(model);
    const std::string m = error_of([&] { (void)ft::load_checkpoint(ck, model, optimizer); });
    CAPTURE(m);
    CHECK(m.find(expected) != std::string::npos);
    CHECK(Snapshot(model) == b);
  };

  SUBCASE("another network") {
    fp::Model<SmallTanh, fp::Host> other{fp::seed(8), fp::Host{1}};
    refused(other, opt, state_path + ": is a checkpoint of another network");
  }
  SUBCASE("another optimizer") {
    fp::Adam adam;
    refused(target, adam, "holds the state of optimizer Sgd; this run uses Adam");
  }
  SUBCASE("another model seed") {
    Model seeded{fp::seed(9), fp::Host{1}};
    refused(seeded, opt, "was trained from model seed 8; this model has seed 9");
  }
  SUBCASE("a flipped byte in either file, anywhere") {
    for (const std::string& path : {state_path, weights_path}) {
      const Bytes good = read_bytes(path);
      for (std::size_t i : {std::size_t(3), std::size_t(20), good.size() / 2, good.size() - 1}) {
        Bytes bad = good;
        bad[i] ^= 0x20;
        write_bytes(path, bad);
        CAPTURE(path);
        CAPTURE(i);
        refused(target, opt, path + ": ");
      }
      write_bytes(path, good);
    }
    CHECK_NOTHROW((void)ft::load_checkpoint(ck, target, opt));
  }
  SUBCASE("a truncated file") {
    for (const std::string& path : {state_path, weights_path}) {
      const Bytes good = read_bytes(path);
      write_bytes(path, Bytes(good.begin(), good.begin() + std::ptrdiff_t(good.size() * 2 / 3)));
      refused(target, opt, path + ": file is truncated");
      write_bytes(path, good);
    }
  }
  SUBCASE("weights of another save") {
    Model c{fp::seed(8), fp::Host{1}};
    train(c, opt, 5);
    ft::save_checkpoint(dir.file("other"), c, state_at(3));
    fs::copy_file(dir.file("other/model.safetensors"), weights_path, fs::copy_options::overwrite_existing);
    refused(target, opt, "does not belong to " + state_path);
  }
  SUBCASE("missing files or folder") {
    fs::remove(weights_path);
    refused(target, opt, weights_path + ": safetensors file does not exist");
    fs::remove(state_path);
    refused(target, opt, state_path + ": safetensors file does not exist");
    fs::remove_all(ck);
    refused(target, opt, ck + ": checkpoint folder does not exist");
    write_bytes(ck, {1, 2, 3});
    refused(target, opt, ck + ": is not a checkpoint folder");
  }
}

TEST_CASE("an interrupted save leaves a usable checkpoint; the next save completes it") {
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  Model a{fp::seed(10), fp::Host{1}};
  train(a, opt, 2);
  ft::save_checkpoint(ck, a, state_at(1));
  const Snapshot first(a);
  train(a, opt, 2, 400);
  const Snapshot second(a);

  SUBCASE("crash after writing the temporaries, before the commit: the previous save loads") {
    ft::detail::save_checkpoint(ck, a, state_at(2), ft::detail::SaveStop::after_temporaries);
    CHECK(fs::exists(ck + "/model.safetensors.tmp"));
    Model b{fp::seed(10), fp::Host{1}};
    CHECK(ft::load_checkpoint(ck, b, opt).epochs_done == 1);
    CHECK(Snapshot(b) == first);
  }
  SUBCASE("crash between the two renames: the committed save loads from the temporary weights") {
    ft::detail::save_checkpoint(ck, a, state_at(2), ft::detail::SaveStop::after_commit);
    CHECK(fs::exists(ck + "/model.safetensors.tmp"));
    Model b{fp::seed(10), fp::Host{1}};
    CHECK(ft::load_checkpoint(ck, b, opt).epochs_done == 2);
    CHECK(Snapshot(b) == second);
    // the next save first finishes the rename, then writes its own
    train(a, opt, 1, 500);
    ft::save_checkpoint(ck, a, state_at(3));
    CHECK_FALSE(fs::exists(ck + "/model.safetensors.tmp"));
    Model c{fp::seed(10), fp::Host{1}};
    CHECK(ft::load_checkpoint(ck, c, opt).epochs_done == 3);
    CHECK(Snapshot(c) == Snapshot(a));
  }
}

TEST_CASE("a failed write leaves the previous checkpoint and weights intact") {
  TempDir dir("fusedp_ckpt");
  const std::string ck = dir.file("ck");
  const std::string weights = dir.file("w.safetensors");
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  Model a{fp::seed(11), fp::Host{1}};
  train(a, opt, 2);
  ft::save_checkpoint(ck, a, state_at(1));
  ft::save_weights(weights, a);
  const Snapshot saved(a);
  const Bytes state_bytes = read_bytes(ck + "/training_state.safetensors");
  const Bytes weight_bytes = read_bytes(weights);
  train(a, opt, 2, 600);

  SUBCASE("the disk refuses the write (file size limit: EFBIG, as a full disk gives ENOSPC)") {
    // Works as root too, unlike a read-only folder. SIGXFSZ would kill the process; ignore it.
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit old{};
    REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    rlimit small = old;
    small.rlim_cur = 1024;  // our files are larger than that
    REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
    const std::string m1 = error_of([&] { ft::save_checkpoint(ck, a, state_at(2)); });
    const std::string m2 = error_of([&] { ft::save_weights(weights, a); });
    REQUIRE(setrlimit(RLIMIT_FSIZE, &old) == 0);
    std::signal(SIGXFSZ, old_handler);
    CAPTURE(m1);
    CAPTURE(m2);
    CHECK(m1.rfind(ck + "/model.safetensors.tmp: writing failed after", 0) == 0);
    CHECK(m1.find("File too large") != std::string::npos);
    CHECK(m2.rfind(weights + ".tmp: writing failed", 0) == 0);
  }
  SUBCASE("the folder is read-only") {
    if (geteuid() == 0) {
      MESSAGE("skipped: running as root, which writes into read-only folders (the file size limit case covers it)");
      return;
    }
    fs::permissions(ck, fs::perms::owner_read | fs::perms::owner_exec);
    fs::permissions(dir.path, fs::perms::owner_read | fs::perms::owner_exec);
    const std::string m1 = error_of([&] { ft::save_checkpoint(ck, a, state_at(2)); });
    const std::string m2 = error_of([&] { ft::save_weights(weights, a); });
    fs::permissions(ck, fs::perms::owner_all);
    fs::permissions(dir.path, fs::perms::owner_all);
    CHECK(m1.find("Permission denied") != std::string::npos);
    CHECK(m2.find("Permission denied") != std::string::npos);
  }
  SUBCASE("a path that cannot be a folder") {
    const std::string m = error_of([&] { ft::save_checkpoint(weights + "/ck", a, state_at(2)); });
    CHECK(m.rfind(weights + "/ck: cannot create the checkpoint folder", 0) == 0);
  }
  CHECK(read_bytes(ck + "/training_state.safetensors") == state_bytes);
  CHECK(read_bytes(weights) == weight_bytes);
  CHECK_FALSE(fs::exists(ck + "/model.safetensors.tmp"));
  CHECK_FALSE(fs::exists(ck + "/training_state.safetensors.tmp"));
  CHECK_FALSE(fs::exists(weights + ".tmp"));
  Model b{fp::seed(11), fp::Host{1}};
  (void)ft::load_checkpoint(ck, b, opt);
  CHECK(Snapshot(b) == saved);
}
