//! Kimi Delta Attention: a gated delta-rule linear attention with per-channel decay, computed in f32.
//!
//! Per token and head (H heads of width D, C = H·D): q, k, v projections → causal depthwise conv (kernel K) → SiLU;
//! decay gate g (bounded K3 form or Kimi Linear softplus form); β = σ(b·x); L2-normalised q, k with q scaled by
//! D^-½; the recurrence S ← (I − β k kᵀ) diag(eᵍ) S + β k vᵀ, o = Sᵀ q; per-head gated RMSNorm; output projection.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use deltafin_quant::{DenseMatrix, OutputLayout};

use crate::config::KdaConfig;
use crate::error::{ModelError, Result};
use crate::kda_heads::{HeadParams, Projected};
use crate::ops::{linear_many_laid_out, linear_values, tensor};
use crate::profile::{Phase, Profile};
use crate::state::KdaState;
use crate::weights::Loader;

/// The output rows of the last KDA layer's pass, kept for the next layer's (`[T, C]`: 25 MB at K3's width for 512
/// tokens). A fresh buffer's pages are faulted in by the heads' first writes, every thread at once, which cost the
/// first layers of a prompt a fifth of their heads' time; the heap gives the freed rows back only once it has room.
static IDLE_ROWS: Mutex<Vec<f32>> = Mutex::new(Vec::new());

/// An empty buffer with room for `len` values: the idle rows when they hold `len` to twice as many (a prompt's next
/// layer), else a new one on transparent huge pages where the system gives them (the idle rows are dropped, so a
/// decode step after a long prompt does not keep its rows).
fn take_rows(len: usize) -> Vec<f32> {
    let mut idle = IDLE_ROWS.lock().unwrap_or_else(|e| e.into_inner());
    let rows = std::mem::take(&mut *idle);
    if (len..=len.saturating_mul(2)).contains(&rows.capacity()) {
        rows
    } else {
        deltafin_quant::huge_page_vec(len)
    }
}

/// Keeps `rows` for the next layer's [`take_rows`].
fn keep_rows(rows: Vec<f32>) {
    *IDLE_ROWS.lock().unwrap_or_else(|e| e.into_inner()) = rows;
}

/// The output gate: full rank (K3) or low rank (Kimi Linear).
#[derive(Debug)]
enum OutGate {
    Full(DenseMatrix),
    LowRank { down: DenseMatrix, up: DenseMatrix },
}

/// One KDA layer's weights.
#[derive(Debug)]
pub struct Kda {
    /// The shape and per-channel parameters the heads run with.
    heads: HeadParams,
    q_proj: DenseMatrix,
    k_proj: DenseMatrix,
    v_proj: DenseMatrix,
    f_a: DenseMatrix,
    f_b: DenseMatrix,
    b_proj: DenseMatrix,
    gate: OutGate,
    o_proj: DenseMatrix,
    /// The conv taps, gate vectors and norm weight on the device, when the model runs on CUDA (the layer then runs
    /// there whole, see `crate::gpu::kda`).
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::kda::KdaParams>,
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
        let a_exp: Vec<f32> = a_log_heads(&a_name, &a_log.shape, &a_log.to_f32(), h)?
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
        let conv = [
            conv("q_conv1d.weight")?,
            conv("k_conv1d.weight")?,
            conv("v_conv1d.weight")?,
        ];
        let dt_bias = {
            // Kimi Linear stores dt_bias as [C] too; some exports use [H, D]. One read either way.
            let dt_name = name("dt_bias");
            let dt = ld.host(&dt_name)?;
            if dt.shape != [h, d] {
                crate::weights::check_shape(&dt_name, &dt.shape, &[c])?;
            }
            dt.to_f32()
        };
        let o_norm = ld.vec(&name("o_norm.weight"), &[d])?;
        // The layer runs whole on the GPU when the model does and its head fits the kernels.
        #[cfg(feature = "cuda")]
        let gpu = match &ld.gpu {
            Some(g) if crate::gpu::kda::fits(&g.gpu, d, k) => {
                Some(crate::gpu::kda::KdaParams::upload(
                    &g.gpu, &g.kda, &conv, &dt_bias, &a_exp, &o_norm,
                )?)
            }
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let on_device = gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        let on_device = false;
        Ok(Self {
            heads: HeadParams::new(cfg, conv, a_exp, dt_bias, o_norm, eps)?,
            q_proj: ld.matrix(&name("q_proj.weight"), c, hidden)?,
            k_proj: ld.matrix(&name("k_proj.weight"), c, hidden)?,
            v_proj: ld.matrix(&name("v_proj.weight"), c, hidden)?,
            f_a: ld.matrix(&name("f_a_proj.weight"), f_rank, hidden)?,
            f_b: if on_device {
                // The GPU's heads kernel reads it as floats.
                ld.float_matrix(&name("f_b_proj.weight"), c, f_rank)?
            } else {
                // The CPU's head inputs read it by rows.
                ld.host_matrix(&name("f_b_proj.weight"), c, f_rank)?
            },
            b_proj: ld.matrix(&name("b_proj.weight"), h, hidden)?,
            gate,
            o_proj: ld.matrix(&name("o_proj.weight"), hidden, c)?,
            #[cfg(feature = "cuda")]
            gpu,
        })
    }

    /// Runs `x` (`[T, hidden]`, already normed) through the layer, advancing `state`.
    ///
    /// Three threaded jobs: every projection of the input at once; then each head on its own thread, from its
    /// channels of the projections to its output rows (short conv and SiLU, the decay gate through its slice of
    /// `f_b`, β, the q/k L2 norms, the delta-rule recurrence and the gated RMSNorm); then the output projection. A
    /// head's arithmetic is the same whichever thread runs it, so the result does not depend on the thread count.
    ///
    /// The new state is written to a reused buffer while the old one is read, so the caller's old state (kept for a
    /// rollback, a snapshot or a speculative pass) is never copied first: the first token's decay reads the old
    /// matrices and writes the new ones in one pass, and later tokens update the new ones in place.
    pub fn forward(
        &self,
        x: &Tensor,
        state: &mut Arc<KdaState>,
        profile: &Profile,
    ) -> Result<Tensor> {
        let (h, d) = (self.heads.cfg().n_heads, self.heads.cfg().head_dim);
        let c = h * d;
        let t_len = x.dim(0)?;
        let old: &KdaState = state;

        #[cfg(feature = "cuda")]
        if let Some((s, y)) = self.forward_on_device(x, old, t_len, profile)? {
            *state = Arc::new(KdaState::on_device(s));
            return tensor(y, t_len, self.o_proj.rows());
        }

        let gate_in = match &self.gate {
            OutGate::Full(w) => w,
            OutGate::LowRank { down, .. } => down,
        };
        // The projections a head reads along its channels come by heads (`[H, T, D]`: a head's rows one contiguous
        // run), so each head's task streams through its own memory; laid out by token, a head's 512-byte slice of a
        // row lies a whole row (48 KB at K3's width) from the next, and every slice waits on memory.
        let heads = OutputLayout::Heads(d);
        let by_input = OutputLayout::ByInput;
        let p = profile.time(Phase::KdaProj, || -> Result<Projected> {
            let og_layout = match &self.gate {
                OutGate::Full(_) => heads,
                OutGate::LowRank { .. } => by_input,
            };
            let outs = linear_many_laid_out(
                x,
                &[
                    &self.q_proj,
                    &self.k_proj,
                    &self.v_proj,
                    &self.f_a,
                    &self.b_proj,
                    gate_in,
                ],
                &[heads, heads, heads, by_input, by_input, og_layout],
            )?;
            let [q_raw, k_raw, v_raw, f_a, b, gate_raw]: [Vec<f32>; 6] = outs
                .try_into()
                .map_err(|_| ModelError::Device("six linears gave another count".to_string()))?;
            // The decay gate's second projection for every token at once (a row's bits do not depend on how many
            // rows share the product).
            let by_heads = |y: Vec<f32>, w: &DenseMatrix| -> Result<Vec<f32>> {
                let mut out = linear_many_laid_out(&tensor(y, t_len, w.cols())?, &[w], &[heads])?;
                out.pop()
                    .ok_or_else(|| ModelError::Device("a linear gave no output".to_string()))
            };
            let f_b = by_heads(f_a, &self.f_b)?;
            let og = match &self.gate {
                OutGate::Full(_) => gate_raw,
                OutGate::LowRank { up, .. } => by_heads(gate_raw, up)?,
            };
            Projected::new([q_raw, k_raw, v_raw], f_b, b, og, (h, t_len, d))
        })?;
        let windows = old.conv()?;
        let conv: [Vec<f32>; 3] =
            std::array::from_fn(|i| advance_window(&windows[i], &p.raw()[i], t_len, d));
        // A new conversation's state is not read: its matrices are zeros (and its untouched pages would be mapped
        // to the kernel's zero page by the reads, making the first writes into them copy-on-write faults later).
        let old_s = if old.is_zero() { None } else { Some(old.s()?) };
        let mut s_new = crate::state::state_buffer(h * d * d);
        let mut out = take_rows(t_len * c);
        self.heads
            .attend_into(windows, &p, (old_s, &mut s_new), &mut out)?;
        *state = Arc::new(KdaState::new(conv, s_new));
        let y = profile.time(Phase::KdaProj, || linear_values(&out, t_len, &self.o_proj));
        keep_rows(out);
        y
    }
}

#[cfg(feature = "cuda")]
impl Kda {
    /// The whole layer on the GPU when the model runs there and every projection has a device copy (`None`: run
    /// it on the CPU). Returns the new state (on the device) and the output rows `[T, hidden]`. The work is queued
    /// on the device and waited for once, at the output's download, so the projections are not timed apart from
    /// the rest of the block ([`Phase::KdaProj`] stays at zero on this path).
    fn forward_on_device(
        &self,
        x: &Tensor,
        old: &KdaState,
        t_len: usize,
        profile: &Profile,
    ) -> Result<Option<(crate::gpu::DeviceKdaState, Vec<f32>)>> {
        use crate::gpu::kda::{DeviceGate, KdaDims, KdaMatrices, kda_forward};
        let Some(params) = &self.gpu else {
            return Ok(None);
        };
        fn dev<'m>(
            m: &'m DenseMatrix,
            gpu: &Arc<deltafin_quant::cuda::Gpu>,
        ) -> Option<&'m deltafin_quant::cuda::dense::DeviceMatrix> {
            m.cuda().filter(|d| Arc::ptr_eq(d.gpu(), gpu)).map(|d| &**d)
        }
        let g = params.gpu();
        let gate = match &self.gate {
            OutGate::Full(w) => dev(w, g).map(DeviceGate::Full),
            OutGate::LowRank { down, up } => match (dev(down, g), dev(up, g)) {
                (Some(down), Some(up)) => Some(DeviceGate::LowRank { down, up }),
                _ => None,
            },
        };
        let (Some(q), Some(k), Some(v), Some(f_a), Some(f_b), Some(b), Some(gate), Some(o)) = (
            dev(&self.q_proj, g),
            dev(&self.k_proj, g),
            dev(&self.v_proj, g),
            dev(&self.f_a, g),
            dev(&self.f_b, g),
            dev(&self.b_proj, g),
            gate,
            dev(&self.o_proj, g),
        ) else {
            return Ok(None);
        };
        let mats = KdaMatrices {
            q,
            k,
            v,
            f_a,
            f_b,
            b,
            gate,
            o,
        };
        let cfg = self.heads.cfg();
        let dims = KdaDims {
            heads: cfg.n_heads,
            head_dim: cfg.head_dim,
            kern: cfg.conv_kernel,
            lower_bound: cfg.gate_lower_bound,
            eps: self.heads.eps(),
        };
        kda_forward(
            params,
            &mats,
            &dims,
            old,
            (&crate::ops::values(x)?, t_len),
            profile,
        )
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

/// The conv window after the new rows: the last `window.len() / C` rows (K-1) of `window ++ raw`, the window `[K-1, C]`
/// by token and `raw` the `t_len` new rows by heads of `d` channels (`[H, T, D]`), the result by token; taken from
/// the two tails alone (a long prompt's raw rows are tens of megabytes).
fn advance_window(window: &[f32], raw: &[f32], t_len: usize, d: usize) -> Vec<f32> {
    let c = raw.len() / t_len.max(1);
    let keep_rows = window.len() / c.max(1);
    let from_raw = t_len.min(keep_rows);
    let mut next = Vec::with_capacity(window.len());
    next.extend_from_slice(&window[from_raw * c..]);
    for t in t_len - from_raw..t_len {
        for head in raw.chunks_exact(t_len * d) {
            next.extend_from_slice(&head[t * d..(t + 1) * d]);
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The idle rows serve a layer of up to twice fewer values (the next layer of a prompt, its last shorter pass),
    /// not a much shorter one (a decode step), which gets a buffer of its own and lets them go.
    #[test]
    fn idle_rows_serve_the_next_layer_not_a_decode_step() {
        keep_rows(Vec::with_capacity(1000));
        assert_eq!(take_rows(600).capacity(), 1000);
        keep_rows(Vec::with_capacity(1000));
        let small = take_rows(10);
        assert!((10..1000).contains(&small.capacity()));
        assert!(take_rows(600).capacity() < 1000);
        assert!(take_rows(2000).capacity() >= 2000);
    }

    /// The window is the tail of `window ++ raw` for new row counts below, at and above its length.
    #[test]
    fn conv_window_advances_by_the_new_rows() {
        // Two heads of three channels; the new rows come by heads.
        let (heads, d) = (2, 3);
        let c = heads * d;
        let window: Vec<f32> = (0..3 * c).map(|i| -(i as f32) - 1.0).collect();
        for rows in [0, 1, 2, 3, 5] {
            let raw: Vec<f32> = (0..rows * c).map(|i| i as f32 + 1.0).collect();
            let all: Vec<f32> = window.iter().chain(&raw).copied().collect();
            let raw_heads = OutputLayout::Heads(d).arrange(raw, rows, c);
            assert_eq!(
                advance_window(&window, &raw_heads, rows, d),
                all[all.len() - window.len()..],
                "{rows} rows"
            );
        }
    }
}
