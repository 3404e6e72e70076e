//! `cargo xtask make-synthetic --preset NAME --out DIR`: a K3-architecture checkpoint in the released format.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

/// Arguments of `make-synthetic`.
#[derive(Args, Debug)]
pub struct SyntheticArgs {
    /// Preset: demo, demo-cyclic, large, large-cyclic, k3 (the released K3 text configuration at full size).
    #[arg(long)]
    preset: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Override the number of routed experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Override the number of layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Leave the large matrices (all but router, embedding and head) and every expert as file holes: full
    /// apparent size, a few GB on disk; for memory, open time and compute, not disk.
    #[arg(long)]
    sparse: bool,
}

/// Writes the model and reports its size.
pub fn run(args: SyntheticArgs) -> anyhow::Result<()> {
    let mut p = deltafin_synth::preset(&args.preset).with_context(|| {
        format!(
            "unknown preset `{}` (known: {})",
            args.preset,
            deltafin_synth::preset_names().join(", ")
        )
    })?;
    if let Some(e) = args.experts {
        p.experts = e;
    }
    if let Some(l) = args.layers {
        p.layers = l;
        p.mla_layers.retain(|&m| m <= l);
    }
    if let Some(s) = args.seed {
        p.seed = s;
    }
    p.sparse = args.sparse;
    let started = Instant::now();
    let bytes = deltafin_synth::write_model(&p, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {}{} ({:.2} GB of tensors, {:.2} GB of experts, {} bytes per expert, top-{}) in {secs:.1} s ({:.2} GB/s)",
        args.out.display(),
        if p.sparse {
            " (sparse: large matrices are holes)"
        } else {
            ""
        },
        bytes as f64 / 1e9,
        p.total_expert_bytes() as f64 / 1e9,
        p.expert_bytes(),
        p.top_k,
        bytes as f64 / 1e9 / secs
    );
    Ok(())
}
