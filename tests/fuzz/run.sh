#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (AddressSanitizer + UndefinedBehaviorSanitizer)
# and fuzzes each for a bounded time. Fails when any target finds an input that crashes, reads out of
# bounds, hangs (-timeout), allocates too much (-malloc_limit_mb, -rss_limit_mb), throws anything but
# a fusedp::DataError naming the file, or breaks a postcondition the target checks.
#
#   tests/fuzz/run.sh [SECONDS] [TARGET...]
#
#   SECONDS   fuzzing time per target (default 45); 0 only replays the corpora (regression run)
#   TARGET    idx cifar safetensors checkpoint (default: all)
#
# Environment: FUSEDP_FUZZ_CXX   clang++ with libFuzzer, version >= 18 (fusedp's layers take float
#                                template arguments, which clang supports from 18; Debian 12:
#                                apt-get install clang-19 libclang-rt-19-dev)
#              FUSEDP_FUZZ_BUILD build folder (default build/fuzz)
#              FUSEDP_FUZZ_JOBS  targets fuzzed at the same time (default: the number of cores)
#
# Corpora: the seeds come from make_corpus.cpp (regenerated every run); what the fuzzer learns is kept
# in $FUSEDP_FUZZ_BUILD/corpus/<target>; inputs that once failed are checked in under
# tests/fuzz/corpus/<target>/ and replayed on every run. A failing input is saved as
# $FUSEDP_FUZZ_BUILD/artifacts/<target>-crash-<sha1> (or -timeout-, -oom-, -leak-); reproduce with
# $FUSEDP_FUZZ_BUILD/fuzz_<target> <that file>.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

seconds=${1:-45}
shift $(($# > 0 ? 1 : 0)) || true
all_targets=(idx cifar safetensors checkpoint)
targets=("$@")
((${#targets[@]})) || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "fuzz: unknown target '$t' (known: ${all_targets[*]})" >&2; exit 2; }
done

build=${FUSEDP_FUZZ_BUILD:-$root/build/fuzz}
parallel=${FUSEDP_FUZZ_JOBS:-$(nproc)}
mkdir -p "$build/logs" "$build/artifacts"

# --- the compiler --------------------------------------------------------------------------------
cxx=""
for c in "${FUSEDP_FUZZ_CXX:-}" clang++-19 clang++-20 clang++-21 clang++-22 clang++-18 clang++; do
  [[ -n "$c" ]] && command -v "$c" >/dev/null || continue
  major=$("$c" -dumpversion 2>/dev/null | cut -d. -f1)
  if [[ "$major" =~ ^[0-9]+$ ]] && ((major >= 18)); then cxx=$c; break; fi
  [[ -n "${FUSEDP_FUZZ_CXX:-}" && "$c" == "$FUSEDP_FUZZ_CXX" ]] && { echo "fuzz: $c is clang $major; need >= 18" >&2; exit 2; }
done
if [[ -z "$cxx" ]]; then
  echo "fuzz: no clang++ >= 18 found (Debian 12: apt-get install clang-19 libclang-rt-19-dev)" >&2
  exit 2
fi

common=(-std=c++20 -g -I"$root/include" -I"$root/tests/fuzz")
fuzz_flags=(-O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)

# Rebuilds a program when it is missing or older than any header or fuzz source.
stale() {
  [[ ! -x "$1" ]] || [[ -n "$(find "$root/include" "$root/tests/fuzz" -newer "$1" \( -name '*.hpp' -o -name '*.cpp' \) -print -quit)" ]]
}

echo "fuzz: building with $cxx ($("$cxx" -dumpversion)) into $build"
t0=$SECONDS
pids=()
if stale "$build/make_corpus"; then
  "$cxx" "${common[@]}" -O0 tests/fuzz/make_corpus.cpp -lz -o "$build/make_corpus" &
  pids+=($!)
fi
for t in "${targets[@]}"; do
  if stale "$build/fuzz_$t"; then
    while (($(jobs -rp | wc -l) >= parallel)); do sleep 1; done
    "$cxx" "${common[@]}" "${fuzz_flags[@]}" "tests/fuzz/$t.cpp" -lz -o "$build/fuzz_$t" &
    pids+=($!)
  fi
done
build_failed=0
for p in "${pids[@]}"; do wait "$p" || build_failed=1; done
((build_failed == 0)) || { echo "fuzz: build failed" >&2; exit 1; }
echo "fuzz: built in $((SECONDS - t0)) s"

rm -rf "$build/seeds"
"$build/make_corpus" "$build/seeds"

# --- fuzzing -------------------------------------------------------------------------------------
# Limits per target. -malloc_limit_mb: no single allocation may exceed 128 MiB for inputs of a few
# KiB; the largest the readers make on purpose is read_idx's 64 MiB reserve before data arrives.
declare -A max_len=([idx]=4096 [cifar]=6400 [safetensors]=4096 [checkpoint]=8192)
declare -A dict=([safetensors]=safetensors.dict [checkpoint]=safetensors.dict)

# Symbolized reports: the symbolizer of the compiler's own LLVM when there is one (the unversioned
# name on Debian may belong to another LLVM, and the sanitizer runtime does not find it alone).
if [[ -z "${ASAN_SYMBOLIZER_PATH:-}" ]]; then
  for s in "$(dirname "$(readlink -f "$(command -v "$cxx")")")/llvm-symbolizer" \
           "$(command -v "llvm-symbolizer-$major" || true)" /usr/lib/llvm-*/bin/llvm-symbolizer \
           "$(command -v llvm-symbolizer || true)"; do
    [[ -n "$s" && -x "$s" ]] && { export ASAN_SYMBOLIZER_PATH=$(readlink -f "$s"); break; }
  done
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# The checkpoint target's folders, removed even when a crash skips the target's own cleanup.
scratch=$(mktemp -d /dev/shm/fusedp-fuzz-run-XXXXXX 2>/dev/null || mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export FUSEDP_FUZZ_SCRATCH=$scratch

fuzz_one() {
  local t=$1 args
  mkdir -p "$build/corpus/$t"
  args=(-timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=128 -max_len="${max_len[$t]}"
        -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-")
  [[ -n "${dict[$t]:-}" ]] && args+=(-dict="$root/tests/fuzz/${dict[$t]}")
  if ((seconds > 0)); then args+=(-max_total_time="$seconds"); else args+=(-runs=0); fi
  local dirs=("$build/corpus/$t" "$build/seeds/$t")
  [[ -d "$root/tests/fuzz/corpus/$t" ]] && dirs+=("$root/tests/fuzz/corpus/$t")
  "$build/fuzz_$t" "${args[@]}" "${dirs[@]}" >"$build/logs/$t.log" 2>&1
}

echo "fuzz: ${targets[*]}, ${seconds} s each, $parallel at a time (logs in $build/logs)"
t0=$SECONDS
declare -A pid_of
for t in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= parallel)); do sleep 1; done
  fuzz_one "$t" &
  pid_of[$t]=$!
done
failed=()
for t in "${targets[@]}"; do
  if wait "${pid_of[$t]}"; then
    stats=$(grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$build/logs/$t.log" | awk '{printf "%s %s  ", $1, $2}')
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "$build/logs/$t.log" | tail -1)
    echo "fuzz: $t ok  ${cov}  ${stats//stat::/}"
  else
    failed+=("$t")
    echo "fuzz: $t FAILED; the end of $build/logs/$t.log:" >&2
    tail -n 60 "$build/logs/$t.log" >&2
  fi
done
echo "fuzz: fuzzed in $((SECONDS - t0)) s"
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]} (inputs in $build/artifacts/; add each to tests/fuzz/corpus/<target>/ once fixed)" >&2
  exit 1
fi
