//! Gated multi-head latent attention without positional encoding, in the absorbed form over a latent cache.
//!
//! Per token the cache holds `c = RMSNorm(W_kva·x)[..kv_lora]` and the raw shared `k_pe`: `kv_lora + rope` values.
//! With no RoPE the absorption is exact: `score_h = (W_UK,hᵀ q_nope,h)·c + q_pe,h·k_pe`, scaled by
//! `(nope + rope)^-½`, and `out_h = W_UV,h (Σ_t p_t c_t)`.
//!
//! Every query row is computed on its own with fixed-order dot products, so a row's result does not depend on how
//! many rows share the call (speculation and chunked prefill rely on this).

use candle_core::Tensor;
use deltafin_quant::DenseMatrix;
use rayon::prelude::*;

use crate::activation::gate_in_place;
use crate::config::{MLA_LORA_NORM_EPS, MlaConfig};
use crate::error::{ModelError, Result};
use crate::mla_attend::{AbsorbedMatrix, HeadCache, attend};
use crate::ops::{linear, linear_many, rms_norm, rms_norm_row, tensor, values};
use crate::profile::{Phase, Profile};
use crate::state::MlaCache;
use crate::weights::Loader;

/// Queries per block of the attention over the latent cache: the block's query rows, scores and context rows stay
/// in L1 and L2 while the cache rows stream past them once. A long prompt's cache outgrows L2 (4.7 MB at 2,048
/// tokens), so the more queries a block has, the fewer times each row comes from L3; a block of 32 computes 16
/// scores a query past its own rows on average, and never reads them.
const QUERY_BLOCK: usize = 32;

/// How the query is projected.
#[derive(Debug)]
enum QueryProj {
    /// `q_b · RMSNorm(q_a · x)`.
    LowRank {
        a: DenseMatrix,
        norm: Vec<f32>,
        b: DenseMatrix,
    },
    /// `q_proj · x`.
    Plain(DenseMatrix),
}

/// One MLA layer's weights, with `kv_b_proj` split per head at load.
#[derive(Debug)]
pub struct Mla {
    cfg: MlaConfig,
    q: QueryProj,
    kv_a: DenseMatrix,
    kv_a_norm: Vec<f32>,
    /// Per head `W_UK,h` `[nope, kv_lora]`: a query's nope part times it is the query in the latent space.
    w_uk: Vec<AbsorbedMatrix>,
    /// Per head `W_UV,hᵀ` `[kv_lora, v]`: a latent context times it is the head's values.
    w_uv_t: Vec<AbsorbedMatrix>,
    gate: Option<DenseMatrix>,
    o_proj: DenseMatrix,
    /// The absorbed attention on the GPU, when the model runs on CUDA.
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::MlaGpu>,
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
                a: ld.matrix(&name("q_a_proj.weight"), r, hidden)?,
                norm: ld.vec(&name("q_a_layernorm.weight"), &[r])?,
                b: ld.matrix(&name("q_b_proj.weight"), nh * qk, r)?,
            },
            None => QueryProj::Plain(ld.matrix(&name("q_proj.weight"), nh * qk, hidden)?),
        };
        let kvl = cfg.kv_lora_rank;
        let per_head = cfg.nope_dim + cfg.v_dim;
        let kv_b_name = name("kv_b_proj.weight");
        // [heads * (nope + v), kv_lora]: per head, nope key rows then value rows. Read first, so that ranks in the
        // config that do not match the checkpoint are reported on this tensor; kept in its stored precision.
        let kv_b = ld.host_matrix(&kv_b_name, nh * per_head, kvl)?;
        let gate = if cfg.output_gate {
            Some(ld.matrix(&name("g_proj.weight"), nh * cfg.v_dim, hidden)?)
        } else {
            None
        };
        let kv_a_norm = ld.vec(&name("kv_a_layernorm.weight"), &[kvl])?;
        // The GPU takes `W_UK,hᵀ` `[kv_lora, nope]` and `W_UV,h` `[v, kv_lora]`, laid out on the device from `kv_b`
        // as stored (bf16 or f32): a streamed layer is built again at every pass, and converting and stacking 50 MB
        // on the host there cost more than its upload. Int8 rows are dequantised and laid out on the host.
        #[cfg(feature = "cuda")]
        let gpu = match &ld.gpu {
            Some(g) => {
                let device_kv_b = match kv_b.data() {
                    deltafin_quant::DenseData::Int8 { .. } => None,
                    _ => deltafin_quant::cuda::dense::DeviceMatrix::upload(&g.gpu, &kv_b)
                        .map_err(|e| ModelError::Device(format!("{kv_b_name}: {e}")))?,
                };
                let device_values = device_kv_b.as_ref().and_then(|m| m.float_values());
                let host;
                let absorbed = match device_values {
                    Some((buf, bf16)) => crate::gpu::Absorbed::Device(buf, bf16),
                    None => {
                        host = gpu_absorbed(&kv_b.to_f32(), nh, (cfg.nope_dim, cfg.v_dim, kvl));
                        crate::gpu::Absorbed::Host(&host.0, &host.1)
                    }
                };
                Some(crate::gpu::MlaGpu::new(
                    &g.gpu,
                    &g.mla,
                    (nh, absorbed),
                    (
                        &kv_a_norm,
                        match &q {
                            QueryProj::LowRank { norm, .. } => Some(norm.as_slice()),
                            QueryProj::Plain(_) => None,
                        },
                    ),
                    (cfg.nope_dim, cfg.rope_dim, kvl, cfg.v_dim),
                )?)
            }
            None => None,
        };
        #[cfg(feature = "cuda")]
        let on_gpu = gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        let on_gpu = false;
        // The CPU multiplies by `W_UK,h` `[nope, kv_lora]` and `W_UV,hᵀ` `[kv_lora, v]` (`mla_attend`: each product
        // runs as multiply-add chains across its outputs). With the absorbed attention on the GPU the host keeps no
        // copy of its matrices.
        let (mut w_uk, mut w_uv_t) = (Vec::new(), Vec::new());
        let absorbed = |rows: usize, cols: usize, values: &[f32]| {
            AbsorbedMatrix::new(rows, cols, values).ok_or_else(|| ModelError::BadWeight {
                name: kv_b_name.clone(),
                msg: format!("a head's slice is not [{rows}, {cols}]"),
            })
        };
        // A layer only checked (streamed; its values are read at every pass) needs none of them: building them
        // from its zeros cost the open a widened copy and a transposed one of `kv_b` per MLA layer.
        if !on_gpu && !ld.checks_only() {
            // Widened once (the values `Loader::vec` gives); the stored matrix is dropped here.
            let kv_b = {
                let stored = kv_b;
                stored.to_f32()
            };
            for h in 0..nh {
                let (k, v) =
                    kv_b[h * per_head * kvl..(h + 1) * per_head * kvl].split_at(cfg.nope_dim * kvl);
                w_uk.push(absorbed(cfg.nope_dim, kvl, k)?);
                w_uv_t.push(absorbed(kvl, cfg.v_dim, &transposed(v, cfg.v_dim, kvl))?);
            }
        }
        Ok(Self {
            #[cfg(feature = "cuda")]
            gpu,
            cfg: cfg.clone(),
            q,
            kv_a: ld.matrix(
                &name("kv_a_proj_with_mqa.weight"),
                kvl + cfg.rope_dim,
                hidden,
            )?,
            kv_a_norm,
            w_uk,
            w_uv_t,
            gate,
            o_proj: ld.matrix(&name("o_proj.weight"), hidden, nh * cfg.v_dim)?,
        })
    }

    /// Runs `x` (`[T, hidden]`, already normed) with causal attention over the cache plus these rows, appending
    /// them to `cache`.
    pub fn forward(&self, x: &Tensor, cache: &mut MlaCache, profile: &Profile) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, kvl, rope, nope, vd) = (
            cfg.n_heads,
            cfg.kv_lora_rank,
            cfg.rope_dim,
            cfg.nope_dim,
            cfg.v_dim,
        );
        let qk = nope + rope;
        let t_len = x.dim(0)?;
        let scale = (qk as f32).powf(-0.5);

        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_on_device(x, cache, (t_len, scale), profile)? {
            return tensor(y, t_len, self.o_proj.rows());
        }

        // Every projection of the input in one threaded job: the query's first projection, the compressed KV and
        // the output gate.
        let q_in = match &self.q {
            QueryProj::LowRank { a, .. } => a,
            QueryProj::Plain(w) => w,
        };
        let mut ws = vec![q_in, &self.kv_a];
        ws.extend(self.gate.as_ref());
        let (q, kv, gate) = profile.time(Phase::MlaProj, || -> Result<_> {
            let mut outs = linear_many(x, &ws)?.into_iter();
            let (Some(q_first), Some(kv)) = (outs.next(), outs.next()) else {
                return Err(crate::error::ModelError::Device(
                    "the MLA projections gave too few outputs".to_string(),
                ));
            };
            let gate = outs.next().map(|g| values(&g)).transpose()?;
            let q = values(&match &self.q {
                QueryProj::LowRank { norm, b, .. } => {
                    linear(&rms_norm(&q_first, norm, MLA_LORA_NORM_EPS)?, b)?
                }
                QueryProj::Plain(_) => q_first,
            })?; // [T, heads * (nope + rope)]
            Ok((q, kv, gate))
        })?;

        // Compressed KV for the new rows, appended to the cache.
        let mut ckv = values(&kv)?; // [T, kvl + rope]: c normalised in place, k_pe raw
        for row in ckv.chunks_exact_mut(kvl + rope) {
            rms_norm_row(&mut row[..kvl], &self.kv_a_norm, MLA_LORA_NORM_EPS);
        }
        let past = cache.len();
        cache.push_block(&ckv, kvl + rope);
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            let mut out = g.attend(&q, cache, past, t_len, scale)?;
            if let Some(g) = &gate {
                let width = nh * vd;
                out.par_chunks_mut(width.max(1))
                    .zip(g.par_chunks(width.max(1)))
                    .for_each(|(row, g)| gate_in_place(row, g));
            }
            return self.project(out, t_len, profile);
        }
        let rows: Vec<&[f32]> = cache.rows().collect();

        // Heads in parallel: each reads its own absorbed projections (`w_uk`, `w_uv_t`: 512 KB a head at K3's size)
        // and writes its own output rows; the arithmetic of a head is the same whatever thread runs it. Queries in
        // blocks: a cache row is read once for every query of a block (`mla_attend`: each query's bits do not
        // depend on the block).
        let mut by_head = deltafin_quant::zeroed::zeroed(nh * t_len * vd);
        by_head
            .par_chunks_mut(t_len * vd)
            .enumerate()
            .for_each(|(h, dst)| {
                let hc = HeadCache {
                    w_uk: &self.w_uk[h],
                    w_uv_t: &self.w_uv_t[h],
                    rows: &rows,
                    kvl,
                    scale,
                };
                for (b, dst) in dst.chunks_mut(QUERY_BLOCK * vd).enumerate() {
                    let b0 = b * QUERY_BLOCK;
                    let nq = dst.len() / vd.max(1);
                    let queries: Vec<(&[f32], &[f32])> = (b0..b0 + nq)
                        .map(|t| q[(t * nh + h) * qk..(t * nh + h + 1) * qk].split_at(nope))
                        .collect();
                    let seen: Vec<usize> = (b0..b0 + nq).map(|t| past + t + 1).collect();
                    attend(&hc, &queries, &seen, dst);
                }
            });
        // [heads, T, v] -> [T, heads, v] with the output gate, a token row per task.
        let width = nh * vd;
        let mut out = deltafin_quant::zeroed::zeroed(t_len * width);
        out.par_chunks_mut(width.max(1))
            .enumerate()
            .for_each(|(t, row)| {
                for (h, o) in row.chunks_exact_mut(vd.max(1)).enumerate() {
                    o.copy_from_slice(&by_head[(h * t_len + t) * vd..(h * t_len + t + 1) * vd]);
                }
                if let Some(g) = &gate {
                    gate_in_place(row, &g[t * width..(t + 1) * width]);
                }
            });
        self.project(out, t_len, profile)
    }

    /// The output projection of the attention rows `out [T, heads · v]` (gated).
    fn project(&self, out: Vec<f32>, t_len: usize, profile: &Profile) -> Result<Tensor> {
        let width = self.cfg.n_heads * self.cfg.v_dim;
        let out = tensor(out, t_len, width)?;
        profile.time(Phase::MlaProj, || linear(&out, &self.o_proj))
    }
}

#[cfg(feature = "cuda")]
impl Mla {
    /// The whole layer on the GPU when the model runs there and every projection has a device copy (`None`: run
    /// the projections on the CPU). Returns the output rows `[T, hidden]` and appends the new rows to `cache`. The
    /// work is queued and waited for once, so [`Phase::MlaProj`] stays at zero on this path.
    fn forward_on_device(
        &self,
        x: &Tensor,
        cache: &mut MlaCache,
        (t_len, scale): (usize, f32),
        profile: &Profile,
    ) -> Result<Option<Vec<f32>>> {
        use crate::gpu::mla::MlaMatrices;
        use deltafin_quant::cuda::dense::DeviceMatrix;
        let Some(g) = &self.gpu else {
            return Ok(None);
        };
        if t_len == 0 {
            return Ok(None);
        }
        let gpu = g.gpu();
        fn on<'m>(
            m: &'m DenseMatrix,
            gpu: &std::sync::Arc<deltafin_quant::cuda::Gpu>,
        ) -> Option<&'m DeviceMatrix> {
            m.cuda()
                .filter(|d| std::sync::Arc::ptr_eq(d.gpu(), gpu))
                .map(|d| &**d)
        }
        let dev = |m| on(m, gpu);
        let (q_in, q_b) = match &self.q {
            QueryProj::LowRank { a, b, .. } => match dev(b) {
                Some(b) => (dev(a), Some(b)),
                None => return Ok(None),
            },
            QueryProj::Plain(w) => (dev(w), None),
        };
        let gate = match &self.gate {
            Some(w) => match dev(w) {
                Some(d) => Some(d),
                None => return Ok(None),
            },
            None => None,
        };
        let (Some(q_in), Some(kv_a), Some(o)) = (q_in, dev(&self.kv_a), dev(&self.o_proj)) else {
            return Ok(None);
        };
        let mats = MlaMatrices {
            q_in,
            q_b,
            kv_a,
            gate,
            o,
        };
        g.forward(&mats, (&values(x)?, t_len), cache, scale, profile)
            .map(Some)
    }
}

/// The GPU's absorbed matrices from `kv_b` `[heads * (nope + v), kv_lora]` (per head its nope key rows, then its
/// value rows): every head's `W_UK,hᵀ` `[kv_lora, nope]` one after another, and every head's `W_UV,h`
/// `[v, kv_lora]`. Written straight into the two stacks, the heads on every thread. Used for int8 rows (dequantised
/// on the host); bf16 and f32 `kv_b` is laid out on the device by `mla_absorb`, whose test holds it to these bits.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn gpu_absorbed(
    kv_b: &[f32],
    heads: usize,
    (nope, vd, kvl): (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    use rayon::prelude::*;
    let per_head = (nope + vd) * kvl;
    let (mut uk_t, mut uv) = (
        vec![0.0f32; heads * kvl * nope],
        vec![0.0f32; heads * vd * kvl],
    );
    uk_t.par_chunks_mut(kvl * nope.max(1))
        .zip(uv.par_chunks_mut(vd * kvl.max(1)))
        .zip(kv_b.par_chunks(per_head.max(1)))
        .for_each(|((k_t, v), src)| {
            let (k, v_src) = src.split_at(nope * kvl);
            for (r, row) in k.chunks_exact(kvl.max(1)).enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    k_t[c * nope + r] = x;
                }
            }
            v.copy_from_slice(v_src);
        });
    (uk_t, uv)
}

/// `m` (`rows × cols`, row-major) transposed.
fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = m[r * cols + c];
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{HostTensor, WeightSource};
    use std::collections::HashMap;

    /// The headers of one layer: shapes, and no values (reading one fails, as a checked layer must not).
    struct Headers(HashMap<String, Vec<usize>>);

    impl WeightSource for Headers {
        fn load(&self, name: &str) -> Result<Option<HostTensor>> {
            Err(ModelError::Device(format!(
                "{name}: values read by a load that checks shapes only"
            )))
        }
        fn shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
            Ok(self.0.get(name).cloned())
        }
    }

    /// A layer only checked (streamed) reads no values and builds no absorbed matrices from its zeros, and a
    /// `kv_b` of another shape is still reported.
    #[test]
    fn a_checked_layer_builds_no_absorbed_matrices() {
        let cfg = MlaConfig {
            n_heads: 2,
            q_lora_rank: Some(8),
            kv_lora_rank: 6,
            nope_dim: 4,
            rope_dim: 2,
            v_dim: 5,
            output_gate: true,
        };
        let hidden = 16;
        let shapes = |kv_b_rows: usize| {
            Headers(
                [
                    ("q_a_proj.weight", vec![8, hidden]),
                    ("q_a_layernorm.weight", vec![8]),
                    ("q_b_proj.weight", vec![2 * 6, 8]),
                    ("kv_b_proj.weight", vec![kv_b_rows, 6]),
                    ("g_proj.weight", vec![2 * 5, hidden]),
                    ("kv_a_layernorm.weight", vec![6]),
                    ("kv_a_proj_with_mqa.weight", vec![6 + 2, hidden]),
                    ("o_proj.weight", vec![hidden, 2 * 5]),
                ]
                .into_iter()
                .map(|(n, s)| (format!("l.{n}"), s))
                .collect(),
            )
        };
        let src = shapes(2 * (4 + 5));
        let m = Mla::load(&Loader::shapes_only(&src), "l.", &cfg, hidden).expect("shapes match");
        assert!(m.w_uk.is_empty() && m.w_uv_t.is_empty());
        let wrong = shapes(2 * (4 + 5) + 1);
        assert!(Mla::load(&Loader::shapes_only(&wrong), "l.", &cfg, hidden).is_err());
    }

    /// The stacks hold each head's key rows transposed and its value rows as stored, head after head (the plain
    /// per-head construction), at a shape whose heads and widths all differ.
    #[test]
    fn gpu_absorbed_stacks_every_heads_matrices() {
        let (heads, nope, vd, kvl) = (3, 4, 5, 6);
        let kv_b: Vec<f32> = (0..heads * (nope + vd) * kvl)
            .map(|i| i as f32 * 0.5 - 7.0)
            .collect();
        let (uk_t, uv) = gpu_absorbed(&kv_b, heads, (nope, vd, kvl));
        let per_head = (nope + vd) * kvl;
        let (mut want_k, mut want_v) = (Vec::new(), Vec::new());
        for h in 0..heads {
            let (k, v) = kv_b[h * per_head..(h + 1) * per_head].split_at(nope * kvl);
            want_k.extend(transposed(k, nope, kvl));
            want_v.extend_from_slice(v);
        }
        assert_eq!(uk_t, want_k);
        assert_eq!(uv, want_v);
        // Spot-check one element against the layout's definition: head 2, kv_lora column 3, nope row 1.
        assert_eq!(
            uk_t[2 * kvl * nope + 3 * nope + 1],
            kv_b[2 * per_head + kvl + 3]
        );
    }
}
