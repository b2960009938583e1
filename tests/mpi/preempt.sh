#!/bin/sh
# Preemption: SIGTERM or SIGUSR1 (what SLURM and Kubernetes send) makes a run stop after the current
# step, every rank after the same one, save a checkpoint, say where it stopped and exit with status 75;
# resumed twice, the run ends with the weights, training state and metrics of a run that was never
# interrupted, bit for bit.
#
#   preempt.sh <work dir> <mlp_fit> [<mpirun> <flags>...]
#
# One process: SIGTERM, then SIGUSR1, to the program. Under mpirun: SIGTERM to rank 1 (not the rank
# that writes), then SIGUSR1 to mpirun (which forwards it to every rank). Each signal comes inside an
# epoch, once the metrics of epoch 2 (then 4) are written. Exits non-zero, saying why, on any difference.
set -u
work=$1
program=$2
shift 2
launcher="$*"

flags="--epochs 6 --samples 65536 --side 16 --batch 64 --lr 0.002 --threads 1 --seed 5"

fail() {
  echo "preempt.sh: FAILED: $*" >&2
  exit 1
}

rm -rf "$work" && mkdir -p "$work" || fail "cannot make $work"
cd "$work" || fail "cannot enter $work"

# The pid of rank $2 among mpirun $1's children.
rank_pid() {
  for child in $(ps -o pid= --ppid "$1"); do
    if tr '\0' '\n' < "/proc/$child/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$child"
      return
    fi
  done
}

# $1: output file; $2: metrics lines to wait for; $3: signal; $4: who gets it (self, rank1, launcher);
# the rest: extra flags.
run_and_signal() {
  out=$1
  lines=$2
  sig=$3
  whom=$4
  shift 4
  # shellcheck disable=SC2086
  $launcher "$program" $flags "$@" > "$out" 2>&1 &
  pid=$!
  tries=0
  while [ "$(cat metrics.jsonl 2>/dev/null | wc -l)" -lt "$lines" ]; do
    kill -0 "$pid" 2>/dev/null || fail "the run ended before epoch $lines was written (see $work/$out)"
    tries=$((tries + 1))
    [ "$tries" -lt 6000 ] || fail "no metrics for epoch $lines after 60 s (see $work/$out)"
    sleep 0.01
  done
  sleep 0.05
  case $whom in
    rank1) target=$(rank_pid "$pid" 1) ;;
    *) target=$pid ;;
  esac
  [ -n "$target" ] || fail "found no process for $whom under $pid"
  kill "-$sig" "$target" || fail "could not send $sig to $target"
  wait "$pid"
  status=$?
  if [ -z "$launcher" ]; then
    [ "$status" -eq 75 ] || fail "exit status $status after $sig, expected 75 (see $work/$out)"
  else
    [ "$status" -ne 0 ] || fail "mpirun exited 0 after $sig (see $work/$out)"
  fi
  grep -q '^stopped by .* after step [0-9]* (epoch [0-9]*, batch [0-9]* of [0-9]*); saved to checkpoint' "$out" ||
    fail "no 'stopped by ... saved to checkpoint' line after $sig to $whom (see $work/$out)"
  grep -q '^done:' "$out" && fail "the run finished before the signal (make it longer)"
  echo "$(grep '^stopped by' "$out")"
}

start=$(date +%s)
# shellcheck disable=SC2086
$launcher "$program" $flags --checkpoint reference --metrics reference.jsonl > reference.txt 2>&1 ||
  fail "the reference run failed (see $work/reference.txt)"
if [ -z "$launcher" ]; then
  first=self
else
  first=rank1
fi
run_and_signal first.txt 2 TERM "$first" --checkpoint checkpoint --metrics metrics.jsonl
run_and_signal second.txt 4 USR1 launcher --checkpoint checkpoint --metrics metrics.jsonl --resume checkpoint
# shellcheck disable=SC2086
$launcher "$program" $flags --checkpoint checkpoint --metrics metrics.jsonl --resume checkpoint > last.txt 2>&1 ||
  fail "the last resume failed (see $work/last.txt)"
grep -q '^resumed from checkpoint: .* (epoch [0-9]* goes on after its batch [0-9]*)' last.txt ||
  fail "the last run did not resume inside an epoch (see $work/last.txt)"

cmp reference/model.safetensors checkpoint/model.safetensors || fail "the weights differ"
cmp reference/training_state.safetensors checkpoint/training_state.safetensors || fail "the training states differ"
strip() {
  sed -e 's/, "samples_per_s": [^,}]*//' -e 's/, "train_gflops": [^,}]*//' -e 's/, "mfu": [^,}]*//' \
      -e 's/, "seconds": [^,}]*//' "$1"
}
strip reference.jsonl > reference.metrics
strip metrics.jsonl > resumed.metrics
[ "$(wc -l < resumed.metrics)" -eq 6 ] || fail "$(wc -l < resumed.metrics) metrics lines, expected 6"
cmp reference.metrics resumed.metrics || fail "the metrics differ: $(diff reference.metrics resumed.metrics)"
echo "stopped twice by signals and resumed inside the epoch: weights, training state and 6 epochs of metrics" \
  "equal to the uninterrupted run's ($(($(date +%s) - start)) s)"
