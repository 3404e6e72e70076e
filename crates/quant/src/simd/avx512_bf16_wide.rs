//! AVX-512 bf16 products of many inputs with the inputs across the vector lanes, the weights widened ahead: the
//! form [`crate::bf16_contract::dot_lanes`] runs on Intel's cores (`crate::bf16_contract::LanesKernel`).
//!
//! Same contract and inputs' layout as [`super::avx512_bf16_lanes`] (sixteen inputs at one element `e` in a
//! vector's lanes, six rows by four groups in registers), but the weights of a block of rows and chunks are first
//! widened to f32 and laid out element by element ([`widen_block`]): an element's weights over the block are then
//! consecutive values, a broadcast is a load alone, and one element's inputs stay in L1 while every row of the block
//! passes over them. Widened inside the loop, each broadcast takes one more vector operation per four FMAs, which on
//! Intel's cores runs on the FMA ports, and each element's inputs come from L2 again for every six rows. On AMD's
//! Zen 5, whose other vector pipes take the widening, the two forms run alike (the transpose costs about what the
//! loop saves). Per lane the operations and their order are the contract's (the widening is exact), so every result
//! is bit-identical to [`crate::bf16_contract::dot_ref`].

use std::arch::x86_64::*;

use super::avx512_bf16_lanes::{Weights, load_tile, rows6, store_tile};
use super::avx512_tokens::transpose16;
use crate::aligned::Lines;
use crate::bf16_contract::CHUNK;
use crate::bf16_lanes::{GROUP, acc_at, token_lanes_len};

/// Chunks per block: one element's inputs for four groups over a block (16 KiB) stay in L1 while every row of the
/// block passes over them, and each tile's accumulators are loaded and stored once per 64 chunks.
const BLOCK_CHUNKS: usize = 64;

/// Rows per block: their widened weights over a block of chunks (384 KiB) stay in L2 beside the inputs (a dense
/// product's tasks have this many rows).
const BLOCK_ROWS: usize = 48;

thread_local! {
    /// Per-thread widened weights of a block ([`widen_block`]), kept between calls.
    static WIDE: std::cell::RefCell<Lines> = std::cell::RefCell::new(Lines::zeroed(0));
}

/// The accumulators of every (row, group) pair of `rows` (each `32 · n` weights) against the `groups` groups of
/// inputs in `xt` (laid out for `n` chunks), into `acc` ([`crate::bf16_lanes::accumulators_len`]): for each block of
/// rows and chunks, its weights widened ([`widen_block`], the next block's fetched into L2 meanwhile), then for each
/// element of a chunk, each four groups and each six rows, one [`tile`].
///
/// # Safety
/// The CPU must support AVX-512F and FMA; every row holds `32 · n` weights (`n >= 1`); `xt` holds `groups` groups of
/// the layout for `n` chunks; `acc` holds every pair.
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn accumulate(rows: &[&[u16]], xt: &[f32], n: usize, groups: usize, acc: &mut [f32]) {
    WIDE.with_borrow_mut(|wide| {
        let len = widened_len(BLOCK_ROWS.min(rows.len()), BLOCK_CHUNKS.min(n));
        if wide.len() < len {
            *wide = Lines::zeroed(len);
        }
        for first in (0..rows.len()).step_by(BLOCK_ROWS) {
            let block_rows = &rows[first..(first + BLOCK_ROWS).min(rows.len())];
            let end = first + block_rows.len();
            for c0 in (0..n).step_by(BLOCK_CHUNKS) {
                let nb = BLOCK_CHUNKS.min(n - c0);
                // SAFETY: AVX-512F present; every row holds the block's chunks, `wide` sized for them.
                unsafe { widen_block(block_rows, c0, nb, wide) };
                let block = (&wide[..], first, block_rows.len());
                // The next block's weights: the same rows' next chunks, or the next rows' first.
                let next = if c0 + nb < n {
                    Some((block_rows, c0 + nb))
                } else {
                    let rest = &rows[end..];
                    (!rest.is_empty()).then(|| (&rest[..BLOCK_ROWS.min(rest.len())], 0))
                };
                for e in 0..CHUNK {
                    if let Some((next_rows, next_c0)) = next {
                        let next_nb = BLOCK_CHUNKS.min(n - next_c0);
                        prefetch_block(next_rows, next_c0, next_nb, (e, CHUNK));
                    }
                    let mut g = 0;
                    while g < groups {
                        let v = (groups - g).min(4);
                        // The tiles' calls: as the caller guarantees, with the block widened.
                        crate::simd::lane_tiles!(
                            tile; r in first, end; v; (block, xt, (r, g, e), (c0, nb), n, acc, groups)
                        );
                        g += v;
                    }
                }
            }
        }
    });
}

/// Values of [`widen_block`]'s output for `rows` rows and `nb` chunks.
pub fn widened_len(rows: usize, nb: usize) -> usize {
    CHUNK * element_stride(rows, nb)
}

/// Values between two elements' weights in [`widen_block`]'s output: the rows' values and one cache line more, so
/// that the 32 elements' lines of one row and chunk, stored one after another, do not all fall into one set of L1
/// (whole multiples of 4 KiB apart, they did, and evicted each other as they were written).
pub fn element_stride(rows: usize, nb: usize) -> usize {
    rows * nb + GROUP
}

/// The weights of chunks `c0 .. c0 + nb` of `rows`, widened to f32, element by element: element `e` of chunk `c0 + j`
/// of row `r` at `e · s + r · nb + j` of `out`, `s` the [`element_stride`]. Sixteen chunks at a time, a row's sixteen
/// 64-byte chunks are transposed as words (pairs of bf16) in registers, each word vector then widened twice (its even
/// and its odd elements) and stored whole; the block's last chunks, fewer than sixteen, one value at a time.
///
/// # Safety
/// The CPU must support AVX-512F; every row holds chunks `c0 .. c0 + nb`; `out` holds [`widened_len`]`(rows.len(),
/// nb)` values.
#[target_feature(enable = "avx512f")]
pub unsafe fn widen_block(rows: &[&[u16]], c0: usize, nb: usize, out: &mut [f32]) {
    debug_assert!(out.len() >= widened_len(rows.len(), nb));
    debug_assert!(rows.iter().all(|w| w.len() >= (c0 + nb) * CHUNK));
    let s = element_stride(rows.len(), nb);
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let dst = out.as_mut_ptr();
    for (r, w) in rows.iter().enumerate() {
        let src = w[c0 * CHUNK..].as_ptr();
        let whole = nb / 16 * 16;
        for j0 in (0..whole).step_by(16) {
            // SAFETY: chunks j0 .. j0 + 16 of the block lie in the row (16 words each).
            let mut v: [__m512i; 16] = std::array::from_fn(|j| unsafe {
                _mm512_loadu_si512(src.add((j0 + j) * CHUNK) as *const _)
            });
            transpose16(&mut v);
            for (p, words) in v.iter().enumerate() {
                let even = _mm512_slli_epi32::<16>(*words);
                let odd = _mm512_and_si512(*words, high);
                // SAFETY: elements 2p and 2p + 1 of row r at chunks j0 .. j0 + 16 lie in `out`.
                unsafe {
                    _mm512_storeu_si512(dst.add(2 * p * s + r * nb + j0) as *mut _, even);
                    _mm512_storeu_si512(dst.add((2 * p + 1) * s + r * nb + j0) as *mut _, odd);
                }
            }
        }
        for j in whole..nb {
            for e in 0..CHUNK {
                // SAFETY: as above, one value at a time.
                unsafe {
                    *dst.add(e * s + r * nb + j) =
                        f32::from_bits(u32::from(*src.add(j * CHUNK + e)) << 16)
                };
            }
        }
    }
}

/// Part `part` of `parts` of the cache lines of chunks `c0 .. c0 + nb` of `rows`, fetched into L2 ahead of
/// [`widen_block`] (each row's chunks are a few KiB, too short for the hardware's prefetchers to run ahead of the
/// widening, whose loads then waited on memory).
pub fn prefetch_block(rows: &[&[u16]], c0: usize, nb: usize, (part, parts): (usize, usize)) {
    // Lines of one row's chunks (64 bytes a chunk).
    let per_row = nb;
    let total = rows.len() * per_row;
    let (from, to) = (total * part / parts, total * (part + 1) / parts);
    for i in from..to {
        let (r, j) = (i / per_row, i % per_row);
        if let Some(line) = rows[r].get((c0 + j) * CHUNK) {
            // SAFETY: a prefetch of an address inside the row; it never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>((line as *const u16).cast()) };
        }
    }
}

/// One tile: rows `r0 .. r0 + R` of the task from a block's widened weights (`wide`, [`widen_block`]'s layout of
/// the task's rows `first .. first + n_rows` over `nb` chunks) against groups `g0 .. g0 + V` of the inputs (`xt`,
/// laid out for `n` chunks), element `e`, the block's chunks `c0 .. c0 + nb`, into the pairs' accumulators in `acc`.
/// The first block (`c0 == 0`) starts its accumulators at zero, whatever `acc` holds. Six rows by four groups run in
/// the in-loop kernel's `asm!` tile (`rows6`, the weights as `Weights::Widened`); other shapes (a task's last rows
/// and groups) through intrinsics, with the same operations per lane.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; `wide` holds the block as [`widen_block`] laid it out; `xt` groups `g0 ..
/// g0 + V` of the layout for `n` chunks; `c0 + nb <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn tile<const R: usize, const V: usize>(
    (wide, first, n_rows): (&[f32], usize, usize),
    xt: &[f32],
    (r0, g0, e): (usize, usize, usize),
    (c0, nb): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!(c0 + nb <= n && e < CHUNK && r0 >= first && r0 + R <= first + n_rows);
    debug_assert!(wide.len() >= widened_len(n_rows, nb));
    debug_assert!(xt.len() >= token_lanes_len(n * CHUNK, (g0 + V) * GROUP));
    debug_assert!(acc.len() >= acc_at(r0 + R - 1, g0 + V - 1, groups, e) + GROUP);
    if nb == 0 {
        return;
    }
    // Row r's weights of element e over the block: `nb` consecutive values, rows `nb` values apart.
    let w = wide[e * element_stride(n_rows, nb) + (r0 - first) * nb..].as_ptr();
    let xg: [*const f32; V] =
        std::array::from_fn(|v| xt[((g0 + v) * CHUNK + e) * n * GROUP + c0 * GROUP..].as_ptr());
    // SAFETY: the caller's `acc` holds every pair.
    let (at, mut regs) = unsafe { load_tile::<R, V>(acc, (r0, g0, e), groups, c0 == 0) };
    if R == 6 && V == 4 {
        let mut a: [__m512; 24] = std::array::from_fn(|i| regs[i / 4][i % 4]);
        // SAFETY: as the caller guarantees; the six rows lie `nb` values apart, the groups evenly apart.
        unsafe {
            rows6(
                &mut a,
                (xg[0], (xg[1] as usize).wrapping_sub(xg[0] as usize)),
                (w.cast(), 4 * nb),
                nb,
                Weights::Widened,
            )
        };
        regs = std::array::from_fn(|r| std::array::from_fn(|v| a[r * 4 + v]));
    } else {
        for j in 0..nb {
            // SAFETY (every access below): the caller's block and inputs hold chunk c0 + j.
            let xs: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(xg[v].add(j * GROUP)) });
            for (r, row) in regs.iter_mut().enumerate() {
                let b = _mm512_set1_ps(unsafe { *w.add(r * nb + j) });
                for (acc, x) in row.iter_mut().zip(&xs) {
                    *acc = _mm512_fmadd_ps(b, *x, *acc);
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { store_tile(acc, &at, &regs) };
}
