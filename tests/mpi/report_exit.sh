#!/bin/sh
# Runs one rank's command and reports its exit status: mpirun's own status may not show it.
"$@"
status=$?
echo "rank ${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-?}} exited with $status"
exit $status
