//! `cargo xtask`: project automation written in Rust (one module per subcommand).

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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crates => {
            for (name, role) in [
                ("crates/storage", "shard index, expert span map, reads"),
                ("crates/quant", "MXFP4 codec and fused kernels"),
                ("crates/model", "the K3 / Kimi Linear graph"),
                ("crates/runtime", "engine, sessions, generation"),
                ("apps/cli", "the deltafin binary"),
            ] {
                println!("{name:16} {role}");
            }
        }
    }
    Ok(())
}
