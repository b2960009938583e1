// allreduce_bench: the all-reduce bandwidth that Parallel<Net, Cuda>'s compile-time bucket plans achieve,
// against one plain ncclAllReduce of the whole gradient buffer, for LeNet and the CIFAR-10 CNN of
// train_step_gpu.cu. World size = the visible GPUs, one process, one communicator per device
// (ncclCommInitAll), one thread queuing every device's calls inside an NCCL group, as one step of
// Parallel without Overlap does. Each repetition is bracketed by CUDA events on every device's stream;
// the time of a repetition is the slowest device's; the median over the repetitions is reported.
//
//   RESULT bench=allreduce net=lenet world=1 plan=bucket_1048576 buckets=1 bytes=228224 median_us=12.3 algbw_GBps=18.5 busbw_GBps=0.0
//
// Plans: `whole` (one in-place ncclAllReduce of the buffer), `bucket_<bytes>` (BucketPlan<Net, bytes>,
// in place, as Parallel reduces), and `whole_out_of_place` (into another buffer).
// algbw = bytes / time; busbw = algbw * 2 (world - 1) / world (NCCL's bus bandwidth, comparable
// across world sizes). With one GPU an all-reduce moves nothing between devices: in place it is the
// cost of queuing a no-op (the algbw figure is then meaningless), out of place a device copy; busbw
// is 0 (the program says so). Measured on one H200 (NCCL 2.28.9): in place 1.3 us (LeNet, 1 bucket) to
// 2.5 us (3-5 buckets): a bucket costs about 0.5 us of queuing.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 -Iinclude -Xcompiler=-pthread benchmarks/gpu/allreduce_bench.cu -lnccl
//        -o build/allreduce_bench      (one line)
//   LD_LIBRARY_PATH=<dir of libnccl.so.2>:$LD_LIBRARY_PATH build/allreduce_bench [--reps 50] [--warmup 10]
#include "../../tests/support/fusedp_core.hpp"
#include <fusedp/parallel/bucket_plan.hpp>
#include <fusedp/parallel/nccl.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>
#include "../../tests/support/seed_networks.hpp"

#if !FUSEDP_HAS_NCCL
#error "allreduce_bench needs <nccl.h> (NCCL) on the include path"
#endif

namespace fp = fusedp;

namespace {

using seed_networks::LeNet;
using seed_networks::CifarCnn;

struct Options {
  int reps = 50;
  int warmup = 10;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Device {
  int id = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  fp::DeviceBuffer<float> grads;
};

struct Span {
  std::size_t begin, end;
};

// Median time in microseconds of one out-of-place ncclAllReduce of every device's whole buffer into
// `out`: with one GPU, a real device-to-device copy (in place, NCCL has nothing to do).
double time_out_of_place(std::vector<Device>& devs, std::vector<fp::parallel::NcclCommunicator>& comms,
                         std::vector<fp::DeviceBuffer<float>>& out, const Options& o) {
  std::vector<double> us;
  for (int rep = 0; rep < o.warmup + o.reps; ++rep) {
    for (auto& d : devs) {
      FUSEDP_CUDA_CHECK(cudaSetDevice(d.id));
      FUSEDP_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    }
    {
      fp::parallel::NcclGroup group;
      for (std::size_t i = 0; i < devs.size(); ++i)
        fp::parallel::detail::nccl_check(ncclAllReduce(devs[i].grads.data(), out[i].data(), devs[i].grads.size(),
                                                       ncclFloat, ncclSum, comms[i].get(), devs[i].stream),
                                         "ncclAllReduce (out of place)", int(i), comms[i].get());
      group.end();
    }
    double slowest = 0;
    for (std::size_t i = 0; i < devs.size(); ++i) {
      FUSEDP_CUDA_CHECK(cudaSetDevice(devs[i].id));
      FUSEDP_CUDA_CHECK(cudaEventRecord(devs[i].stop, devs[i].stream));
      comms[i].wait(devs[i].stream, "allreduce_bench");
      float ms = 0;
      FUSEDP_CUDA_CHECK(cudaEventElapsedTime(&ms, devs[i].start, devs[i].stop));
      slowest = std::max(slowest, double(ms) * 1000.0);
    }
    if (rep >= o.warmup) us.push_back(slowest);
  }
  return median(us);
}

// Median time in microseconds of all-reducing `buckets` of every device's buffer, one group per repetition.
double time_buckets(std::vector<Device>& devs, std::vector<fp::parallel::NcclCommunicator>& comms,
                    const std::vector<Span>& buckets, const Options& o) {
  std::vector<double> us;
  for (int rep = 0; rep < o.warmup + o.reps; ++rep) {
    for (auto& d : devs) {
      FUSEDP_CUDA_CHECK(cudaSetDevice(d.id));
      FUSEDP_CUDA_CHECK(cudaEventRecord(d.start, d.stream));
    }
    {
      fp::parallel::NcclGroup group;
      for (const Span& b : buckets)
        for (std::size_t i = 0; i < devs.size(); ++i)
          comms[i].all_reduce_sum(devs[i].grads.data() + b.begin, b.end - b.begin, devs[i].stream);
      group.end();
    }
    double slowest = 0;
    for (std::size_t i = 0; i < devs.size(); ++i) {
      FUSEDP_CUDA_CHECK(cudaSetDevice(devs[i].id));
      FUSEDP_CUDA_CHECK(cudaEventRecord(devs[i].stop, devs[i].stream));
      comms[i].wait(devs[i].stream, "allreduce_bench");
      float ms = 0;
      FUSEDP_CUDA_CHECK(cudaEventElapsedTime(&ms, devs[i].start, devs[i].stop));
      slowest = std::max(slowest, double(ms) * 1000.0);
    }
    if (rep >= o.warmup) us.push_back(slowest);
  }
  return median(us);
}

template <class Net, std::size_t Bytes>
std::vector<Span> plan_of() {
  using Plan = fp::parallel::BucketPlan<Net, Bytes, sizeof(float)>;
  std::vector<Span> v;
  for (const auto& b : Plan::buckets) v.push_back({b.begin, b.end});
  return v;
}

template <class Net>
void bench(const char* name, const std::vector<int>& ids, const Options& o) {
  std::vector<fp::parallel::NcclCommunicator> comms = fp::parallel::NcclCommunicator::init_all(ids, std::chrono::seconds(120));
  std::vector<Device> devs;
  for (int id : ids) {
    FUSEDP_CUDA_CHECK(cudaSetDevice(id));
    Device d;
    d.id = id;
    FUSEDP_CUDA_CHECK(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
    FUSEDP_CUDA_CHECK(cudaEventCreate(&d.start));
    FUSEDP_CUDA_CHECK(cudaEventCreate(&d.stop));
    d.grads = fp::DeviceBuffer<float>(Net::param_storage);
    devs.push_back(std::move(d));
  }
  const std::size_t bytes = Net::param_storage * sizeof(float);
  const int world = int(ids.size());
  auto report = [&](const std::string& plan, const std::vector<Span>& buckets, double us) {
    const double algbw = double(bytes) / (us * 1e-6) / 1e9;
    const double busbw = algbw * 2.0 * double(world - 1) / double(world);
    std::printf("RESULT bench=allreduce net=%s world=%d plan=%s buckets=%zu bytes=%zu median_us=%.2f algbw_GBps=%.2f "
                "busbw_GBps=%.2f\n",
                name, world, plan.c_str(), buckets.size(), bytes, us, algbw, busbw);
    std::fflush(stdout);
  };
  auto in_place = [&](const std::string& plan, const std::vector<Span>& buckets) {
    report(plan, buckets, time_buckets(devs, comms, buckets, o));
  };
  in_place("whole", {{0, Net::param_storage}});
  in_place("bucket_65536", plan_of<Net, 64 << 10>());
  in_place("bucket_1048576", plan_of<Net, 1 << 20>());
  in_place("bucket_4194304", plan_of<Net, 4 << 20>());
  in_place("bucket_26214400", plan_of<Net, 25 << 20>());  // PyTorch DDP's default bucket_cap_mb
  {
    std::vector<fp::DeviceBuffer<float>> out;
    for (const auto& d : devs) {
      FUSEDP_CUDA_CHECK(cudaSetDevice(d.id));
      out.emplace_back(Net::param_storage);
    }
    report("whole_out_of_place", {{0, Net::param_storage}}, time_out_of_place(devs, comms, out, o));
  }
  for (auto& d : devs) {
    FUSEDP_CUDA_CHECK(cudaSetDevice(d.id));
    cudaEventDestroy(d.start);
    cudaEventDestroy(d.stop);
    cudaStreamDestroy(d.stream);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) o.reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) o.warmup = std::max(0, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: allreduce_bench [--reps N] [--warmup N]\n");
      return 2;
    }
  }
  try {
    const int n = fp::cuda_device_count();
    if (n == 0) {
      std::printf("SKIP allreduce_bench: %s\n", fp::cuda_unavailable_reason().c_str());
      return 0;
    }
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess) version = 0;
    std::printf("allreduce_bench: %d GPU(s), NCCL %d (headers %d.%d.%d)\n", n, version, NCCL_MAJOR, NCCL_MINOR,
                NCCL_PATCH);
    if (n == 1)
      std::printf("NOTE allreduce_bench: world size 1: nothing crosses an interconnect; the figures are the cost of "
                  "queuing NCCL's single-rank all-reduce (in place: nothing to do; out of place: a device copy), busbw is 0 by "
                  "definition\n");
    std::vector<int> ids;
    for (int i = 0; i < n; ++i) ids.push_back(i);
    bench<LeNet>("lenet", ids, o);
    bench<CifarCnn>("cifar_cnn", ids, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
