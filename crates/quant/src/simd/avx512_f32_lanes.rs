//! AVX-512 f32 products of many inputs with the inputs across the vector lanes (prefill, from
//! [`crate::dot::LANES_MIN_TOKENS`] inputs, rows whose length is a multiple of 32): the f32 form of
//! [`super::avx512_bf16_lanes`].
//!
//! [`crate::dot`]'s contract computes, for one row and one input, 32 independent chains, one per element `e` of a
//! block of 32 (`e = 8a + l`: accumulator `a`, lane `l`), `acc = fma(w[32c + e], x[32c + e], acc)` over the blocks
//! `c` in order, then a fixed reduction. Here a vector's lanes are sixteen *inputs* at one `e` (the inputs' layout of
//! [`crate::bf16_lanes`], whose chunks are the contract's blocks of 32), so a weight is one broadcast shared by every
//! input of a tile, and six rows by four groups of inputs run in the `asm!` tile of the bf16 kernel
//! (`super::avx512_bf16_lanes::rows6`, its weights read as f32 values 128 bytes apart): four vector loads and six
//! broadcasts per 24 FMAs, where the two-row tiles of [`crate::dot::dot_f32_tiles`] load eight vectors per twelve.
//! Per lane the operations and their order are the contract's, so every result is bit-identical to
//! [`crate::dot::dot_f32_ref`].

use std::arch::x86_64::*;

use super::avx512_bf16_lanes::{Weights, load_tile, rows6, store_tile};
use crate::bf16_lanes::{GROUP, acc_at, token_lanes_len};
use crate::dot::{ACCS, BLOCK, LANES};

/// One tile: rows `r0 .. r0 + R` of the task (`rows[r0 + r]`, each `32 · n` weights) against groups `g0 .. g0 + V`
/// of the inputs (`xt`, laid out for `n` chunks), element `e`, chunks `c0 .. c1`, into the pairs' accumulators in
/// `acc`. A row's first chunk (`c0 == 0`) starts its accumulators at zero, whatever `acc` holds. Six evenly spaced
/// rows by four groups run in `rows6`; other shapes (a task's last rows and groups) through intrinsics, with the same
/// operations per lane.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; every row holds `32 · n` weights, `xt` groups `g0 .. g0 + V` of the layout
/// for `n` chunks; `c1 <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn tile<const R: usize, const V: usize>(
    rows: &[&[f32]],
    xt: &[f32],
    (r0, g0, e): (usize, usize, usize),
    (c0, c1): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!(c1 <= n && e < BLOCK && rows.len() >= r0 + R);
    debug_assert!(rows[r0..r0 + R].iter().all(|w| w.len() == n * BLOCK));
    debug_assert!(xt.len() >= token_lanes_len(n * BLOCK, (g0 + V) * GROUP));
    debug_assert!(acc.len() >= acc_at(r0 + R - 1, g0 + V - 1, groups, e) + GROUP);
    if c0 >= c1 {
        return;
    }
    // Element e of chunk c of row r is at `wr[r] + 32c`.
    let wr: [*const f32; R] = std::array::from_fn(|r| rows[r0 + r][e..].as_ptr());
    let xg: [*const f32; V] =
        std::array::from_fn(|v| xt[((g0 + v) * BLOCK + e) * n * GROUP..].as_ptr());
    // SAFETY: the caller's `acc` holds every pair.
    let (at, mut regs) = unsafe { load_tile::<R, V>(acc, (r0, g0, e), groups, c0 == 0) };
    // Bytes between neighbouring rows, where they are evenly spaced (rows of one matrix).
    let stride = (wr[R - 1] as usize).wrapping_sub(wr[0] as usize) / R.saturating_sub(1).max(1);
    let even = (0..R).all(|r| wr[r] as usize == (wr[0] as usize).wrapping_add(r * stride));
    if R == 6 && V == 4 && even {
        let mut a: [__m512; 24] = std::array::from_fn(|i| regs[i / 4][i % 4]);
        // SAFETY: as the caller guarantees; the six rows lie `stride` bytes apart, each chunk's weight 128 bytes
        // after the last.
        unsafe {
            rows6(
                &mut a,
                (
                    xg[0].add(c0 * GROUP),
                    (xg[1] as usize).wrapping_sub(xg[0] as usize),
                ),
                (wr[0].add(c0 * BLOCK).cast(), stride),
                c1 - c0,
                Weights::F32,
            )
        };
        regs = std::array::from_fn(|r| std::array::from_fn(|v| a[r * 4 + v]));
    } else {
        for c in c0..c1 {
            // SAFETY (every access below): the caller's rows and inputs hold chunk c.
            let xs: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(xg[v].add(c * GROUP)) });
            for r in 0..R {
                let w = _mm512_set1_ps(unsafe { wr[r].add(c * BLOCK).read() });
                for v in 0..V {
                    regs[r][v] = _mm512_fmadd_ps(w, xs[v], regs[r][v]);
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { store_tile(acc, &at, &regs) };
}

/// The contract's reduction ([`crate::dot::reduce`]) of pair (`r`, `g`)'s 32 element accumulators, for its sixteen
/// inputs: `out[t]` for input `16g + t`.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds the pair.
#[target_feature(enable = "avx512f")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    let p = acc.as_ptr();
    // SAFETY: the caller's `acc` holds the pair's 32 vectors.
    let a = |e: usize| unsafe { _mm512_loadu_ps(p.add(acc_at(r, g, groups, e))) };
    const _: () = assert!(ACCS == 4 && LANES == 8);
    // v[l] = (a0[l] + a1[l]) + (a2[l] + a3[l]), accumulator k's lane l being element 8k + l.
    let mut v: [__m512; LANES] = std::array::from_fn(|l| {
        _mm512_add_ps(
            _mm512_add_ps(a(l), a(LANES + l)),
            _mm512_add_ps(a(2 * LANES + l), a(3 * LANES + l)),
        )
    });
    // Then lanes l and l + 4, l and l + 2, 0 and 1.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] = _mm512_add_ps(v[l], v[l + width]);
        }
        width /= 2;
    }
    let mut out = [0.0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v[0]) };
    out
}
