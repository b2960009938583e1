#!/usr/bin/env bash
# Builds the cpu tests that run memory-unsafe code (raw buffers, file readers, index arithmetic)
# with AddressSanitizer and UndefinedBehaviorSanitizer and runs them; any report fails the run
# (-fno-sanitize-recover=all, and leaks are reports too). Kept to what finishes in about 5 minutes
# on 2 cores: the readers, loaders and checkpoints (tests/data, tests/train), every layer's gradient
# check (tests/layers/gradients_*, which drive the Host kernels), the model and its plan (tests/net)
# and in-process replicas (tests/parallel). The full suite stays the job of the ordinary build.
#
# Left out by default: test_train_fashion_mnist, an epoch of LeNet training (two minutes at -O1
# under the sanitizers) that runs no code the tests above do not; and the Host kernels' own tests
# (tests/kernels/host: every GEMM shape and layout, conv2d, pooling), which FUSEDP_SANITIZE_KERNELS=1
# adds for about 3 more minutes on 2 busy cores, mostly the GEMM and conv2d shape sweeps.
#
#   tests/sanitize/run.sh [REGEX]      only the tests whose names match REGEX
#
# Environment: FUSEDP_SANITIZE_CXX    the compiler (default g++; clang++ >= 18 works too)
#              FUSEDP_SANITIZE_OPT    optimization (default -O0, see below; -O1 is the usual choice)
#              FUSEDP_SANITIZE_KERNELS=1  also tests/kernels/host
#              FUSEDP_SANITIZE_BUILD  build folder (default build/sanitize)
#              FUSEDP_SANITIZE_JOBS   parallel compiles and tests (default: the number of cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
build=${FUSEDP_SANITIZE_BUILD:-$root/build/sanitize}
cxx=${FUSEDP_SANITIZE_CXX:-g++}
parallel=${FUSEDP_SANITIZE_JOBS:-$(nproc)}
narrow=${1:-}

# The tests, by the name tests/CMakeLists.txt gives them: tests/<dir>/<name>.cpp -> test_<dir>_<name>.
skip="test_train_fashion_mnist"
tests=()
sources=(tests/data/*.cpp tests/train/*.cpp tests/layers/gradients_*.cpp tests/net/*.cpp tests/parallel/*.cpp)
[[ "${FUSEDP_SANITIZE_KERNELS:-0}" == 1 ]] && sources+=(tests/kernels/host/*.cpp)
for f in "${sources[@]}"; do
  [[ -f "$f" ]] || continue
  stem=${f#tests/}
  stem=${stem%.cpp}
  name="test_${stem//\//_}"
  [[ " $skip " == *" $name "* ]] || tests+=("$name")
done
if [[ -n "$narrow" ]]; then
  kept=()
  for t in "${tests[@]}"; do [[ "$t" =~ $narrow ]] && kept+=("$t"); done
  tests=("${kept[@]}")
fi
((${#tests[@]})) || { echo "sanitize: no tests match" >&2; exit 1; }

# -O0 finds what -O1 finds (ASan instruments every access, more of them unoptimized; UBSan's checks
# come from the front end) and halves the build, which is most of the time: on 2 busy cores, 3m37 of
# CPU at -O0 against 6m33 at -O1, the tests taking 34 s against 12 s. -g1 (line tables): reports
# still name file and line, a quarter less build time than -g.
flags="${FUSEDP_SANITIZE_OPT:--O0} -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"
t0=$SECONDS
mkdir -p "$build"
# Debug: no -DNDEBUG, so assertions run too; its flags are replaced by the ones above.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_CXX_FLAGS_DEBUG="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DFUSEDP_ENABLE_CUDA=OFF -DFUSEDP_ENABLE_MPI=OFF -DFUSEDP_NATIVE=OFF -DFUSEDP_INSTALL=OFF \
  -DFUSEDP_BUILD_EXAMPLES=OFF -DFUSEDP_BUILD_BENCHMARKS=OFF -DFUSEDP_TEST_CONSUMERS=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log" >&2; exit 1; }
echo "sanitize: building ${#tests[@]} tests with $cxx ($flags)"
cmake --build "$build" -j "$parallel" --target "${tests[@]}"
t1=$SECONDS

regex="^($(IFS='|'; echo "${tests[*]}"))\$"
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$build" -R "$regex" -j "$parallel" --output-on-failure --no-tests=error
echo "sanitize: built in $((t1 - t0)) s, tested in $((SECONDS - t1)) s"
