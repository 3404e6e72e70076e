//! Gated multi-head latent attention without positional encoding, in the absorbed form over a latent cache.
//!
//! Per token the cache holds `c = RMSNorm(W_kva·x)[..kv_lora]` and the raw shared `k_pe`: `kv_lora + rope` values.
//! With no RoPE the absorption is exact: `score_h = (W_UK,hᵀ q_nope,h)·c + q_pe,h·k_pe`, scaled by
//! `(nope + rope)^-½`, and `out_h = W_UV,h (Σ_t p_t c_t)`.

use candle_core::{D, Tensor};

use crate::config::{MLA_LORA_NORM_EPS, MlaConfig};
use crate::error::Result;
use crate::ops::{linear, rms_norm};
use crate::state::MlaCache;
use crate::weights::Loader;

/// How the query is projected.
#[derive(Debug)]
enum QueryProj {
    /// `q_b · RMSNorm(q_a · x)`.
    LowRank { a: Tensor, norm: Tensor, b: Tensor },
    /// `q_proj · x`.
    Plain(Tensor),
}

/// One MLA layer's weights, with `kv_b_proj` split per head at load.
#[derive(Debug)]
pub struct Mla {
    cfg: MlaConfig,
    q: QueryProj,
    kv_a: Tensor,
    kv_a_norm: Tensor,
    /// `[heads, nope, kv_lora]`: the key half of `kv_b_proj`.
    w_uk: Tensor,
    /// `[heads, kv_lora, v]`: the value half of `kv_b_proj`, transposed.
    w_uv_t: Tensor,
    gate: Option<Tensor>,
    o_proj: Tensor,
}

impl Mla {
    /// Loads the weights under `prefix` (`…layers.L.self_attn.`).
    pub(crate) fn load(
        ld: &Loader<'_>,
        prefix: &str,
        cfg: &MlaConfig,
        hidden: usize,
    ) -> Result<Self> {
        let name = |s: &str| format!("{prefix}{s}");
        let nh = cfg.n_heads;
        let qk = cfg.nope_dim + cfg.rope_dim;
        let q = match cfg.q_lora_rank {
            Some(r) => QueryProj::LowRank {
                a: ld.tensor(&name("q_a_proj.weight"), &[r, hidden])?,
                norm: ld.tensor(&name("q_a_layernorm.weight"), &[r])?,
                b: ld.tensor(&name("q_b_proj.weight"), &[nh * qk, r])?,
            },
            None => QueryProj::Plain(ld.tensor(&name("q_proj.weight"), &[nh * qk, hidden])?),
        };
        let kvl = cfg.kv_lora_rank;
        // [heads, nope + v, kv_lora]: per head, nope key rows then value rows.
        let kv_b = ld
            .tensor(
                &name("kv_b_proj.weight"),
                &[nh * (cfg.nope_dim + cfg.v_dim), kvl],
            )?
            .reshape((nh, cfg.nope_dim + cfg.v_dim, kvl))?;
        let w_uk = kv_b.narrow(1, 0, cfg.nope_dim)?.contiguous()?;
        let w_uv_t = kv_b
            .narrow(1, cfg.nope_dim, cfg.v_dim)?
            .transpose(1, 2)?
            .contiguous()?;
        let gate = if cfg.output_gate {
            Some(ld.tensor(&name("g_proj.weight"), &[nh * cfg.v_dim, hidden])?)
        } else {
            None
        };
        Ok(Self {
            cfg: cfg.clone(),
            q,
            kv_a: ld.tensor(
                &name("kv_a_proj_with_mqa.weight"),
                &[kvl + cfg.rope_dim, hidden],
            )?,
            kv_a_norm: ld.tensor(&name("kv_a_layernorm.weight"), &[kvl])?,
            w_uk,
            w_uv_t,
            gate,
            o_proj: ld.tensor(&name("o_proj.weight"), &[hidden, nh * cfg.v_dim])?,
        })
    }

    /// Runs `x` (`[T, hidden]`, already normed) with causal attention over the cache plus these rows, appending
    /// them to `cache`.
    pub fn forward(&self, x: &Tensor, cache: &mut MlaCache) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, kvl, rope) = (cfg.n_heads, cfg.kv_lora_rank, cfg.rope_dim);
        let t_len = x.dim(0)?;
        let dev = x.device();

        let q = match &self.q {
            QueryProj::LowRank { a, norm, b } => {
                linear(&rms_norm(&linear(x, a)?, norm, MLA_LORA_NORM_EPS)?, b)?
            }
            QueryProj::Plain(w) => linear(x, w)?,
        };
        // [T, heads, nope + rope] -> [heads, T, ·]
        let q = q
            .reshape((t_len, nh, cfg.nope_dim + rope))?
            .transpose(0, 1)?;
        let q_nope = q.narrow(2, 0, cfg.nope_dim)?.contiguous()?;
        let q_pe = q.narrow(2, cfg.nope_dim, rope)?.contiguous()?;

        // Compressed KV for the new rows, appended to the cache.
        let ckv = linear(x, &self.kv_a)?; // [T, kvl + rope]
        let c_new = rms_norm(&ckv.narrow(1, 0, kvl)?, &self.kv_a_norm, MLA_LORA_NORM_EPS)?;
        let kpe_new = ckv.narrow(1, kvl, rope)?;
        cache
            .c
            .extend(c_new.flatten_all()?.to_vec1::<f32>()?.iter());
        cache
            .k_pe
            .extend(kpe_new.flatten_all()?.to_vec1::<f32>()?.iter());
        let past = cache.len;
        cache.len += t_len;
        let s_len = cache.len;
        let c_all = Tensor::from_slice(&cache.c, (s_len, kvl), dev)?;
        let kpe_all = Tensor::from_slice(&cache.k_pe, (s_len, rope), dev)?;

        // Absorbed scores: [heads, T, S].
        let q_abs = q_nope.matmul(&self.w_uk)?; // [heads, T, kvl]
        let scores =
            (q_abs.broadcast_matmul(&c_all.t()?)? + q_pe.broadcast_matmul(&kpe_all.t()?)?)?;
        let scale = ((cfg.nope_dim + rope) as f64).powf(-0.5);
        let scores = (scores * scale)?;
        let mask: Vec<f32> = (0..t_len)
            .flat_map(|t| {
                (0..s_len).map(move |s| {
                    if s <= past + t {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t_len, s_len), dev)?;
        let scores = scores.broadcast_add(&mask)?;
        let max = scores.max_keepdim(D::Minus1)?;
        let exp = scores.broadcast_sub(&max)?.exp()?;
        let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;

        let ctx = probs.broadcast_matmul(&c_all)?; // [heads, T, kvl]
        let out = ctx.matmul(&self.w_uv_t)?; // [heads, T, v]
        let out = out
            .transpose(0, 1)?
            .contiguous()?
            .reshape((t_len, nh * cfg.v_dim))?;
        let out = match &self.gate {
            Some(g) => {
                let gate = linear(x, g)?;
                let sig = (gate.neg()?.exp()? + 1.0)?.recip()?;
                (out * sig)?
            }
            None => out,
        };
        linear(&out, &self.o_proj)
    }
}
