//! Building and running the `deltafin` binary from xtask (same profile, next to the xtask binary).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// Builds `deltafin` with this xtask's profile (release under `cargo xtask`) and returns its path, next to this
/// xtask binary.
pub fn deltafin_binary() -> anyhow::Result<PathBuf> {
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-q", "-p", "deltafin-cli"]);
    if !cfg!(debug_assertions) {
        build.arg("--release");
    }
    let status = build.status().context("building deltafin")?;
    if !status.success() {
        bail!("cargo build -p deltafin-cli failed");
    }
    let bin = std::env::current_exe()?.with_file_name("deltafin");
    if !bin.is_file() {
        bail!("{} not found", bin.display());
    }
    Ok(bin)
}

/// Runs `deltafin SUBCOMMAND... ARGS...`, failing with its exit status.
pub fn run_deltafin(subcommand: &[&str], args: &[String]) -> anyhow::Result<()> {
    let status = Command::new(deltafin_binary()?)
        .args(subcommand)
        .args(args)
        .status()
        .context("running deltafin")?;
    if !status.success() {
        bail!("deltafin {} failed ({status})", subcommand.join(" "));
    }
    Ok(())
}
