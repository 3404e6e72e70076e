//! The layouts of the bf16 products of many inputs with the inputs across the vector lanes (prefill), shared by the
//! AVX-512 kernels (`crate::simd::avx512_bf16_lanes`) and the AVX2 ones (`crate::simd::avx2_bf16_lanes`).
//!
//! [`crate::bf16_contract`] computes, for one row and one input, 32 independent chains, one per element `e` of a
//! chunk of 32 (`even[l]` is `e = 2l`, `odd[l]` is `e = 2l + 1`): `acc = fma(w[32c + e], x[32c + e], acc)` over the
//! chunks `c` in order, then a fixed reduction. The kernels of many inputs put sixteen *inputs* at one `e` in a
//! vector's lanes (one 512-bit vector or two 256-bit halves), so a weight is one 32-bit broadcast (the pair of bf16
//! that holds it, widened by a shift or a mask) shared by every input.
//!
//! Inputs ([`token_lanes`]): group `g` of 16 inputs, element `e`, chunk `c`, input `t` at
//! `((g · 32 + e) · n + c) · 16 + t` (`n` chunks): for one `e` a group's chunks are contiguous. Accumulators
//! ([`accumulators_len`]): one vector of 16 per (row, group, element).

use crate::aligned::Lines;
use crate::bf16_contract::CHUNK;

/// Inputs per vector (one group).
pub const GROUP: usize = 16;

/// `t_rows` inputs of `cols` values (`x`, row-major; `cols` a multiple of 32) in the inputs' layout (see the module
/// header), zero past the last input.
pub fn token_lanes(x: &[f32], cols: usize, t_rows: usize) -> Lines {
    let n = cols / CHUNK;
    let mut xt = Lines::zeroed(token_lanes_len(cols, t_rows));
    for (t, row) in x.chunks_exact(cols.max(1)).take(t_rows).enumerate() {
        let (g, lane) = (t / GROUP, t % GROUP);
        for (i, &v) in row.iter().enumerate() {
            let (c, e) = (i / CHUNK, i % CHUNK);
            xt[((g * CHUNK + e) * n + c) * GROUP + lane] = v;
        }
    }
    xt
}

/// Values of [`token_lanes`]`(_, cols, t_rows)`.
pub fn token_lanes_len(cols: usize, t_rows: usize) -> usize {
    t_rows.div_ceil(GROUP) * CHUNK * (cols / CHUNK) * GROUP
}

/// Values of the accumulators of every (row, group) pair of a task, one vector per element `e`:
/// `[rows][groups][32]` vectors of 16.
pub fn accumulators_len(rows: usize, groups: usize) -> usize {
    rows * groups * CHUNK * GROUP
}

/// Where pair (`r`, `g`)'s element-`e` accumulator starts ([`accumulators_len`]`(_, groups)`).
#[inline]
pub fn acc_at(r: usize, g: usize, groups: usize, e: usize) -> usize {
    ((r * groups + g) * CHUNK + e) * GROUP
}
