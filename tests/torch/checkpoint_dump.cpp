// checkpoint_dump: the fusedp side of checkpoint_torch.py, which checks that PyTorch loads fusedp's
// safetensors weights and that fusedp loads PyTorch's.
//
//   checkpoint_dump export --net lenet|cifar|resnet18 --out DIR [--seed N] [--batch N]
//       trains 2 SGD steps from seed N (so the weights are not the initial ones), then writes
//       DIR/fusedp.safetensors (save_weights), DIR/input.f32 (B, C, H, W) and DIR/logits.f32
//       (B, 10) from predict(), raw little-endian float32.
//   checkpoint_dump import --net lenet|cifar|resnet18 --weights FILE --input FILE --out FILE
//       load_weights(FILE) into a model of another seed, predict() on the input, write the logits.
//
// Exit status: 0 on success, 1 on any error (the message names the file), 2 on bad arguments.
#include "../support/fusedp_core.hpp"
#include <fusedp/train/checkpoint.hpp>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;

namespace {

using seed_networks::LeNet;
using seed_networks::CifarCnn;
using ResNet18 = fp::models::ResNet18Cifar<10>;

void write_floats(const std::string& path, std::span<const float> v) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
  if (!out) throw fp::DataError(path, "cannot write");
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw fp::DataError(path, "cannot open");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() % 4 != 0) throw fp::DataError(path, "size is not a multiple of 4");
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

template <class Net>
int export_weights(const std::string& out, std::uint64_t seed, std::size_t batch) {
  using Model = fp::Model<Net, fp::Host>;
  Model model{fp::seed(seed), fp::Host{0}};
  std::vector<float> x(batch * Model::input_size);
  std::vector<std::int32_t> y(batch);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2 * fp::rng::uniform(seed, 11, i) - 1;
  for (std::size_t i = 0; i < batch; ++i) y[i] = std::int32_t(fp::rng::uniform(seed, 12, i) * 10);
  fp::Sgd opt{{.lr = 0.05f, .momentum = 0.9f}};
  for (int s = 0; s < 2; ++s)
    (void)model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y), fp::SoftmaxCrossEntropy{}, opt);
  std::filesystem::create_directories(out);
  fp::train::save_weights(out + "/fusedp.safetensors", model);
  write_floats(out + "/input.f32", x);
  write_floats(out + "/logits.f32", model.predict(x));
  return 0;
}

template <class Net>
int import_weights(const std::string& weights, const std::string& input, const std::string& out) {
  using Model = fp::Model<Net, fp::Host>;
  Model model{fp::seed(12345), fp::Host{0}};
  fp::train::load_weights(weights, model);
  const std::vector<float> x = read_floats(input);
  if (x.empty() || x.size() % Model::input_size != 0)
    throw fp::DataError(input, "does not hold whole samples of " + std::to_string(Model::input_size));
  write_floats(out, model.predict(x));
  return 0;
}

int usage() {
  std::fprintf(stderr,
               "usage: checkpoint_dump export --net lenet|cifar|resnet18 --out DIR [--seed N] [--batch N]\n"
               "       checkpoint_dump import --net lenet|cifar|resnet18 --weights FILE --input FILE --out FILE\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string mode = argv[1];
  std::string net, out, weights, input;
  std::uint64_t seed = 7;
  std::size_t batch = 4;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--net") net = v;
    else if (k == "--out") out = v;
    else if (k == "--weights") weights = v;
    else if (k == "--input") input = v;
    else if (k == "--seed") seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--batch") batch = std::strtoull(v.c_str(), nullptr, 10);
    else return usage();
  }
  if ((net != "lenet" && net != "cifar" && net != "resnet18") || out.empty() || batch == 0) return usage();
  try {
    if (mode == "export") {
      if (net == "lenet") return export_weights<LeNet>(out, seed, batch);
      if (net == "cifar") return export_weights<CifarCnn>(out, seed, batch);
      return export_weights<ResNet18>(out, seed, batch);
    }
    if (mode == "import" && !weights.empty() && !input.empty()) {
      if (net == "lenet") return import_weights<LeNet>(weights, input, out);
      if (net == "cifar") return import_weights<CifarCnn>(weights, input, out);
      return import_weights<ResNet18>(weights, input, out);
    }
    return usage();
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "checkpoint_dump: error: %s\n", e.what());
    return 1;
  }
}
