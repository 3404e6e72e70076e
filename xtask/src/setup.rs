//! `cargo xtask setup` and `cargo xtask fetch-experts-all`: the CLI's `deltafin setup` and `deltafin setup
//! fetch-experts-all` (one implementation, `apps/cli/src/setup.rs` over `deltafin_storage::install`), built and run
//! with the arguments passed through.

use clap::Args;

use crate::deltafin::run_deltafin;

/// Arguments handed to the CLI unchanged (`--full`, `--stream`, `--repo`, `--revision`, `--dest`; or `--model`,
/// `--dry-run`, `--layers`).
#[derive(Args, Debug)]
pub struct PassArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// Runs `deltafin setup ARGS`.
pub fn setup(a: PassArgs) -> anyhow::Result<()> {
    run_deltafin(&["setup"], &a.args)
}

/// Runs `deltafin setup fetch-experts-all ARGS`.
pub fn fetch_experts_all(a: PassArgs) -> anyhow::Result<()> {
    run_deltafin(&["setup", "fetch-experts-all"], &a.args)
}
