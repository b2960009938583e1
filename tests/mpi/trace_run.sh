#!/bin/sh
# An example traced (--trace) and its trace reported (scripts/trace_report.py): in one process with 2
# replicas, or under mpirun with 2 ranks (one file per rank, merged). Checks the run's trace line, that
# every file and the merged trace are JSON with the spans of every step, the report's split of the
# steps and each rank's overlap line, and that a trace path that cannot be written is a clear error
# before training (exit 1, naming the file).
#
#   trace_run.sh WORK_DIR MLP_FIT SOURCE_DIR [MPIEXEC NP_FLAG NP FLAGS...]
name=trace_run.sh
. "$(dirname "$0")/lib.sh"
work=$1
mlp_fit=$2
source_dir=$3
shift 3
report="$source_dir/scripts/trace_report.py"
enter_work "$work"

if [ $# -gt 0 ]; then
  "$@" "$mlp_fit" --epochs 1 --threads 1 --bucket-mb 0.004 --trace run.json > out.txt 2>&1 || fail "the traced run failed (see $PWD/out.txt)"
  files="run.rank0.json run.rank1.json"
  ranks=2
else
  "$mlp_fit" --epochs 1 --replicas 2 --bucket-mb 0.004 --trace run.json > out.txt 2>&1 || fail "the traced run failed (see $PWD/out.txt)"
  files="run.json"
  ranks=1
fi
for f in $files; do
  [ -s "$f" ] || fail "no trace $f (see $PWD/out.txt)"
done
grep -q "^trace: run[.a-z0-9]*json ([0-9]* spans); gradient reduction [0-9.]* ms, [0-9.]* ms of it exposed: [0-9]*% hidden behind backward" out.txt ||
  fail "no trace line in the run's output (see $PWD/out.txt)"

# shellcheck disable=SC2086
python3 "$report" $files -o merged.json --per-step > report.txt 2>&1 || fail "trace_report.py failed (see $PWD/report.txt)"
steps=$(sed -n 's/^\([0-9]*\) steps, .*/\1/p' report.txt)
[ -n "$steps" ] && [ "$steps" -gt 0 ] || fail "the report counts no steps (see $PWD/report.txt)"
grep -q "^ *median " report.txt || fail "no median row in the report (see $PWD/report.txt)"
[ "$(grep -c '^rank [0-9]: gradient reduction' report.txt)" -eq "$ranks" ] || fail "not one overlap line per rank (see $PWD/report.txt)"
# The run's own count of steps ('step N/N' of its progress line) is the report's, one row each.
run_steps=$(tr '\r' '\n' < out.txt | sed -n 's/.*step \([0-9]*\)\/\1 .*/\1/p' | tail -1)
[ -n "$run_steps" ] || fail "no 'step N/N' in the run's output (see $PWD/out.txt)"
[ "$steps" -eq "$run_steps" ] || fail "the report counts $steps steps, the run $run_steps"
[ "$(grep -c '^ *[0-9][0-9]* .* rank [0-9] lane [0-9]' report.txt)" -eq "$steps" ] || fail "per-step rows differ from the step count"
python3 - merged.json "$steps" $files <<'EOF' || fail "the traces are not what they should be"
import json, sys
merged, steps, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for path in [merged] + files:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert events, path + ": no events"
with open(merged) as f:
    events = json.load(f)["traceEvents"]
step_spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
pids = {e["pid"] for e in step_spans}
assert len(pids) == len(files), f"{len(pids)} ranks hold steps in {merged}"
assert len({e["args"]["step"] for e in step_spans}) == steps, "the merged trace's steps differ from the report's"
reduce = [e for e in events if e.get("ph") in ("b", "e") and e.get("cat") == "reduce"]
assert reduce and len(reduce) % 2 == 0, "no reduction pairs"
EOF

# A trace that cannot be written: exit 1 before training, naming the file.
if "$mlp_fit" --epochs 1 --trace "$work/no/such/folder/t.json" > bad.txt 2>&1; then fail "an unwritable --trace path was accepted"; fi
grep -q "\-\-trace: $work/no/such/folder/t.json: cannot write the trace" bad.txt || fail "no clear error for an unwritable --trace path (see $PWD/bad.txt)"
grep -q "step 1/" bad.txt && fail "it trained before failing on --trace"
echo "$name: ok ($steps steps, $ranks process(es))"
