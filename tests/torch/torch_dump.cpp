// torch_dump: runs one fusedp network on the Host space and writes everything PyTorch needs to
// reproduce the computation, and what fusedp got, for cross_check.py to compare.
//
//   torch_dump --net lenet|cifar|resblock|resnet18 --out DIR [--seed N] [--batch N] [--threads N] [--steps N]
//              [--precision f32|f64]
//
// Written to DIR (raw little-endian float32 (float64 with --precision f64: .f64 files) / int32, C order,
// shapes in manifest.json; the input is float32 either way):
//   input.f32              (B, C, H, W) in [-1, 1)
//   labels.i32             (B) in [0, 10)
//   param/<name>.f32       each parameter tensor before training; <name> is PyTorch's ("0.weight")
//   grad/<name>.f32        its gradient of the mean loss from compute_gradients
//   logits.f32             (B, 10) from predict() (evaluation mode) after compute_gradients
//   after/<name>.f32       each parameter after `steps` train_step calls with Sgd(lr 0.05, momentum 0.9)
//   buffer/<name>.f32      each BatchNorm buffer (running_mean, running_var, num_batches_tracked) then
//   eval_logits.f32        (B, 10) from predict() then
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
using ResNet18 = fp::models::ResNet18Cifar<10>;
static_assert(ResNet18::param_count == 11'173'962);
// A ResNet small enough to check quickly: a stem, an identity block and a projection block, 8x8 input.
using ResBlock = fp::Sequential<fp::Input<3, 8, 8>, fp::Named<fp::models::names::conv1, fp::Conv2d<4, 3, 1, 1, fp::no_bias>>,
                                fp::Named<fp::models::names::bn1, fp::BatchNorm2d<>>, fp::ReLU,
                                fp::Named<fp::models::names::layer1_0, fp::models::BasicBlock<4, 1, false>>, fp::ReLU,
                                fp::Named<fp::models::names::layer2_0, fp::models::BasicBlock<8, 2, true>>, fp::ReLU,
                                fp::GlobalAvgPool2d, fp::Flatten, fp::Named<fp::models::names::fc, fp::Linear<10>>>;

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
  bool double_precision = false;  // --precision f64 (resnet18 only: keeps the instantiations few)
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "torch_dump: " << problem << "\n"
            << "usage: torch_dump --net lenet|cifar|resblock|resnet18 --out DIR [--seed N] [--batch N] [--threads N] [--steps N] [--precision f32|f64]\n";
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
    else if (a == "--precision") {
      if (std::string_view(v) != "f32" && std::string_view(v) != "f64") usage("--precision must be f32 or f64");
      o.double_precision = std::string_view(v) == "f64";
    }
    else usage("unknown argument " + std::string(a));
  }
  if (o.net != "lenet" && o.net != "cifar" && o.net != "resblock" && o.net != "resnet18")
    usage("--net must be lenet, cifar, resblock or resnet18, got '" + o.net + "'");
  if (o.out.empty()) usage("--out DIR is required");
  if (o.batch == 0) usage("--batch must be positive");
  if (o.double_precision && o.net != "resnet18") usage("--precision f64 is built for --net resnet18 only");
  return o;
}

template <class T>
void write_raw(const fs::path& path, const T* data, std::size_t n) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
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

template <class Net, class T>
int run(const Options& o) {
  using Model = fp::Model<Net, fp::Host, T>;
  const std::string ext = sizeof(T) == 4 ? ".f32" : ".f64";
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
  const std::vector<T> xt(x.begin(), x.end());
  write_raw(dir / "labels.i32", labels.data(), labels.size());

  // Tensor names as torch.nn.Sequential's state_dict spells them.
  const auto& layout = Net::param_layout;
  std::vector<std::string> names;
  std::vector<std::vector<int>> dims;
  for (const fp::ParamTensor& p : layout) {
    names.push_back(p.name.c_str());
    dims.emplace_back(p.dims.begin(), p.dims.begin() + p.rank);
  }
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto p = model.param(t);
    write_raw(dir / "param" / (names[t] + ext), p.data(), p.size());
  }

  const fp::SoftmaxCrossEntropy loss_fn{};
  const T loss = model.compute_gradients(std::span<const T>(xt), std::span<const std::int32_t>(labels), loss_fn);
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto g = model.grad(t);
    write_raw(dir / "grad" / (names[t] + ext), g.data(), g.size());
  }
  // predict() reuses the workspace: copy its view before anything else runs on the model.
  const auto view = model.predict(std::span<const T>(xt));
  const std::vector<T> logits(view.begin(), view.end());
  write_raw(dir / ("logits" + ext), logits.data(), logits.size());

  fp::Sgd opt{{.lr = sgd_lr, .momentum = sgd_momentum}};
  std::vector<double> train_losses;
  for (int s = 0; s < o.steps; ++s)
    train_losses.push_back(
        model.train_step(std::span<const T>(xt), std::span<const std::int32_t>(labels), loss_fn, opt));
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const auto p = model.param(t);
    write_raw(dir / "after" / (names[t] + ext), p.data(), p.size());
  }
  std::vector<const fp::StateTensor*> buffers;
  for (const fp::StateTensor& s : Net::state_layout) {
    if (s.kind != fp::StateKind::buffer) continue;
    buffers.push_back(&s);
    write_raw(dir / "buffer" / (std::string(s.name.c_str()) + ext), model.buffers().data() + s.offset, s.size);
  }
  const auto eval_view = model.predict(std::span<const T>(xt));
  write_raw(dir / ("eval_logits" + ext), eval_view.data(), eval_view.size());

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
    << "  \"dtype\": \"" << (sizeof(T) == 4 ? "float32" : "float64") << "\",\n"
    << "  \"logits\": {\"file\": \"logits" << ext << "\", \"dims\": "
    << json_dims({int(batch), classes}) << "},\n"
    << "  \"eval_logits\": {\"file\": \"eval_logits" << ext << "\", \"dims\": "
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
      << (p.role == fp::ParamRole::weight ? "weight" : "bias") << "\", \"constant\": " << (p.constant ? "true" : "false")
      << ", \"size\": " << p.size
      << ", \"dims\": " << json_dims(dims[t]) << ", \"param\": \"param/" << names[t] << ext << "\", \"grad\": \"grad/"
      << names[t] << ext << "\", \"after\": \"after/" << names[t] << ext << "\"}" << (t + 1 < layout.size() ? "," : "")
      << "\n";
  }
  m << "  ],\n  \"buffers\": [\n";
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const fp::StateTensor& s = *buffers[b];
    const std::string name = s.name.c_str();
    m << "    {\"name\": \"" << name << "\", \"dims\": " << json_dims({s.dims.begin(), s.dims.begin() + s.rank})
      << ", \"file\": \"buffer/" << name << ext << "\"}" << (b + 1 < buffers.size() ? "," : "") << "\n";
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
    if (o.net == "lenet") return run<LeNet, float>(o);
    if (o.net == "cifar") return run<CifarCnn, float>(o);
    if (o.net == "resblock") return run<ResBlock, float>(o);
    if (o.double_precision) return run<ResNet18, double>(o);
    return run<ResNet18, float>(o);
  } catch (const std::exception& e) {
    std::cerr << "torch_dump: " << e.what() << "\n";
    return 1;
  }
}
