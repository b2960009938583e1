#pragma once
// A fully fused MLP stage (in the spirit of tiny-cuda-nn): a run of Linear + activation layers, every
// width at most 128, runs as one kernel forward and one backward. A block owns 128 rows of the batch;
// their activations stay in shared memory from the first layer to the last, each layer's weights are
// staged into shared memory in turn, and each warp multiplies its 16 rows on TF32 tensor cores.
// Forward writes each layer's output once (backward and the next stage need it); backward carries the
// gradient through the layers on chip, writing each layer's dz once for the weight-gradient GEMMs that
// follow (split-K GEMMs over the batch, bias gradient fused, kernels/cuda/gemm.cuh), and hands the run's
// input gradient to a sink (kernels/cuda/gradient_sink.cuh): stored, or the group below's dz.
//
// Widths are padded to multiples of 16 with zero weights, so any width up to 128 works. TF32 only:
// the plan (net/cuda_plan.hpp) forms MLP groups only for precision::Tf32; where a device cannot run
// the kernels (before sm_80, too little shared memory: mlp_supported) or set_fused_mlp(false) says so,
// the model runs the group's layers one by one.
// Verified on an H200 (tests/gpu/mlp.cu; benchmarks/RESULTS.md: 2.9-9.5x PyTorch at 16K rows, but
// 0.41x eager for width 128 at 2^18 rows, where the weights' staging binds); the block shape was
// chosen to fit shared memory, not swept.
#include "fusedp/core/config.hpp"

#if FUSEDP_HAS_CUDA
#include "fusedp/core/error.hpp"
#include "fusedp/exec/cuda.hpp"
#include "fusedp/kernels/cuda/gemm.cuh"
#include "fusedp/kernels/cuda/gradient_sink.cuh"
#include "fusedp/kernels/cuda/linear.cuh"

#include <mma.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <tuple>

namespace fusedp::kernels::cuda {

/// One layer of a fused MLP: In -> Out features, then the epilogue Epi (which must read only its
/// output in backward: !Epi::saves_input).
template <int In, int Out, class Epi>
struct MlpLayer {
  static_assert(In > 0 && Out > 0 && In <= 128 && Out <= 128, "MlpLayer: widths must be in [1, 128]");
  static_assert(!Epi::saves_input, "MlpLayer: the epilogue's derivative must need only its output");
  static constexpr int in = In, out = Out;
  static constexpr int in_pad = (In + 15) / 16 * 16, out_pad = (Out + 15) / 16 * 16;
  using epilogue = Epi;
};

/// A run of MlpLayers and the shape of the fused kernels that execute it.
template <class... Layers>
struct MlpSpec {
  static_assert(sizeof...(Layers) >= 1, "MlpSpec: at least one layer");
  static constexpr int count = sizeof...(Layers);
  template <int L>
  using layer = std::tuple_element_t<L, std::tuple<Layers...>>;
  static constexpr int in = layer<0>::in;
  static constexpr int out = layer<count - 1>::out;
  static constexpr int width = std::max({Layers::in_pad..., Layers::out_pad...});
  static constexpr int warps = 8;
  static constexpr int rows = 16 * warps;  // batch rows per block
  static constexpr int threads = 32 * warps;
  static constexpr int lda = width + 4;    // activations, floats per row
  static constexpr int ldw = width + 4;    // staged weights
  static constexpr std::size_t smem_floats = std::size_t(rows) * lda + std::size_t(width) * ldw + width;
  static constexpr std::size_t smem_bytes = smem_floats * sizeof(float);
};

/// Device pointers of one fused MLP call.
template <int N>
struct MlpArgs {
  int batch;
  const float* x;      // (batch, in) the run's input
  const float* w[N];   // (out_l, in_l) as PyTorch
  const float* b[N];   // (out_l)
  float* y[N];         // (batch, out_l) each layer's output
  const float* dy;     // (batch, out) gradient of the run's output (backward)
  float* dz[N];        // (batch, out_l) gradient before each epilogue (backward writes them)
  float* dx;           // (batch, in) gradient of the run's input, or null (mlp_backward; mlp_backward_to
                       // hands it to its sink instead)
};

namespace detail {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FUSEDP_MLP_TENSOR_CORES 1
#else
#define FUSEDP_MLP_TENSOR_CORES 0
#endif

__device__ FUSEDP_ALWAYS_INLINE float mlp_tf32(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return nvcuda::wmma::__float_to_tf32(v);
#else
  return v;
#endif
}

// Stages W (out x in, padded to out_pad x in_pad with zeros, rounded to TF32) and b into shared memory.
template <class Spec, class Layer>
__device__ void mlp_stage_weights(float* ws, float* bs, const float* w, const float* b) {
  constexpr int I = Layer::in, O = Layer::out, IP = Layer::in_pad, OP = Layer::out_pad;
  for (int idx = int(threadIdx.x); idx < OP * IP; idx += Spec::threads) {
    const int o = idx / IP, i = idx % IP;
    ws[o * Spec::ldw + i] = (o < O && i < I) ? mlp_tf32(w[o * I + i]) : 0.0f;
  }
  if (b != nullptr)
    for (int o = int(threadIdx.x); o < OP; o += Spec::threads) bs[o] = o < O ? b[o] : 0.0f;
}

// Loads `cols` columns of `rows` (batch, cols) rows into the block's activation tile, zero-padded to
// `pad` columns and past the batch.
template <class Spec>
__device__ void mlp_load_rows(float* act, const float* src, int row0, int batch, int cols, int pad) {
  for (int idx = int(threadIdx.x); idx < Spec::rows * pad; idx += Spec::threads) {
    const int r = idx / pad, c = idx % pad;
    const int row = row0 + r;
    act[r * Spec::lda + c] = (c < cols && row < batch) ? src[std::size_t(row) * cols + c] : 0.0f;
  }
}

#if FUSEDP_MLP_TENSOR_CORES
// One warp: out (16 x NP) = a (16 x KP, tile rows, lda) times the staged weights, as W^T (BRowMajor:
// false, weights (n, k) at ws[n * ldw + k]) or as W (true, weights (k, n) at ws[k * ldw + n]).
// The product overwrites the warp's rows of the tile.
template <class Spec, int KP, int NP, bool BRowMajor>
__device__ void mlp_warp_gemm(float* arow, const float* ws) {
  using namespace nvcuda;
  using BLayout = std::conditional_t<BRowMajor, wmma::row_major, wmma::col_major>;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[NP / 16];
#pragma unroll
  for (int n = 0; n < NP / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
  for (int k = 0; k < KP; k += 8) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
    wmma::load_matrix_sync(a, arow + k, Spec::lda);
#pragma unroll
    for (int t = 0; t < a.num_elements; ++t) a.x[t] = wmma::__float_to_tf32(a.x[t]);
#pragma unroll
    for (int n = 0; n < NP / 16; ++n) {
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, BLayout> b;
      const float* bp = BRowMajor ? ws + k * Spec::ldw + 16 * n : ws + 16 * n * Spec::ldw + k;
      wmma::load_matrix_sync(b, bp, Spec::ldw);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
  __syncwarp();  // every lane has read its rows before any lane overwrites them
#pragma unroll
  for (int n = 0; n < NP / 16; ++n) wmma::store_matrix_sync(arow + 16 * n, acc[n], Spec::lda, wmma::mem_row_major);
  __syncwarp();
}
#endif

template <class Spec, int L>
__device__ void mlp_forward_layer(const MlpArgs<Spec::count>& args, float* act, float* ws, float* bs, int row0) {
  using Layer = typename Spec::template layer<L>;
  using Epi = typename Layer::epilogue;
  constexpr int O = Layer::out, OP = Layer::out_pad;
  __syncthreads();  // the previous layer is done with the staged weights and the tile
  mlp_stage_weights<Spec, Layer>(ws, bs, args.w[L], args.b[L]);
  __syncthreads();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float* arow = act + warp * 16 * Spec::lda;
#if FUSEDP_MLP_TENSOR_CORES
  mlp_warp_gemm<Spec, Layer::in_pad, OP, false>(arow, ws);
#endif
  float* y = args.y[L];
  for (int e = lane; e < 16 * OP; e += 32) {
    const int r = e / OP, c = e % OP;
    const int row = row0 + warp * 16 + r;
    float v = 0.0f;  // padding columns stay zero: the next layer multiplies them by zero weights
    if (c < O) {
      v = Epi::apply(arow[r * Spec::lda + c] + bs[c]);
      if (row < args.batch) y[std::size_t(row) * O + c] = v;
    }
    arow[r * Spec::lda + c] = v;
  }
  __syncwarp();
  if constexpr (L + 1 < Spec::count) mlp_forward_layer<Spec, L + 1>(args, act, ws, bs, row0);
}

// Sink: where the run's input gradient goes (StoreSink{args.dx}, or the dz of the group below:
// kernels/cuda/gradient_sink.cuh), element (row, c) at flat index row * in + c.
template <class Spec, int L, class Sink>
__device__ void mlp_backward_layer(const MlpArgs<Spec::count>& args, float* act, float* ws, int row0,
                                   const Sink& sink) {
  using Layer = typename Spec::template layer<L>;
  using Epi = typename Layer::epilogue;
  constexpr int I = Layer::in, O = Layer::out, OP = Layer::out_pad;
  __syncthreads();
  mlp_stage_weights<Spec, Layer>(ws, nullptr, args.w[L], nullptr);
  __syncthreads();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float* arow = act + warp * 16 * Spec::lda;
  // The tile holds dy of this layer's output: make it dz = dy * Epi'(y) and keep a copy for dW.
  const float* y = args.y[L];
  float* dz = args.dz[L];
  for (int e = lane; e < 16 * OP; e += 32) {
    const int r = e / OP, c = e % OP;
    const int row = row0 + warp * 16 + r;
    float d = 0.0f;
    if (c < O && row < args.batch) {
      const std::size_t i = std::size_t(row) * O + c;
      d = arow[r * Spec::lda + c];
      if constexpr (!Epi::empty) d *= Epi::derivative(y[i], y[i]);
      dz[i] = d;
    }
    arow[r * Spec::lda + c] = d;
  }
  __syncwarp();
  if (L == 0 && !sink.active()) return;
#if FUSEDP_MLP_TENSOR_CORES
  // dy of the layer's input (16 x in_pad) = dz (16 x out_pad) W (out_pad x in_pad)
  mlp_warp_gemm<Spec, OP, Layer::in_pad, true>(arow, ws);
#endif
  if constexpr (L == 0) {
    for (int e = lane; e < 16 * I; e += 32) {
      const int r = e / I, c = e % I;
      const int row = row0 + warp * 16 + r;
      if (row < args.batch) sink.put(std::size_t(row) * I + c, arow[r * Spec::lda + c]);
    }
  } else {
    mlp_backward_layer<Spec, L - 1>(args, act, ws, row0, sink);
  }
}

template <class Spec>
__global__ void __launch_bounds__(Spec::threads) mlp_forward_kernel(const MlpArgs<Spec::count> args) {
  kernel_prologue();
  extern __shared__ __align__(128) unsigned char mlp_smem[];
  float* act = reinterpret_cast<float*>(mlp_smem);
  float* ws = act + Spec::rows * Spec::lda;
  float* bs = ws + Spec::width * Spec::ldw;
  const int row0 = int(blockIdx.x) * Spec::rows;
  mlp_load_rows<Spec>(act, args.x, row0, args.batch, Spec::in, Spec::template layer<0>::in_pad);
  mlp_forward_layer<Spec, 0>(args, act, ws, bs, row0);
}

template <class Spec, class Sink>
__global__ void __launch_bounds__(Spec::threads) mlp_backward_kernel(const MlpArgs<Spec::count> args,
                                                                     const Sink sink) {
  kernel_prologue();
  extern __shared__ __align__(128) unsigned char mlp_smem[];
  float* act = reinterpret_cast<float*>(mlp_smem);
  float* ws = act + Spec::rows * Spec::lda;
  const int row0 = int(blockIdx.x) * Spec::rows;
  mlp_load_rows<Spec>(act, args.dy, row0, args.batch, Spec::out, Spec::template layer<Spec::count - 1>::out_pad);
  mlp_backward_layer<Spec, Spec::count - 1>(args, act, ws, row0, sink);
}

// Opts a kernel in to more than 48 KiB of dynamic shared memory, once per device.
template <class Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes, int device, std::atomic<std::uint64_t>& done) {
  const std::uint64_t bit = device < 64 ? std::uint64_t(1) << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  FUSEDP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <class Spec, class P>
void check_mlp_device(const CudaSpace<P>& space) {
  if (Spec::smem_bytes > space.shared_memory_per_block())
    throw DeviceError("fused MLP", int(cudaErrorInvalidValue),
                      "needs " + std::to_string(Spec::smem_bytes) + " bytes of shared memory per block; device " +
                          std::to_string(space.device()) + " offers " +
                          std::to_string(space.shared_memory_per_block()));
  require(space.architecture() >= 80, "fused MLP: needs sm_80 or newer (TF32 tensor cores), device is sm_",
          space.architecture());
}

}  // namespace detail

namespace detail {
inline std::atomic<bool>& fused_mlp_flag() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace detail

/// Whether models use the fused MLP kernels where a device can run them (the default), or run the
/// layers of every MLP group one by one as on a device that cannot (too little shared memory: LeNet's
/// 128-wide run on an sm_86 or sm_89), so that path is testable on any device. Model's step graphs are
/// recorded again after a change (Parallel's steps are not recorded).
inline void set_fused_mlp(bool on) noexcept { detail::fused_mlp_flag().store(on, std::memory_order_relaxed); }
[[nodiscard]] inline bool fused_mlp() noexcept { return detail::fused_mlp_flag().load(std::memory_order_relaxed); }

/// Whether the fused MLP kernels run on this device (sm_80+, enough shared memory, fused_mlp());
/// otherwise the caller runs the layers one by one.
template <class Spec, class P>
bool mlp_supported(const CudaSpace<P>& space) {
  return fused_mlp() && space.architecture() >= 80 && Spec::smem_bytes <= space.shared_memory_per_block();
}

/// Forward of the fused run: args.y[l] = Epi_l(y[l-1] W_l^T + b_l), y[-1] = args.x.
template <class Spec, class P>
void mlp_forward(const CudaSpace<P>& space, const MlpArgs<Spec::count>& args) {
  if (args.batch <= 0) return;
  detail::check_mlp_device<Spec>(space);
  static std::atomic<std::uint64_t> opted{0};
  detail::allow_shared_memory(detail::mlp_forward_kernel<Spec>, Spec::smem_bytes, space.device(), opted);
  const unsigned blocks = unsigned((args.batch + Spec::rows - 1) / Spec::rows);
  launch<detail::mlp_forward_kernel<Spec>>("mlp_forward_kernel", blocks, Spec::threads, Spec::smem_bytes,
                                           space.stream(), args);
}

/// Scratch (floats) of mlp_backward's weight-gradient GEMMs.
template <class Spec>
std::size_t mlp_backward_scratch(int batch, int sm_count) {
  std::size_t s = 0;
  [&]<int... L>(std::integer_sequence<int, L...>) {
    ((s = std::max(s, weight_gradient_scratch<tile_for<Spec::template layer<L>::in>>(
                          Spec::template layer<L>::out, Spec::template layer<L>::in, batch, sm_count))),
     ...);
  }(std::make_integer_sequence<int, Spec::count>{});
  return s;
}

/// Backward of the fused run: from args.dy, writes args.dz[l] for every layer, the run's input gradient
/// through `sink` when it is active (StoreSink{args.dx}: stored; the group below's UnpoolSink or
/// ActivationSink: that group's dz, so that it runs no pass of its own), then each layer's dW and db
/// (set, not accumulated) by split-K GEMMs over the batch, which apply `updates[l]` when given (after
/// the fused kernel has read every weight). args.dx is not used.
template <class Spec, class P, class Sink>
void mlp_backward_to(const CudaSpace<P>& space, const MlpArgs<Spec::count>& args, const Sink& sink,
                     float* const (&dw)[Spec::count], float* const (&db)[Spec::count], float* scratch,
                     const LayerUpdate<float>* updates = nullptr) {
  if (args.batch <= 0) return;
  detail::check_mlp_device<Spec>(space);
  static std::atomic<std::uint64_t> opted{0};
  detail::allow_shared_memory(detail::mlp_backward_kernel<Spec, Sink>, Spec::smem_bytes, space.device(), opted);
  const unsigned blocks = unsigned((args.batch + Spec::rows - 1) / Spec::rows);
  launch<detail::mlp_backward_kernel<Spec, Sink>>("mlp_backward_kernel", blocks, Spec::threads, Spec::smem_bytes,
                                                  space.stream(), args, sink);
  [&]<int... L>(std::integer_sequence<int, L...>) {
    (
        [&] {
          using Layer = typename Spec::template layer<L>;
          const float* input = L == 0 ? args.x : args.y[L == 0 ? 0 : L - 1];
          // dW (out, in) = dz^T (out, batch) x input (batch, in); db = row sums of dz^T
          weight_gradient<tile_for<Layer::in>, P>(space.stream(), space.sm_count(), Layer::out, Layer::in, args.batch,
                                                  Columns{args.dz[L], Layer::out}, Columns{input, Layer::in}, dw[L],
                                                  db[L], scratch, updates ? updates[L] : LayerUpdate<float>{},
                                                  split_arrivals(space));
        }(),
        ...);
  }(std::make_integer_sequence<int, Spec::count>{});
}

/// mlp_backward_to with the run's input gradient stored to args.dx (none when it is null).
template <class Spec, class P>
void mlp_backward(const CudaSpace<P>& space, const MlpArgs<Spec::count>& args, float* const (&dw)[Spec::count],
                  float* const (&db)[Spec::count], float* scratch, const LayerUpdate<float>* updates = nullptr) {
  mlp_backward_to<Spec>(space, args, StoreSink{args.dx}, dw, db, scratch, updates);
}

}  // namespace fusedp::kernels::cuda
#undef FUSEDP_MLP_TENSOR_CORES
#endif  // FUSEDP_HAS_CUDA
