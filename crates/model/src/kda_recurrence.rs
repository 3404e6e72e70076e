//! The delta-rule recurrence of one KDA head over a pass's tokens, on the CPU in f32.

/// One head's inputs to the recurrence.
#[derive(Clone, Debug, Default)]
pub struct HeadInputs {
    /// Queries `[T, D]`, L2-normalised and scaled.
    pub q: Vec<f32>,
    /// Keys `[T, D]`, L2-normalised.
    pub k: Vec<f32>,
    /// Values `[T, D]`.
    pub v: Vec<f32>,
    /// Decay gates in log space `[T, D]` (at most 0).
    pub g: Vec<f32>,
    /// β `[T]`.
    pub beta: Vec<f32>,
}

/// The recurrence's arithmetic over `t_len` tokens of one head of width `d`: per token and state element the
/// decay's multiply and a multiply-add each for `u = Sᵀk`, the update and `o = Sᵀq` (an FMA counting two).
pub fn recurrence_flops(t_len: usize, d: usize) -> u64 {
    7 * (t_len * d * d) as u64
}

/// Where a pass's state starts.
#[derive(Clone, Copy, Debug)]
pub enum Start<'a> {
    /// Zeros (a new conversation's state, not read).
    Zeros,
    /// These matrices (`[D_k, D_v]`), read while the new state is written elsewhere.
    From(&'a [f32]),
    /// The state buffer's own values: a pass that goes on from the one before it (a long pass cut into pieces).
    InPlace,
}

/// One head's delta-rule recurrence over `t_len` tokens: `s` (`[D_k, D_v]`, row `i` a key channel) starts as
/// `s_prev` (`None`: zeros) and ends as the head's new state; returns the output rows `[T, D]`
/// ([`recurrence_into`] into a new buffer).
pub fn recurrence_head(
    s: &mut [f32],
    s_prev: Option<&[f32]>,
    inp: &HeadInputs,
    t_len: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; t_len * d];
    recurrence_into(
        s,
        s_prev.map_or(Start::Zeros, Start::From),
        inp,
        (t_len, d),
        &mut out,
    );
    out
}

/// One head's delta-rule recurrence over `t_len` tokens (`dims` = (T, D)): `s` (`[D_k, D_v]`, row `i` a key channel)
/// starts as `start` says and ends as the head's new state; writes every value of the output rows `out[..T·D]`.
/// `inp`'s rows past the first `T` are not read, so a buffer sized for a longer pass can carry a shorter one.
///
/// Per token and state element the operations are, in this order: the decay `s ← s · exp(g_i)` (the model's
/// branch-free `exp`, [`crate::activation::exp`]); `u_j ← fma(s, k_i, u_j)` over the rows `i` in order from zero;
/// `δ_j = β (v_j − u_j)`; `s ← fma(k_i, δ_j, s)`; `o_j ← fma(s, q_i, o_j)` over the rows in order from zero. Every
/// build below runs exactly these, so the bits do not depend on the CPU, on the vector width, or on how a prompt is
/// cut into passes (decode, prefill and speculative verification agree).
///
/// `recurrence_blocks` built for the widest vectors the CPU has: AVX-512, AVX2 with FMA, or the baseline (4 wide;
/// on an x86-64 CPU without FMA, `mul_add` is libm's exactly rounded `fmaf`, slow but the same bits).
pub fn recurrence_into(
    s: &mut [f32],
    start: Start<'_>,
    inp: &HeadInputs,
    dims: (usize, usize),
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if deltafin_quant::simd::has_avx512() {
            // SAFETY: AVX-512F is present.
            return unsafe { recurrence_avx512(s, start, inp, dims, out) };
        }
        if deltafin_quant::simd::has_avx2_fma() {
            // SAFETY: AVX2 and FMA are present.
            return unsafe { recurrence_avx2(s, start, inp, dims, out) };
        }
    }
    recurrence_blocks::<16, PlainSweep>(s, start, inp, dims, out)
}

/// [`recurrence_blocks`] built for AVX-512: blocks of 64 columns, four vectors a row ([`QuadSweep`]), where the
/// width is a multiple of 64 (K3's 128), else of 32, two vectors a row ([`PairSweep`]); the running sums (`o` and
/// the next `u`) stay in registers. With two vectors a row each sum takes one FMA a row, so a row waits on the FMA
/// latency as long as its arithmetic takes at two FMAs a cycle; with four the sweep has twice the arithmetic per
/// wait. With one vector a row a sweep waits on the latency of two running sums; the plain sweep at 32 columns kept
/// its sums on the stack.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn recurrence_avx512(
    s: &mut [f32],
    start: Start<'_>,
    inp: &HeadInputs,
    dims: (usize, usize),
    out: &mut [f32],
) {
    if dims.1.is_multiple_of(64) {
        recurrence_blocks::<64, QuadSweep>(s, start, inp, dims, out)
    } else {
        recurrence_blocks::<32, PairSweep>(s, start, inp, dims, out)
    }
}

/// [`recurrence_blocks`] built for AVX2 and FMA: blocks of 16 columns (AVX2's sixteen registers hold a block's
/// running sums, its δ, a row and the row's four scalars).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn recurrence_avx2(
    s: &mut [f32],
    start: Start<'_>,
    inp: &HeadInputs,
    dims: (usize, usize),
    out: &mut [f32],
) {
    recurrence_blocks::<16, PlainSweep>(s, start, inp, dims, out)
}

/// The recurrence by blocks of `W` state columns. A column's operations involve only that column of the state, of
/// `u`, `δ`, `v` and `o`, so a block `[D, W]` (8 KiB at D = 128, W = 16) goes through every token of the pass while
/// it stays in L1, instead of the whole 64 KiB state streaming through twice a token. Within a block one sweep over
/// the rows does token `t`'s update and output and token `t + 1`'s decay and `u`, so each element is loaded and
/// stored once a token. Columns past the last whole block go in blocks of 8, then 1.
#[inline(always)]
fn recurrence_blocks<const W: usize, S: Sweep<W>>(
    s: &mut [f32],
    start: Start<'_>,
    inp: &HeadInputs,
    (t_len, d): (usize, usize),
    out: &mut [f32],
) {
    if t_len == 0 {
        match start {
            Start::From(prev) => s.copy_from_slice(prev),
            Start::Zeros => s.fill(0.0),
            Start::InPlace => {}
        }
        return;
    }
    // The decays once, not once per block.
    let decay: Vec<f32> = inp.g[..t_len * d]
        .iter()
        .map(|&g| crate::activation::exp(g))
        .collect();
    // One buffer for every block's copy (each block writes all of its rows before reading them), as wide as the
    // widest block.
    let mut lines = deltafin_quant::aligned::Lines::zeroed(d * W.max(8));
    let mut j0 = 0;
    while j0 < d {
        let rest = d - j0;
        j0 += if rest >= W {
            column_block::<W, S>(s, start, inp, (&decay, &mut lines), out, (t_len, d, j0))
        } else if rest >= 8 {
            column_block::<8, PlainSweep>(s, start, inp, (&decay, &mut lines), out, (t_len, d, j0))
        } else {
            column_block::<1, PlainSweep>(s, start, inp, (&decay, &mut lines), out, (t_len, d, j0))
        };
    }
}

/// Columns `j0 .. j0 + W` of the state through every token (`dims` = (T, D, j0)); writes those columns of `out` and
/// returns `W`. The block works on a contiguous copy (`[D, W]`): in place, its rows would lie a state row apart
/// (512 bytes at D = 128), all in a few of L1's sets, and evict each other. The copy starts a cache line, so a row of
/// 16 or 32 values is one or two whole lines (a vector load across two lines costs two).
#[inline(always)]
fn column_block<const W: usize, S: Sweep<W>>(
    s: &mut [f32],
    start: Start<'_>,
    inp: &HeadInputs,
    (decay, lines): (&[f32], &mut [f32]),
    out: &mut [f32],
    dims: (usize, usize, usize),
) -> usize {
    let (t_len, d, j0) = dims;
    let (block, _) = lines[..d * W].as_chunks_mut::<W>();
    // Token 0's decay (from the old state, or from zeros) and its u.
    let prev = match start {
        Start::From(prev) => Some(prev),
        // The block's columns of the state are written back only after its last token.
        Start::InPlace => Some(&*s),
        Start::Zeros => None,
    };
    let mut u = start_rows(block, prev.map(|p| (p, d, j0)), &inp.k[..d], &decay[..d]);
    // While the block sweeps a pass of several tokens, a few rows a token of what comes from memory next: the next
    // block's columns of the old state (its start) and this block's columns of the new one (the write-back, its lines
    // asked for owned). Done at the block's ends, those loads would each wait on memory with nothing to overlap them.
    let warm_rows = if t_len >= WARM_FROM_TOKENS {
        d.div_ceil(t_len)
    } else {
        0
    };
    let next_cols = (j0 + W).min(d)..(j0 + 2 * W).min(d);
    for t in 0..t_len {
        for i in (t * warm_rows..(t + 1) * warm_rows).take_while(|&i| i < d) {
            if let Some(prev) = prev {
                deltafin_quant::simd::prefetch_slice(
                    &prev[i * d + next_cols.start..i * d + next_cols.end],
                );
            }
            deltafin_quant::simd::prefetch_slice_for_write(&s[i * d + j0..i * d + j0 + W]);
        }
        let mut delta = [0.0f32; W];
        let v = &inp.v[t * d + j0..t * d + j0 + W];
        for j in 0..W {
            delta[j] = inp.beta[t] * (v[j] - u[j]);
        }
        let (k, q) = (&inp.k[t * d..(t + 1) * d], &inp.q[t * d..(t + 1) * d]);
        let o = if t + 1 < t_len {
            // This token's update and output, then the next token's decay and u, in one sweep.
            let next = (
                &inp.k[(t + 1) * d..(t + 2) * d],
                &decay[(t + 1) * d..(t + 2) * d],
            );
            let (o, u_next) = S::update_and_next(block, (k, q), next, &delta);
            u = u_next;
            o
        } else {
            S::update_last(block, (k, q), &delta)
        };
        out[t * d + j0..t * d + j0 + W].copy_from_slice(&o);
    }
    for (dst, row) in s.chunks_exact_mut(d).zip(block.iter()) {
        dst[j0..j0 + W].copy_from_slice(row);
    }
    W
}

/// Tokens from which a pass warms the memory a column block's neighbours need while it sweeps ([`column_block`]):
/// shorter passes (a decoded token) would ask for all of it at once.
const WARM_FROM_TOKENS: usize = 16;

/// Token 0's rows of a column block: `block[i] = prev[i][j0..j0 + W] · decay_i` (`prev` the old state with its row
/// length and the block's first column; `None`: a zero state, whose rows become `0 · decay_i`, the bits of decaying
/// zeros read from memory), and returns `u = Σ_i block[i] · k_i` in row order. Each case is its own loop, and a row
/// is copied, then scaled in place: so written, the compiler keeps a row in vectors (with the case chosen inside the
/// loop, or the product written from one slice into another, it built each row a value at a time and read it back
/// as vectors, a stall on every row).
#[inline(always)]
fn start_rows<const W: usize>(
    block: &mut [[f32; W]],
    prev: Option<(&[f32], usize, usize)>,
    k: &[f32],
    decay: &[f32],
) -> [f32; W] {
    match prev {
        Some((prev, d, j0)) => {
            for ((row, src), &dec) in block.iter_mut().zip(prev.chunks_exact(d)).zip(decay) {
                row.copy_from_slice(&src[j0..j0 + W]);
                row.iter_mut().for_each(|x| *x *= dec);
            }
        }
        None => {
            for (row, &dec) in block.iter_mut().zip(decay) {
                *row = [0.0 * dec; W];
            }
        }
    }
    let mut u = [0.0f32; W];
    for (row, &ki) in block.iter().zip(k) {
        for j in 0..W {
            u[j] = row[j].mul_add(ki, u[j]);
        }
    }
    u
}

/// One sweep over a column block's rows (`block[i]` the row of key channel `i`) for one token, in the contract's
/// order: per row `x = fma(k_i, δ, s)`, `o ← fma(x, q_i, o)`; while another token follows, `y = x · decay_next_i`,
/// `u_next ← fma(y, k_next_i, u_next)` and the row becomes `y`, else it becomes `x`.
trait Sweep<const W: usize> {
    /// This token's update and output and the next token's decay and `u`: returns `(o, u_next)`. `kq` holds this
    /// token's key and query, `next` the next token's key and decay, `D` values each.
    fn update_and_next(
        block: &mut [[f32; W]],
        kq: (&[f32], &[f32]),
        next: (&[f32], &[f32]),
        delta: &[f32; W],
    ) -> ([f32; W], [f32; W]);

    /// The pass's last token: update and output only; returns `o`.
    fn update_last(block: &mut [[f32; W]], kq: (&[f32], &[f32]), delta: &[f32; W]) -> [f32; W];
}

/// The sweep as plain loops over the columns, which the compiler vectorises for the build it is inlined into.
struct PlainSweep;

impl<const W: usize> Sweep<W> for PlainSweep {
    #[inline(always)]
    fn update_and_next(
        block: &mut [[f32; W]],
        (k, q): (&[f32], &[f32]),
        (k_next, dec_next): (&[f32], &[f32]),
        delta: &[f32; W],
    ) -> ([f32; W], [f32; W]) {
        let (mut o, mut u_next) = ([0.0f32; W], [0.0f32; W]);
        for ((((row, &ki), &qi), &kn), &dn) in
            block.iter_mut().zip(k).zip(q).zip(k_next).zip(dec_next)
        {
            for j in 0..W {
                let x = ki.mul_add(delta[j], row[j]);
                o[j] = x.mul_add(qi, o[j]);
                let y = x * dn;
                u_next[j] = y.mul_add(kn, u_next[j]);
                row[j] = y;
            }
        }
        (o, u_next)
    }

    #[inline(always)]
    fn update_last(block: &mut [[f32; W]], (k, q): (&[f32], &[f32]), delta: &[f32; W]) -> [f32; W] {
        let mut o = [0.0f32; W];
        for ((row, &ki), &qi) in block.iter_mut().zip(k).zip(q) {
            for j in 0..W {
                let x = ki.mul_add(delta[j], row[j]);
                o[j] = x.mul_add(qi, o[j]);
                row[j] = x;
            }
        }
        o
    }
}

/// A sweep of `$w` columns as `$n` AVX-512 vectors a row, its running sums in registers. Only [`recurrence_avx512`]
/// uses these: their methods must be inlined into code built with AVX-512F.
macro_rules! vector_sweep {
    ($name:ident, $w:literal, $n:literal) => {
        #[cfg(target_arch = "x86_64")]
        struct $name;

        #[cfg(target_arch = "x86_64")]
        impl Sweep<$w> for $name {
            #[inline(always)]
            fn update_and_next(
                block: &mut [[f32; $w]],
                (k, q): (&[f32], &[f32]),
                (k_next, dec_next): (&[f32], &[f32]),
                delta: &[f32; $w],
            ) -> ([f32; $w], [f32; $w]) {
                use std::arch::x86_64::*;
                let (mut o, mut u_next) = ([0.0f32; $w], [0.0f32; $w]);
                // SAFETY: only `recurrence_avx512` (built with AVX-512F, called when the CPU has it) reaches this;
                // every pointer is to a row or array of `$n` 16-value vectors.
                unsafe {
                    let d: [__m512; $n] =
                        std::array::from_fn(|v| _mm512_loadu_ps(delta.as_ptr().add(16 * v)));
                    let mut os = [_mm512_setzero_ps(); $n];
                    let mut us = [_mm512_setzero_ps(); $n];
                    for ((((row, &ki), &qi), &kn), &dn) in
                        block.iter_mut().zip(k).zip(q).zip(k_next).zip(dec_next)
                    {
                        let p = row.as_mut_ptr();
                        let (ki, qi) = (_mm512_set1_ps(ki), _mm512_set1_ps(qi));
                        let (kn, dn) = (_mm512_set1_ps(kn), _mm512_set1_ps(dn));
                        for v in 0..$n {
                            let x = _mm512_fmadd_ps(ki, d[v], _mm512_loadu_ps(p.add(16 * v)));
                            os[v] = _mm512_fmadd_ps(x, qi, os[v]);
                            let y = _mm512_mul_ps(x, dn);
                            us[v] = _mm512_fmadd_ps(y, kn, us[v]);
                            _mm512_storeu_ps(p.add(16 * v), y);
                        }
                    }
                    for v in 0..$n {
                        _mm512_storeu_ps(o.as_mut_ptr().add(16 * v), os[v]);
                        _mm512_storeu_ps(u_next.as_mut_ptr().add(16 * v), us[v]);
                    }
                }
                (o, u_next)
            }

            #[inline(always)]
            fn update_last(
                block: &mut [[f32; $w]],
                (k, q): (&[f32], &[f32]),
                delta: &[f32; $w],
            ) -> [f32; $w] {
                use std::arch::x86_64::*;
                let mut o = [0.0f32; $w];
                // SAFETY: as in `update_and_next`.
                unsafe {
                    let d: [__m512; $n] =
                        std::array::from_fn(|v| _mm512_loadu_ps(delta.as_ptr().add(16 * v)));
                    let mut os = [_mm512_setzero_ps(); $n];
                    for ((row, &ki), &qi) in block.iter_mut().zip(k).zip(q) {
                        let p = row.as_mut_ptr();
                        let (ki, qi) = (_mm512_set1_ps(ki), _mm512_set1_ps(qi));
                        for v in 0..$n {
                            let x = _mm512_fmadd_ps(ki, d[v], _mm512_loadu_ps(p.add(16 * v)));
                            os[v] = _mm512_fmadd_ps(x, qi, os[v]);
                            _mm512_storeu_ps(p.add(16 * v), x);
                        }
                    }
                    for v in 0..$n {
                        _mm512_storeu_ps(o.as_mut_ptr().add(16 * v), os[v]);
                    }
                }
                o
            }
        }
    };
}

vector_sweep!(PairSweep, 32, 2);
vector_sweep!(QuadSweep, 64, 4);

#[cfg(test)]
mod tests {
    use super::*;

    /// Smooth inputs of `t_len` tokens for one head of width `d`: q, k, v from sines of frequencies `f[0..3]`, decay
    /// gates (at most 0) from `f[3]`, β rising from `beta0` by 0.1 a token.
    fn test_inputs(t_len: usize, d: usize, f: [f32; 4], beta0: f32) -> HeadInputs {
        let val = |i: usize, k: f32| (i as f32 * k).sin() * 0.9;
        let rows = |k: f32| (0..t_len * d).map(|i| val(i, k)).collect();
        HeadInputs {
            q: rows(f[0]),
            k: rows(f[1]),
            v: rows(f[2]),
            g: (0..t_len * d).map(|i| -val(i, f[3]).abs()).collect(),
            beta: (0..t_len).map(|t| beta0 + 0.1 * t as f32).collect(),
        }
    }

    /// A build of the recurrence, as [`recurrence_into`] is called.
    type Recurrence = fn(&mut [f32], Start<'_>, &HeadInputs, (usize, usize), &mut [f32]);

    /// The AVX-512 builds on their own (pairs and quads of vectors a row), where the CPU has AVX-512 (the dispatched
    /// build runs one of them there too, by the width).
    fn vector_builds() -> Vec<(&'static str, Recurrence)> {
        #[cfg(target_arch = "x86_64")]
        if deltafin_quant::simd::has_avx512() {
            /// # Safety
            /// The CPU must support AVX-512F.
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn pairs(
                s: &mut [f32],
                start: Start<'_>,
                inp: &HeadInputs,
                dims: (usize, usize),
                out: &mut [f32],
            ) {
                recurrence_blocks::<32, PairSweep>(s, start, inp, dims, out)
            }
            /// # Safety
            /// The CPU must support AVX-512F.
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn quads(
                s: &mut [f32],
                start: Start<'_>,
                inp: &HeadInputs,
                dims: (usize, usize),
                out: &mut [f32],
            ) {
                recurrence_blocks::<64, QuadSweep>(s, start, inp, dims, out)
            }
            // SAFETY (both): AVX-512F is present.
            return vec![
                ("32 in AVX-512 pairs", |s, start, inp, dims, out| unsafe {
                    pairs(s, start, inp, dims, out)
                }),
                ("64 in AVX-512 quads", |s, start, inp, dims, out| unsafe {
                    quads(s, start, inp, dims, out)
                }),
            ];
        }
        Vec::new()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The contract written plainly: per token, the whole state in four passes (decay, `u`, update, output).
    fn per_token_form(
        s_prev: &[f32],
        inp: &HeadInputs,
        t_len: usize,
        d: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut s = s_prev.to_vec();
        let mut out = vec![0.0f32; t_len * d];
        for t in 0..t_len {
            for i in 0..d {
                let dec = crate::activation::exp(inp.g[t * d + i]);
                s[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= dec);
            }
            let mut u = vec![0.0f32; d];
            for i in 0..d {
                for j in 0..d {
                    u[j] = s[i * d + j].mul_add(inp.k[t * d + i], u[j]);
                }
            }
            let delta: Vec<f32> = (0..d)
                .map(|j| inp.beta[t] * (inp.v[t * d + j] - u[j]))
                .collect();
            for i in 0..d {
                for j in 0..d {
                    s[i * d + j] = inp.k[t * d + i].mul_add(delta[j], s[i * d + j]);
                }
            }
            for i in 0..d {
                for j in 0..d {
                    out[t * d + j] = s[i * d + j].mul_add(inp.q[t * d + i], out[t * d + j]);
                }
            }
        }
        (s, out)
    }

    /// Every build and block width gives the bits of the plain per-token form, at widths that leave tails of 8 and 1
    /// columns (and, for the quads, of 8 after one block of 64).
    #[test]
    fn every_build_gives_the_per_token_bits() {
        let val = |i: usize, k: f32| (i as f32 * k).sin() * 0.9;
        for (d, t_len) in [(24, 7), (40, 5), (19, 3), (128, 4), (72, 3)] {
            let inp = test_inputs(t_len, d, [0.31, 0.17, 0.23, 0.07], 0.1);
            let prev: Vec<f32> = (0..d * d).map(|i| val(i, 0.013)).collect();
            let (s_ref, out_ref) = per_token_form(&prev, &inp, t_len, d);
            let builds: [(&str, Recurrence); 4] = [
                ("dispatched", recurrence_into),
                ("8", recurrence_blocks::<8, PlainSweep>),
                ("16", recurrence_blocks::<16, PlainSweep>),
                ("32", recurrence_blocks::<32, PlainSweep>),
            ];
            for (name, f) in builds.into_iter().chain(vector_builds()) {
                let mut s = vec![f32::NAN; d * d];
                let mut out = vec![f32::NAN; t_len * d];
                f(&mut s, Start::From(&prev), &inp, (t_len, d), &mut out);
                assert_eq!(bits(&out), bits(&out_ref), "{name}, D {d}, T {t_len}");
                assert_eq!(bits(&s), bits(&s_ref), "{name}, D {d}, T {t_len}");
            }
            assert!(out_ref.iter().chain(&s_ref).all(|x| x.is_finite()));
            assert!(out_ref.iter().any(|&x| x != 0.0));
        }
    }

    /// A pass cut in two (the state carried between them, as decode, chunked prefill and speculative verification
    /// cut a prompt) gives the bits of the whole pass, wherever the cut.
    #[test]
    fn a_pass_cut_anywhere_gives_the_same_bits() {
        let (d, t_len) = (40, 9);
        let inp = test_inputs(t_len, d, [0.27, 0.13, 0.37, 0.11], 0.15);
        let mut whole_s = vec![0.0f32; d * d];
        let whole = recurrence_head(&mut whole_s, None, &inp, t_len, d);
        for cut in 0..=t_len {
            let part = |from: usize, to: usize| HeadInputs {
                q: inp.q[from * d..to * d].to_vec(),
                k: inp.k[from * d..to * d].to_vec(),
                v: inp.v[from * d..to * d].to_vec(),
                g: inp.g[from * d..to * d].to_vec(),
                beta: inp.beta[from..to].to_vec(),
            };
            let mut s1 = vec![0.0f32; d * d];
            let mut out = recurrence_head(&mut s1, None, &part(0, cut), cut, d);
            let mut s2 = vec![0.0f32; d * d];
            out.extend(recurrence_head(
                &mut s2,
                Some(&s1),
                &part(cut, t_len),
                t_len - cut,
                d,
            ));
            assert_eq!(bits(&out), bits(&whole), "cut at {cut}");
            assert_eq!(bits(&s2), bits(&whole_s), "cut at {cut}");
        }
    }

    /// A pass cut into pieces that go on in place (`Start::InPlace`, as a layer's heads run a long prompt a piece at
    /// a time) gives the bits of the whole pass, into an output buffer longer than a piece.
    #[test]
    fn pieces_going_on_in_place_give_the_whole_pass_bits() {
        let (d, t_len) = (40, 11);
        let inp = test_inputs(t_len, d, [0.23, 0.19, 0.31, 0.09], 0.12);
        let prev: Vec<f32> = (0..d * d).map(|i| (i as f32 * 0.017).cos() * 0.3).collect();
        let mut whole_s = vec![0.0f32; d * d];
        let whole = recurrence_head(&mut whole_s, Some(&prev), &inp, t_len, d);
        for piece in [1, 3, 4, 11] {
            let mut s = vec![f32::NAN; d * d];
            let mut out = Vec::new();
            let mut buf = vec![f32::NAN; piece * d];
            for t0 in (0..t_len).step_by(piece) {
                let n = piece.min(t_len - t0);
                let part = HeadInputs {
                    q: inp.q[t0 * d..(t0 + piece).min(t_len) * d].to_vec(),
                    k: inp.k[t0 * d..(t0 + piece).min(t_len) * d].to_vec(),
                    v: inp.v[t0 * d..(t0 + piece).min(t_len) * d].to_vec(),
                    g: inp.g[t0 * d..(t0 + piece).min(t_len) * d].to_vec(),
                    beta: inp.beta[t0..t0 + n].to_vec(),
                };
                let start = if t0 == 0 {
                    Start::From(&prev)
                } else {
                    Start::InPlace
                };
                recurrence_into(&mut s, start, &part, (n, d), &mut buf);
                out.extend_from_slice(&buf[..n * d]);
            }
            assert_eq!(bits(&out), bits(&whole), "pieces of {piece}");
            assert_eq!(bits(&s), bits(&whole_s), "pieces of {piece}");
        }
    }

    /// The zero state (`None`, not read) gives the bits of a zero state read from memory, into a buffer holding
    /// garbage, at one token, several, and none.
    #[test]
    fn zero_state_is_not_read_and_gives_the_same_bits() {
        let d = 16;
        let zeros = vec![0.0f32; d * d];
        for t_len in [0, 1, 5] {
            let inp = test_inputs(t_len, d, [0.29, 0.19, 0.41, 0.05], 0.2);
            let (mut a, mut b) = (vec![f32::NAN; d * d], vec![7.0f32; d * d]);
            let out_a = recurrence_head(&mut a, None, &inp, t_len, d);
            let out_b = recurrence_head(&mut b, Some(&zeros), &inp, t_len, d);
            assert_eq!(bits(&out_a), bits(&out_b), "{t_len} tokens");
            assert_eq!(bits(&a), bits(&b), "{t_len} tokens");
            assert!(a.iter().all(|x| x.is_finite()), "{t_len} tokens");
            if t_len > 0 {
                assert!(out_a.iter().any(|&x| x != 0.0), "{t_len} tokens");
            }
        }
    }
}
