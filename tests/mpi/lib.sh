# Shared by the shell tests of runs that are stopped and resumed (restart.sh, preempt.sh,
# elastic.sh): sourced after `name` is set to the script's name.

fail() {
  echo "$name: FAILED: $*" >&2
  exit 1
}

# Makes and enters the empty work directory $1.
enter_work() {
  rm -rf "$1" && mkdir -p "$1" || fail "cannot make $1"
  cd "$1" || fail "cannot enter $1"
}

# The pid of rank $2 among the children of mpirun $1 (empty if there is none).
rank_pid() {
  for child in $(ps -o pid= --ppid "$1"); do
    if tr '\0' '\n' < "/proc/$child/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$child"
      return
    fi
  done
}

# Waits until metrics.jsonl holds $2 lines while run $1 (output in $3) is alive; fails after 60 s or
# when the run ends first.
wait_for_metrics() {
  tries=0
  while [ "$(cat metrics.jsonl 2>/dev/null | wc -l)" -lt "$2" ]; do
    kill -0 "$1" 2>/dev/null || fail "the run ended before epoch $2 was written (see $PWD/$3)"
    tries=$((tries + 1))
    [ "$tries" -lt 6000 ] || fail "no metrics for epoch $2 after 60 s (see $PWD/$3)"
    sleep 0.01
  done
}

# Runs the command after $4 in the background, output in $1; once metrics.jsonl holds $2 lines
# (and 0.05 s more: inside the next epoch) sends signal $3 to it ($4 = self) or to its rank N among
# mpirun's children ($4 = rankN), and waits for it. Leaves its exit status in `status`.
signal_when_written() {
  out=$1
  lines=$2
  sig=$3
  whom=$4
  shift 4
  "$@" > "$out" 2>&1 &
  pid=$!
  wait_for_metrics "$pid" "$lines" "$out"
  sleep 0.05
  case $whom in
    rank*) target=$(rank_pid "$pid" "${whom#rank}") ;;
    *) target=$pid ;;
  esac
  [ -n "$target" ] || fail "found no process for $whom under $pid"
  kill "-$sig" "$target" || fail "could not send $sig to $target"
  wait "$pid"
  status=$?
}

# Metrics file $1 without the timings (samples per second, achieved GFLOP/s and utilization,
# seconds), which differ from run to run.
strip_timings() {
  sed -e 's/, "samples_per_s": [^,}]*//' -e 's/, "train_gflops": [^,}]*//' -e 's/, "mfu": [^,}]*//' \
      -e 's/, "seconds": [^,}]*//' "$1"
}

# The run's checkpoint and its $1 epochs of metrics equal, bit for bit, those of the reference run.
same_as_reference() {
  cmp reference/model.safetensors checkpoint/model.safetensors || fail "the weights differ"
  cmp reference/training_state.safetensors checkpoint/training_state.safetensors || fail "the training states differ"
  strip_timings reference.jsonl > reference.metrics
  strip_timings metrics.jsonl > resumed.metrics
  [ "$(wc -l < resumed.metrics)" -eq "$1" ] || fail "$(wc -l < resumed.metrics) metrics lines, expected $1"
  cmp reference.metrics resumed.metrics || fail "the metrics differ: $(diff reference.metrics resumed.metrics)"
}
