#!/bin/bash
# Runs a command inside a memory cap, as ../shared/docs/benchmarks.md describes (root only; the cap counts page
# cache, as RAM does on a real machine), and prints the cgroup's peak usage and OOM kills afterwards. Uses the
# cgroup-v1 memory controller where it is mounted (this project's VM), else a cgroup-v2 child of the root (the
# device machine).
#   scripts/in-cgroup.sh GIB command [args...]
set -u
G=$1; shift
if [ -d /sys/fs/cgroup/memory ]; then
  CG=/sys/fs/cgroup/memory/deltafin-cap-$$
  mkdir -p "$CG"
  echo $((G * 1024 * 1024 * 1024)) > "$CG/memory.limit_in_bytes"
  echo 0 > "$CG/memory.swappiness" 2>/dev/null
  sh -c "echo \$\$ > $CG/cgroup.procs; exec \"\$@\"" sh "$@"
  rc=$?
  echo "cgroup peak $(( $(cat "$CG/memory.max_usage_in_bytes") / 1048576 )) MiB, $(grep oom_kill "$CG/memory.oom_control" | tr '\n' ' ')" >&2
else
  CG=/sys/fs/cgroup/deltafin-cap-$$
  echo "+memory" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
  mkdir -p "$CG" || exit 1
  echo $((G * 1024 * 1024 * 1024)) > "$CG/memory.max"
  echo 0 > "$CG/memory.swap.max" 2>/dev/null
  sh -c "echo \$\$ > $CG/cgroup.procs; exec \"\$@\"" sh "$@"
  rc=$?
  echo "cgroup v2 peak $(( $(cat "$CG/memory.peak" 2>/dev/null || echo 0) / 1048576 )) MiB, $(grep oom_kill "$CG/memory.events" | tr '\n' ' ')" >&2
fi
rmdir "$CG"
exit $rc
