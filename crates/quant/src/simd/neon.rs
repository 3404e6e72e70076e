//! NEON kernels (aarch64). f32 rows follow the contract in [`crate::dot`] (an 8-lane accumulator is a pair of
//! `float32x4_t`, lanes 0..4 and 4..8), bf16 rows the one in [`crate::bf16_contract`] (a 16-lane accumulator is
//! four), so lane-wise FMAs and the fixed reductions give the scalar twins' bits.
//!
//! Untested here: the project builds and tests on x86-64; this module is type-checked with
//! `cargo check --target aarch64-unknown-linux-gnu -p deltafin-quant`.

use std::arch::aarch64::*;

use crate::dot::{BLOCK, LANES};

/// Two halves of an 8-lane accumulator.
#[derive(Clone, Copy)]
struct Acc8 {
    lo: float32x4_t,
    hi: float32x4_t,
}

#[inline]
fn zero() -> Acc8 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        Acc8 {
            lo: vdupq_n_f32(0.0),
            hi: vdupq_n_f32(0.0),
        }
    }
}

/// `acc += w * x` for 8 lanes, fused.
#[inline]
fn fma8(acc: Acc8, w: [float32x4_t; 2], x: *const f32) -> Acc8 {
    // SAFETY: the caller guarantees 8 readable f32 at x; NEON is baseline on aarch64.
    unsafe {
        Acc8 {
            lo: vfmaq_f32(acc.lo, w[0], vld1q_f32(x)),
            hi: vfmaq_f32(acc.hi, w[1], vld1q_f32(x.add(4))),
        }
    }
}

/// The contract's reduction.
#[inline]
fn reduce(a: [Acc8; 4]) -> f32 {
    // SAFETY: NEON is baseline on aarch64.
    unsafe {
        let lo = vaddq_f32(vaddq_f32(a[0].lo, a[1].lo), vaddq_f32(a[2].lo, a[3].lo));
        let hi = vaddq_f32(vaddq_f32(a[0].hi, a[1].hi), vaddq_f32(a[2].hi, a[3].hi));
        let s4 = vaddq_f32(lo, hi); // lanes l and l+4
        let s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4)); // lanes l and l+2
        vget_lane_f32::<0>(s2) + vget_lane_f32::<1>(s2)
    }
}

/// The dot contract over `n` weights, `load(i)` giving weights `i..i+8` as two f32 vectors and `get(i)` one.
#[inline]
fn dot_with(
    n: usize,
    x: &[f32],
    load: impl Fn(usize) -> [float32x4_t; 2],
    get: impl Fn(usize) -> f32,
) -> f32 {
    let n = n.min(x.len());
    let full = n / BLOCK * BLOCK;
    let xp = x.as_ptr();
    let mut acc = [zero(); 4];
    let mut b = 0;
    while b < full {
        for (a, acc_a) in acc.iter_mut().enumerate() {
            let i = b + a * LANES;
            // SAFETY: i + 8 <= full <= n.
            *acc_a = fma8(*acc_a, load(i), unsafe { xp.add(i) });
        }
        b += BLOCK;
    }
    let mut c = full;
    while c < n {
        let mut wb = [0.0f32; LANES];
        let mut xb = [0.0f32; LANES];
        for l in 0..LANES.min(n - c) {
            wb[l] = get(c + l);
            xb[l] = x[c + l];
        }
        // SAFETY: wb holds 8 f32.
        let w = unsafe { [vld1q_f32(wb.as_ptr()), vld1q_f32(wb.as_ptr().add(4))] };
        acc[0] = fma8(acc[0], w, xb.as_ptr());
        c += LANES;
    }
    reduce(acc)
}

/// NEON twin of [`crate::dot::dot_f32_ref`].
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let wp = w.as_ptr();
    // SAFETY (in the closure): dot_with only loads i..i+8 within n = min(len) values.
    dot_with(
        w.len(),
        x,
        |i| unsafe { [vld1q_f32(wp.add(i)), vld1q_f32(wp.add(i + 4))] },
        |i| w[i],
    )
}

/// `R` bf16 rows of equal length against one permuted input ([`crate::bf16_contract`]): each chunk of 32 weights is
/// four 16-byte loads a row, each widened to exact f32 by a shift (even weights) and a mask (odd weights); the
/// contract's 16-lane accumulators are four quarters here.
pub fn bf16_rows<const R: usize>(rows: [&[u16]; R], xp: &[f32]) -> [f32; R] {
    use crate::bf16_contract::{CHUNK, padded_len};
    let n = rows[0].len();
    if rows.iter().any(|w| w.len() != n) || xp.len() < padded_len(n) {
        return rows.map(|w| crate::bf16_contract::dot_ref(w, xp));
    }
    // SAFETY: NEON is baseline on aarch64; every load below is inside a row, its padded copy or `xp` (checked).
    unsafe {
        let zero = vdupq_n_f32(0.0);
        let high = vdupq_n_u32(0xffff_0000);
        let mut even = [[zero; 4]; R];
        let mut odd = [[zero; 4]; R];
        for c in 0..n.div_ceil(CHUNK) {
            let at = xp.as_ptr().add(c * CHUNK);
            for r in 0..R {
                let w = rows[r];
                let mut padded = [0u16; CHUNK];
                let p = if (c + 1) * CHUNK <= n {
                    w.as_ptr().add(c * CHUNK)
                } else {
                    padded[..n - c * CHUNK].copy_from_slice(&w[c * CHUNK..]);
                    padded.as_ptr()
                };
                for q in 0..4 {
                    let v = vld1q_u32(p.add(8 * q) as *const u32);
                    let e = vreinterpretq_f32_u32(vshlq_n_u32::<16>(v));
                    let o = vreinterpretq_f32_u32(vandq_u32(v, high));
                    even[r][q] = vfmaq_f32(even[r][q], e, vld1q_f32(at.add(4 * q)));
                    odd[r][q] = vfmaq_f32(odd[r][q], o, vld1q_f32(at.add(16 + 4 * q)));
                }
            }
        }
        std::array::from_fn(|r| {
            let v: [float32x4_t; 4] = std::array::from_fn(|q| vaddq_f32(even[r][q], odd[r][q]));
            let s8 = [vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3])]; // lanes l and l + 8
            let s4 = vaddq_f32(s8[0], s8[1]); // lanes l and l + 4
            let s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4)); // lanes l and l + 2
            vget_lane_f32::<0>(s2) + vget_lane_f32::<1>(s2)
        })
    }
}
