//! The accumulation contract of the MXFP4 dot product, and its scalar reference.
//!
//! The contract is shaped around the cheapest exact decode on AVX-512: a 32-bit lane holds eight 4-bit codes, and a
//! 16-entry table permute (`vpermps`) reads the low code of every lane at once, so eight shifts and eight permutes
//! turn 64 packed bytes into 128 exact f32 weights with no widening. The weights then come out in a fixed
//! non-natural order; the input vector is permuted once per product to match ([`permute_input`]), which costs
//! nothing next to the thousands of rows that reuse it.
//!
//! For one row (`cols` a multiple of 32, seen as chunks of 128 weights, the last one zero-padded):
//! - Chunk `c`, lane `k` (0..16) is the little-endian 32-bit word `d` at bytes `64c + 4k ..`; nibble `s` (0..8) of
//!   `d` is weight `128c + 8k + s`, decoded as `w[s][k] = E2M1[(d >> 4s) & 15]` (exact). Words past the row are 0.
//! - `xp[c][s][k] = x[128c + 8k + s]` (0 past the row).
//! - `te = w0·x0` then `te = fma(w2, x2, te)`, `fma(w4, x4, te)`, `fma(w6, x6, te)`; `to` likewise over 1, 3, 5, 7;
//!   `t = te + to`.
//! - `acc[c % 2][k] = fma(t, scale, acc[c % 2][k])`, where `scale` is the E8M0 multiplier of group `4c + k / 4` (1.0
//!   past the row).
//! - Reduction: `v[k] = acc0[k] + acc1[k]`; then lanes `k` and `k + 8`, `k + 4`, `k + 2`, and lane 0 + lane 1.
//!
//! Every SIMD path computes exactly these operations per lane, so its result is bit-identical to
//! [`dot_row_ref`].

use crate::mxfp4::{E2M1_TABLE, MXFP4_GROUP, e8m0_scale};

/// Weights per chunk (16 lanes × 8 codes).
pub const CHUNK: usize = 128;
/// Packed bytes per chunk.
pub const CHUNK_BYTES: usize = CHUNK / 2;
/// 32-bit lanes per chunk.
pub const CHUNK_LANES: usize = 16;
/// Codes per lane.
pub const CODES_PER_LANE: usize = 8;
/// Scale groups per chunk.
pub const GROUPS_PER_CHUNK: usize = CHUNK / MXFP4_GROUP;

/// Chunks of a row of `cols` weights (the last one may be partial).
pub fn chunks(cols: usize) -> usize {
    cols.div_ceil(CHUNK)
}

/// The input `x` (`cols` values) in the contract's order, zero-padded to whole chunks (`chunks(cols) * 128`).
pub fn permute_input(x: &[f32]) -> Vec<f32> {
    let n = chunks(x.len());
    let mut xp = vec![0.0f32; n * CHUNK];
    for (c, out) in xp.chunks_exact_mut(CHUNK).enumerate() {
        for s in 0..CODES_PER_LANE {
            for k in 0..CHUNK_LANES {
                let i = c * CHUNK + k * CODES_PER_LANE + s;
                if let Some(&v) = x.get(i) {
                    out[s * CHUNK_LANES + k] = v;
                }
            }
        }
    }
    xp
}

/// The multiplier of group `g` of a row, 1.0 past its end. Scale bytes were checked for the NaN byte when the
/// matrix was built.
#[inline]
pub fn group_scale(scales: &[u8], g: usize) -> f32 {
    scales
        .get(g)
        .map_or(1.0, |&e| e8m0_scale(e).unwrap_or(f32::NAN))
}

/// The 32-bit word of lane `k` of chunk `c`, 0 past the row.
#[inline]
fn lane_word(packed: &[u8], c: usize, k: usize) -> u32 {
    let at = c * CHUNK_BYTES + 4 * k;
    match packed.get(at..at + 4) {
        Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        None => 0,
    }
}

/// Reduces the sixteen lanes of the two accumulators in the contract's order.
#[inline]
pub fn reduce16(acc: &[[f32; CHUNK_LANES]; 2]) -> f32 {
    let mut v = [0.0f32; CHUNK_LANES];
    for k in 0..CHUNK_LANES {
        v[k] = acc[0][k] + acc[1][k];
    }
    let mut width = CHUNK_LANES / 2;
    while width > 0 {
        for k in 0..width {
            v[k] += v[k + width];
        }
        width /= 2;
    }
    v[0]
}

/// Scalar reference: one row (`packed`: `cols / 2` bytes, `scales`: `cols / 32` bytes) times the permuted input
/// `xp` (from [`permute_input`]).
pub fn dot_row_ref(packed: &[u8], scales: &[u8], xp: &[f32]) -> f32 {
    let mut acc = [[0.0f32; CHUNK_LANES]; 2];
    for (c, x) in xp.chunks_exact(CHUNK).enumerate() {
        for k in 0..CHUNK_LANES {
            let d = lane_word(packed, c, k);
            let w = |s: usize| E2M1_TABLE[((d >> (4 * s)) & 15) as usize];
            let xv = |s: usize| x[s * CHUNK_LANES + k];
            let mut te = w(0) * xv(0);
            let mut to = w(1) * xv(1);
            for s in (2..CODES_PER_LANE).step_by(2) {
                te = w(s).mul_add(xv(s), te);
                to = w(s + 1).mul_add(xv(s + 1), to);
            }
            let scale = group_scale(scales, c * GROUPS_PER_CHUNK + k / 4);
            acc[c % 2][k] = (te + to).mul_add(scale, acc[c % 2][k]);
        }
    }
    reduce16(&acc)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn permutation_places_every_input_once() {
        let x: Vec<f32> = (0..160).map(|i| i as f32 + 1.0).collect();
        let xp = permute_input(&x);
        assert_eq!(xp.len(), 256);
        // Lane 3, code 5 of chunk 0 is input 8·3 + 5.
        assert_eq!(xp[5 * CHUNK_LANES + 3], 30.0);
        let mut seen: Vec<f32> = xp.iter().copied().filter(|&v| v != 0.0).collect();
        seen.sort_by(f32::total_cmp);
        assert_eq!(seen, x);
    }

    #[test]
    fn reference_matches_a_plain_sum_on_exact_values() {
        let (packed, scales, x, plain) = exact_case();
        assert_eq!(
            dot_row_ref(&packed, &scales, &permute_input(&x)) as f64,
            plain
        );
    }

    /// A row of 160 weights (a partial last chunk), its scales and an input on which every product and sum is exact
    /// (in f32, and in bf16 for the inputs), so any accumulation order gives the plain sum, returned last.
    pub(crate) fn exact_case() -> (Vec<u8>, Vec<u8>, Vec<f32>, f64) {
        let cols = 160;
        let packed: Vec<u8> = (0..cols / 2).map(|i| (i * 37 % 251) as u8).collect();
        let scales = vec![127u8, 128, 126, 127, 129];
        let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut plain = 0.0f64;
        for (i, &xi) in x.iter().enumerate() {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 15;
            let w = E2M1_TABLE[code as usize] * group_scale(&scales, i / 32);
            plain += w as f64 * xi as f64;
        }
        (packed, scales, x, plain)
    }
}
