//! The KDA recurrence of a whole layer at K3's width (96 heads of 128 channels) against the f32 FMA peak measured in
//! the same process: every head's recurrence over a pass of T tokens, heads in parallel as a layer runs them, from a
//! non-zero state (a prompt's later pass), median of five passes after a warm-up.
//!
//! `cargo run --release -p deltafin-model --example kda_rate [-- --tokens 1,64,512] [--heads 96]`
//!
//! FLOP per token and head: 7·D² (the decay's multiply, then a multiply and an add each for `u = Sᵀk`, the update
//! `S += k δᵀ` and `o = Sᵀq`, an FMA counting two), the recurrence's own arithmetic; the FMA peak is
//! `deltafin_quant::flops::fma_peak` on every thread of rayon's pool, read before and after, the faster used.

use std::time::Instant;

use deltafin_model::kda_recurrence::{HeadInputs, recurrence_flops, recurrence_head};
use rayon::prelude::*;

mod common;

/// Channels per head (K3).
const D: usize = 128;

fn main() {
    let mut rate = common::Rate::from_args("kda_rate", &[1, 64, 512]);
    let heads = rate.heads;
    let prev: Vec<f32> = (0..heads * D * D)
        .map(|i| ((i as f32) * 0.013).sin() * 0.05)
        .collect();
    for t_len in rate.tokens.clone() {
        let inputs: Vec<HeadInputs> = (0..heads).map(|h| inputs(t_len, h)).collect();
        let mut state = vec![0.0f32; heads * D * D];
        rate.time(t_len, || {
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
    }
    rate.report(|t_len| recurrence_flops(t_len, D) as f64 * heads as f64);
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
