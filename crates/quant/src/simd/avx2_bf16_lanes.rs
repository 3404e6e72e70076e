//! AVX2 bf16 products of many inputs with the inputs across the vector lanes (prefill on CPUs without AVX-512, rows
//! whose length is a multiple of 32), in the layouts of [`crate::bf16_lanes`]: a group of sixteen inputs at one
//! element `e` is two 256-bit halves, and one row's widened weight serves up to four groups (eight halves, the
//! inputs as the FMAs' memory operands), so a broadcast and its widening are two operations per eight FMAs. Per
//! input the operations and their order are the contract's, so every result is bit-identical to
//! [`crate::bf16_contract::dot_ref`].
//!
//! Without the lanes every input of a prefill widened every weight again (one product at a time), a quarter of the
//! FMA peak on an AMD Zen 3 core.

use std::arch::x86_64::*;

use crate::bf16_contract::{CHUNK, LANES};
use crate::bf16_lanes::{GROUP, acc_at, token_lanes_len};

/// Inputs per 256-bit vector: half a group.
const HALF: usize = GROUP / 2;

/// Every row of a task (`rows`, each `32 · n` bf16 weights) against groups `g0 .. g0 + V` (`V` 1 to 4) of the inputs
/// (`xt`, laid out for `n` chunks), element `e`, chunks `c0 .. c1`, into the pairs' accumulators in `acc`: row by
/// row, while the groups' inputs over the block stay in L1. A row's first block (`c0 == 0`) starts its accumulators
/// at zero, whatever `acc` holds.
///
/// # Safety
/// The CPU must support AVX2 and FMA; every row holds `32 · n` weights, `xt` groups `g0 .. g0 + V` of the layout for
/// `n` chunks; `c1 <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tiles<const V: usize>(
    rows: &[&[u16]],
    xt: &[f32],
    (g0, e): (usize, usize),
    (c0, c1): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!((1..=4).contains(&V) && c1 <= n && e < CHUNK);
    debug_assert!(rows.iter().all(|w| w.len() == n * CHUNK));
    debug_assert!(xt.len() >= token_lanes_len(n * CHUNK, (g0 + V) * GROUP));
    debug_assert!(
        rows.is_empty() || acc.len() >= acc_at(rows.len() - 1, g0 + V - 1, groups, e) + GROUP
    );
    if c0 >= c1 {
        return;
    }
    // The 32-bit word that holds element e of chunk c of a row is at `w + 32c` (in bf16).
    let word = 2 * (e / 2);
    // Group v's input vector of chunk c at `x + v · xs + 16c` (in f32), halves 8 apart.
    let x = xt[(g0 * CHUNK + e) * n * GROUP + c0 * GROUP..].as_ptr();
    let xs = CHUNK * n * GROUP;
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let p = acc.as_mut_ptr();
    for (r, w) in rows.iter().enumerate() {
        let at: [usize; V] = std::array::from_fn(|v| acc_at(r, g0 + v, groups, e));
        // [group][half]
        let mut regs: [[__m256; 2]; V] = std::array::from_fn(|v| {
            std::array::from_fn(|half| {
                if c0 == 0 {
                    _mm256_setzero_ps()
                } else {
                    // SAFETY: the caller's `acc` holds every pair.
                    unsafe { _mm256_loadu_ps(p.add(at[v] + HALF * half)) }
                }
            })
        });
        let wp = w[word + c0 * CHUNK..].as_ptr();
        for c in 0..c1 - c0 {
            // SAFETY (every access below): the caller's row and inputs hold chunk c0 + c.
            let pair = unsafe { (wp.add(c * CHUNK) as *const i32).read_unaligned() };
            let b = _mm256_set1_epi32(pair);
            let wv = if e % 2 == 0 {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(b))
            } else {
                _mm256_castsi256_ps(_mm256_and_si256(b, high))
            };
            for (v, regs) in regs.iter_mut().enumerate() {
                for (half, a) in regs.iter_mut().enumerate() {
                    let xv = unsafe { _mm256_loadu_ps(x.add(v * xs + c * GROUP + HALF * half)) };
                    *a = _mm256_fmadd_ps(wv, xv, *a);
                }
            }
        }
        for (v, regs) in regs.iter().enumerate() {
            for (half, a) in regs.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(p.add(at[v] + HALF * half), *a) };
            }
        }
    }
}

/// The contract's reduction of pair (`r`, `g`)'s 32 element accumulators, for its sixteen inputs: `out[t]` for
/// input `16g + t`.
///
/// # Safety
/// The CPU must support AVX2; `acc` holds the pair.
#[target_feature(enable = "avx2")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    debug_assert!(acc.len() >= acc_at(r, g, groups, CHUNK - 1) + GROUP);
    let p = acc.as_ptr();
    let mut out = [0.0f32; GROUP];
    for half in 0..2 {
        // v[l] = even[l] + odd[l]: elements 2l and 2l + 1.
        // SAFETY: the caller's `acc` holds the pair's 32 vectors.
        let mut v: [__m256; LANES] = std::array::from_fn(|l| unsafe {
            _mm256_add_ps(
                _mm256_loadu_ps(p.add(acc_at(r, g, groups, 2 * l) + HALF * half)),
                _mm256_loadu_ps(p.add(acc_at(r, g, groups, 2 * l + 1) + HALF * half)),
            )
        });
        let mut width = LANES / 2;
        while width > 0 {
            for l in 0..width {
                v[l] = _mm256_add_ps(v[l], v[l + width]);
            }
            width /= 2;
        }
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(HALF * half), v[0]) };
    }
    out
}
