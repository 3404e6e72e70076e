//! `cargo xtask convert-spine-int8 --model DIR`: writes the row-wise int8 copy of the spine next to the model.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

/// Arguments of `convert-spine-int8`.
#[derive(Args, Debug)]
pub struct Int8Args {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
}

/// Converts and reports sizes.
pub fn run(args: Int8Args) -> anyhow::Result<()> {
    let r = deltafin_runtime::convert_spine_int8(&args.model)
        .with_context(|| format!("converting the spine of {}", args.model.display()))?;
    println!(
        "wrote {}: {} matrices, {:.3} GB -> {:.3} GB (select with K3_SPINE=int8)",
        r.path.display(),
        r.tensors,
        r.bytes_in as f64 / 1e9,
        r.bytes_out as f64 / 1e9
    );
    Ok(())
}
