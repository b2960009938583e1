#!/bin/sh
# Elastic resume in the examples: a run of 2 ranks checkpointed at the end of an epoch resumes at 3
# ranks and says so; the resumed run trains the rest and saves its own checkpoint.
#
#   elastic.sh <work dir> <mlp_fit> <mpirun> <its rank-count flag> <a count, ignored> <flags>...
set -u
work=$1
program=$2
mpirun=$3
np=$4
shift 5
flags="--samples 16384 --side 16 --batch 64 --lr 0.002 --threads 1 --seed 5"

fail() {
  echo "elastic.sh: FAILED: $*" >&2
  exit 1
}
rm -rf "$work" && mkdir -p "$work" || fail "cannot make $work"
cd "$work" || fail "cannot enter $work"

# shellcheck disable=SC2086
"$mpirun" "$np" 2 "$@" "$program" $flags --epochs 2 --checkpoint ck > two.txt 2>&1 || fail "the 2-rank run failed (see $work/two.txt)"
# shellcheck disable=SC2086
"$mpirun" "$np" 3 "$@" "$program" $flags --epochs 3 --checkpoint ck --resume ck > three.txt 2>&1 ||
  fail "the 3-rank resume failed (see $work/three.txt)"
grep -q '^resumed at 3 process(es) from a 2-process checkpoint: epoch 3, sample 0 of 16384' three.txt ||
  fail "no 'resumed at 3 process(es) from a 2-process checkpoint' line (see $work/three.txt)"
grep -q '^done: 1 epochs' three.txt || fail "the resumed run did not train its one epoch (see $work/three.txt)"
echo "resumed at 3 ranks from a 2-rank checkpoint and trained epoch 3"
