//! The accumulation contract of the MXFP4 dot product with bf16 inputs, and its scalar reference.
//!
//! This is the cast Moonshot's reference makes when it runs in its native dtype: the activations reaching an expert
//! are bf16, the dequantised weights are exact in bf16, and products accumulate in f32. It is a separate contract
//! from [`crate::mxfp4_contract`] (exact f32 inputs) because it is shaped around a different instruction:
//! AVX-512 BF16's `vdpbf16ps`, which multiplies two bf16 pairs per 32-bit lane and adds both products to an f32
//! accumulator. On AMD Zen 5 and in Intel's definition, it adds the high pair's product first, then the low pair's,
//! each rounded to nearest-even, with denormal inputs read as (signed) zero and denormal results flushed to signed
//! zero. The reference below does exactly that with scalar `mul_add`, so the SIMD path is bit-identical to it.
//!
//! For one row (`cols` a multiple of 32, seen as chunks of 128 weights, the last one zero-padded):
//! - Chunk `c`, lane `k` (0..16) is the little-endian 32-bit word `d` at bytes `64c + 4k ..` (0 past the row); nibble
//!   `s` of `d` is weight `128c + 8k + s`, `w(s) = E2M1[(d >> 4s) & 15]` (exact in bf16).
//! - Pair `j` (0..4) of lane `k` is weights `(j, j + 4)` against inputs `(x[128c + 8k + j], x[128c + 8k + j + 4])`,
//!   each input rounded to bf16 by [`bf16_round`]. [`permute_input`] stores the pair as one 32-bit word, low half
//!   first.
//! - `t = +0`, then for `j = 0..4`: `t = ftz(fma(w(j + 4), x_hi, t))`, then `t = ftz(fma(w(j), x_lo, t))`.
//! - `acc[c % 2][k] = fma(t, scale, acc[c % 2][k])` in plain f32, where `scale` is the E8M0 multiplier of group
//!   `4c + k / 4` (1.0 past the row); the reduction is [`crate::mxfp4_contract::reduce16`].

use crate::mxfp4::E2M1_TABLE;
use crate::mxfp4_contract::{
    CHUNK, CHUNK_BYTES, CHUNK_LANES, GROUPS_PER_CHUNK, group_scale, reduce16,
};

/// Input pairs per lane of a chunk.
pub const PAIRS: usize = 4;
/// 32-bit input words per chunk (16 lanes × 4 pairs).
pub const CHUNK_WORDS: usize = CHUNK_LANES * PAIRS;

/// Rounds `x` to bf16 (nearest, ties to even), as PyTorch's cast does, except that a result too small to be
/// normal becomes a zero of the same sign (the BF16 dot instruction reads such inputs as zero anyway). NaN stays
/// NaN (quiet).
pub fn bf16_round(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let b = rounded as u16;
    if b & 0x7f80 == 0 { b & 0x8000 } else { b }
}

/// `x` rounded by [`bf16_round`], as f32 (exact): what this contract multiplies by. Dense kernels use it to give
/// their inputs the same rounding.
pub fn bf16_rounded(x: f32) -> f32 {
    bf16_value(bf16_round(x))
}

/// The value of bf16 bits, read as the dot instruction reads them: a denormal is a zero of its sign.
fn bf16_value(b: u16) -> f32 {
    if b & 0x7f80 == 0 {
        f32::from_bits(((b & 0x8000) as u32) << 16)
    } else {
        f32::from_bits((b as u32) << 16)
    }
}

/// A denormal result flushed to a zero of its sign.
fn flush(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// Whether no partial sum of a product with the paired inputs `xb` can be denormal, so that a kernel may skip the
/// contract's flushes: every input half is a zero, not finite, or a normal bf16 of magnitude at least 2^-100. Then
/// every input is a multiple of 2^-107 and every weight of 2^-1, so every exact product and sum of the contract's
/// chain is a multiple of 2^-108; rounded to f32 it stays one (below 2^-84 it is exact, above it the unit in the last
/// place is at least 2^-107), and a nonzero multiple of 2^-108 is normal. Infinities and NaNs stay what they are.
pub fn flush_free(xb: &[u32]) -> bool {
    /// bf16 exponent field of 2^-100.
    const MIN_EXPONENT: u16 = 127 - 100;
    let fine = |h: u16| h & 0x7fff == 0 || (h >> 7) & 0xff >= MIN_EXPONENT;
    xb.iter().all(|&w| fine(w as u16) && fine((w >> 16) as u16))
}

/// Chunks of a row of `cols` weights (the last one may be partial).
pub fn chunks(cols: usize) -> usize {
    crate::mxfp4_contract::chunks(cols)
}

/// The input `x` rounded to bf16 and laid out in the contract's pairs: word `64c + 16j + k` holds inputs
/// `128c + 8k + j` (low half) and `128c + 8k + j + 4` (high half), zero past the row.
pub fn permute_input(x: &[f32]) -> Vec<u32> {
    let n = chunks(x.len());
    let mut xb = vec![0u32; n * CHUNK_WORDS];
    let at = |i: usize| x.get(i).map_or(0, |&v| bf16_round(v) as u32);
    for (c, out) in xb.chunks_exact_mut(CHUNK_WORDS).enumerate() {
        for j in 0..PAIRS {
            for k in 0..CHUNK_LANES {
                let first = c * CHUNK + k * 8 + j;
                out[j * CHUNK_LANES + k] = at(first) | (at(first + 4) << 16);
            }
        }
    }
    xb
}

/// Scalar reference: one row (`packed`: `cols / 2` bytes, `scales`: `cols / 32` bytes) times the paired bf16 input
/// `xb` (from [`permute_input`]).
pub fn dot_row_ref(packed: &[u8], scales: &[u8], xb: &[u32]) -> f32 {
    let mut acc = [[0.0f32; CHUNK_LANES]; 2];
    for (c, x) in xb.chunks_exact(CHUNK_WORDS).enumerate() {
        for k in 0..CHUNK_LANES {
            let at = c * CHUNK_BYTES + 4 * k;
            let d = packed
                .get(at..at + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let w = |s: usize| E2M1_TABLE[((d >> (4 * s)) & 15) as usize];
            let mut t = 0.0f32;
            for j in 0..PAIRS {
                let pair = x[j * CHUNK_LANES + k];
                t = flush(w(j + 4).mul_add(bf16_value((pair >> 16) as u16), t));
                t = flush(w(j).mul_add(bf16_value(pair as u16), t));
            }
            let scale = group_scale(scales, c * GROUPS_PER_CHUNK + k / 4);
            acc[c % 2][k] = t.mul_add(scale, acc[c % 2][k]);
        }
    }
    reduce16(&acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_free_accepts_zeros_normals_and_non_finite_only_above_its_floor() {
        let word = |lo: f32, hi: f32| bf16_round(lo) as u32 | (bf16_round(hi) as u32) << 16;
        assert!(flush_free(&[
            word(0.0, -0.0),
            word(1.5, -3.0e38),
            word(f32::INFINITY, f32::NAN)
        ]));
        assert!(flush_free(&[word(2f32.powi(-100), -(2f32.powi(-100)))]));
        assert!(!flush_free(&[word(1.0, 2f32.powi(-101))]));
        assert!(!flush_free(&[word(-f32::MIN_POSITIVE, 1.0)]));
        // A denormal bf16 (which `permute_input` never writes, the contract reads as zero) is not flush-free.
        assert!(!flush_free(&[0x0001_0000]));
        assert!(flush_free(&[]));
    }

    #[test]
    fn rounding_is_nearest_even_and_flushes_denormals() {
        assert_eq!(bf16_round(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_round(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(bf16_round(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_round(-2.5), 0xc020);
        assert_eq!(bf16_round(f32::MAX), 0x7f80, "rounds up to infinity");
        assert_eq!(bf16_round(1e-39), 0);
        assert_eq!(bf16_round(-1e-39), 0x8000);
        assert!(bf16_value(bf16_round(f32::NAN)).is_nan());
    }

    #[test]
    fn layout_places_every_input_once() {
        let x: Vec<f32> = (0..160).map(|i| i as f32 + 1.0).collect();
        let xb = permute_input(&x);
        assert_eq!(xb.len(), 2 * CHUNK_WORDS);
        // Lane 3, pair 1 of chunk 0: inputs 8·3 + 1 and 8·3 + 5.
        let pair = xb[CHUNK_LANES + 3];
        assert_eq!(bf16_value(pair as u16), 26.0);
        assert_eq!(bf16_value((pair >> 16) as u16), 30.0);
        let mut seen: Vec<f32> = xb
            .iter()
            .flat_map(|&p| [bf16_value(p as u16), bf16_value((p >> 16) as u16)])
            .filter(|&v| v != 0.0)
            .collect();
        seen.sort_by(f32::total_cmp);
        assert_eq!(seen, x);
    }

    #[test]
    fn reference_matches_a_plain_sum_on_exact_values() {
        let (packed, scales, x, plain) = crate::mxfp4_contract::tests::exact_case();
        assert_eq!(
            dot_row_ref(&packed, &scales, &permute_input(&x)) as f64,
            plain
        );
    }

    #[test]
    fn denormal_partial_sums_flush_to_zero() {
        // One weight 0.5 (code 1) against an input at the smallest normal: the product is denormal, so the partial
        // sum is flushed to zero and the scale 2^127 cannot bring it back. Twice that input gives a normal product.
        let mut packed = vec![0u8; 16];
        packed[0] = 0x01;
        let scales = [254u8];
        let tiny = f32::from_bits(0x0080_0000);
        let dot = |x0: f32| {
            let mut x = vec![0.0f32; 32];
            x[0] = x0;
            dot_row_ref(&packed, &scales, &permute_input(&x))
        };
        assert_eq!(dot(tiny), 0.0);
        assert_eq!(dot(-tiny), 0.0);
        assert_eq!(dot(2.0 * tiny), 2.0);
        assert_eq!(dot(-2.0 * tiny), -2.0);
    }
}
