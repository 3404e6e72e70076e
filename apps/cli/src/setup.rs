//! `deltafin setup` and `deltafin setup fetch-experts-all`: install Kimi K3 from the hub (the same code as
//! `cargo xtask setup`, in `deltafin_storage::install`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use deltafin_storage::install::{self, DEFAULT_REPO, DEFAULT_REVISION, SetupOptions, parse_layers};
use deltafin_storage::{HubOptions, InstallMode};

use crate::paths::default_dest;
use crate::progress::BarProgress;

/// `deltafin setup [OPTIONS]` or `deltafin setup fetch-experts-all [OPTIONS]`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SetupCommand {
    #[command(subcommand)]
    action: Option<SetupAction>,
    #[command(flatten)]
    args: SetupArgs,
}

#[derive(Subcommand, Debug)]
enum SetupAction {
    /// Fetch every missing expert of a streaming install (resumable).
    FetchExpertsAll(FetchArgs),
}

/// Runs `deltafin setup ...`.
pub fn run(cmd: SetupCommand) -> anyhow::Result<()> {
    match cmd.action {
        Some(SetupAction::FetchExpertsAll(args)) => fetch_experts_all(args),
        None => setup(cmd.args),
    }
}

/// Arguments of `setup`.
#[derive(Args, Debug)]
struct SetupArgs {
    /// Download everything (~1.7 TB for K3); resumable.
    #[arg(long, conflicts_with = "stream")]
    full: bool,
    /// Download config, tokenizer, index, shard headers and the spine; fetch experts on demand.
    #[arg(long)]
    stream: bool,
    /// Hub repository.
    #[arg(long, default_value = DEFAULT_REPO)]
    repo: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = DEFAULT_REVISION)]
    revision: String,
    /// Destination (default: `$DELTAFIN_ROOT/models/NAME`).
    #[arg(long)]
    dest: Option<PathBuf>,
}

/// Arguments of `fetch-experts-all`.
#[derive(Args, Debug)]
struct FetchArgs {
    /// The streaming install to fill (default: $DELTAFIN_ROOT/models/Kimi-K3).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Only print how many experts and bytes are missing.
    #[arg(long)]
    dry_run: bool,
    /// Only these MoE layers, e.g. `1-40` (0-based, inclusive).
    #[arg(long)]
    layers: Option<String>,
}

/// Runs `setup`.
fn setup(args: SetupArgs) -> anyhow::Result<()> {
    let mode = match (args.full, args.stream) {
        (true, _) => Some(InstallMode::Full),
        (_, true) => Some(InstallMode::Stream),
        _ => None,
    };
    let dest = args.dest.unwrap_or_else(|| default_dest(&args.repo));
    let opts = SetupOptions {
        repo: args.repo,
        revision: args.revision,
        dest: dest.clone(),
        mode,
        hub: HubOptions::default(),
    };
    let report = install::setup(&opts, &BarProgress::default(), &|s| eprintln!("{s}"))
        .with_context(|| format!("setting up {}", dest.display()))?;
    if report.missing.experts > 0 {
        eprintln!(
            "{} experts ({:.1} GB) will be fetched on demand; `deltafin setup fetch-experts-all` fetches them now",
            report.missing.experts,
            report.missing.bytes as f64 / 1e9
        );
    }
    println!("{}", dest.display());
    Ok(())
}

/// Runs `fetch-experts-all`.
fn fetch_experts_all(args: FetchArgs) -> anyhow::Result<()> {
    let dir = args.model.unwrap_or_else(|| default_dest(DEFAULT_REPO));
    let layers = match &args.layers {
        Some(t) => {
            Some(parse_layers(t).with_context(|| format!("--layers {t:?}: expected A-B or N"))?)
        }
        None => None,
    };
    let missing = install::fetch_experts_all(
        &dir,
        layers.as_ref(),
        args.dry_run,
        &HubOptions::default(),
        &BarProgress::default(),
    )
    .with_context(|| format!("filling {}", dir.display()))?;
    let verb = if args.dry_run { "missing" } else { "fetched" };
    println!(
        "{verb}: {} experts, {} bytes ({:.1} GB)",
        missing.experts,
        missing.bytes,
        missing.bytes as f64 / 1e9
    );
    Ok(())
}
