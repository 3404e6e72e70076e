//! `cargo xtask`: project automation written in Rust (one module per subcommand).

mod bench;
mod deltafin;
mod int8;
mod setup;
mod synthetic;

use clap::{Parser, Subcommand};

/// deltafin project tasks.
#[derive(Parser, Debug)]
#[command(name = "xtask", about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the workspace's crate map (a quick orientation).
    Crates,
    /// Install Kimi K3 from the hub: --full, --stream, or neither (full if the disk has room).
    Setup(setup::PassArgs),
    /// Fetch every missing expert of a streaming install (resumable).
    FetchExpertsAll(setup::PassArgs),
    /// Write a synthetic K3-architecture checkpoint (presets demo, large, and -cyclic variants).
    MakeSynthetic(synthetic::SyntheticArgs),
    /// Write the row-wise int8 copy of a model's spine (used with K3_SPINE=int8).
    ConvertSpineInt8(int8::Int8Args),
    /// Decode benchmark inside a memory cap, against the disk's O_DIRECT bandwidth measured in the same run.
    Bench(bench::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Crates => {
            for (name, role) in [
                (
                    "crates/storage",
                    "shard index, expert span map, read pool, hub, installs",
                ),
                ("crates/quant", "MXFP4 codec and fused kernels"),
                ("crates/model", "the K3 / Kimi Linear graph"),
                (
                    "crates/runtime",
                    "engine, sessions, generation, RAM expert cache",
                ),
                ("apps/cli", "the deltafin binary"),
            ] {
                println!("{name:16} {role}");
            }
        }
        Command::Setup(args) => setup::setup(args)?,
        Command::FetchExpertsAll(args) => setup::fetch_experts_all(args)?,
        Command::MakeSynthetic(args) => synthetic::run(args)?,
        Command::ConvertSpineInt8(args) => int8::run(args)?,
        Command::Bench(args) => bench::run(args)?,
    }
    Ok(())
}
