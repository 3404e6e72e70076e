//! `deltafin bench-decode` (hidden): the measured side of `cargo xtask bench`. Opens a model, prefills a short
//! prompt, decodes greedily (speculation off) and prints one JSON object with per-token times, bytes read (the
//! engine's counters and `/proc/self/io`), cache counters, the phase breakdown and peak RSS.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use deltafin_model::ProfileSnapshot;
use deltafin_runtime::{DevicePref, Engine, GenerateOptions, SpineReadStats};

use crate::engine_args::EngineArgs;
use serde::Serialize;

/// Arguments of `deltafin bench-decode`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Tokens to decode.
    #[arg(long, default_value_t = 8)]
    tokens: usize,
    #[command(flatten)]
    engine: EngineArgs,
    /// GiB of memory to read on every core before the model is opened, for the memory read bound of the same run
    /// (0: skip).
    #[arg(long, default_value_t = 2.0)]
    membw_gib: f64,
    /// GiB of memory to read on every core right before each decoded token, for a read bound beside every token
    /// (0: skip). Memory speed on a shared machine moves from minute to minute; a bound read next to each token
    /// follows it. The buffer stays allocated during decoding and is left out of `peak_rss_bytes`.
    #[arg(long, default_value_t = 0.0)]
    membw_per_token_gib: f64,
    /// MiB to copy on the GPU (device to device, and host to device from pinned memory; `--dev cuda` builds only)
    /// before the model is opened and after decoding, for the device memory and upload bounds of the same run (0:
    /// skip).
    #[arg(long, default_value_t = 0)]
    hbm_mib: usize,
    /// Experts to read through the engine's read path before decoding, for the storage read bound of the same run
    /// (0: skip).
    #[arg(long, default_value_t = 0)]
    disk_spans: usize,
    /// Read every expert into the RAM cache before decoding (whole layers, while the cache's budget allows), so
    /// that a run with every layer pinned measures compute with every weight resident.
    #[arg(long)]
    warm_experts: bool,
    /// Prompt length (token ids 1..=N).
    #[arg(long, default_value_t = 4)]
    prompt_len: usize,
}

#[derive(Serialize)]
struct Report {
    /// Experts read into the RAM cache before decoding (`--warm-experts`).
    warm_experts: usize,
    tokens: usize,
    /// Seconds for each decoded token (after the prefill and its first token).
    token_s: Vec<f64>,
    /// The all-core memory read rate measured right before each decoded token (bytes/s; empty unless
    /// `--membw-per-token-gib`).
    token_membw_bytes_per_s: Vec<f64>,
    /// Each token's time over its compute bound (weight bytes a step touches ÷ the read rate measured right before
    /// it), and their median (0 when not measured).
    token_bound_ratio: Vec<f64>,
    bound_ratio_median: f64,
    /// Expert bytes read from the device plus streamed spine bytes.
    engine_disk_bytes: u64,
    engine_disk_reads: u64,
    /// Streamed spine bytes (zero when the spine is resident).
    spine_read_bytes: u64,
    /// I/O buffers the spine reader mapped while decoding (fresh pages the kernel zeroed; 0 when every streamed
    /// layer reads into buffers it reused).
    spine_buffers_allocated: u64,
    /// I/O buffers the expert reader mapped while decoding (on a GPU each is also page-locked: a registration the
    /// reads wait for; 0 when every read reused a buffer).
    expert_buffers_allocated: u64,
    streamed_layers: usize,
    /// Of the streamed layers, those uploaded to the GPU from RAM at every pass (the host tier), not read from
    /// storage.
    host_tier_layers: usize,
    proc_read_bytes: u64,
    cache_hits: u64,
    cache_misses: u64,
    cache_budget_bytes: u64,
    expert_bytes: u64,
    spine_bytes: u64,
    peak_rss_bytes: u64,
    /// The engine's memory budget.
    budget_bytes: u64,
    /// Anonymous memory on transparent huge pages at the end.
    anon_huge_bytes: u64,
    expert_wait_s: f64,
    expert_compute_s: f64,
    attention_s: f64,
    kda_s: f64,
    /// Of `kda_s`, the dense projections.
    kda_proj_s: f64,
    mla_s: f64,
    /// Of `mla_s`, the dense projections.
    mla_proj_s: f64,
    /// Of `attention_s`, the GPU's own time (device events; zero on the CPU).
    attn_device_s: f64,
    spine_compute_s: f64,
    dense_ffn_s: f64,
    moe_trunk_s: f64,
    shared_experts_s: f64,
    head_s: f64,
    spine_wait_s: f64,
    /// Threads in the compute pool.
    threads: usize,
    /// All-core memory read rate measured in the same process just before the model is opened (bytes/s; the best
    /// of three reads).
    membw_bytes_per_s: f64,
    /// The GPU's memory rate (a device-to-device copy, reads and writes counted; bytes/s) measured before the
    /// model is opened and after decoding (0 when `--hbm-mib` is 0).
    hbm_before_bytes_per_s: f64,
    hbm_after_bytes_per_s: f64,
    /// The host-to-device link's rate from pinned memory (bytes/s), measured with the copies above.
    h2d_pinned_before_bytes_per_s: f64,
    h2d_pinned_after_bytes_per_s: f64,
    /// Seconds `Engine::open` took, and the bytes it read from storage (`/proc/self/io`).
    open_s: f64,
    open_read_bytes: u64,
    /// Of `open_s`, the seconds the load was blocked reading spine tensors, and (on a GPU) the seconds inside the
    /// spine uploads (staged, or straight from page-locked read buffers), of which copying into the staging
    /// buffers, waiting for a copy to the device and allocating device memory.
    open_read_wait_s: f64,
    open_upload_s: f64,
    open_upload_copy_s: f64,
    open_upload_wait_s: f64,
    open_upload_alloc_s: f64,
    /// Of the open's uploads, the bytes that went up straight from page-locked read buffers (no staging copy).
    open_upload_direct_bytes: u64,
    /// I/O buffers the spine reader mapped during the open (each one fresh pages, on a GPU also page-locked).
    open_spine_buffers_allocated: u64,
    /// The open's phases (`Engine::open_times`): before the model load (headers, expert map, plan, device), the
    /// load, and after it.
    open_before_load_s: f64,
    open_load_s: f64,
    open_after_load_s: f64,
    /// On a GPU, the seconds its kernels took to compile (NVRTC; 0 when they came from the kernel cache) and to load
    /// (the driver) when it was opened, and whether the kernel cache held them.
    gpu_kernels_compile_s: f64,
    gpu_kernels_load_s: f64,
    gpu_kernels_cached: bool,
    /// Expert spans read through a fresh read pool right before and right after `Engine::open` (distinct spans, none
    /// of them read by the open), bytes/s: the storage bound of the open, measured around it (0 when
    /// `--disk-spans` is 0).
    open_disk_before_bytes_per_s: f64,
    open_disk_after_bytes_per_s: f64,
    /// `open_read_bytes / open_s` over the mean of the two rates around it (0 when not measured).
    open_disk_ratio: f64,
    /// Spine bytes kept resident (read once at open).
    resident_spine_bytes: u64,
    /// Experts read from storage through the engine's read path before decoding (bytes/s; 0 when not measured).
    disk_bytes_per_s: f64,
    /// Weight bytes a decode step touches: every layer's spine, the head, one embedding row, and the routed
    /// experts asked for (per token).
    spine_bytes_touched_per_token: u64,
    expert_bytes_touched_per_token: u64,
    /// GPU expert cache (`--dev cuda`; zero on the CPU), per decoded tokens: bytes uploaded host → device, and the
    /// upload helper's wall time (reads, staging copies, queued uploads); of the bytes, those uploaded straight from
    /// page-locked read buffers.
    gpu_expert_uploaded_bytes: u64,
    gpu_expert_upload_s: f64,
    gpu_expert_direct_bytes: u64,
    /// The upload stream's own time for those bytes (device events around each expert's copies): the DMA alone.
    gpu_expert_upload_dma_s: f64,
    /// Streamed spine layers' uploads while decoding (zeros when every layer stays on the GPU): bytes, of them from
    /// page-locked memory, and the seconds inside the uploads, of which waiting for the copies and allocating.
    gpu_spine_uploaded_bytes: u64,
    gpu_spine_upload_direct_bytes: u64,
    gpu_spine_upload_s: f64,
    gpu_spine_upload_wait_s: f64,
    gpu_spine_upload_alloc_s: f64,
    /// Where the decoded tokens' GPU MoE calls spent their wall time (seconds, summed; zeros on the CPU): calls,
    /// total, the helper blocked on reads and queuing copies, the overlap work, and the finish after the helper.
    gpu_moe_calls: u64,
    gpu_moe_s: f64,
    gpu_moe_reads_s: f64,
    gpu_moe_queue_s: f64,
    gpu_moe_overlap_s: f64,
    gpu_moe_finish_s: f64,
    prefetch_reads: u64,
    prefetch_wasted: u64,
    /// Experts asked for by guessed layers, and how many were guessed.
    prefetch_wanted: u64,
    prefetch_recalled: u64,
}

/// The number after `key` on its line of the `/proc` file `file` (units such as `kB` dropped); `None` where the
/// file or the line is missing.
fn proc_value(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    })
}

/// `read_bytes` of `/proc/self/io` (0 where unavailable).
pub(crate) fn proc_read_bytes() -> u64 {
    proc_value("/proc/self/io", "read_bytes:").unwrap_or(0)
}

/// `VmHWM` of `/proc/self/status` (the peak resident set), in bytes; `None` where there is no such file.
pub fn peak_rss() -> Option<u64> {
    proc_value("/proc/self/status", "VmHWM:").map(|kb| kb * 1024)
}

/// Resets the peak resident set (`VmHWM`) to the current one (Linux: `5` written to `/proc/self/clear_refs`); a
/// no-op where that file does not exist.
fn reset_peak_rss() {
    // Best effort: without it the peak includes memory freed before the engine was opened.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// `AnonHugePages` of `/proc/self/smaps_rollup`: anonymous memory on transparent huge pages, in bytes.
fn anon_huge_bytes() -> u64 {
    proc_value("/proc/self/smaps_rollup", "AnonHugePages:").map_or(0, |kb| kb * 1024)
}

/// The prefetch counters (zero when prefetch is off).
fn pf(s: &deltafin_runtime::ExpertStats) -> deltafin_runtime::PrefetchStats {
    s.prefetch.unwrap_or_default()
}

/// The GPU's copy rate over `mib` MiB (bytes/s, reads and writes; median of 20 copies each way) and the link's rate
/// of `mib` MiB uploads from pinned memory (median of 10); zeros for 0 MiB.
fn hbm_rate(mib: usize) -> anyhow::Result<(f64, f64)> {
    if mib == 0 {
        return Ok((0.0, 0.0));
    }
    #[cfg(feature = "cuda")]
    {
        Ok((
            deltafin_runtime::device_copy_rate(mib << 20, 20)?,
            deltafin_runtime::pinned_upload_rate(mib << 20, 10)?,
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        anyhow::bail!("--hbm-mib needs a build with the `cuda` feature")
    }
}

/// The GPU expert cache's upload counters (zeros on the CPU).
#[derive(Clone, Copy, Default)]
struct GpuUploads {
    /// Bytes uploaded, and of them those that went up without staging.
    bytes: u64,
    direct_bytes: u64,
    /// The upload helper's seconds, and the upload stream's own seconds for the copies.
    helper_s: f64,
    dma_s: f64,
    /// The MoE calls' split (zeros on the CPU).
    #[cfg(feature = "cuda")]
    split: deltafin_model::gpu::MoeSplit,
    /// Spine uploads (streamed layers, once the model is open): bytes, those from page-locked memory, and the
    /// uploads' seconds, of which waiting for the copies and allocating device memory.
    spine_bytes: u64,
    spine_direct_bytes: u64,
    spine_s: f64,
    spine_wait_s: f64,
    spine_alloc_s: f64,
}

impl GpuUploads {
    /// The counters so far.
    fn of(engine: &Engine) -> Self {
        #[cfg(feature = "cuda")]
        if let Some(g) = engine.expert_cache_stats() {
            let s = engine
                .gpu_staging_stats()
                .map(|(s, _)| s)
                .unwrap_or_default();
            return Self {
                bytes: g.uploaded_bytes,
                direct_bytes: g.uploaded_direct_bytes,
                helper_s: g.upload_secs,
                dma_s: g.upload_dma_secs,
                split: g.split,
                spine_bytes: s.bytes,
                spine_direct_bytes: s.direct_bytes,
                spine_s: s.secs,
                spine_wait_s: s.wait_secs,
                spine_alloc_s: s.alloc_secs,
            };
        }
        let _ = engine;
        Self::default()
    }

    /// What was counted between `earlier` and these.
    fn since(self, earlier: Self) -> Self {
        Self {
            bytes: self.bytes - earlier.bytes,
            direct_bytes: self.direct_bytes - earlier.direct_bytes,
            helper_s: self.helper_s - earlier.helper_s,
            dma_s: self.dma_s - earlier.dma_s,
            #[cfg(feature = "cuda")]
            split: self.split.since(&earlier.split),
            spine_bytes: self.spine_bytes - earlier.spine_bytes,
            spine_direct_bytes: self.spine_direct_bytes - earlier.spine_direct_bytes,
            spine_s: self.spine_s - earlier.spine_s,
            spine_wait_s: self.spine_wait_s - earlier.spine_wait_s,
            spine_alloc_s: self.spine_alloc_s - earlier.spine_alloc_s,
        }
    }

    /// The MoE calls' split (zeros on the CPU).
    fn moe_times(&self) -> MoeTimes {
        #[cfg(feature = "cuda")]
        {
            let s = &self.split;
            MoeTimes {
                calls: s.calls,
                total: s.total,
                reads: s.reads,
                queue: s.queue,
                overlap: s.overlap,
                finish: s.finish,
            }
        }
        #[cfg(not(feature = "cuda"))]
        MoeTimes::default()
    }
}

/// Where the GPU MoE calls spent their wall time (`deltafin_model::gpu::MoeSplit`, which only a CUDA build has).
#[derive(Clone, Copy, Default)]
struct MoeTimes {
    calls: u64,
    total: f64,
    reads: f64,
    queue: f64,
    overlap: f64,
    finish: f64,
}

/// The GPU's share of the open: staged uploads (total, copies, waits for a buffer, allocations) and the kernels'
/// compile and load (zeros on the CPU).
#[derive(Clone, Copy, Default)]
struct OpenGpuTimes {
    upload: f64,
    copy: f64,
    wait: f64,
    alloc: f64,
    direct_bytes: u64,
    compile: f64,
    load: f64,
    cached: bool,
}

impl OpenGpuTimes {
    /// The counters right after the open (the staged uploads so far are the spine's; streamed layers upload later).
    fn of(engine: &Engine) -> Self {
        #[cfg(feature = "cuda")]
        if let Some((s, k)) = engine.gpu_staging_stats() {
            return Self {
                upload: s.secs,
                copy: s.copy_secs,
                wait: s.wait_secs,
                alloc: s.alloc_secs,
                direct_bytes: s.direct_bytes,
                compile: k.compile_secs,
                load: k.load_secs,
                cached: k.from_cache,
            };
        }
        let _ = engine;
        Self::default()
    }
}

/// Runs `deltafin bench-decode`.
pub fn run(args: BenchArgs, dev: Option<DevicePref>) -> anyhow::Result<()> {
    let options = args.engine.options(dev)?;
    // The read bound is measured before the model is opened and its buffer freed, and the peak resident set is
    // reset after, so `peak_rss_bytes` is the engine's own.
    let membw_rate = if args.membw_gib > 0.0 {
        let b = deltafin_runtime::membw::ReadBuffer::new(
            (args.membw_gib * (1u64 << 30) as f64) as usize,
        );
        b.read_rate().max(b.read_rate()).max(b.read_rate())
    } else {
        0.0
    };
    // The GPU probes below open the device: with the engine's kernel cache, as the engine would.
    #[cfg(feature = "cuda")]
    if args.hbm_mib > 0 {
        deltafin_runtime::shared_gpu(&options.device)?;
    }
    let hbm_before = hbm_rate(args.hbm_mib)?;
    let mut gpu_upload0 = GpuUploads::default();
    let per_token_buffer = (args.membw_per_token_gib > 0.0).then(|| {
        deltafin_runtime::membw::ReadBuffer::new(
            (args.membw_per_token_gib * (1u64 << 30) as f64) as usize,
        )
    });
    let per_token_bytes = per_token_buffer.as_ref().map_or(0, |b| b.len() as u64);
    // The open's storage bound: expert spans (which the open does not read) right before and right after it.
    let around_open = |skip: usize| -> anyhow::Result<f64> {
        if args.disk_spans == 0 {
            return Ok(0.0);
        }
        let files = deltafin_storage::ModelFiles::open(&args.model)?;
        let map = deltafin_storage::ExpertMap::build(&files)?;
        Ok(deltafin_storage::expert_spans_read_rate(
            &files,
            &map,
            skip,
            args.disk_spans,
        )?)
    };
    let open_disk_before = around_open(0)?;
    reset_peak_rss();
    let (open_io0, open_from) = (proc_read_bytes(), Instant::now());
    let engine = Engine::open(&args.model, options)
        .with_context(|| format!("opening model {}", args.model.display()))?;
    let (open_s, open_read_bytes) = (
        open_from.elapsed().as_secs_f64(),
        proc_read_bytes() - open_io0,
    );
    let open_disk_after = around_open(args.disk_spans)?;
    let open_disk_ratio = if open_disk_before + open_disk_after > 0.0 {
        open_read_bytes as f64 / open_s / ((open_disk_before + open_disk_after) / 2.0)
    } else {
        0.0
    };
    let disk_rate = if args.disk_spans > 0 {
        engine.expert_read_rate(args.disk_spans)?
    } else {
        0.0
    };
    let open_gpu = OpenGpuTimes::of(&engine);
    let warm_experts = if args.warm_experts {
        engine.warm_expert_cache()?
    } else {
        0
    };
    let prompt: Vec<u32> = (1..=args.prompt_len as u32).collect();
    let mut session = engine.session();
    let mut token_s = Vec::with_capacity(args.tokens);
    let mut token_membw = Vec::with_capacity(args.tokens);
    let mut last = Instant::now();
    // Counters start after the first token (prefill + its first token), so every number is per decoded token.
    type Start = (
        u64,
        deltafin_runtime::ExpertStats,
        ProfileSnapshot,
        SpineReadStats,
    );
    let mut start: Option<Start> = None;
    session.generate(
        &prompt,
        &GenerateOptions {
            max_new: args.tokens + 1,
            ignore_eos: true,
            ..GenerateOptions::default()
        },
        |_| {
            if start.is_none() {
                start = Some((
                    proc_read_bytes(),
                    engine.expert_stats(),
                    engine.profile(),
                    engine.spine_reads(),
                ));
                gpu_upload0 = GpuUploads::of(&engine);
            } else {
                token_s.push(last.elapsed().as_secs_f64());
            }
            if token_s.len() < args.tokens
                && let Some(b) = &per_token_buffer
            {
                token_membw.push(b.read_rate());
            }
            last = Instant::now();
            true
        },
    )?;
    let (io0, stats0, p0, spine0) = start.context("no token was generated")?;
    let hbm_after = hbm_rate(args.hbm_mib)?;
    let gpu_upload = GpuUploads::of(&engine).since(gpu_upload0);
    let moe = gpu_upload.moe_times();
    let stats = engine.expert_stats();
    let p = engine.profile().since(&p0);
    let spine = engine.spine_reads();
    let spine_read_bytes = spine.bytes - spine0.bytes;
    let cfg = engine.config();
    let expert_bytes = {
        let (w, i) = (cfg.expert_width() as u64, cfg.moe.inter as u64);
        3 * (w * i / 2 + w * i / 32)
    };
    let token_count = token_s.len();
    let spine_bytes_touched_per_token = engine.layer_spine_bytes().iter().sum::<u64>()
        + engine.head_bytes()
        + (cfg.hidden_size * 2) as u64;
    let expert_bytes_touched_per_token =
        (stats.cache.hits + stats.cache.misses - stats0.cache.hits - stats0.cache.misses)
            * expert_bytes
            / token_count.max(1) as u64;
    let touched = (spine_bytes_touched_per_token + expert_bytes_touched_per_token) as f64;
    let token_bound_ratio: Vec<f64> = token_s
        .iter()
        .zip(&token_membw)
        .map(|(s, rate)| s / (touched / rate))
        .collect();
    let bound_ratio_median = {
        let mut v = token_bound_ratio.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let report = Report {
        warm_experts,
        tokens: token_s.len(),
        token_s,
        token_membw_bytes_per_s: token_membw,
        token_bound_ratio,
        bound_ratio_median,
        engine_disk_bytes: stats.reader.disk.device_bytes - stats0.reader.disk.device_bytes
            + spine_read_bytes,
        engine_disk_reads: stats.reader.disk.reads - stats0.reader.disk.reads + spine.reads
            - spine0.reads,
        spine_read_bytes,
        spine_buffers_allocated: spine.buffers_allocated - spine0.buffers_allocated,
        expert_buffers_allocated: stats.reader.disk.buffers_allocated
            - stats0.reader.disk.buffers_allocated,
        streamed_layers: engine.streamed_layers().len(),
        host_tier_layers: engine.host_tier_layers().len(),
        proc_read_bytes: proc_read_bytes() - io0,
        cache_hits: stats.cache.hits - stats0.cache.hits,
        cache_misses: stats.cache.misses - stats0.cache.misses,
        cache_budget_bytes: stats.cache.budget,
        expert_bytes,
        spine_bytes: engine.spine_bytes(),
        peak_rss_bytes: peak_rss().unwrap_or(0).saturating_sub(per_token_bytes),
        budget_bytes: engine.memory_budget(),
        anon_huge_bytes: anon_huge_bytes(),
        expert_wait_s: p.expert_wait.as_secs_f64(),
        expert_compute_s: p.expert_compute.as_secs_f64(),
        attention_s: p.attention().as_secs_f64(),
        kda_s: p.kda.as_secs_f64(),
        kda_proj_s: p.kda_proj.as_secs_f64(),
        mla_s: p.mla.as_secs_f64(),
        mla_proj_s: p.mla_proj.as_secs_f64(),
        attn_device_s: p.attn_device.as_secs_f64(),
        spine_compute_s: p.spine_compute().as_secs_f64(),
        dense_ffn_s: p.dense_ffn.as_secs_f64(),
        moe_trunk_s: p.moe_trunk.as_secs_f64(),
        shared_experts_s: p.shared_experts.as_secs_f64(),
        head_s: p.head.as_secs_f64(),
        threads: deltafin_runtime::compute_threads(),
        membw_bytes_per_s: membw_rate,
        hbm_before_bytes_per_s: hbm_before.0,
        hbm_after_bytes_per_s: hbm_after.0,
        h2d_pinned_before_bytes_per_s: hbm_before.1,
        h2d_pinned_after_bytes_per_s: hbm_after.1,
        disk_bytes_per_s: disk_rate,
        open_s,
        open_read_wait_s: engine.open_reads().wait_secs,
        open_upload_s: open_gpu.upload,
        open_upload_copy_s: open_gpu.copy,
        open_upload_wait_s: open_gpu.wait,
        open_upload_alloc_s: open_gpu.alloc,
        open_upload_direct_bytes: open_gpu.direct_bytes,
        open_spine_buffers_allocated: engine.open_reads().buffers_allocated,
        open_before_load_s: engine.open_times().before_load_secs,
        open_load_s: engine.open_times().load_secs,
        open_after_load_s: engine.open_times().after_load_secs,
        gpu_kernels_compile_s: open_gpu.compile,
        gpu_kernels_load_s: open_gpu.load,
        gpu_kernels_cached: open_gpu.cached,
        open_read_bytes,
        open_disk_before_bytes_per_s: open_disk_before,
        open_disk_after_bytes_per_s: open_disk_after,
        open_disk_ratio,
        resident_spine_bytes: engine.memory_plan().fixed_spine + engine.memory_plan().pinned_layers,
        spine_bytes_touched_per_token,
        expert_bytes_touched_per_token,
        spine_wait_s: p.spine_wait.as_secs_f64(),
        gpu_expert_uploaded_bytes: gpu_upload.bytes,
        gpu_expert_upload_s: gpu_upload.helper_s,
        gpu_expert_direct_bytes: gpu_upload.direct_bytes,
        gpu_expert_upload_dma_s: gpu_upload.dma_s,
        gpu_spine_uploaded_bytes: gpu_upload.spine_bytes,
        gpu_spine_upload_direct_bytes: gpu_upload.spine_direct_bytes,
        gpu_spine_upload_s: gpu_upload.spine_s,
        gpu_spine_upload_wait_s: gpu_upload.spine_wait_s,
        gpu_spine_upload_alloc_s: gpu_upload.spine_alloc_s,
        gpu_moe_calls: moe.calls,
        gpu_moe_s: moe.total,
        gpu_moe_reads_s: moe.reads,
        gpu_moe_queue_s: moe.queue,
        gpu_moe_overlap_s: moe.overlap,
        gpu_moe_finish_s: moe.finish,
        prefetch_reads: pf(&stats).reads - pf(&stats0).reads,
        prefetch_wasted: pf(&stats).wasted - pf(&stats0).wasted,
        prefetch_wanted: pf(&stats).wanted - pf(&stats0).wanted,
        prefetch_recalled: pf(&stats).recalled - pf(&stats0).recalled,
    };
    crate::out::emit(&serde_json::to_string(&report)?)?;
    Ok(())
}
