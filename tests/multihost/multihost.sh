#!/bin/sh
# Faults across machines, on two test hosts made on this machine (hosts.sh: network namespaces
# joined by an emulated link), with examples/mlp_fit under mpirun over TCP:
#
#   multihost.sh <scenario> <work dir> <mlp_fit> [<ranks per host>]
#
#   same       a Deterministic run on 2 hosts equals the run of as many ranks on one host, bit for
#              bit (weights, training state, metrics)
#   lossy      the same over a slow, lossy link: host 2's packets wait 20 ms and 2% are lost
#   partition  host 2 cut off mid-run: every rank exits non-zero naming a rank of the other host
#              within timeout + 15 s, and the job, mpirun and the remote daemon included, ends within
#              timeout + 30 s
#   unplug     the same when host 2's interface goes down (ip link set eth0 down) instead
#   stop       host 2's ranks stopped (SIGSTOP) mid-run: rank 0 names them, and the job ends
#   freeze     every process of host 2 (Open MPI's daemon too) stopped for longer than the timeout,
#              then continued: the ranks of host 1 name them, and the job ends once host 2 runs again
#   disk-full  the checkpoint folder (a small tmpfs) fills up during a save: rank 0 exits 1 naming the
#              folder, the job ends, and the previous checkpoint resumes to the end bit for bit
#
# mpirun runs with the flags of the README's recipe for several machines (hosts.sh's mh_mpirun and
# below: the TCP retry limit, each rank's output kept on its own host). Collective timeouts are
# 5 s here (60 s by default). Exits non-zero, saying why, on any difference; 77 (skipped) where test
# hosts cannot be made.
set -u
scenario=$1
work=$2
program=$3
per_host=${4:-1}

name="multihost.sh $scenario"
. "$(dirname "$0")/hosts.sh"
mh_require mpirun
enter_work "$work"

ranks=$((2 * per_host))
timeout_s=5
flags="--samples 8192 --side 16 --batch 64 --lr 0.002 --threads 1 --seed 5 --deterministic"
program_name=$(basename "$program" | cut -c1-15)  # as ps shows it

now() { date +%s.%N; }
# $1 - $2 in seconds, to a tenth.
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", a - b }'; }
# Whether $1 <= $2 (seconds).
within() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }

# The single-host run of as many ranks (shared memory), the reference: $1 epochs.
reference() {
  # shellcheck disable=SC2086
  mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$program" $flags --epochs "$1" \
    --checkpoint reference --metrics reference.jsonl > reference.out 2>&1 || fail "the one-host reference run failed (see $work/reference.out)"
}

# Starts the 2-host run in the background (pid in `pid`), output in $1 and each rank's own output
# under ranks/ (Open MPI's --output-filename: written on the rank's own host, so it survives a
# partition); the rest: flags. Each rank runs under tests/mpi/report_exit.sh, which prints its exit
# status.
start_two_hosts() {
  out=$1
  shift
  rm -rf ranks
  # shellcheck disable=SC2086
  FUSEDP_COLLECTIVE_TIMEOUT=$timeout_s mh_mpirun -x FUSEDP_COLLECTIVE_TIMEOUT --output-filename "$work/ranks" \
    -np "$ranks" -host "host1:$per_host,host2:$per_host" \
    sh "$mh_dir/../mpi/report_exit.sh" "$program" $flags "$@" > "$out" 2>&1 &
  pid=$!
}

# Rank $1's stdout and stderr, as its host wrote them.
rank_output() {
  cat "ranks/1/rank.$1/stdout" "ranks/1/rank.$1/stderr" 2> /dev/null
}

# Whether host $1 runs a process of the program.
runs_on() {
  pids=$(ip netns pids "${mh_prefix}h$1" 2> /dev/null)
  [ -n "$pids" ] && ps -o comm= -p "$(echo $pids | tr ' ' ',')" 2> /dev/null | grep -qx "$program_name"
}

# Watches the run (pid) from time $1 on, for at most $2 s: sets gone1 and gone2 (seconds after $1
# when the host's last rank ended), job (when mpirun had ended and host2 ran no process at all, Open
# MPI's daemon included) and status (mpirun's exit status).
watch_ends() {
  start=$1
  limit=$2
  gone1= gone2= job= status= mpirun_done=
  while :; do
    t=$(since "$(now)" "$start")
    [ -n "$gone1" ] || runs_on 1 || gone1=$t
    [ -n "$gone2" ] || runs_on 2 || gone2=$t
    if [ -z "$mpirun_done" ] && ! kill -0 "$pid" 2> /dev/null; then
      wait "$pid"
      status=$?
      mpirun_done=1
    fi
    [ -n "$job" ] || [ -z "$mpirun_done" ] || [ -n "$(ip netns pids "${mh_prefix}h2")" ] || job=$t
    [ -z "$gone1" ] || [ -z "$gone2" ] || [ -z "$job" ] || return 0
    if ! within "$t" "$limit"; then
      up=
      runs_on 1 && up="$up ranks on host1,"
      runs_on 2 && up="$up ranks on host2,"
      [ -n "$mpirun_done" ] || up="$up mpirun,"
      ip netns pids "${mh_prefix}h2" | xargs -r ps -o comm= -p | grep -qx orted && up="$up host2's Open MPI daemon,"
      fail "still up $limit s after the fault:${up%,} (see $work/run.out; mh_down ends them)"
    fi
    sleep 0.1
  done
}

# Rank $1's output names the ranks of the other host, and that host, as stopped responding, and says it exited
# non-zero (when it lived to say so: Open MPI may end it first, after another rank's abort).
names_other_host() {
  r=$1
  if [ "$r" -lt "$per_host" ]; then others="[$per_host-$((ranks - 1))]" other=2; else others="[0-$((per_host - 1))]" other=1; fi
  rank_output "$r" | grep -q "^fusedp: rank $r: .* ranks* $others\(, $others\)*\( and $others\)* (on host$other) stopped responding" ||
    fail "rank $r does not name a rank of the other host and that host (see $work/ranks/1/rank.$r)"
  ! rank_output "$r" | grep -q "^rank $r exited with 0$" || fail "rank $r exited 0"
}

# Ranks 0 .. $1 - 1 each name the other host's ranks (names_other_host).
ranks_below_name_other_host() {
  r=0
  while [ "$r" -lt "$1" ]; do
    names_other_host "$r"
    r=$((r + 1))
  done
}

case $scenario in
  same | lossy)
    reference 2
    mh_up 2
    [ "$scenario" = same ] || mh_link 2 delay 20 loss 0.02
    began=$(now)
    start_two_hosts run.out --epochs 2 --checkpoint checkpoint --metrics metrics.jsonl
    wait "$pid" || fail "the 2-host run failed (see $work/run.out)"
    echo "$scenario: 2 hosts x $per_host ranks trained 2 epochs in $(since "$(now)" "$began") s"
    same_as_reference 2
    ;;

  partition | unplug)
    mh_up 2
    # The recipe: the kernel gives up on a TCP connection whose peer stopped acknowledging after about
    # 13 s (5 retransmissions) instead of about 15 minutes (15), so that Open MPI's daemons, which
    # have messages queued for each other, learn that the other host is gone.
    mh_on 1 sysctl -q -w net.ipv4.tcp_retries2=5 && mh_on 2 sysctl -q -w net.ipv4.tcp_retries2=5 ||
      fail "cannot set net.ipv4.tcp_retries2 in the test hosts"
    start_two_hosts run.out --epochs 1000 --metrics metrics.jsonl
    wait_for_metrics "$pid" 1 run.out
    if [ "$scenario" = partition ]; then
      mh_link 2 down                      # the network drops everything to and from host 2
    else
      ip -n "${mh_prefix}h2" link set eth0 down  # host 2's interface goes down (its cable pulled)
    fi
    cut=$(now)
    watch_ends "$cut" $((timeout_s + 60))
    echo "$scenario: ranks ended ${gone1} s (host1) and ${gone2} s (host2) after the cut, the job ${job} s (mpirun status $status); timeout $timeout_s s"
    [ "$status" -ne 0 ] || fail "mpirun exited 0"
    ranks_below_name_other_host "$ranks"
    within "$gone1" $((timeout_s + 15)) || fail "host1's ranks ended $gone1 s after the cut (more than timeout + 15 s)"
    within "$gone2" $((timeout_s + 15)) || fail "host2's ranks ended $gone2 s after the cut (more than timeout + 15 s)"
    within "$job" $((timeout_s + 30)) || fail "the job ended $job s after the cut (more than timeout + 30 s)"
    ;;

  stop | freeze)
    mh_up 2
    start_two_hosts run.out --epochs 1000 --metrics metrics.jsonl
    wait_for_metrics "$pid" 1 run.out
    if [ "$scenario" = stop ]; then
      victims=$(ip netns pids "${mh_prefix}h2" | xargs -r ps -o pid=,comm= -p | awk -v p="$program_name" '$2 == p { print $1 }')
    else
      victims=$(ip netns pids "${mh_prefix}h2")
    fi
    [ -n "$victims" ] || fail "nothing to stop on host2"
    # shellcheck disable=SC2086
    kill -STOP $victims || fail "cannot stop $victims"
    stopped=$(now)
    if [ "$scenario" = freeze ]; then
      # Host 1's ranks give up and name host 2's; mpirun cannot end host 2's ranks while its daemon
      # is stopped (TCP still acknowledges: the kernel runs), so the job waits for it.
      sleep $((timeout_s + 5))
      kill -0 "$pid" 2> /dev/null || fail "the job ended while host2 was stopped (see $work/run.out)"
      ranks_below_name_other_host "$per_host"
      # shellcheck disable=SC2086
      kill -CONT $victims
      continued=$(now)
      watch_ends "$continued" 30
      echo "freeze: host2 stopped $(since "$continued" "$stopped") s; after it continued, ranks ended ${gone1} s (host1) and ${gone2} s (host2) later, the job ${job} s (mpirun status $status)"
    else
      watch_ends "$stopped" $((timeout_s + 30))
      echo "stop: ranks ended ${gone1} s (host1) and ${gone2} s (host2) after the stop, the job ${job} s (mpirun status $status); timeout $timeout_s s"
      ranks_below_name_other_host "$per_host"
      within "$job" $((timeout_s + 15)) || fail "the job ended $job s after the stop (more than timeout + 15 s)"
    fi
    [ "$status" -ne 0 ] || fail "mpirun exited 0"
    ;;

  disk-full)
    reference 4
    mh_up 2
    mh_tmpfs "$work/checkpoint" 512k
    start_two_hosts run.out --epochs 4 --checkpoint "$work/checkpoint" --metrics metrics.jsonl
    wait_for_metrics "$pid" 1 run.out
    # Leave 4 KiB: the next save starts, and cannot complete.
    free=$(df --output=avail -B1 "$work/checkpoint" | tail -1)
    head -c $((free - 4096)) /dev/zero > "$work/checkpoint/filler" 2> /dev/null
    watch_ends "$(now)" 30
    [ "$status" -ne 0 ] || fail "mpirun exited 0 with the checkpoint folder full (see $work/run.out)"
    rank_output 0 | grep -q "^mlp_fit: error: --checkpoint: $work/checkpoint: cannot save the checkpoint after epoch [2-4]: .*No space left on device; the folder still holds the checkpoint after epoch [1-3], which --resume $work/checkpoint continues from$" ||
      fail "no message naming the folder, the full disk and the checkpoint kept (see $work/ranks/1/rank.0)"
    rank_output 0 | grep -q "^rank 0 exited with 1$" || fail "rank 0 did not exit with 1 (see $work/ranks/1/rank.0)"
    kept=$(rank_output 0 | sed -n 's/.*the folder still holds the checkpoint after epoch \([0-9]*\).*/\1/p')
    ls "$work/checkpoint" | grep -v -x -e filler -e model.safetensors -e training_state.safetensors &&
      fail "a failed save left files behind"
    rm "$work/checkpoint/filler"
    mv ranks ranks.full
    start_two_hosts resume.out --epochs 4 --checkpoint "$work/checkpoint" --resume "$work/checkpoint" --metrics metrics.jsonl
    wait "$pid" || fail "resuming from the checkpoint after epoch $kept failed (see $work/resume.out)"
    echo "disk-full: the save after epoch $((kept + 1)) failed, the checkpoint after epoch $kept resumed to the end"
    same_as_reference 4
    ;;

  *)
    fail "no scenario $scenario (same, lossy, partition, unplug, stop, freeze, disk-full)"
    ;;
esac
echo "$name: passed"
