#!/usr/bin/env bash
# benchmarks/gpu/prebuild.sh: builds what check.sh runs (tests/gpu/*.cu, the layer tests once more on the
# tensor-core mainloop as test_gpu_*_mma, train_step_gpu, train_step_gpu_mma, train_step_gpu_unfused and
# train_step_gpu_wide,
# gemm_gpu, allreduce_bench
# and the examples) for one
# GPU architecture on a machine WITHOUT a GPU, so that a short lease of a GPU machine is spent running,
# not compiling. They need an x86-64 Linux with a driver at least as new as this nvcc, libstdc++, zlib,
# and on LD_LIBRARY_PATH libnccl.so.2 (PyTorch's wheel has one) and libcudart.so.13 (copied into DIR).
#
#   benchmarks/gpu/prebuild.sh [ARCH] [DIR]     ARCH default 90 (H100/H200), DIR default build/gpu-prebuilt
#
# then, on the GPU machine:  FUSEDP_PREBUILT_DIR=DIR benchmarks/gpu/check.sh
# or, with the device tool's 64 MiB limit, carry build/gpu-carry and give check.sh the archive written
# below:                      FUSEDP_PREBUILT_DIR=$PWD/build/gpu-carry/prebuilt-sm90.tar.xz benchmarks/gpu/check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=${1:-90}
DIR=${2:-build/gpu-prebuilt}
BUILD=build/gpu$ARCH
JOBS=$(nproc 2>/dev/null || echo 2)
# The device code uncompressed in the binaries (nvcc --no-compress): the archive's xz compresses it far
# better than nvcc's own fatbin compression leaves it. benchmarks/gpu/gemm_gpu.cu, stripped, in xz -9e:
# 1.24 MB compressed by nvcc, 0.90 MB not (2026-12-07), though the binary grows from 4.6 to 8.1 MB.
NO_COMPRESS=--no-compress
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DCMAKE_CUDA_FLAGS="$NO_COMPRESS" \
  -DFUSEDP_BUILD_TESTS=ON -DFUSEDP_BUILD_EXAMPLES=OFF -DFUSEDP_BUILD_BENCHMARKS=OFF -DFUSEDP_TEST_CONSUMERS=OFF \
  -DFUSEDP_HEADER_TEST_CUDA=OFF -DFUSEDP_ENABLE_MPI=OFF -DFUSEDP_INSTALL=OFF -DFUSEDP_GPU_MMA_TESTS=ON > /dev/null
mapfile -t tests < <(ninja -C "$BUILD" -t targets all | sed -n 's/^\(test_gpu_[A-Za-z0-9_]*\): phony$/\1/p')
echo "prebuild: ${tests[*]} and train_step_gpu for sm_$ARCH with $JOBS jobs"
ninja -C "$BUILD" -j "$JOBS" "${tests[@]}"
# Emptied first, so that no binary of a test since removed is packed and run.
rm -rf "$DIR" && mkdir -p "$DIR"
# The commit the binaries are built from (check.sh prints it, and warns where the call names another).
{ git rev-parse --short=12 HEAD 2>/dev/null || echo unknown; } | { read -r c; git diff --quiet HEAD -- include tests benchmarks examples 2>/dev/null && echo "$c" || echo "$c (with uncommitted changes)"; } > "$DIR/BUILT_FROM"
for t in "${tests[@]}"; do cp "$BUILD/tests/$t" "$DIR/"; done
bench() { nvcc -std=c++20 -O3 -arch=sm_"$ARCH" $NO_COMPRESS -Iinclude -Xcompiler=-pthread "$@"; }
bench benchmarks/gpu/train_step_gpu.cu -o "$DIR/train_step_gpu"
# The same train steps with the layers' GEMMs on the tensor-core mainloop (impl=fusedp-mma).
# With BF16 for LeNet and the CIFAR-10 CNN (--precision bf16: issue 17's BF16 targets) and ResNet-18.
bench -DFUSEDP_CUDA_MMA_LAYERS=1 -DFUSEDP_BENCH_BF16=1 benchmarks/gpu/train_step_gpu.cu -o "$DIR/train_step_gpu_mma"
# Without the fused gradient boundaries (impl=fusedp-unfused): what they give, measured in the same run.
bench -DFUSEDP_CUDA_FUSED_GRADIENTS=0 benchmarks/gpu/train_step_gpu.cu -o "$DIR/train_step_gpu_unfused"
# train_step_gpu_mma's BF16 runs with every stage output and gradient in fp32 elements
# (impl=fusedp-mma-wide-bf16): what the 16-bit elements give, measured in the same run. BF16 only, to keep the carry inside 64 MiB.
bench -DFUSEDP_CUDA_MMA_LAYERS=1 -DFUSEDP_BENCH_ONLY_BF16=1 -DFUSEDP_CUDA_NARROW_OUTPUTS=0 \
  benchmarks/gpu/train_step_gpu.cu -o "$DIR/train_step_gpu_wide"
bench benchmarks/gpu/gemm_gpu.cu -o "$DIR/gemm_gpu"
bench -DFUSEDP_WITH_NCCL=1 benchmarks/gpu/allreduce_bench.cu -lnccl -o "$DIR/allreduce_bench"
# The examples (each with its _cuda twin), without MPI: GPU machines may have none.
cmake -S . -B build/gpu$ARCH-examples -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DCMAKE_CUDA_FLAGS="$NO_COMPRESS" \
  -DFUSEDP_BUILD_TESTS=OFF -DFUSEDP_BUILD_EXAMPLES=ON -DFUSEDP_BUILD_BENCHMARKS=OFF -DFUSEDP_INSTALL=OFF \
  -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON > /dev/null
ninja -C build/gpu$ARCH-examples -j "$JOBS"
# Only each example's _cuda program (nvcc's build, which runs --device cuda on its own): the C++ compiler's
# twin only hands such a run to it, and leaving the four out keeps the carry inside the device tool's
# 64 MiB (2026-12-07: 3.3 MB of the archive).
for e in lenet_mnist cifar10_cnn mlp_fit resnet18_cifar; do cp build/gpu$ARCH-examples/examples/${e}_cuda "$DIR/"; done
cp -L "$(dirname "$(command -v nvcc)")/../lib64/libcudart.so.13" "$DIR/" 2>/dev/null ||
  cp -L /usr/local/cuda/lib/libcudart.so.13 "$DIR/" 2>/dev/null || echo "prebuild: libcudart.so.13 not copied"
strip "$DIR"/test_gpu_* "$DIR"/train_step_gpu "$DIR"/train_step_gpu_mma "$DIR"/train_step_gpu_unfused \
  "$DIR"/train_step_gpu_wide "$DIR"/gemm_gpu "$DIR"/allreduce_bench "$DIR"/*_cuda 2>/dev/null || true
du -sh "$DIR"
# The device tool carries at most 64 MiB with the working tree, and the binaries take about 150 MB:
# also pack them (xz: 12.2 MB on 2026-12-07 with --no-compress, 37.4 MB before), which check.sh unpacks itself when FUSEDP_PREBUILT_DIR names the
# archive. Carry the archive's folder (git-ignored under build/), not DIR.
PACK=${PACK:-build/gpu-carry/prebuilt-sm$ARCH.tar.xz}
mkdir -p "$(dirname "$PACK")"
# One xz block whose dictionary spans the whole tar (the test binaries share most of their kernels, ten
# binaries apart), with the x86 filter for the host code: 37.4 -> 36.6 MB on the same binaries
# (2026-12-07); with the uncompressed device code, 12.2 MB for 294 MB of binaries. Unpacking takes
# 256 MiB of memory and a second or two; python3's tarfile reads it (check.sh).
tar -C "$(dirname "$DIR")" -cf - "$(basename "$DIR")" | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$PACK"
echo "prebuild: packed into $PACK ($(du -h "$PACK" | cut -f1)); on the GPU machine:"
echo "  FUSEDP_PREBUILT_DIR=\$PWD/$PACK benchmarks/gpu/check.sh"
# What the device tool would carry: its folder and the tracked tree (64 MiB in all; device_call.sh adds
# Fashion-MNIST's 31 MB to the folder).
carry=$(( $(du -sb "$(dirname "$PACK")" | cut -f1) + $(git archive HEAD 2>/dev/null | wc -c) ))
echo "prebuild: $(dirname "$PACK") and the tree: $(( carry / 1048576 )) MiB of the device tool's 64"
