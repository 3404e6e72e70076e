//! The layouts of the MXFP4 products of many inputs with the inputs across the vector lanes (prefill), shared by
//! the AVX-512 kernels (`crate::simd::avx512_tokens`) and the AVX2 ones (`crate::simd::avx2_tokens`).
//!
//! [`crate::mxfp4_contract`] computes, for one row and one input, sixteen independent lanes `k`, each a chain over
//! the row's chunks `c`: `te`/`to` over the lane's eight weights, then `acc[c % 2][k] = fma(te + to, scale,
//! acc[c % 2][k])`, and a fixed reduction of the lanes at the end. The single-input kernels put the sixteen `k` in a
//! vector's lanes; the kernels of many inputs put sixteen *inputs* at one `k` there instead (one 512-bit vector, or
//! two 256-bit halves), so each decoded weight is broadcast once and used by every input. Per input the operations
//! and their order are the contract's, so every result is bit-identical to
//! [`crate::mxfp4_contract::dot_row_ref`].
//!
//! Layouts (`n_pad` = the row's chunk count rounded up to even):
//! - inputs ([`token_lanes`]): group `g` of 16 inputs, lane `k`, chunk `c`, code `s`, input `t` at
//!   `(g · 16 + k) · stride + (c · 8 + s) · 16 + t` (`stride` = `n_pad · 128` and one line): for one `k` a group's
//!   chunks are contiguous, so a block of them stays in L1 while every row of a task passes over it;
//! - decoded weights, one lane of a few rows over a block of at most [`BLOCK_CHUNKS_MAX`] chunks at a time: weight
//!   `s` of chunk `j` of the block of row `r` at `(r · 8 + s) · 16 + j` ([`lane_weights`]);
//! - multipliers, group by group for the whole row ([`row_scales`]): lane `k` of chunk `c` uses group `4c + k / 4`;
//! - accumulators ([`accumulators_len`]): the even and odd ones of every lane `k` of every (row, group) pair, and one
//!   vector of padding a pair.

use crate::aligned::Lines;
use crate::mxfp4::MXFP4_GROUP;
use crate::mxfp4_contract::{CHUNK, CHUNK_LANES, CODES_PER_LANE};

/// Inputs per group (one 512-bit vector of f32).
pub const GROUP: usize = 16;

/// Chunks of a row in the layouts here: its chunk count rounded up to even (decoders write two chunks per store).
pub fn padded_chunks(cols: usize) -> usize {
    crate::mxfp4_contract::chunks(cols).div_ceil(2) * 2
}

/// `t_rows` inputs of `cols` values (`x`, row-major) in the inputs' layout (see the module header), zero past the
/// row and past the last input.
pub fn token_lanes(x: &[f32], cols: usize, t_rows: usize) -> Lines {
    let n_pad = padded_chunks(cols);
    let groups = t_rows.div_ceil(GROUP);
    let stride = lane_stride(n_pad);
    let mut xt = Lines::zeroed(groups * CHUNK_LANES * stride);
    for (t, row) in x.chunks_exact(cols.max(1)).take(t_rows).enumerate() {
        let (g, lane) = (t / GROUP, t % GROUP);
        for (i, &v) in row.iter().enumerate() {
            let (c, k, s) = (i / CHUNK, i % CHUNK / CODES_PER_LANE, i % CODES_PER_LANE);
            xt[(g * CHUNK_LANES + k) * stride + (c * CODES_PER_LANE + s) * GROUP + lane] = v;
        }
    }
    xt
}

/// Values of one (group, lane) block of the inputs' layout: its chunks and one cache line more, so that the blocks a
/// tile reads together do not all start at the same offset in a 4 KiB page (where they would compete for the same L1
/// sets; at K3's widths they otherwise would, though no difference was measurable on the noisy 2-core machine).
pub fn lane_stride(n_pad: usize) -> usize {
    n_pad * CODES_PER_LANE * GROUP + GROUP
}

/// Values of [`token_lanes`]`(_, cols, t_rows)`.
pub fn token_lanes_len(cols: usize, t_rows: usize) -> usize {
    t_rows.div_ceil(GROUP) * CHUNK_LANES * lane_stride(padded_chunks(cols))
}

/// Most chunks in a block of decoded weights.
pub const BLOCK_CHUNKS_MAX: usize = 16;

/// Values of the decoded weights of one lane `k` of `rows` rows over a block of chunks.
pub fn lane_weights(rows: usize) -> usize {
    rows * CODES_PER_LANE * BLOCK_CHUNKS_MAX
}

/// Values of one decoded row's multipliers.
pub fn row_scales(cols: usize) -> usize {
    row_scales_per_row(padded_chunks(cols))
}

/// [`row_scales`] for a row of `n_pad` chunks: one multiplier per group of 32.
pub fn row_scales_per_row(n_pad: usize) -> usize {
    n_pad * CHUNK / MXFP4_GROUP
}

/// Values of the even and odd accumulators of every lane `k` of every (row, group) pair of a task:
/// `[rows][groups][16 · 2 + 1]` vectors of 16 (the last of a pair unused).
pub fn accumulators_len(rows: usize, groups: usize) -> usize {
    rows * groups * PAIR_VECTORS * GROUP
}

/// Vectors per (row, group) pair of the accumulators: two per lane and one of padding, so that the pairs a tile's
/// next call reaches (two groups or four rows on) are not a whole multiple of 4 KiB from the ones it just stored,
/// where a core takes a load for the store before it to the same low address bits and waits.
const PAIR_VECTORS: usize = 2 * CHUNK_LANES + 1;

/// Where pair (`r`, `g`)'s lane-`k` accumulators start ([`accumulators_len`]`(_, groups)`): the even one, then the
/// odd one, 16 values each.
#[inline]
pub fn acc_at(r: usize, g: usize, groups: usize, k: usize) -> usize {
    ((r * groups + g) * PAIR_VECTORS + 2 * k) * GROUP
}
