// torch_dump: runs one fusedp network on the Host space and writes everything PyTorch needs to
// reproduce the computation, and what fusedp got, for cross_check.py to compare.
//
//   torch_dump --net lenet|cifar --out DIR [--seed N] [--batch N] [--threads N] [--steps N]
//
// Written to DIR (raw little-endian float32 / int32, C order, shapes in manifest.json):
//   input.f32              (B, C, H, W) in [-1, 1)
//   labels.i32             (B) in [0, 10)
//   param/<name>.f32       each parameter tensor before training; <name> is PyTorch's ("0.weight")
//   grad/<name>.f32        its gradient of the mean loss from compute_gradients
//   logits.f32             (B, 10) from predict() after compute_gradients
//   after/<name>.f32       each parameter after `steps` train_step calls with Sgd(lr 0.05, momentum 0.9)
//   manifest.json          network, seed, batch, SGD options, loss, the train losses, and per tensor
//                          its name, layer, role, dims and files
// Every train step uses the same batch. Exit code 0 on success, 2 on bad arguments, 1 on errors.
#include "../support/fusedp_core.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>
#include "../support/seed_networks.hpp"

namespace fp = fusedp;
namespace fs = std::filesystem;

namespace {

using seed_networks::LeNet;
using seed_networks::CifarCnn;
static_assert(LeNet::param_count == 57'026);

constexpr int classes = 10;
constexpr float sgd_lr = 0.05f;
constexpr float sgd_momentum = 0.9f;

struct Options {
  std::string net;
  fs::path out;
  std::uint64_t seed = 42;
  std::size_t batch = 8;
  int threads = 0;
  int steps = 3;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "torch_dump: " << problem << "\n"
            << "usage: torch_dump --net lenet|cifar --out DIR [--seed N] [--batch N] [--threads N] [--steps N]\n";
  std::exit(2);
}

std::uint64_t parse_uint(std::string_view flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || text[0] == '-')
    usage(std::string(flag) + " needs a non-negative integer, got '" + text + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "-h" || a == "--help") usage("help");
    if (i + 1 >= argc) usage("missing value after " + std::string(a));
    const char* v = argv[++i];
    if (a == "--net") o.net = v;
    else if (a == "--out") o.out = v;
    else if (a == "--seed") o.seed = parse_uint(a, v);
    else if (a == "--batch") o.batch = parse_uint(a, v);
    else if (a == "--threads") o.threads = int(parse_uint(a, v));
    else if (a == "--steps") o.steps = int(parse_uint(a, v));
    else usage("unknown argument " + std::string(a));
  }
  if (o.net != "lenet" && o.net != "cifar") usage("--net must be lenet or cifar, got '" + o.net + "'");
  if (o.out.empty()) usage("--out DIR is required");
  if (o.batch == 0) usage("--batch must be positive");
  return o;
}

template <class T>
void write_raw(const fs::path& path, const T* data, std::size_t n) {
  static_assert(sizeof(T) == 4);
  static_assert(std::endian::native == std::endian::little, "torch_dump writes little-endian files as they lie");
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), std::streamsize(n * sizeof(T)));
  f.close();
  if (!f) throw std::runtime_error("torch_dump: cannot write " + path.string());
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN/Inf; the checker reports null as a failure
  std::ostringstream s;
  s << std::setprecision(std::numeric_limits<double>::max_digits10) << v;
  return s.str();
}

std::string json_dims(const std::vector<int>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

template <class Net>
int run(const Options& o) {
  using Model = fp::Model<Net, fp::Host>;
  constexpr std::size_t in_size = Model::input_size;
  static_assert(Model::output_size == classes);
  const std::size_t batch = o.batch;

  // The batch: uniform [0,1) from the data stream mapped to [-1, 1); labels uniform in [0, 10).
  std::vector<float> x(batch * in_size);
  const std::uint64_t data_stream = fp::rng::stream(fp::rng::Purpose::data, 0);
  const std::uint64_t label_stream = fp::rng::stream(fp::rng::Purpose::data, 1);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 2.0f * fp::rng::uniform(o.seed, data_stream, i) - 1.0f;
  std::vector<std::int32_t> labels(batch);
  for (std::size_t n = 0; n < batch; ++n)
    labels[n] = std::min<std::int32_t>(classes - 1,
                                       std::int32_t(fp::rng::uniform(o.seed, label_stream, n) * float(classes)));

  Model model{fp::seed(o.seed), fp::Host{o.threads}};
  const fs::path dir = o.out;
  fs::create_directories(dir);

  write_raw(dir / "input.f32", x.data(), x.size());
  write_raw(dir / "labels.i32", labels.data(), labels.size());

  // Tensor names as torch.nn.Sequential's state_dict spells them.
  const auto& layout = Net::param_layout;
  std::vector<std::string> names;
  std::vector<std::vector<int>> dims;
  for (const fp::ParamTensor& p : layout) {
    names.push_back(std::to_string(p.layer - 1) + (p.role == fp::ParamRole::weight ? ".weight" : ".bias"));
    dims.emplace_back(p.dims.begin(), p.dims.begin() + p.rank);
  }
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto p = model.param(t);
    write_raw(dir / "param" / (names[t] + ".f32"), p.data(), p.size());
  }

  const fp::SoftmaxCrossEntropy loss_fn{};
  const float loss = model.compute_gradients(std::span<const float>(x), std::span<const std::int32_t>(labels), loss_fn);
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto g = model.grad(t);
    write_raw(dir / "grad" / (names[t] + ".f32"), g.data(), g.size());
  }
  // predict() reuses the workspace: copy its view before anything else runs on the model.
  const auto view = model.predict(std::span<const float>(x));
  const std::vector<float> logits(view.begin(), view.end());
  write_raw(dir / "logits.f32", logits.data(), logits.size());

  fp::Sgd opt{{.lr = sgd_lr, .momentum = sgd_momentum}};
  std::vector<float> train_losses;
  for (int s = 0; s < o.steps; ++s)
    train_losses.push_back(
        model.train_step(std::span<const float>(x), std::span<const std::int32_t>(labels), loss_fn, opt));
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto p = model.param(t);
    write_raw(dir / "after" / (names[t] + ".f32"), p.data(), p.size());
  }

  std::ofstream m(dir / "manifest.json", std::ios::trunc);
  m << "{\n"
    << "  \"net\": \"" << o.net << "\",\n"
    << "  \"seed\": " << o.seed << ",\n"
    << "  \"batch\": " << batch << ",\n"
    << "  \"threads\": " << model.space().threads() << ",\n"
    << "  \"input\": {\"file\": \"input.f32\", \"dtype\": \"float32\", \"dims\": "
    << json_dims({int(batch), Net::input_shape::channels, Net::input_shape::height, Net::input_shape::width})
    << "},\n"
    << "  \"labels\": {\"file\": \"labels.i32\", \"dtype\": \"int32\", \"dims\": " << json_dims({int(batch)})
    << "},\n"
    << "  \"logits\": {\"file\": \"logits.f32\", \"dtype\": \"float32\", \"dims\": "
    << json_dims({int(batch), classes}) << "},\n"
    << "  \"loss\": " << json_number(loss) << ",\n"
    << "  \"sgd\": {\"lr\": " << json_number(sgd_lr) << ", \"momentum\": " << json_number(sgd_momentum)
    << ", \"steps\": " << o.steps << "},\n"
    << "  \"train_losses\": [";
  for (std::size_t s = 0; s < train_losses.size(); ++s) m << (s ? ", " : "") << json_number(train_losses[s]);
  m << "],\n  \"params\": [\n";
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const fp::ParamTensor& p = layout[t];
    m << "    {\"name\": \"" << names[t] << "\", \"layer\": " << p.layer << ", \"role\": \""
      << (p.role == fp::ParamRole::weight ? "weight" : "bias") << "\", \"size\": " << p.size
      << ", \"dims\": " << json_dims(dims[t]) << ", \"param\": \"param/" << names[t] << ".f32\", \"grad\": \"grad/"
      << names[t] << ".f32\", \"after\": \"after/" << names[t] << ".f32\"}" << (t + 1 < layout.size() ? "," : "")
      << "\n";
  }
  m << "  ]\n}\n";
  m.close();
  if (!m) throw std::runtime_error("torch_dump: cannot write " + (dir / "manifest.json").string());

  std::cout << "torch_dump: " << o.net << " (" << Net::param_count << " parameters, batch " << batch << ", "
            << model.space().threads() << " threads): loss " << loss << ", wrote " << dir.string() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return o.net == "lenet" ? run<LeNet>(o) : run<CifarCnn>(o);
  } catch (const std::exception& e) {
    std::cerr << "torch_dump: " << e.what() << "\n";
    return 1;
  }
}
