//! The accumulation contract of the MXFP4 dot product with inputs quantised to int16 per group of 32, and its scalar
//! reference.
//!
//! Each group of 32 inputs (the span one E8M0 weight scale covers) is quantised on its own: `s = max|x| / 32767`,
//! `q = round(x / s)` (nearest, ties away from zero). An input then moves by at most `s / 2`, that is 1/65534 of the
//! largest magnitude in its group: a bf16 cast moves each input by up to 1/512 of itself. Twice an E2M1 value is an
//! integer (`±{0, 1, 2, 3, 4, 6, 8, 12}`), so a chunk's products sum exactly in 32-bit integers, and the kernel is
//! shaped around AVX-512 VNNI's `vpdpwssd` (two int16 products per 32-bit lane): a word permute decodes 32 codes
//! into int16 at once and one `vpdpwssd` multiplies them, where the exact f32 contract ([`crate::mxfp4_contract`])
//! needs a permute, a conversion and an FMA per 16 codes. On AVX2, byte shuffles decode the codes and `vpmaddwd`
//! multiplies the pairs, about 1.7× as fast as the f32 contract's AVX2 kernel.
//!
//! For one row (`cols` a multiple of 32, seen as chunks of 128 weights, the last one zero-padded):
//! - Chunk `c`, lane `k` (0..16) is the little-endian 32-bit word `d` at bytes `64c + 4k ..` (0 past the row); nibble
//!   `s` of `d` is weight `128c + 8k + s`, `v(s) = 2·E2M1[(d >> 4s) & 15]` (an integer).
//! - Pair `j` (0..4) of lane `k` is weights `(j, j + 4)` against `(q[128c + 8k + j], q[128c + 8k + j + 4])`;
//!   `t = Σ_j v(j)·q_lo + v(j + 4)·q_hi`, an exact integer (at most `8 · 12 · 32767 < 2^22`, so exact in f32 too).
//! - `u = f32(t) · m`, rounded once, where `m = s / 2` of the lane's input group `4c + k / 4` (the halving undoes the
//!   doubled weights).
//! - `acc[c % 2][k] = fma(u, scale, acc[c % 2][k])`, where `scale` is the E8M0 multiplier of group `4c + k / 4` (1.0
//!   past the row); the reduction is [`crate::mxfp4_contract::reduce16`].
//!
//! [`permute_input`] lays a chunk out as 64 words of input pairs (`q` low half first) followed by the 16 lanes'
//! multipliers `m` as f32 bits, so a kernel reads one buffer. A group with a NaN or an infinity gets the multiplier
//! NaN, so its rows' results are NaN as in f32 arithmetic.

use crate::mxfp4::MXFP4_GROUP;
use crate::mxfp4_contract::{
    CHUNK, CHUNK_BYTES, CHUNK_LANES, GROUPS_PER_CHUNK, group_scale, reduce16,
};
use crate::quantise;

/// Input pairs per lane of a chunk.
pub const PAIRS: usize = 4;
/// Words of input pairs per chunk (16 lanes × 4 pairs).
pub const PAIR_WORDS: usize = CHUNK_LANES * PAIRS;
/// Words per chunk of a permuted input: the pairs, then one multiplier per lane.
pub const CHUNK_WORDS: usize = PAIR_WORDS + CHUNK_LANES;
/// Largest magnitude of a quantised input.
pub const Q_MAX: f32 = quantise::Q_MAX;

/// Chunks of a row of `cols` weights (the last one may be partial).
pub fn chunks(cols: usize) -> usize {
    crate::mxfp4_contract::chunks(cols)
}

/// `x` as this contract reads it: each group of 32 quantised and scaled back (`s · q`). Dense experts use it so that
/// the int16 mode means one thing for every kind of expert.
pub fn dequantised(x: &[f32]) -> Vec<f32> {
    let mut q = [0i16; MXFP4_GROUP];
    let mut out = Vec::with_capacity(x.len());
    for group in x.chunks(MXFP4_GROUP) {
        let step = quantise::symmetric(group, &mut q[..group.len()]);
        out.extend(q[..group.len()].iter().map(|&v| f32::from(v) * step));
    }
    out
}

/// The input `x` quantised and laid out in the contract's chunks of [`CHUNK_WORDS`] words: word `80c + 16j + k`
/// holds `q[128c + 8k + j]` (low half) and `q[128c + 8k + j + 4]` (high half), zero past the row; word
/// `80c + 64 + k` holds the f32 bits of lane `k`'s multiplier `m` (0 past the row).
pub fn permute_input(x: &[f32]) -> Vec<u32> {
    let n = chunks(x.len());
    let mut q = vec![0i16; n * CHUNK];
    let mut half_steps = vec![0.0f32; n * GROUPS_PER_CHUNK];
    for (g, group) in x.chunks(MXFP4_GROUP).enumerate() {
        half_steps[g] = quantise::symmetric(group, &mut q[g * MXFP4_GROUP..][..group.len()]) * 0.5;
    }
    let mut out = vec![0u32; n * CHUNK_WORDS];
    for (c, words) in out.chunks_exact_mut(CHUNK_WORDS).enumerate() {
        let at = |i: usize| u32::from(q[c * CHUNK + i] as u16);
        for j in 0..PAIRS {
            for k in 0..CHUNK_LANES {
                words[j * CHUNK_LANES + k] = at(8 * k + j) | (at(8 * k + j + 4) << 16);
            }
        }
        for k in 0..CHUNK_LANES {
            words[PAIR_WORDS + k] = half_steps[c * GROUPS_PER_CHUNK + k / 4].to_bits();
        }
    }
    out
}

/// Twice the E2M1 values, indexed by code: integers, since every E2M1 value is a multiple of 0.5.
pub const E2M1_DOUBLED: [i16; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Twice the E2M1 value of a code (only its low four bits are read).
#[inline]
pub fn doubled(code: u32) -> i32 {
    i32::from(E2M1_DOUBLED[(code & 15) as usize])
}

/// Scalar reference: one row (`packed`: `cols / 2` bytes, `scales`: `cols / 32` bytes) times the quantised input
/// `xq` (from [`permute_input`]).
pub fn dot_row_ref(packed: &[u8], scales: &[u8], xq: &[u32]) -> f32 {
    let mut acc = [[0.0f32; CHUNK_LANES]; 2];
    for (c, x) in xq.chunks_exact(CHUNK_WORDS).enumerate() {
        for k in 0..CHUNK_LANES {
            let at = c * CHUNK_BYTES + 4 * k;
            let d = packed
                .get(at..at + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let v = |s: usize| doubled(d >> (4 * s));
            let mut t = 0i32;
            for j in 0..PAIRS {
                let pair = x[j * CHUNK_LANES + k];
                t += v(j) * i32::from(pair as u16 as i16)
                    + v(j + 4) * i32::from((pair >> 16) as u16 as i16);
            }
            let u = t as f32 * f32::from_bits(x[PAIR_WORDS + k]);
            let scale = group_scale(scales, c * GROUPS_PER_CHUNK + k / 4);
            acc[c % 2][k] = u.mul_add(scale, acc[c % 2][k]);
        }
    }
    reduce16(&acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mxfp4::E2M1_TABLE;

    #[test]
    fn doubled_table_is_twice_the_e2m1_values() {
        for (code, &v) in E2M1_DOUBLED.iter().enumerate() {
            assert_eq!(f32::from(v), 2.0 * E2M1_TABLE[code], "code {code}");
        }
    }

    #[test]
    fn quantises_each_group_to_its_largest_magnitude() {
        let mut x = vec![0.0f32; 64];
        x[0] = 0.5;
        x[1] = -2.0;
        x[2] = 1.0;
        x[40] = 1e-3;
        let q = permute_input(&x);
        assert_eq!(q.len(), CHUNK_WORDS);
        // Lane 0, pair 0 holds inputs 0 and 4; pair 1 inputs 1 and 5; pair 2 inputs 2 and 6.
        assert_eq!(q[0] as u16 as i16, 8192);
        assert_eq!(q[CHUNK_LANES] as u16 as i16, -32767);
        assert_eq!(q[2 * CHUNK_LANES] as u16 as i16, 16384);
        // Input 40 is lane 5, pair 0, alone in group 1: it is that group's largest magnitude.
        assert_eq!(q[5] as u16 as i16, 32767);
        assert_eq!(f32::from_bits(q[PAIR_WORDS]), 2.0 / Q_MAX * 0.5);
        assert_eq!(f32::from_bits(q[PAIR_WORDS + 4]), 1e-3 / Q_MAX * 0.5);
        // Groups 2 and 3 are zero.
        assert_eq!(f32::from_bits(q[PAIR_WORDS + 8]), 0.0);
    }

    #[test]
    fn layout_places_every_input_once() {
        // 1..=160, five groups of 32: each value comes back within its group's step, from one place only.
        let x: Vec<f32> = (0..160).map(|i| i as f32 + 1.0).collect();
        let xq = permute_input(&x);
        assert_eq!(xq.len(), 2 * CHUNK_WORDS);
        let value = |c: usize, word: usize, high: bool| {
            let w = xq[c * CHUNK_WORDS + word];
            let q = if high { (w >> 16) as u16 } else { w as u16 } as i16;
            f32::from(q)
                * f32::from_bits(xq[c * CHUNK_WORDS + PAIR_WORDS + word % CHUNK_LANES])
                * 2.0
        };
        let mut seen = Vec::new();
        for c in 0..2 {
            for word in 0..PAIR_WORDS {
                for high in [false, true] {
                    let v = value(c, word, high);
                    if v != 0.0 {
                        seen.push(v);
                    }
                }
            }
        }
        // Lane 3, pair 1 of chunk 0: inputs 8·3 + 1 and 8·3 + 5 (values 26 and 30), within the group's step.
        assert!((value(0, CHUNK_LANES + 3, false) - 26.0).abs() < 32.0 / Q_MAX);
        assert!((value(0, CHUNK_LANES + 3, true) - 30.0).abs() < 32.0 / Q_MAX);
        seen.sort_by(f32::total_cmp);
        assert_eq!(seen.len(), x.len());
        for (s, v) in seen.iter().zip(&x) {
            assert!((s - v).abs() <= 160.0 / Q_MAX, "{s} vs {v}");
        }
    }

    #[test]
    fn reference_is_the_sum_over_the_dequantised_input() {
        // The contract's only change to the input is its quantisation: against the dequantised input, a plain f64
        // sum differs by f32 rounding alone; against the original, by at most s / 2 per input times |w|.
        let (packed, scales, x, exact) = crate::mxfp4_contract::tests::exact_case();
        let weight = |i: usize| {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 15;
            f64::from(E2M1_TABLE[code as usize] * group_scale(&scales, i / 32))
        };
        let xd = dequantised(&x);
        let plain: f64 = xd
            .iter()
            .enumerate()
            .map(|(i, &v)| weight(i) * f64::from(v))
            .sum();
        let bound: f64 = (0..x.len())
            .map(|i| weight(i).abs() * 3.0 / f64::from(Q_MAX) / 2.0)
            .sum();
        let got = f64::from(dot_row_ref(&packed, &scales, &permute_input(&x)));
        assert!(
            (got - plain).abs() <= 1e-6 * plain.abs().max(1.0),
            "{got} vs {plain}"
        );
        assert!(
            (got - exact).abs() <= bound,
            "{got} vs {exact} (bound {bound})"
        );
        assert_ne!(
            got, exact,
            "3 / 32767 is not exact, so the quantisation shows"
        );
    }

    #[test]
    fn non_finite_groups_give_nan_and_zero_groups_nothing() {
        let packed = vec![0x22u8; 32];
        let scales = [127u8, 127];
        let mut x = vec![0.0f32; 64];
        assert_eq!(dot_row_ref(&packed, &scales, &permute_input(&x)), 0.0);
        x[33] = f32::INFINITY;
        assert!(dot_row_ref(&packed, &scales, &permute_input(&x)).is_nan());
        // A NaN among zeros, where the largest magnitude is 0, is still NaN.
        let mut x = vec![0.0f32; 64];
        x[1] = f32::NAN;
        assert!(dot_row_ref(&packed, &scales, &permute_input(&x)).is_nan());
        assert_eq!(dequantised(&[0.0, 3.0, -1.5])[1], 3.0);
    }
}
