//! One KDA layer's heads at K3's width (96 heads of 128 channels, 4 conv taps, the bounded gate) against the f32 FMA
//! peak measured in the same process, heads in parallel as a layer runs them, from a non-zero state (a prompt's
//! later pass), median of five passes after a warm-up. Two parts a token count:
//! - `recurrence`: every head's delta-rule recurrence over the pass, its inputs made beforehand;
//! - `heads`: the layer's whole work between its projections ([`HeadParams::attend`]: conv and SiLU, norms, gates,
//!   the recurrence and the gated norm into the output rows), from projections laid out as the layer makes them
//!   (larger than the caches at a prompt's length, so read from memory as in the engine), into output rows kept
//!   from one pass to the next as the engine keeps them from layer to layer (a new buffer's pages, 100 MB at 2,048
//!   tokens, would be faulted in by every pass).
//!
//! `cargo run --release -p deltafin-model --example kda_rate [-- --tokens 1,64,512] [--heads 96]`
//!
//! FLOP per token and head, both parts: 7·D² (the decay's multiply, then a multiply and an add each for `u = Sᵀk`,
//! the update `S += k δᵀ` and `o = Sᵀq`, an FMA counting two), the recurrence's own arithmetic and the count
//! `deltafin bench-prefill` holds KDA's attention time against; the FMA peak is `deltafin_quant::flops::best_fma_peak`
//! (three probes on every thread of rayon's pool) read before and after, the faster used.

use std::time::Instant;

use deltafin_model::config::KdaConfig;
use deltafin_model::kda_heads::{HeadParams, Projected};
use deltafin_model::kda_recurrence::{HeadInputs, recurrence_flops, recurrence_head};
use rayon::prelude::*;

mod common;

/// Channels per head (K3).
const D: usize = 128;
/// Conv taps (K3).
const TAPS: usize = 4;

fn main() {
    let mut rate = common::Rate::from_args("kda_rate", &[1, 64, 512]);
    let heads = rate.heads;
    let prev: Vec<f32> = (0..heads * D * D)
        .map(|i| ((i as f32) * 0.013).sin() * 0.05)
        .collect();
    let params = match layer_params(heads) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kda_rate: {e}");
            std::process::exit(1);
        }
    };
    let windows: [Vec<f32>; 3] =
        std::array::from_fn(|i| wave((TAPS - 1) * heads * D, 0.019, i as f32));
    for t_len in rate.tokens.clone() {
        let inputs: Vec<HeadInputs> = (0..heads).map(|h| inputs(t_len, h)).collect();
        let mut state = vec![0.0f32; heads * D * D];
        rate.time("recurrence", t_len, || {
            let started = Instant::now();
            let sink: f32 = state
                .par_chunks_mut(D * D)
                .zip(prev.par_chunks(D * D))
                .zip(&inputs)
                .map(|((s, p), inp)| recurrence_head(s, Some(p), inp, t_len, D)[0])
                .sum();
            std::hint::black_box(sink);
            started.elapsed().as_secs_f64()
        });
        drop(inputs);
        let n = heads * t_len * D;
        let projected = Projected::new(
            std::array::from_fn(|i| wave(n, 0.031 + 0.01 * i as f32, 0.3)),
            wave(n, 0.017, 1.1),
            wave(heads * t_len, 0.29, 0.7),
            wave(n, 0.023, 0.4),
            (heads, t_len, D),
        );
        let projected = match projected {
            Ok(p) => p,
            Err(e) => {
                eprintln!("kda_rate: {e}");
                std::process::exit(1);
            }
        };
        let mut out = Vec::new();
        rate.time("heads", t_len, || {
            let started = Instant::now();
            let done =
                params.attend_into(&windows, &projected, (Some(&prev), &mut state), &mut out);
            let secs = started.elapsed().as_secs_f64();
            std::hint::black_box(done.map(|()| out[0]).unwrap_or(f32::NAN));
            secs
        });
    }
    rate.report(|t_len| recurrence_flops(t_len, D) as f64 * heads as f64);
}

/// `n` values of a smooth wave of frequency `f` and phase `phase`, in `[-1, 1]`.
fn wave(n: usize, f: f32, phase: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * f + phase).sin()).collect()
}

/// A layer of K3's shape with smooth parameters: conv taps that keep the rows' scale, the bounded gate.
fn layer_params(heads: usize) -> deltafin_model::Result<HeadParams> {
    let cfg = KdaConfig {
        n_heads: heads,
        head_dim: D,
        conv_kernel: TAPS,
        gate_lower_bound: Some(-5.0),
        full_rank_gate: true,
    };
    let c = heads * D;
    HeadParams::new(
        &cfg,
        std::array::from_fn(|i| {
            wave(c * TAPS, 0.07, i as f32)
                .iter()
                .map(|w| 0.4 * w)
                .collect()
        }),
        (0..heads).map(|h| 1.0 + 0.01 * h as f32).collect(),
        wave(c, 0.05, 0.2),
        wave(D, 0.03, 1.0).iter().map(|w| 1.0 + 0.1 * w).collect(),
        1e-5,
    )
}

/// Smooth inputs of one head: unit-norm keys and queries as the layer makes them, gates in K3's bounded range.
fn inputs(t_len: usize, head: usize) -> HeadInputs {
    let wave = |i: usize, f: f32| ((i as f32) * f + head as f32).sin();
    let unit = |f: f32| -> Vec<f32> {
        let mut v: Vec<f32> = (0..t_len * D).map(|i| wave(i, f)).collect();
        for row in v.chunks_exact_mut(D) {
            let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
            row.iter_mut().for_each(|x| *x /= n);
        }
        v
    };
    HeadInputs {
        q: unit(0.31),
        k: unit(0.17),
        v: (0..t_len * D).map(|i| wave(i, 0.23)).collect(),
        g: (0..t_len * D)
            .map(|i| -5.0 * (0.5 + 0.5 * wave(i, 0.07)))
            .collect(),
        beta: (0..t_len).map(|t| 0.5 + 0.4 * wave(t, 0.5)).collect(),
    }
}
