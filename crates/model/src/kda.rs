//! Kimi Delta Attention: a gated delta-rule linear attention with per-channel decay, computed in f32.
//!
//! Per token and head (H heads of width D, C = H·D): q, k, v projections → causal depthwise conv (kernel K) → SiLU;
//! decay gate g (bounded K3 form or Kimi Linear softplus form); β = σ(b·x); L2-normalised q, k with q scaled by
//! D^-½; the recurrence S ← (I − β k kᵀ) diag(eᵍ) S + β k vᵀ, o = Sᵀ q; per-head gated RMSNorm; output projection.

use std::sync::Arc;

use candle_core::Tensor;
use deltafin_quant::DenseMatrix;
use rayon::prelude::*;

use crate::config::KdaConfig;
use crate::error::{ModelError, Result};
use crate::ops::{inv_rms, linear, sigmoid, silu, softplus, tensor, values};
use crate::state::KdaState;
use crate::weights::Loader;

/// Eps inside the sqrt of the q/k L2 norm (fla's `l2norm`).
const L2_NORM_EPS: f32 = 1e-6;

/// The output gate: full rank (K3) or low rank (Kimi Linear).
#[derive(Debug)]
enum OutGate {
    Full(DenseMatrix),
    LowRank { down: DenseMatrix, up: DenseMatrix },
}

/// One KDA layer's weights.
#[derive(Debug)]
pub struct Kda {
    cfg: KdaConfig,
    q_proj: DenseMatrix,
    k_proj: DenseMatrix,
    v_proj: DenseMatrix,
    /// Conv taps `[C, K]` for q, k, v, oldest tap first.
    conv: [Vec<f32>; 3],
    f_a: DenseMatrix,
    f_b: DenseMatrix,
    b_proj: DenseMatrix,
    /// `exp(A_log)` per head.
    a_exp: Vec<f32>,
    dt_bias: Vec<f32>,
    gate: OutGate,
    o_norm: Vec<f32>,
    o_proj: DenseMatrix,
    eps: f32,
    /// The device the recurrence runs on, when the model runs on CUDA.
    #[cfg(feature = "cuda")]
    gpu: Option<std::sync::Arc<deltafin_quant::cuda::Gpu>>,
}

impl Kda {
    /// Loads the weights under `prefix` (`…layers.L.self_attn.`).
    pub(crate) fn load(
        ld: &Loader<'_>,
        prefix: &str,
        cfg: &KdaConfig,
        hidden: usize,
        eps: f32,
    ) -> Result<Self> {
        let (h, d, k) = (cfg.n_heads, cfg.head_dim, cfg.conv_kernel);
        let c = h * d;
        let name = |s: &str| format!("{prefix}{s}");
        let conv = |s: &str| ld.vec(&name(s), &[c, 1, k]);
        let a_name = name("A_log");
        let a_log = ld.host(&a_name)?;
        let a_exp = a_log_heads(&a_name, &a_log.shape, &a_log.to_f32(), h)?
            .into_iter()
            .map(f32::exp)
            .collect();
        let f_rank = ld
            .shape(&name("f_a_proj.weight"))?
            .first()
            .copied()
            .unwrap_or(0);
        let gate = if cfg.full_rank_gate {
            OutGate::Full(ld.matrix(&name("g_proj.weight"), c, hidden)?)
        } else {
            let g_name = name("g_a_proj.weight");
            let rank = ld.shape(&g_name)?.first().copied().unwrap_or(0);
            OutGate::LowRank {
                down: ld.matrix(&g_name, rank, hidden)?,
                up: ld.matrix(&name("g_b_proj.weight"), c, rank)?,
            }
        };
        Ok(Self {
            cfg: cfg.clone(),
            q_proj: ld.matrix(&name("q_proj.weight"), c, hidden)?,
            k_proj: ld.matrix(&name("k_proj.weight"), c, hidden)?,
            v_proj: ld.matrix(&name("v_proj.weight"), c, hidden)?,
            conv: [
                conv("q_conv1d.weight")?,
                conv("k_conv1d.weight")?,
                conv("v_conv1d.weight")?,
            ],
            f_a: ld.matrix(&name("f_a_proj.weight"), f_rank, hidden)?,
            f_b: ld.matrix(&name("f_b_proj.weight"), c, f_rank)?,
            b_proj: ld.matrix(&name("b_proj.weight"), h, hidden)?,
            a_exp,
            dt_bias: {
                // Kimi Linear stores dt_bias as [C] too; some exports use [H, D]. One read either way.
                let dt_name = name("dt_bias");
                let dt = ld.host(&dt_name)?;
                if dt.shape != [h, d] {
                    crate::weights::check_shape(&dt_name, &dt.shape, &[c])?;
                }
                dt.to_f32()
            },
            gate,
            o_norm: ld.vec(&name("o_norm.weight"), &[d])?,
            o_proj: ld.matrix(&name("o_proj.weight"), hidden, c)?,
            eps,
            #[cfg(feature = "cuda")]
            gpu: ld.gpu.as_ref().map(|g| g.gpu.clone()),
        })
    }

    /// Runs `x` (`[T, hidden]`, already normed) through the layer, advancing `state`.
    ///
    /// The new state is written to fresh memory while the old one is read, so the caller's old state (kept for a
    /// rollback, a snapshot or a speculative pass) is never copied first: the first token's decay reads the old
    /// matrices and writes the new ones in one pass, and later tokens update the new ones in place.
    pub fn forward(&self, x: &Tensor, state: &mut Arc<KdaState>) -> Result<Tensor> {
        let (h, d, kern) = (self.cfg.n_heads, self.cfg.head_dim, self.cfg.conv_kernel);
        let c = h * d;
        let t_len = x.dim(0)?;
        let old: &KdaState = state;
        // The conv windows are small ((K-1) rows of C values each): copied and advanced.
        let mut conv = old.conv.clone();

        // [T, C] each, after conv + SiLU.
        let proj = [&self.q_proj, &self.k_proj, &self.v_proj];
        let mut qkv: Vec<Vec<f32>> = Vec::with_capacity(3);
        for ((w, window), taps) in proj.iter().zip(conv.iter_mut()).zip(&self.conv) {
            let raw = values(&linear(x, w)?)?;
            qkv.push(causal_conv_silu(&raw, window, taps, c, kern));
        }

        // Decay gate, [T, C].
        let z = values(&linear(&linear(x, &self.f_a)?, &self.f_b)?)?;
        let g: Vec<f32> = z
            .iter()
            .enumerate()
            .map(|(i, &zi)| {
                let ch = i % c;
                let a = self.a_exp[ch / d];
                let zb = zi + self.dt_bias[ch];
                match self.cfg.gate_lower_bound {
                    Some(lb) => lb * sigmoid(a * zb),
                    None => -a * softplus(zb),
                }
            })
            .collect();
        // β, [T, H].
        let beta: Vec<f32> = values(&linear(x, &self.b_proj)?)?
            .into_iter()
            .map(sigmoid)
            .collect();

        let (mut q, mut k, v) = match <[Vec<f32>; 3]>::try_from(qkv) {
            Ok([q, k, v]) => (q, k, v),
            Err(_) => unreachable!("three projections were pushed above"),
        };
        let q_scale = (d as f32).powf(-0.5);
        for row in q.chunks_exact_mut(d) {
            l2_normalize(row);
            row.iter_mut().for_each(|x| *x *= q_scale);
        }
        for row in k.chunks_exact_mut(d) {
            l2_normalize(row);
        }

        let (s, mut out) =
            match self.recurrence_on_device(&old.s, [&q, &k, &v, &g, &beta], t_len)? {
                Some(done) => done,
                None => recurrence(&old.s, [&q, &k, &v, &g], &beta, t_len, h, d),
            };
        *state = Arc::new(KdaState { conv, s });

        // Gated per-head RMSNorm.
        let og = values(&match &self.gate {
            OutGate::Full(w) => linear(x, w)?,
            OutGate::LowRank { down, up } => linear(&linear(x, down)?, up)?,
        })?;
        for (o_h, g_h) in out.chunks_exact_mut(d).zip(og.chunks_exact(d)) {
            let inv = inv_rms(o_h, self.eps);
            for ((o, w), gate) in o_h.iter_mut().zip(&self.o_norm).zip(g_h) {
                *o = (*o * inv) * w * sigmoid(*gate);
            }
        }
        linear(&tensor(out, t_len, c)?, &self.o_proj)
    }
}

impl Kda {
    /// The recurrence on the GPU when the model runs there (`None`: run it on the CPU): the new state and the
    /// output. `qkvgb` are q, k, v, the log decay and β.
    #[cfg(feature = "cuda")]
    fn recurrence_on_device(
        &self,
        s_old: &[f32],
        qkvgb: [&[f32]; 5],
        t_len: usize,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        let Some(gpu) = &self.gpu else {
            return Ok(None);
        };
        let [q, k, v, g, beta] = qkvgb;
        let dims = (t_len, self.cfg.n_heads, self.cfg.head_dim);
        let mut s = s_old.to_vec();
        Ok(crate::gpu::kda_recurrent(gpu, &mut s, q, k, v, g, beta, dims)?.map(|out| (s, out)))
    }

    /// Without the `cuda` feature the recurrence always runs on the CPU.
    #[cfg(not(feature = "cuda"))]
    fn recurrence_on_device(
        &self,
        _s_old: &[f32],
        _qkvgb: [&[f32]; 5],
        _t_len: usize,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        Ok(None)
    }
}

/// The first `heads` entries of `A_log`, which K3 stores zero-padded (`[128]`) and Kimi Linear as `[1, 1, H, 1]`.
fn a_log_heads(name: &str, shape: &[usize], data: &[f32], heads: usize) -> Result<Vec<f32>> {
    let n: usize = shape.iter().product();
    let squeezed: Vec<usize> = shape.iter().copied().filter(|&s| s != 1).collect();
    if squeezed.len() > 1 || n < heads {
        return Err(ModelError::BadWeight {
            name: name.to_string(),
            msg: format!("shape {shape:?} cannot hold one value per head for {heads} heads"),
        });
    }
    if data[heads..].iter().any(|&v| v != 0.0) {
        return Err(ModelError::BadWeight {
            name: name.to_string(),
            msg: format!("padding past the first {heads} heads is not zero"),
        });
    }
    Ok(data[..heads].to_vec())
}

/// Depthwise causal conv + SiLU over `raw` (`[T, C]`), using and updating the `(K-1)`-row window.
fn causal_conv_silu(
    raw: &[f32],
    window: &mut Vec<f32>,
    taps: &[f32],
    c: usize,
    kern: usize,
) -> Vec<f32> {
    // [hist + T, C]: the window rows, then the new rows.
    let mut ext = Vec::with_capacity(window.len() + raw.len());
    ext.extend_from_slice(window);
    ext.extend_from_slice(raw);
    let t_len = raw.len() / c;
    let mut out = vec![0.0f32; raw.len()];
    for t in 0..t_len {
        for ch in 0..c {
            let mut acc = 0.0f32;
            for i in 0..kern {
                acc += taps[ch * kern + i] * ext[(t + i) * c + ch];
            }
            out[t * c + ch] = silu(acc);
        }
    }
    window.clear();
    window.extend_from_slice(&ext[t_len * c..]);
    out
}

/// `x ← x / sqrt(Σx² + eps)`.
fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + L2_NORM_EPS).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The delta-rule recurrence of every head over `t_len` tokens, heads in parallel: the new states (`[H, D, D]`)
/// and the outputs (`[T, H·D]`). `qkvg` are `[T, H·D]` each, `beta` is `[T, H]`. The old states are only read.
fn recurrence(
    s_old: &[f32],
    [q, k, v, g]: [&[f32]; 4],
    beta: &[f32],
    t_len: usize,
    h: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    let c = h * d;
    // Zeroed memory the kernel hands over untouched; every value is written by the first token's decay.
    let mut s_new = vec![0.0f32; s_old.len()];
    let per_head: Vec<Vec<f32>> = s_new
        .par_chunks_mut(d * d)
        .zip(s_old.par_chunks(d * d))
        .enumerate()
        .map(|(head, (s, s_prev))| {
            let mut out = vec![0.0f32; t_len * d];
            for t in 0..t_len {
                let off = t * c + head * d;
                let gate = &g[off..off + d];
                if t == 0 {
                    decay_from(s, s_prev, gate);
                } else {
                    decay(s, gate);
                }
                delta_rule_update(
                    s,
                    &q[off..off + d],
                    &k[off..off + d],
                    &v[off..off + d],
                    beta[t * h + head],
                    &mut out[t * d..(t + 1) * d],
                );
            }
            out
        })
        .collect();
    let mut out = vec![0.0f32; t_len * c];
    for (head, o) in per_head.iter().enumerate() {
        for t in 0..t_len {
            out[t * c + head * d..t * c + (head + 1) * d].copy_from_slice(&o[t * d..(t + 1) * d]);
        }
    }
    (s_new, out)
}

/// `s ← s_prev` with row `i` scaled by `exp(g[i])` (the decay of a head's first token, read from the old state).
fn decay_from(s: &mut [f32], s_prev: &[f32], g: &[f32]) {
    let d = g.len();
    for ((row, prev), &gk) in s.chunks_exact_mut(d).zip(s_prev.chunks_exact(d)).zip(g) {
        let decay = gk.exp();
        for (x, &p) in row.iter_mut().zip(prev) {
            *x = p * decay;
        }
    }
}

/// Row `i` of `s` scaled by `exp(g[i])`, in place.
fn decay(s: &mut [f32], g: &[f32]) {
    let d = g.len();
    for (row, &gk) in s.chunks_exact_mut(d).zip(g) {
        let decay = gk.exp();
        row.iter_mut().for_each(|x| *x *= decay);
    }
}

/// The rest of one delta-rule step for one head after the decay; `s` is `[D_k, D_v]`.
fn delta_rule_update(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, out: &mut [f32]) {
    let d = k.len();
    // u = Sᵀ k
    let mut u = vec![0.0f32; d];
    for (row, &kk) in s.chunks_exact(d).zip(k) {
        for (acc, &x) in u.iter_mut().zip(row) {
            *acc += x * kk;
        }
    }
    let delta: Vec<f32> = v.iter().zip(&u).map(|(vi, ui)| beta * (vi - ui)).collect();
    for (row, &kk) in s.chunks_exact_mut(d).zip(k) {
        for (x, dl) in row.iter_mut().zip(&delta) {
            *x += kk * dl;
        }
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for (row, &qk) in s.chunks_exact(d).zip(q) {
        for (o, &x) in out.iter_mut().zip(row) {
            *o += x * qk;
        }
    }
}
