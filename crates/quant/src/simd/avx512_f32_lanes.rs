//! AVX-512 f32 products of many inputs with the inputs across the vector lanes (prefill, from
//! [`crate::dot::LANES_MIN_TOKENS`] inputs, rows whose length is a multiple of 32): the f32 form of
//! [`super::avx512_bf16_lanes`].
//!
//! [`crate::dot`]'s contract computes, for one row and one input, 32 independent chains, one per element `e` of a
//! block of 32 (`e = 8a + l`: accumulator `a`, lane `l`), `acc = fma(w[32c + e], x[32c + e], acc)` over the blocks
//! `c` in order, then a fixed reduction. Here a vector's lanes are sixteen *inputs* at one `e` (the inputs' layout of
//! [`crate::bf16_lanes`], whose chunks are the contract's blocks of 32), so a weight is one broadcast shared by every
//! input of a tile, and six rows by four groups of inputs run in the bf16 kernel's generic tile and `asm!` loop
//! (`super::avx512_bf16_lanes::accumulate`, the weights read as f32 values 128 bytes apart; this module gives the f32
//! rows' `LaneRow` and the contract's reduction): four vector loads and six
//! broadcasts per 24 FMAs, where the two-row tiles of [`crate::dot::dot_f32_tiles`] load eight vectors per twelve.
//! Per lane the operations and their order are the contract's, so every result is bit-identical to
//! [`crate::dot::dot_f32_ref`].

use std::arch::x86_64::*;

use super::avx512_bf16_lanes::{LaneRow, Weights};
use crate::bf16_lanes::{GROUP, acc_at};
use crate::dot::{ACCS, LANES};

/// f32 rows: a weight is the row's own value, broadcast.
impl LaneRow for f32 {
    fn at(e: usize) -> (usize, Weights) {
        (e, Weights::F32)
    }

    #[inline(always)]
    unsafe fn broadcast(p: *const f32, _: usize) -> __m512 {
        // SAFETY: the caller's `p` lies inside the row; AVX-512F present.
        unsafe { _mm512_set1_ps(p.read()) }
    }
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
