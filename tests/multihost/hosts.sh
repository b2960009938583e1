# Test hosts on one machine, sourced by the multihost tests after `name` is set to the test's name.
#
#   mh_up N       makes hosts host1..hostN: a network namespace each, with an interface eth0 at
#                 10.77.0.K/24 and its own host name, all joined by link.py (a switch in user space
#                 that drops or delays packets on demand). Everything is torn down when the script
#                 exits, fails or is killed (SIGINT, SIGTERM, SIGHUP: ctest's timeout included).
#   mh_on K CMD   runs CMD on host K (in its namespace, under its host name).
#   mh_link K F   sets host K's link fault F: "up", "down" (cut off), or "delay MS loss P" (on the
#                 packets it sends), as `tc netem` would; link.py applies it within milliseconds.
#   mh_tmpfs D S  mounts a tmpfs of size S on folder D (a disk to fill), unmounted at the end.
#   mh_mpirun ... mpirun, started on host 1, reaching the others through agent.sh (the rsh agent:
#                 it runs Open MPI's daemon on the host named), with the flags that keep Open MPI on
#                 eth0 and TCP; see the README's recipe for the flags that matter on real machines.
#
# Nothing leaves the namespaces: their only interfaces are lo and eth0, and eth0's packets go only
# to link.py, which hands them only to the other hosts' eth0. The namespaces are named
# fdp<pid>h<K>, so that tests running at once do not meet.
#
# Needs root, ip (iproute2), unshare (util-linux), python3 and /dev/net/tun; mh_require exits with
# status 77 (ctest: skipped) and says which is missing otherwise.

mh_dir=${mh_dir:-$(cd "$(dirname "$0")" && pwd)}
mh_prefix="fdp$$"
mh_hosts=0
mh_link_pid=
mh_state=

mh_mounts=

# fail, enter_work, wait_for_metrics, strip_timings, same_as_reference: shared with the mpi tests.
. "$mh_dir/../mpi/lib.sh"

mh_skip() {
  echo "$name: SKIPPED: $*"
  exit 77
}

mh_require() {
  [ "$(id -u)" = 0 ] || mh_skip "needs root (to make network namespaces)"
  for tool in ip unshare python3 "$@"; do
    command -v "$tool" > /dev/null 2>&1 || mh_skip "needs $tool (Debian: iproute2, util-linux, python3)"
  done
  [ -c /dev/net/tun ] || mh_skip "needs /dev/net/tun (the tun driver)"
  ip netns add "${mh_prefix}probe" 2> /dev/null || mh_skip "cannot make a network namespace here (ip netns add failed)"
  ip netns del "${mh_prefix}probe"
}

# Ends every process of namespace $1 and removes it.
mh_remove_ns() {
  pids=$(ip netns pids "$1" 2> /dev/null)
  [ -z "$pids" ] || kill -KILL $pids 2> /dev/null
  ip netns del "$1" 2> /dev/null
  rm -rf "/etc/netns/$1"
}

mh_down() {
  trap - EXIT INT TERM HUP
  for m in $mh_mounts; do
    umount -l "$m" 2> /dev/null
  done
  [ -z "$mh_link_pid" ] || { kill -TERM "$mh_link_pid" 2> /dev/null; wait "$mh_link_pid" 2> /dev/null; }
  k=1
  while [ "$k" -le "$mh_hosts" ]; do
    mh_remove_ns "${mh_prefix}h$k"
    k=$((k + 1))
  done
  [ -z "$mh_state" ] || rm -f "$mh_state" "$mh_state.ready"
}

# Removes the test hosts of earlier tests that were killed before they could (SIGKILL: ctest's
# timeout), named fdp<pid>h<K> after a shell that is gone.
mh_clean_stale() {
  for ns in $(ip netns list | awk '{ print $1 }' | grep -x 'fdp[0-9]*h[0-9]*'); do
    owner=${ns#fdp}
    owner=${owner%h*}
    kill -0 "$owner" 2> /dev/null || mh_remove_ns "$ns"
  done
}

mh_up() {
  mh_clean_stale
  mh_hosts=$1
  trap 'status=$?; mh_down; exit $status' EXIT
  trap 'mh_down; exit 130' INT
  trap 'mh_down; exit 143' TERM HUP
  mh_state="${TMPDIR:-/tmp}/${mh_prefix}.link"
  : > "$mh_state"
  hosts_file=
  namespaces=
  k=1
  while [ "$k" -le "$mh_hosts" ]; do
    ns="${mh_prefix}h$k"
    ip netns add "$ns" || fail "ip netns add $ns"
    ip -n "$ns" link set lo up
    namespaces="$namespaces $ns"
    hosts_file="${hosts_file}10.77.0.$k host$k
"
    k=$((k + 1))
  done
  # shellcheck disable=SC2086
  python3 "$mh_dir/link.py" "${mh_prefix}t" $namespaces --state "$mh_state" --ready "$mh_state.ready" &
  mh_link_pid=$!
  tries=0
  until [ -s "$mh_state.ready" ]; do
    kill -0 "$mh_link_pid" 2> /dev/null || fail "link.py did not start"
    tries=$((tries + 1))
    [ "$tries" -lt 500 ] || fail "link.py not ready after 5 s"
    sleep 0.01
  done
  k=1
  while [ "$k" -le "$mh_hosts" ]; do
    ns="${mh_prefix}h$k"
    # `ip netns exec` shows /etc/netns/<ns>/hosts as /etc/hosts: the host names resolve inside.
    mkdir -p "/etc/netns/$ns"
    printf '127.0.0.1 localhost\n%s' "$hosts_file" > "/etc/netns/$ns/hosts"
    ip -n "$ns" link set "${mh_prefix}t$((k - 1))" name eth0 || fail "no tun device on $ns"
    ip -n "$ns" addr add "10.77.0.$k/24" dev eth0
    ip -n "$ns" link set eth0 mtu 9000 up
    # No way out: no default route, and no interface but lo and eth0.
    [ -z "$(ip -n "$ns" route show default)" ] || fail "$ns has a default route"
    [ "$(ip -n "$ns" -o link show | wc -l)" -eq 2 ] || fail "$ns has interfaces other than lo and eth0"
    k=$((k + 1))
  done
  export FUSEDP_MH_PREFIX="$mh_prefix"
}

# Mounts a tmpfs of size $2 (as mount's size=) on folder $1 (made if need be), unmounted by mh_down.
mh_tmpfs() {
  mkdir -p "$1" && mount -t tmpfs -o "size=$2" tmpfs "$1" || fail "cannot mount a tmpfs on $1"
  mh_mounts="$mh_mounts $1"
}

mh_on() {
  k=$1
  shift
  ip netns exec "${mh_prefix}h$k" unshare --uts sh -c 'hostname "$0" && exec "$@"' "host$k" "$@"
}

mh_link() {
  k=$1
  shift
  grep -v "^$k " "$mh_state" > "$mh_state.new"
  [ "$*" = up ] || echo "$k $*" >> "$mh_state.new"
  mv "$mh_state.new" "$mh_state"
  kill -HUP "$mh_link_pid" || fail "link.py is gone"
}

mh_mpirun() {
  mh_on 1 mpirun --allow-run-as-root --oversubscribe \
    --mca plm_rsh_agent "$mh_dir/agent.sh" \
    --mca pml ob1 --mca btl self,vader,tcp --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
    "$@"
}
