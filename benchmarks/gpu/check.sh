#!/usr/bin/env bash
# benchmarks/gpu/check.sh: the one-call GPU check of fusedp, for a machine with one NVIDIA GPU and no
# network (it needs nvcc and python3 with a CUDA build of PyTorch; CMake >= 3.25 with ninja and
# doctest for the tests, else it says what it skipped). In under 8 minutes it
#
#   1. prints the date, the GPU, the driver, CUDA, PyTorch and the commit; with prebuilt binaries, runs
#      test_gpu_memory alone (it measures the device's free memory);
#   2. starts PyTorch on every benchmark configuration in the background (eager, eager captured in a
#      CUDA graph and torch.compile everywhere; max-autotune and bf16 autocast on LeNet and the CIFAR-10
#      CNN), so torch.compile compiles and warms up while nvcc builds (or the prebuilt tests run);
#   3. configures for the present GPU's architecture only and builds the gpu tests (tests/gpu/*.cu) and
#      the benchmark (benchmarks/gpu/train_step_gpu.cu);
#   4. runs ctest -L gpu (prebuilt: each program within 90 s, none started with under 20 s left);
#   5. waits until every PyTorch process is warm (or the time left says stop; the cold ones are
#      reported as not measured), then times PyTorch one configuration and mode at a time with nothing
#      else running, then fusedp's train steps (CUDA events, warm-up, median of 100 steps each), the
#      most important first and each only while time is left, so that a call cut short keeps them:
#      a. issue 17's figures: LeNet and the CIFAR-10 CNN at batch 128 on the WMMA layers (train_step_gpu)
#         and on the tensor-core ones (train_step_gpu_mma: FUSEDP_CUDA_MMA_LAYERS=1), TF32 and BF16
#         (impl=fusedp, fusedp-mma, fusedp-mma-bf16); then, where ncu exists, each kernel's time and
#         DRAM bytes in one step of LeNet and of the CNN and of the CNN's BF16 step, against the step's
#         time and the fused minimum traffic (benchmarks/gpu/kernel_times.py);
#      b. the 5-hidden-layer MLPs of width 64 and 128 at batch 2^14 and 2^18 and ResNet-18 at 256 on
#         both builds;
#      c. the ablations, LeNet and the CIFAR-10 CNN each: without the fused gradient boundaries
#         (train_step_gpu_unfused, when prebuilt), the CNN's BF16 stage outputs in fp32 elements
#         (impl=fusedp-mma-wide-bf16, train_step_gpu_wide when prebuilt), the optimizer as a separate
#         pass (impl=fusedp-separate-update), without programmatic dependent launch (impl=fusedp-no-pdl),
#         backward's weight gradients in order on one stream (impl=fusedp-serial), split-K GEMMs' parts
#         always added up by a second kernel (impl=fusedp-split-kernel) or always by the GEMM's last
#         block per tile (impl=fusedp-split-gemm);
#      d. the GEMM problems of the seed networks on the tensor-core mainloop and the WMMA one
#         (benchmarks/gpu/gemm_gpu.cu; also the BF16 mainloop with the CIFAR-10 activations in memory as
#         fp32 and as BFloat16), and compute-sanitizer memcheck and racecheck on test_gpu_gemm_mma where
#         the toolkit has it; one ResNet-18 BF16 step under ncu, its 15 costliest kernel functions
#         (BatchNorm's split passes among them); the table so far (results.txt, results.md);
#      e. the all-reduce benchmark and the examples on the GPU (prebuilt only);
#   6. prints the table of images/s and ratios last (and writes it as Markdown for RESULTS.md).
#
# Environment: FUSEDP_CHECK_DIR (work folder, default build/gpu-check), FUSEDP_DOCTEST_DIR (folder with
# doctest.h), FUSEDP_COMMIT (when the tree is not a git checkout), FUSEDP_TORCH_PYTHON (default
# python3), FUSEDP_CHECK_BUDGET (seconds, default 460), FUSEDP_COMPILE_MODE (torch.compile mode,
# default "default"), FUSEDP_FASHION_MNIST_DIR (real data for the training test; synthetic otherwise),
# FUSEDP_CHECK_ARCH (compute capability to build for, e.g. 90, instead of asking nvidia-smi),
# FUSEDP_PREBUILT_DIR (a folder holding test_gpu_* and train_step_gpu[_mma] built elsewhere for this
# GPU's architecture, e.g. by `benchmarks/gpu/prebuild.sh` on a machine without a GPU, or the .tar.xz it
# packs them into: nothing is built here, which saves the minutes of device time nvcc takes),
# FUSEDP_TORCH_MODES (PyTorch modes run on every configuration, default "eager graph"),
# FUSEDP_TORCH_STRONG (modes run on LeNet and the CIFAR-10 CNN only, default "compile autotune
# eager:bf16 graph:bf16 autotune:bf16"; "" for none). A mode is
# eager|graph|compile|autotune, with :bf16 for bf16 autocast (benchmarks/gpu/torch_bench.py).
#
# Exit status: 0 when everything built and every gpu test passed on the GPU; 1 when a build or a test
# failed, or a test was not run for want of time (its log line says NOT RUN); 3 when the tests found no
# usable device and skipped (benchmark numbers never fail it). Only with prebuilt binaries does
# test_gpu_memory run alone before PyTorch's processes start; built here, it runs beside them.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${FUSEDP_CHECK_BUDGET:-460}
OUT=${FUSEDP_CHECK_DIR:-$ROOT/build/gpu-check}
PY=${FUSEDP_TORCH_PYTHON:-python3}
COMPILE_MODE=${FUSEDP_COMPILE_MODE:-default}
# torch.compile's processes compete for the CPUs while they warm up: the default mode runs on LeNet and
# the CIFAR-10 CNN only (with max-autotune and bf16 autocast, what issue 17 compares against), eager and
# eager in a CUDA graph everywhere.
read -r -a TORCH_MODES <<< "${FUSEDP_TORCH_MODES:-eager graph}"
read -r -a TORCH_STRONG <<< "${FUSEDP_TORCH_STRONG-compile autotune eager:bf16 graph:bf16 autotune:bf16}"
STRONG_CONFIGS=" lenet:128 cifar:128 "
PREBUILT=${FUSEDP_PREBUILT_DIR:-}
JOBS=$(nproc 2>/dev/null || echo 4)
status=0
skipped=0

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { printf '[check %3ds] %s\n' "$(elapsed)" "$*"; }
clamp() { local v=$1 lo=$2 hi=$3; (( v < lo )) && v=$lo; (( v > hi )) && v=$hi; echo "$v"; }
# Runs one gpu test program ($1) within $2 seconds; its output in $OUT/<name>.out, a summary here.
run_gpu_test() {
  local t=$1 t_limit=$2 tout trc
  log "$(basename "$t") (time limit ${t_limit}s)"
  tout="$OUT/$(basename "$t").out"
  FUSEDP_SOURCE_DIR="$ROOT" timeout "$t_limit" "$t" > "$tout" 2>&1
  trc=$?
  if (( trc != 0 )); then
    (( trc == 124 )) && log "TIMED OUT after ${t_limit}s: $(basename "$t")" || log "FAILED (exit $trc): $(basename "$t")"
    tail -40 "$tout"; status=1
  fi
  grep -E "test cases|MESSAGE|accuracy|mean loss|data:" "$tout" | tail -8
  grep -q "fusedp-gpu-skip" "$tout" && skipped=1
}

mkdir -p "$OUT"
rm -rf "$OUT/torch" "$OUT/fusedp.txt" "$OUT/header.txt" "$OUT/kernel_times.txt" "$OUT/results.md"
mkdir -p "$OUT/torch"
# FUSEDP_PREBUILT_DIR may name prebuild.sh's archive (.tar.xz): unpacked here into $OUT/prebuilt (by
# python3's tarfile, so the machine needs no xz).
if [[ "$PREBUILT" == *.tar.xz ]]; then
  [[ -f "$PREBUILT" ]] || { log "FUSEDP_PREBUILT_DIR: $PREBUILT does not exist"; exit 2; }
  rm -rf "$OUT/prebuilt" && mkdir -p "$OUT/prebuilt"
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PREBUILT" "$OUT/prebuilt" ||
    { log "could not unpack $PREBUILT"; exit 2; }
  PREBUILT=$(find "$OUT/prebuilt" -mindepth 1 -maxdepth 1 -type d | head -1)
  log "unpacked the prebuilt binaries into $PREBUILT"
fi
# Which commit the binaries were built from (prebuild.sh writes BUILT_FROM): a stale archive must not
# pass for the commit the call names.
if [[ -n "$PREBUILT" ]]; then
  if [[ -f "$PREBUILT/BUILT_FROM" ]]; then
    BUILT_FROM=$(head -1 "$PREBUILT/BUILT_FROM")
    log "the prebuilt binaries were built from $BUILT_FROM"
    if [[ -n "${FUSEDP_COMMIT:-}" && "$BUILT_FROM" != "$FUSEDP_COMMIT"* && "$FUSEDP_COMMIT" != "${BUILT_FROM%% *}"* ]]; then
      log "WARNING: FUSEDP_COMMIT is $FUSEDP_COMMIT but the binaries are from $BUILT_FROM: the header names the binaries' commit"
      FUSEDP_COMMIT="$BUILT_FROM (binaries; FUSEDP_COMMIT said $FUSEDP_COMMIT)"
    fi
  else
    log "WARNING: $PREBUILT has no BUILT_FROM: the commit below is what the caller says, not checked"
  fi
fi
# The prebuilt binaries find libcudart.so.13 beside them (prebuild.sh copies it there). PyTorch keeps the
# caller's path (TORCH_LD): LD_LIBRARY_PATH overrides its wheel's RUNPATH, and the runtime it was built
# against may be newer than the one copied here.
TORCH_LD=${LD_LIBRARY_PATH-}
[[ -n "$PREBUILT" ]] && export LD_LIBRARY_PATH="$PREBUILT${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- 1. the machine ---------------------------------------------------------------------------------
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if ! command -v nvidia-smi >/dev/null; then
  log "nvidia-smi not found: is there an NVIDIA GPU and driver on this machine?"
fi
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
if [[ -n "${FUSEDP_CHECK_ARCH:-}" ]]; then
  ARCH=$FUSEDP_CHECK_ARCH  # e.g. 90; for a dry run on a machine without a GPU
elif [[ -z "$CAP" ]]; then
  ARCH=native  # CMake >= 3.24 and nvcc >= 11.5 resolve it to the present GPU
  log "could not read the compute capability; building for CMAKE_CUDA_ARCHITECTURES=native"
else
  ARCH=$CAP
fi
if [[ -n "${FUSEDP_COMMIT:-}" ]]; then
  COMMIT=$FUSEDP_COMMIT
elif COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT (with uncommitted changes)"
else
  COMMIT="unknown (not a git checkout; set FUSEDP_COMMIT)"
fi
TORCH=$(LD_LIBRARY_PATH="$TORCH_LD" "$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available" if torch.cuda.is_available() else "NOT AVAILABLE")' 2>/dev/null || echo "not importable by $PY")
{
  echo "fusedp GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "GPU: ${GPU:-unknown} (sm_${ARCH})"
  echo "CUDA: $("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' | head -1) (nvcc), PyTorch: $TORCH"
  echo "commit: $COMMIT"
  echo "host: $(nproc) CPUs, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)"
} > "$OUT/header.txt"
cat "$OUT/header.txt"

# test_gpu_memory compares the device's free memory before and after a model allocates, and then takes
# nearly all of it: it runs alone, before PyTorch's processes start (they would move the one, and fail
# their own allocations while it holds the other).
EARLY_TEST=""
if [[ -n "$PREBUILT" && -x "$PREBUILT/test_gpu_memory" ]]; then
  EARLY_TEST=test_gpu_memory
  run_gpu_test "$PREBUILT/test_gpu_memory" 60
fi

# --- 2. PyTorch: compile and warm up in the background ------------------------------------------------
CONFIGS=(lenet:128 cifar:128 mlp64:16384 mlp64:262144 mlp128:16384 mlp128:262144 resnet18:256)
declare -A TORCH_PID
TORCH_IDS=()  # mode[:precision]-net-batch, in the order they are timed
torch_modes_of() {  # the PyTorch modes run on configuration $1
  local m
  for m in "${TORCH_MODES[@]}"; do echo "$m"; done
  if [[ "$STRONG_CONFIGS" == *" $1 "* ]]; then for m in "${TORCH_STRONG[@]}"; do echo "$m"; done; fi
}
torch_ok=0
# Each torch.compile process would start a pool of compile workers as large as the machine; with some
# thirty processes warming up at once beside the tests, max-autotune may not finish in time.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
if LD_LIBRARY_PATH="$TORCH_LD" "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch_ok=1
  for cfg in "${CONFIGS[@]}"; do
    net=${cfg%%:*} batch=${cfg##*:}
    while read -r spec; do
      mode=${spec%%:*} precision=tf32
      [[ "$spec" == *:* ]] && precision=${spec##*:}
      id="$mode-$precision-$net-$batch"
      LD_LIBRARY_PATH="$TORCH_LD" "$PY" "$ROOT/benchmarks/gpu/torch_bench.py" --net "$net" --batch "$batch" --mode "$mode" \
        --precision "$precision" --compile-mode "$COMPILE_MODE" --steps 100 --warmup 10 \
        --ready "$OUT/torch/$id.ready" --go "$OUT/torch/$id.go" --wait "$BUDGET" --out "$OUT/torch/$id.json" \
        > "$OUT/torch/$id.log" 2>&1 &
      TORCH_PID[$id]=$!
      TORCH_IDS+=("$id")
    done < <(torch_modes_of "$cfg")
  done
  log "PyTorch: ${#TORCH_PID[@]} processes compiling and warming up in the background"
else
  log "PyTorch with CUDA is not available to $PY: the PyTorch columns stay empty"
fi

# --- 3. build -----------------------------------------------------------------------------------------
TEST_MODE=none  # ctest, direct, prebuilt or none
if [[ -n "$PREBUILT" ]]; then
  log "using the binaries in $PREBUILT (built elsewhere; nothing is compiled here)"
  ls "$PREBUILT"/test_gpu_* >/dev/null 2>&1 && TEST_MODE=prebuilt || log "no test_gpu_* in $PREBUILT"
  [[ -x "$PREBUILT/train_step_gpu" ]] && cp "$PREBUILT/train_step_gpu" "$OUT/train_step_gpu"
  [[ -x "$PREBUILT/train_step_gpu_mma" ]] && cp "$PREBUILT/train_step_gpu_mma" "$OUT/train_step_gpu_mma"
  [[ -x "$PREBUILT/train_step_gpu_unfused" ]] && cp "$PREBUILT/train_step_gpu_unfused" "$OUT/train_step_gpu_unfused"
  [[ -x "$PREBUILT/train_step_gpu_wide" ]] && cp "$PREBUILT/train_step_gpu_wide" "$OUT/train_step_gpu_wide"
  [[ -x "$PREBUILT/gemm_gpu" ]] && cp "$PREBUILT/gemm_gpu" "$OUT/gemm_gpu"
else
DOCTEST_DIR=""
for d in "${FUSEDP_DOCTEST_DIR:-}" "$ROOT/third_party/doctest" /usr/include/doctest /usr/local/include/doctest; do
  if [[ -n "$d" && -f "$d/doctest.h" ]]; then DOCTEST_DIR=$d; break; fi
done
if [[ -z "$DOCTEST_DIR" ]]; then
  log "doctest not found (FUSEDP_DOCTEST_DIR, third_party/doctest/doctest.h, /usr/include/doctest):"
  log "  THE GPU TESTS ARE NOT BUILT OR RUN; only the benchmarks. Copy doctest.h to third_party/doctest/."
fi

# the benchmark: one translation unit, straight from nvcc (needs nothing but the CUDA toolkit)
if [[ "$ARCH" == native ]]; then ARCH_FLAG=-arch=native; else ARCH_FLAG="-arch=sm_$ARCH"; fi
log "building benchmarks/gpu/train_step_gpu.cu for $ARCH_FLAG"
{ "$NVCC" -std=c++20 -O3 "$ARCH_FLAG" -I"$ROOT/include" -Xcompiler=-pthread \
    "$ROOT/benchmarks/gpu/train_step_gpu.cu" -o "$OUT/train_step_gpu" &&
  "$NVCC" -std=c++20 -O3 "$ARCH_FLAG" -I"$ROOT/include" -Xcompiler=-pthread \
    "$ROOT/benchmarks/gpu/gemm_gpu.cu" -o "$OUT/gemm_gpu" &&
  "$NVCC" -std=c++20 -O3 "$ARCH_FLAG" -I"$ROOT/include" -Xcompiler=-pthread -DFUSEDP_CUDA_MMA_LAYERS=1 \
    -DFUSEDP_BENCH_BF16=1 "$ROOT/benchmarks/gpu/train_step_gpu.cu" -o "$OUT/train_step_gpu_mma"; } > "$OUT/bench_build.log" 2>&1 &
BENCH_BUILD=$!

if [[ -n "$DOCTEST_DIR" ]]; then
  cmake_ok=0
  if command -v cmake >/dev/null && command -v ninja >/dev/null; then
    doctest_flag=()
    [[ "$DOCTEST_DIR" == "$ROOT/third_party/doctest" || "$DOCTEST_DIR" == /usr/include/doctest ]] || doctest_flag=(-DFUSEDP_DOCTEST_DIR="$DOCTEST_DIR")
    log "configuring (CMAKE_CUDA_ARCHITECTURES=$ARCH)"
    if cmake -S "$ROOT" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" \
         -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DFUSEDP_BUILD_TESTS=ON -DFUSEDP_BUILD_EXAMPLES=OFF \
         -DFUSEDP_BUILD_BENCHMARKS=OFF -DFUSEDP_TEST_CONSUMERS=OFF -DFUSEDP_HEADER_TEST_CUDA=OFF \
         -DFUSEDP_ENABLE_MPI=OFF -DFUSEDP_INSTALL=OFF -DFUSEDP_GPU_MMA_TESTS=ON "${doctest_flag[@]}" > "$OUT/configure.log" 2>&1; then
      mapfile -t GPU_TESTS < <(ctest --test-dir "$OUT/build" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: *//p')
      if (( ${#GPU_TESTS[@]} > 0 )); then
        cmake_ok=1
        log "building ${#GPU_TESTS[@]} gpu tests with $JOBS jobs"
        if cmake --build "$OUT/build" --target "${GPU_TESTS[@]}" -j "$JOBS" > "$OUT/build.log" 2>&1; then
          TEST_MODE=ctest
        else
          log "BUILD FAILED (last lines of $OUT/build.log):"; tail -30 "$OUT/build.log"; status=1
        fi
      else
        log "configured, but no gpu tests were registered (is CUDA enabled? see $OUT/configure.log)"
      fi
    else
      log "cmake could not configure (see $OUT/configure.log; last lines:)"; tail -15 "$OUT/configure.log"
    fi
  else
    log "cmake or ninja not found"
  fi
  if (( cmake_ok == 0 )); then
    # Without CMake: each tests/gpu/*.cu straight from nvcc with doctest's main (fashion_mnist needs zlib).
    log "building the gpu tests with nvcc directly"
    mkdir -p "$OUT/direct"
    printf '#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN\n#include <doctest/doctest.h>\n' > "$OUT/direct/main.cpp"
    mkdir -p "$OUT/direct/include/doctest" && cp "$DOCTEST_DIR/doctest.h" "$OUT/direct/include/doctest/"
    build_one() {
      local src=$1 name; name=$(basename "$src" .cu)
      local libs=()
      if grep -q 'fusedp/data/' "$src"; then
        [[ -f /usr/include/zlib.h ]] || { echo "skip $name (no zlib.h)"; return 0; }
        libs=(-lz)
      fi
      "$NVCC" -std=c++20 -O2 "$ARCH_FLAG" -I"$ROOT/include" -I"$ROOT/tests/gpu" -isystem "$OUT/direct/include" \
        -Xcompiler=-pthread "$OUT/direct/main.cpp" "$src" -o "$OUT/direct/test_gpu_$name" "${libs[@]}" \
        > "$OUT/direct/$name.log" 2>&1 || { echo "FAILED $name"; tail -20 "$OUT/direct/$name.log"; return 1; }
    }
    export -f build_one; export NVCC ARCH_FLAG ROOT OUT
    if ls "$ROOT"/tests/gpu/*.cu | xargs -P "$JOBS" -I{} bash -c 'build_one "$@"' _ {}; then
      TEST_MODE=direct
    else
      status=1; TEST_MODE=direct
    fi
  fi
fi
if wait "$BENCH_BUILD"; then
  log "benchmark built"
else
  log "BENCHMARK BUILD FAILED:"; tail -30 "$OUT/bench_build.log"; status=1
fi
fi  # not prebuilt

# --- 4. tests -----------------------------------------------------------------------------------------
test_limit=$(clamp $(( $(left) - 150 )) 60 240)
case $TEST_MODE in
  ctest)
    log "ctest -L gpu (time limit ${test_limit}s)"
    timeout "$test_limit" ctest --test-dir "$OUT/build" -L gpu -V --timeout "$test_limit" > "$OUT/ctest.log" 2>&1
    rc=$?
    grep -E "tests passed|tests failed|Test +#.*(Passed|Failed|Timeout|Skipped)|MESSAGE|accuracy|mean loss|data:|fusedp-gpu-skip|FUSEDP_TEST_SEED|ERROR" \
      "$OUT/ctest.log" | sed 's/^[0-9]*: //' | uniq | tail -60
    if grep -q "fusedp-gpu-skip" "$OUT/ctest.log"; then
      log "WARNING: the gpu tests found no usable CUDA device and SKIPPED their GPU parts"; skipped=1
    fi
    if (( rc != 0 )); then log "GPU TESTS FAILED (rc $rc; full output in $OUT/ctest.log)"; tail -60 "$OUT/ctest.log"; status=1; fi
    ;;
  direct|prebuilt)
    [[ $TEST_MODE == direct ]] && tdir="$OUT/direct" || tdir="$PREBUILT"
    for t in "$tdir"/test_gpu_*; do
      [[ -x "$t" ]] || continue
      [[ "$(basename "$t")" == "$EARLY_TEST" ]] && continue  # ran alone before PyTorch started
      # Each test within what is left beyond the benchmarks' share, and at most 90 s (generous for a
      # program of GPU tests, even beside PyTorch's warming processes; no per-test times have been
      # measured), so that a few tests that hang cannot take the benchmarks' time between them; a test
      # that would get less than 20 s is not started.
      t_limit=$(clamp $(( $(left) - 250 )) 0 90)
      if (( t_limit < 20 )); then
        log "NOT RUN (the tests' time is spent): $(basename "$t")"; status=1; continue
      fi
      run_gpu_test "$t" "$t_limit"
    done
    ;;
  none) log "no gpu tests were run" ;;
esac

# --- 5. benchmarks: PyTorch one at a time, then fusedp ------------------------------------------------
if (( torch_ok )); then
  # Nothing is timed while any process still compiles or autotunes (max-autotune times kernels on the
  # GPU): wait until every one is warm or gone, keeping about 3 s per timing run, fusedp's benchmark
  # and the report; those still cold then are stopped and reported as not measured.
  # Seconds kept for fusedp: issue 17's runs first (LeNet and the CIFAR-10 CNN on both builds in TF32
  # and BF16, about 40 s; their kernels under ncu, about 60 s; the report), then about a minute of the
  # other configurations and ablations; the rest of those run as far as the budget goes. PyTorch's
  # strongest modes (max-autotune) need the warm-up time more than the ablations do.
  after=110
  [[ -n "$(command -v ncu || ls "$(dirname "$NVCC")/ncu" 2>/dev/null || true)" ]] || after=50  # no ncu runs
  after=$(( after + 60 ))
  keep=$(( after + 3 * ${#TORCH_IDS[@]} ))
  while (( $(left) > keep )); do
    cold=0
    for id in "${TORCH_IDS[@]}"; do
      [[ -e "$OUT/torch/$id.ready" ]] || ! kill -0 "${TORCH_PID[$id]}" 2>/dev/null || cold=$((cold + 1))
    done
    (( cold == 0 )) && break
    sleep 1
  done
  for id in "${TORCH_IDS[@]}"; do
    pid=${TORCH_PID[$id]}
    if [[ ! -e "$OUT/torch/$id.ready" ]]; then
      log "PyTorch $id: not measured ($(kill -0 "$pid" 2>/dev/null && echo 'still warming up at the time limit' || echo "failed: $(tail -1 "$OUT/torch/$id.log")"))"
      kill "$pid" 2>/dev/null
    fi
  done
  for id in "${TORCH_IDS[@]}"; do
    pid=${TORCH_PID[$id]}
    [[ -e "$OUT/torch/$id.ready" ]] || continue
    (( $(left) > after )) || { log "PyTorch $id: not timed (time limit)"; kill "$pid" 2>/dev/null; continue; }
    touch "$OUT/torch/$id.go"
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill "$pid" 2>/dev/null
    if [[ -s "$OUT/torch/$id.json" ]]; then
      log "PyTorch $id: $("$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["impl"], "median_ms=%.4f" % r["median_ms"], "images_per_s=%.0f" % r["images_per_s"])' "$OUT/torch/$id.json" 2>/dev/null || cut -c1-200 "$OUT/torch/$id.json")"
    else
      log "PyTorch $id: no result ($(tail -1 "$OUT/torch/$id.log"))"
    fi
  done
fi
for pid in "${TORCH_PID[@]}"; do kill "$pid" 2>/dev/null; done
wait 2>/dev/null

# --- 5a. fusedp, the most important first: issue 17's figures (LeNet and the CIFAR-10 CNN at batch 128
# on the WMMA and the tensor-core layers, TF32 and BF16, then their kernels under ncu), then the other
# configurations, then the ablations; each while time is left, so a call cut short still has the first.
# One train step configuration: $1 the binary, $2 net, $3 batch, the rest train_step_gpu's arguments
# (the RESULT line's impl names the build and variant). Appends to fusedp.txt as it goes.
step_run() {
  local bin=$1 net=$2 batch=$3
  shift 3
  [[ -x "$bin" ]] || return 0
  (( $(left) > 25 )) || { log "$(basename "$bin") $net $batch $*: not run (time limit)"; return 0; }
  timeout "$(clamp $(( $(left) - 20 )) 10 45)" "$bin" --net "$net" --batch "$batch" --steps 100 --warmup 10 "$@" |
    tee -a "$OUT/fusedp.txt"
}
: > "$OUT/fusedp.txt"
OTHER_CONFIGS=(mlp64:16384 mlp64:262144 mlp128:16384 mlp128:262144 resnet18:256)
if [[ -x "$OUT/train_step_gpu" || -x "$OUT/train_step_gpu_mma" ]]; then
  log "fusedp train steps: LeNet and the CIFAR-10 CNN, WMMA and tensor-core layers, TF32 and BF16"
  for net in lenet cifar; do
    step_run "$OUT/train_step_gpu" "$net" 128
    FUSEDP_CUDA_GEMM=mma step_run "$OUT/train_step_gpu_mma" "$net" 128
    FUSEDP_CUDA_GEMM=mma step_run "$OUT/train_step_gpu_mma" "$net" 128 --precision bf16
  done
fi
# Where LeNet's and the CIFAR-10 CNN's steps go: each kernel's time and DRAM bytes under Nsight Compute
# (it runs the kernels one at a time; the card's clocks and the L2 are left as they are), their sums
# against the step's median above (the rest is time between kernels) and against the fused minimum
# traffic that train_step_gpu prints (floor_mb, from the type: net/cost.hpp's step_traffic_floor, the
# arithmetic of benchmarks/RESULTS.md's session 21): LeNet 7.5 MB, the CIFAR-10 CNN 331.2 MB per step of
# 128 in TF32, 289.5 MB in BF16 with its 16-bit activations.
NCU=$(command -v ncu || ls "$(dirname "$NVCC")/ncu" 2>/dev/null || true)
ncu_ok=1
# The value of `key` $3 in the first RESULT line of fusedp.txt for impl $1 and net $2 at batch $4 (128).
result_field() {
  sed -n "s/^RESULT impl=$1 net=$2 batch=${4:-128} .*$3=\([0-9.]*\).*/\1/p" "$OUT/fusedp.txt" | head -1
}
# One step of $4 (a train_step_gpu binary, then its arguments) under ncu into ncu_$1.csv, and its kernels
# against the step's median and floor of impl $2, net $3 (kernel_times.py labels it $1). An ncu that may
# not read the counters (ERR_NVGPUCTRPERM) is said once and not run again.
ncu_step() {
  local name=$1 impl=$2 net=$3
  shift 3
  [[ -n "$NCU" && -x "$1" ]] && (( ncu_ok )) && (( $(left) > ${NCU_TIMEOUT:-45} + 25 )) || return 0
  log "kernel times and DRAM bytes of one $name step (ncu)"
  timeout "${NCU_TIMEOUT:-45}" "$NCU" --clock-control none --cache-control none --csv --page raw --print-units base \
    --print-kernel-base function \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$@" ${NCU_STEPS:---steps 3 --warmup 2} --no-queued > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
  if grep -qE "ERR_NVGPUCTRPERM|==ERROR==" "$OUT/ncu_$name.csv" "$OUT/ncu_$name.err" 2>/dev/null; then
    log "ncu could not profile: $(grep -hE "ERR_NVGPUCTRPERM|==ERROR==" "$OUT/ncu_$name.csv" "$OUT/ncu_$name.err" | head -2 | tr '\n' ' ')"
    log "no further ncu runs"
    ncu_ok=0
    return 0
  fi
  local floor step_ms
  floor=$(result_field "$impl" "$net" floor_mb "${NCU_BATCH:-128}")
  step_ms=$(result_field "$impl" "$net" median_ms "${NCU_BATCH:-128}")
  "$PY" "$ROOT/benchmarks/gpu/kernel_times.py" "$OUT/ncu_$name.csv" --net "$name" ${floor:+--floor-mb "$floor"} \
    ${step_ms:+--step-ms "$step_ms"} ${KERNEL_TOP:+--top "$KERNEL_TOP"} | tee -a "$OUT/kernel_times.txt" || tail -3 "$OUT/ncu_$name.err"
}
ncu_step lenet fusedp lenet "$OUT/train_step_gpu" --net lenet --batch 128
ncu_step cifar fusedp cifar "$OUT/train_step_gpu" --net cifar --batch 128
FUSEDP_CUDA_GEMM=mma ncu_step cifar-bf16 fusedp-mma-bf16 cifar "$OUT/train_step_gpu_mma" --net cifar --batch 128 --precision bf16
# The other configurations on both builds.
log "fusedp train steps: the MLPs and ResNet-18"
for cfg in "${OTHER_CONFIGS[@]}"; do
  step_run "$OUT/train_step_gpu" "${cfg%%:*}" "${cfg##*:}"
  FUSEDP_CUDA_GEMM=mma step_run "$OUT/train_step_gpu_mma" "${cfg%%:*}" "${cfg##*:}"
done
# ResNet-18 in BF16 (its BatchNorm and block tensors in 16 bits, session 35; never run before).
FUSEDP_CUDA_GEMM=mma step_run "$OUT/train_step_gpu_mma" resnet18 256 --precision bf16
# The ablations: LeNet and the CIFAR-10 CNN once more with one of fusedp's defaults off (the RESULT
# line's impl names the variant): what each piece of issue 17 gives, in the same run.
variant_steps() {
  local what=$1 bin=$2
  shift 2
  [[ -x "$bin" ]] && (( $(left) > 65 )) || return 0
  log "fusedp train steps $what"
  for net in lenet cifar; do step_run "$bin" "$net" 128 "$@"; done
}
# Without the fused gradient boundaries (impl=fusedp-unfused; prebuilt only).
variant_steps "without the fused gradient boundaries" "$OUT/train_step_gpu_unfused"
# The CIFAR-10 CNN in BF16 with every stage output in fp32 elements (impl=fusedp-mma-wide-bf16;
# prebuilt only): what storing them in 16 bits gives.
if [[ -x "$OUT/train_step_gpu_wide" ]]; then
  FUSEDP_CUDA_GEMM=mma step_run "$OUT/train_step_gpu_wide" cifar 128 --precision bf16
fi
# The optimizer as a separate pass (impl=fusedp-separate-update), not in the weight-gradient GEMMs.
variant_steps "with the optimizer as a separate pass" "$OUT/train_step_gpu" --separate-update
# Every kernel launched the plain way (impl=fusedp-no-pdl), without programmatic dependent launch.
variant_steps "without programmatic dependent launch" "$OUT/train_step_gpu" --no-dependent-launch
# Each weight gradient after its layer's input gradient on one stream (impl=fusedp-serial), not beside
# the next layer's backward.
variant_steps "with backward in order on one stream" "$OUT/train_step_gpu" --serial-backward
# Who adds up the parts of split-K GEMMs. By default the GEMM's last block per tile where its chain of
# round trips to L2 is at most 8, else a second kernel (none of LeNet's or the CIFAR-10 CNN's is that short);
# here every split by a second kernel (impl=fusedp-split-kernel), then every split by the GEMM's last
# block, whatever its size (impl=fusedp-split-gemm: the rule before session 30). The variable reaches
# train_step_gpu through the functions.
FUSEDP_CUDA_SPLIT_REDUCTION=kernel variant_steps "with split-K parts added up by a second kernel" "$OUT/train_step_gpu"
FUSEDP_CUDA_SPLIT_REDUCTION=gemm variant_steps "with split-K parts always added up by the GEMM's last block" "$OUT/train_step_gpu"

# The tensor-core mainloop against the WMMA one, per GEMM problem of the seed networks (issue 14), and
# compute-sanitizer on its test where the toolkit has it.
if [[ -x "$OUT/gemm_gpu" ]] && (( $(left) > 40 )); then
  log "GEMM kernels: mma.sync mainloop vs WMMA"
  timeout 60 "$OUT/gemm_gpu" | tee "$OUT/gemm.txt" | grep -v "^GEMM\|^HELD"
fi
GEMM_TEST=""
[[ -n "$PREBUILT" && -x "$PREBUILT/test_gpu_gemm_mma" ]] && GEMM_TEST=$PREBUILT/test_gpu_gemm_mma
[[ -z "$GEMM_TEST" && -x "$OUT/build/tests/test_gpu_gemm_mma" ]] && GEMM_TEST=$OUT/build/tests/test_gpu_gemm_mma
SANITIZER=$(command -v compute-sanitizer || echo "$(dirname "$NVCC")/compute-sanitizer")
if [[ -n "$GEMM_TEST" && -x "$SANITIZER" ]]; then
  # On the small cases, every tile and operand layout (memcheck on all of them may not fit its 90 s: a
  # review's estimate, not measured); racecheck is far slower still.
  for tool in memcheck racecheck; do
    (( $(left) > 100 )) || { log "compute-sanitizer $tool: not run (time limit)"; continue; }
    filter=(--test-case="gemm_mma: every tile*")
    log "compute-sanitizer --tool $tool on test_gpu_gemm_mma ${filter[*]}"
    timeout 90 "$SANITIZER" --tool "$tool" --error-exitcode 9 "$GEMM_TEST" "${filter[@]}" 2>&1 | tail -3
    log "compute-sanitizer $tool exit: ${PIPESTATUS[0]} (0: clean; 9: errors found; 124: timed out)"
  done
fi

# ResNet-18's kernels in BF16, after issue 17's figures while time is left: BatchNorm's split passes
# (session 37: two kernels over 32 blocks a channel at layer1, where one block a channel ran before;
# never measured) beside the convolutions. Some 200 launches a step: three steps (ncu writes its CSV
# only at the end, so a run cut by the timeout leaves nothing), the 15 kernel functions with the most
# time, a minute at most.
FUSEDP_CUDA_GEMM=mma NCU_TIMEOUT=60 NCU_STEPS="--steps 2 --warmup 1" NCU_BATCH=256 KERNEL_TOP=15 \
  ncu_step resnet18-bf16 fusedp-mma-bf16 resnet18 "$OUT/train_step_gpu_mma" --net resnet18 --batch 256 --precision bf16

# The table so far (again at the end): a call cut short after this point still has it.
"$PY" "$ROOT/benchmarks/gpu/report.py" --fusedp "$OUT/fusedp.txt" --torch-dir "$OUT/torch" --header "$OUT/header.txt" \
  --markdown "$OUT/results.md" > "$OUT/results.txt" 2>&1 || true

# --- 5b. all-reduce bandwidth of the bucket plans, and the examples on the GPU (prebuilt only), each
# while time is left ------------------------------------------------------------------------------------
if [[ -n "$PREBUILT" && -x "$PREBUILT/allreduce_bench" ]] && (( $(left) > 70 )); then
  log "allreduce_bench"
  timeout 60 "$PREBUILT/allreduce_bench" --reps 50 --warmup 10 2>&1 | tee "$OUT/allreduce.txt" | grep -E "RESULT|note" | cut -c1-160
fi
# Runs an example while time is left: $1 its time limit, then the command.
example() {
  local limit=$1
  shift
  (( $(left) > limit + 10 )) || { log "example $(basename "$1") $2: not run (time limit)"; return 0; }
  timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v "ETA"
}
# The examples' _cuda programs (nvcc's builds; prebuild.sh carries only those, which run --device cuda on
# their own).
if [[ -n "$PREBUILT" && -x "$PREBUILT/lenet_mnist_cuda" ]] && (( $(left) > 60 )); then
  EX_DATA=()
  [[ -n "${FUSEDP_FASHION_MNIST_DIR:-}" ]] && EX_DATA=(--data "$FUSEDP_FASHION_MNIST_DIR")
  log "examples on the GPU"
  rm -rf "$OUT/ckpt"
  example 60 "$PREBUILT/lenet_mnist_cuda" --device cuda --epochs 2 --checkpoint "$OUT/ckpt" "${EX_DATA[@]}" | grep -v "^epoch" | tail -4
  example 40 "$PREBUILT/lenet_mnist_cuda" --device cuda --epochs 3 --resume "$OUT/ckpt" "${EX_DATA[@]}" | tail -3
  example 40 "$PREBUILT/lenet_mnist_cuda" --device cuda --replicas 2 --epochs 1 "${EX_DATA[@]}" | tail -2  # one GPU: a clear error
  # A trace of one GPU epoch (event-timed spans: docs/TRACING.md), its step split and timeline PNG.
  example 40 "$PREBUILT/lenet_mnist_cuda" --device cuda --epochs 1 --trace "$OUT/trace_lenet_gpu.json" "${EX_DATA[@]}" | grep -E "^trace|^done"
  [[ -s "$OUT/trace_lenet_gpu.json" ]] && (( $(left) > 25 )) &&
    timeout 20 "$PY" "$ROOT/scripts/trace_report.py" "$OUT/trace_lenet_gpu.json" --png "$OUT/trace_lenet_gpu.png" 2>&1 | tail -5
  example 60 "$PREBUILT/cifar10_cnn_cuda" --device cuda --synthetic 8192 --epochs 2 --batch 128 | tail -3
  example 40 "$PREBUILT/mlp_fit_cuda" --device cuda --epochs 5 | tail -2
  [[ -x "$PREBUILT/resnet18_cifar_cuda" ]] && example 60 "$PREBUILT/resnet18_cifar_cuda" --device cuda --synthetic 4096 --epochs 2 --batch 256 | tail -3
fi

# --- 6. the table -------------------------------------------------------------------------------------
echo
"$PY" "$ROOT/benchmarks/gpu/report.py" --fusedp "$OUT/fusedp.txt" --torch-dir "$OUT/torch" --header "$OUT/header.txt" \
  --markdown "$OUT/results.md" || python3 "$ROOT/benchmarks/gpu/report.py" --fusedp "$OUT/fusedp.txt" \
  --torch-dir "$OUT/torch" --header "$OUT/header.txt" --markdown "$OUT/results.md"
if [[ $TEST_MODE == none ]]; then verdict="NOT BUILT OR RUN"
elif (( status != 0 )); then verdict="FAILED (see above)"
elif (( skipped )); then verdict="passed, but their GPU parts SKIPPED (no usable device)"
else verdict="all passed"; fi
echo "gpu tests: $verdict; total $(elapsed)s; table also in $OUT/results.md"
(( status == 0 && skipped )) && status=3
exit $status
