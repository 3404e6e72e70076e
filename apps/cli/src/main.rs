//! `deltafin`: run Kimi K3 from the command line.
//!
//! Subcommands print JSON with `--json`; the `nll` and `run --prompt-ids` forms are used by tools outside the
//! project and stay stable.

mod bench;
mod bench_prefill;
mod demo;
mod diskstats;
mod engine_args;
mod ids;
mod nll;
mod out;
mod paths;
mod progress;
mod run;
mod serve;
mod setup;
mod text;
mod tokenize;

use clap::{Parser, Subcommand};
use deltafin_runtime::DevicePref;

/// Run Kimi K3 on a machine whose RAM is a fraction of the model.
#[derive(Parser, Debug)]
#[command(name = "deltafin", version, about)]
struct Cli {
    /// Where the model runs: cpu, cuda, or auto (CUDA when this build has it and a GPU is usable, else the CPU)
    /// [K3_DEV; default cpu].
    #[arg(long, global = true, value_parser = parse_dev)]
    dev: Option<DevicePref>,
    #[command(subcommand)]
    command: Command,
}

fn parse_dev(s: &str) -> Result<DevicePref, String> {
    s.parse()
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate tokens after a prompt (greedy).
    Run(run::RunArgs),
    /// Score a token sequence: per-position NLL and top-5 logits.
    Nll(nll::NllArgs),
    /// Decode benchmark run by `cargo xtask bench` (prints one JSON object).
    #[command(hide = true)]
    BenchDecode(bench::BenchArgs),
    /// Time to first token of a long prompt against its storage and compute bounds (prints one JSON object).
    #[command(hide = true)]
    BenchPrefill(bench_prefill::BenchPrefillArgs),
    /// Encode text or render a chat with the model's tokenizer.
    Tokenize(tokenize::TokenizeArgs),
    /// Install Kimi K3 from the hub (--full, --stream), or fill a streaming install (fetch-experts-all).
    Setup(setup::SetupCommand),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

fn main() -> std::process::ExitCode {
    // Before anything allocates: freed buffers stay for the next layer (see the module's header).
    deltafin_runtime::allocator::keep_freed_memory();
    let cli = Cli::parse();
    // The server states what it serves at start-up: info by default there, warnings only elsewhere.
    let default_filter = match cli.command {
        Command::Serve(_) => "warn,deltafin_server=info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(out::colour(std::io::IsTerminal::is_terminal(
            &std::io::stderr(),
        )))
        .init();
    let dev = cli.dev;
    let result = match cli.command {
        Command::Run(a) => run::run(a, dev),
        Command::Nll(a) => nll::run(a, dev),
        Command::BenchDecode(a) => bench::run(a, dev),
        Command::BenchPrefill(a) => bench_prefill::run(a, dev),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Setup(a) => setup::run(a),
        Command::Serve(a) => serve::run(a, dev),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
