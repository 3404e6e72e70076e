//! `cargo xtask bench --model DIR --mem-cap-gb G --tokens N [--runs R] [--json]`: decode inside a memory cap,
//! next to the disk's O_DIRECT bandwidth for the same read pattern measured in the same run.
//!
//! Method (docs/benchmarks.md): the engine runs in a child process (`deltafin bench-decode`) placed in a cgroup-v1
//! memory cgroup whose limit counts page cache, as RAM does on a laptop; the page cache is dropped before every
//! run; one warm-up run, then `runs` counted runs. The bound for a token is the bytes that token had to read
//! (experts missed by the RAM cache, plus the streamed spine layers when the spine does not fit the budget) divided
//! by the disk's bandwidth, measured right before every run as the faster of the storage read pool reading random
//! expert spans with a full queue and fio's O_DIRECT random reads of expert-sized blocks. The engine gets the cap
//! minus a headroom as its RAM budget for weights (`--ram-gb`): the resident spine first, the expert cache the rest.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use deltafin_storage::{ExpertMap, ModelFiles, PoolFile, ReadPool, ReadPoolOptions, ReadRequest};
use serde_json::{Value, json};

/// Arguments of `bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory (for example `cargo xtask make-synthetic --preset large`).
    #[arg(long)]
    model: PathBuf,
    /// Memory cap for the engine process, in GiB (page cache included).
    #[arg(long, default_value_t = 4.0)]
    mem_cap_gb: f64,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 8)]
    tokens: usize,
    /// Counted runs (after one warm-up).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Look-ahead expert prefetch in the engine (`on` or `off`).
    #[arg(long, default_value = "off")]
    prefetch: String,
    /// How routed experts read their inputs in the engine (`f32`, `bf16` or `i16`).
    #[arg(long, default_value = "f32")]
    expert_input: String,
}

const CGROUP: &str = "/sys/fs/cgroup/memory/deltafin-bench";
/// Memory of the cgroup kept out of the engine's budget for the process itself and the page cache the cgroup
/// counts (the budget covers the engine's buffers, state and scratch).
const HEADROOM_GIB: f64 = 0.75;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn drop_caches() -> anyhow::Result<()> {
    Command::new("sync").status().context("sync")?;
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("dropping the page cache (needs root)")?;
    Ok(())
}

/// The storage bound, measured just before each decode run so both see the same disk.
#[derive(Clone, Copy, Debug)]
struct DiskBound {
    /// Our read pool (O_DIRECT, 4 reads in flight) over random expert spans, queue kept full.
    pool_bps: f64,
    /// `fio --direct=1 --ioengine=libaio --rw=randread --bs=<expert span> --iodepth=4` over the shards, if fio is
    /// installed.
    fio_bps: Option<f64>,
}

impl DiskBound {
    /// The faster of the two: the stricter bound for the engine.
    fn bps(&self) -> f64 {
        self.pool_bps.max(self.fio_bps.unwrap_or(0.0))
    }
}

/// Random expert spans read back to back through the read pool (one submission, so the queue never drains between
/// layers), after dropping the page cache.
fn pool_bandwidth(model: &Path, top_k: usize, seed: u64) -> anyhow::Result<f64> {
    let files = ModelFiles::open(model)?;
    let map = ExpertMap::build(&files)?;
    let handles: Vec<Arc<PoolFile>> = files
        .shards()
        .iter()
        .map(|s| PoolFile::open(&s.path, true).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let pool = ReadPool::new(&ReadPoolOptions::default())?;
    let layers = map.layers();
    let mut rng = 0x2545_f491_4f6c_dd1du64 ^ seed;
    let mut next = |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    // About as many bytes as a few tokens read.
    let reqs: Vec<ReadRequest> = (0..8 * top_k)
        .map(|tag| {
            let layer = layers[next(layers.len())];
            let span = map.span(layer, next(map.n_experts(layer)))?;
            Ok(ReadRequest {
                tag,
                file: Arc::clone(&handles[span.shard]),
                offset: span.offset,
                len: span.len,
                expect_crc: None,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    drop_caches()?;
    let started = Instant::now();
    let mut bytes = 0u64;
    for done in pool.submit(reqs) {
        bytes += done.result?.len() as u64;
    }
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// fio's random-read bandwidth over the model's shards with expert-sized blocks; `None` without fio.
fn fio_bandwidth(model: &Path, block: u64) -> anyhow::Result<Option<f64>> {
    let files = ModelFiles::open(model)?;
    let names: Vec<String> = files
        .shards()
        .iter()
        .map(|s| s.path.display().to_string().replace(':', "\\:"))
        .collect();
    drop_caches()?;
    let out = match Command::new("fio")
        .args([
            "--name=bound",
            "--direct=1",
            "--ioengine=libaio",
            "--rw=randread",
            "--iodepth=4",
            "--runtime=3",
            "--time_based",
            "--output-format=json",
        ])
        .arg(format!("--bs={}", block.next_multiple_of(4096)))
        .arg(format!("--filename={}", names.join(":")))
        .output()
    {
        Ok(out) if out.status.success() => out,
        Ok(_) | Err(_) => return Ok(None),
    };
    let v: Value = serde_json::from_slice(&out.stdout).context("fio's JSON output")?;
    Ok(v["jobs"][0]["read"]["bw_bytes"].as_f64())
}

/// One capped run of `deltafin bench-decode`.
fn capped_run(bin: &Path, args: &BenchArgs, ram_gb: f64) -> anyhow::Result<Value> {
    drop_caches()?;
    let capped = Path::new(CGROUP).is_dir();
    let mut cmd = if capped {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > {CGROUP}/cgroup.procs && exec \"$0\" \"$@\""
            ))
            .arg(bin);
        c
    } else {
        Command::new(bin)
    };
    let out = cmd
        .args(["bench-decode", "--model"])
        .arg(&args.model)
        .args([
            "--tokens",
            &args.tokens.to_string(),
            "--ram-gb",
            &format!("{ram_gb:.3}"),
            "--prefetch",
            &args.prefetch,
            "--expert-input",
            &args.expert_input,
        ])
        .output()
        .context("running deltafin bench-decode")?;
    if !out.status.success() {
        bail!(
            "bench-decode failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Runs the benchmark.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let cap = (args.mem_cap_gb * (1u64 << 30) as f64) as u64;
    let root = std::fs::create_dir_all(CGROUP).is_ok()
        && std::fs::write(format!("{CGROUP}/memory.limit_in_bytes"), cap.to_string()).is_ok();
    if !root {
        eprintln!(
            "warning: cannot create the cgroup-v1 memory cgroup {CGROUP} (root needed): running uncapped"
        );
    }
    let bin = crate::deltafin::deltafin_binary()?;
    let spine = deltafin_runtime::spine_bytes(&ModelFiles::open(&args.model)?);
    // Only the config is needed here: opening an engine would load the whole spine.
    let top_k = deltafin_model::ModelConfig::from_file(&args.model.join("config.json"))?
        .moe
        .top_k;
    // The engine charges the resident spine to this budget itself and streams the layers that do not fit; it refuses
    // a budget over MAX_RAM_SHARE of the cgroup's limit, which a large cap less the fixed headroom would ask for.
    let ram_gb = (args.mem_cap_gb - HEADROOM_GIB)
        .min(args.mem_cap_gb * deltafin_runtime::MAX_RAM_SHARE)
        .max(0.0);
    let block = {
        let files = ModelFiles::open(&args.model)?;
        let map = ExpertMap::build(&files)?;
        let layer = map.layers().first().copied().unwrap_or(0);
        map.span(layer, 0).map(|s| s.len).unwrap_or(16 << 20)
    };

    // The disk bound is measured right before every run (this machine's disk and memory vary by tens of per cent
    // from minute to minute), and each run is compared with its own bound.
    let mut runs = Vec::new();
    let mut bounds = Vec::new();
    for i in 0..=args.runs {
        let bound = DiskBound {
            pool_bps: pool_bandwidth(&args.model, top_k, i as u64)?,
            fio_bps: fio_bandwidth(&args.model, block)?,
        };
        let r = capped_run(&bin, &args, ram_gb)?;
        if i > 0 {
            runs.push(r);
            bounds.push(bound);
        }
    }
    let bandwidth = median(bounds.iter().map(DiskBound::bps).collect());
    let per_run = |f: &dyn Fn(&Value) -> f64| median(runs.iter().map(f).collect());
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    // Decode tokens only (bench-decode starts its clocks and counters after the prefill's token).
    let s_per_token = |v: &Value| {
        let t: Vec<f64> = v["token_s"]
            .as_array()
            .map_or(Vec::new(), |a| a.iter().filter_map(Value::as_f64).collect());
        median(t)
    };
    let tokens = |v: &Value| num(v, "tokens").max(1.0);
    // Experts missed by the RAM cache (a prefetched expert counts as a miss: the token read it, only earlier),
    // plus the streamed spine.
    let needed = |v: &Value| {
        (num(v, "cache_misses") * num(v, "expert_bytes") + num(v, "spine_read_bytes")) / tokens(v)
    };
    let engine_bytes = |v: &Value| num(v, "engine_disk_bytes") / tokens(v);
    let proc_bytes = |v: &Value| num(v, "proc_read_bytes") / tokens(v);
    let all_token_s: Vec<f64> = runs.iter().map(s_per_token).collect();
    let s_tok = median(all_token_s.clone());
    let need = per_run(&needed);
    let bound = need / bandwidth;
    let prefetch_recall = {
        let wanted: f64 = runs.iter().map(|v| num(v, "prefetch_wanted")).sum();
        let recalled: f64 = runs.iter().map(|v| num(v, "prefetch_recalled")).sum();
        if wanted > 0.0 { recalled / wanted } else { 0.0 }
    };
    // Each run against the bound measured just before it.
    let run_ratios: Vec<f64> = runs
        .iter()
        .zip(&bounds)
        .map(|(r, b)| s_per_token(r) / (needed(r) / b.bps()).max(1e-12))
        .collect();
    let report = json!({
        "model": args.model,
        "mem_cap_gib": args.mem_cap_gb,
        "capped": root,
        "weights_budget_gib": ram_gb,
        "spine_bytes": spine,
        "disk_bandwidth_gbs": bandwidth / 1e9,
        "disk_pool_gbs": bounds.iter().map(|b| b.pool_bps / 1e9).collect::<Vec<_>>(),
        "disk_fio_gbs": bounds.iter().map(|b| b.fio_bps.map(|v| v / 1e9)).collect::<Vec<_>>(),
        "run_ratios_to_own_bound": run_ratios,
        "prefetch": args.prefetch,
        "expert_input": args.expert_input,
        "prefetch_recall": prefetch_recall,
        "prefetch_wasted_reads_per_token": per_run(&|v| num(v, "prefetch_wasted") / tokens(v)),
        "ratio_median_of_runs": median(run_ratios.clone()),
        "runs": args.runs,
        "tokens_per_run": args.tokens,
        "s_per_token_median": s_tok,
        "s_per_token_min": all_token_s.iter().cloned().fold(f64::INFINITY, f64::min),
        "s_per_token_max": all_token_s.iter().cloned().fold(0.0, f64::max),
        "needed_bytes_per_token": need,
        "engine_bytes_per_token": per_run(&engine_bytes),
        "proc_bytes_per_token": per_run(&proc_bytes),
        "achieved_gbs": per_run(&engine_bytes) / s_tok / 1e9,
        "io_bound_s_per_token": bound,
        "ratio_to_io_bound": s_tok / bound.max(1e-12),
        "bytes_ratio_to_needed": per_run(&engine_bytes) / need.max(1.0),
        "peak_rss_bytes": per_run(&|v| num(v, "peak_rss_bytes")),
        "peak_rss_to_cap": per_run(&|v| num(v, "peak_rss_bytes")) / cap as f64,
        "breakdown_s_per_token": {
            "expert_wait": per_run(&|v| num(v, "expert_wait_s") / tokens(v)),
            "expert_compute": per_run(&|v| num(v, "expert_compute_s") / tokens(v)),
            "attention": per_run(&|v| num(v, "attention_s") / tokens(v)),
            "spine_compute": per_run(&|v| num(v, "spine_compute_s") / tokens(v)),
            "spine_wait": per_run(&|v| num(v, "spine_wait_s") / tokens(v)),
        },
        "spine_read_bytes_per_token": per_run(&|v| num(v, "spine_read_bytes") / tokens(v)),
        "raw": runs,
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "decode {:.3} s/token (median of {} runs, range {:.3}-{:.3}); I/O bound {:.3} s/token \
             ({:.2} GB needed / {:.2} GB/s) -> ratio {:.2}",
            s_tok,
            args.runs,
            report["s_per_token_min"].as_f64().unwrap_or(0.0),
            report["s_per_token_max"].as_f64().unwrap_or(0.0),
            bound,
            need / 1e9,
            bandwidth / 1e9,
            s_tok / bound.max(1e-12)
        );
        println!(
            "bytes/token: engine {:.2} GB, /proc/self/io {:.2} GB, needed {:.2} GB ({:.3}x); peak RSS {:.2} GiB of a {:.1} GiB cap",
            per_run(&engine_bytes) / 1e9,
            per_run(&proc_bytes) / 1e9,
            need / 1e9,
            per_run(&engine_bytes) / need.max(1.0),
            per_run(&|v| num(v, "peak_rss_bytes")) / (1u64 << 30) as f64,
            args.mem_cap_gb
        );
        println!(
            "per run against the bound measured just before it: {:?} (median {:.2}); disk GB/s pool {}, fio {}",
            run_ratios
                .iter()
                .map(|r| (r * 100.0).round() / 100.0)
                .collect::<Vec<_>>(),
            median(run_ratios.clone()),
            report["disk_pool_gbs"],
            report["disk_fio_gbs"]
        );
        if args.prefetch == "on" {
            println!(
                "prefetch: recall {:.1}%, {:.1} wasted reads per token",
                100.0 * report["prefetch_recall"].as_f64().unwrap_or(0.0),
                report["prefetch_wasted_reads_per_token"]
                    .as_f64()
                    .unwrap_or(0.0)
            );
        }
        println!("breakdown (s/token): {}", report["breakdown_s_per_token"]);
    }
    Ok(())
}
