//! The accumulation contract of bf16 rows, and its scalar reference.
//!
//! The contract is shaped around the cheapest exact widening on SIMD hardware: a 32-bit lane holds two bf16
//! weights, and bf16 → f32 is a 16-bit shift for the low one (the even element) and a mask for the high one (the
//! odd element), so one full-width load gives two vectors of exact f32 weights with two instructions. The weights
//! then come out split by parity; the input is permuted once per product to match ([`permute_input`]).
//!
//! For one row of `n` weights (seen as chunks of 32, the last one zero-padded):
//! - `xp[c][l] = x[32c + 2l]` and `xp[c][16 + l] = x[32c + 2l + 1]` for `l < 16` (0 past the row);
//! - `even[l] = fma(w[32c + 2l], x[32c + 2l], even[l])` and `odd[l] = fma(w[32c + 2l + 1], x[32c + 2l + 1],
//!   odd[l])` for every chunk `c` in order, padded weights and inputs included (as 0);
//! - reduction: `v[l] = even[l] + odd[l]`; then lanes `l` and `l + 8`, `l + 4`, `l + 2`, and lane 0 + lane 1.
//!
//! Every SIMD path computes exactly these operations per lane, so its result is bit-identical to [`dot_ref`].

use crate::aligned::Lines;
use crate::dot::bf16_to_f32;

/// Weights per chunk.
pub const CHUNK: usize = 32;
/// Lanes of each of the two accumulators.
pub const LANES: usize = CHUNK / 2;

/// Length of a permuted input for rows of `n` weights: `n` rounded up to whole chunks.
pub fn padded_len(n: usize) -> usize {
    n.div_ceil(CHUNK) * CHUNK
}

/// The input `x` in the contract's order, zero-padded to whole chunks.
///
/// The result starts a cache line (each half chunk is a line of its own), so no full-width load of it straddles two.
pub fn permute_input(x: &[f32]) -> Lines {
    let mut xp = Lines::zeroed(padded_len(x.len()));
    for (c, out) in xp.chunks_exact_mut(CHUNK).enumerate() {
        for (i, &v) in x[c * CHUNK..].iter().take(CHUNK).enumerate() {
            out[(i % 2) * LANES + i / 2] = v;
        }
    }
    xp
}

/// Reduces the two accumulators in the contract's order.
#[inline]
pub fn reduce(even: &[f32; LANES], odd: &[f32; LANES]) -> f32 {
    let mut v: [f32; LANES] = std::array::from_fn(|l| even[l] + odd[l]);
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}

/// `Σ w·x` for bf16 weights (raw `u16` bits) against the permuted input `xp` ([`permute_input`] of `x`): scalar
/// reference. `xp` must hold at least [`padded_len`]`(w.len())` values.
pub fn dot_ref(w: &[u16], xp: &[f32]) -> f32 {
    let mut even = [0.0f32; LANES];
    let mut odd = [0.0f32; LANES];
    for (c, x) in xp
        .chunks_exact(CHUNK)
        .take(w.len().div_ceil(CHUNK))
        .enumerate()
    {
        let weight = |i: usize| w.get(c * CHUNK + i).map_or(0.0, |&b| bf16_to_f32(b));
        for l in 0..LANES {
            even[l] = weight(2 * l).mul_add(x[l], even[l]);
            odd[l] = weight(2 * l + 1).mul_add(x[LANES + l], odd[l]);
        }
    }
    reduce(&even, &odd)
}

/// `Σ w·x` for bf16 weights against the plain input `x` (permuted here): scalar reference.
pub fn dot_bf16_ref(w: &[u16], x: &[f32]) -> f32 {
    dot_ref(w, &permute_input(x))
}

/// How the one-input bf16 kernels (AVX-512 and AVX2) prefetch a call's rows; the arithmetic is the same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// Not at all.
    Off,
    /// Each row `n` bytes past its own read point (interleaved streams, one a row).
    PerRow(usize),
    /// The rows' span (neighbouring rows of one matrix: row `r + 1` starts where row `r` ends) in address order, `n`
    /// bytes past where one reader going through it at the rows' pace would be: one stream.
    Span(usize),
}

/// How the one-input bf16 kernels prefetch, chosen once from the CPU and the cores this process may use, unless
/// `DELTAFIN_BF16_PREFETCH_KIB` gives the distance (in KiB, 0: off) or `DELTAFIN_BF16_PREFETCH_FORM` the form (`row`
/// or `span`). Intel's cores and AMD's Zen 5 cores keep too few lines in flight for their share of memory bandwidth
/// without the hint, at any core count; on older AMD cores (family 25: Zen 3 and Zen 4) it made decode on two cores
/// slower, so they prefetch from [`PREFETCH_MIN_CORES`] up only. 16 KiB ahead; on AMD's cores as a span (as the int8
/// and f32 kernels prefetch), on Intel's a row at a time, where it was measured (a span there has not been shown
/// to be faster). The measurements behind the rule: docs/performance-log.md ("Decode on 2-vCPU machines", "Session
/// 18", "Session 22").
pub fn prefetch() -> Prefetch {
    static HOW: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *HOW.get_or_init(|| {
        let bytes = std::env::var("DELTAFIN_BF16_PREFETCH_KIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or_else(prefetch_rule, |kib| kib << 10);
        let form = std::env::var("DELTAFIN_BF16_PREFETCH_FORM").ok();
        prefetch_form(bytes, form.as_deref(), crate::simd::is_intel())
    })
}

/// The prefetch `bytes` ahead (0: off) in the form `form` names (`span`, `row`), else a span except on Intel's cores.
fn prefetch_form(bytes: usize, form: Option<&str>, intel: bool) -> Prefetch {
    let span = match form {
        Some("span") => true,
        Some("row") => false,
        _ => !intel,
    };
    match (bytes, span) {
        (0, _) => Prefetch::Off,
        (n, true) => Prefetch::Span(n),
        (n, false) => Prefetch::PerRow(n),
    }
}

/// [`prefetch`]'s distance from the CPU and the core count.
fn prefetch_rule() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let helped = crate::simd::is_intel() || crate::simd::cpu_family() >= ZEN5_FAMILY;
    if helped || cores >= PREFETCH_MIN_CORES {
        16 << 10
    } else {
        0
    }
}

/// AMD's CPU family of Zen 5 (26); later families are taken to keep its need for a software prefetch.
const ZEN5_FAMILY: u32 = 0x1a;

/// Cores from which the bf16 kernels prefetch on CPUs other than Intel's ([`prefetch`]).
pub const PREFETCH_MIN_CORES: usize = 8;

/// `Σ w·x` against the permuted input `xp`, on the fastest path this CPU has (bit-identical to [`dot_ref`]).
pub fn dot(w: &[u16], xp: &[f32]) -> f32 {
    if xp.len() < padded_len(w.len()) {
        return dot_ref(w, xp);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F/BW present; `xp` covers the row's chunks (checked above).
        return unsafe { crate::simd::avx512::bf16_rows::<1>([w], xp, prefetch())[0] };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 and FMA present; `xp` covers the row's chunks (checked above).
        return unsafe { crate::simd::avx2::bf16_rows::<1>([w], xp, prefetch())[0] };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::bf16_rows::<1>([w], xp)[0];
    }
    #[allow(unreachable_code)]
    dot_ref(w, xp)
}

/// Two rows of equal length against the permuted input `xp`: each result bit-identical to [`dot_ref`].
pub fn dot_x2(w0: &[u16], w1: &[u16], xp: &[f32]) -> [f32; 2] {
    if w0.len() != w1.len() || xp.len() < padded_len(w0.len()) {
        return [dot(w0, xp), dot(w1, xp)];
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F/BW present; equal rows and an input that covers their chunks (checked above).
        return unsafe { crate::simd::avx512::bf16_rows::<2>([w0, w1], xp, prefetch()) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 and FMA present; equal rows and an input that covers their chunks (checked above).
        return unsafe { crate::simd::avx2::bf16_rows::<2>([w0, w1], xp, prefetch()) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::bf16_rows::<2>([w0, w1], xp);
    }
    #[allow(unreachable_code)]
    [dot_ref(w0, xp), dot_ref(w1, xp)]
}

/// Four rows of equal length against the permuted input `xp`: each result bit-identical to [`dot_ref`] (each row
/// keeps its own accumulators; the rows only share the input's loads). Without AVX-512, or for rows of unequal
/// length, two pairs.
pub fn dot_x4(w: [&[u16]; 4], xp: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        let n = w[0].len();
        if crate::simd::has_avx512() && w.iter().all(|r| r.len() == n) && xp.len() >= padded_len(n)
        {
            // SAFETY: AVX-512F/BW present; equal rows and an input that covers their chunks (checked above).
            return unsafe { crate::simd::avx512::bf16_rows::<4>(w, xp, prefetch()) };
        }
    }
    let ([a, b], [c, d]) = (dot_x2(w[0], w[1], xp), dot_x2(w[2], w[3], xp));
    [a, b, c, d]
}

/// Rows per kernel call of the one-input products (`DenseMatrix::dot_rows`): four with AVX-512 on AMD's cores before
/// Zen 5 (family 25, whose AVX-512 parts are Zen 4), two elsewhere. With four rows' streams one Zen 4 core keeps more
/// lines in flight and reads a larger share of memory bandwidth than with two (docs/performance-log.md, "Session
/// 24"); the other cores run two, as measured when their kernels were tuned (not re-measured with four).
pub fn rows_per_call() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512()
            && !crate::simd::is_intel()
            && crate::simd::cpu_family() < ZEN5_FAMILY
        {
            return 4;
        }
        2
    })
}

/// `Σ w·x` against the plain input `x` on the fastest path (permutes `x` first; for one-off rows).
pub fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    dot(w, &permute_input(x))
}

/// Inputs per AVX-512 tile of [`dot_tiles`] (with two rows: 24 accumulators, 4 widened weight vectors and 2 inputs in
/// the 32 vector registers).
#[cfg(target_arch = "x86_64")]
const TILE_TOKENS: usize = 6;

/// Chunks per block of [`dot_tiles`]: a tile's inputs over a block (6 × 1024 values, 24 KiB) stay in L1 while every
/// row pair of the block goes through them.
#[cfg(target_arch = "x86_64")]
const BLOCK_CHUNKS: usize = 32;

/// `out[r · xps.len() + t]` = `rows[r] · xps[t]` for every row and permuted input (rows of equal length `n`, inputs of
/// at least [`padded_len`]`(n)` values), each bit-identical to [`dot_ref`]. On AVX-512 the products run in tiles of
/// two rows by `TILE_TOKENS` inputs over blocks of `BLOCK_CHUNKS` chunks, each row chunk widened once for all of
/// a tile's inputs (prefill's multi-token form); elsewhere one product at a time.
pub fn dot_tiles(rows: &[&[u16]], xps: &[&[f32]], out: &mut [f32]) {
    let n = rows.first().map_or(0, |w| w.len());
    let tokens = xps.len();
    let fits = rows.iter().all(|w| w.len() == n)
        && xps.iter().all(|x| x.len() >= padded_len(n))
        && out.len() >= rows.len() * tokens;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() && fits {
        use crate::simd::avx512::{Bf16Acc, bf16_finish, bf16_tile};
        // SAFETY: an all-zero bit pattern is a valid vector (the accumulators' start).
        let mut acc: Vec<Bf16Acc> = vec![unsafe { std::mem::zeroed() }; rows.len() * tokens];
        let chunks = n.div_ceil(CHUNK);
        // SAFETY (every call below): AVX-512F/BW present; rows of equal length, inputs covering their chunks and
        // `acc` holding every pair (checked above).
        macro_rules! tile {
            ($r:literal, $r0:expr, $t0:expr, $width:expr, $span:expr, $($t:literal)+) => {{
                $(
                    if $width == $t {
                        let xs: [&[f32]; $t] = std::array::from_fn(|k| xps[$t0 + k]);
                        let rs: [&[u16]; $r] = std::array::from_fn(|k| rows[$r0 + k]);
                        unsafe { bf16_tile::<$r, $t>(rs, xs, $span, &mut acc[$r0 * tokens + $t0..], tokens) };
                    }
                )+
            }};
        }
        for c0 in (0..chunks).step_by(BLOCK_CHUNKS) {
            let span = (c0, (c0 + BLOCK_CHUNKS).min(chunks));
            for t0 in (0..tokens).step_by(TILE_TOKENS) {
                let width = TILE_TOKENS.min(tokens - t0);
                let mut r0 = 0;
                while r0 < rows.len() {
                    if rows.len() - r0 >= 2 {
                        tile!(2, r0, t0, width, span, 1 2 3 4 5 6);
                        r0 += 2;
                    } else {
                        tile!(1, r0, t0, width, span, 1 2 3 4 5 6);
                        r0 += 1;
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            // SAFETY: AVX-512F present (checked above).
            *o = unsafe { bf16_finish(a) };
        }
        return;
    }
    let _ = fits;
    for (r, w) in rows.iter().enumerate() {
        for (t, xp) in xps.iter().enumerate() {
            out[r * tokens + t] = dot(w, xp);
        }
    }
}

/// Inputs from which a product of bf16 rows (of a length that is a multiple of [`CHUNK`]) runs with the inputs
/// across the vector lanes on AVX-512 ([`dot_lanes`]).
#[cfg(target_arch = "x86_64")]
pub const LANES_MIN_TOKENS: usize = 16;

/// Chunks per block of [`dot_lanes`]: six rows' words over a block (24 KiB) stay in L1 while every element and group
/// of the block goes through them, and each tile's accumulators are loaded and stored once per 64 chunks (blocks of
/// 16, 32, 64 and 112 chunks: 0.39, 0.43, 0.45 and 0.45 of the FMA peak on this project's 2-core machine).
#[cfg(target_arch = "x86_64")]
const LANES_BLOCK_CHUNKS: usize = 64;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread words of a block of rows for [`dot_lanes`] on AVX2 (`crate::simd::avx2_bf16_lanes::transpose_pairs`).
    static LANES_PAIRS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The AVX-512 form of [`dot_lanes`]: the weights widened inside the tiles' loop
/// (`crate::simd::avx512_bf16_lanes`) or ahead, a block at a time (`crate::simd::avx512_bf16_wide`). Same bits.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LanesKernel {
    /// Widened inside the loop: one more vector operation per four FMAs.
    InLoop,
    /// Widened ahead, element by element.
    Ahead,
}

/// The AVX-512 form [`dot_lanes`] runs: `DELTAFIN_BF16_WIDEN` `ahead` or `in-loop`, else ahead on Intel's cores and
/// inside the loop on others. Measured on an Intel Xeon (Emerald Rapids, 16 threads), the widening ahead ran the
/// bf16 products faster, where the in-loop widening and the fetching of each element's inputs for every six rows
/// again sit on the FMA ports and in L2; on AMD's Zen 5, whose other vector pipes take the widening, alike or slower
/// (docs/performance-log.md, "Session 13").
#[cfg(target_arch = "x86_64")]
pub fn lanes_kernel() -> LanesKernel {
    use std::sync::OnceLock;
    static CHOSEN: OnceLock<LanesKernel> = OnceLock::new();
    *CHOSEN.get_or_init(|| match std::env::var("DELTAFIN_BF16_WIDEN").as_deref() {
        Ok("ahead") => LanesKernel::Ahead,
        Ok("in-loop") => LanesKernel::InLoop,
        _ if crate::simd::is_intel() => LanesKernel::Ahead,
        _ => LanesKernel::InLoop,
    })
}

/// [`dot_lanes_by`] with this CPU's [`lanes_kernel`].
#[cfg(target_arch = "x86_64")]
pub fn dot_lanes(rows: &[&[u16]], xt: &[f32], t_rows: usize, out: &mut [f32]) {
    dot_lanes_by(lanes_kernel(), rows, xt, t_rows, out)
}

/// `out[r · t_rows + t]` = `rows[r] · x_t` for every row and input, the inputs laid out across the lanes
/// ([`crate::bf16_lanes::token_lanes`] of the `t_rows` inputs), each bit-identical to [`dot_ref`]. On AVX-512 with
/// `kernel` [`LanesKernel::InLoop`], for each block of chunks, each six rows, each element of a chunk and each four
/// groups of 16 inputs, one tile (`crate::simd::avx512_bf16_lanes::tile`), with [`LanesKernel::Ahead`]
/// `crate::simd::avx512_bf16_wide::accumulate`; on AVX2 (whatever `kernel` says), for each block, each element and each
/// four groups, every row in turn (`crate::simd::avx2_bf16_lanes::tiles`). Rows must all have the same length, a
/// multiple of [`CHUNK`], and the CPU AVX-512 or AVX2 ([`crate::simd::has_avx2_fma`]); anything else fills `out` with
/// NaN.
#[cfg(target_arch = "x86_64")]
pub fn dot_lanes_by(
    kernel: LanesKernel,
    rows: &[&[u16]],
    xt: &[f32],
    t_rows: usize,
    out: &mut [f32],
) {
    use crate::bf16_lanes::{accumulators_len, lanes_shape};
    use crate::simd::avx512_bf16_lanes::finish;
    let has = crate::simd::has_avx2_fma();
    let Some((n, groups)) = lanes_shape(rows, (xt, t_rows), out, has) else {
        return;
    };
    crate::bf16_lanes::with_accumulators(accumulators_len(rows.len(), groups), |acc| {
        if !crate::simd::has_avx512() {
            return dot_lanes_avx2(rows, xt, t_rows, n, acc, out);
        }
        if kernel == LanesKernel::Ahead {
            // SAFETY: AVX-512F and FMA present; rows of `32 · n` weights (n ≥ 1), the inputs laid out for `n` chunks
            // and `groups` groups, `acc` holding every pair (checked above).
            unsafe { crate::simd::avx512_bf16_wide::accumulate(rows, xt, n, groups, acc) };
        } else {
            // SAFETY: as for the widening ahead above.
            unsafe {
                crate::simd::avx512_bf16_lanes::accumulate(
                    rows,
                    xt,
                    (n, groups),
                    acc,
                    LANES_BLOCK_CHUNKS,
                )
            };
        }
        let acc = &*acc;
        // SAFETY: AVX-512F present; `acc` holds every pair.
        let sums = |r, g| unsafe { finish(acc, r, g, groups) };
        crate::simd::copy_group_sums(&mut out[..rows.len() * t_rows], t_rows, sums);
    });
}

/// [`dot_lanes`] on AVX2 (checked by the caller), with `acc` sized for the rows and groups: for each block of
/// [`AVX2_LANES_BLOCK_CHUNKS`] chunks, each element and each four groups, every row in turn, so that the groups'
/// inputs over the block (16 KiB for four) stay in L1 while the rows pass over them.
#[cfg(target_arch = "x86_64")]
fn dot_lanes_avx2(
    rows: &[&[u16]],
    xt: &[f32],
    t_rows: usize,
    n: usize,
    acc: &mut [f32],
    out: &mut [f32],
) {
    use crate::bf16_lanes::GROUP;
    use crate::simd::avx2_bf16_lanes::{finish, tiles, transpose_pairs};
    let groups = t_rows.div_ceil(GROUP);
    LANES_PAIRS.with_borrow_mut(|words| {
        words.resize(rows.len() * LANES * AVX2_LANES_BLOCK_CHUNKS.min(n), 0);
        for c0 in (0..n).step_by(AVX2_LANES_BLOCK_CHUNKS) {
            let span = (c0, (c0 + AVX2_LANES_BLOCK_CHUNKS).min(n));
            // SAFETY: AVX2 present; every row holds the block's chunks, `words` sized for them.
            unsafe { transpose_pairs(rows, c0, span.1 - c0, words) };
            let pairs = (&words[..], rows.len());
            for e in 0..CHUNK {
                let mut g = 0;
                while g < groups {
                    let v = (groups - g).min(4);
                    // SAFETY (every arm): AVX2 and FMA present; the block's words of every row, the inputs laid out
                    // for `n` chunks and `groups` groups, `acc` holding every pair (checked by `dot_lanes`).
                    match v {
                        4 => unsafe { tiles::<4>(pairs, xt, (g, e), span, n, acc, groups) },
                        3 => unsafe { tiles::<3>(pairs, xt, (g, e), span, n, acc, groups) },
                        2 => unsafe { tiles::<2>(pairs, xt, (g, e), span, n, acc, groups) },
                        _ => unsafe { tiles::<1>(pairs, xt, (g, e), span, n, acc, groups) },
                    }
                    g += v;
                }
            }
        }
    });
    let acc = &*acc;
    // SAFETY: AVX2 present; `acc` holds every pair.
    let sums = |r, g| unsafe { finish(acc, r, g, groups) };
    crate::simd::copy_group_sums(&mut out[..rows.len() * t_rows], t_rows, sums);
}

/// Chunks per block of [`dot_lanes`] on AVX2: four groups' inputs over a block (16 KiB) stay in a 32 KiB L1.
#[cfg(target_arch = "x86_64")]
const AVX2_LANES_BLOCK_CHUNKS: usize = 64;

/// Whether multi-token bf16 products run with the inputs across the lanes ([`dot_lanes`]) rather than in tiles of
/// rows by inputs ([`dot_tiles`]): both give the same bits, and which is faster depends on the core. On this
/// project's 2-core machine, whose cores load one 64-byte vector a cycle, the lanes (four vector loads per 24 FMAs)
/// beat the tiles (seven per twelve); on cores that load two a cycle the tiles may win. So it is measured once per
/// process (`lanes_measured_faster`, a few milliseconds), unless `DELTAFIN_BF16_LANES` is `on` or `off`. Always on a
/// CPU with AVX2 but not AVX-512, whose tiles are one product at a time; never without AVX2.
#[cfg(target_arch = "x86_64")]
pub fn lanes_chosen() -> bool {
    use std::sync::OnceLock;
    static CHOSEN: OnceLock<bool> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if !crate::simd::has_avx2_fma() {
            return false;
        }
        // Without AVX-512 the tiles are one product at a time.
        crate::simd::forced_choice("DELTAFIN_BF16_LANES")
            .unwrap_or_else(|| !crate::simd::has_avx512() || lanes_measured_faster())
    })
}

/// Times [`dot_tiles`] and [`dot_lanes`] on one task-sized product (48 rows of 4,096 weights against 64 inputs)
/// ([`crate::simd::second_is_faster`]) and says whether the lanes are faster.
#[cfg(target_arch = "x86_64")]
fn lanes_measured_faster() -> bool {
    let (rows, cols, tokens) = (48, 4096, 64);
    let w: Vec<u16> = (0..rows * cols)
        .map(|i| 0x3c00 + ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u16)
        .collect();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| (i % 97) as f32 / 97.0 - 0.5)
        .collect();
    let row_refs: Vec<&[u16]> = w.chunks_exact(cols).collect();
    let xps: Vec<Lines> = x.chunks_exact(cols).map(permute_input).collect();
    let xp_refs: Vec<&[f32]> = xps.iter().map(|p| &p[..]).collect();
    let xt = crate::bf16_lanes::token_lanes(&x, cols, tokens);
    let mut out = vec![0.0f32; rows * tokens];
    let mut lanes_out = vec![0.0f32; rows * tokens];
    crate::simd::second_is_faster(
        || dot_tiles(&row_refs, &xp_refs, &mut out),
        || dot_lanes(&row_refs, &xt, tokens, &mut lanes_out),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefetch choice follows its rule: the vendor and family CPUID reports (checked against what Linux reports)
    /// and the core count, or the variable that overrides it.
    #[test]
    fn prefetch_follows_the_vendor_and_the_cores() {
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        {
            let info = std::fs::read_to_string("/proc/cpuinfo").expect("cpuinfo");
            let linux_says = info
                .lines()
                .find(|l| l.starts_with("vendor_id"))
                .is_some_and(|l| l.trim_end().ends_with("GenuineIntel"));
            assert_eq!(crate::simd::is_intel(), linux_says);
        }
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        {
            let info = std::fs::read_to_string("/proc/cpuinfo").expect("cpuinfo");
            let family = info
                .lines()
                .find(|l| l.starts_with("cpu family"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<u32>().ok());
            assert_eq!(Some(crate::simd::cpu_family()), family);
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helped = crate::simd::is_intel() || crate::simd::cpu_family() >= ZEN5_FAMILY;
        let want = if helped || cores >= PREFETCH_MIN_CORES {
            16 << 10
        } else {
            0
        };
        let given = std::env::var("DELTAFIN_BF16_PREFETCH_KIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok());
        let bytes = given.map_or(want, |kib| kib << 10);
        let form = std::env::var("DELTAFIN_BF16_PREFETCH_FORM").ok();
        assert_eq!(
            prefetch(),
            prefetch_form(bytes, form.as_deref(), crate::simd::is_intel())
        );
        // The forms: a distance of 0 is off whatever the form; otherwise as named, else by vendor.
        assert_eq!(prefetch_form(0, Some("span"), false), Prefetch::Off);
        assert_eq!(
            prefetch_form(4096, Some("span"), true),
            Prefetch::Span(4096)
        );
        assert_eq!(
            prefetch_form(4096, Some("row"), false),
            Prefetch::PerRow(4096)
        );
        assert_eq!(prefetch_form(4096, None, true), Prefetch::PerRow(4096));
        assert_eq!(
            prefetch_form(4096, Some("other"), false),
            Prefetch::Span(4096)
        );
    }

    #[test]
    fn permutation_splits_each_chunk_by_parity_and_pads() {
        let x: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let xp = permute_input(&x);
        assert_eq!(xp.len(), 64);
        assert_eq!(&xp[..4], &[0.0, 2.0, 4.0, 6.0]);
        assert_eq!(&xp[16..19], &[1.0, 3.0, 5.0]);
        assert_eq!(&xp[32..36], &[32.0, 34.0, 36.0, 38.0]);
        assert_eq!(&xp[48..52], &[33.0, 35.0, 37.0, 39.0]);
        assert!(xp[36..48].iter().chain(&xp[52..]).all(|&v| v == 0.0));
    }

    #[test]
    fn reference_matches_an_exact_sum() {
        // Small integers: every product and partial sum is exact, so any order gives the same value.
        let w: Vec<u16> = (0..70).map(|i| half_bits((i % 7) as f32 - 3.0)).collect();
        let x: Vec<f32> = (0..70).map(|i| (i % 5) as f32).collect();
        let exact: f32 = (0..70)
            .map(|i| ((i % 7) as f32 - 3.0) * (i % 5) as f32)
            .sum();
        assert_eq!(dot_bf16_ref(&w, &x), exact);
    }

    /// Four rows at once give each row's bits of the reference, for lengths around the 32-weight chunk and K3's
    /// width, and for rows of unequal length (two pairs then).
    #[test]
    fn four_rows_match_the_reference() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for n in [1usize, 31, 32, 33, 95, 7168] {
            let rows: Vec<Vec<u16>> = (0..4)
                .map(|_| (0..n).map(|_| moderate_bf16(next())).collect())
                .collect();
            let x: Vec<f32> = (0..n)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let xp = permute_input(&x);
            let got = dot_x4(std::array::from_fn(|r| &rows[r][..]), &xp);
            for (r, row) in rows.iter().enumerate() {
                assert!(got[r].is_finite(), "n={n} row {r}: {}", got[r]);
                assert_eq!(
                    got[r].to_bits(),
                    dot_ref(row, &xp).to_bits(),
                    "n={n} row {r}"
                );
            }
            if n > 1 {
                let short = &rows[3][..n - 1];
                let got = dot_x4([&rows[0], &rows[1], &rows[2], short], &xp);
                assert_eq!(
                    got[3].to_bits(),
                    dot_ref(short, &xp).to_bits(),
                    "n={n}, short row"
                );
                assert_eq!(
                    got[0].to_bits(),
                    dot_ref(&rows[0], &xp).to_bits(),
                    "n={n}, row 0"
                );
            }
        }
    }

    /// bf16 bits from random bits: either sign, a magnitude between 2^-16 and 2^16 (so sums of thousands of
    /// products stay finite and their rounding shows the order of additions).
    fn moderate_bf16(bits: u64) -> u16 {
        let exponent = 0x6f + (bits >> 8) % 32;
        ((bits >> 40) as u16 & 0x8000) | ((exponent as u16) << 7) | (bits as u16 & 0x7f)
    }

    /// bf16 bits of a value that bf16 holds exactly.
    fn half_bits(v: f32) -> u16 {
        (v.to_bits() >> 16) as u16
    }
}
