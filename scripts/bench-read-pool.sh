#!/usr/bin/env bash
# Read-pool throughput vs fio on K3-sized expert spans (17,547,264 bytes) at random offsets of a large file.
# Not a test: run by hand as root (drops the page cache). Results go to docs/PERFORMANCE.md, "Expert reads".
#
#   scripts/bench-read-pool.sh [FILE_GB=8] [RUNS=5] [SECONDS=15] [DEPTH=4]
#
# Each run drops the page cache, then measures fio (O_DIRECT, libaio, randread, bs = span, 4 KiB-aligned random
# offsets, iodepth = DEPTH)
# and the read pool (DEPTH threads, O_DIRECT, unaligned span offsets) in A B B A order; medians are printed.
set -euo pipefail
cd "$(dirname "$0")/.."

FILE_GB=${1:-8}
RUNS=${2:-5}
SECONDS_PER=${3:-15}
DEPTH=${4:-4}
SPAN=17547264
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
DIR=${BENCH_DIR:-$CARGO_TARGET_DIR/bench-read-pool}
FILE=$DIR/experts.bin

command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio >/dev/null; }
cargo build --release -q -p deltafin-storage --example read_pool_bench
BENCH=$CARGO_TARGET_DIR/release/examples/read_pool_bench

mkdir -p "$DIR"
THP=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed -E 's/.*\[(.*)\].*/\1/' "$THP")
trap 'rm -f "$FILE"; echo "$THP_WAS" > "$THP"' EXIT
if [ ! -f "$FILE" ] || [ "$(stat -c %s "$FILE")" -ne $((FILE_GB << 30)) ]; then
    echo "writing a ${FILE_GB} GiB file at $FILE"
    # Real data blocks (not fallocate's unwritten extents, which read as zeros without touching the disk).
    dd if=/dev/urandom of="$FILE" bs=64M count=$((FILE_GB * 16)) iflag=fullblock oflag=direct status=none
fi
sync

drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }


# fio with its default buffers (4 KiB pages), or with THP forced on and 2 MiB-aligned buffers ("thp"): the read
# pool's buffers are 2 MiB-aligned and madvise(MADV_HUGEPAGE)d, which lets one device request cover 2 MiB per
# segment; the "thp" column gives fio the same advantage.
run_fio() {
    drop
    local extra=()
    if [ "${1:-}" = thp ]; then echo always > "$THP"; extra=(--iomem_align=2m); else echo "$THP_WAS" > "$THP"; fi
    # --blockalign=4k: random 4 KiB-aligned offsets, as expert spans have (fio's default aligns offsets to bs,
    # which leaves only FILE/bs distinct positions to read over and over).
    fio --name=experts --filename="$FILE" --direct=1 --ioengine=libaio --rw=randread --bs=$SPAN \
        --blockalign=4096 --iodepth="$DEPTH" --runtime="$SECONDS_PER" --time_based --size=$((FILE_GB << 30)) \
        "${extra[@]}" --output-format=json 2>/dev/null \
        | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.3f" % (j["jobs"][0]["read"]["bw_bytes"]/1e9))'
}

run_pool() {
    drop
    "$BENCH" "$FILE" $SPAN "$DEPTH" "$SECONDS_PER" "${1:-stream}" | sed -E 's/^GB\/s=([0-9.]+).*/\1/'
}

echo "machine: $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
echo "disk: $(df -h "$DIR" | awk 'NR==2 {print $1, $2}'), $(stat -f -c %T "$DIR")"
echo "span $SPAN bytes, queue depth $DEPTH, $SECONDS_PER s per measurement, $RUNS runs"
# Warm-up (not counted).
run_fio >/dev/null; run_pool >/dev/null

fio_all=(); thp_all=(); pool_all=(); layer_all=()
for i in $(seq 1 "$RUNS"); do
    if (( i % 2 )); then
        f=$(run_fio); p=$(run_pool stream); t=$(run_fio thp)
    else
        t=$(run_fio thp); p=$(run_pool stream); f=$(run_fio)
    fi
    echo "$THP_WAS" > "$THP"
    l=$(run_pool layer)
    echo "run $i: fio $f GB/s, fio+thp $t GB/s, pool $p GB/s, pool (16-span layer batches) $l GB/s"
    fio_all+=("$f"); thp_all+=("$t"); pool_all+=("$p"); layer_all+=("$l")
done

python3 - "${fio_all[*]}" "${thp_all[*]}" "${pool_all[*]}" "${layer_all[*]}" <<'PY'
import statistics, sys
fio, thp, pool, layer = ([float(x) for x in a.split()] for a in sys.argv[1:5])
m = statistics.median
def line(name, xs):
    return f"median {name:8} {m(xs):.3f} GB/s (min {min(xs):.3f}, max {max(xs):.3f})"
print(line("fio", fio))
print(line("fio+thp", thp))
print(line("pool", pool) + f"  pool/fio {m(pool)/m(fio):.3f}  pool/fio+thp {m(pool)/m(thp):.3f}")
print(line("layer", layer) + f"  layer/fio {m(layer)/m(fio):.3f}  layer/fio+thp {m(layer)/m(thp):.3f}")
PY
