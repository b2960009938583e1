#!/usr/bin/env bash
# benchmarks/gpu/device_call.sh: the whole GPU check as one call of a lent GPU machine that has no
# network and takes at most 64 MiB of files along (this workplace's device tool). Prepare here, on a
# machine without a GPU:
#
#   benchmarks/gpu/prebuild.sh 90                      # ~25 min on 2 cores; writes build/gpu-carry/prebuilt-sm90.tar.xz
#   mkdir -p build/gpu-carry/fmnist && for f in /usr/share/datasets/fashion-mnist/*.gz; do
#     zcat "$f" | xz -9 -T2 > "build/gpu-carry/fmnist/$(basename "${f%.gz}").xz"; done
#                                                      # real data for the examples and the training test:
#                                                      # 27 MB in xz where the .gz files take 31
#
# (2026-12-07, session 37 at 854a4e025d60: archive 12.3 MB, build/gpu-carry 38.8 MB with Fashion-MNIST.
# Session 36: archive 12.2 MB + Fashion-MNIST 26.5 MB + the tree 3.3 MB = 42.1 MB of the
# 64 MiB = 67.1 MB, since prebuild.sh builds the device code uncompressed and packs one xz block over the
# whole tar (37.4 MB before); prebuild.sh prints the folder's and the tree's size. Check
# `du -sb build/gpu-carry` before the call.)
#
# then run there, in the repository root, carrying build/gpu-carry:
#
#   FUSEDP_COMMIT=<commit> bash benchmarks/gpu/device_call.sh
#
# It puts the NCCL of PyTorch's wheel on LD_LIBRARY_PATH, prints the card's state, runs check.sh on the
# prebuilt archive within FUSEDP_CHECK_BUDGET seconds (default 490: give the call a limit of ~580), and
# leaves in $OUT (the folder that comes back; ./gpu-check-out where $OUT is unset) the log, the table,
# fusedp's and the GEMM lines, the trace picture and one archive of every other log and PyTorch result.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
DEST=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$DEST"
CARRY=${FUSEDP_CARRY_DIR:-$ROOT/build/gpu-carry}
ARCHIVE=$(ls "$CARRY"/prebuilt-sm*.tar.xz 2>/dev/null | head -1)
[[ -n "$ARCHIVE" ]] || { echo "device_call: no $CARRY/prebuilt-sm*.tar.xz (run benchmarks/gpu/prebuild.sh here first)"; exit 2; }
# NCCL (test_gpu_nccl, test_gpu_guard, allreduce_bench and the examples link libnccl.so.2): the one in
# PyTorch's wheel, found by its module or, failing that, by its file under site-packages.
NCCL_LIB=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" 2>/dev/null)
if [[ -z "$NCCL_LIB" || ! -e "$NCCL_LIB/libnccl.so.2" ]]; then
  NCCL_SO=$(python3 -c 'import site, glob; print(next(iter(sorted(f for d in site.getsitepackages() + [site.getusersitepackages()] for f in glob.glob(d + "/nvidia/*/lib/libnccl.so.2"))), ""))' 2>/dev/null)
  NCCL_LIB=${NCCL_SO:+$(dirname "$NCCL_SO")}
fi
[[ -n "$NCCL_LIB" ]] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi --query-gpu=name,compute_mode,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used --format=csv
  echo "tools: ncu=$(command -v ncu || echo none) compute-sanitizer=$(command -v compute-sanitizer || echo none)"
  echo "NCCL: ${NCCL_LIB:-not found (the NCCL tests and the examples will fail to load)}"
} | tee "$DEST/machine.txt"
WORK=${FUSEDP_CHECK_DIR:-/tmp/fusedp-gpu-check}
# Fashion-MNIST: IDX files in xz (unpacked beside the work folder by python3's lzma, so the machine
# needs no xz; the readers take plain or .gz files), or the .gz files themselves. A failed unpacking
# leaves the data out (the training test then uses its synthetic set, and says so).
DATA=()
if ls "$CARRY"/fmnist/*-ubyte.xz >/dev/null 2>&1; then
  FMNIST="$WORK-fmnist"
  rm -rf "$FMNIST" && mkdir -p "$FMNIST"
  unpacked=1
  for f in "$CARRY"/fmnist/*-ubyte.xz; do
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$f" "$FMNIST/$(basename "${f%.xz}")" || unpacked=0
  done
  if (( unpacked )); then DATA=(FUSEDP_FASHION_MNIST_DIR="$FMNIST"); else echo "device_call: could not unpack Fashion-MNIST"; rm -rf "$FMNIST"; fi
elif [[ -f "$CARRY/fmnist/t10k-images-idx3-ubyte.gz" ]]; then
  DATA=(FUSEDP_FASHION_MNIST_DIR="$CARRY/fmnist")
fi
# check.sh keeps to its budget; the outer limit stops it where a step overran, so that what it has
# written so far is still copied below before the call's own limit ends everything.
timeout -k 10 "${FUSEDP_CHECK_LIMIT:-540}" env "${DATA[@]}" FUSEDP_PREBUILT_DIR="$ARCHIVE" FUSEDP_CHECK_DIR="$WORK" \
  FUSEDP_CHECK_BUDGET="${FUSEDP_CHECK_BUDGET:-490}" bash benchmarks/gpu/check.sh > "$DEST/check.log" 2>&1
rc=$?
(( rc == 124 || rc == 137 )) && echo "check.sh stopped at the outer limit (${FUSEDP_CHECK_LIMIT:-540} s)" >> "$DEST/check.log"
echo "check.sh exit status $rc" >> "$DEST/check.log"
cp "$WORK"/results.md "$WORK"/results.txt "$WORK"/fusedp.txt "$WORK"/gemm.txt "$WORK"/kernel_times.txt "$WORK"/*.png \
  "$DEST"/ 2>/dev/null
tar -C "$WORK" -czf "$DEST/logs.tgz" --exclude=prebuilt --exclude='train_step_gpu*' \
  --exclude=gemm_gpu --exclude='*.png' . 2>/dev/null
tail -c 9000 "$DEST/check.log"
exit $rc
