//! Attention Residuals (K3): the residual stream is replaced by a per-token softmax mix over stored block sums.
//!
//! `Mix(cur, blocks)` scores each candidate `v ∈ [blocks…, cur]` as `Σ_d (v_d / rms(v)) · w_norm[d] · w_proj[d]`,
//! takes a softmax over candidates and returns the weighted sum of the raw candidates. The mix runs across depth
//! only, never across positions, so it needs no cache.

use candle_core::Tensor;
use deltafin_quant::dot::dot_f32;

use crate::error::Result;
use crate::ops::inv_rms;
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

    /// The mix of `cur` (`[T, H]`) with `blocks` (each `[T, H]`), row by row.
    pub fn mix(&self, cur: &Tensor, blocks: &[Tensor]) -> Result<Tensor> {
        let hidden = self.score.len();
        let cur_v = cur.flatten_all()?.to_vec1::<f32>()?;
        let block_v = blocks
            .iter()
            .map(|b| Ok(b.flatten_all()?.to_vec1::<f32>()?))
            .collect::<Result<Vec<_>>>()?;
        let rows = cur_v.len() / hidden;
        let mut out = vec![0.0f32; cur_v.len()];
        let mut logits = Vec::with_capacity(blocks.len() + 1);
        for t in 0..rows {
            let span = t * hidden..(t + 1) * hidden;
            let cands: Vec<&[f32]> = block_v
                .iter()
                .map(|b| &b[span.clone()])
                .chain(std::iter::once(&cur_v[span.clone()]))
                .collect();
            logits.clear();
            // `Σ (v·inv)·w` as `inv · Σ v·w` in the `dot` contract's order: the same value up to rounding, in
            // SIMD (a left-to-right sum took about 14 µs a candidate at K3's width).
            for v in &cands {
                logits.push(inv_rms(v, self.eps) * dot_f32(v, &self.score));
            }
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f32 = exps.iter().sum();
            let dst = &mut out[span];
            for (v, e) in cands.iter().zip(&exps) {
                let p = e / total;
                for (o, x) in dst.iter_mut().zip(v.iter()) {
                    *o += p * x;
                }
            }
        }
        Ok(Tensor::from_vec(out, cur.shape(), cur.device())?)
    }
}
