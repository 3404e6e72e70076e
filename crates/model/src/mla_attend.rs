//! MLA's attention over the latent cache on the CPU, one head and a block of queries at a time, in the absorbed
//! form (see [`crate::mla`]).
//!
//! Per query (its position sees cache rows `0 .. seen`), in this order, whatever block it shares:
//! - `q_abs_i = Σ_j fma(q_nope,j, W_UK,h[j][i], ·)` over `j` in order from zero;
//! - `score_n = ([q_abs, q_pe] · [c_n, k_pe,n]) · scale` (the dot contract over the whole cache row);
//! - `p_n = e^{score_n − max} / Σ e^{…}` with the model's branch-free `exp` ([`crate::activation::exp`]) and the sum
//!   over `n` in order;
//! - `ctx_i = Σ_n fma(p_n, c_n,i, ·)` over `n` in order from zero;
//! - `out_r = Σ_i fma(ctx_i, W_UV,hᵀ[i][r], ·)` over `i` in order from zero.
//!
//! So a query's result does not depend on how many queries share the call (prefill, decode and speculative
//! verification agree to the bit). Within a block the scores run as multi-input tiles of the dot contract
//! (`deltafin_quant::dot::dot_f32_tiles`: each cache row loaded once for several queries), and the absorbed products
//! and the context as multiply-add chains in register tiles of up to four queries by 16 to 64 outputs, built for the
//! widest vectors the CPU has (on AVX-512, tiles of up to six queries by 64 or 128 outputs in named registers).

use deltafin_quant::aligned::Lines;
use deltafin_quant::dot::dot_f32_tiles;

use crate::activation;

/// Queries from which the scores run in tiles (`score_tiles!`).
#[cfg(target_arch = "x86_64")]
const SCORE_QUERIES: usize = 4;
/// Queries of one score tile.
#[cfg(target_arch = "x86_64")]
const SCORE_TILE_QUERIES: usize = 2;
/// Cache rows of one score tile.
#[cfg(target_arch = "x86_64")]
const SCORE_ROWS: usize = 6;
/// Rows per call of [`dot_f32_tiles`].
const TILE_ROWS: usize = 32;
/// Queries of one register tile of the context (and of the absorbed products).
const CTX_QUERIES: usize = 4;
/// Queries of one AVX-512 register tile of the context (six by four vectors: 24 sums, so a row's four loads from L2
/// feed 24 FMAs where four queries' fed sixteen).
#[cfg(target_arch = "x86_64")]
const AVX512_CTX_QUERIES: usize = 6;
/// Outputs of one register tile at [`CTX_QUERIES`] queries (twice as many at two queries, four times at one).
const CTX_COLS: usize = 16;
/// Outputs of one AVX-512 register tile at three or four queries (twice as many at one or two, so that one query's
/// tile fits `W_UV`'s 128 columns): four 16-lane vectors a query, so a row's four loads and the queries' broadcasts
/// feed sixteen FMAs. The plain tiles' sums, as wide
/// arrays, stay on the stack in an AVX-512 build (each FMA then waits on a store and a load), so these name vectors.
const AVX512_COLS: usize = 64;

/// One head's arithmetic over a prompt of `t_len` tokens from an empty cache (query `p` of `1..=t_len` sees `p`
/// rows), an FMA counting two: the absorbed products `q_nope · W_UK` and `ctx · W_UV` once a token, the scores over
/// the cache row's `kv_lora + rope` values and the context over its `kv_lora` once a row seen. `(kvl, rope, nope, v)`
/// are the model's widths.
pub fn prompt_flops(t_len: usize, (kvl, rope, nope, v): (usize, usize, usize, usize)) -> f64 {
    let t = t_len as f64;
    let positions = t * (t + 1.0) / 2.0;
    2.0 * (t * (kvl * (nope + v)) as f64 + positions * (2 * kvl + rope) as f64)
}

/// One of a head's absorbed matrices `[rows, cols]` in f32, every row starting a cache line (its stride `cols`
/// rounded up to 16 values), so the register tiles' loads of a row never straddle two lines.
#[derive(Debug)]
pub struct AbsorbedMatrix {
    values: Lines,
    rows: usize,
    cols: usize,
    stride: usize,
}

impl AbsorbedMatrix {
    /// The matrix of `values` (`rows · cols`, row-major), or `None` when their count is not `rows · cols`.
    pub fn new(rows: usize, cols: usize, values: &[f32]) -> Option<Self> {
        if rows.checked_mul(cols)? != values.len() {
            return None;
        }
        let stride = cols.next_multiple_of(16);
        let mut lines = Lines::zeroed(rows * stride);
        for (dst, src) in lines
            .chunks_exact_mut(stride.max(1))
            .zip(values.chunks_exact(cols.max(1)))
        {
            dst[..cols].copy_from_slice(src);
        }
        Some(AbsorbedMatrix {
            values: lines,
            rows,
            cols,
            stride,
        })
    }

    /// Row `r` (`cols` values).
    pub fn row(&self, r: usize) -> &[f32] {
        &self.values[r * self.stride..r * self.stride + self.cols]
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// One head's absorbed matrices and the latent cache it attends over.
pub struct HeadCache<'a> {
    /// `W_UK,h` `[nope, kv_lora]`.
    pub w_uk: &'a AbsorbedMatrix,
    /// `W_UV,hᵀ` `[kv_lora, v]`.
    pub w_uv_t: &'a AbsorbedMatrix,
    /// The cache rows (`kv_lora` latent values, then `rope` values of `k_pe`).
    pub rows: &'a [&'a [f32]],
    /// `kv_lora`.
    pub kvl: usize,
    /// The score scale, `(nope + rope)^-½`.
    pub scale: f32,
}

/// A block of queries: query `k`'s nope and rope parts and the cache rows it sees (`seen[k]`, at least 1, at most
/// the cache's rows). Writes each query's `[v]` output row into `out` (`queries.len() · v` values).
pub fn attend(hc: &HeadCache<'_>, queries: &[(&[f32], &[f32])], seen: &[usize], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if deltafin_quant::simd::has_avx512() {
            // SAFETY: AVX-512F is present.
            return unsafe { attend_avx512(hc, queries, seen, out) };
        }
        if deltafin_quant::simd::has_avx2_fma() {
            // SAFETY: AVX2 and FMA are present.
            return unsafe { attend_avx2(hc, queries, seen, out) };
        }
    }
    attend_body::<false>(hc, queries, seen, out)
}

/// [`attend_body`] built for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn attend_avx512(
    hc: &HeadCache<'_>,
    queries: &[(&[f32], &[f32])],
    seen: &[usize],
    out: &mut [f32],
) {
    attend_body::<true>(hc, queries, seen, out)
}

/// [`attend_body`] built for AVX2 and FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(
    hc: &HeadCache<'_>,
    queries: &[(&[f32], &[f32])],
    seen: &[usize],
    out: &mut [f32],
) {
    attend_body::<false>(hc, queries, seen, out)
}

/// The block's attention; `AVX512` (only in [`attend_avx512`]) runs the context and absorbed products in
/// [`context_tile_avx512`]'s register tiles.
#[inline(always)]
fn attend_body<const AVX512: bool>(
    hc: &HeadCache<'_>,
    queries: &[(&[f32], &[f32])],
    seen: &[usize],
    out: &mut [f32],
) {
    let (nq, kvl) = (queries.len(), hc.kvl);
    let span = seen.iter().copied().max().unwrap_or(0).min(hc.rows.len());
    let nopes: Vec<&[f32]> = queries.iter().map(|q| q.0).collect();
    let q_abs = chains::<AVX512>(hc.w_uk, &nopes);
    // Scores of every query against every row of the span ([row][query]); a query's rows past its own `seen` are
    // computed and never read.
    let rows = &hc.rows[..span];
    let latents: Vec<&[f32]> = rows.iter().map(|r| &r[..kvl]).collect();
    // Each query as one row of the cache's width: its latent part, then its rope part, on whole cache lines like the
    // cache rows (`crate::state::CacheBlock`): at K3's width every query then starts a line, and the score tiles'
    // loads of it never straddle two.
    let width = kvl + queries.first().map_or(0, |q| q.1.len());
    let mut qcat = Lines::zeroed(nq * width);
    for ((dst, a), q) in qcat
        .chunks_exact_mut(width.max(1))
        .zip(q_abs.chunks_exact(kvl))
        .zip(queries)
    {
        dst[..kvl].copy_from_slice(a);
        for (d, &v) in dst[kvl..].iter_mut().zip(q.1) {
            *d = v;
        }
    }
    let qs: Vec<&[f32]> = qcat[..nq * width].chunks_exact(width.max(1)).collect();
    // The scores, then in place the probabilities, `[row][query]`.
    let mut p = vec![0.0f32; span * nq];
    scores::<AVX512>(rows, &qs, &mut p);
    softmax_by_rows(&mut p, seen, hc.scale);
    let mut ctx = vec![0.0f32; nq * kvl];
    context::<AVX512>(&Weights::by_row(&p, nq), seen, &latents, kvl, &mut ctx);
    let ctxs: Vec<&[f32]> = ctx.chunks_exact(kvl).collect();
    out[..nq * hc.w_uv_t.cols()].copy_from_slice(&chains::<AVX512>(hc.w_uv_t, &ctxs));
}

/// `xs[k] · m` for every input (`m` `[rows, cols]`, each input `rows` long), `[input][col]`: per output a chain of
/// multiply-adds over the rows in order ([`context`] with every row seen).
#[inline(always)]
fn chains<const AVX512: bool>(m: &AbsorbedMatrix, xs: &[&[f32]]) -> Vec<f32> {
    let (rows, cols) = (m.rows(), m.cols());
    let ms: Vec<&[f32]> = (0..rows).map(|r| m.row(r)).collect();
    // Each input's values are its weights of the rows, read where they lie (a copy `[row][input]` for the
    // context's layout of probabilities took as long as half the product).
    let nx = xs.len();
    let mut out = vec![0.0f32; nx * cols];
    context::<AVX512>(&Weights::by_query(xs), &vec![rows; nx], &ms, cols, &mut out);
    out
}

/// `p[n · nq + k]` (the scores of query `k`, `nq = seen.len()`, against rows `n`) becomes query `k`'s probability of
/// row `n` for `n < seen[k]`: `v = s · scale`, `m = max v` (folded in row order from −∞), `e = exp(v − m)`,
/// `total = Σ e` in row order from zero, `p = e / total`. Sixteen queries at a time, one in each lane, so the max and
/// the sum, each a chain over the rows, run sixteen chains at once; a lane past its query's rows adds nothing (its
/// values are left unread). The same operations in the same order as one query at a time, so the same bits.
#[inline(always)]
fn softmax_by_rows(p: &mut [f32], seen: &[usize], scale: f32) {
    const L: usize = 16;
    let nq = seen.len();
    let span = p.len() / nq.max(1);
    let mut k0 = 0;
    while k0 + L <= nq {
        let s: [usize; L] = std::array::from_fn(|l| seen[k0 + l]);
        let mut max = [f32::NEG_INFINITY; L];
        for (n, row) in p.chunks_exact_mut(nq).enumerate() {
            let row = &mut row[k0..k0 + L];
            for l in 0..L {
                row[l] *= scale;
                let v = if n < s[l] { row[l] } else { f32::NEG_INFINITY };
                max[l] = max[l].max(v);
            }
        }
        let mut total = [0.0f32; L];
        for (n, row) in p.chunks_exact_mut(nq).enumerate() {
            let row = &mut row[k0..k0 + L];
            for l in 0..L {
                let e = activation::exp(row[l] - max[l]);
                row[l] = e;
                total[l] += if n < s[l] { e } else { 0.0 };
            }
        }
        for row in p.chunks_exact_mut(nq) {
            let row = &mut row[k0..k0 + L];
            for l in 0..L {
                row[l] /= total[l];
            }
        }
        k0 += L;
    }
    // The last queries one at a time.
    for (k, &sk) in seen.iter().enumerate().skip(k0) {
        let mut max = f32::NEG_INFINITY;
        for n in 0..sk.min(span) {
            p[n * nq + k] *= scale;
            max = max.max(p[n * nq + k]);
        }
        let mut total = 0.0f32;
        for n in 0..sk.min(span) {
            let e = activation::exp(p[n * nq + k] - max);
            p[n * nq + k] = e;
            total += e;
        }
        for n in 0..sk.min(span) {
            p[n * nq + k] /= total;
        }
    }
}

/// Every query's score against every row (`out[r · xs.len() + t]`, the dot contract): in the register tiles of
/// this build where a block has a tile's [`SCORE_QUERIES`] queries, else (decode, a short verification) by the
/// shared walk, whose one-input kernels run all of a product's accumulators at once where a tile would run three
/// rows' chains one accumulator at a time.
#[inline(always)]
fn scores<const AVX512: bool>(rows: &[&[f32]], xs: &[&[f32]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if xs.len() >= SCORE_QUERIES {
        if AVX512 {
            // SAFETY: only the AVX-512 build sets `AVX512` (its caller checked the CPU).
            return unsafe { scores_avx512(rows, xs, out) };
        }
        if deltafin_quant::simd::has_avx2_fma() {
            // SAFETY: AVX2 and FMA are present (checked just above).
            return unsafe { scores_avx2(rows, xs, out) };
        }
    }
    tiles_by_rows(rows, xs, out)
}

/// [`dot_f32_tiles`] over [`TILE_ROWS`] rows at a time (`out[r · xs.len() + t]`), so that its accumulators (128
/// bytes a product) stay a small heap block in cache instead of a fresh mapping for a whole span of rows.
#[inline(always)]
fn tiles_by_rows(rows: &[&[f32]], xs: &[&[f32]], out: &mut [f32]) {
    let per = xs.len().max(1);
    for (rs, o) in rows.chunks(TILE_ROWS).zip(out.chunks_mut(TILE_ROWS * per)) {
        dot_f32_tiles(rs, xs, o);
    }
}

/// Defines `$scores(rows, xs, out)`: [`tiles_by_rows`]'s scores (`out[r · xs.len() + t]`) in tiles of up to
/// [`SCORE_ROWS`] cache rows by [`SCORE_TILE_QUERIES`] queries of `$simd`'s dot contract kernels, the queries as the
/// kernels' held rows and the cache rows as their inputs, rows outermost (six rows stay in L1 while every query pair
/// passes them, so each row comes from L3 once a block of queries, and a step loads four query vectors from L2 for
/// 24 FMAs where three rows by four queries loaded eight). Each tile's accumulators start as zeros
/// in registers, run over every whole block (`dot_f32_tile`) and end in the contract's tail and reduction
/// (`dot_f32_finish`): the scores have `dot_f32_ref`'s bits without the shared walk's accumulator buffer (and, on
/// AVX-512, realigned row copies) allocated and zeroed for every call. The CPU must have `$simd`'s features: only
/// the build for them calls `$scores`.
#[cfg(target_arch = "x86_64")]
macro_rules! score_tiles {
    ($scores:ident, $tile:ident, $simd:ident, $zero:expr, $reduce_all:path, $features:literal) => {
        /// # Safety
        /// The CPU must have the build's features.
        #[target_feature(enable = $features)]
        #[inline(never)]
        unsafe fn $scores(rows: &[&[f32]], xs: &[&[f32]], out: &mut [f32]) {
            let n = xs.first().map_or(0, |x| x.len());
            if rows.iter().chain(xs).any(|v| v.len() != n) {
                // Not the cache's shape: the shared walk checks and handles it.
                return tiles_by_rows(rows, xs, out);
            }
            let full = n / deltafin_quant::dot::BLOCK * deltafin_quant::dot::BLOCK;
            let mut r0 = 0;
            while r0 < rows.len() {
                let rn = SCORE_ROWS.min(rows.len() - r0);
                let mut t0 = 0;
                while t0 < xs.len() {
                    let tn = SCORE_TILE_QUERIES.min(xs.len() - t0);
                    let at = (r0, t0, full);
                    match (tn, rn) {
                        (1, 1) => $tile::<1, 1>(rows, xs, at, out),
                        (1, 2) => $tile::<1, 2>(rows, xs, at, out),
                        (1, 3) => $tile::<1, 3>(rows, xs, at, out),
                        (1, 4) => $tile::<1, 4>(rows, xs, at, out),
                        (1, 5) => $tile::<1, 5>(rows, xs, at, out),
                        (1, _) => $tile::<1, 6>(rows, xs, at, out),
                        (_, 1) => $tile::<2, 1>(rows, xs, at, out),
                        (_, 2) => $tile::<2, 2>(rows, xs, at, out),
                        (_, 3) => $tile::<2, 3>(rows, xs, at, out),
                        (_, 4) => $tile::<2, 4>(rows, xs, at, out),
                        (_, 5) => $tile::<2, 5>(rows, xs, at, out),
                        _ => $tile::<2, 6>(rows, xs, at, out),
                    }
                    t0 += tn;
                }
                r0 += rn;
            }
        }

        /// Queries `t0 .. t0 + Q` by cache rows `r0 .. r0 + C` (`at` = (r0, t0, whole-block values)): the queries
        /// as the kernel's rows, held while the cache rows pass (the dot contract's products are the same with the
        /// two sides swapped: each step a multiply-add of the two values).
        #[inline(always)]
        fn $tile<const Q: usize, const C: usize>(
            rows: &[&[f32]],
            xs: &[&[f32]],
            (r0, t0, full): (usize, usize, usize),
            out: &mut [f32],
        ) {
            use deltafin_quant::simd::$simd::{F32Acc, dot_f32_finish, dot_f32_tile};
            let q: [&[f32]; Q] = std::array::from_fn(|k| xs[t0 + k]);
            let c: [&[f32]; C] = std::array::from_fn(|k| rows[r0 + k]);
            let nq = xs.len();
            // SAFETY: the CPU has the kernels' features (the caller's build); every row and query has one length
            // (checked), `full` whole blocks of it, and `acc` holds the `Q · C` products at stride `C`.
            unsafe {
                let mut acc: [F32Acc; 12] = [$zero; 12];
                dot_f32_tile::<Q, C>(q, c, (0, full), &mut acc, C);
                // Rows without a tail (K3's 576 values) reduce every product of the tile at once where the build can.
                let no_tail = q.first().is_some_and(|v| v.len() == full);
                let all = if no_tail {
                    $reduce_all(&acc[..Q * C])
                } else {
                    None
                };
                for (i, qv) in q.iter().enumerate() {
                    for (j, cv) in c.iter().enumerate() {
                        out[(r0 + j) * nq + t0 + i] = match &all {
                            Some(sums) => sums[i * C + j],
                            None => dot_f32_finish(&acc[i * C + j], qv, cv),
                        };
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
score_tiles!(
    scores_avx512,
    score_tile_avx512,
    avx512,
    [std::arch::x86_64::_mm512_setzero_ps(); 2],
    reduce_all_avx512,
    "avx512f,avx512vl,avx2,fma"
);
#[cfg(target_arch = "x86_64")]
score_tiles!(
    scores_avx2,
    score_tile_avx2,
    avx2,
    [std::arch::x86_64::_mm256_setzero_ps(); 4],
    reduce_one_at_a_time,
    "avx2,fma"
);

/// A score tile's products (at most 16, no tail) reduced at once (`dot_f32_finish16`). Only the AVX-512 build of
/// the scores calls it.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce_all_avx512(acc: &[deltafin_quant::simd::avx512::F32Acc]) -> Option<[f32; 16]> {
    // SAFETY: AVX-512F is present (the caller's build); a tile holds at most 12 products.
    Some(unsafe { deltafin_quant::simd::avx512::dot_f32_finish16(acc) })
}

/// The AVX2 build reduces its products one at a time.
///
/// # Safety
/// None (unsafe only to share [`reduce_all_avx512`]'s signature in the tiles' macro).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce_one_at_a_time(_: &[deltafin_quant::simd::avx2::F32Acc]) -> Option<[f32; 16]> {
    None
}

/// `ctx[k] = Σ_n w(n, k) · latents[n]` over `n < seen[k]` in order (fused multiply-adds), `w` the weights of each
/// row for each query ([`Weights`]).
/// Rows every query of a group of [`CTX_QUERIES`] sees go through register tiles ([`run_tile`]); the rows past the
/// group's smallest `seen`, and channels past its last whole tile, follow per query, still in order. The tiles run
/// by chunks of channels, every group's tiles over one chunk before the next chunk: the chunk's slice of the rows
/// (a long span's: `span` × 512 bytes) stays in L2 from one group to the next instead of coming from L3 for each.
#[inline(always)]
fn context<const AVX512: bool>(
    w: &Weights<'_>,
    seen: &[usize],
    latents: &[&[f32]],
    kvl: usize,
    ctx: &mut [f32],
) {
    let nq = seen.len();
    let rows_in = TileIn { w, latents, kvl };
    // (first query, queries, rows all of them see, tile width) of each group.
    let per_group = group_queries::<AVX512>();
    let groups: Vec<(usize, usize, usize, usize)> = (0..nq)
        .step_by(per_group)
        .map(|q0| {
            let qn = per_group.min(nq - q0);
            let common = seen[q0..q0 + qn].iter().copied().min().unwrap_or(0);
            (q0, qn, common, tile_width::<AVX512>(qn))
        })
        .collect();
    // The widest tile, a multiple of every other width.
    let chunk = tile_width::<AVX512>(1);
    let whole = kvl / chunk * chunk;
    for c0 in (0..whole).step_by(chunk) {
        for &(q0, qn, common, width) in &groups {
            for i0 in (c0..c0 + chunk).step_by(width) {
                run_tile::<AVX512>(qn, &rows_in, q0, (common, i0), ctx);
            }
        }
    }
    for &(q0, qn, common, width) in &groups {
        let mut i0 = whole;
        while i0 + width <= kvl {
            run_tile::<AVX512>(qn, &rows_in, q0, (common, i0), ctx);
            i0 += width;
        }
        for k in q0..q0 + qn {
            let ck = &mut ctx[k * kvl..(k + 1) * kvl];
            // Channels past the last whole tile, from the first row (none at K3's widths: then no walk over the
            // rows at all, a bounds check and a weight lookup a row for nothing).
            let tail = if i0 < kvl { common } else { 0 };
            for (n, row) in latents[..tail].iter().enumerate() {
                let w = w.at(n, k);
                for (c, &v) in ck[i0..].iter_mut().zip(&row[i0..kvl]) {
                    *c = w.mul_add(v, *c);
                }
            }
            // Rows past the group's common ones, every channel.
            for (n, row) in latents.iter().enumerate().take(seen[k]).skip(common) {
                let w = w.at(n, k);
                for (c, &v) in ck.iter_mut().zip(&row[..kvl]) {
                    *c = w.mul_add(v, *c);
                }
            }
        }
    }
}

/// Queries of one register tile of the context at most.
#[inline(always)]
fn group_queries<const AVX512: bool>() -> usize {
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        return AVX512_CTX_QUERIES;
    }
    CTX_QUERIES
}

/// Channels of one register tile of `qn` queries. Fewer queries, wider tiles: every tile keeps eight to sixteen
/// 8-lane chains going (AVX-512: eight to sixteen 16-lane chains). The width at one query is the widest, and a
/// multiple of the others.
#[inline(always)]
fn tile_width<const AVX512: bool>(qn: usize) -> usize {
    if AVX512 {
        match qn {
            1 | 2 => AVX512_COLS * 2,
            _ => AVX512_COLS,
        }
    } else {
        CTX_COLS * CTX_QUERIES / qn.next_power_of_two()
    }
}

/// The weights of a [`context`] call: query `k`'s weight of row `n` is `queries[k][n · step]`.
struct Weights<'a> {
    queries: Vec<&'a [f32]>,
    step: usize,
}

impl<'a> Weights<'a> {
    /// Probabilities `p` laid out `[row][query]` for `nq` queries.
    fn by_row(p: &'a [f32], nq: usize) -> Weights<'a> {
        Weights {
            queries: (0..nq).map(|k| &p[k.min(p.len())..]).collect(),
            step: nq,
        }
    }

    /// One slice of weights a query, `[row]`.
    fn by_query(xs: &[&'a [f32]]) -> Weights<'a> {
        Weights {
            queries: xs.to_vec(),
            step: 1,
        }
    }

    /// Query `k`'s weight of row `n`.
    #[inline(always)]
    fn at(&self, n: usize, k: usize) -> f32 {
        self.queries[k][n * self.step]
    }

    /// Queries `q0 .. q0 + Q`, each cut to its weights of rows `0 .. rows` (a query holding fewer panics here, before
    /// a tile's loop starts).
    #[inline(always)]
    fn tile<const Q: usize>(&self, q0: usize, rows: usize) -> [&'a [f32]; Q] {
        std::array::from_fn(|k| {
            let q = self.queries[q0 + k];
            let len = if rows == 0 {
                0
            } else {
                (rows - 1) * self.step + 1
            };
            &q[..len]
        })
    }
}

/// What every register tile of one [`context`] call reads: the weights, and the rows with the width of the context
/// (`kvl`).
struct TileIn<'a> {
    w: &'a Weights<'a>,
    latents: &'a [&'a [f32]],
    kvl: usize,
}

/// The register tile of `qn` queries from `q0`, [`tile_width`] channels from `at.1`, rows `0 .. at.0`.
#[inline(always)]
fn run_tile<const AVX512: bool>(
    qn: usize,
    rows_in: &TileIn<'_>,
    q0: usize,
    at: (usize, usize),
    ctx: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        const V: usize = AVX512_COLS / 16;
        match qn {
            1 => context_tile_avx512::<1, { 2 * V }>(rows_in, q0, at, ctx),
            2 => context_tile_avx512::<2, { 2 * V }>(rows_in, q0, at, ctx),
            3 => context_tile_avx512::<3, V>(rows_in, q0, at, ctx),
            4 => context_tile_avx512::<4, V>(rows_in, q0, at, ctx),
            5 => context_tile_avx512::<5, V>(rows_in, q0, at, ctx),
            _ => context_tile_avx512::<6, V>(rows_in, q0, at, ctx),
        }
        return;
    }
    match qn {
        1 => context_tile::<1, { CTX_COLS * 4 }>(rows_in, q0, at, ctx),
        2 => context_tile::<2, { CTX_COLS * 2 }>(rows_in, q0, at, ctx),
        3 => context_tile::<3, CTX_COLS>(rows_in, q0, at, ctx),
        _ => context_tile::<4, CTX_COLS>(rows_in, q0, at, ctx),
    }
}

/// Queries `q0 .. q0 + Q`, channels `i0 .. i0 + C`, rows `0 .. common` of [`context`], in registers.
#[inline(always)]
fn context_tile<const Q: usize, const C: usize>(
    rows_in: &TileIn<'_>,
    q0: usize,
    (common, i0): (usize, usize),
    ctx: &mut [f32],
) {
    let TileIn { w, latents, kvl } = *rows_in;
    let (qw, step) = (w.tile::<Q>(q0, common), w.step);
    let mut acc = [[0.0f32; C]; Q];
    for (n, row) in latents[..common].iter().enumerate() {
        let c = &row[i0..i0 + C];
        for (a, qw) in acc.iter_mut().zip(&qw) {
            let w = qw[n * step];
            for j in 0..C {
                a[j] = w.mul_add(c[j], a[j]);
            }
        }
    }
    for (k, a) in acc.iter().enumerate() {
        ctx[(q0 + k) * kvl + i0..(q0 + k) * kvl + i0 + C].copy_from_slice(a);
    }
}

/// [`context_tile`] in AVX-512 registers: `Q` queries by `V` vectors of 16 channels (`Q · V` at most 24), the
/// same chain per output. Only [`attend_avx512`]'s build reaches it (`attend_body::<true>`): it must be inlined
/// into code built with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn context_tile_avx512<const Q: usize, const V: usize>(
    rows_in: &TileIn<'_>,
    q0: usize,
    (common, i0): (usize, usize),
    ctx: &mut [f32],
) {
    let TileIn { w, latents, kvl } = *rows_in;
    let (qw, step) = (w.tile::<Q>(q0, common), w.step);
    use std::arch::x86_64::*;
    // SAFETY: AVX-512F is present (above); every load reads `16 · V` channels from `i0` of a row, every store
    // writes them to a query's context, both checked by the slicing.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); V]; Q];
        for (n, row) in latents[..common].iter().enumerate() {
            let c = row[i0..i0 + 16 * V].as_ptr();
            let mut cv = [_mm512_setzero_ps(); V];
            for (v, cv) in cv.iter_mut().enumerate() {
                *cv = _mm512_loadu_ps(c.add(16 * v));
            }
            for (a, qw) in acc.iter_mut().zip(&qw) {
                let w = _mm512_set1_ps(qw[n * step]);
                for (a, &cv) in a.iter_mut().zip(&cv) {
                    *a = _mm512_fmadd_ps(w, cv, *a);
                }
            }
        }
        for (k, a) in acc.iter().enumerate() {
            let dst = &mut ctx[(q0 + k) * kvl + i0..(q0 + k) * kvl + i0 + 16 * V];
            for (v, &a) in a.iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add(16 * v), a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(n: usize, f: f32, phase: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * f + phase).sin() * 0.7).collect()
    }

    /// One query at a time, written plainly in the module header's order.
    fn plain(hc: &HeadCache<'_>, q: (&[f32], &[f32]), seen: usize) -> Vec<f32> {
        let kvl = hc.kvl;
        let chain = |m: &AbsorbedMatrix, x: &[f32]| -> Vec<f32> {
            let mut y = vec![0.0f32; m.cols()];
            for (j, &xj) in x.iter().enumerate() {
                for (yi, &w) in y.iter_mut().zip(m.row(j)) {
                    *yi = xj.mul_add(w, *yi);
                }
            }
            y
        };
        let q_abs = chain(hc.w_uk, q.0);
        let mut p: Vec<f32> = hc.rows[..seen]
            .iter()
            .map(|r| {
                let qcat: Vec<f32> = q_abs.iter().chain(q.1).copied().collect();
                deltafin_quant::dot::dot_f32_ref(&qcat, r) * hc.scale
            })
            .collect();
        let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        p.iter_mut().for_each(|v| *v = activation::exp(*v - max));
        let mut total = 0.0f32;
        for v in &p {
            total += v;
        }
        p.iter_mut().for_each(|v| *v /= total);
        let mut ctx = vec![0.0f32; kvl];
        for (n, r) in hc.rows[..seen].iter().enumerate() {
            for i in 0..kvl {
                ctx[i] = p[n].mul_add(r[i], ctx[i]);
            }
        }
        chain(hc.w_uv_t, &ctx)
    }

    /// `prompt_flops` is the sum over the prompt's queries of each one's products (query `p` sees `p` rows), and an
    /// absorbed matrix refuses values that are not `rows · cols` and pads its rows without changing them.
    #[test]
    fn prompt_flops_and_absorbed_matrices() {
        let (kvl, rope, nope, v) = (512usize, 64usize, 128usize, 128usize);
        for t_len in [0usize, 1, 7, 512] {
            let per_query: u64 = (1..=t_len as u64)
                .map(|p| 2 * (kvl * (nope + v)) as u64 + 2 * p * (2 * kvl + rope) as u64)
                .sum();
            assert_eq!(
                prompt_flops(t_len, (kvl, rope, nope, v)),
                per_query as f64,
                "{t_len} tokens"
            );
        }
        let values = wave(3 * 20, 0.3, 0.0);
        assert!(AbsorbedMatrix::new(3, 21, &values).is_none());
        assert!(AbsorbedMatrix::new(usize::MAX, 2, &values).is_none());
        let m = AbsorbedMatrix::new(3, 20, &values).expect("shape");
        assert_eq!((m.rows(), m.cols()), (3, 20));
        for r in 0..3 {
            assert_eq!(m.row(r), &values[r * 20..(r + 1) * 20]);
            assert!(
                (m.row(r).as_ptr() as usize).is_multiple_of(64),
                "row {r} starts a cache line"
            );
        }
    }

    /// Blocks of 1 to 9 and of 16 to 30 queries at the positions of a prompt's pass (each one more row than the
    /// last), with latent widths that leave no tail and a tail past the register tiles (of every build), give each
    /// query's plain bits.
    #[test]
    fn every_block_gives_each_querys_plain_bits() {
        // 288 = 256 + 32: AVX-512's tiles of one or two queries (128 channels) and of three or four (64), and a tail;
        // 112 + 16 = 128: cache rows of whole blocks (no tail), whose score tiles reduce all their products at once.
        for (kvl, rope, nope, v) in [
            (64usize, 16usize, 24usize, 20usize),
            (40, 8, 16, 12),
            (288, 16, 24, 20),
            (112, 16, 24, 20),
        ] {
            // Value widths of 20 and 12 leave `W_UV`'s rows padded to a line.
            let uk = AbsorbedMatrix::new(nope, kvl, &wave(kvl * nope, 0.37, 0.1)).expect("shape");
            let uv = AbsorbedMatrix::new(kvl, v, &wave(v * kvl, 0.23, 0.4)).expect("shape");
            let cache: Vec<Vec<f32>> = (0..30).map(|n| wave(kvl + rope, 0.11, n as f32)).collect();
            let rows: Vec<&[f32]> = cache.iter().map(|r| r.as_slice()).collect();
            let hc = HeadCache {
                w_uk: &uk,
                w_uv_t: &uv,
                rows: &rows,
                kvl,
                scale: ((nope + rope) as f32).powf(-0.5),
            };
            // Up to 9 queries (every register tile shape), then 16 to 30 (the probabilities' lanes and a tail); spans
            // of 25 to 30 rows end the score tiles' six rows in every shorter tile.
            let shapes = (1..=9).chain([16, 17, 23, 30]).map(|nq| (nq, 30));
            for (nq, span) in shapes.chain((25..30).map(|span| (9, span))) {
                let past = span - nq;
                let qs: Vec<(Vec<f32>, Vec<f32>)> = (0..nq)
                    .map(|k| (wave(nope, 0.31, k as f32), wave(rope, 0.17, k as f32 + 0.5)))
                    .collect();
                let queries: Vec<(&[f32], &[f32])> =
                    qs.iter().map(|(a, b)| (&a[..], &b[..])).collect();
                let seen: Vec<usize> = (0..nq).map(|k| past + k + 1).collect();
                let mut out = vec![f32::NAN; nq * v];
                attend(&hc, &queries, &seen, &mut out);
                for k in 0..nq {
                    let want = plain(&hc, queries[k], seen[k]);
                    let got = &out[k * v..(k + 1) * v];
                    assert!(
                        want.iter().all(|x| x.is_finite()),
                        "kvl {kvl}, {nq} queries"
                    );
                    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(&want),
                        "kvl {kvl}, query {k} of {nq}, {span} rows"
                    );
                }
            }
        }
    }
}
