//! `deltafin run`: generation after a prompt of token ids (greedy by default, with lossless n-gram speculation).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use deltafin_runtime::{DevicePref, Engine, GenerateOptions, SamplingParams, Session};

use crate::engine_args::EngineArgs;

use crate::text::{TextMode, TextPrinter};
use serde::Serialize;

use crate::demo;
use crate::ids::parse_ids;

/// Arguments of `deltafin run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model directory (default: the installed model under DELTAFIN_ROOT, else the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Comma-separated prompt token ids.
    #[arg(long, conflicts_with = "prompt")]
    prompt_ids: Option<String>,
    /// Prompt text (encoded with the model's tokenizer).
    #[arg(long)]
    prompt: Option<String>,
    /// Treat `--prompt` as a user message in K3's chat format; reasoning and answer are shown apart.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// Chat without the thinking phase.
    #[arg(long, requires = "chat")]
    no_thinking: bool,
    /// Thinking effort announced to the model (low, high, max).
    #[arg(long, requires = "chat")]
    effort: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// Do not stop at the end-of-turn token.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of plain ids.
    #[arg(long)]
    json: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampling stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// n-gram speculation for greedy decoding (lossless).
    #[arg(long, env = "K3_SPEC", default_value = "on", value_parser = crate::engine_args::parse_on_off, action = clap::ArgAction::Set)]
    spec: bool,
    /// Draft tokens verified per pass.
    #[arg(long, env = "K3_SPEC_DEPTH", default_value_t = 1)]
    spec_depth: usize,
    /// Restore this snapshot first; the prompt then continues it.
    #[arg(long)]
    load_snapshot: Option<PathBuf>,
    /// Save the session (prompt and generated tokens) to this file at the end.
    #[arg(long)]
    save_snapshot: Option<PathBuf>,
    /// Print per-run counters to stderr.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Serialize)]
struct RunReport {
    prompt_ids: Vec<u32>,
    new_ids: Vec<u32>,
}

/// Runs `deltafin run`.
pub fn run(args: RunArgs, dev: Option<DevicePref>) -> anyhow::Result<()> {
    let (model_dir, engine) = args.engine.open(args.model.as_deref(), dev)?;
    if let Some(missing) = engine.missing_experts() {
        eprintln!(
            "warning: streaming install: {} experts ({:.1} GB) are not local yet and will be fetched as \
             they are needed; `deltafin setup fetch-experts-all` fetches them all",
            missing.experts,
            missing.bytes as f64 / 1e9
        );
    }
    let (prompt, text_mode) = match (&args.prompt_ids, &args.prompt) {
        (Some(text), _) => (parse_ids(text)?, None),
        (None, Some(text)) => {
            let mode = if args.chat {
                TextMode::Chat {
                    thinking: !args.no_thinking,
                    effort: args.effort.clone(),
                }
            } else {
                TextMode::Plain
            };
            let ids = crate::text::encode_prompt(&engine, text, &mode)?;
            (ids, Some(mode))
        }
        (None, None) if demo::is_demo(&model_dir) => (demo::DEMO_PROMPT_IDS.to_vec(), None),
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let mut session = engine.session();
    session.set_progress(crate::progress::prefill_bar());
    if let Some(path) = &args.load_snapshot {
        session
            .load_snapshot(path)
            .with_context(|| format!("loading snapshot {}", path.display()))?;
    }
    let opts = GenerateOptions {
        max_new: args.max_new,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
        },
        ignore_eos: args.ignore_eos,
        stop_tokens: Vec::new(),
        speculation_depth: if args.spec { args.spec_depth } else { 0 },
    };
    let started = std::time::Instant::now();
    let stop = crate::text::ctrl_c_flag();
    let keep_going = || !stop.load(std::sync::atomic::Ordering::Relaxed);
    let new_ids = if args.json {
        session.generate(&prompt, &opts, |_| keep_going())?.tokens
    } else if let Some(mode) = &text_mode {
        let mut printer = TextPrinter::new(&engine, mode)?;
        let g = session.generate(&prompt, &opts, |id| printer.push(id) && keep_going())?;
        printer.finish();
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!("\n(stopped by Ctrl-C after {} tokens)", g.tokens.len());
        }
        g.tokens
    } else {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        // A closed stdout ends generation instead of failing it.
        let mut open = write!(out, "prompt ids: {prompt:?}\nnew ids:").is_ok();
        let g = session.generate(&prompt, &opts, |id| {
            open = open && write!(out, " {id}").and_then(|_| out.flush()).is_ok();
            open && keep_going()
        })?;
        // The line end is cosmetic; a closed stdout was already handled above.
        let _ = writeln!(out);
        g.tokens
    };
    if let Some(path) = &args.save_snapshot {
        session
            .save_snapshot(path)
            .with_context(|| format!("saving snapshot {}", path.display()))?;
    }
    if args.json {
        let report = RunReport {
            prompt_ids: prompt,
            new_ids,
        };
        crate::out::emit(&serde_json::to_string(&report)?)?;
    }
    if args.stats {
        print_stats(&engine, &session, started.elapsed());
    }
    eprintln!("{}", engine.expert_stats());
    Ok(())
}

fn print_stats(engine: &Engine, session: &Session<'_>, elapsed: std::time::Duration) {
    let s = session.stats();
    let reads = engine.expert_reads();
    let passes = s.decode_passes.max(1);
    let tokens = s.generated.max(1) as f64;
    let p = engine.profile();
    let x = engine.expert_stats();
    let per_token = |d: std::time::Duration| d.as_secs_f64() / tokens;
    eprintln!("--- stats (per generated token, prefill included)");
    eprintln!(
        "prefill              {} tokens in {:.3} s ({:.1} tokens/s), {:.1} MB read, passes of up to {} tokens",
        s.prefill_tokens,
        s.prefill_seconds,
        s.prefill_tokens as f64 / s.prefill_seconds.max(1e-9),
        s.prefill_read_bytes as f64 / 1e6,
        engine.prefill_chunk()
    );
    eprintln!(
        "wall time            {:.3} s total, {:.4} s/token",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() / tokens
    );
    let streamed = engine.streamed_layers();
    if streamed.is_empty() {
        eprintln!("spine read wait      0 (spine resident: read once at open)");
    } else {
        eprintln!(
            "spine read wait      {:.4} s ({} of {} layers streamed, {} of them from RAM; {:.1} MB/token of spine \
             read)",
            per_token(p.spine_wait),
            streamed.len(),
            engine.config().n_layers,
            engine.host_tier_layers().len(),
            engine.spine_reads().bytes as f64 / 1e6 / tokens
        );
    }
    eprintln!("expert read wait     {:.4} s", per_token(p.expert_wait));
    eprintln!(
        "spine compute        {:.4} s (dense FFN {:.4}, MoE router/latent {:.4}, shared experts {:.4}, \
         mixes+head {:.4})",
        per_token(p.spine_compute()),
        per_token(p.dense_ffn),
        per_token(p.moe_trunk),
        per_token(p.shared_experts),
        per_token(p.head)
    );
    eprintln!(
        "attention            {:.4} s (KDA {:.4}, of which projections {:.4}; MLA {:.4}, of which projections \
         {:.4}; device time on the GPU {:.4})",
        per_token(p.attention()),
        per_token(p.kda),
        per_token(p.kda_proj),
        per_token(p.mla),
        per_token(p.mla_proj),
        per_token(p.attn_device)
    );
    eprintln!(
        "MoE compute          {:.4} s (expert inputs {})",
        per_token(p.expert_compute),
        engine.expert_input()
    );
    #[cfg(feature = "cuda")]
    if let Some(g) = engine.expert_cache_stats() {
        eprintln!(
            "GPU experts          {} hits, {} misses ({:.1}% hit rate); {:.1} MB/token uploaded ({:.0}% straight from \
             page-locked read buffers), helper {:.4} s/token (reads, staging copies, queued uploads: {:.1} GB/s), DMA \
             {:.4} s/token ({:.1} GB/s)",
            g.hits,
            g.misses,
            100.0 * g.hit_rate(),
            g.uploaded_bytes as f64 / 1e6 / tokens,
            100.0 * g.uploaded_direct_bytes as f64 / g.uploaded_bytes.max(1) as f64,
            g.upload_secs / tokens,
            g.uploaded_bytes as f64 / 1e9 / g.upload_secs.max(1e-9),
            g.upload_dma_secs / tokens,
            g.uploaded_bytes as f64 / 1e9 / g.upload_dma_secs.max(1e-9)
        );
    }
    eprintln!(
        "bytes read           {:.1} MB/token from disk ({} reads; spine {:.1} MB/token), {:.1}% expert cache hit rate",
        (x.reader.disk.bytes + engine.spine_reads().bytes) as f64 / 1e6 / tokens,
        x.reader.disk.reads + engine.spine_reads().reads,
        engine.spine_reads().bytes as f64 / 1e6 / tokens,
        100.0 * x.cache.hit_rate()
    );
    eprintln!(
        "forward passes       {} ({} decode)",
        s.passes, s.decode_passes
    );
    eprintln!(
        "speculation          {} drafted, {} accepted ({:.1}%), {:.2} tokens per decode pass",
        s.drafted,
        s.accepted,
        100.0 * s.accepted as f64 / s.drafted.max(1) as f64,
        s.generated.saturating_sub(1) as f64 / passes as f64
    );
    eprintln!("expert requests      {}", reads.total_reads());
    eprintln!("prefix reuse         {} tokens", s.reused_tokens);
    eprintln!("memory budget        {}", engine.memory_plan());
    if let Some(peak) = crate::bench::peak_rss() {
        eprintln!(
            "peak RSS             {:.2} GiB ({:.2}x the budget)",
            peak as f64 / (1u64 << 30) as f64,
            peak as f64 / engine.memory_budget() as f64
        );
    }
}
