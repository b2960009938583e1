// lenet_mnist: trains the LeNet of PyTorch's multi-GPU tutorial on Fashion-MNIST (or any folder of
// MNIST-format IDX files) on the CPU, reports progress, evaluates on the test set after each epoch.
//
//   lenet_mnist                          # Debian's Fashion-MNIST, 2 epochs
//   lenet_mnist --data ~/mnist --epochs 5 --metrics run.jsonl
#include <fusedp/data/batches.hpp>
#include <fusedp/data/idx.hpp>
#include <fusedp/fusedp.hpp>
#include <fusedp/train/metrics.hpp>
#include <fusedp/train/progress.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace fp = fusedp;

// conv 5x5 1->6, pool 2, conv 3x3 6->16, pool 2, linear 400->120->60->10, ReLU between.
using LeNet = fp::Sequential<fp::Input<1, 28, 28>,
                             fp::Conv2d<6, 5>, fp::ReLU, fp::MaxPool2d<2>,
                             fp::Conv2d<16, 3>, fp::ReLU, fp::MaxPool2d<2>,
                             fp::Flatten,
                             fp::Linear<120>, fp::ReLU, fp::Linear<60>, fp::ReLU, fp::Linear<10>>;
static_assert(LeNet::output_shape::size == 10);
static_assert(LeNet::param_count == 57'026);

struct Options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  int epochs = 2;
  int batch = 64;
  float lr = 0.05f;
  float momentum = 0.9f;
  std::uint64_t seed = 42;
  int threads = 0;
  std::string metrics;
};

struct TestResult {
  double loss;
  double accuracy;
};

template <class Model>
TestResult evaluate(Model& model, const fp::data::Dataset& test) {
  constexpr std::size_t chunk = 1000;
  const std::size_t sample = Model::input_size;
  double loss = 0;
  std::size_t correct = 0;
  for (std::size_t first = 0; first < test.count; first += chunk) {
    const std::size_t n = std::min(chunk, test.count - first);
    const std::span<const float> x(test.images.data() + first * sample, n * sample);
    const std::span<const std::int32_t> y(test.labels.data() + first, n);
    const auto result = model.evaluate(x, y, fp::SoftmaxCrossEntropy{});
    loss += double(result.loss) * double(n);
    correct += fp::count_correct(result.outputs, y);
  }
  return {loss / double(test.count), double(correct) / double(test.count)};
}

int run(const Options& o) {
  auto train = fp::data::load_mnist(o.data, fp::data::Split::train);
  auto test = fp::data::load_mnist(o.data, fp::data::Split::test);
  const auto [mean, stddev] = fp::data::mean_std(train);
  fp::data::normalize(train, mean, stddev);
  fp::data::normalize(test, mean, stddev);
  fp::require(train.height == 28 && train.width == 28 && train.channels == 1, o.data,
              ": LeNet needs 1x28x28 images, the files hold ", train.channels, "x", train.height, "x", train.width);

  fp::Host host{o.threads};
  fp::Model<LeNet, fp::Host> model{fp::seed(o.seed), host};
  fp::Sgd opt{{.lr = o.lr, .momentum = o.momentum}};
  fp::train::MetricsWriter metrics = o.metrics.empty() ? fp::train::MetricsWriter{} : fp::train::MetricsWriter{o.metrics};
  fp::train::ProgressLine progress;

  const std::size_t batch = std::size_t(o.batch), sample = LeNet::input_shape::size;
  const std::size_t steps = (train.count + batch - 1) / batch;  // the last batch may be smaller
  std::vector<float> images(batch * sample);
  std::vector<std::int32_t> labels(batch);
  model.reserve(batch);
  std::printf("fusedp %s: LeNet (%zu parameters) on %s, %zu train / %zu test images, %d threads\n",
              FUSEDP_VERSION_STRING, LeNet::param_count, o.data.c_str(), train.count, test.count, host.threads());

  double total_seconds = 0, total_images = 0;
  TestResult result{};
  for (int epoch = 1; epoch <= o.epochs; ++epoch) {
    const auto order = fp::data::permutation(train.count, o.seed, std::uint64_t(epoch));
    progress.start_epoch(std::size_t(epoch), std::size_t(o.epochs), steps);
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::size_t seen = 0;
    for (std::size_t s = 0; s < steps; ++s) {
      const std::size_t n = std::min(batch, train.count - s * batch);
      const std::span<const std::size_t> idx(order.data() + s * batch, n);
      const std::span<float> x(images.data(), n * sample);
      const std::span<std::int32_t> y(labels.data(), n);
      fp::data::gather<float>(train.images, train.labels, sample, idx, x, y);
      loss_sum += double(model.train_step(std::span<const float>(x), std::span<const std::int32_t>(y),
                                          fp::SoftmaxCrossEntropy{}, opt)) * double(n);
      seen += n;
      progress.update(s + 1, loss_sum / double(seen), seen);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_seconds += seconds;
    total_images += double(seen);
    result = evaluate(model, test);
    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %d/%d  train loss %.4f  test loss %.4f  test accuracy %.2f%%  %.0f images/s  %.1fs", epoch,
                  o.epochs, loss_sum / double(seen), result.loss, 100 * result.accuracy, double(seen) / seconds,
                  seconds);
    progress.finish(line);
    metrics.write({{"epoch", (long long)epoch},
                   {"train_loss", loss_sum / double(seen)},
                   {"test_loss", result.loss},
                   {"test_accuracy", result.accuracy},
                   {"images_per_s", double(seen) / seconds},
                   {"seconds", seconds}});
  }
  std::printf("done: %d epochs in %.1fs (%.0f images/s training), test accuracy %.2f%%\n", o.epochs, total_seconds,
              total_images / total_seconds, 100 * result.accuracy);
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Train LeNet on Fashion-MNIST (or any MNIST-format folder) with fusedp on the CPU"};
  Options o;
  app.add_option("--data", o.data, "folder with {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]")
      ->capture_default_str();
  app.add_option("--epochs", o.epochs, "passes over the training set")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--batch", o.batch, "samples per step")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate")->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::Range(0.0f, 0.999999f))->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the weights and the shuffle")->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads (0: one per core)")->check(CLI::Range(0, 1024))->capture_default_str();
  app.add_option("--metrics", o.metrics, "write one JSON object per epoch to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    (void)app.exit(e);
    return 1;
  }
  try {
    return run(o);
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "lenet_mnist: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lenet_mnist: unexpected error: %s\n", e.what());
    return 1;
  }
}
