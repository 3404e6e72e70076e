//! `deltafin bench-prefill`: time to first token of a long prompt against its storage and compute bounds, measured
//! in the same run (issue 19's benchmark; `docs/PERFORMANCE.md`).
//!
//! The prompt (ids 1..=N, cycled through a prime stride so tokens differ) is fed once per pass length asked for
//! (`--chunks auto,64,…`; `auto` is the engine's own), each into a fresh session, with the expert cache emptied
//! first. For each: the time, the bytes read (the engine's counters, `/proc/self/io` and the model's block device in
//! `/proc/diskstats`), the distinct experts the prompt used, and the bounds:
//! - I/O bound = (distinct experts × expert bytes + the streamed spine once) ÷ the storage rate, that rate read
//!   right before and after the prefills through a fresh read pool (`--disk-spans` expert spans), the faster of the
//!   two;
//! - compute bound = the prompt's FLOP ÷ the f32 FMA peak of every core (`quant::flops`), read right before and
//!   after too, the faster of the two. FLOP: 2 per weight and token for every dense spine matrix of every layer and
//!   the `top_k` experts of every MoE layer, the head once, the KDA recurrence (7·H·D² per token and layer) and
//!   MLA's attention over the prompt (per query at position p and head: q·W_uk, p scores of kv_lora + rope, p context
//!   rows, W_uv).

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use deltafin_model::{AttnKind, DevicePref};
use deltafin_runtime::Engine;
use serde::Serialize;

use crate::engine_args::EngineArgs;

/// `deltafin bench-prefill`.
#[derive(Args, Debug)]
pub struct BenchPrefillArgs {
    /// Model directory.
    #[arg(long)]
    model: std::path::PathBuf,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Pass lengths to compare, in order: `auto` (the engine's) or a count; `1` is token by token.
    #[arg(long, default_value = "auto,64", value_delimiter = ',')]
    chunks: Vec<String>,
    /// Expert spans read through a fresh read pool before and after the prefills, for the storage rate (0: skip).
    #[arg(long, default_value_t = 48)]
    disk_spans: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Serialize)]
struct Run {
    /// Tokens per pass.
    chunk: usize,
    passes: u64,
    ttft_s: f64,
    /// Bytes read by the engine (expert spans from the device, streamed spine) and by the process (`/proc/self/io`).
    engine_read_bytes: u64,
    proc_read_bytes: u64,
    /// Bytes the model's block device delivered during the pass (`/proc/diskstats`: every process's reads of that
    /// device; null where the model's filesystem has no device there).
    device_read_bytes: Option<u64>,
    distinct_experts: u64,
    /// Distinct experts × expert bytes + the streamed spine once.
    needed_bytes: u64,
    io_bound_s: f64,
    compute_bound_s: f64,
    /// `ttft_s ÷ max(1.2 × io_bound_s, 2 × compute_bound_s)`: at most 1 meets issue 19's goal.
    goal_ratio: f64,
    expert_compute_s: f64,
    expert_wait_s: f64,
    spine_wait_s: f64,
    attention_s: f64,
    /// Of `attention_s`: KDA blocks and their dense projections, MLA blocks and theirs (what is left of a kind's
    /// time after its projections is its attention proper: KDA's conv, gates, recurrence and norm; MLA's attention
    /// over the latent cache).
    kda_s: f64,
    kda_proj_s: f64,
    mla_s: f64,
    mla_proj_s: f64,
    spine_compute_s: f64,
    /// Of `spine_compute_s`: shared experts, dense FFN layers, the MoE trunk (router, latent projections, norm and
    /// combine) and the rest (embedding, mixes, head).
    shared_experts_s: f64,
    dense_ffn_s: f64,
    moe_trunk_s: f64,
    head_s: f64,
    /// Expert read buffers mapped afresh during the pass (each a page-fault and zeroing of its pages; the rest of
    /// the reads reused a buffer), and the expert cache's budget at the end of the pass.
    expert_buffers_allocated: u64,
    expert_cache_budget_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    prompt_len: usize,
    /// The model's block device in `/proc/diskstats` (null: none, and `device_read_bytes` is null too).
    device: Option<String>,
    flop: f64,
    /// Of `flop`, KDA's recurrence and MLA's attention over the latent cache (to hold `kda_s - kda_proj_s` and
    /// `mla_s - mla_proj_s` against).
    kda_attention_flop: f64,
    mla_attention_flop: f64,
    /// Storage rate before and after the runs (bytes/s), and FMA peak before and after (FLOP/s, each the best of
    /// three probes).
    disk_before_bytes_per_s: f64,
    disk_after_bytes_per_s: f64,
    fma_peak_before: f64,
    fma_peak_after: f64,
    threads: usize,
    runs: Vec<Run>,
}

/// A prompt's FLOP: all of it, and the attention proper of each kind (summed over its layers) apart.
#[derive(Clone, Copy, Debug, Default)]
struct PromptFlop {
    total: f64,
    /// KDA's recurrence ([`deltafin_model::kda_recurrence::recurrence_flops`]).
    kda_attention: f64,
    /// MLA's attention over the latent cache: the absorbed query and output products and the scores and context
    /// over the positions each query sees.
    mla_attention: f64,
}

/// The FLOP of a prompt of `t` tokens through `engine`'s model (see the module header).
fn prompt_flop(engine: &Engine, t: usize) -> PromptFlop {
    let cfg = engine.config();
    let t_f = t as f64;
    // Dense spine weights per layer: their stored bytes over bytes per weight (2 for bf16, 1 for the int8 copy).
    let per_weight = if engine.spine_is_int8() { 1.0 } else { 2.0 };
    let spine: f64 = engine
        .layer_spine_bytes()
        .iter()
        .map(|&b| b as f64 / per_weight)
        .sum();
    let expert = 3.0 * cfg.expert_width() as f64 * cfg.moe.inter as f64;
    let moe_layers = (0..cfg.n_layers).filter(|&l| cfg.is_moe_layer(l)).count() as f64;
    let mut flop = PromptFlop {
        total: 2.0 * t_f * (spine + moe_layers * cfg.moe.top_k as f64 * expert)
            + 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64,
        ..PromptFlop::default()
    };
    let m = &cfg.mla;
    for kind in &cfg.layer_kinds {
        match kind {
            AttnKind::Kda => {
                flop.kda_attention += cfg.kda.n_heads as f64
                    * deltafin_model::kda_recurrence::recurrence_flops(t, cfg.kda.head_dim) as f64
            }
            AttnKind::Mla => {
                flop.mla_attention += m.n_heads as f64
                    * deltafin_model::mla_attend::prompt_flops(
                        t,
                        (m.kv_lora_rank, m.rope_dim, m.nope_dim, m.v_dim),
                    )
            }
        }
    }
    flop.total += flop.kda_attention + flop.mla_attention;
    flop
}

/// The storage rate through a fresh read pool over `spans` expert spans from the `skip`-th (0 when `spans` is 0).
fn disk_rate(engine: &Engine, skip: usize, spans: usize) -> anyhow::Result<f64> {
    if spans == 0 {
        return Ok(0.0);
    }
    let files = deltafin_storage::ModelFiles::open(engine.dir())?;
    let map = deltafin_storage::ExpertMap::build(&files)?;
    Ok(deltafin_storage::expert_spans_read_rate(
        &files, &map, skip, spans,
    )?)
}

/// Runs `deltafin bench-prefill`.
pub fn run(args: BenchPrefillArgs, dev: Option<DevicePref>) -> anyhow::Result<()> {
    let options = args.engine.options(dev)?;
    let engine = Engine::open(&args.model, options)
        .with_context(|| format!("opening model {}", args.model.display()))?;
    let vocab = engine.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..args.prompt_len as u32)
        .map(|i| 1 + (i * 7919) % (vocab - 1))
        .collect();
    let chunks: Vec<usize> = args
        .chunks
        .iter()
        .map(|c| match c.trim() {
            "auto" => Ok(engine.prefill_chunk()),
            n => n.parse().context("--chunks: auto or a count"),
        })
        .collect::<anyhow::Result<_>>()?;
    let flop = prompt_flop(&engine, prompt.len());
    let peak = || deltafin_runtime::flops::best_fma_peak(3, 20_000_000);
    let (fma_before, disk_before) = (peak(), disk_rate(&engine, 0, args.disk_spans)?);
    let streamed: u64 = engine
        .layer_spine_bytes()
        .iter()
        .zip(&engine.memory_plan().resident)
        .filter(|(_, r)| !**r)
        .map(|(b, _)| b)
        .sum();
    let expert_bytes = engine.expert_bytes();
    let device = crate::diskstats::DiskCounter::for_path(&args.model);
    let device_bytes = || device.as_ref().and_then(|d| d.read_bytes());
    let mut runs = Vec::new();
    for chunk in chunks {
        engine.clear_expert_cache();
        engine.reset_expert_reads();
        let mut session = engine.session();
        session.limit_prefill_chunk(chunk);
        let (p0, io0, eng0, bufs0, dev0) = (
            engine.profile(),
            crate::bench::proc_read_bytes(),
            engine.read_bytes(),
            engine.expert_stats().reader.disk.buffers_allocated,
            device_bytes(),
        );
        let from = Instant::now();
        session.prefill_last(&prompt)?;
        let ttft_s = from.elapsed().as_secs_f64();
        let p = engine.profile().since(&p0);
        let distinct: u64 = engine
            .expert_reads()
            .distinct
            .iter()
            .map(|s| s.len() as u64)
            .sum();
        runs.push(Run {
            chunk: chunk.min(engine.prefill_chunk()),
            passes: session.stats().passes,
            ttft_s,
            engine_read_bytes: engine.read_bytes() - eng0,
            proc_read_bytes: crate::bench::proc_read_bytes() - io0,
            device_read_bytes: device_bytes()
                .zip(dev0)
                .map(|(now, then)| now.saturating_sub(then)),
            distinct_experts: distinct,
            needed_bytes: distinct * expert_bytes + streamed,
            io_bound_s: 0.0,
            compute_bound_s: 0.0,
            goal_ratio: 0.0,
            expert_compute_s: p.expert_compute.as_secs_f64(),
            expert_wait_s: p.expert_wait.as_secs_f64(),
            spine_wait_s: p.spine_wait.as_secs_f64(),
            attention_s: p.attention().as_secs_f64(),
            kda_s: p.kda.as_secs_f64(),
            kda_proj_s: p.kda_proj.as_secs_f64(),
            mla_s: p.mla.as_secs_f64(),
            mla_proj_s: p.mla_proj.as_secs_f64(),
            spine_compute_s: p.spine_compute().as_secs_f64(),
            shared_experts_s: p.shared_experts.as_secs_f64(),
            dense_ffn_s: p.dense_ffn.as_secs_f64(),
            moe_trunk_s: p.moe_trunk.as_secs_f64(),
            head_s: p.head.as_secs_f64(),
            expert_buffers_allocated: engine.expert_stats().reader.disk.buffers_allocated - bufs0,
            expert_cache_budget_bytes: engine.expert_stats().cache.budget,
        });
    }
    let (fma_after, disk_after) = (
        peak(),
        disk_rate(&engine, args.disk_spans, args.disk_spans)?,
    );
    // The faster reading of each, for the reason the probes take their best: a slow moment of a shared machine would
    // lower a rate, lengthen a bound and make the goal look easier than it is.
    let disk = disk_before.max(disk_after);
    let fma = fma_before.max(fma_after);
    for r in &mut runs {
        r.io_bound_s = if disk > 0.0 {
            r.needed_bytes as f64 / disk
        } else {
            0.0
        };
        r.compute_bound_s = flop.total / fma;
        r.goal_ratio = r.ttft_s / (1.2 * r.io_bound_s).max(2.0 * r.compute_bound_s);
    }
    let report = Report {
        prompt_len: prompt.len(),
        device: device.map(|d| d.name().to_string()),
        flop: flop.total,
        kda_attention_flop: flop.kda_attention,
        mla_attention_flop: flop.mla_attention,
        disk_before_bytes_per_s: disk_before,
        disk_after_bytes_per_s: disk_after,
        fma_peak_before: fma_before,
        fma_peak_after: fma_after,
        threads: deltafin_runtime::compute_threads(),
        runs,
    };
    crate::out::emit(&serde_json::to_string(&report)?)?;
    Ok(())
}
