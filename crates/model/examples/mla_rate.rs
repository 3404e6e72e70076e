//! MLA's attention over a prompt at K3's width (96 heads; latent 512, rope 64, nope and value 128) against the f32
//! FMA peak measured in the same process: every head's blocks of 32 queries over the latent cache of the prompt, as a
//! layer's prefill runs them (heads in parallel, the cache as the layer stores it, glibc's heap set as the engine sets
//! it), median of five passes after a warm-up.
//!
//! `cargo run --release -p deltafin-model --example mla_rate [-- --tokens 512,2048] [--heads 96]`
//!
//! FLOP: `deltafin_model::mla_attend::prompt_flops` (the absorbed products once a token, the scores and the context
//! once a row a query sees), the count `deltafin bench-prefill` reports; the FMA peak is
//! `deltafin_quant::flops::best_fma_peak` (three probes on every thread of rayon's pool) before and after, the faster.

use std::time::Instant;

use deltafin_model::mla_attend::{AbsorbedMatrix, HeadCache, attend, prompt_flops};
use deltafin_model::state::MlaCache;
use rayon::prelude::*;

mod common;

/// K3's latent width, rope, nope and value widths.
const DIMS: (usize, usize, usize, usize) = (512, 64, 128, 128);
/// Queries a block (the layer's `QUERY_BLOCK`).
const BLOCK: usize = 32;
fn wave(n: usize, f: f32, phase: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * f + phase).sin() * 0.5).collect()
}

fn main() {
    let mut rate = common::Rate::from_args("mla_rate", &[512]);
    let heads = rate.heads;
    let (kvl, rope, nope, vd) = DIMS;
    let matrix = |rows: usize, cols: usize, phase: f32| {
        AbsorbedMatrix::new(rows, cols, &wave(rows * cols, 0.013, phase))
    };
    let built: Option<Vec<(AbsorbedMatrix, AbsorbedMatrix)>> = (0..heads)
        .map(|h| {
            Some((
                matrix(nope, kvl, h as f32)?,
                matrix(kvl, vd, h as f32 + 0.5)?,
            ))
        })
        .collect();
    let Some(absorbed) = built else {
        eprintln!("mla_rate: the absorbed matrices' shapes do not hold their values");
        std::process::exit(1);
    };
    for t_len in rate.tokens.clone() {
        // The prompt's latent rows in one block, as a layer's prefill pushes them.
        let mut cache = MlaCache::default();
        cache.push_block(&wave(t_len * (kvl + rope), 0.011, 0.2), kvl + rope);
        let rows: Vec<&[f32]> = cache.rows().collect();
        let q: Vec<f32> = wave(t_len * heads * (nope + rope), 0.007, 0.3);
        let mut by_head = vec![0.0f32; heads * t_len * vd];
        rate.time("attention", t_len, || {
            let started = Instant::now();
            by_head
                .par_chunks_mut(t_len * vd)
                .enumerate()
                .for_each(|(h, dst)| {
                    let hc = HeadCache {
                        w_uk: &absorbed[h].0,
                        w_uv_t: &absorbed[h].1,
                        rows: &rows,
                        kvl,
                        scale: ((nope + rope) as f32).powf(-0.5),
                    };
                    let qk = nope + rope;
                    for (b, dst) in dst.chunks_mut(BLOCK * vd).enumerate() {
                        let b0 = b * BLOCK;
                        let nq = dst.len() / vd;
                        let queries: Vec<(&[f32], &[f32])> = (b0..b0 + nq)
                            .map(|t| {
                                q[(t * heads + h) * qk..(t * heads + h + 1) * qk].split_at(nope)
                            })
                            .collect();
                        let seen: Vec<usize> = (b0..b0 + nq).map(|t| t + 1).collect();
                        attend(&hc, &queries, &seen, dst);
                    }
                });
            std::hint::black_box(&by_head);
            started.elapsed().as_secs_f64()
        });
    }
    rate.report(|t_len| prompt_flops(t_len, DIMS) * heads as f64);
}
