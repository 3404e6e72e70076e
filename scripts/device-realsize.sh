#!/bin/bash
# Real-size CPU measurements on the device machine's 16-core host (issue 18), in one call. Steps (all by default,
# or those named in $STEPS):
#   kernels  kernel throughput against the memory read bound (kernel_bandwidth, gemv_sweep, kernel_compute)
#   dense    decode of a dense real-width K3 model (6 layers, 32 experts) with everything resident, at the thread
#            counts in $THREADS (default 16 8 4 2)
#   capped   the same dense model under a 12 GiB budget (layers streamed, experts read from disk), with the
#            expert read rate of the same run for the I/O bound, $RUNS times
#   prefill  time to first token of $PROMPTS-token prompts (default 512) on the dense model, resident, 16 threads,
#            the engine's own pass length against 64-token passes (issue 19)
#   sparse   the full-size sparse K3 model under the budgets in $BUDGETS (default 96 48)
# Binaries are built on the development machine and carried gzip-compressed in target/devbin; results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-kernels dense prefill capped sparse}
PROMPTS=${PROMPTS:-512}
RUNS=${RUNS:-1}
THREADS=${THREADS:-16 8 4 2}
BUDGETS=${BUDGETS:-96 48}
TOKENS=${TOKENS:-6}
mkdir -p "$OUT" bin
for f in target/devbin/*.gz; do gunzip -c "$f" > bin/$(basename "$f" .gz); done
chmod +x bin/*
exec > >(tee "$OUT/log.txt") 2>&1
echo "== machine"; nproc; free -g; df -h / | tail -1; grep -m1 "model name" /proc/cpuinfo
lscpu | grep -E "Thread|Core|Socket|NUMA node\(s\)|L2|L3"
cat /sys/kernel/mm/transparent_hugepage/enabled
DATA=${DATA:-/root/dfdata}; mkdir -p "$DATA"
T0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - T0 )) s)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has kernels; then
  for t in 16 8; do
    step "gemv_sweep, $t threads"
    [ -x bin/gemv_sweep ] && RAYON_NUM_THREADS=$t timeout 120 bin/gemv_sweep | tee -a "$OUT/gemv_sweep.jsonl"
  done
  step "kernel_compute, 1 thread"
  [ -x bin/kernel_compute ] && RAYON_NUM_THREADS=1 timeout 120 bin/kernel_compute --json | tee "$OUT/kernel_compute.json"
  step "gemm_compute (1 and all threads)"
  [ -x bin/gemm_compute ] && timeout 150 bin/gemm_compute --tokens 64,1024 | tee "$OUT/gemm_compute.txt"
  step "kernel_bandwidth, 16 threads"
  [ -x bin/kernel_bandwidth ] && RAYON_NUM_THREADS=16 timeout 150 bin/kernel_bandwidth --json | tee "$OUT/kernel_bandwidth.json"
fi
make_dense() {
  step "make dense real-width model"
  [ -d "$DATA/k3d" ] || timeout 240 bin/xtask make-synthetic --preset k3 --layers 6 --experts 32 --out "$DATA/k3d"
}
if has dense; then
  make_dense
  for t in $THREADS; do
    runs=1; [ "$t" = 16 ] && runs=$RUNS
    for r in $(seq "$runs"); do
      step "bench-decode dense, resident, $t threads, run $r"
      RAYON_NUM_THREADS=$t timeout 100 bin/deltafin bench-decode --model "$DATA/k3d" --ram-gb 60 --pin-layers all \
        --tokens "$TOKENS" --membw-gib 0 --membw-per-token-gib 1 --warm-experts | tee -a "$OUT/dense_threads.jsonl"
    done
  done
fi
if has prefill; then
  make_dense
  for n in $PROMPTS; do
    step "bench-prefill dense, resident, $n tokens"
    RAYON_NUM_THREADS=16 timeout 200 bin/deltafin bench-prefill --model "$DATA/k3d" --ram-gb 60 --pin-layers all \
      --prompt-len "$n" --chunks auto,64 | tee -a "$OUT/dense_prefill.jsonl"
  done
fi
if has capped; then
  make_dense
  for r in $(seq "$RUNS"); do
    step "bench-decode dense, 12 GiB budget, run $r"
    timeout 150 bin/deltafin bench-decode --model "$DATA/k3d" --ram-gb 12 --tokens "$TOKENS" --membw-gib 4 \
      --disk-spans 48 | tee -a "$OUT/dense_capped.jsonl"
  done
fi
if has sparse; then
  rm -rf "$DATA/k3d"
  step "make full-size sparse model"
  [ -d "$DATA/k3s" ] || timeout 120 bin/xtask make-synthetic --preset k3 --sparse --out "$DATA/k3s"
  for gb in $BUDGETS; do
    step "bench-decode sparse full size, K3_RAM_GB=$gb"
    timeout 150 bin/deltafin bench-decode --model "$DATA/k3s" --ram-gb $gb --tokens 2 --prompt-len 3 \
      --membw-gib 4 | tee -a "$OUT/sparse_budget.jsonl"
  done
fi
step done
