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
//! ([`accumulators_len`]): one vector of 16 per (row, group, element), and one of padding per (row, group).

use crate::aligned::Lines;
use crate::bf16_contract::CHUNK;

/// Inputs per vector (one group).
pub const GROUP: usize = 16;

/// Elements of a chunk that one parallel item of [`token_lanes`] lays out (for one group of inputs).
const ITEM_ELEMENTS: usize = 8;

/// `t_rows` inputs of `cols` values (`x`, row-major; `cols` a multiple of 32) in the inputs' layout (see the module
/// header), zero past the last input.
///
/// One parallel item per group of 16 inputs and run of `ITEM_ELEMENTS` elements (whose part of the layout is one
/// contiguous run), chunk by chunk: a chunk's 16 × 8 values are read as 16 pieces of 32 bytes and written as 8 whole
/// lines of 16, so both sides stay in L1. Built on one thread, a long prompt's block kept every other thread waiting
/// for the product to start (docs/performance-log.md); with an item a group, a 64-input block kept 12 of 16 threads
/// waiting.
pub fn token_lanes(x: &[f32], cols: usize, t_rows: usize) -> Lines {
    use rayon::prelude::*;
    let n = cols / CHUNK;
    let mut xt = Lines::zeroed(token_lanes_len(cols, t_rows));
    let t_rows = t_rows.min(x.len() / cols.max(1));
    let items_per_group = CHUNK / ITEM_ELEMENTS;
    let fill = |(i, out): (usize, &mut [f32])| {
        let (g, e0) = (i / items_per_group, i % items_per_group * ITEM_ELEMENTS);
        let tokens = g * GROUP..((g + 1) * GROUP).min(t_rows);
        for c in 0..n {
            for (lane, t) in tokens.clone().enumerate() {
                let at = t * cols + c * CHUNK + e0;
                for (de, &v) in x[at..at + ITEM_ELEMENTS].iter().enumerate() {
                    out[(de * n + c) * GROUP + lane] = v;
                }
            }
        }
    };
    let per_item = (ITEM_ELEMENTS * n * GROUP).max(1);
    if t_rows * cols < 1 << 16 {
        xt.chunks_mut(per_item).enumerate().for_each(fill);
    } else {
        xt.par_chunks_mut(per_item).enumerate().for_each(fill);
    }
    xt
}

/// Values of [`token_lanes`]`(_, cols, t_rows)`.
pub fn token_lanes_len(cols: usize, t_rows: usize) -> usize {
    t_rows.div_ceil(GROUP) * CHUNK * (cols / CHUNK) * GROUP
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread accumulators of the lane kernels ([`with_accumulators`]), kept between tasks (fresh, a task's
    /// hundreds of KiB were new zeroed pages each time).
    static ACC: std::cell::RefCell<Lines> = std::cell::RefCell::new(Lines::zeroed(0));
}

/// Runs `f` with this thread's accumulators for the lane kernels, `len` values ([`accumulators_len`]), grown if
/// needed; what they held before is left in them (each kernel starts a pair at zero itself).
#[cfg(target_arch = "x86_64")]
pub(crate) fn with_accumulators<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    ACC.with_borrow_mut(|acc| {
        if acc.len() < len {
            *acc = Lines::zeroed(len);
        }
        f(&mut acc[..len])
    })
}

/// The shape of a lane product of `rows` against the `t_rows` inputs laid out in `xt` ([`token_lanes`]) into `out`:
/// `Some((n, groups))` (chunks a row, groups of inputs) when `cpu` (the kernels' instructions are there), every row
/// has one length, a multiple of [`CHUNK`], and `xt` and `out` hold the product. Otherwise `None`, with `out` filled
/// with NaN, or with zeros for empty rows (the reduction of zero accumulators).
#[cfg(target_arch = "x86_64")]
pub(crate) fn lanes_shape<T>(
    rows: &[&[T]],
    (xt, t_rows): (&[f32], usize),
    out: &mut [f32],
    cpu: bool,
) -> Option<(usize, usize)> {
    let cols = rows.first().map_or(0, |w| w.len());
    let fits = cpu
        && cols.is_multiple_of(CHUNK)
        && rows.iter().all(|w| w.len() == cols)
        && xt.len() >= token_lanes_len(cols, t_rows)
        && out.len() >= rows.len() * t_rows;
    if !fits {
        out.fill(f32::NAN);
        return None;
    }
    if cols == 0 {
        out.fill(0.0);
        return None;
    }
    Some((cols / CHUNK, t_rows.div_ceil(GROUP)))
}

/// Values of the accumulators of every (row, group) pair of a task, one vector per element `e`:
/// `[rows][groups][33]` vectors of 16 (the last of a pair unused).
pub fn accumulators_len(rows: usize, groups: usize) -> usize {
    rows * groups * PAIR_VECTORS * GROUP
}

/// Vectors per (row, group) pair of the accumulators: one per element and one of padding, so that the pairs of rows
/// six apart (a tile's next call, when the elements run outermost) are not a whole multiple of 4 KiB apart, where
/// Intel's cores take a load for the store before it to the same low address bits and wait.
const PAIR_VECTORS: usize = CHUNK + 1;

/// Where pair (`r`, `g`)'s element-`e` accumulator starts ([`accumulators_len`]`(_, groups)`).
#[inline]
pub fn acc_at(r: usize, g: usize, groups: usize, e: usize) -> usize {
    ((r * groups + g) * PAIR_VECTORS + e) * GROUP
}
