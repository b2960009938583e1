// What every example shares, so that each example file shows only its network, its data and its
// optimizer: the common flags, turning any error into a clear message and exit code 1, and the
// training loop (epochs, progress line, evaluation, metrics, checkpoints, resume).
#pragma once

#include <fusedp/data/loader.hpp>
#include <fusedp/fusedp.hpp>
#include <fusedp/train/checkpoint.hpp>
#include <fusedp/train/metrics.hpp>
#include <fusedp/train/progress.hpp>

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <optional>
#include <string>
#include <utility>

namespace example {

namespace fp = fusedp;
namespace fd = fusedp::data;
namespace ft = fusedp::train;

/// The flags every example takes. Defaults are the values the example sets before calling
/// add_training_flags.
struct TrainFlags {
  int epochs = 2;
  int batch = 64;
  float lr = 0.05f;
  std::uint64_t seed = 42;
  int threads = 0;
  std::string metrics;     // JSON lines, one per epoch
  std::string checkpoint;  // folder written after every epoch
  std::string resume;      // folder to continue from
};

inline void add_training_flags(CLI::App& app, TrainFlags& f) {
  app.add_option("--epochs", f.epochs, "passes over the training set (in total, when resuming)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch", f.batch, "samples per step")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate")->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the weights, the shuffle and the augmentation")->capture_default_str();
  app.add_option("--threads", f.threads, "CPU threads (0: one per core)")->check(CLI::Range(0, 1024))->capture_default_str();
  app.add_option("--metrics", f.metrics, "write one JSON object per epoch to this file (scripts/plot_metrics.py plots it)");
  app.add_option("--checkpoint", f.checkpoint,
                 "save weights (model.safetensors, loadable by PyTorch) and training state into this folder after "
                 "every epoch");
  app.add_option("--resume", f.resume, "continue the run saved in this checkpoint folder");
}

/// Parses the command line and runs `body`. Help exits 0; a bad flag prints CLI11's message and exits 1;
/// any error from the run prints "<name>: error: <what>" (which names the file or flag) and exits 1.
template <class Body>
int run_main(const char* name, CLI::App& app, int argc, char** argv, Body&& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;
  }
  try {
    return body();
  } catch (const fp::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: error: out of memory\n", name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: unexpected error: %s\n", name, e.what());
  }
  return 1;
}

/// Runs f(), prefixing a fusedp error with the flag whose value caused it ("--resume: ck: ...").
template <class F>
decltype(auto) with_flag(const char* flag, F&& f) {
  try {
    return f();
  } catch (const fp::Error& e) {
    throw fp::DataError(flag, e.what());
  }
}

/// When --resume is given, the verified training state of that checkpoint. The model must then be
/// constructed with its seed: an explicit --seed that differs is an error, not a silent change.
inline std::optional<ft::TrainingState> resume_state(const CLI::App& app, TrainFlags& f) {
  if (f.resume.empty()) return std::nullopt;
  ft::TrainingState s = with_flag("--resume", [&] { return ft::read_training_state(f.resume); });
  if (app.count("--seed") > 0 && f.seed != s.model_seed)
    throw fp::InvalidArgument("--seed " + std::to_string(f.seed) + " differs from the seed " +
                              std::to_string(s.model_seed) + " of the checkpoint in " + f.resume +
                              "; leave --seed out when resuming");
  if (s.data_seed != s.model_seed)
    throw fp::DataError(f.resume, "was trained with data seed " + std::to_string(s.data_seed) + " and model seed " +
                                      std::to_string(s.model_seed) + "; the examples use one seed for both");
  f.seed = s.model_seed;
  return s;
}

/// Fails early, before any training, when the --checkpoint folder cannot be created or written.
inline void check_checkpoint_folder(const std::string& dir) {
  with_flag("--checkpoint", [&] {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir, ec))
      throw fp::DataError(dir, "cannot create the checkpoint folder" + (ec ? ": " + ec.message() : std::string()));
    const std::string probe = (std::filesystem::path(dir) / ".fusedp_write_test").string();
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      const int err = errno;
      throw fp::DataError(dir, "cannot write into the checkpoint folder: " + std::generic_category().message(err));
    }
    ::close(fd);
    ::unlink(probe.c_str());
  });
}

/// Mean loss over a dataset, and the accuracy for classification.
struct Evaluation {
  double loss = 0;
  std::optional<double> accuracy;
};

/// Evaluates `model` on every sample the loader yields (an evaluation-mode sampler visits each once).
template <class Model, class Loss>
Evaluation evaluate(Model& model, fd::DataLoader& loader, const Loss& loss) {
  double sum = 0;
  std::size_t correct = 0, seen = 0;
  const bool classification = !loader.dataset().regression();
  loader.set_epoch(0);
  while (auto b = loader.next()) {
    const std::size_t n = b->size();
    if constexpr (std::is_same_v<typename Loss::template target<float>, std::int32_t>) {
      const auto r = model.evaluate(b->images, b->labels, loss);
      sum += double(r.loss) * double(n);
      correct += fp::count_correct(r.outputs, b->labels);
    } else {
      sum += double(model.evaluate(b->images, b->targets, loss).loss) * double(n);
    }
    seen += n;
  }
  Evaluation e;
  e.loss = sum / double(seen);
  if (classification) e.accuracy = double(correct) / double(seen);
  return e;
}

/// Trains `model` for epochs 1..flags.epochs (or from the checkpoint of --resume on), evaluating on
/// `test` after each epoch, printing a progress line and a summary per epoch, writing --metrics and
/// saving --checkpoint. The loaders' sampler and augmentation seeds must be flags.seed.
template <class Model, class Opt, class Loss>
void fit(Model& model, Opt& opt, const Loss& loss, fd::DataLoader& train, fd::DataLoader& test, const TrainFlags& f,
         const std::optional<ft::TrainingState>& resumed) {
  const std::size_t dataset_size = train.dataset().count;
  std::uint64_t first_epoch = 1;
  std::size_t first_batch = 0;
  if (resumed) {
    const ft::TrainingState& s = *resumed;
    with_flag("--resume", [&] {
      (void)ft::load_checkpoint(f.resume, model, opt);  // checks the network, optimizer and files first
      if (s.dataset_size != dataset_size)
        throw fp::DataError(f.resume, "was trained on " + std::to_string(s.dataset_size) +
                                          " samples; this run has " + std::to_string(dataset_size) +
                                          " (another dataset?)");
      if (s.world_size != 1)
        throw fp::DataError(f.resume, "was trained by " + std::to_string(s.world_size) +
                                          " ranks; this example runs one process");
      if (s.batch_size != std::uint64_t(f.batch) && s.batches_done != 0)
        throw fp::DataError(f.resume, "stopped inside an epoch with --batch " + std::to_string(s.batch_size) +
                                          "; resume it with the same --batch");
    });
    if (s.batch_size != std::uint64_t(f.batch))
      std::printf("note: the checkpoint was trained with --batch %llu; continuing with %d\n",
                  static_cast<unsigned long long>(s.batch_size), f.batch);
    first_epoch = s.epochs_done + 1;
    first_batch = std::size_t(s.batches_done);
    std::printf("resumed from %s: %llu epochs and %llu steps done\n", f.resume.c_str(),
                static_cast<unsigned long long>(s.epochs_done), static_cast<unsigned long long>(s.steps));
    if (first_epoch > std::uint64_t(f.epochs)) {
      std::printf("nothing to do: the checkpoint holds %llu epochs and --epochs is %d\n",
                  static_cast<unsigned long long>(s.epochs_done), f.epochs);
      return;
    }
  }
  if (!f.checkpoint.empty()) check_checkpoint_folder(f.checkpoint);
  ft::MetricsWriter metrics;
  if (!f.metrics.empty())
    metrics = with_flag("--metrics", [&] {
      return resumed ? ft::MetricsWriter::resume(f.metrics, first_epoch - 1) : ft::MetricsWriter{f.metrics};
    });

  ft::ProgressLine progress{stdout, train.dataset().regression() ? "samples" : "images"};
  model.reserve(std::size_t(f.batch));
  double total_seconds = 0, total_samples = 0;
  Evaluation result;
  for (std::uint64_t epoch = first_epoch; epoch <= std::uint64_t(f.epochs); ++epoch) {
    const std::size_t first = epoch == first_epoch ? first_batch : 0;
    train.set_epoch(epoch, first);
    progress.start_epoch(std::size_t(epoch), std::size_t(f.epochs), train.batches());
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::size_t seen = 0;
    while (auto b = train.next()) {
      const std::size_t n = b->size();
      float l = 0;
      if constexpr (std::is_same_v<typename Loss::template target<float>, std::int32_t>) l = model.train_step(b->images, b->labels, loss, opt);
      else l = model.train_step(b->images, b->targets, loss, opt);
      loss_sum += double(l) * double(n);
      seen += n;
      progress.update(b->index + 1, loss_sum / double(seen), seen);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_seconds += seconds;
    total_samples += double(seen);
    result = evaluate(model, test, loss);
    const double train_loss = seen > 0 ? loss_sum / double(seen) : 0.0;
    char line[256];
    if (result.accuracy)
      std::snprintf(line, sizeof line,
                    "epoch %llu/%d  train loss %.4f  test loss %.4f  test accuracy %.2f%%  %.0f images/s  %.1fs",
                    static_cast<unsigned long long>(epoch), f.epochs, train_loss, result.loss, 100 * *result.accuracy,
                    double(seen) / seconds, seconds);
    else
      std::snprintf(line, sizeof line, "epoch %llu/%d  train loss %.6f  test loss %.6f  %.0f samples/s  %.1fs",
                    static_cast<unsigned long long>(epoch), f.epochs, train_loss, result.loss, double(seen) / seconds,
                    seconds);
    progress.finish(line);
    if (result.accuracy)
      metrics.write({{"epoch", static_cast<long long>(epoch)},
                     {"train_loss", train_loss},
                     {"test_loss", result.loss},
                     {"test_accuracy", *result.accuracy},
                     {"images_per_s", double(seen) / seconds},
                     {"seconds", seconds}});
    else
      metrics.write({{"epoch", static_cast<long long>(epoch)},
                     {"train_loss", train_loss},
                     {"test_loss", result.loss},
                     {"samples_per_s", double(seen) / seconds},
                     {"seconds", seconds}});
    if (!f.checkpoint.empty()) {
      ft::TrainingState s;
      s.epochs_done = epoch;
      s.data_seed = f.seed;
      s.dataset_size = dataset_size;
      s.batch_size = std::uint64_t(f.batch);
      with_flag("--checkpoint", [&] { ft::save_checkpoint(f.checkpoint, model, s); });
    }
  }
  if (total_seconds > 0) {
    const auto epochs = static_cast<unsigned long long>(std::uint64_t(f.epochs) - first_epoch + 1);
    if (result.accuracy)
      std::printf("done: %llu epochs in %.1fs (%.0f images/s training), test accuracy %.2f%%\n", epochs,
                  total_seconds, total_samples / total_seconds, 100 * *result.accuracy);
    else
      std::printf("done: %llu epochs in %.1fs (%.0f samples/s training), test loss %.6f\n", epochs, total_seconds,
                  total_samples / total_seconds, result.loss);
  }
}

}  // namespace example
