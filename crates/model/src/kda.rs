//! Kimi Delta Attention: a gated delta-rule linear attention with per-channel decay, computed in f32.
//!
//! Per token and head (H heads of width D, C = H·D): q, k, v projections → causal depthwise conv (kernel K) → SiLU;
//! decay gate g (bounded K3 form or Kimi Linear softplus form); β = σ(b·x); L2-normalised q, k with q scaled by
//! D^-½; the recurrence S ← (I − β k kᵀ) diag(eᵍ) S + β k vᵀ, o = Sᵀ q; per-head gated RMSNorm; output projection.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::Tensor;
use deltafin_quant::{DenseMatrix, OutputLayout};
use rayon::prelude::*;

use crate::activation;
use crate::config::KdaConfig;
use crate::error::{ModelError, Result};
use crate::kda_recurrence::{HeadInputs, recurrence_head};
use crate::ops::{inv_rms, linear, linear_many_laid_out, sigmoid, softplus, tensor};
use crate::profile::{Phase, Profile};
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
            cfg: cfg.clone(),
            q_proj: ld.matrix(&name("q_proj.weight"), c, hidden)?,
            k_proj: ld.matrix(&name("k_proj.weight"), c, hidden)?,
            v_proj: ld.matrix(&name("v_proj.weight"), c, hidden)?,
            conv,
            f_a: ld.matrix(&name("f_a_proj.weight"), f_rank, hidden)?,
            f_b: if on_device {
                ld.matrix(&name("f_b_proj.weight"), c, f_rank)?
            } else {
                // The CPU's head inputs read it by rows.
                ld.host_matrix(&name("f_b_proj.weight"), c, f_rank)?
            },
            b_proj: ld.matrix(&name("b_proj.weight"), h, hidden)?,
            a_exp,
            dt_bias,
            gate,
            o_norm,
            o_proj: ld.matrix(&name("o_proj.weight"), hidden, c)?,
            eps,
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
        let (h, d) = (self.cfg.n_heads, self.cfg.head_dim);
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
            Ok(Projected {
                raw: [q_raw, k_raw, v_raw],
                f_b,
                b,
                og: match &self.gate {
                    OutGate::Full(_) => gate_raw,
                    OutGate::LowRank { up, .. } => by_heads(gate_raw, up)?,
                },
                t_len,
                d,
            })
        })?;
        let windows = old.conv()?;
        let conv: [Vec<f32>; 3] =
            std::array::from_fn(|i| advance_window(&windows[i], &p.raw[i], t_len, d));

        // A new conversation's state is not read: its matrices are zeros (and its untouched pages would be mapped
        // to the kernel's zero page by the reads, making the first writes into them copy-on-write faults later).
        let old_s = if old.is_zero() { None } else { Some(old.s()?) };
        let s_len = h * d * d;
        if let Some(o) = old_s
            && o.len() != s_len
        {
            return Err(ModelError::Device(format!(
                "a KDA state of {} values where the layer has {s_len}",
                o.len()
            )));
        }
        let mut s_new = crate::state::state_buffer(s_len);
        // Each head writes its gated output straight into its columns of the rows `[T, C]` the output projection
        // reads (a separate pass from `[H, T, D]` read every head's rows back from memory). The heads' columns
        // cover the rows (C = H·D), so the rows are not zeroed first (25 MB at K3's width for 512 tokens).
        let mut out: Vec<f32> = Vec::with_capacity(t_len * c);
        let columns = HeadColumns::new(&mut out.spare_capacity_mut()[..t_len * c], c, d);
        s_new
            .par_chunks_mut(d * d)
            .enumerate()
            .for_each(|(head, s)| {
                let s_prev = old_s.map(|o| &o[head * d * d..(head + 1) * d * d]);
                // SAFETY: this task is head `head`'s only one, and nothing else touches `out` until they end.
                let dst = unsafe { columns.head(head) };
                self.head(windows, &p, head, (s, s_prev), dst);
            });
        // SAFETY: every head's task wrote each of its `D` columns of every row (`gated_norm_head`), and the heads'
        // columns are the whole rows.
        unsafe { out.set_len(t_len * c) };
        *state = Arc::new(KdaState::new(conv, s_new));
        let out = tensor(out, t_len, c)?;
        profile.time(Phase::KdaProj, || linear(&out, &self.o_proj))
    }

    /// One head's part of a call: its inputs, its recurrence from `state.1` (`None`: zeros) into `state.0`, and its
    /// gated norm into the head's columns `dst` of the layer's output rows. Run on the widest vectors the CPU has (an
    /// AVX-512 or AVX2 build of the same code: its loops are element-wise or keep their order, so every build gives
    /// the same bits).
    fn head(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        head: usize,
        state: (&mut [f32], Option<&[f32]>),
        dst: HeadSlots<'_>,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            if deltafin_quant::simd::has_avx512() {
                // SAFETY: AVX-512F is present.
                return unsafe { self.head_avx512(windows, p, head, state, dst) };
            }
            if deltafin_quant::simd::has_avx2_fma() {
                // SAFETY: AVX2 and FMA are present.
                return unsafe { self.head_avx2(windows, p, head, state, dst) };
            }
        }
        self.head_work(windows, p, head, state, dst)
    }

    /// [`Self::head_work`] built for AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn head_avx512(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        head: usize,
        state: (&mut [f32], Option<&[f32]>),
        dst: HeadSlots<'_>,
    ) {
        self.head_work(windows, p, head, state, dst)
    }

    /// [`Self::head_work`] built for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn head_avx2(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        head: usize,
        state: (&mut [f32], Option<&[f32]>),
        dst: HeadSlots<'_>,
    ) {
        self.head_work(windows, p, head, state, dst)
    }

    #[inline(always)]
    fn head_work(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        head: usize,
        (s, s_prev): (&mut [f32], Option<&[f32]>),
        dst: HeadSlots<'_>,
    ) {
        let inp = self.head_inputs(windows, p, head);
        let out = recurrence_head(s, s_prev, &inp, p.t_len, self.cfg.head_dim);
        self.gated_norm_head(&out, p, head, dst);
    }

    /// One head's inputs to the recurrence, each `[T, D]` (β `[T]`): its channels of q, k and v through the short
    /// conv and SiLU (q and k L2-normalised, q scaled by `D^-1/2`), and its decay gate.
    #[inline(always)]
    fn head_inputs(&self, windows: &[Vec<f32>; 3], p: &Projected, head: usize) -> HeadInputs {
        let (h, d, kern) = (self.cfg.n_heads, self.cfg.head_dim, self.cfg.conv_kernel);
        let c = h * d;
        let t_len = p.t_len;
        let hist = kern - 1;
        let ch0 = head * d;
        let mut qkv: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0.0f32; t_len * d]);
        for (i, dst) in qkv.iter_mut().enumerate() {
            let (window, raw, taps) = (&windows[i], &p.raw[i], &self.conv[i]);
            // This head's taps by tap, `[K][D]`, so each tap's products run along the head's channels.
            let by_tap: Vec<f32> = (0..kern)
                .flat_map(|k| (0..d).map(move |j| taps[(ch0 + j) * kern + k]))
                .collect();
            // The head's channels of row `r` of (window ++ raw): the window by token, the raw rows by heads.
            let raw = p.head(raw, head);
            let ext = |r: usize| -> &[f32] {
                if r < hist {
                    &window[r * c + ch0..r * c + ch0 + d]
                } else {
                    &raw[(r - hist) * d..(r - hist + 1) * d]
                }
            };
            for (t, out) in dst.chunks_exact_mut(d).enumerate() {
                conv_silu_row(out, &by_tap, |k| ext(t + k));
            }
        }
        let [mut q, mut k, v] = qkv;
        let q_scale = (d as f32).powf(-0.5);
        for row in q.chunks_exact_mut(d) {
            l2_normalize(row);
            row.iter_mut().for_each(|x| *x *= q_scale);
        }
        for row in k.chunks_exact_mut(d) {
            l2_normalize(row);
        }
        // The decay gate: this head's channels of `f_b · f_a · x` (projected with the others), its bias, then the
        // bounded (K3) or softplus (Kimi Linear) form.
        let a = self.a_exp[head];
        let mut g = vec![0.0f32; t_len * d];
        let bias = &self.dt_bias[ch0..ch0 + d];
        for (g_t, f_b) in g
            .chunks_exact_mut(d)
            .zip(p.head(&p.f_b, head).chunks_exact(d))
        {
            let z = f_b.iter().zip(bias);
            // The form chosen outside the loop, so the loop is one straight line of arithmetic (vectorised).
            match self.cfg.gate_lower_bound {
                Some(lb) => {
                    for (gv, (&z, &b)) in g_t.iter_mut().zip(z) {
                        *gv = lb * activation::sigmoid(a * (z + b));
                    }
                }
                None => {
                    for (gv, (&z, &b)) in g_t.iter_mut().zip(z) {
                        *gv = -a * softplus(z + b);
                    }
                }
            }
        }
        let beta = (0..t_len).map(|t| sigmoid(p.b[t * h + head])).collect();
        HeadInputs { q, k, v, g, beta }
    }

    /// The gated per-head RMSNorm of one head's recurrence output `out [T, D]`, with its rows of the output gate,
    /// into `dst`.
    #[inline(always)]
    fn gated_norm_head(&self, out: &[f32], p: &Projected, head: usize, mut dst: HeadSlots<'_>) {
        let d = self.cfg.head_dim;
        let rows = out.chunks_exact(d).zip(p.head(&p.og, head).chunks_exact(d));
        for (t, (o_h, g_h)) in rows.enumerate() {
            self.gated_norm_row(o_h, g_h, dst.row(t));
        }
    }

    /// The gated RMSNorm of one head's output row `o_h [D]` with its gate values `g_h [D]`, into `dst [D]`.
    #[inline(always)]
    fn gated_norm_row(&self, o_h: &[f32], g_h: &[f32], dst: &mut [MaybeUninit<f32>]) {
        let inv = inv_rms(o_h, self.eps);
        for (((y, &o), w), gate) in dst.iter_mut().zip(o_h).zip(&self.o_norm).zip(g_h) {
            y.write((o * inv) * w * activation::sigmoid(*gate));
        }
    }
}

/// A layer's output rows `[T, C]` (not yet written) shared by its heads' tasks, each of which writes only its own `D`
/// columns ([`HeadColumns::head`]).
struct HeadColumns<'a> {
    ptr: *mut MaybeUninit<f32>,
    t_len: usize,
    c: usize,
    d: usize,
    _rows: PhantomData<&'a mut [MaybeUninit<f32>]>,
}

// SAFETY: `HeadColumns` is a `&mut [MaybeUninit<f32>]` handed to the heads' tasks; `head`'s contract (one task a head) keeps their
// writes apart (a head's columns are disjoint from every other head's), and nothing reads through it.
unsafe impl Send for HeadColumns<'_> {}
// SAFETY: as above.
unsafe impl Sync for HeadColumns<'_> {}

impl<'a> HeadColumns<'a> {
    /// `rows` holds whole rows of `c` values, `d` a head's share of them (at most `c`).
    fn new(rows: &'a mut [MaybeUninit<f32>], c: usize, d: usize) -> HeadColumns<'a> {
        HeadColumns {
            ptr: rows.as_mut_ptr(),
            t_len: rows.len().checked_div(c).unwrap_or(0),
            c,
            d: d.min(c),
            _rows: PhantomData,
        }
    }

    /// Head `head`'s columns `head·D .. (head+1)·D` of every row (none if they lie past a row's end).
    ///
    /// # Safety
    /// At most one [`HeadSlots`] of a head may be live at a time.
    unsafe fn head(&self, head: usize) -> HeadSlots<'_> {
        let fits = (head + 1) * self.d <= self.c;
        HeadSlots {
            columns: self,
            col0: head * self.d,
            t_len: if fits { self.t_len } else { 0 },
        }
    }
}

/// One head's columns of a layer's output rows ([`HeadColumns::head`]).
struct HeadSlots<'a> {
    columns: &'a HeadColumns<'a>,
    col0: usize,
    t_len: usize,
}

impl HeadSlots<'_> {
    /// The head's `D` values of row `t` (panics past the last row: a caller's bug).
    fn row(&mut self, t: usize) -> &mut [MaybeUninit<f32>] {
        assert!(t < self.t_len, "row {t} of {}", self.t_len);
        let cols = self.columns;
        // SAFETY: `t < t_len` and `col0 + d <= c`, so the `d` values lie in the rows; they are this head's, only this
        // head's `HeadSlots` reaches them ([`HeadColumns::head`]'s contract), and `&mut self` keeps one row borrowed
        // at a time.
        unsafe { std::slice::from_raw_parts_mut(cols.ptr.add(t * cols.c + self.col0), cols.d) }
    }
}

/// The projections of one call's input: those read along a head's channels by heads (`[H, T, D]`,
/// [`OutputLayout::Heads`]), β by token.
struct Projected {
    /// q, k and v before the conv, `[H, T, D]` each.
    raw: [Vec<f32>; 3],
    /// The decay gate's projection before its bias, `f_b · (f_a · x)`, `[H, T, D]`.
    f_b: Vec<f32>,
    /// β before the sigmoid, `[T, H]`.
    b: Vec<f32>,
    /// The output gate before the sigmoid, `[H, T, D]`.
    og: Vec<f32>,
    t_len: usize,
    /// Channels per head.
    d: usize,
}

impl Projected {
    /// Head `head`'s rows `[T, D]` of a projection laid out by heads.
    fn head<'a>(&self, by_heads: &'a [f32], head: usize) -> &'a [f32] {
        let n = self.t_len * self.d;
        &by_heads[head * n..(head + 1) * n]
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
        let dims = KdaDims {
            heads: self.cfg.n_heads,
            head_dim: self.cfg.head_dim,
            kern: self.cfg.conv_kernel,
            lower_bound: self.cfg.gate_lower_bound,
            eps: self.eps,
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

/// One token's short conv and SiLU over a head's channels: `out[j] = SiLU(0 + w_0j·x_0j + w_1j·x_1j + …)`, the
/// taps in order (the plain loop's order), with `by_tap` the head's taps `[K][D]` and `rows(k)` the head's channels of
/// the `k`-th input row. Sixteen channels at a time, so each running sum stays in a register through the taps instead
/// of going to memory and back once a tap; σ is [`activation::sigmoid`], as in [`activation::silu_in_place`]. Four
/// taps (K3's and Kimi Linear's kernel) go through [`conv4_silu_row`].
#[inline(always)]
fn conv_silu_row<'a>(out: &mut [f32], by_tap: &[f32], rows: impl Fn(usize) -> &'a [f32]) {
    const LANES: usize = 16;
    let d = out.len();
    let kern = by_tap.len() / d.max(1);
    if kern == 4 {
        return conv4_silu_row(out, by_tap, [rows(0), rows(1), rows(2), rows(3)]);
    }
    let whole = d - d % LANES;
    for c0 in (0..whole).step_by(LANES) {
        let mut acc = [0.0f32; LANES];
        for k in 0..kern {
            let w = &by_tap[k * d + c0..k * d + c0 + LANES];
            let x = &rows(k)[c0..c0 + LANES];
            for j in 0..LANES {
                acc[j] += w[j] * x[j];
            }
        }
        for (o, a) in out[c0..c0 + LANES].iter_mut().zip(acc) {
            *o = a * activation::sigmoid(a);
        }
    }
    for j in whole..d {
        let mut a = 0.0f32;
        for k in 0..kern {
            a += by_tap[k * d + j] * rows(k)[j];
        }
        out[j] = a * activation::sigmoid(a);
    }
}

/// [`conv_silu_row`] with four taps, the rows `x` looked up once and each tap a named slice of the head's width, so
/// the channel loop is one straight vectorised line without a lookup or bounds check a tap. Same operations in the
/// same order.
#[inline(always)]
fn conv4_silu_row(out: &mut [f32], by_tap: &[f32], x: [&[f32]; 4]) {
    let d = out.len();
    let (w0, rest) = by_tap.split_at(d);
    let (w1, rest) = rest.split_at(d);
    let (w2, w3) = rest.split_at(d);
    let (w3, [x0, x1, x2, x3]) = (&w3[..d], x.map(|r| &r[..d]));
    for j in 0..d {
        let mut a = 0.0f32;
        a += w0[j] * x0[j];
        a += w1[j] * x1[j];
        a += w2[j] * x2[j];
        a += w3[j] * x3[j];
        out[j] = a * activation::sigmoid(a);
    }
}

/// `x ← x / sqrt(Σx² + eps)`.
#[inline(always)]
fn l2_normalize(x: &mut [f32]) {
    // The dot contract's sum (vectorised; a left-to-right sum is one dependent add a value).
    let ss = deltafin_quant::dot::dot_f32(x, x);
    let inv = 1.0 / (ss + L2_NORM_EPS).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
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

    /// The conv in register sums gives the bits of the plain loop (a sum in memory per channel, taps in order, then
    /// SiLU over the row), for head widths with and without a tail of channels and for several tap counts.
    #[test]
    fn conv_silu_row_gives_the_plain_loop_bits() {
        // Four taps take `conv4_silu_row`, the others the general form (with and without a tail of channels).
        for (d, kern) in [(128, 4), (40, 4), (7, 4), (7, 3), (40, 3), (16, 1)] {
            let val = |i: usize, f: f32| ((i as f32) * f).sin() * 2.5;
            let by_tap: Vec<f32> = (0..kern * d).map(|i| val(i, 0.37)).collect();
            let rows: Vec<Vec<f32>> = (0..kern)
                .map(|k| (0..d).map(|j| val(k * d + j, 0.11) - 0.3).collect())
                .collect();
            let mut plain = vec![0.0f32; d];
            for (k, tap) in by_tap.chunks_exact(d).enumerate() {
                for ((o, &w), &x) in plain.iter_mut().zip(tap).zip(&rows[k]) {
                    *o += w * x;
                }
            }
            activation::silu_in_place(&mut plain);
            let mut out = vec![f32::NAN; d];
            conv_silu_row(&mut out, &by_tap, |k| &rows[k]);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&plain), "D {d}, {kern} taps");
            assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0));
        }
    }
}
