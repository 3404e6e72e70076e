//! `deltafin nll`: the quality harness. Prints per-position negative log-likelihood and top-5 logits.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, ValueEnum};
use deltafin_runtime::DevicePref;

use crate::engine_args::EngineArgs;
use serde::Serialize;

use crate::ids::parse_ids;

/// How the sequence is fed to the model.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Mode {
    /// The whole sequence in one forward pass.
    Prefill,
    /// One token at a time through the session's cache.
    Decode,
}

/// Arguments of `deltafin nll`.
#[derive(Args, Debug)]
pub struct NllArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    ids: String,
    /// Feed mode.
    #[arg(long, value_enum, default_value = "prefill")]
    mode: Mode,
    /// Print one JSON object (the only output format).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Serialize)]
struct NllReport {
    n_tokens: usize,
    mean_nll: f64,
    nll: Vec<f64>,
    top5: Vec<Vec<u32>>,
    top5_logits: Vec<Vec<f32>>,
}

/// Runs `deltafin nll`.
pub fn run(args: NllArgs, dev: Option<DevicePref>) -> anyhow::Result<()> {
    if !args.json {
        bail!("nll prints JSON only: pass --json");
    }
    let ids = parse_ids(&args.ids)?;
    let (_, engine) = args.engine.open(Some(&args.model), dev)?;
    let mut session = engine.session();
    let rows: Vec<Vec<f32>> = match args.mode {
        Mode::Prefill => {
            let logits = session.prefill(&ids)?;
            (0..logits.rows()).map(|i| logits.row(i).to_vec()).collect()
        }
        Mode::Decode => ids
            .iter()
            .map(|&id| session.step(id))
            .collect::<Result<_, _>>()?,
    };
    let report = score(&ids, &rows);
    crate::out::emit(&serde_json::to_string(&report)?)?;
    Ok(())
}

fn score(ids: &[u32], rows: &[Vec<f32>]) -> NllReport {
    let mut nll = Vec::with_capacity(ids.len().saturating_sub(1));
    let mut top5 = Vec::with_capacity(rows.len());
    let mut top5_logits = Vec::with_capacity(rows.len());
    for (t, row) in rows.iter().enumerate() {
        if let Some(&next) = ids.get(t + 1) {
            nll.push(log_sum_exp(row) - row[next as usize] as f64);
        }
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        order.truncate(5);
        top5.push(order.iter().map(|&i| i as u32).collect());
        top5_logits.push(order.iter().map(|&i| row[i]).collect());
    }
    let mean_nll = if nll.is_empty() {
        0.0
    } else {
        nll.iter().sum::<f64>() / nll.len() as f64
    };
    NllReport {
        n_tokens: ids.len(),
        mean_nll,
        nll,
        top5,
        top5_logits,
    }
}

/// `log Σ exp(x)` in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_uniform_logits_is_log_vocab() {
        let rows = vec![vec![0.0f32; 4]; 2];
        let r = score(&[1, 2], &rows);
        assert_eq!(r.nll.len(), 1);
        assert!((r.nll[0] - 4f64.ln()).abs() < 1e-12);
        assert_eq!(r.top5[0], vec![0, 1, 2, 3]);
    }
}
