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

/// The 32-bit words (pairs of bf16) of chunks `c0 .. c0 + nb` of `rows` with pairs and chunks swapped: pair `p`
/// (elements `2p` and `2p + 1`) of chunk `c0 + j` of row `r` at `(r · 16 + p) · nb + j` of `out` (`rows.len() · 16 ·
/// nb` words). One element's weights over a block are then `nb` consecutive words for [`tiles`]; read from the rows
/// themselves, each was on a cache line of its own, and the lines of a task's rows, fetched again from L2 for every
/// element, left the inputs too little of L1 (0.51–0.56 of the FMA peak at 64 inputs and more on an AMD Zen 3 core).
///
/// # Safety
/// The CPU must support AVX2; every row holds chunks `c0 .. c0 + nb` and `out` `rows.len() · 16 · nb` words.
#[target_feature(enable = "avx2")]
pub unsafe fn transpose_pairs(rows: &[&[u16]], c0: usize, nb: usize, out: &mut [u32]) {
    debug_assert!(out.len() >= rows.len() * LANES * nb);
    debug_assert!(rows.iter().all(|w| w.len() >= (c0 + nb) * CHUNK));
    for (r, w) in rows.iter().enumerate() {
        let src = w[c0 * CHUNK..].as_ptr() as *const u32;
        let dst = out[r * LANES * nb..].as_mut_ptr();
        // Eight chunks at a time: two 8×8 transposes of their words (pairs 0..8 and 8..16).
        let whole = nb / 8 * 8;
        for j0 in (0..whole).step_by(8) {
            for q in 0..2 {
                // SAFETY: chunks j0 .. j0 + 8 of the block lie in the row, words 8q .. 8q + 8 of each.
                let mut v: [__m256i; 8] = std::array::from_fn(|j| unsafe {
                    _mm256_loadu_si256(src.add((j0 + j) * LANES + 8 * q) as *const __m256i)
                });
                transpose8(&mut v);
                for (p, line) in v.iter().enumerate() {
                    // SAFETY: pair 8q + p of chunks j0 .. j0 + 8 lies in row r's words.
                    unsafe {
                        _mm256_storeu_si256(dst.add((8 * q + p) * nb + j0) as *mut __m256i, *line)
                    };
                }
            }
        }
        for j in whole..nb {
            for p in 0..LANES {
                // SAFETY: as above, one word at a time.
                unsafe { *dst.add(p * nb + j) = (src.add(j * LANES + p)).read_unaligned() };
            }
        }
    }
}

/// Transposes eight vectors of eight 32-bit words: word `k` of `v[j]` becomes word `j` of `v[k]`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(v: &mut [__m256i; 8]) {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * (i / 2)], v[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4h + m]: word m (lane 0) and word m + 4 (lane 1) of rows 4h .. 4h + 4. `t[4h]` interleaves words 0 and 1 (4
    // and 5) of rows 4h and 4h + 1, `t[4h + 1]` their words 2 and 3; `t[4h + 2]`, `t[4h + 3]` the next two rows'.
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, m) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + m / 2], t[4 * h + 2 + m / 2]);
        if m % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    // Word k = m + 4·lane: that lane of rows 0..4, then of rows 4..8.
    for (k, out) in v.iter_mut().enumerate() {
        let (m, lane) = (k % 4, k / 4);
        let (a, b) = (u[m], u[4 + m]);
        *out = if lane == 0 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        };
    }
}

/// Every row of a task (`pairs`: its `rows` rows' words over chunks `c0 .. c1`, [`transpose_pairs`]) against groups
/// `g0 .. g0 + V` (`V` 1 to 4) of the inputs (`xt`, laid out for `n` chunks), element `e`, into the pairs'
/// accumulators in `acc`: row by row, while the groups' inputs over the block stay in L1. A row's first block (`c0 ==
/// 0`) starts its accumulators at zero, whatever `acc` holds.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `pairs` holds `rows · 16 · (c1 - c0)` words, `xt` groups `g0 .. g0 + V` of the
/// layout for `n` chunks; `c1 <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tiles<const V: usize>(
    (pairs, rows): (&[u32], usize),
    xt: &[f32],
    (g0, e): (usize, usize),
    (c0, c1): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    let nb = c1.saturating_sub(c0);
    debug_assert!((1..=4).contains(&V) && c1 <= n && e < CHUNK);
    debug_assert!(pairs.len() >= rows * LANES * nb);
    debug_assert!(xt.len() >= token_lanes_len(n * CHUNK, (g0 + V) * GROUP));
    debug_assert!(rows == 0 || acc.len() >= acc_at(rows - 1, g0 + V - 1, groups, e) + GROUP);
    if nb == 0 {
        return;
    }
    // Group v's input vector of chunk c at `x + v · xs + 16c` (in f32), halves 8 apart.
    let x = xt[(g0 * CHUNK + e) * n * GROUP + c0 * GROUP..].as_ptr();
    let xs = CHUNK * n * GROUP;
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let p = acc.as_mut_ptr();
    for r in 0..rows {
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
        // The words holding element e of the row's chunks, one after another.
        let wp = pairs[(r * LANES + e / 2) * nb..].as_ptr();
        for c in 0..nb {
            // SAFETY (every access below): the caller's words and inputs hold chunk c0 + c.
            let pair = unsafe { *wp.add(c) } as i32;
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
        let v: [__m256; LANES] = std::array::from_fn(|l| unsafe {
            _mm256_add_ps(
                _mm256_loadu_ps(p.add(acc_at(r, g, groups, 2 * l) + HALF * half)),
                _mm256_loadu_ps(p.add(acc_at(r, g, groups, 2 * l + 1) + HALF * half)),
            )
        });
        // SAFETY: `out` holds 16 f32.
        unsafe {
            _mm256_storeu_ps(
                out.as_mut_ptr().add(HALF * half),
                super::avx2::halving_sum(v),
            )
        };
    }
    out
}
