//! `deltafin`: run Kimi K3 from the command line.
//!
//! Subcommands print JSON with `--json`; the `nll` and `run --prompt-ids` forms are used by tools outside the
//! project and stay stable.

mod demo;
mod ids;
mod nll;
mod run;
mod serve;
mod text;
mod tokenize;

use clap::{Parser, Subcommand};

/// Run Kimi K3 on a machine whose RAM is a fraction of the model.
#[derive(Parser, Debug)]
#[command(name = "deltafin", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate tokens after a prompt (greedy).
    Run(run::RunArgs),
    /// Score a token sequence: per-position NLL and top-5 logits.
    Nll(nll::NllArgs),
    /// Encode text or render a chat with the model's tokenizer.
    Tokenize(tokenize::TokenizeArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
}

fn main() -> std::process::ExitCode {
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
        .init();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Nll(a) => nll::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
