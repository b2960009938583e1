// What every example shares, so that each example file shows only its network, its data and its
// optimizer: the common flags, turning any error into a clear message and exit code 1, where the run
// goes (--device cpu or cuda[:N]) and how it is spread (one model; --replicas N in this process,
// DataParallel style; one replica per rank under mpirun, DistributedDataParallel style), and the
// training loop (epochs, progress line, evaluation, metrics, checkpoints, resume).
//
// Where CUDA is enabled, examples/CMakeLists.txt builds each example twice: <name> by the C++ compiler
// (the Host kernels at full vector width) and <name>_cuda by nvcc (FUSEDP_EXAMPLE_GPU_PART). run_main
// hands a --device cuda run of <name> to <name>_cuda beside it (exec, same arguments).
#pragma once

#include <fusedp/data/device_loader.hpp>
#include <fusedp/data/loader.hpp>
#include <fusedp/exec/peak.hpp>
#include <fusedp/fusedp.hpp>
#include <fusedp/net/cost.hpp>
#include <fusedp/parallel/parallel.hpp>
#include <fusedp/parallel/replica_memory.hpp>
#include <fusedp/train/checkpoint.hpp>
#include <fusedp/train/parallel_checkpoint.hpp>
#include <fusedp/train/metrics.hpp>
#include <fusedp/train/progress.hpp>

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstring>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

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
  int replicas = 1;        // in this process
#if defined(FUSEDP_EXAMPLE_GPU_PART)
  std::string device = "cuda";  // cpu, cuda or cuda:N
#else
  std::string device = "cpu";
#endif
  std::string metrics;     // JSON lines, one per epoch
  std::string checkpoint;  // folder written after every epoch
  std::string resume;      // folder to continue from
  double peak_gflops = 0;  // the machines' peak for utilization (0: measured on the CPU, from the GPU's data)
  std::string schedule = "constant";  // the learning rate over the run: constant or cosine
  int warmup = 0;                     // steps of linear warm-up before it
  int step_epochs = 10;               // --schedule step: epochs between two reductions of the rate
  float gamma = 0.1f;                 // --schedule step: the factor of each reduction
  float weight_decay = 0.0f;          // L2 penalty (SGD, Adam) or decoupled decay (AdamW)
  std::string decay = "weights";      // what the weight decay applies to: weights or all
  bool nesterov = false;              // SGD: Nesterov momentum
  int accumulate = 1;                 // micro-batches of `batch` samples per step
  std::string reduce = "allreduce";   // allreduce, reduce-broadcast or zero1
  bool deterministic = false;         // AllReduce + Deterministic
  std::string compress = "none";      // none or bf16
  std::string precision = "fp32";     // the CPU's precision: fp32 or bf16
  bool overlap = true;                // reduce buckets while backward continues
  double bucket_mb = 4;               // gradient bucket capacity
  bool sync_bn = false;               // SyncBatchNorm
  std::string on_nonfinite = "stop";  // a NaN or infinite gradient: stop or skip
  float clip_grad_norm = 0;           // the largest global L2 norm of a step's gradient (0: no clipping)
  std::string trace;                  // Chrome trace of the run (rank r of several: .rank<r> before the extension)
};

/// Samples per step in each process: --batch per micro-batch, --accumulate micro-batches.
inline std::size_t step_batch(const TrainFlags& f) { return std::size_t(f.batch) * std::size_t(f.accumulate); }

/// The exit status of a run stopped by SIGTERM or SIGUSR1 (EX_TEMPFAIL: "try again"), after it saved
/// a checkpoint to resume from when --checkpoint was given.
inline constexpr int preempted_status = 75;

inline void add_training_flags(CLI::App& app, TrainFlags& f) {
  app.add_option("--epochs", f.epochs, "passes over the training set (in total, when resuming)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--batch", f.batch, "samples per step (per micro-batch with --accumulate), in each process")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--accumulate", f.accumulate,
                 "micro-batches per step: their gradients are summed before one reduction and update, so a step "
                 "trains on accumulate x batch samples per process with the memory of one micro-batch")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--reduce", f.reduce,
                 "how replicas combine gradients: allreduce (DDP), reduce-broadcast (DataParallel: the root steps "
                 "and broadcasts) or zero1 (ZeRO-1: each replica updates, and holds the optimizer state of, a block)")
      ->check(CLI::IsMember({"allreduce", "reduce-broadcast", "zero1"}))
      ->capture_default_str();
  app.add_flag("--deterministic", f.deterministic,
               "sum gradients in rank order: the same bits on every run, whatever the communicator does");
  app.add_option("--compress", f.compress, "send gradients as bf16 (half the bytes) or not (none)")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->capture_default_str();
  app.add_option("--bucket-mb", f.bucket_mb, "the capacity of a gradient bucket, in MiB (DDP's bucket_cap_mb)")
      ->check(CLI::Range(0.001, 65536.0))
      ->capture_default_str();
  app.add_flag("!--no-overlap", f.overlap, "reduce the gradients after backward instead of bucket by bucket during it");
  app.add_flag("--sync-bn", f.sync_bn,
               "SyncBatchNorm: BatchNorm statistics over every replica's shard (default: each shard's own, rank 0's "
               "running statistics broadcast)");
  app.add_option("--on-nonfinite", f.on_nonfinite,
                 "a step whose gradient is NaN or infinite: stop (exit 1, naming the step and the first tensor) or "
                 "skip it (parameters unchanged; the skipped steps are counted in each epoch's line)")
      ->check(CLI::IsMember({"stop", "skip"}))
      ->capture_default_str();
  app.add_option("--clip-grad-norm", f.clip_grad_norm,
                 "scale each step's gradient down to this global L2 norm when it is larger, as PyTorch's "
                 "clip_grad_norm_ (0: no clipping)")
      ->check(CLI::Range(0.0f, 1e9f))
      ->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate")->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the weights, the shuffle and the augmentation")->capture_default_str();
  app.add_option("--threads", f.threads, "CPU threads of this process (0: one per CPU it may use: its affinity mask and CPU quota, shared with the other ranks on its machine and among its replicas)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--replicas", f.replicas,
                 "data-parallel replicas in this process, each taking a share of every batch (under mpirun: one "
                 "replica per rank instead)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--device", f.device, "where to train: cpu, or cuda[:N] (GPU N, default 0; a build with CUDA)")
      ->capture_default_str();
  app.add_option("--precision", f.precision,
                 "--device cpu: fp32, or bf16 (GEMM operands rounded to bfloat16, activations and their "
                 "gradients stored as bfloat16 values; fp32 sums, logits and weights; needs a CPU with AVX-512 BF16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--metrics", f.metrics, "write one JSON object per epoch to this file (scripts/plot_metrics.py plots it)");
  app.add_option("--checkpoint", f.checkpoint,
                 "save weights (model.safetensors, loadable by PyTorch) and training state into this folder after "
                 "every epoch");
  app.add_option("--resume", f.resume, "continue the run saved in this checkpoint folder");
  app.add_option("--schedule", f.schedule,
                 "the learning rate over the run: constant; step (times --gamma every --step-epochs epochs, as "
                 "PyTorch's StepLR); or cosine (from --lr down to 0 at the last step)")
      ->check(CLI::IsMember({"constant", "step", "cosine"}))
      ->capture_default_str();
  app.add_option("--step-epochs", f.step_epochs, "--schedule step: epochs between two reductions of the rate")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--gamma", f.gamma, "--schedule step: the factor of each reduction")
      ->check(CLI::Range(0.0f, 1.0f))
      ->capture_default_str();
  app.add_option("--weight-decay", f.weight_decay, "weight decay (L2 for SGD and Adam)")
      ->check(CLI::Range(0.0f, 1.0f))
      ->capture_default_str();
  app.add_option("--decay", f.decay,
                 "what the weight decay applies to: weights (conv and linear weights; not biases or BatchNorm) or "
                 "all (every parameter, PyTorch's default)")
      ->check(CLI::IsMember({"weights", "all"}))
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "steps over which the learning rate rises linearly to --lr first")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  app.add_option("--peak-gflops", f.peak_gflops,
                 "the peak GFLOP/s of all the processors the run uses, the denominator of the utilization printed "
                 "per epoch (default: measured at start, the CPU's rate of the instruction its precision multiplies with: "
                 "fp32 FMA, or at bf16 AMX tiles where it has them, else VDPBF16PS; or the GPU's dense rate at its "
                 "precision)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--trace", f.trace,
                 "write a timeline of the run to this file as a Chrome trace (open it in ui.perfetto.dev; under "
                 "mpirun each rank writes FILE with .rank<r> before the extension; scripts/trace_report.py merges "
                 "them and splits each step's time)");
}

/// The flags of the SGD examples: --momentum and --nesterov (their defaults are the example's).
inline void add_sgd_flags(CLI::App& app, TrainFlags& f, float& momentum) {
  app.add_option("--momentum", momentum, "SGD momentum")->check(CLI::Range(0.0f, 0.999999f))->capture_default_str();
  app.add_flag("--nesterov,!--no-nesterov", f.nesterov, "Nesterov momentum (or plain momentum)")->capture_default_str();
}

/// The SGD of the flags (--lr, --weight-decay, --decay, --nesterov) with `momentum`.
inline fp::Sgd sgd_of(const TrainFlags& f, float momentum) {
  return fp::Sgd{{.lr = f.lr,
                  .momentum = momentum,
                  .weight_decay = f.weight_decay,
                  .nesterov = f.nesterov,
                  .decay = f.decay == "all" ? fp::Decay::all : fp::Decay::weights}};
}
/// The Adam of the flags (--lr, --weight-decay, --decay).
inline fp::Adam adam_of(const TrainFlags& f) {
  return fp::Adam{{.lr = f.lr, .weight_decay = f.weight_decay, .decay = f.decay == "all" ? fp::Decay::all : fp::Decay::weights}};
}
/// The optimizer's part of the first line: "SGD (Nesterov) momentum 0.9, weight decay 0.0005 on weights".
inline std::string optimizer_text(const TrainFlags& f, const char* name, float momentum = -1) {
  std::string t = name;
  char buf[160];
  if (momentum >= 0) {
    std::snprintf(buf, sizeof buf, "%s momentum %g", f.nesterov ? " (Nesterov)" : "", double(momentum));
    t += buf;
  }
  std::snprintf(buf, sizeof buf, ", lr %g (%s%s), weight decay %g%s", double(f.lr), f.schedule.c_str(),
                f.warmup > 0 ? (", " + std::to_string(f.warmup) + " warm-up steps").c_str() : "", double(f.weight_decay),
                f.weight_decay > 0 ? (f.decay == "all" ? " on every parameter" : " on conv and linear weights") : "");
  return t + buf;
}

/// Thrown by fit when SIGTERM or SIGUSR1 stopped the run (after its checkpoint was saved); run_main
/// turns it into exit status preempted_status.
struct Preempted {
  int signal;
};

namespace detail {
inline std::atomic<int> stop_signal{0};
inline void on_stop_signal(int sig) {
  if (stop_signal.exchange(sig) != 0) {  // the second signal: no more waiting
    static const char msg[] = "second stop signal: exiting at once, without saving\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(128 + sig);
  }
}
}  // namespace detail

/// For the length of a run: SIGTERM and SIGUSR1 (what SLURM and Kubernetes send before they stop a
/// job) ask it to stop after the current step; a second signal ends the process at once.
class StopSignals {
 public:
  StopSignals() {
    detail::stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = detail::on_stop_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGUSR1, &sa, &old_usr1_);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGUSR1, &old_usr1_, nullptr);
  }
  /// The signal received (0: none).
  [[nodiscard]] int received() const noexcept { return detail::stop_signal.load(); }

 private:
  struct sigaction old_term_ {};
  struct sigaction old_usr1_ {};
};

/// Parses the command line and runs `body`. Help exits 0; a bad flag prints CLI11's message and exits 1;
/// any error from the run prints "<name>: error: <what>" (which names the file or flag) and exits 1.
inline bool wants_gpu(int argc, char** argv);

/// Replaces this process with `program` from this program's folder, with the same arguments (a
/// --device cuda run of an example built by the C++ compiler). Returns only on failure.
inline int exec_sibling(const char* name, const char* program, char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string path = ((ec ? std::filesystem::path(argv[0]) : self).parent_path() / program).string();
  ::execv(path.c_str(), argv);
  std::fprintf(stderr, "%s: error: --device: cannot start %s, the CUDA build of this example: %s\n", name,
               path.c_str(), std::generic_category().message(errno).c_str());
  return 1;
}

template <class Body>
int run_main(const char* name, CLI::App& app, int argc, char** argv, Body&& body) {
#if defined(FUSEDP_EXAMPLE_CUDA_PROGRAM)
  if (wants_gpu(argc, argv)) return exec_sibling(name, FUSEDP_EXAMPLE_CUDA_PROGRAM, argv);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;
  }
  try {
    return body();
  } catch (const Preempted&) {
    return preempted_status;
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

/// Where a checkpoint stands, for messages: "after epoch 3" or "in epoch 4, after step 17".
inline std::string checkpoint_point(const ft::TrainingState& s) {
  if (s.batches_done == 0) return "after epoch " + std::to_string(s.epochs_done);
  return "in epoch " + std::to_string(s.epochs_done + 1) + ", after step " + std::to_string(s.batches_done);
}

/// The trace file of this process for --trace FILE: FILE itself in a run of one process, else FILE with
/// .rank<r> before its extension (run.json -> run.rank0.json, run.rank1.json, ...).
inline std::string rank_trace_path(const std::string& path, int rank, int world) {
  if (world <= 1) return path;
  const std::filesystem::path p(path);
  const std::string ext = p.extension().string();
  const std::string stem = ext.empty() ? path : path.substr(0, path.size() - ext.size());
  return stem + ".rank" + std::to_string(rank) + ext;
}

/// --trace: while it lives, this process's spans are recorded (fusedp/exec/trace.hpp); write() saves
/// them and rank 0 prints the overlap of gradient reduction with backward. A run that ends by an
/// error or a signal still writes what it recorded.
class TraceFile {
 public:
  TraceFile(const std::string& path, int rank, int world) : path_(rank_trace_path(path, rank, world)) {
    if (path.empty()) return;
    char host[256] = "";
    (void)gethostname(host, sizeof host - 1);
    // Fails now, with the file's name, rather than after the run.
    with_flag("--trace", [&] {
      std::FILE* f = std::fopen(path_.c_str(), "wb");
      if (f == nullptr) throw fp::DataError(path_, std::string("cannot write the trace: ") + std::strerror(errno));
      std::fclose(f);
    });
    recorder_ = std::make_unique<fp::trace::Recorder>(rank, world, host);
    recorder_->name_lane(0, world > 1 ? "rank " + std::to_string(rank) : "main");
    session_ = std::make_unique<fp::trace::Session>(*recorder_);
  }
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;
  ~TraceFile() {
    try {
      write(false);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "--trace: %s\n", e.what());
    }
  }

  /// Stops recording, writes the file, and (`report`, rank 0) prints where it is and the overlap.
  void write(bool report) {
    if (!recorder_) return;
    session_.reset();
    const std::unique_ptr<fp::trace::Recorder> r = std::move(recorder_);
    with_flag("--trace", [&] { r->write(path_); });
    if (!report || r->rank() != 0) return;
    const fp::trace::OverlapFigure f = r->overlap();
    std::printf("trace: %s (%zu spans)", path_.c_str(), r->size());
    if (f.reduce_seconds > 0)
      std::printf("; gradient reduction %.1f ms, %.1f ms of it exposed: %.0f%% hidden behind backward\n",
                  1e3 * f.reduce_seconds, 1e3 * f.exposed_seconds, 100 * f.overlap());
    else
      std::printf("; no gradient reduction (one replica)\n");
  }

 private:
  std::string path_;
  std::unique_ptr<fp::trace::Recorder> recorder_;
  std::unique_ptr<fp::trace::Session> session_;
};

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

/// How this run is spread over processes: one, or the ranks of mpirun (each with its own share of
/// the data). MPI is initialized here when the program was started by mpirun.
class Launch {
 public:
  Launch() {
    if (!fp::launched_by_mpirun()) return;
#if FUSEDP_WITH_MPI
    mpi_ = std::make_unique<fp::MpiWorld>();
    world_ = mpi_->size();
    rank_ = mpi_->rank();
#else
    throw fp::InvalidArgument("started by mpirun with several ranks, but this program was built without MPI "
                              "(apt-get install libopenmpi-dev, then rebuild)");
#endif
  }
  /// Processes (MPI ranks) taking part.
  [[nodiscard]] int world() const { return world_; }
  [[nodiscard]] int rank() const { return rank_; }
  /// Rank 0 prints, writes metrics and checkpoints.
  [[nodiscard]] bool root() const { return rank_ == 0; }
  [[nodiscard]] bool mpi() const { return world_ > 1; }
#if FUSEDP_WITH_MPI
  [[nodiscard]] const fp::MpiWorld& mpi_world() const { return *mpi_; }
#endif

  /// This rank's share of a training set: a new permutation each epoch, the same on every rank, padded
  /// so every rank takes the same number of steps.
  [[nodiscard]] fd::DistributedSampler train_sampler(std::size_t size, std::uint64_t seed) const {
    return fd::DistributedSampler{size, std::size_t(world_), std::size_t(rank_), {.shuffle = true, .seed = seed}};
  }
  /// This rank's share of a test set: every sample exactly once across ranks.
  [[nodiscard]] fd::DistributedSampler eval_sampler(std::size_t size) const {
    return fd::DistributedSampler{size, std::size_t(world_), std::size_t(rank_), {.shuffle = false, .evaluation = true}};
  }

 private:
  int world_ = 1;
  int rank_ = 0;
#if FUSEDP_WITH_MPI
  std::unique_ptr<fp::MpiWorld> mpi_;
#endif
};

/// `n` random 3x32x32 images whose colour leans towards their class, so a speed run also learns.
inline fd::Dataset synthetic_cifar(std::size_t n, std::uint64_t seed, std::uint64_t split) {
  constexpr std::size_t plane = 32 * 32;
  std::vector<float> x(n * 3 * plane);
  std::vector<std::int32_t> y(n);
  const std::uint64_t stream = fp::rng::stream(fp::rng::Purpose::data, (std::uint64_t(1) << 40) | split);
  for (std::size_t i = 0; i < n; ++i) {
    y[i] = std::int32_t(fp::rng::uniform(seed, stream, i) * 10);
    for (std::size_t c = 0; c < 3; ++c) {
      const float tint = float((std::size_t(y[i]) >> c) & 1) * 0.3f;
      for (std::size_t p = 0; p < plane; ++p)
        x[(i * 3 + c) * plane + p] = 0.7f * fp::rng::uniform(seed, stream + 1, (i * 3 + c) * plane + p) + tint;
    }
  }
  return fd::make_dataset(std::move(x), std::move(y), 3, 32, 32, 10, "synthetic data");
}

/// The training and test sets of the CIFAR-10 examples: the binary batches in `data` (--data), or
/// `synthetic` random images and a fifth as many for testing (--synthetic); exactly one of the two.
inline std::pair<fd::Dataset, fd::Dataset> cifar10_or_synthetic(const std::string& data, std::size_t synthetic,
                                                                std::uint64_t seed) {
  if (!data.empty() && synthetic > 0) throw fp::InvalidArgument("give --data DIR or --synthetic N, not both");
  if (data.empty() && synthetic == 0)
    throw fp::InvalidArgument(std::string("no CIFAR-10 data: pass --data DIR, a folder with the binary batches "
                                          "data_batch_1.bin .. data_batch_5.bin and test_batch.bin (download ") +
                              fd::cifar10_url + " and extract it), or --synthetic N to time training on N random images");
  if (synthetic > 0)
    return {synthetic_cifar(synthetic, seed, 0), synthetic_cifar(std::max<std::size_t>(synthetic / 5, 1), seed, 1)};
  return {with_flag("--data", [&] { return fd::load_cifar10(data, fd::Split::train); }),
          with_flag("--data", [&] { return fd::load_cifar10(data, fd::Split::test); })};
}

/// The data-parallel trainers of the examples: each replica or rank trains on its own batches (Sharded);
/// the gradients are reduced in 4 MiB buckets as the flags say, from a closed set (each member is one
/// more instantiation of the trainer and of the training loop, so the set stays small):
///   --reduce allreduce (default)  AllReduce, each bucket while backward continues (Overlap); buckets of
///                                 --bucket-mb (ParallelOptions::bucket_bytes, a run-time value)
///        with --no-overlap        AllReduce after backward
///        with --deterministic     AllReduce + Deterministic (the same bits on every run and world)
///        with --compress bf16     AllReduce + Compress<bf16>
///        with --sync-bn           AllReduce + batch_norm::Sync (networks with BatchNorm)
///   --reduce reduce-broadcast     ReduceBroadcast (DataParallel: the root steps, then broadcasts)
///   --reduce zero1                ReduceScatter (ZeRO-1: optimizer state sharded), Overlap
/// A network with BatchNorm takes rank 0's running statistics after every step (batch_norm::Broadcast)
/// unless --sync-bn.
template <class Net, class Space, class Bn, class... P>
struct ExampleParallelOf {
  using type = fp::Parallel<Net, Space, fp::scatter::Sharded, P..., Bn>;
};
template <class Net, class Space, class... P>
struct ExampleParallelOf<Net, Space, void, P...> {
  using type = fp::Parallel<Net, Space, fp::scatter::Sharded, P...>;
};

/// --bucket-mb in bytes.
inline std::size_t bucket_bytes(const TrainFlags& f) { return std::size_t(f.bucket_mb * double(1u << 20)); }

/// Whether the flags ask for a Parallel (in one process, a Parallel of one replica when only
/// --accumulate or a reduction flag is given).
inline bool wants_parallel(const TrainFlags& f) {
  return f.replicas > 1 || f.accumulate > 1 || f.reduce != "allreduce" || f.deterministic || f.compress != "none" ||
         !f.overlap || f.sync_bn || f.bucket_mb != 4;
}

/// Calls make.template operator()<P>() with the Parallel type P the flags choose (see above); a
/// combination outside the set is an InvalidArgument that names it.
template <class Net, class Space, class Make>
void with_parallel_type(const TrainFlags& f, Make&& make) {
  using B = fp::Bucket<(4u << 20)>;
  using Bn = std::conditional_t<(Net::state_storage > 0), fp::batch_norm::Broadcast, void>;
  const auto as = [&]<class... P>() { make.template operator()<typename ExampleParallelOf<Net, Space, Bn, P...>::type>(); };
  const int knobs = int(f.deterministic) + int(f.compress != "none") + int(!f.overlap) + int(f.sync_bn);
  if (knobs > 1 || (knobs == 1 && f.reduce != "allreduce"))
    throw fp::InvalidArgument("--deterministic, --compress, --no-overlap and --sync-bn go one at a time, with --reduce "
                              "allreduce (the examples build that set of policies; a program of your own can "
                              "combine any: see parallel/policy.hpp)");
  if (f.reduce == "zero1") {
    as.template operator()<fp::reduce::ReduceScatter<B, fp::Overlap>>();
  } else if (f.reduce == "reduce-broadcast") {
    as.template operator()<fp::reduce::ReduceBroadcast<B>>();
  } else if (f.deterministic) {
    as.template operator()<fp::reduce::AllReduce<B, fp::Overlap>, fp::Deterministic>();
  } else if (f.compress == "bf16") {
    as.template operator()<fp::reduce::AllReduce<B, fp::Overlap>, fp::Compress<fp::bf16>>();
  } else if (!f.overlap) {
    as.template operator()<fp::reduce::AllReduce<B>>();
  } else if (f.sync_bn) {
    if constexpr (Net::state_storage > 0)
      make.template operator()<fp::Parallel<Net, Space, fp::scatter::Sharded, fp::reduce::AllReduce<B, fp::Overlap>,
                                            fp::batch_norm::Sync>>();
    else
      throw fp::InvalidArgument("--sync-bn: this network has no BatchNorm");
  } else {
    as.template operator()<fp::reduce::AllReduce<B, fp::Overlap>>();
  }
}

/// The one model of a trainer (replica 0 of a Parallel).
template <class Net, class S>
fp::Model<Net, S>& model_of(fp::Model<Net, S>& m) {
  return m;
}
template <class Net, class S, class... P>
fp::Model<Net, S>& model_of(fp::Parallel<Net, S, P...>& dp) {
  return dp.model(0);
}
/// Calls f on every model the trainer holds in this process.
template <class Net, class S, class F>
void for_each_model(fp::Model<Net, S>& m, F&& f) {
  f(m);
}
template <class Net, class S, class... P, class F>
void for_each_model(fp::Parallel<Net, S, P...>& dp, F&& f) {
  for (std::size_t r = 0; r < dp.local_replicas(); ++r) f(dp.model(r));
}

/// Whether a trainer's models live on a CUDA device.
template <class Trainer>
inline constexpr bool on_gpu = !std::is_same_v<typename std::remove_reference_t<
                                                   decltype(model_of(std::declval<Trainer&>()))>::space_type,
                                               fp::Host>;

/// Where the run trains, for the examples' first line: "GPU cuda:0" or "CPU, 4 threads per process".
inline std::string where(const TrainFlags& f, int threads) {
  std::string w = f.device != "cpu" ? "GPU " + (f.device == "cuda" ? std::string("cuda:0") : f.device)
                                    : "CPU, " + std::to_string(threads) + " threads per process" +
                                          (f.precision == "bf16" ? ", bf16" : "");
  if (wants_parallel(f) || fp::launched_by_mpirun()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "; gradients: %s%s%s%s%s, %g MiB buckets", f.reduce.c_str(),
                  f.deterministic ? " deterministic" : "", f.compress == "bf16" ? " bf16" : "",
                  f.overlap ? " overlapped" : " after backward", f.sync_bn ? ", SyncBatchNorm" : "", f.bucket_mb);
    w += buf;
  }
  if (f.accumulate > 1) w += "; " + std::to_string(f.accumulate) + " micro-batches of " + std::to_string(f.batch) + " per step";
  return w;
}

/// Whether the command line asks for --device other than cpu.
inline bool wants_gpu(int argc, char** argv) {
  bool gpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) gpu = std::string(argv[i + 1]) != "cpu";
    else if (a.rfind("--device=", 0) == 0) gpu = a.substr(9) != "cpu";
  }
  return gpu;
}

/// The GPU number of --device: -1 for cpu, N for cuda or cuda:N.
inline int device_number(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
      device.find_first_not_of("0123456789", 5) == std::string::npos && device.size() < 10)
    return std::stoi(device.substr(5));
  throw fp::InvalidArgument("--device " + device + ": expected cpu, cuda or cuda:N");
}

/// A hash of the command line: ranks started with different flags refuse to train together.
inline std::uint64_t flags_hash(int argc, char** argv) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 1; i < argc; ++i)
    for (const char* c = argv[i];; ++c) {
      h = (h ^ std::uint8_t(*c)) * 0x100000001b3ull;
      if (*c == 0) break;
    }
  return h;
}

/// Builds the trainer the flags and the launch ask for and calls body(trainer, threads): one Model;
/// a Parallel of --replicas models in this process; or, under mpirun, a Parallel of one model per rank.
template <class Net, class Body>
void with_trainer(const Launch& launch, const TrainFlags& f, std::uint64_t agree_on, Body&& body) {
  (void)agree_on;  // used only under mpirun
  const int threads = f.threads > 0 ? f.threads : fp::cpu_budget().usable();
  const int gpu = device_number(f.device);
  const fp::HostPrecision precision = f.precision == "bf16" ? fp::HostPrecision::bf16 : fp::HostPrecision::fp32;
#if defined(FUSEDP_EXAMPLE_GPU_PART)
  if (gpu < 0)
    throw fp::InvalidArgument("--device cpu: this is the CUDA build of the example; run the program without the "
                              "_cuda suffix for the CPU");
  if (precision != fp::HostPrecision::fp32)
    throw fp::InvalidArgument("--precision " + f.precision + ": the CUDA build of the example trains in TF32 on the "
                              "GPU; --precision chooses the CPU's arithmetic (run the program without the _cuda suffix)");
  if (launch.mpi() || wants_parallel(f)) {
#if FUSEDP_HAS_NCCL
    if (launch.mpi()) {
      if (f.replicas > 1)
        throw fp::InvalidArgument("--replicas: under mpirun each rank is one replica; leave --replicas out");
      if (f.device != "cuda")
        throw fp::InvalidArgument("--device " + f.device + ": under mpirun each rank takes the GPU of its place "
                                  "among the ranks of its machine; use --device cuda");
#if FUSEDP_WITH_MPI
      with_parallel_type<Net, fp::Cuda>(f, [&]<class P>() {
        P dp{launch.mpi_world(), fp::seed(f.seed),
             {.agree_on = agree_on, .accumulate = f.accumulate, .bucket_bytes = bucket_bytes(f)}};
        body(dp, threads);
      });
#endif
    } else {
      std::vector<int> ids;
      for (int i = 0; i < f.replicas; ++i) ids.push_back(gpu + i);
      with_parallel_type<Net, fp::Cuda>(f, [&]<class P>() {
        P dp{fp::Devices(ids), fp::seed(f.seed), {.accumulate = f.accumulate, .bucket_bytes = bucket_bytes(f)}};
        body(dp, threads);
      });
    }
#else
    throw fp::InvalidArgument("--replicas, --accumulate and mpirun with --device " + f.device +
                              " need NCCL, which this program was built without (install NCCL, then reconfigure)");
#endif
    return;
  }
  fp::Model<Net, fp::Cuda> model{fp::seed(f.seed), fp::Cuda{gpu}};
  body(model, threads);
#else
  if (gpu >= 0)
    throw fp::InvalidArgument("--device " + f.device + ": this program was built without CUDA (configure with nvcc "
                              "on the PATH, or CMAKE_CUDA_COMPILER set)");
  if (launch.mpi()) {
#if FUSEDP_WITH_MPI
    if (f.replicas > 1) throw fp::InvalidArgument("--replicas: under mpirun each rank is one replica; leave --replicas out");
    with_parallel_type<Net, fp::Host>(f, [&]<class P>() {
      P dp{launch.mpi_world(), fp::seed(f.seed),
           {.threads = f.threads, .agree_on = agree_on, .accumulate = f.accumulate, .bucket_bytes = bucket_bytes(f),
            .host_precision = precision}};
      body(dp, dp.model(0).space().threads());
    });
#endif
  } else if (wants_parallel(f)) {
    const int per = std::max(1, threads / f.replicas);
    with_parallel_type<Net, fp::Host>(f, [&]<class P>() {
      P dp{fp::replicas(f.replicas, per), fp::seed(f.seed),
           {.accumulate = f.accumulate, .bucket_bytes = bucket_bytes(f), .host_precision = precision}};
      body(dp, per * f.replicas);
    });
  } else {
    fp::Model<Net, fp::Host> model{fp::seed(f.seed), fp::Host{threads, precision}};
    body(model, threads);
  }
#endif
}

/// The peak FLOP/s of every processor the run uses, all ranks together: --peak-gflops, or each process's
/// own (its CPU threads' rate measured now, of the instruction its precision computes with: fp32 FMA,
/// VDPBF16PS or AMX tiles; or its GPUs' dense rate at their precision) added up over the ranks. 0 when
/// unknown.
template <class Trainer>
double run_peak_flops(Trainer& trainer, const TrainFlags& f) {
  if (f.peak_gflops > 0) return f.peak_gflops * 1e9;
  double mine = 0;
  int threads = 0;
  fp::HostPeak instruction = fp::HostPeak::fma32;
  for_each_model(trainer, [&](auto& m) {
    if constexpr (on_gpu<Trainer>) {
#if FUSEDP_HAS_CUDA
      mine += fp::cuda_peak_flops(m.space());
#endif
    } else {
      threads += m.space().cpu_threads();
      instruction = fp::host_peak_instruction(m.space());
    }
  });
  if (threads > 0) mine = fp::measure_host_peak_flops(threads, 0.05, instruction);
  // A sum of doubles over the ranks, through the evaluation sums' collective.
  if constexpr (requires { trainer.sum_over_ranks(fp::GlobalEvaluation{}); })
    return trainer.sum_over_ranks(fp::GlobalEvaluation{mine, 0, 0}).loss_sum;
  return mine;
}

/// `n` with a comma between groups of three digits: 19,200.
inline std::string thousands(std::uint64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

/// Achieved model FLOP/s and their share of the peak, for the epoch lines.
inline std::string utilization(double flops, double seconds, double peak) {
  char text[96];
  const double rate = seconds > 0 ? flops / seconds : 0.0;
  if (peak > 0) std::snprintf(text, sizeof text, "  %.1f GFLOP/s (%.1f%% of peak)", rate / 1e9, 100 * rate / peak);
  else std::snprintf(text, sizeof text, "  %.1f GFLOP/s", rate / 1e9);
  return text;
}

/// The parameter tensor whose gradient first holds a NaN or an infinity ("'3.weight' (layer 4)").
template <class M>
std::string nonfinite_where(const M& model) {
  if constexpr (std::is_same_v<typename M::space_type, fp::Host>) {
    return model.first_nonfinite_tensor();
  } else {
    std::vector<float> g(model.grads().size());
    model.copy_grads_to_host(g);
    for (std::size_t i = 0; i < g.size(); ++i)
      if (!std::isfinite(g[i])) return M::nonfinite_tensor_name(i);
    return "no tensor";
  }
}

/// Mean loss over a dataset, and the accuracy for classification.
struct Evaluation {
  double loss = 0;
  std::optional<double> accuracy;
};

/// Evaluates the trainer's model on every sample this rank's loader yields (an evaluation-mode sampler
/// visits each once), then adds up the sums of all ranks.
template <class Trainer, class Loss>
Evaluation evaluate(Trainer& trainer, fd::DataLoader& loader, const Loss& loss) {
  auto& model = model_of(trainer);
  const fp::trace::Scope span("evaluate", fp::trace::Kind::evaluate);
  fp::GlobalEvaluation sums;
  const bool classification = !loader.dataset().regression();
  loader.set_epoch(0);
  while (auto b = loader.next()) {
    const std::size_t n = b->size();
    if constexpr (std::is_same_v<typename Loss::template target<float>, std::int32_t>) {
      const auto r = model.evaluate(b->images, b->labels, loss);
      sums.loss_sum += double(r.loss) * double(n);
      sums.correct += fp::count_correct(r.outputs, b->labels);
    } else {
      sums.loss_sum += double(model.evaluate(b->images, b->targets, loss).loss) * double(n);
    }
    sums.count += n;
  }
  if constexpr (requires { trainer.sum_over_ranks(sums); }) sums = trainer.sum_over_ranks(sums);
  Evaluation e;
  e.loss = sums.loss();
  if (classification) e.accuracy = sums.accuracy();
  return e;
}

template <class Trainer, class Opt, class Loss, class TrainLoader>
void fit_with(Trainer& trainer, Opt& opt, const Loss& loss, TrainLoader& train, fd::DataLoader& test,
              const TrainFlags& f, const std::optional<ft::TrainingState>& resumed, const Launch& launch);

/// Trains for epochs 1..flags.epochs (or from the checkpoint of --resume on), evaluating on `test`
/// after each epoch, printing a progress line and a summary per epoch, writing --metrics and saving
/// --checkpoint (rank 0 only). The loaders' sampler and augmentation seeds must be flags.seed, and
/// their samplers this rank's share (Launch::train_sampler, eval_sampler). On a GPU the training
/// batches go through a DeviceLoader made from `train`'s dataset, sampler and options.
template <class Trainer, class Opt, class Loss>
void fit(Trainer& trainer, Opt& opt, const Loss& loss, fd::DataLoader& train, fd::DataLoader& test, const TrainFlags& f,
         const std::optional<ft::TrainingState>& resumed, const Launch& launch) {
#if FUSEDP_HAS_CUDA
  // A Parallel splits each host batch among its GPUs; one model takes whole batches from the device.
  if constexpr (on_gpu<Trainer> && std::is_same_v<Trainer, std::remove_reference_t<decltype(model_of(trainer))>>) {
    // The same batches, prepared into pinned memory and copied to the GPU while it computes.
    fd::DeviceLoader device_train{train.dataset(), train.sampler(), train.options(), model_of(trainer).space()};
    fit_with(trainer, opt, loss, device_train, test, f, resumed, launch);
    return;
  }
#endif
  fit_with(trainer, opt, loss, train, test, f, resumed, launch);
}

#if FUSEDP_HAS_CUDA
/// " (N MiB once it evaluates batches of E)" where evaluation runs at a larger batch than training: a
/// model that evaluates a batch grows its workspace and staging to it (backward's branch memory too,
/// once it has trained), so it then holds what training at that batch would.
inline std::string evaluation_memory(std::size_t train_batch, std::size_t eval_batch, std::size_t need) {
  if (eval_batch <= train_batch) return "";
  return " (" + std::to_string((need + (1u << 19)) >> 20) + " MiB once it evaluates batches of " +
         std::to_string(eval_batch) + ")";
}

/// One line on a GPU run's memory: what the model (with its optimizer's state) and the DeviceLoader hold
/// at this batch, from their types (CudaMemory), and the largest batch that would fit in what they hold
/// and what is free, less a tenth for the CUDA context and cudaMalloc's rounding.
template <class Net, class P>
void print_device_memory(const fp::Model<Net, fp::CudaSpace<P>>& m, const fd::DeviceLoader& loader, std::size_t batch,
                         std::size_t eval_batch, fp::CudaMemoryOptions o) {
  using Memory = fp::CudaMemory<Net, P>;
  o.device_loader = true;
  o.targets = loader.dataset().target_size;
  const int sm = m.space().sm_count();
  const std::size_t need = Memory::use(batch, sm, o).total();
  fp::CudaMemoryOptions eval = o;
  eval.device_loader = false;  // the loader's slots stay at the training batch
  const std::size_t eval_need = Memory::use(eval_batch, sm, eval).total() + Memory::use(batch, sm, o).loader;
  const fp::DeviceMemory device = m.space().memory();
  const std::size_t held = m.memory_use().total() + loader.device_bytes();
  const std::size_t largest = Memory::largest_batch((held + device.free) / 10 * 9, sm, o);
  std::printf("GPU memory: %.0f MiB for batches of %zu (model, optimizer state, loader)%s; %.0f of %.0f MiB free; "
              "batches up to %zu would fit\n",
              double(need) / (1 << 20), batch, evaluation_memory(batch, eval_batch, eval_need).c_str(),
              double(device.free) / (1 << 20), double(device.total) / (1 << 20), largest);
}

/// The same for a Parallel on GPUs: what replica 0 holds at this process's step batch (its shard of it,
/// in micro-batches of at most `--batch`: ReplicaMemory), and the largest step batch whose shards would
/// fit its device. Replica 0 also evaluates this process's test batches.
template <class Net, class P, class... Ps>
void print_device_memory(const fp::Parallel<Net, fp::CudaSpace<P>, Ps...>& dp, std::size_t batch,
                         std::size_t eval_batch, const fp::CudaMemoryOptions& o, const fp::ParallelOptions& po) {
  using Memory = fp::ReplicaMemory<Net, P, Ps...>;
  const std::size_t local = dp.local_replicas();
  const std::size_t shard = (batch + local - 1) / local;
  const int sm = dp.model(0).space().sm_count();
  const std::size_t world = dp.world_size();
  const std::size_t need = Memory::use(shard, sm, world, o, po).total();
  // Evaluating a batch of E grows replica 0's model as a shard of E x accumulate (micro-batches of E) would.
  const std::size_t micro = Memory::micro_batch(shard, std::size_t(po.accumulate), world);
  const std::size_t eval_need = Memory::use(eval_batch * std::size_t(po.accumulate), sm, world, o, po).total();
  const fp::DeviceMemory device = dp.model(0).space().memory();
  const std::size_t largest = Memory::largest_shard((dp.memory_use(0).total() + device.free) / 10 * 9, sm, world, o, po);
  std::printf("GPU memory of replica 0: %.0f MiB for shards of %zu (model, optimizer state, reduction)%s; %.0f of "
              "%.0f MiB free; step batches up to %zu would fit\n",
              double(need) / (1 << 20), shard, evaluation_memory(micro, eval_batch, eval_need).c_str(),
              double(device.free) / (1 << 20), double(device.total) / (1 << 20), largest * local);
}
#endif

/// fit's loop over a host DataLoader or a DeviceLoader.
template <class Trainer, class Opt, class Loss, class TrainLoader>
void fit_with(Trainer& trainer, Opt& opt, const Loss& loss, TrainLoader& train, fd::DataLoader& test,
              const TrainFlags& f, const std::optional<ft::TrainingState>& resumed, const Launch& launch) {
  const bool root = launch.root();
  const std::size_t dataset_size = train.dataset().count;
  std::uint64_t first_epoch = 1;
  fd::EpochPosition first_position;  // where the first epoch starts: the rest of a resumed one
  std::uint64_t first_steps = 0;     // steps of that epoch trained before the resume
  double resumed_loss_sum = 0;
  std::size_t resumed_seen = 0;
  if (resumed) {
    const ft::TrainingState& s = *resumed;
    with_flag("--resume", [&] {
      // Checks the network, optimizer and files before changing anything; every rank reads the same
      // folder (it must be visible to all of them).
      (void)ft::load_checkpoint(f.resume, trainer, opt);
      if (s.dataset_size != dataset_size)
        throw fp::DataError(f.resume, "was trained on " + std::to_string(s.dataset_size) +
                                          " samples; this run has " + std::to_string(dataset_size) +
                                          " (another dataset?)");
    });
    if (root && s.batch_size != std::uint64_t(step_batch(f)))
      std::printf("note: the checkpoint was trained with %llu samples per step; continuing with %zu\n",
                  static_cast<unsigned long long>(s.batch_size), step_batch(f));
    // The position is in samples of the epoch's global order, so the rest of the epoch can be shared
    // among any number of processes: each remaining sample is visited once (data/sampler.hpp).
    if (root && s.world_size != std::uint64_t(launch.world()))
      std::printf("resumed at %d process(es) from a %llu-process checkpoint: epoch %llu, sample %s of %s\n",
                  launch.world(), static_cast<unsigned long long>(s.world_size),
                  static_cast<unsigned long long>(s.epochs_done + 1), thousands(s.samples_done).c_str(),
                  thousands(dataset_size).c_str());
    first_epoch = s.epochs_done + 1;
    first_position = {std::size_t(s.samples_done)};
    first_steps = s.batches_done;
    if (first_position.samples > 0) {  // the epoch's loss so far, to report the whole epoch's
      // Sums over all ranks' samples ("epoch_global_..."), or over one rank's in a checkpoint written
      // before resuming at another world size was possible (every rank trained as many).
      const bool global = s.extra.count("epoch_global_loss_sum") != 0;
      const auto sum = s.extra.find(global ? "epoch_global_loss_sum" : "epoch_loss_sum");
      const auto count = s.extra.find(global ? "epoch_global_samples" : "epoch_samples");
      if (sum != s.extra.end() && count != s.extra.end()) {
        const double scale = global ? 1.0 : double(s.world_size);
        resumed_loss_sum = std::strtod(sum->second.c_str(), nullptr) * scale;
        resumed_seen = std::size_t(std::strtoull(count->second.c_str(), nullptr, 10)) * std::size_t(scale);
      }
    }
    if (root)
      std::printf("resumed from %s: %llu epochs and %llu steps done%s\n", f.resume.c_str(),
                  static_cast<unsigned long long>(s.epochs_done), static_cast<unsigned long long>(s.steps),
                  first_position.samples > 0
                      ? (" (epoch " + std::to_string(first_epoch) + " goes on at sample " +
                         thousands(first_position.samples) + " of " + thousands(dataset_size) + ")").c_str()
                      : "");
    if (first_epoch > std::uint64_t(f.epochs)) {
      if (root)
        std::printf("nothing to do: the checkpoint holds %llu epochs and --epochs is %d\n",
                  static_cast<unsigned long long>(s.epochs_done), f.epochs);
      return;
    }
  }
  if (root && !f.checkpoint.empty()) check_checkpoint_folder(f.checkpoint);
  TraceFile trace{f.trace, launch.rank(), launch.world()};
  ft::MetricsWriter metrics;
  if (root && !f.metrics.empty())
    metrics = with_flag("--metrics", [&] {
      return resumed ? ft::MetricsWriter::resume(f.metrics, first_epoch - 1) : ft::MetricsWriter{f.metrics};
    });

  ft::ProgressLine progress{stdout, train.dataset().regression() ? "samples" : "images"};
  if constexpr (requires { trainer.reserve(std::size_t(1)); }) trainer.reserve(std::size_t(f.batch));
#if FUSEDP_HAS_CUDA
  {
    // Training runs through Guarded (below): its gradient statistics are on the device.
    const fp::CudaMemoryOptions memory{.state_slots = Opt::state_slots, .guarded = true};
    const std::size_t batch = std::min<std::size_t>(step_batch(f), dataset_size);
    const std::size_t eval_batch = std::min(test.options().batch, test.sampler().size());
    if constexpr (std::is_same_v<TrainLoader, fd::DeviceLoader>) {
      if (root) print_device_memory(model_of(trainer), train, batch, eval_batch, memory);
    } else if constexpr (on_gpu<Trainer> && requires { trainer.memory_use(std::size_t(0)); }) {
      if (root)
        print_device_memory(trainer, batch, eval_batch, memory,
                            {.accumulate = f.accumulate, .bucket_bytes = bucket_bytes(f)});
    }
  }
#endif
  if constexpr (requires { trainer.agree_steps(std::size_t(1)); }) {
    // The samplers pad every rank to the same count; a mismatch would leave a rank waiting forever.
    const std::size_t steps = train.batches();
    if (trainer.agree_steps(steps) != steps)
      throw fp::InvalidArgument("ranks disagree on the number of steps per epoch (" + std::to_string(steps) +
                                " here); start every rank with the same data and flags");
  }
  const double world = double(launch.world());
  using Net = typename std::remove_reference_t<decltype(model_of(trainer))>::network;
  // The learning rate of step s (counted over the whole run, so a resumed run continues the curve).
  const std::uint64_t total_steps = std::uint64_t(f.epochs) * train.batches();
  const std::uint64_t steps_per_epoch = train.batches();
  // A warm-up as long as the run leaves the rate rising to its last step, never at --lr, never decayed:
  // on a short run (2 epochs of 1024 synthetic images, 32 steps, against the ResNet example's 100) that
  // can look like instability (PyTorch's SGD on that recipe spikes alike). Said once, not refused.
  if (root && f.warmup > 0 && total_steps <= std::uint64_t(f.warmup))
    std::printf("note: the warm-up (--warmup %d steps) covers the whole run (%llu steps): the learning rate rises "
                "to %g (--lr %g) by the last step and the %s schedule never starts; a shorter --warmup gives it\n",
                f.warmup, static_cast<unsigned long long>(total_steps),
                double(f.lr) * double(total_steps) / double(f.warmup), double(f.lr), f.schedule.c_str());
  const auto lr_at = [&f, total_steps, steps_per_epoch](std::uint64_t step) -> float {
    if (f.schedule == "cosine")
      return fp::CosineWarmup{f.lr, std::uint64_t(f.warmup), std::max(total_steps, std::uint64_t(f.warmup) + 1)}(step);
    if (f.schedule == "step" && step >= std::uint64_t(f.warmup))
      return fp::StepLR{f.lr, std::max<std::uint64_t>(1, std::uint64_t(f.step_epochs) * steps_per_epoch), f.gamma}(step);
    if (step < std::uint64_t(f.warmup)) return f.lr * float(step + 1) / float(f.warmup);
    return f.lr;
  };
  const double peak = run_peak_flops(trainer, f);
  double total_seconds = 0, total_samples = 0;
  Evaluation result;
  // Every step is guarded: a NaN or infinite gradient is caught before it reaches the parameters
  // (--on-nonfinite says whether the run then stops or goes on), and --clip-grad-norm clips.
  fp::Guarded<Opt, fp::nonfinite::Skip> guarded{opt, {.max_norm = f.clip_grad_norm}};
  const bool stop_on_nonfinite = f.on_nonfinite == "stop";
  const StopSignals signals;
  // A checkpoint of the run after `epochs_done` epochs and `batches_done` steps of the next, which
  // reached `at` in its order, with that epoch's loss so far (a collective for a Parallel: every rank
  // calls it; rank 0 writes).
  // The last checkpoint this run saved in --checkpoint (empty before the first).
  std::string saved_in_folder;
  const auto save = [&](std::uint64_t epochs_done, std::uint64_t batches_done, fd::EpochPosition at,
                        double loss_sum, std::size_t seen) {
    ft::TrainingState s;
    s.epochs_done = epochs_done;
    s.batches_done = batches_done;
    s.samples_done = at.samples;
    s.data_seed = f.seed;
    s.dataset_size = dataset_size;
    s.batch_size = std::uint64_t(step_batch(f));
    s.world_size = std::uint64_t(launch.world());
    if (at.samples > 0) {
      char hex[64];
      std::snprintf(hex, sizeof hex, "%a", loss_sum);  // exact, so a resumed epoch reports the same loss
      s.extra["epoch_global_loss_sum"] = hex;
      s.extra["epoch_global_samples"] = std::to_string(seen);
    }
    try {
      ft::save_checkpoint(f.checkpoint, trainer, s);
    } catch (const fp::Error& e) {
      // A failed save leaves the folder's previous checkpoint as it was (train/durable_file.hpp):
      // say which one that is, so a full disk loses nothing but the epochs since.
      throw fp::DataError("--checkpoint", f.checkpoint + ": cannot save the checkpoint " + checkpoint_point(s) +
                                              ": " + e.what() + "; the folder still holds " +
                                              (saved_in_folder.empty() ? "what it held before this run"
                                                                       : "the checkpoint " + saved_in_folder) +
                                              ", which --resume " + f.checkpoint + " continues from");
    }
    saved_in_folder = checkpoint_point(s);
  };
  for (std::uint64_t epoch = first_epoch; epoch <= std::uint64_t(f.epochs); ++epoch) {
    const bool resuming = epoch == first_epoch && first_position.samples > 0;
    train.set_epoch(epoch, resuming ? first_position : fd::EpochPosition{});
    const std::uint64_t steps_before = resuming ? first_steps : 0;  // of this epoch, before the resume
    progress.start_epoch(std::size_t(epoch), std::size_t(f.epochs), train.batches());
    const auto start = std::chrono::steady_clock::now();
    // The loss over the epoch's steps (those before a resume included) weighted by the samples of
    // each step on all ranks, and the samples this run trained on this rank.
    double loss_sum = resuming ? resumed_loss_sum : 0.0;
    std::size_t loss_seen = resuming ? resumed_seen : 0;
    std::size_t seen = 0;
    std::uint64_t skipped = 0;
    while (auto b = train.next()) {
      const std::size_t n = b->size();
      auto& model = model_of(trainer);
      guarded.optimizer.options.lr = lr_at(model.steps());
      const std::uint64_t skipped_before = model.skipped_steps();
      float l = 0;
      if constexpr (std::is_same_v<typename Loss::template target<float>, std::int32_t>)
        l = trainer.train_step(b->images, b->labels, loss, guarded);
      else
        l = trainer.train_step(b->images, b->targets, loss, guarded);
      const bool was_skipped = model.skipped_steps() != skipped_before;
      if ((was_skipped || !std::isfinite(l)) && stop_on_nonfinite)
        throw fp::NumericError("step " + std::to_string(model.steps()) + " (epoch " + std::to_string(epoch) +
                               ", batch " + std::to_string(steps_before + b->index + 1) + "): " +
                               (was_skipped ? "the gradient is not finite (NaN or infinity), first in " +
                                                  nonfinite_where(model) + "; the parameters are those before it"
                                            : std::string("the loss is not finite")) +
                               " (--on-nonfinite skip goes on past such steps; a lower --lr or --clip-grad-norm "
                               "may avoid them)");
      if (was_skipped || !std::isfinite(l)) {
        skipped += was_skipped ? 1 : 0;
      } else {
        loss_sum += double(l) * double(n) * world;  // every rank trained n samples (the samplers pad)
        loss_seen += n * std::size_t(world);
      }
      seen += n;
      if (root) progress.update(b->index + 1, loss_seen > 0 ? loss_sum / double(loss_seen) : 0.0,
                                std::size_t(double(seen) * world));
      // Preemption: every rank stops after the same step once any rank got the signal.
      bool stop = signals.received() != 0;
      if constexpr (requires { trainer.all_ranks(true); }) stop = !trainer.all_ranks(!stop);
      if (stop) {
        const fd::EpochPosition at = train.position();
        if (!f.checkpoint.empty()) save(epoch - 1, steps_before + b->index + 1, at, loss_sum, loss_seen);
        if (root) {
          progress.finish("");
          std::printf("stopped by %s after step %llu (epoch %llu, sample %s of %s)%s\n",
                      signals.received() == SIGUSR1 ? "SIGUSR1" : signals.received() == SIGTERM ? "SIGTERM"
                                                                                                : "a signal to a rank",
                      static_cast<unsigned long long>(model.steps()), static_cast<unsigned long long>(epoch),
                      thousands(at.samples).c_str(), thousands(dataset_size).c_str(),
                      f.checkpoint.empty() ? "; nothing saved (no --checkpoint)"
                                           : ("; saved to " + f.checkpoint + ", continue with --resume " + f.checkpoint)
                                                 .c_str());
          std::fflush(stdout);
        }
        throw Preempted{signals.received()};
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_seconds += seconds;
    const double train_loss = loss_seen > 0 ? loss_sum / double(loss_seen) : 0.0;  // each step's loss is global
    seen = std::size_t(double(seen) * world);  // every rank trained on as many samples
    total_samples += double(seen);
    result = evaluate(trainer, test, loss);
    if (!std::isfinite(result.loss))  // the metrics never hold a NaN
      throw fp::NumericError("epoch " + std::to_string(epoch) + ": the test loss is not finite: the model has " +
                             "diverged (train loss " + std::to_string(train_loss) +
                             "); a lower --lr or --clip-grad-norm may avoid it");
    const double flops = fp::CostModel<Net>::train_flops * double(seen);  // model FLOPs of the epoch's steps
    const std::string used = utilization(flops, seconds, peak);
    const double rate = seconds > 0 ? double(seen) / seconds : 0.0;
    char skips[64] = "";
    if (skipped > 0)
      std::snprintf(skips, sizeof skips, "  %llu step(s) skipped (not finite)", static_cast<unsigned long long>(skipped));
    char line[384];
    if (result.accuracy)
      std::snprintf(line, sizeof line,
                    "epoch %llu/%d  train loss %.4f  test loss %.4f  test accuracy %.2f%%  %.0f images/s%s  %.1fs%s",
                    static_cast<unsigned long long>(epoch), f.epochs, train_loss, result.loss, 100 * *result.accuracy,
                    rate, used.c_str(), seconds, skips);
    else
      std::snprintf(line, sizeof line, "epoch %llu/%d  train loss %.6f  test loss %.6f  %.0f samples/s%s  %.1fs%s",
                    static_cast<unsigned long long>(epoch), f.epochs, train_loss, result.loss, rate, used.c_str(),
                    seconds, skips);
    if (root) progress.finish(line);
    if (result.accuracy)
      metrics.write({{"epoch", static_cast<long long>(epoch)},
                     {"train_loss", train_loss},
                     {"test_loss", result.loss},
                     {"test_accuracy", *result.accuracy},
                     {"images_per_s", rate},
                     {"train_gflops", flops / seconds / 1e9},
                     {"mfu", peak > 0 ? flops / seconds / peak : 0.0},
                     {"skipped_steps", static_cast<long long>(skipped)},
                     {"seconds", seconds}});
    else
      metrics.write({{"epoch", static_cast<long long>(epoch)},
                     {"train_loss", train_loss},
                     {"test_loss", result.loss},
                     {"samples_per_s", rate},
                     {"train_gflops", flops / seconds / 1e9},
                     {"mfu", peak > 0 ? flops / seconds / peak : 0.0},
                     {"skipped_steps", static_cast<long long>(skipped)},
                     {"seconds", seconds}});
    if (!f.checkpoint.empty()) save(epoch, 0, {}, 0.0, 0);
  }
  trace.write(true);
  if (root && total_seconds > 0) {
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
