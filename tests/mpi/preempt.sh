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

name=preempt.sh
. "$(dirname "$0")/lib.sh"
enter_work "$work"

# $1: output file; $2: metrics lines to wait for; $3: signal; $4: who gets it (self, rank1, launcher);
# the rest: extra flags.
run_and_signal() {
  out=$1
  lines=$2
  sig=$3
  whom=$4
  shift 4
  # shellcheck disable=SC2086
  signal_when_written "$out" "$lines" "$sig" "$whom" $launcher "$program" $flags "$@"
  if [ -z "$launcher" ]; then
    [ "$status" -eq 75 ] || fail "exit status $status after $sig, expected 75 (see $work/$out)"
  else
    [ "$status" -ne 0 ] || fail "mpirun exited 0 after $sig (see $work/$out)"
  fi
  grep -q '^stopped by .* after step [0-9]* (epoch [0-9]*, sample [0-9,]* of 65,536); saved to checkpoint' "$out" ||
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
grep -q '^resumed from checkpoint: .* (epoch [0-9]* goes on at sample [0-9,]* of 65,536)' last.txt ||
  fail "the last run did not resume inside an epoch (see $work/last.txt)"

same_as_reference 6
echo "stopped twice by signals and resumed inside the epoch: weights, training state and 6 epochs of metrics" \
  "equal to the uninterrupted run's ($(($(date +%s) - start)) s)"
