//! One KDA layer's heads on the CPU: from the projections of a pass's tokens to the rows the output projection reads.
//!
//! Per head: its channels of q, k and v through the short conv and SiLU, q and k L2-normalised (q scaled by D^-½),
//! the decay gate and β, the delta-rule recurrence ([`crate::kda_recurrence`]) from the layer's old state into its
//! new one, and the gated RMSNorm into the head's columns of the output rows. The heads run on every thread, each
//! on the widest vectors the CPU has; a head's arithmetic is the same whichever thread or build runs it.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::activation;
use crate::config::KdaConfig;
use crate::error::{ModelError, Result};
use crate::kda_recurrence::{HeadInputs, Start, recurrence_into};
use crate::ops::{inv_rms, sigmoid, softplus};

/// Tokens a head takes at a time through its inputs, recurrence and norm. A head's buffers then hold a piece (six rows
/// of `D` values a token: 768 KiB at K3's width, within a core's L2 on the machines measured) instead of a whole
/// pass (6 MiB a head at 2,048 tokens, every thread at once), so a long prompt's scratch does not grow with its
/// length and a piece's inputs are still in cache when the recurrence reads them. Pieces give the bits of one pass
/// (the recurrence goes on in place); shorter pieces cost their own start (a sweep a column block).
const PIECE: usize = 256;

/// A thread's buffers for the heads it runs: a piece's inputs to the recurrence and its output rows.
#[derive(Default)]
struct HeadScratch {
    inp: HeadInputs,
    out: Vec<f32>,
}

thread_local! {
    /// The buffers of the last head this thread ran ([`HeadParams::attend`]'s tasks take and put them back).
    static HEAD_SCRATCH: std::cell::Cell<HeadScratch> = std::cell::Cell::new(HeadScratch::default());
}

/// Eps inside the sqrt of the q/k L2 norm (fla's `l2norm`).
const L2_NORM_EPS: f32 = 1e-6;

/// How many rows ahead a head's loops over its projections' rows ask for them: the rows come from memory (a
/// prompt's projections are tens of megabytes, written by heads long before a head reads its own), and read on
/// demand each line would stall the conv's arithmetic for a round trip.
const ROWS_AHEAD: usize = 8;

/// A KDA layer's per-channel parameters: what its heads need besides the projections.
#[derive(Debug)]
pub struct HeadParams {
    cfg: KdaConfig,
    /// Conv taps for q, k, v by head and tap, `[H][K][D]` (a head's taps `[K][D]` one run, so each tap's products
    /// run along the head's channels), oldest tap first; laid out once here rather than by every head of every pass.
    conv_by_tap: [Vec<f32>; 3],
    /// `exp(A_log)` per head.
    a_exp: Vec<f32>,
    /// The decay gate's bias `[C]`.
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight `[D]`.
    o_norm: Vec<f32>,
    eps: f32,
}

impl HeadParams {
    /// The parameters of a layer of `cfg`'s shape (H heads of width D, C = H·D, K taps): conv taps `[C, K]` each,
    /// `exp(A_log)` `[H]`, the gate's bias `[C]`, the norm's weight `[D]` and its eps; any other length is an error.
    pub fn new(
        cfg: &KdaConfig,
        conv: [Vec<f32>; 3],
        a_exp: Vec<f32>,
        dt_bias: Vec<f32>,
        o_norm: Vec<f32>,
        eps: f32,
    ) -> Result<Self> {
        let (h, d, k) = (cfg.n_heads, cfg.head_dim, cfg.conv_kernel);
        let c = h * d;
        let lengths = [
            ("q conv taps", conv[0].len(), c * k),
            ("k conv taps", conv[1].len(), c * k),
            ("v conv taps", conv[2].len(), c * k),
            ("A_log", a_exp.len(), h),
            ("dt_bias", dt_bias.len(), c),
            ("o_norm", o_norm.len(), d),
        ];
        if let Some((name, got, want)) = lengths.iter().find(|(_, got, want)| got != want) {
            return Err(ModelError::BadWeight {
                name: name.to_string(),
                msg: format!(
                    "{got} values where a layer of {h} heads of {d} with {k} taps has {want}"
                ),
            });
        }
        let conv_by_tap = conv.map(|taps| {
            (0..h)
                .flat_map(|head| (0..k).map(move |tap| (head, tap)))
                .flat_map(|(head, tap)| (0..d).map(move |j| (head * d + j) * k + tap))
                .map(|at| taps[at])
                .collect()
        });
        Ok(Self {
            cfg: cfg.clone(),
            conv_by_tap,
            a_exp,
            dt_bias,
            o_norm,
            eps,
        })
    }

    /// The layer's shape.
    pub fn cfg(&self) -> &KdaConfig {
        &self.cfg
    }

    /// The gated RMSNorm's eps.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Every head of a pass: from the projections `p` and the conv windows `windows` (`[K-1, C]` by token, the old
    /// state's), the recurrence from `old_s` (`None`: zeros) into `s_new` (`[H, D, D]` each), and the rows `[T, C]`
    /// the output projection reads. Errors if a state or window has another length than the layer's.
    pub fn attend(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        old_s: Option<&[f32]>,
        s_new: &mut [f32],
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.attend_into(windows, p, (old_s, s_new), &mut out)?;
        Ok(out)
    }

    /// [`Self::attend`] into `out` (cleared first; its capacity reused, so a buffer whose pages the process already
    /// has is not faulted in again).
    pub fn attend_into(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        (old_s, s_new): (Option<&[f32]>, &mut [f32]),
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (h, d, k) = (self.cfg.n_heads, self.cfg.head_dim, self.cfg.conv_kernel);
        let (c, t_len) = (h * d, p.t_len);
        let s_len = h * d * d;
        let window_len = k.saturating_sub(1) * c;
        if old_s.is_some_and(|o| o.len() != s_len) || s_new.len() != s_len {
            return Err(ModelError::Device(format!(
                "a KDA state of {} values where the layer has {s_len}",
                old_s.map_or(s_new.len(), <[f32]>::len)
            )));
        }
        if windows.iter().any(|w| w.len() != window_len) || p.d != d || p.heads != h {
            return Err(ModelError::Device(format!(
                "KDA inputs of {} heads of {} with windows of {:?} values where the layer has {h} of {d} and {window_len}",
                p.heads,
                p.d,
                windows.each_ref().map(Vec::len)
            )));
        }
        // Each head writes its gated output straight into its columns of the rows `[T, C]` the output projection
        // reads (a separate pass from `[H, T, D]` read every head's rows back from memory). The heads' columns
        // cover the rows (C = H·D), so the rows are not zeroed first (25 MB at K3's width for 512 tokens).
        out.clear();
        out.reserve(t_len * c);
        let columns = HeadColumns::new(&mut out.spare_capacity_mut()[..t_len * c], c, d);
        s_new
            .par_chunks_mut(d * d)
            .enumerate()
            .for_each(|(head, s)| {
                let s_prev = old_s.map(|o| &o[head * d * d..(head + 1) * d * d]);
                // SAFETY: this task is head `head`'s only one, and nothing else touches `out` until they end.
                let dst = unsafe { columns.head(head) };
                self.head(windows, p, head, (s, s_prev), dst);
            });
        // SAFETY: every head's task wrote each of its `D` columns of every row (`gated_norm_head`), and the heads'
        // columns are the whole rows.
        unsafe { out.set_len(t_len * c) };
        Ok(())
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
        mut dst: HeadSlots<'_>,
    ) {
        let d = self.cfg.head_dim;
        let piece = PIECE.min(p.t_len).max(1);
        // This thread's buffers from its last head, grown if this pass needs more (every value a piece reads is
        // written first, so they are neither cleared nor allocated again: five 128 KiB buffers a head otherwise).
        let mut scratch = HEAD_SCRATCH.take();
        let HeadScratch { inp, out } = &mut scratch;
        for v in [&mut inp.q, &mut inp.k, &mut inp.v, &mut inp.g, out] {
            if v.len() < piece * d {
                v.resize(piece * d, 0.0);
            }
        }
        if inp.beta.len() < piece {
            inp.beta.resize(piece, 0.0);
        }
        let by_tap = self.taps_by_tap(head);
        // One step when there are no tokens: the state still becomes the old one.
        for t0 in (0..p.t_len.max(1)).step_by(piece) {
            let n = piece.min(p.t_len - t0);
            // The first piece warms the old state (its recurrence starts from it) while it makes its inputs.
            let warm = if t0 == 0 { s_prev } else { None };
            self.head_inputs(windows, p, (head, &by_tap), (t0..t0 + n, warm), inp);
            let start = match (t0, s_prev) {
                (0, Some(prev)) => Start::From(prev),
                (0, None) => Start::Zeros,
                _ => Start::InPlace,
            };
            recurrence_into(s, start, inp, (n, d), out);
            self.gated_norm_rows(&out[..n * d], p, head, t0, &mut dst);
        }
        HEAD_SCRATCH.set(scratch);
    }

    /// Head `head`'s conv taps for q, k and v by tap, `[K][D]` each.
    fn taps_by_tap(&self, head: usize) -> [&[f32]; 3] {
        let n = self.cfg.conv_kernel * self.cfg.head_dim;
        std::array::from_fn(|i| &self.conv_by_tap[i][head * n..(head + 1) * n])
    }

    /// One head's inputs to the recurrence for the tokens `tokens`, into the first rows of `inp` (`[n, D]` each, β
    /// `[n]`): its channels of q, k and v through the short conv and SiLU (q and k L2-normalised, q scaled by
    /// `D^-1/2`), and its decay gate. `head` carries the head's taps ([`Self::taps_by_tap`]); `warm`, a state `[D, D]`
    /// the recurrence reads next, is asked for from memory a few rows a token meanwhile (its loads would otherwise
    /// wait on memory at the recurrence's start, with nothing to overlap them).
    #[inline(always)]
    fn head_inputs(
        &self,
        windows: &[Vec<f32>; 3],
        p: &Projected,
        (head, by_tap): (usize, &[&[f32]; 3]),
        (tokens, warm): (std::ops::Range<usize>, Option<&[f32]>),
        inp: &mut HeadInputs,
    ) {
        let (h, d, kern) = (self.cfg.n_heads, self.cfg.head_dim, self.cfg.conv_kernel);
        let c = h * d;
        let hist = kern - 1;
        let ch0 = head * d;
        let (t0, n) = (tokens.start, tokens.len());
        for (i, dst) in [&mut inp.q, &mut inp.k, &mut inp.v].into_iter().enumerate() {
            let window = &windows[i];
            // The head's channels of row `r` of (window ++ raw): the window by token, the raw rows by heads.
            let raw = p.head(&p.raw[i], head);
            let ext = |r: usize| -> &[f32] {
                if r < hist {
                    &window[r * c + ch0..r * c + ch0 + d]
                } else {
                    &raw[(r - hist) * d..(r - hist + 1) * d]
                }
            };
            // The state's rows spread over the tokens of the first channel group (all at once for a short pass).
            let warm_rows = match warm {
                Some(_) if i == 0 => d.div_ceil(n.max(1)),
                _ => 0,
            };
            for (t, out) in (t0..).zip(dst[..n * d].chunks_exact_mut(d)) {
                prefetch_row(raw, t + ROWS_AHEAD, d);
                if let Some(state) = warm {
                    for r in ((t - t0) * warm_rows..(t - t0 + 1) * warm_rows).take_while(|&r| r < d)
                    {
                        prefetch_row(state, r, d);
                    }
                }
                conv_silu_row(out, by_tap[i], |k| ext(t + k));
            }
        }
        let q_scale = (d as f32).powf(-0.5);
        for row in inp.q[..n * d].chunks_exact_mut(d) {
            l2_normalize(row);
            row.iter_mut().for_each(|x| *x *= q_scale);
        }
        for row in inp.k[..n * d].chunks_exact_mut(d) {
            l2_normalize(row);
        }
        // The decay gate: this head's channels of `f_b · f_a · x` (projected with the others), its bias, then the
        // bounded (K3) or softplus (Kimi Linear) form.
        let a = self.a_exp[head];
        let bias = &self.dt_bias[ch0..ch0 + d];
        let f_b_rows = p.head(&p.f_b, head);
        let g_rows = inp.g[..n * d].chunks_exact_mut(d);
        for (t, (g_t, f_b)) in (t0..).zip(g_rows.zip(f_b_rows[t0 * d..].chunks_exact(d))) {
            prefetch_row(f_b_rows, t + ROWS_AHEAD, d);
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
        for (beta, t) in inp.beta[..n].iter_mut().zip(tokens) {
            *beta = sigmoid(p.b[t * h + head]);
        }
    }

    /// The gated per-head RMSNorm of one head's recurrence output `out [n, D]` for the tokens from `t0`, with their
    /// rows of the output gate, into their rows of `dst`.
    #[inline(always)]
    fn gated_norm_rows(
        &self,
        out: &[f32],
        p: &Projected,
        head: usize,
        t0: usize,
        dst: &mut HeadSlots<'_>,
    ) {
        let d = self.cfg.head_dim;
        let og = p.head(&p.og, head);
        for (t, (o_h, g_h)) in (t0..).zip(out.chunks_exact(d).zip(og[t0 * d..].chunks_exact(d))) {
            prefetch_row(og, t + ROWS_AHEAD, d);
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

/// The projections of a pass's tokens that a layer's heads read: those read along a head's channels by heads
/// (`[H, T, D]`, `deltafin_quant::OutputLayout::Heads`), β by token.
pub struct Projected {
    /// q, k and v before the conv, `[H, T, D]` each.
    raw: [Vec<f32>; 3],
    /// The decay gate's projection before its bias, `f_b · (f_a · x)`, `[H, T, D]`.
    f_b: Vec<f32>,
    /// β before the sigmoid, `[T, H]`.
    b: Vec<f32>,
    /// The output gate before the sigmoid, `[H, T, D]`.
    og: Vec<f32>,
    heads: usize,
    t_len: usize,
    /// Channels per head.
    d: usize,
}

impl Projected {
    /// `t_len` tokens' projections for `heads` heads of `d` channels: q, k and v (`raw`), the decay gate's `f_b` and
    /// the output gate's `og`, `[H, T, D]` each, and β before its sigmoid `b` (`[T, H]`); any other length is an
    /// error.
    pub fn new(
        raw: [Vec<f32>; 3],
        f_b: Vec<f32>,
        b: Vec<f32>,
        og: Vec<f32>,
        (heads, t_len, d): (usize, usize, usize),
    ) -> Result<Self> {
        let n = heads * t_len * d;
        let lens = [
            raw[0].len(),
            raw[1].len(),
            raw[2].len(),
            f_b.len(),
            og.len(),
        ];
        if lens.iter().any(|&l| l != n) || b.len() != heads * t_len {
            return Err(ModelError::Device(format!(
                "KDA projections of {lens:?} values and β of {} for {t_len} tokens of {heads} heads of {d}",
                b.len()
            )));
        }
        Ok(Self {
            raw,
            f_b,
            b,
            og,
            heads,
            t_len,
            d,
        })
    }

    /// The pre-conv q, k and v rows, `[H, T, D]` each (the layer's next conv window comes from their last rows).
    pub fn raw(&self) -> &[Vec<f32>; 3] {
        &self.raw
    }

    /// Head `head`'s rows `[T, D]` of a projection laid out by heads.
    fn head<'a>(&self, by_heads: &'a [f32], head: usize) -> &'a [f32] {
        let n = self.t_len * self.d;
        &by_heads[head * n..(head + 1) * n]
    }
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

/// Asks for row `t` of `rows` (rows of `d` values; nothing past the last).
#[inline(always)]
fn prefetch_row(rows: &[f32], t: usize, d: usize) {
    if let Some(row) = rows.get(t * d..(t + 1) * d) {
        deltafin_quant::simd::prefetch_slice(row);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(heads: usize, head_dim: usize) -> KdaConfig {
        KdaConfig {
            n_heads: heads,
            head_dim,
            conv_kernel: 4,
            gate_lower_bound: Some(-5.0),
            full_rank_gate: true,
        }
    }

    /// A pass longer than a piece (and not a multiple of one) gives the bits of the same tokens one at a time, each
    /// from the state and conv window the one before left: output rows and final state.
    #[test]
    fn a_long_pass_gives_the_bits_of_its_tokens_one_by_one() -> Result<()> {
        let (h, d, t_len) = (2, 16, PIECE + 45);
        let (c, k) = (h * d, 4);
        let wave = |n: usize, f: f32, ph: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * f + ph).sin()).collect()
        };
        let params = HeadParams::new(
            &shape(h, d),
            std::array::from_fn(|i| {
                wave(c * k, 0.07, i as f32)
                    .iter()
                    .map(|w| 0.4 * w)
                    .collect()
            }),
            vec![1.0, 1.3],
            wave(c, 0.05, 0.2),
            wave(d, 0.03, 1.0).iter().map(|w| 1.0 + 0.1 * w).collect(),
            1e-5,
        )?;
        let n = h * t_len * d;
        let raw: [Vec<f32>; 3] = std::array::from_fn(|i| wave(n, 0.031 + 0.01 * i as f32, 0.3));
        let (f_b, b, og) = (
            wave(n, 0.017, 1.1),
            wave(h * t_len, 0.29, 0.7),
            wave(n, 0.023, 0.4),
        );
        let window0: [Vec<f32>; 3] = std::array::from_fn(|i| wave((k - 1) * c, 0.019, i as f32));
        let prev = wave(h * d * d, 0.013, 0.5)
            .iter()
            .map(|x| 0.05 * x)
            .collect::<Vec<_>>();
        let whole = Projected::new(
            raw.clone(),
            f_b.clone(),
            b.clone(),
            og.clone(),
            (h, t_len, d),
        )?;
        let mut s_whole = vec![0.0; h * d * d];
        let out_whole = params.attend(&window0, &whole, Some(&prev), &mut s_whole)?;
        // Into a reused buffer holding other values (and room for more): the same rows.
        let mut reused = vec![f32::NAN; 2 * n];
        let mut s_reused = vec![f32::NAN; h * d * d];
        params.attend_into(&window0, &whole, (Some(&prev), &mut s_reused), &mut reused)?;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&reused), bits(&out_whole));
        assert_eq!(bits(&s_reused), bits(&s_whole));

        // Token `t`'s rows of a `[H, T, D]` projection, as a one-token `[H, 1, D]` one.
        let token = |v: &[f32], t: usize| -> Vec<f32> {
            (0..h)
                .flat_map(|hd| v[(hd * t_len + t) * d..(hd * t_len + t + 1) * d].to_vec())
                .collect()
        };
        // Row `r` of (window ++ raw) by token.
        let ext_row = |i: usize, r: usize| -> Vec<f32> {
            if r < k - 1 {
                window0[i][r * c..(r + 1) * c].to_vec()
            } else {
                token(&raw[i], r - (k - 1))
            }
        };
        let mut s = prev;
        let mut out = Vec::new();
        for t in 0..t_len {
            let windows: [Vec<f32>; 3] =
                std::array::from_fn(|i| (t..t + k - 1).flat_map(|r| ext_row(i, r)).collect());
            let one = Projected::new(
                std::array::from_fn(|i| token(&raw[i], t)),
                token(&f_b, t),
                b[t * h..(t + 1) * h].to_vec(),
                token(&og, t),
                (h, 1, d),
            )?;
            let mut s_next = vec![f32::NAN; h * d * d];
            out.extend(params.attend(&windows, &one, Some(&s), &mut s_next)?);
            s = s_next;
        }
        assert_eq!(bits(&out_whole), bits(&out));
        assert_eq!(bits(&s_whole), bits(&s));
        assert!(out.iter().chain(&s).all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0));
        Ok(())
    }

    /// Parameters, projections, states and windows of another length than the layer's are errors, not panics.
    #[test]
    fn lengths_other_than_the_layers_are_errors() -> Result<()> {
        let (h, d, t) = (2, 8, 3);
        let cfg = shape(h, d);
        let c = h * d;
        let taps = || std::array::from_fn(|_| vec![0.1; c * 4]);
        let params = HeadParams::new(&cfg, taps(), vec![1.0; h], vec![0.0; c], vec![1.0; d], 1e-5)?;
        assert!(
            HeadParams::new(
                &cfg,
                taps(),
                vec![1.0; h + 1],
                vec![0.0; c],
                vec![1.0; d],
                1e-5
            )
            .is_err()
        );
        assert!(
            HeadParams::new(
                &cfg,
                taps(),
                vec![1.0; h],
                vec![0.0; c],
                vec![1.0; d - 1],
                1e-5
            )
            .is_err()
        );
        let n = h * t * d;
        let rows = |len: usize| vec![0.5f32; len];
        assert!(
            Projected::new(
                [rows(n), rows(n), rows(n - 1)],
                rows(n),
                rows(h * t),
                rows(n),
                (h, t, d)
            )
            .is_err()
        );
        assert!(
            Projected::new(
                [rows(n), rows(n), rows(n)],
                rows(n),
                rows(h),
                rows(n),
                (h, t, d)
            )
            .is_err()
        );
        let p = Projected::new(
            [rows(n), rows(n), rows(n)],
            rows(n),
            rows(h * t),
            rows(n),
            (h, t, d),
        )?;
        let windows: [Vec<f32>; 3] = std::array::from_fn(|_| rows(3 * c));
        let mut s = vec![0.0; h * d * d];
        let out = params.attend(&windows, &p, None, &mut s)?;
        assert_eq!(out.len(), t * c);
        assert!(out.iter().chain(&s).all(|x| x.is_finite()));
        assert!(
            params
                .attend(&windows, &p, Some(&rows(h * d * d - 1)), &mut s)
                .is_err()
        );
        assert!(
            params
                .attend(&windows, &p, None, &mut vec![0.0; h * d * d + 1])
                .is_err()
        );
        let short: [Vec<f32>; 3] = std::array::from_fn(|_| rows(2 * c));
        assert!(params.attend(&short, &p, None, &mut s).is_err());
        let other = Projected::new(
            [rows(n), rows(n), rows(n)],
            rows(n),
            rows(t),
            rows(n),
            (1, t, 2 * d),
        )?;
        assert!(params.attend(&windows, &other, None, &mut s).is_err());
        Ok(())
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
