#!/usr/bin/env bash
# Generation benchmarks on the large synthetic preset (issue 6). Not a test: run by hand as root (drops the page
# cache). Results go to docs/PERFORMANCE.md, "Generation".
#
#   scripts/bench-generation.sh LARGE_DIR LARGE_CYCLIC_DIR [RUNS=3]
#
# Every run is a fresh process inside a 4 GiB memory cgroup, page cache dropped first.
# 1. Prefill of a 64-token prompt: chunked (64 tokens a pass) vs token by token (chunk 1): wall time and expert
#    bytes read from disk, expert cache 2.8 GiB (what a 4 GiB machine leaves for it).
# 2. Decode on a repetitive prompt with the cyclic preset: n-gram speculation off vs depth 1 vs depth 3.
set -euo pipefail
cd "$(dirname "$0")/.."
LARGE=$1
CYCLIC=$2
RUNS=${3:-3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build --release -q -p deltafin-cli
BIN=$CARGO_TARGET_DIR/release/deltafin
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# The memory cap of `cargo xtask bench` (cgroup v1, 4 GiB, page cache included), as in the decode benchmark.
CG=/sys/fs/cgroup/memory/deltafin-bench
mkdir -p "$CG" && echo $((4 << 30)) > "$CG/memory.limit_in_bytes"
capped() { sh -c "echo \$\$ > $CG/cgroup.procs && exec \"\$0\" \"\$@\"" "$@"; }
PROMPT64=$(seq 1 64 | awk '{printf "%s%d", (NR>1?",":""), ($1*37)%800+1}')
REPEAT=$(for i in $(seq 1 6); do printf "1,2,3,4,5,6,7,"; done; printf "1")

run_stats() { # label, args...
    local label=$1; shift
    for r in $(seq 1 "$RUNS"); do
        drop
        local start end
        start=$(date +%s.%N)
        capped "$BIN" run "$@" --json --stats 2>/tmp/bench-gen.err >/dev/null
        end=$(date +%s.%N)
        local disk
        disk=$(grep -o 'disk: [0-9]* reads, [0-9.]* MiB' /tmp/bench-gen.err | head -1)
        local spec
        spec=$(grep 'speculation' /tmp/bench-gen.err | sed 's/ \+/ /g')
        echo "$label run $r: $(echo "$end - $start" | bc) s; $disk;$spec"
    done
}

echo "== prefill, 64-token prompt, max-new 1 (large preset, expert cache 2.8 GiB)"
run_stats "chunk-64" --model "$LARGE" --prompt-ids "$PROMPT64" --max-new 1 --prefill-chunk 64 --ram-gb 2.8 --spec off
run_stats "chunk-1 " --model "$LARGE" --prompt-ids "$PROMPT64" --max-new 1 --prefill-chunk 1 --ram-gb 2.8 --spec off

echo "== decode 32 tokens on a repetitive prompt (large-cyclic preset, expert cache 2.8 GiB)"
run_stats "spec off    " --model "$CYCLIC" --prompt-ids "$REPEAT" --max-new 32 --ignore-eos --ram-gb 2.8 --spec off
run_stats "spec depth 1" --model "$CYCLIC" --prompt-ids "$REPEAT" --max-new 32 --ignore-eos --ram-gb 2.8 --spec on --spec-depth 1
run_stats "spec depth 3" --model "$CYCLIC" --prompt-ids "$REPEAT" --max-new 32 --ignore-eos --ram-gb 2.8 --spec on --spec-depth 3
