#!/bin/bash
# CUDA measurements on the H200 machine (issue 20), in few calls. Steps (all by default, or those named in
# $STEPS):
#   kernels  cuda_kernels: every MoE kernel family and the dense GEMM against the scalar references (only the tests
#            whose names contain $KFILTER, when set)
#   fixtures cuda_fixtures: CUDA logits against the CPU f32 path on every fixture
#   kda      the model's GPU unit tests (bin/model_lib: the KDA heads' kernel against an f64 reference, passes cut
#            anywhere) and `kda-bw` (the kernel alone at K3's shape, hot and with L2 cleared) at $KTOKENS tokens
#   moebw    the MoE kernels on 16 experts of K3's shape at several token counts, against a device copy
#   ncu      Nsight Compute on the warpgroup GEMM's gate/up kernel at T = 64, one launch of each MoE kernel family
#            in $NCU_KERNELS (default "wg"; `moe-bw --kernels K --tokens 64`): `--set full` into
#            $OUT/ncu_K_details.csv (every section's metrics) and, for the last family, its SASS with each
#            instruction's stall samples into $OUT/ncu_K_sass.csv.gz; the down kernel's duration, clock, grid and
#            waves into $OUT/ncu_K_down.csv
#   densebw  the dense GEMM at K3's attention shapes against a device copy, for the column splits in $SPLITS and the
#            weight kinds in $KINDS (bf16, int8)
#   make     the full-size sparse K3 model (xtask make-synthetic --preset k3 --sparse)
#   cuda     `deltafin run --dev cuda` on it, peak host RSS measured, for each GPU memory budget in $VRAMS
#            (GiB; "all" for the default, every layer on the GPU), $RUNS times each, $MAXNEW tokens (default 4);
#            $BINS names the carried builds to alternate (default: deltafin)
#   bench    `deltafin bench-decode --dev cuda` on it (decoded tokens only, 8 by default: $TOKENS_BD), for each GPU
#            memory budget in $VRAMS (as for `cuda`), the HBM copy rate measured in the same process (--hbm-mib
#            1024), $RUNS times for each of $BINS
#   cpu      the same on the CPU, for the greedy tokens
#   int8     the int8 spine on the GPU: a dense real-width K3 (6 layers, 32 experts) and its int8 copy, then
#            `bench-decode --dev cuda` for each K3_SPINE in $SPINES (default "bf16 int8"; "auto" chooses by the GPU
#            budget), $RUNS times, every layer on the GPU and with a GPU budget of $INT8_VRAM GiB (default 8: some
#            bf16 layers streamed)
#   tier     the host tier: on the dense real-width K3 of `int8` (bf16 spine) under a GPU budget of $INT8_VRAM GiB,
#            `bench-decode --dev cuda` with the layers the GPU streams kept in RAM (`--pin-layers auto`) and read from
#            storage at every pass (`--pin-layers none`), alternated, $RUNS times
#   pin      `deltafin-cudabench pin-rate`: page-locking fresh host buffers, their pages untouched or faulted in
#            first, on 1 and 8 threads; then `upload-from`: the link's rate from each kind of page-locked source, on
#            one stream and several
#   perf     `bench-decode --dev cuda` at the first of $VRAMS under a carried perf (cpu-clock, 299 Hz; target/devperf:
#            perf.tgz, perf and its libraries, and deltafin-sym.gz, deltafin stripped of debug info only): every
#            sample's thread, time and symbol into $OUT/perf_script.txt.gz (the spine reader is a new thread per
#            forward pass); analysed on the development machine (docs/performance-log.md, session 23)
#   offcpu   `bench-decode --dev cuda` (one token) at the first of $VRAMS under the carried perf's `sched record -g`:
#            every run and wait of every thread with the kernel stack it left the CPU in, into $OUT/offcpu.txt.gz, and
#            the open's waits summed by that stack (scripts/offcpu_waits.py): what a thread waits on when none is busy
#   contend  the read pool alone on a file of holes (target/devcuda/rpb.gz: the storage crate's read_pool_bench), then
#            beside pinned uploads (deltafin-cudabench upload-bw): whether host memory traffic slows the reads; then
#            the reads into cold buffers (last written 7 GB of reads ago, as the RAM expert cache hands them back),
#            alone and beside expert-sized uploads from registered pages (upload-from): host memory's share of both
# Binaries are built on the development machine and carried gzip-compressed in target/devcuda; results go to $OUT,
# and all of them also into $OUT/results.tgz after every step (the device hands back at most eight files a call, and
# none past the eighth: a run that leaves more ends its command with
# `cd $OUT && ls | grep -vE '^(results.tgz|log.txt)$' | xargs rm -f`, results.tgz holding them all).
set -u
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-kernels fixtures moebw}
RAM=${RAM:-64}
mkdir -p "$OUT" bin
for f in target/devcuda/*.gz; do gunzip -c "$f" > bin/$(basename "$f" .gz); done
chmod +x bin/*
exec > >(tee -a "$OUT/log.txt") 2>&1
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib
# The test binaries find the fixtures at the path they were built in.
mkdir -p /work/main && [ -e /work/main/tests ] || ln -sfn "$PWD/tests" /work/main/tests
DATA=${DATA:-/root/dfdata}; mkdir -p "$DATA"
T0=$(date +%s)
step() { tar czf "$OUT/results.tgz.tmp" -C "$OUT" --exclude results.tgz --exclude results.tgz.tmp . 2>/dev/null;
  mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; echo "== $1 ($(( $(date +%s) - T0 )) s)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
# Runs a command and prints its peak RSS (the children's maximum resident set).
peak() { python3 -c 'import resource,subprocess,sys; r=subprocess.run(sys.argv[1:]).returncode; print("exit", r, "peak_rss_gib", round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/2**20, 2))' "$@"; }
if has kernels; then
  step "cuda_kernels"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  timeout 300 bin/cuda_kernels ${KFILTER:-} --test-threads 1 --nocapture 2>&1 | grep -E "worst|test |result|kernels:" \
    | tee "$OUT/cuda_kernels.txt"
fi
if has fixtures; then
  step "cuda_fixtures"
  timeout 300 bin/cuda_fixtures --test-threads 1 --nocapture 2>&1 | tail -25 | tee "$OUT/cuda_fixtures.txt"
fi
if has kda; then
  step "kda"
  timeout 200 bin/model_lib gpu:: --test-threads 1 2>&1 | grep -E "^test |panicked|result" | tee "$OUT/kda_tests.txt"
  timeout 200 bin/deltafin-cudabench kda-bw --tokens ${KTOKENS:-1,2,4,8,64,512} --reps 100 | tee "$OUT/kda_bw.txt"
fi
if has moebw; then
  step "moe-bw"
  timeout 200 bin/deltafin-cudabench moe-bw --reps ${REPS:-50} --kernels ${KERNELS:-tensor,tiles,gemm} \
    --tokens ${TOKENS:-1,2,4,8,16,32,64} | tee "$OUT/moe_bw.txt"
fi
if has ncu; then
  step "ncu"
  NCU=${NCU:-/usr/local/cuda/bin/ncu}
  for k in ${NCU_KERNELS:-wg}; do
    timeout 200 "$NCU" -k "regex:moe_${k}_gate_up_n8_f2" -c 1 --set full --import-source no -o "/tmp/ncu_$k" -f \
      bin/deltafin-cudabench moe-bw --reps 1 --kernels "$k" --tokens 64 2>&1 | tail -3
    "$NCU" -i "/tmp/ncu_$k.ncu-rep" --page details --csv > "$OUT/ncu_${k}_details.csv"
    # The down kernel's duration, clock and waves beside it (the gate/up kernel's are in the details).
    timeout 120 "$NCU" -k "regex:moe_${k}_down_n8" -c 1 --section SpeedOfLight --section LaunchStats --csv \
      bin/deltafin-cudabench moe-bw --reps 1 --kernels "$k" --tokens 64 2>/dev/null \
      | grep -E '"(Duration|SM Frequency|Grid Size|Waves Per SM)"' | tee "$OUT/ncu_${k}_down.csv"
  done
  "$NCU" -i "/tmp/ncu_$k.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/ncu_${k}_sass.csv.gz"
fi
if has densebw; then
  step "dense-bw"
  timeout 120 bin/deltafin-cudabench dense-bw --tokens ${DTOKENS:-1,3} --reps 50 --splits ${SPLITS:-0,1} \
    --kinds ${KINDS:-bf16} | tee "$OUT/dense_bw.txt"
fi
if has make; then
  step "make full-size sparse model"
  [ -d "$DATA/k3s" ] || timeout 300 bin/xtask make-synthetic --preset k3 --sparse --out "$DATA/k3s"
  du -sh --apparent-size "$DATA/k3s"; du -sh "$DATA/k3s"
fi
if has cuda; then
  for v in ${VRAMS:-all}; do
    vram=(); [ "$v" = all ] || vram=(--vram-gb "$v")
    for i in $(seq 1 "${RUNS:-1}"); do
      for b in ${BINS:-deltafin}; do
        step "cuda run $i of $b, K3_RAM_GB=$RAM, VRAM budget $v"
        K3_RAM_GB=$RAM peak timeout 400 bin/$b run --dev cuda "${vram[@]}" --model "$DATA/k3s" --prompt-ids 1,2,3 \
          --max-new "${MAXNEW:-4}" --ignore-eos --json --stats 2>&1 | tee "$OUT/cuda_run_${v}_${b}_$i.txt"
      done
    done
  done
fi
if has bench; then
  for v in ${VRAMS:-all}; do
  vram=(); [ "$v" = all ] || vram=(--vram-gb "$v")
  for i in $(seq 1 "${RUNS:-1}"); do
    for b in ${BINS:-deltafin}; do
      step "bench-decode run $i of $b, K3_RAM_GB=$RAM, VRAM budget $v"
      K3_RAM_GB=$RAM timeout 200 bin/$b bench-decode --dev cuda "${vram[@]}" --model "$DATA/k3s" --ram-gb "$RAM" \
        --tokens "${TOKENS_BD:-8}" --prompt-len 3 --membw-gib 0 --hbm-mib 1024 > "$OUT/bench_${b}_${v}_$i.json"
      python3 - "$OUT/bench_${b}_${v}_$i.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1])); n = d["tokens"]; rate = (d["hbm_before_bytes_per_s"] + d["hbm_after_bytes_per_s"]) / 2
if d["streamed_layers"]:
    print(f"{d['streamed_layers']} layers streamed, {d['host_tier_layers']} of them from RAM: spine read "
          f"{d['spine_read_bytes'] / n / 1e9:.2f} GB/token, wait {d['spine_wait_s'] / n:.3f} s/token; s/token "
          f"{statistics.median(d['token_s']):.3f} ({min(d['token_s']):.3f}-{max(d['token_s']):.3f}); peak RSS "
          f"{d['peak_rss_bytes'] / 2**30:.2f} GiB of {d['budget_bytes'] / 2**30:.2f}")
    print(f"spine uploads {d['gpu_spine_uploaded_bytes'] / n / 1e9:.2f} GB/token "
          f"({d['gpu_spine_upload_direct_bytes'] / max(d['gpu_spine_uploaded_bytes'], 1):.0%} from page-locked memory) "
          f"in {d['gpu_spine_upload_s'] / n:.3f} s/token (waiting {d['gpu_spine_upload_wait_s'] / n:.3f}, allocating "
          f"{d['gpu_spine_upload_alloc_s'] / n:.3f})")
bound = 72.96e9 / rate  # attention's GPU-resident weights per token at K3's size (docs/PERFORMANCE.md)
state = 2 * 69 * 96 * 128 * 128 * 4 / rate  # the 69 KDA layers' states, read and written once a token
print(f"s/token median {statistics.median(d['token_s']):.3f}; attention {d['attention_s'] / n * 1e3:.2f} ms, GPU "
      f"{d['attn_device_s'] / n * 1e3:.2f} ms = {d['attn_device_s'] / n / bound:.3f}x "
      f"({d['attn_device_s'] / n / (bound + state):.3f}x with the KDA states) of {bound * 1e3:.2f} ms at "
      f"{rate / 1e12:.3f} TB/s; experts up {d['gpu_expert_uploaded_bytes'] / n / 1e9:.2f} GB/token in "
      f"{d['gpu_expert_upload_s'] / n:.3f} s ({d.get('gpu_expert_direct_bytes', 0) / max(d['gpu_expert_uploaded_bytes'], 1):.0%} "
      f"without staging); open {d.get('open_s', 0):.1f} s; expert buffers mapped {d.get('expert_buffers_allocated', 0) / n:.1f}/token")
h2d = (d.get("h2d_pinned_before_bytes_per_s", 0) + d.get("h2d_pinned_after_bytes_per_s", 0)) / 2
if h2d > 0 and d["gpu_expert_upload_s"] > 0:
    up = d["gpu_expert_uploaded_bytes"] / d["gpu_expert_upload_s"]
    dma = d["gpu_expert_uploaded_bytes"] / max(d.get("gpu_expert_upload_dma_s", 0), 1e-9)
    print(f"pinned link {h2d / 1e9:.1f} GB/s; expert uploads {up / 1e9:.1f} GB/s of helper time = {up / h2d:.2f} of it; "
          f"DMA {dma / 1e9:.1f} GB/s = {dma / h2d:.2f}")
    # Issue 20 item 3: s/token against 1.2 x (GPU-resident bytes touched / HBM rate) + the experts' upload at the link.
    touched = d["spine_bytes_touched_per_token"] + d["expert_bytes_touched_per_token"]
    goal = 1.2 * touched / rate + d["gpu_expert_uploaded_bytes"] / n / h2d
    print(f"bound: {touched / 1e9:.1f} GB at HBM + {d['gpu_expert_uploaded_bytes'] / n / 1e9:.1f} GB at the link: goal "
          f"{goal:.3f} s/token; median s/token / goal = {statistics.median(d['token_s']) / goal:.2f}")
# Where the MoE calls and the open spent their time (docs/PERFORMANCE.md, issue 20 item 3 and 5).
if "gpu_moe_s" in d:
    print("MoE s/token: " + ", ".join(f"{k} {d['gpu_moe_' + k + '_s' if k else 'gpu_moe_s'] / n:.3f}" for k in
          ("", "reads", "queue", "overlap", "finish")).lstrip(" "))
if "open_read_wait_s" in d:
    print("open s: " + ", ".join(f"{k[5:-2] or 'total'} {d.get(k, 0):.2f}" for k in
          ("open_s", "open_read_wait_s", "open_upload_s", "open_upload_copy_s", "open_upload_wait_s",
           "open_upload_alloc_s")) + f"; kernels compile {d.get('gpu_kernels_compile_s', 0):.2f} s, load "
          f"{d.get('gpu_kernels_load_s', 0):.2f} s" + (" (from the cache)" if d.get("gpu_kernels_cached") else ""))
    print(f"open phases s: before load {d.get('open_before_load_s', 0):.2f}, load {d.get('open_load_s', 0):.2f}, after "
          f"{d.get('open_after_load_s', 0):.2f}; uploads straight from read buffers "
          f"{d.get('open_upload_direct_bytes', 0) / 1e9:.1f} GB; spine buffers mapped {d.get('open_spine_buffers_allocated', 0)}")
PY
    done
  done
  done
fi
if has pin; then
  step "pin-rate"
  timeout 200 bin/deltafin-cudabench pin-rate --mib 44 --gib ${PIN_GIB:-8} --threads 1,8 | tee "$OUT/pin_rate.txt"
  for m in 1024 17; do timeout 100 bin/deltafin-cudabench upload-from --mib $m --streams 1,2,8 | tee -a "$OUT/pin_rate.txt"
  done
fi
if has perf; then
  step "perf of bench-decode"
  mkdir -p /tmp/p && tar xzf target/devperf/perf.tgz -C /tmp/p && gunzip -c target/devperf/deltafin-sym.gz > bin/deltafin-sym
  chmod +x bin/deltafin-sym
  v=${VRAMS%% *}; vram=(); [ "$v" = all ] || vram=(--vram-gb "$v")
  PERF=(env LD_LIBRARY_PATH=/tmp/p/devperf/lib /tmp/p/devperf/perf)
  K3_RAM_GB=$RAM timeout 300 "${PERF[@]}" record -e cpu-clock -F 299 -o /tmp/perf.data -- bin/deltafin-sym bench-decode \
    --dev cuda "${vram[@]}" --model "$DATA/k3s" --ram-gb "$RAM" --tokens "${TOKENS_BD:-8}" --prompt-len 3 --membw-gib 0 \
    > "$OUT/perf_bench.json"
  "${PERF[@]}" script -i /tmp/perf.data -F tid,time,ip,sym,dso | gzip > "$OUT/perf_script.txt.gz"
fi
if has offcpu; then
  step "off-CPU profile of bench-decode"
  mkdir -p /tmp/p && tar xzf target/devperf/perf.tgz -C /tmp/p
  v=${VRAMS%% *}; vram=(); [ "$v" = all ] || vram=(--vram-gb "$v")
  PERF=(env LD_LIBRARY_PATH=/tmp/p/devperf/lib /tmp/p/devperf/perf)
  K3_RAM_GB=$RAM timeout 300 "${PERF[@]}" sched record -g -o /tmp/sched.data -- bin/deltafin bench-decode --dev cuda \
    "${vram[@]}" --model "$DATA/k3s" --ram-gb "$RAM" --tokens 1 --prompt-len 3 --membw-gib 0 > "$OUT/offcpu_bench.json"
  "${PERF[@]}" sched timehist -i /tmp/sched.data -g 2>/dev/null | gzip > "$OUT/offcpu.txt.gz"
  open_s=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["open_s"])' "$OUT/offcpu_bench.json")
  python3 scripts/offcpu_waits.py "$OUT/offcpu.txt.gz" --until "$open_s" --long 100 | tee "$OUT/offcpu_summary.txt"
fi
if has contend; then
  step "read pool alone and beside pinned uploads"
  f="$DATA/holes"; [ -e "$f" ] || truncate -s 40G "$f"
  for t in 4 8; do echo "alone, $t threads: $(bin/rpb "$f" 17547264 $t 3 layer 4194304)"; done | tee "$OUT/contend.txt"
  bin/deltafin-cudabench upload-bw --mib 1024 --reps 400 > "$OUT/contend_up.txt" & up=$!
  sleep 2
  for t in 4 8; do echo "beside uploads, $t threads: $(bin/rpb "$f" 17547264 $t 2 layer 4194304)"; done \
    | tee -a "$OUT/contend.txt"
  # The uploads alone after (a bare `wait` would also wait for the log's tee).
  wait "$up"; cat "$OUT/contend_up.txt"; bin/deltafin-cudabench upload-bw --mib 1024 --reps 20
  # The link the other way round: expert-sized copies from registered 4 KiB pages while $t threads zero holes into
  # buffers last written 400 spans (7 GB) ago, as the engine's RAM expert cache hands them back (rpb's HOLD), and
  # those reads alone.
  for t in 8 16; do echo "alone, $t threads, cold buffers: $(bin/rpb "$f" 17547264 $t 3 layer 4194304 400)"; done \
    | tee -a "$OUT/contend.txt"
  for t in 0 8 16; do
    r=; [ "$t" = 0 ] || { bin/rpb "$f" 17547264 "$t" 5 layer 4194304 400 > "$OUT/rpb_bg_$t.txt" & r=$!; sleep 3; }
    echo "uploads beside $t reading threads: $(bin/deltafin-cudabench upload-from --mib 17 --reps 301 \
      --kinds registered-4k --streams 1 | tr '\n' ' ')"
    [ -z "$r" ] || { wait "$r"; echo "  its reads: $(cat "$OUT/rpb_bg_$t.txt")"; }
  done | tee -a "$OUT/contend.txt"
fi
if has cpu; then
  step "cpu run, K3_RAM_GB=96"
  K3_RAM_GB=96 peak timeout 300 bin/deltafin run --dev cpu --model "$DATA/k3s" --prompt-ids 1,2,3 --max-new 4 \
    --ignore-eos --json --stats | tee "$OUT/cpu_run.txt"
fi
if has int8; then
  step "int8 spine: make the dense real-width model and its int8 copy"
  D="$DATA/k3d6"
  [ -d "$D" ] || timeout 300 bin/xtask make-synthetic --preset k3 --layers 6 --experts 32 --out "$D" | tail -1
  timeout 300 bin/xtask convert-spine-int8 --model "$D" | tail -1
  for i in $(seq 1 "${RUNS:-1}"); do
    for spine in ${SPINES:-bf16 int8}; do
      for v in all "${INT8_VRAM:-8}"; do
        vram=(); [ "$v" = all ] || vram=(--vram-gb "$v")
        step "bench-decode run $i, K3_SPINE=$spine, GPU budget $v"
        K3_SPINE=$spine timeout 200 bin/deltafin bench-decode --dev cuda "${vram[@]}" --model "$D" --ram-gb 40 \
          --tokens 8 --prompt-len 3 --membw-gib 0 --hbm-mib 1024 > "$OUT/int8_${spine}_${v}_$i.json"
        python3 - "$OUT/int8_${spine}_${v}_$i.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1])); n = d["tokens"]
print(f"s/token median {statistics.median(d['token_s']):.4f} ({min(d['token_s']):.4f}-{max(d['token_s']):.4f}); "
      f"attention {d['attention_s'] / n * 1e3:.2f} ms (GPU {d['attn_device_s'] / n * 1e3:.2f}); spine "
      f"{d['spine_bytes'] / 1e9:.2f} GB, streamed {d['spine_read_bytes'] / n / 1e9:.2f} GB/token, wait "
      f"{d['spine_wait_s'] / n:.4f} s; open {d['open_s']:.1f} s; "
      f"HBM {(d['hbm_before_bytes_per_s'] + d['hbm_after_bytes_per_s']) / 2e12:.2f} TB/s")
PY
      done
    done
  done
fi
if has tier; then
  D="$DATA/k3d6"
  [ -d "$D" ] || timeout 300 bin/xtask make-synthetic --preset k3 --layers 6 --experts 32 --out "$D" | tail -1
  for i in $(seq 1 "${RUNS:-1}"); do
    for pins in auto none; do
      step "bench-decode run $i, GPU budget ${INT8_VRAM:-8} GiB, --pin-layers $pins"
      K3_SPINE=bf16 timeout 200 bin/deltafin bench-decode --dev cuda --vram-gb "${INT8_VRAM:-8}" --model "$D" \
        --ram-gb 40 --pin-layers "$pins" --tokens 8 --prompt-len 3 --membw-gib 0 --hbm-mib 1024 \
        > "$OUT/tier_${pins}_$i.json"
      python3 - "$OUT/tier_${pins}_$i.json" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1])); n = d["tokens"]
h2d = (d["h2d_pinned_before_bytes_per_s"] + d["h2d_pinned_after_bytes_per_s"]) / 2
print(f"s/token median {statistics.median(d['token_s']):.4f} ({min(d['token_s']):.4f}-{max(d['token_s']):.4f}); "
      f"streamed layers {d['streamed_layers']}, from RAM {d['host_tier_layers']}; spine read "
      f"{d['spine_read_bytes'] / n / 1e9:.2f} GB/token, wait {d['spine_wait_s'] / n:.4f} s; open {d['open_s']:.1f} s "
      f"({d['open_read_bytes'] / 1e9:.2f} GB read); pinned link {h2d / 1e9:.1f} GB/s; peak RSS "
      f"{d['peak_rss_bytes'] / 2**30:.2f} GiB")
PY
    done
  done
fi
step done
