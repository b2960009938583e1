#!/bin/sh
# Divergence in the examples: lenet_mnist --lr 100 (SGD) makes the gradient overflow within a few steps.
#   by default the run stops at the first such step, naming it and the first tensor, exit 1;
#   --on-nonfinite skip goes on past such steps, and when the model is beyond repair (a test loss
#   that is not finite) it stops with a message instead of writing a NaN into the metrics;
#   --clip-grad-norm keeps the same run finite to its end.
# The metrics file never holds a NaN (JSON null).
#
#   divergence.sh <work dir> <lenet_mnist>
set -u
work=$1
program=$2
flags="--lr 100 --epochs 1 --threads 2"

fail() {
  echo "divergence.sh: FAILED: $*" >&2
  exit 1
}
rm -rf "$work" && mkdir -p "$work" || fail "cannot make $work"
cd "$work" || fail "cannot enter $work"

# $1: output file; $2: expected exit status; $3: a regex the output must match; the rest: flags.
expect() {
  out=$1
  want=$2
  pattern=$3
  shift 3
  # shellcheck disable=SC2086
  "$program" $flags "$@" > "$out" 2>&1
  status=$?
  [ "$status" -eq "$want" ] || fail "exit status $status, expected $want, with $* (see $work/$out)"
  tr '\r' '\n' < "$out" | grep -Eq "$pattern" || fail "no line matching '$pattern' with $* (see $work/$out)"
  if [ -f metrics.jsonl ] && grep -Eq 'null|nan|inf' metrics.jsonl; then
    fail "the metrics hold a value that is not finite with $*: $(cat metrics.jsonl)"
  fi
  rm -f metrics.jsonl
}

expect stop.txt 1 "error: step [0-9]+ \(epoch 1, batch [0-9]+\): the gradient is not finite \(NaN or infinity\), first in '[0-9a-z.]+' \(layer [0-9]+\)" \
  --metrics metrics.jsonl
expect skip.txt 1 "error: epoch 1: the test loss is not finite: the model has diverged" --on-nonfinite skip \
  --metrics metrics.jsonl
expect clip.txt 0 "^epoch 1/1  train loss [0-9.]+  test loss [0-9.]+" --clip-grad-norm 0.01 --metrics metrics.jsonl
echo "lenet_mnist --lr 100: stopped at the first non-finite gradient; skipped past them; kept finite by clipping"
