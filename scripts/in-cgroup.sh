#!/bin/bash
# Runs a command inside a cgroup-v1 memory cap, as ../shared/docs/benchmarks.md describes (root only; the cap counts
# page cache, as RAM does on a real machine), and prints the cgroup's peak usage and OOM kills afterwards.
#   scripts/in-cgroup.sh GIB command [args...]
set -u
G=$1; shift
CG=/sys/fs/cgroup/memory/deltafin-cap-$$
mkdir -p "$CG"
echo $((G * 1024 * 1024 * 1024)) > "$CG/memory.limit_in_bytes"
echo 0 > "$CG/memory.swappiness" 2>/dev/null
sh -c "echo \$\$ > $CG/cgroup.procs; exec \"\$@\"" sh "$@"
rc=$?
echo "cgroup peak $(( $(cat "$CG/memory.max_usage_in_bytes") / 1048576 )) MiB, $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')" >&2
rmdir "$CG"
exit $rc
