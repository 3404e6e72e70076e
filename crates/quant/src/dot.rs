//! Dot products with one fixed accumulation order, shared by the scalar references and the SIMD paths so that
//! every path gives bit-identical results.
//!
//! The contract (`n` values, weights `w` already exact in f32):
//! - 4 accumulators × 8 lanes. Element `i` of each full 32-block goes to accumulator `(i % 32) / 8`, lane `i % 8`,
//!   as `acc = fma(w, x, acc)`.
//! - The tail (`n % 32` values) is processed in chunks of 8, zero-padded, into accumulator 0.
//! - Reduction: `v[l] = (a0[l] + a1[l]) + (a2[l] + a3[l])`; then `v[l] + v[l+4]` (l < 4); then lanes `l` and `l+2`
//!   (l < 2); then lane 0 + lane 1.
//!
//! f32 rows follow it; bf16 rows have their own, shaped around their widening ([`crate::bf16_contract`]), and int8
//! rows an integer one ([`crate::int8_contract`]).

/// Lanes of one accumulator (one AVX2 register of f32).
pub const LANES: usize = 8;
/// Independent accumulators (hide FMA latency).
pub const ACCS: usize = 4;
/// Elements consumed per step of the main loop.
pub const BLOCK: usize = LANES * ACCS;

/// Reduces the accumulators in the contract's order.
#[inline]
pub fn reduce(acc: &[[f32; LANES]; ACCS]) -> f32 {
    let mut v = [0.0f32; LANES];
    for l in 0..LANES {
        v[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let s4 = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Scalar reference of the contract over any weight type convertible to f32.
#[inline]
pub fn dot_ref_with<W: Copy>(w: &[W], x: &[f32], to_f32: impl Fn(W) -> f32) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let n = w.len().min(x.len());
    let mut acc = [[0.0f32; LANES]; ACCS];
    let full = n / BLOCK * BLOCK;
    for b in (0..full).step_by(BLOCK) {
        for (a, lanes) in acc.iter_mut().enumerate() {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let i = b + a * LANES + l;
                *lane = to_f32(w[i]).mul_add(x[i], *lane);
            }
        }
    }
    for c in (full..n).step_by(LANES) {
        for (l, lane) in acc[0].iter_mut().enumerate() {
            let i = c + l;
            let (wv, xv) = if i < n {
                (to_f32(w[i]), x[i])
            } else {
                (0.0, 0.0)
            };
            *lane = wv.mul_add(xv, *lane);
        }
    }
    reduce(&acc)
}

/// `Σ w·x` for f32 weights: scalar reference.
pub fn dot_f32_ref(w: &[f32], x: &[f32]) -> f32 {
    dot_ref_with(w, x, |v| v)
}

/// The f32 value of raw bf16 bits (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `Σ w·x` for f32 weights, on the fastest path this CPU has (bit-identical to [`dot_f32_ref`]).
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: the CPU supports AVX-512F, AVX2 and FMA (checked above).
        return unsafe { crate::simd::avx512::dot_f32(w, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { crate::simd::avx2::dot_f32(w, x) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::dot_f32(w, x);
    }
    #[allow(unreachable_code)]
    dot_f32_ref(w, x)
}

/// Rows and inputs per tile of [`dot_f32_tiles`] on AVX-512: two rows by six inputs (24 accumulators, four row and
/// two input vectors) load each row block from L2 once for six inputs, where three rows by four did for four and ran
/// slower at K3's width (docs/performance-log.md).
#[cfg(target_arch = "x86_64")]
const AVX512_TILE: (usize, usize) = (2, 6);
/// Rows and inputs per tile of [`dot_f32_tiles`] on AVX2 alone (twelve accumulators a tile either way; three rows
/// by four loads fewer vectors a step than two by six, which ran slower there).
#[cfg(target_arch = "x86_64")]
const AVX2_TILE: (usize, usize) = (3, 4);
/// Values per block of [`dot_f32_tiles`]: a tile's inputs over a block (24 KiB at six) stay in L1 while every row
/// pair goes through them (unblocked, the rows of K3's width made each tile stream its inputs from L2).
#[cfg(target_arch = "x86_64")]
const TILE_BLOCK: usize = 1024;

/// One tile of [`walk_tiles`]: `$r` rows from `$r0` by the `$width` inputs from `$t0` (one of the `$t`).
#[cfg(target_arch = "x86_64")]
macro_rules! f32_tile {
    (
        $tile:ident, $r:literal, ($rows:expr, $xs:expr, $acc:expr, $span:expr), ($r0:expr, $t0:expr, $width:expr),
        $($t:literal)+
    ) => {{
        $(
            if $width == $t {
                let x: [&[f32]; $t] = std::array::from_fn(|k| $xs[$t0 + k]);
                let w: [&[f32]; $r] = std::array::from_fn(|k| $rows[$r0 + k]);
                $tile::<$r, $t>(w, x, $span, &mut $acc[$r0 * $xs.len() + $t0..], $xs.len());
            }
        )+
    }};
}

/// Runs `$tile` (a `dot_f32_tile` of `crate::simd`, accumulators `acc[r · tokens + t]`) over every tile of `$rows`
/// by `$xs` for the values of `$span`, inputs outermost, in tiles of at most `$shape` = (rows, inputs): up to two
/// rows by six inputs or three rows by four ([`AVX512_TILE`], [`AVX2_TILE`]). Unsafe as `$tile` is.
#[cfg(target_arch = "x86_64")]
macro_rules! walk_tiles {
    ($tile:ident, $rows:expr, $xs:expr, $span:expr, $acc:expr, $shape:expr) => {{
        let (rows, xs): (&[&[f32]], &[&[f32]]) = (&$rows, &$xs);
        let (max_rows, max_inputs): (usize, usize) = $shape;
        let tokens = xs.len();
        for t0 in (0..tokens).step_by(max_inputs) {
            let width = max_inputs.min(tokens - t0);
            let mut r0 = 0;
            while r0 < rows.len() {
                let here = (rows.len() - r0).min(max_rows);
                match here {
                    1 => f32_tile!($tile, 1, (rows, xs, $acc, $span), (r0, t0, width), 1 2 3 4 5 6),
                    2 => f32_tile!($tile, 2, (rows, xs, $acc, $span), (r0, t0, width), 1 2 3 4 5 6),
                    _ => f32_tile!($tile, 3, (rows, xs, $acc, $span), (r0, t0, width), 1 2 3 4),
                }
                r0 += here;
            }
        }
    }};
}

/// `$out[r · tokens + t] = $finish(acc, row, input)` for every product of `$rows` by `$xs` (the tail and the
/// reduction after [`walk_tiles`]). Unsafe as `$finish` is.
#[cfg(target_arch = "x86_64")]
macro_rules! finish_tiles {
    ($finish:ident, $rows:expr, $xs:expr, $acc:expr, $out:expr) => {{
        let tokens = $xs.len();
        for (r, w) in $rows.iter().enumerate() {
            for (t, x) in $xs.iter().enumerate() {
                $out[r * tokens + t] = $finish(&$acc[r * tokens + t], w, x);
            }
        }
    }};
}

/// `out[r · xs.len() + t]` = `rows[r] · xs[t]` for every f32 row and input (all of one length), each bit-identical
/// to [`dot_f32_ref`]. On AVX-512 the products run in tiles of two rows by six inputs that share their loads (24
/// accumulators, four row and two input vectors: 30 registers), on AVX2 alone in tiles of three rows by four
/// inputs that run the contract's four accumulators one after the other (twelve registers), both over blocks of
/// `TILE_BLOCK` values (multi-token products); elsewhere one at a time.
pub fn dot_f32_tiles(rows: &[&[f32]], xs: &[&[f32]], out: &mut [f32]) {
    let tokens = xs.len();
    let n = rows.first().map_or(0, |w| w.len());
    let fits = rows.iter().all(|w| w.len() == n)
        && xs.iter().all(|x| x.len() == n)
        && out.len() >= rows.len() * tokens;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() && fits {
        use crate::simd::avx512::{F32Acc, dot_f32_finish, dot_f32_tile};
        // SAFETY: an all-zero bit pattern is a valid vector (the accumulators' start).
        let mut acc: Vec<F32Acc> = vec![unsafe { std::mem::zeroed() }; rows.len() * tokens];
        let full = n / BLOCK * BLOCK;
        // Weight rows that do not start on a cache line (a `Vec<f32>` from the allocator usually does not) are copied
        // block by block onto whole lines first: a 64-byte load across two lines costs the L1 two accesses, and every
        // weight vector of a block is loaded once per tile of inputs. The values and their order are unchanged.
        let realign = tokens > AVX512_TILE.1
            && rows
                .iter()
                .any(|w| !(w.as_ptr() as usize).is_multiple_of(64));
        let mut block = if realign {
            crate::aligned::Lines::zeroed(rows.len() * TILE_BLOCK)
        } else {
            crate::aligned::Lines::zeroed(0)
        };
        let all_rows = rows;
        let all_xs = xs;
        for b0 in (0..full).step_by(TILE_BLOCK) {
            let b1 = (b0 + TILE_BLOCK).min(full);
            let (block_rows, block_xs, span) = if realign {
                for (dst, w) in block.chunks_exact_mut(TILE_BLOCK).zip(all_rows) {
                    dst[..b1 - b0].copy_from_slice(&w[b0..b1]);
                }
                (
                    block
                        .chunks_exact(TILE_BLOCK)
                        .map(|d| &d[..b1 - b0])
                        .collect(),
                    all_xs.iter().map(|x| &x[b0..b1]).collect(),
                    (0, b1 - b0),
                )
            } else {
                (all_rows.to_vec(), all_xs.to_vec(), (b0, b1))
            };
            let (rows, xs) = (&block_rows[..], &block_xs[..]);
            // SAFETY: AVX-512F, AVX2 and FMA present; rows and inputs of one length, the span whole blocks within
            // them, and `acc` holding every product (checked above).
            unsafe { walk_tiles!(dot_f32_tile, rows, xs, span, acc, AVX512_TILE) };
        }
        // SAFETY: AVX-512F, AVX2 and FMA present; one length (checked above).
        unsafe { finish_tiles!(dot_f32_finish, rows, xs, acc, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && fits && tokens > 1 {
        use crate::simd::avx2::{F32Acc, dot_f32_finish, dot_f32_tile};
        // SAFETY: an all-zero bit pattern is a valid vector (the accumulators' start).
        let mut acc: Vec<F32Acc> = vec![unsafe { std::mem::zeroed() }; rows.len() * tokens];
        let full = n / BLOCK * BLOCK;
        for b0 in (0..full).step_by(TILE_BLOCK) {
            let span = (b0, (b0 + TILE_BLOCK).min(full));
            // SAFETY: AVX2 and FMA present; rows and inputs of one length, the span whole blocks within them, and
            // `acc` holding every product (checked above).
            unsafe { walk_tiles!(dot_f32_tile, rows, xs, span, acc, AVX2_TILE) };
        }
        // SAFETY: AVX2 and FMA present; one length (checked above).
        unsafe { finish_tiles!(dot_f32_finish, rows, xs, acc, out) };
        return;
    }
    let _ = fits;
    for (r, w) in rows.iter().enumerate() {
        for (t, x) in xs.iter().enumerate() {
            out[r * tokens + t] = dot_f32(w, x);
        }
    }
}

/// Inputs from which a product of f32 rows (of a length that is a multiple of [`BLOCK`]) may run with the inputs
/// across the vector lanes on AVX-512 ([`dot_f32_lanes`]; [`f32_lanes_chosen`] says whether it does).
#[cfg(target_arch = "x86_64")]
pub const LANES_MIN_TOKENS: usize = 16;

/// Chunks (of [`BLOCK`] values) per block of [`dot_f32_lanes`]: six rows over a block (24 KiB, each chunk's value of
/// one element 128 bytes after the last) stay in L1 while every element and group of the block goes through them.
#[cfg(target_arch = "x86_64")]
const LANES_BLOCK_CHUNKS: usize = 32;

/// `out[r · t_rows + t]` = `rows[r] · x_t` for every f32 row and input, the inputs laid out across the lanes
/// ([`crate::bf16_lanes::token_lanes`] of the `t_rows` inputs), each bit-identical to [`dot_f32_ref`]: for each block
/// of chunks, each six rows, each element of a chunk and each four groups of 16 inputs, one tile of the lane kernels
/// (`crate::simd::avx512_bf16_lanes::accumulate`), then the contract's reduction of each (row, group). Rows must all have
/// the same length, a multiple of [`BLOCK`], and the CPU AVX-512; anything else fills `out` with NaN.
#[cfg(target_arch = "x86_64")]
pub fn dot_f32_lanes(rows: &[&[f32]], xt: &[f32], t_rows: usize, out: &mut [f32]) {
    use crate::bf16_lanes::{accumulators_len, lanes_shape, with_accumulators};
    use crate::simd::avx512_bf16_lanes::accumulate;
    use crate::simd::avx512_f32_lanes::finish;
    let has = crate::simd::has_avx512();
    let Some((n, groups)) = lanes_shape(rows, (xt, t_rows), out, has) else {
        return;
    };
    with_accumulators(accumulators_len(rows.len(), groups), |acc| {
        // SAFETY: AVX-512F and FMA present; rows of `32 · n` weights, the inputs laid out for `n` chunks and `groups`
        // groups, `acc` holding every pair (checked above).
        unsafe { accumulate(rows, xt, (n, groups), acc, LANES_BLOCK_CHUNKS) };
        let acc = &*acc;
        // SAFETY: AVX-512F present; `acc` holds every pair.
        let sums = |r, g| unsafe { finish(acc, r, g, groups) };
        crate::simd::copy_group_sums(&mut out[..rows.len() * t_rows], t_rows, sums);
    });
}

/// Whether multi-token f32 products of rows a multiple of [`BLOCK`] long run with the inputs across the lanes
/// ([`dot_f32_lanes`]) rather than in tiles of rows by inputs ([`dot_f32_tiles`]): both give the same bits, and which
/// is faster depends on the core, so it is measured once per process (`crate::simd::second_is_faster` on a
/// task-sized product, a few milliseconds) unless `DELTAFIN_F32_LANES` is `on` or `off`. Never without AVX-512.
#[cfg(target_arch = "x86_64")]
pub fn f32_lanes_chosen() -> bool {
    use std::sync::OnceLock;
    static CHOSEN: OnceLock<bool> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if !crate::simd::has_avx512() {
            return false;
        }
        crate::simd::forced_choice("DELTAFIN_F32_LANES").unwrap_or_else(f32_lanes_measured_faster)
    })
}

/// Times [`dot_f32_tiles`] and [`dot_f32_lanes`] on one task-sized product (24 rows of 4,096 weights against 64
/// inputs) and says whether the lanes are faster.
#[cfg(target_arch = "x86_64")]
fn f32_lanes_measured_faster() -> bool {
    let (rows, cols, tokens) = (24, 4096, 64);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0 - 0.5)
        .collect();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| (i % 97) as f32 / 97.0 - 0.5)
        .collect();
    let row_refs: Vec<&[f32]> = w.chunks_exact(cols).collect();
    let x_refs: Vec<&[f32]> = x.chunks_exact(cols).collect();
    let xt = crate::bf16_lanes::token_lanes(&x, cols, tokens);
    let mut out = vec![0.0f32; rows * tokens];
    let mut lanes_out = vec![0.0f32; rows * tokens];
    crate::simd::second_is_faster(
        || dot_f32_tiles(&row_refs, &x_refs, &mut out),
        || dot_f32_lanes(&row_refs, &xt, tokens, &mut lanes_out),
    )
}

/// Two rows of f32 weights against one input: each result bit-identical to [`dot_f32_ref`].
pub fn dot_f32_x2(w0: &[f32], w1: &[f32], x: &[f32]) -> [f32; 2] {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() && w0.len() == x.len() && w1.len() == x.len() {
        // SAFETY: AVX-512F, AVX2 and FMA present; lengths checked.
        return unsafe { crate::simd::avx512::dot_f32_x2(w0, w1, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && w0.len() == x.len() && w1.len() == x.len() {
        // SAFETY: AVX2 and FMA present; lengths checked.
        return unsafe { crate::simd::avx2::dot_f32_x2(w0, w1, x) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() && w0.len() == x.len() && w1.len() == x.len() {
        return crate::simd::neon::dot_f32_x2(w0, w1, x);
    }
    [dot_f32(w0, x), dot_f32(w1, x)]
}
