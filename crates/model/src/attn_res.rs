//! Attention Residuals (K3): the residual stream is replaced by a per-token softmax mix over stored block sums.
//!
//! `Mix(cur, blocks)` scores each candidate `v ∈ [blocks…, cur]` as `Σ_d (v_d / rms(v)) · w_norm[d] · w_proj[d]`,
//! takes a softmax over candidates and returns the weighted sum of the raw candidates. The mix runs across depth
//! only, never across positions, so it needs no cache.

use std::mem::MaybeUninit;

use candle_core::Tensor;
use deltafin_quant::dot::dot_f32;
use rayon::prelude::*;

use crate::error::Result;
use crate::ops::{inv_rms, with_values_of};
use crate::weights::Loader;

/// Eps of the AttnRes RMSNorm (`rms_norm_eps` in K3).
#[derive(Clone, Debug)]
pub struct ResMix {
    /// `w_norm ⊙ w_proj`: the two weights only ever appear as this product.
    score: Vec<f32>,
    eps: f32,
}

impl ResMix {
    /// Loads `{prefix}_res_norm.weight` and `{prefix}_res_proj.weight` (e.g. prefix `…layers.3.mlp`).
    pub(crate) fn load(ld: &Loader<'_>, prefix: &str, hidden: usize, eps: f32) -> Result<Self> {
        let norm = ld.vec(&format!("{prefix}_res_norm.weight"), &[hidden])?;
        let proj = ld.vec(&format!("{prefix}_res_proj.weight"), &[1, hidden])?;
        let score = norm.iter().zip(&proj).map(|(a, b)| a * b).collect();
        Ok(Self { score, eps })
    }

    /// The mix of `cur` (`[T, H]`) with `blocks` (each `[T, H]`), row by row: the candidates' values read where they
    /// lie, rows on every thread for a prompt (a row's arithmetic is its own, so the bits do not depend on how many
    /// rows a pass has). At K3's depth a prompt's layer mixes up to nine candidates of tens of megabytes, twice.
    pub fn mix(&self, cur: &Tensor, blocks: &[Tensor]) -> Result<Tensor> {
        let (t, width) = cur.dims2()?;
        if width != self.score.len() || blocks.iter().any(|b| b.dims() != cur.dims()) {
            return Err(crate::error::ModelError::Device(format!(
                "a residual mix of width {} over candidates of {:?} and {:?}",
                self.score.len(),
                cur.dims(),
                blocks.iter().map(|b| b.dims().to_vec()).collect::<Vec<_>>()
            )));
        }
        let hidden = width.max(1);
        let all: Vec<&Tensor> = blocks.iter().chain(std::iter::once(cur)).collect();
        let out = with_values_of(&all, |cands| {
            // On huge pages: a long prompt's rows (59 MB at 2,048 tokens) are a new mapping, written by every thread.
            let mut out: Vec<f32> = deltafin_quant::huge_page_vec(t * width);
            let dst = &mut out.spare_capacity_mut()[..t * width];
            let row = |(r, dst): (usize, &mut [MaybeUninit<f32>])| {
                let span = r * hidden..(r + 1) * hidden;
                self.mix_row(cands.iter().map(|c| &c[span.clone()]), dst);
            };
            if t > 1 {
                dst.par_chunks_exact_mut(hidden).enumerate().for_each(row);
            } else {
                dst.chunks_exact_mut(hidden).enumerate().for_each(row);
            }
            // SAFETY: `mix_row` wrote each value of every row, and the rows are the `t · width` values.
            unsafe { out.set_len(t * width) };
            out
        })?;
        Ok(Tensor::from_vec(out, cur.shape(), cur.device())?)
    }

    /// One row's mix of its candidates `cands` (the blocks', then the current one's) into `dst`.
    fn mix_row<'a>(
        &self,
        cands: impl Iterator<Item = &'a [f32]> + Clone,
        dst: &mut [MaybeUninit<f32>],
    ) {
        // `Σ (v·inv)·w` as `inv · Σ v·w` in the `dot` contract's order: the same value up to rounding, in SIMD (a
        // left-to-right sum took about 14 µs a candidate at K3's width).
        let logits: Vec<f32> = cands
            .clone()
            .map(|v| inv_rms(v, self.eps) * dot_f32(v, &self.score))
            .collect();
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
        let total: f32 = exps.iter().sum();
        dst.iter_mut().for_each(|o| {
            o.write(0.0);
        });
        // SAFETY: every value of `dst` was just written, and `MaybeUninit<f32>` has `f32`'s layout.
        let dst = unsafe { &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32]) };
        for (v, e) in cands.zip(&exps) {
            let p = e / total;
            for (o, x) in dst.iter_mut().zip(v) {
                *o += p * x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{tensor, values};

    /// The mix as its formula reads, one row after another with a plain sum of the weighted candidates.
    fn plain_mix(m: &ResMix, cur: &[f32], blocks: &[Vec<f32>]) -> Vec<f32> {
        let hidden = m.score.len();
        let mut out = vec![0.0f32; cur.len()];
        for (t, dst) in out.chunks_exact_mut(hidden).enumerate() {
            let span = t * hidden..(t + 1) * hidden;
            let cands: Vec<&[f32]> = blocks
                .iter()
                .map(|b| &b[span.clone()])
                .chain([&cur[span.clone()]])
                .collect();
            let logits: Vec<f32> = cands
                .iter()
                .map(|v| inv_rms(v, m.eps) * dot_f32(v, &m.score))
                .collect();
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f32 = exps.iter().sum();
            for (v, e) in cands.iter().zip(&exps) {
                for (o, x) in dst.iter_mut().zip(v.iter()) {
                    *o += e / total * x;
                }
            }
        }
        out
    }

    /// A prompt's rows (on every thread) and one row give the formula's bits, with none, one and three blocks; a
    /// block of another shape is an error.
    #[test]
    fn mix_gives_the_formula_bits_and_checks_shapes() -> Result<()> {
        let hidden = 40;
        let wave =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin() * 2.0).collect() };
        let m = ResMix {
            score: wave(hidden, 0.13),
            eps: 1e-6,
        };
        for (t, n_blocks) in [(7, 3), (1, 3), (5, 1), (3, 0)] {
            let cur = wave(t * hidden, 0.07);
            let blocks: Vec<Vec<f32>> = (0..n_blocks)
                .map(|b| wave(t * hidden, 0.05 + 0.02 * b as f32))
                .collect();
            let block_tensors = blocks
                .iter()
                .map(|b| tensor(b.clone(), t, hidden))
                .collect::<Result<Vec<_>>>()?;
            let got = values(&m.mix(&tensor(cur.clone(), t, hidden)?, &block_tensors)?)?;
            let want = plain_mix(&m, &cur, &blocks);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{t} rows, {n_blocks} blocks");
        }
        let short = tensor(wave(2 * hidden, 0.3), 2, hidden)?;
        assert!(
            m.mix(&tensor(wave(3 * hidden, 0.2), 3, hidden)?, &[short])
                .is_err()
        );
        Ok(())
    }
}
