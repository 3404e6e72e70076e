//! `deltafin run`: greedy generation after a prompt of token ids.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use deltafin_runtime::{Engine, EngineOptions, GreedyOptions};
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
    #[arg(long)]
    prompt_ids: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 16)]
    max_new: usize,
    /// Do not stop at the end-of-turn token.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of plain ids.
    #[arg(long)]
    json: bool,
    /// RAM for the expert cache, in GiB (default: half of physical memory).
    #[arg(long, env = "K3_RAM_GB")]
    ram_gb: Option<f64>,
}

#[derive(Serialize)]
struct RunReport {
    prompt_ids: Vec<u32>,
    new_ids: Vec<u32>,
}

/// Runs `deltafin run`.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let model_dir = match args.model {
        Some(dir) => dir,
        None => demo::default_model_dir()?,
    };
    let prompt = match (&args.prompt_ids, demo::is_demo(&model_dir)) {
        (Some(text), _) => parse_ids(text)?,
        (None, true) => demo::DEMO_PROMPT_IDS.to_vec(),
        (None, false) => bail!("give a prompt with --prompt-ids 1,2,3"),
    };
    let options = EngineOptions {
        ram_gb: args.ram_gb,
        ..EngineOptions::default()
    };
    let engine = Engine::open(&model_dir, options)
        .with_context(|| format!("opening model {}", model_dir.display()))?;
    if let Some(missing) = engine.missing_experts() {
        eprintln!(
            "warning: streaming install: {} experts ({:.1} GB) are not local yet and will be fetched as \
             they are needed; `deltafin setup fetch-experts-all` fetches them all",
            missing.experts,
            missing.bytes as f64 / 1e9
        );
    }
    let mut session = engine.session();
    let opts = GreedyOptions {
        max_new: args.max_new,
        ignore_eos: args.ignore_eos,
    };
    if args.json {
        let new_ids = session.generate_greedy(&prompt, opts, |_| true)?;
        let report = RunReport {
            prompt_ids: prompt,
            new_ids,
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "prompt ids: {prompt:?}")?;
        write!(out, "new ids:")?;
        session.generate_greedy(&prompt, opts, |id| {
            // A closed stdout ends generation instead of failing it.
            write!(out, " {id}").and_then(|_| out.flush()).is_ok()
        })?;
        writeln!(out)?;
    }
    eprintln!("{}", engine.expert_stats());
    Ok(())
}
