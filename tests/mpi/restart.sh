#!/bin/sh
# Kill and restart: a training run killed twice with SIGKILL and each time resumed from its last
# checkpoint ends with the same weights, training state and metrics, bit for bit, as a run that
# was never interrupted.
#
#   restart.sh <work dir> <mlp_fit> [<mpirun> <flags>...]
#
# With an mpirun command line the runs are under mpirun and the process killed is rank 0 (the one
# that writes checkpoints and metrics; mpirun then ends the other ranks); without one, the single
# process is killed. The first kill comes as soon as the metrics of epoch 2 are written, while rank
# 0 saves the checkpoint of epoch 2 (which may be cut short) or begins epoch 3; the second 0.1 s
# after those of epoch 3, while it trains (3 epochs before the end: a margin for a busy machine).
# Exits non-zero, saying why, on any difference.
set -u
work=$1
program=$2
shift 2
launcher="$*"  # empty: one process

flags="--epochs 6 --samples 65536 --side 16 --batch 64 --lr 0.002 --threads 1 --seed 5"

name=restart.sh
. "$(dirname "$0")/lib.sh"
enter_work "$work"

# $1: output file; the rest: extra flags. Runs in the foreground.
run() {
  out=$1
  shift
  # shellcheck disable=SC2086
  $launcher "$program" $flags "$@" > "$out" 2>&1
}

# The pid of the process to kill: the program itself, or rank 0 among mpirun's children.
victim() {
  if [ -z "$launcher" ]; then
    echo "$1"
  else
    rank_pid "$1" 0
  fi
}

# $1: output file; $2: metrics lines to wait for; $3: seconds to wait after them; the rest: extra
# flags. Starts the run, kills it, and checks that it was killed before it finished.
run_and_kill() {
  out=$1
  lines=$2
  delay=$3
  shift 3
  # shellcheck disable=SC2086
  $launcher "$program" $flags "$@" > "$out" 2>&1 &
  pid=$!
  wait_for_metrics "$pid" "$lines" "$out"
  sleep "$delay"
  target=$(victim "$pid")
  [ -n "$target" ] || fail "found no process to kill under $pid"
  kill -KILL "$target" || fail "could not kill $target"
  tries=0
  while kill -0 "$pid" 2>/dev/null; do  # mpirun ends the other ranks
    tries=$((tries + 1))
    if [ "$tries" -ge 3000 ]; then
      kill -KILL "$pid"
      fail "the run did not end within 30 s of the kill"
    fi
    sleep 0.01
  done
  wait "$pid" && fail "the killed run exited 0"
  grep -q '^done:' "$out" && fail "the run finished before it was killed (make it longer)"
  echo "killed $delay s after the metrics of epoch $lines were written"
}

start=$(date +%s)
run reference.txt --checkpoint reference --metrics reference.jsonl || fail "the reference run failed (see $work/reference.txt)"
run_and_kill first.txt 2 0 --checkpoint checkpoint --metrics metrics.jsonl
run_and_kill second.txt 3 0.1 --checkpoint checkpoint --metrics metrics.jsonl --resume checkpoint
run last.txt --checkpoint checkpoint --metrics metrics.jsonl --resume checkpoint || fail "the last resume failed (see $work/last.txt)"
grep -q '^resumed from checkpoint' last.txt || fail "the last run did not resume (see $work/last.txt)"

same_as_reference 6
echo "killed twice and resumed: weights, training state and 6 epochs of metrics equal to the uninterrupted run's" \
  "($(($(date +%s) - start)) s)"
