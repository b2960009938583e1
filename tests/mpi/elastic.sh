#!/bin/sh
# Elastic resume in the examples: a run of 2 ranks stopped inside an epoch (SIGUSR1 to mpirun)
# resumes at 3 ranks from the sample where it stopped and says so; stopped again inside an epoch, it
# resumes as one process and trains to the end. The sampler's part (each remaining sample visited
# once at any world size) is tested in tests/data/sampler.cpp.
#
#   elastic.sh <work dir> <mlp_fit> <mpirun> <its rank-count flag> <a count, ignored> <flags>...
set -u
work=$1
program=$2
mpirun=$3
np=$4
shift 5
options="$*"  # mpirun's own
flags="--samples 32768 --side 16 --batch 64 --lr 0.002 --threads 1 --seed 5 --epochs 6"
flags="$flags --checkpoint checkpoint --metrics metrics.jsonl"

name=elastic.sh
. "$(dirname "$0")/lib.sh"
enter_work "$work"

# $1: output file; $2: metrics lines to wait for; the rest: the command. Starts it, sends SIGUSR1 to
# it once metrics.jsonl holds $2 lines, and prints the sample where it stopped.
run_and_stop() {
  out=$1
  lines=$2
  shift 2
  signal_when_written "$out" "$lines" USR1 self "$@"
  [ "$status" -ne 0 ] || fail "the run exited 0 after SIGUSR1 (see $PWD/$out)"
  grep '^done:' "$out" > /dev/null && fail "the run finished before the signal (make it longer)"
  line=$(grep '^stopped by SIGUSR1 after step' "$out") || fail "no 'stopped by SIGUSR1' line (see $PWD/$out)"
  echo "$line" | sed -n 's/.*(epoch \([0-9]*\), sample \([0-9,]*\) of 32,768).*/\1 \2/p'
}

# shellcheck disable=SC2086
at=$(run_and_stop two.txt 1 "$mpirun" "$np" 2 $options "$program" $flags) || exit 1
epoch=${at% *}
sample=${at#* }
[ -n "$at" ] || fail "the 2-rank run did not say where it stopped (see $work/two.txt)"
# Stopped once more one epoch later: the 2-rank run may have stopped in a later epoch than the first
# (on a fast machine an epoch takes less than the 0.05 s before the signal), so count from the lines
# already written, never signal a run before it has trained.
lines=$(($(wc -l < metrics.jsonl) + 1))
# shellcheck disable=SC2086
at=$(run_and_stop three.txt "$lines" "$mpirun" "$np" 3 $options "$program" $flags --resume checkpoint) || exit 1
grep -q "^resumed at 3 process(es) from a 2-process checkpoint: epoch $epoch, sample $sample of 32,768\$" three.txt ||
  fail "no 'resumed at 3 process(es) from a 2-process checkpoint: epoch $epoch, sample $sample' (see $work/three.txt)"
grep -q "goes on at sample $sample of 32,768)" three.txt || fail "the 3-rank run did not go on at sample $sample"
[ -n "$at" ] || fail "the 3-rank run did not say where it stopped (see $work/three.txt)"
epoch3=${at% *}
sample3=${at#* }
# shellcheck disable=SC2086
"$program" $flags --resume checkpoint > one.txt 2>&1 || fail "the 1-process resume failed (see $work/one.txt)"
grep -q "^resumed at 1 process(es) from a 3-process checkpoint: epoch $epoch3, sample $sample3 of 32,768\$" one.txt ||
  fail "no 'resumed at 1 process(es) from a 3-process checkpoint: epoch $epoch3, sample $sample3' (see $work/one.txt)"
grep -q '^done:' one.txt || fail "the resumed run did not finish (see $work/one.txt)"
[ "$(wc -l < metrics.jsonl)" -eq 6 ] || fail "$(wc -l < metrics.jsonl) metrics lines, expected 6"
grep -q null metrics.jsonl && fail "a metric is not finite: $(cat metrics.jsonl)"
echo "stopped at 2 ranks in epoch $epoch (sample $sample), resumed at 3 ranks, stopped in epoch $epoch3" \
  "(sample $sample3), resumed as one process to the end"
