#!/bin/sh
# The rsh agent of the multihost tests: `agent.sh HOST COMMAND...` runs COMMAND (Open MPI's daemon,
# as mpirun asks ssh to) on test host HOST (hostK or its address 10.77.0.K), in that host's
# namespace and under its host name. hosts.sh exports FUSEDP_MH_PREFIX, which names the namespaces.
host=$1
shift
case $host in
  host*) k=${host#host} ;;
  10.77.0.*) k=${host#10.77.0.} ;;
  *) echo "agent.sh: no test host $host" >&2; exit 255 ;;
esac
exec ip netns exec "${FUSEDP_MH_PREFIX:?agent.sh: FUSEDP_MH_PREFIX is not set}h$k" \
  unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "host$k" "$*"
