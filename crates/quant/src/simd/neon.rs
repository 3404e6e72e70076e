//! NEON kernels (aarch64). Each follows its scalar twin's contract exactly: [`crate::dot`] for f32 rows,
//! [`crate::bf16_contract`] for bf16 rows, [`crate::int8_contract`] for int8 rows, [`crate::mxfp4_contract`] and [`crate::mxfp4_i16_contract`] for MXFP4
//! rows, [`crate::quantise`] for the int16 quantisation. NEON is part of the aarch64 baseline, so the kernels are
//! safe functions: every load is checked against its slice or comes from a zero-padded copy.
//!
//! The contracts' 8- and 16-lane accumulators are pairs and quads of `float32x4_t`; lane-wise FMAs (`vfmaq_f32`, one
//! rounding, as `f32::mul_add`) and the contracts' fixed reductions give the scalar twins' bits. aarch64 Linux and
//! macOS run with denormals on (FPCR.FZ clear), as the scalar code assumes.
//!
//! The bf16-input MXFP4 contract ([`crate::mxfp4_bf16_contract`]) has no NEON kernel: its steps are AVX-512 BF16's
//! `vdpbf16ps` (two fused multiply-adds per lane, each result with denormals flushed to zero). NEON's BF16
//! instructions (FEAT_BF16: M2 and later, not M1) either round differently (`BFDOT` sums both products before one
//! rounding) or follow FPCR's flush setting, which Rust code cannot change; and the Rust intrinsics for them are
//! not stable. An exact form from f32 FMAs plus masks that flush each partial sum costs more per weight than the
//! exact f32 contract, which is the better choice on these machines. That contract runs its scalar reference here.
//!
//! Tested bit for bit against the scalar twins under `qemu-aarch64` (`.ci/aarch64.sh`), not on Apple hardware.

use std::arch::aarch64::*;

use crate::dot::{BLOCK, LANES};
use crate::mxfp4_contract::{CHUNK, CHUNK_BYTES, GROUPS_PER_CHUNK, group_scale};

/// An 8-lane accumulator of the dot contract: lanes 0..4 and 4..8.
type Acc8 = [float32x4_t; 2];

/// A zero vector.
#[inline(always)]
fn zero() -> float32x4_t {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { vdupq_n_f32(0.0) }
}

/// The dot contract's reduction of four 8-lane accumulators.
#[inline(always)]
fn reduce(a: [Acc8; 4]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let lo = vaddq_f32(vaddq_f32(a[0][0], a[1][0]), vaddq_f32(a[2][0], a[3][0]));
        let hi = vaddq_f32(vaddq_f32(a[0][1], a[1][1]), vaddq_f32(a[2][1], a[3][1]));
        // lanes l and l+4
        let s4 = vaddq_f32(lo, hi);
        // lanes l and l+2
        let s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
        // lane 0 + lane 1
        vget_lane_f32::<0>(s2) + vget_lane_f32::<1>(s2)
    }
}

/// 8 values from the start of `v` (which holds at least 8) as two vectors.
#[inline(always)]
fn load8(v: &[f32]) -> Acc8 {
    let v = &v[..LANES];
    // SAFETY: `v` holds 8 values (the slice above is checked).
    unsafe { [vld1q_f32(v.as_ptr()), vld1q_f32(v.as_ptr().add(4))] }
}

/// `R` neighbouring rows of the dot contract ([`crate::dot`]) against one input, sharing its loads: the whole
/// blocks of 32 into four 8-lane accumulators a row, then each row's zero-padded tail into its accumulator 0 and the
/// contract's reduction.
#[inline(always)]
fn f32_rows<const R: usize>(rows: [&[f32]; R], x: &[f32]) -> [f32; R] {
    let n = rows.iter().fold(x.len(), |n, w| n.min(w.len()));
    let full = n / BLOCK * BLOCK;
    let mut acc = [[[zero(); 2]; 4]; R];
    for b in (0..full).step_by(BLOCK) {
        for k in 0..4 {
            let i = b + k * LANES;
            let xv = load8(&x[i..]);
            for (a, w) in acc.iter_mut().zip(&rows) {
                let wv = load8(&w[i..]);
                // SAFETY: NEON is part of the aarch64 baseline.
                unsafe {
                    a[k][0] = vfmaq_f32(a[k][0], wv[0], xv[0]);
                    a[k][1] = vfmaq_f32(a[k][1], wv[1], xv[1]);
                }
            }
        }
    }
    let mut out = [0.0f32; R];
    for ((o, mut a), w) in out.iter_mut().zip(acc).zip(&rows) {
        for c in (full..n).step_by(LANES) {
            // Zero-padded chunk of 8 into accumulator 0, as in the contract.
            let len = LANES.min(n - c);
            let mut wb = [0.0f32; LANES];
            let mut xb = [0.0f32; LANES];
            wb[..len].copy_from_slice(&w[c..c + len]);
            xb[..len].copy_from_slice(&x[c..c + len]);
            let (wv, xv) = (load8(&wb), load8(&xb));
            // SAFETY: NEON is part of the aarch64 baseline.
            unsafe {
                a[0][0] = vfmaq_f32(a[0][0], wv[0], xv[0]);
                a[0][1] = vfmaq_f32(a[0][1], wv[1], xv[1]);
            }
        }
        *o = reduce(a);
    }
    out
}

/// NEON twin of [`crate::dot::dot_f32_ref`].
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    f32_rows([w], x)[0]
}

/// Two neighbouring f32 rows against one input, each bit-identical to [`crate::dot::dot_f32_ref`] (over the
/// shortest of the three lengths).
pub fn dot_f32_x2(w0: &[f32], w1: &[f32], x: &[f32]) -> [f32; 2] {
    f32_rows([w0, w1], x)
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
                    let v = vreinterpretq_u32_u16(vld1q_u16(p.add(8 * q)));
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

/// Columns of an int8 row summed in 32-bit lanes before they are widened to 64 bits. Each lane gets one product
/// (at most `128 · 32767 < 2^22`) per 16 columns, so 256 steps of 16 stay below `2^30`.
const INT8_SEGMENT: usize = 256 * 16;

/// `R` neighbouring int8 rows against one quantised input ([`crate::int8_contract`]): per 16 columns and row, the
/// weights widened to int16 and four widening multiply-adds (`smlal`, one int16 product into each 32-bit lane), the
/// lanes widened into 64-bit sums every [`INT8_SEGMENT`] columns. The sum is exact, so its order is free. Rows are
/// summed over the shortest of the rows and `xq`; `xq` needs no padding (the last partial block is copied).
#[inline(always)]
fn int8_rows<const R: usize>(rows: [&[i8]; R], xq: &[i16]) -> [i64; R] {
    let n = rows.iter().fold(xq.len(), |n, q| n.min(q.len()));
    let full = n / 16 * 16;
    // SAFETY (every block below): NEON is part of the aarch64 baseline; loads read slices checked to hold 16
    // values.
    let mut wide = [unsafe { vdupq_n_s64(0) }; R];
    let block = |acc: &mut [[int32x4_t; 4]; R], x: &[i16], q: &dyn Fn(usize) -> int8x16_t| unsafe {
        let x = &x[..16];
        let (x0, x1) = (vld1q_s16(x.as_ptr()), vld1q_s16(x.as_ptr().add(8)));
        for (r, a) in acc.iter_mut().enumerate() {
            let w = q(r);
            let (w0, w1) = (vmovl_s8(vget_low_s8(w)), vmovl_high_s8(w));
            a[0] = vmlal_s16(a[0], vget_low_s16(w0), vget_low_s16(x0));
            a[1] = vmlal_high_s16(a[1], w0, x0);
            a[2] = vmlal_s16(a[2], vget_low_s16(w1), vget_low_s16(x1));
            a[3] = vmlal_high_s16(a[3], w1, x1);
        }
    };
    let widen = |wide: &mut [int64x2_t; R], acc: [[int32x4_t; 4]; R]| unsafe {
        for (wd, a) in wide.iter_mut().zip(acc) {
            for lanes in a {
                *wd = vpadalq_s32(*wd, lanes);
            }
        }
    };
    let fresh = || [[unsafe { vdupq_n_s32(0) }; 4]; R];
    let mut c = 0;
    while c < full {
        let end = full.min(c + INT8_SEGMENT);
        let mut acc = fresh();
        while c < end {
            block(&mut acc, &xq[c..], &|r| {
                let q = &rows[r][c..c + 16];
                unsafe { vld1q_s8(q.as_ptr()) }
            });
            c += 16;
        }
        widen(&mut wide, acc);
    }
    if full < n {
        // The partial last block, zero-padded.
        let mut x = [0i16; 16];
        x[..n - full].copy_from_slice(&xq[full..n]);
        let mut acc = fresh();
        block(&mut acc, &x, &|r| {
            let mut tail = [0i8; 16];
            tail[..n - full].copy_from_slice(&rows[r][full..n]);
            unsafe { vld1q_s8(tail.as_ptr()) }
        });
        widen(&mut wide, acc);
    }
    wide.map(|wd| unsafe { vaddvq_s64(wd) })
}

/// NEON twin of [`crate::int8_contract::dot_ref`] over `q` and the quantised values `xq` (as long as `q`, or
/// padded past it with zeros).
pub fn int8_dot(q: &[i8], xq: &[i16]) -> i64 {
    int8_rows([q], xq)[0]
}

/// Two neighbouring int8 rows against one quantised input, each equal to [`crate::int8_contract::dot_ref`].
pub fn int8_dot_x2(q0: &[i8], q1: &[i8], xq: &[i16]) -> [i64; 2] {
    int8_rows([q0, q1], xq)
}

/// The code words of chunk `c` of a row as four vectors of four lanes (lanes `4v .. 4v + 4` in vector `v`); a
/// vector past the row's end is zero. A row is whole groups of 16 bytes, so each vector is wholly in or out.
#[inline(always)]
fn chunk_words(packed: &[u8], c: usize) -> [uint32x4_t; 4] {
    std::array::from_fn(|v| {
        let at = c * CHUNK_BYTES + 16 * v;
        match packed.get(at..at + 16) {
            // SAFETY: 16 bytes lie at `b`; NEON is baseline.
            Some(b) => unsafe { vreinterpretq_u32_u8(vld1q_u8(b.as_ptr())) },
            // SAFETY: NEON is part of the aarch64 baseline.
            None => unsafe { vdupq_n_u32(0) },
        }
    })
}

/// The MXFP4 contracts' reduction ([`crate::mxfp4_contract::reduce16`]) of the even and odd accumulators, sixteen
/// lanes each as four vectors.
#[inline(always)]
fn reduce16(acc: [[float32x4_t; 4]; 2]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let v: [float32x4_t; 4] = std::array::from_fn(|q| vaddq_f32(acc[0][q], acc[1][q]));
        // lanes k and k + 8, then k + 4, k + 2, k + 1
        let s8 = [vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3])];
        let s4 = vaddq_f32(s8[0], s8[1]);
        let s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
        vget_lane_f32::<0>(s2) + vget_lane_f32::<1>(s2)
    }
}

/// Drives an MXFP4 kernel over `R` neighbouring rows and `T` inputs: for chunk `c` and lane quarter `v`,
/// `decode(words)` turns a row's four code words into weights once, and `sum(&w, t, c, v)` gives the unscaled sum
/// of those lanes against input `t`; the driver applies the group's scale into the contracts' even and odd
/// accumulators (`acc[c % 2] = fma(sum, scale, acc[c % 2])`) and reduces. Past a row's end its words are zero and
/// its scale is 1, as the contracts say.
#[inline(always)]
fn mxfp4_rows<Wt, const R: usize, const T: usize>(
    rows: [(&[u8], &[u8]); R],
    n_chunks: usize,
    decode: impl Fn(uint32x4_t) -> Wt,
    sum: impl Fn(&Wt, usize, usize, usize) -> float32x4_t,
) -> [[f32; T]; R] {
    let mut acc = [[[[zero(); 4]; 2]; T]; R];
    for c in 0..n_chunks {
        for (&(packed, scales), row_acc) in rows.iter().zip(acc.iter_mut()) {
            let words = chunk_words(packed, c);
            for (v, &quarter) in words.iter().enumerate() {
                let w = decode(quarter);
                // SAFETY: NEON is part of the aarch64 baseline.
                let scale = unsafe { vdupq_n_f32(group_scale(scales, c * GROUPS_PER_CHUNK + v)) };
                for (t, a) in row_acc.iter_mut().enumerate() {
                    let a = &mut a[c % 2][v];
                    // SAFETY: NEON is part of the aarch64 baseline.
                    *a = unsafe { vfmaq_f32(*a, sum(&w, t, c, v), scale) };
                }
            }
        }
    }
    acc.map(|row| row.map(reduce16))
}

/// The upper two bytes of each E2M1 value's f32 bits, by code (bytes `2c` and `2c + 1`): its lower two bytes are
/// zero, so a two-register byte table lookup decodes four codes to exact f32 at once.
const E2M1_HIGH_BYTES: [u8; 32] = {
    let mut bytes = [0u8; 32];
    let mut c = 0;
    while c < 16 {
        let bits = crate::mxfp4::E2M1_TABLE[c].to_bits();
        assert!(bits & 0xffff == 0, "an E2M1 value's low 16 bits are zero");
        bytes[2 * c] = (bits >> 16) as u8;
        bytes[2 * c + 1] = (bits >> 24) as u8;
        c += 1;
    }
    bytes
};

/// The eight weight vectors of four lanes of the f32 contract: vector `s` holds `E2M1[(d >> 4s) & 15]` of each
/// lane's word `d`. Each code `c` becomes the byte indices `(255, 255, 2c, 2c + 1)` by one multiply-add (255 is out
/// of the table's range and reads as zero), and one lookup gives the value's bits.
#[inline(always)]
fn decode_f32(words: uint32x4_t, table: uint8x16x2_t) -> [float32x4_t; 8] {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let (nibble, base) = (vdupq_n_u32(15), vdupq_n_u32(0x0100_ffff));
        std::array::from_fn(|s| {
            let codes = vandq_u32(vshlq_u32(words, vdupq_n_s32(-4 * s as i32)), nibble);
            let index = vmlaq_n_u32(base, codes, 0x0202_0000);
            vreinterpretq_f32_u8(vqtbl2q_u8(table, vreinterpretq_u8_u32(index)))
        })
    }
}

/// The f32 contract's sum `t = te + to` of four lanes: `w` from [`decode_f32`], `x` the lanes' first input value
/// (code 0) in the permuted input, code `s` at `x[16 s ..]`.
#[inline(always)]
fn f32_lanes(w: &[float32x4_t; 8], x: &[f32]) -> float32x4_t {
    let x = &x[..7 * 16 + 4];
    // SAFETY: the loads read within `x` (checked above); NEON is baseline.
    unsafe {
        let xv = |s: usize| vld1q_f32(x.as_ptr().add(16 * s));
        let mut te = vmulq_f32(w[0], xv(0));
        let mut to = vmulq_f32(w[1], xv(1));
        te = vfmaq_f32(te, w[2], xv(2));
        to = vfmaq_f32(to, w[3], xv(3));
        te = vfmaq_f32(te, w[4], xv(4));
        to = vfmaq_f32(to, w[5], xv(5));
        te = vfmaq_f32(te, w[6], xv(6));
        to = vfmaq_f32(to, w[7], xv(7));
        vaddq_f32(te, to)
    }
}

/// The byte table of [`decode_f32`].
#[inline(always)]
fn e2m1_table() -> uint8x16x2_t {
    // SAFETY: the constant holds 32 bytes; NEON is baseline.
    unsafe {
        uint8x16x2_t(
            vld1q_u8(E2M1_HIGH_BYTES.as_ptr()),
            vld1q_u8(E2M1_HIGH_BYTES.as_ptr().add(16)),
        )
    }
}

/// NEON twin of [`crate::mxfp4_contract::dot_row_ref`] for `R` neighbouring rows (each one row's `packed` and
/// `scales`) against one permuted input `xp` (whole chunks; a shorter row reads as zero past its end).
pub fn mxfp4_dot_rows<const R: usize>(rows: [(&[u8], &[u8]); R], xp: &[f32]) -> [f32; R] {
    let table = e2m1_table();
    let out = mxfp4_rows::<_, R, 1>(
        rows,
        xp.len() / CHUNK,
        |words| decode_f32(words, table),
        |w, _, c, v| f32_lanes(w, &xp[c * CHUNK + 4 * v..]),
    );
    out.map(|o| o[0])
}

/// One MXFP4 row against rows of the permuted input, each bit-identical to
/// [`crate::mxfp4_contract::dot_row_ref`]: `out[t] = row · x_t`, where `x_t` is `xps[t * xp_len ..][.. xp_len]`.
/// Each chunk is decoded once for up to four inputs.
pub fn mxfp4_row_multi(packed: &[u8], scales: &[u8], xps: &[f32], xp_len: usize, out: &mut [f32]) {
    let table = e2m1_table();
    let n_chunks = xp_len / CHUNK;
    let inputs = xps.len() / xp_len.max(1);
    for (o, t0) in out.chunks_mut(4).zip((0..).step_by(4)) {
        let x = |t: usize| &xps[(t0 + t) * xp_len..];
        let decode = |words| decode_f32(words, table);
        if o.len() == 4 && inputs >= t0 + 4 {
            let sum = |w: &_, t, c, v| f32_lanes(w, &x(t)[c * CHUNK + 4 * v..]);
            let [y] = mxfp4_rows::<_, 1, 4>([(packed, scales)], n_chunks, decode, sum);
            o.copy_from_slice(&y);
        } else {
            for (i, y) in o.iter_mut().enumerate().take(inputs.saturating_sub(t0)) {
                let sum = |w: &_, _, c, v| f32_lanes(w, &x(i)[c * CHUNK + 4 * v..]);
                *y = mxfp4_rows::<_, 1, 1>([(packed, scales)], n_chunks, decode, sum)[0][0];
            }
        }
    }
}

/// The int16-input contract's four weight vectors of four lanes: vector `j` holds, in the low and the high 16-bit
/// word of each lane, twice the E2M1 value of the lane word's nibbles `j` and `j + 4` (as int16), to multiply the
/// input pair `(q[8k + j], q[8k + j + 4])`. Two byte lookups replace the low and the high nibble of every byte by its
/// signed value; each 16-bit word's two bytes are then brought down with their sign by shifts.
#[inline(always)]
fn decode_i16(words: uint32x4_t, table: int8x16_t) -> [int16x8_t; 4] {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let bytes = vreinterpretq_u8_u32(words);
        let low = vreinterpretq_s16_s8(vqtbl1q_s8(table, vandq_u8(bytes, vdupq_n_u8(15))));
        let high = vreinterpretq_s16_s8(vqtbl1q_s8(table, vshrq_n_u8::<4>(bytes)));
        let low_byte = |v: int16x8_t| vshrq_n_s16::<8>(vshlq_n_s16::<8>(v));
        let high_byte = |v: int16x8_t| vshrq_n_s16::<8>(v);
        [
            low_byte(low),
            low_byte(high),
            high_byte(low),
            high_byte(high),
        ]
    }
}

/// The int16-input contract's `u = f32(t) · m` of four lanes: `w` from [`decode_i16`], `x` the chunk's words (the
/// 64 pair words, then the 16 multipliers), `v` the lane quarter. The pair products are summed exactly in 32-bit
/// lanes (`smlal` on both halves, then a pairwise add).
#[inline(always)]
fn i16_lanes(w: &[int16x8_t; 4], x: &[u32], v: usize) -> float32x4_t {
    use crate::mxfp4_contract::CHUNK_LANES;
    use crate::mxfp4_i16_contract::{CHUNK_WORDS, PAIR_WORDS};
    let x = &x[..CHUNK_WORDS];
    // SAFETY: every load reads 4 words at `4v + 16j` (j < 4) or `64 + 4v`, within the chunk checked above.
    unsafe {
        let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
        for (j, wj) in w.iter().enumerate() {
            let xj = vld1q_s16(x.as_ptr().add(j * CHUNK_LANES + 4 * v).cast::<i16>());
            lo = vmlal_s16(lo, vget_low_s16(*wj), vget_low_s16(xj));
            hi = vmlal_high_s16(hi, *wj, xj);
        }
        let t = vpaddq_s32(lo, hi);
        let m = vld1q_f32(x.as_ptr().add(PAIR_WORDS + 4 * v).cast::<f32>());
        vmulq_f32(vcvtq_f32_s32(t), m)
    }
}

/// The byte table of [`decode_i16`].
#[inline(always)]
fn e2m1_doubled_table() -> int8x16_t {
    const BYTES: [i8; 16] = {
        let mut bytes = [0i8; 16];
        let mut i = 0;
        while i < 16 {
            bytes[i] = crate::mxfp4_i16_contract::E2M1_DOUBLED[i] as i8;
            i += 1;
        }
        bytes
    };
    // SAFETY: the constant holds 16 bytes; NEON is baseline.
    unsafe { vld1q_s8(BYTES.as_ptr()) }
}

/// NEON twin of [`crate::mxfp4_i16_contract::dot_row_ref`] for `R` neighbouring rows against one quantised input
/// `xq` (whole chunks of 80 words).
pub fn mxfp4_i16_dot_rows<const R: usize>(rows: [(&[u8], &[u8]); R], xq: &[u32]) -> [f32; R] {
    use crate::mxfp4_i16_contract::CHUNK_WORDS;
    let table = e2m1_doubled_table();
    let out = mxfp4_rows::<_, R, 1>(
        rows,
        xq.len() / CHUNK_WORDS,
        |words| decode_i16(words, table),
        |w, _, c, v| i16_lanes(w, &xq[c * CHUNK_WORDS..], v),
    );
    out.map(|o| o[0])
}

/// One MXFP4 row against rows of the quantised input, each bit-identical to
/// [`crate::mxfp4_i16_contract::dot_row_ref`]: `out[t] = row · x_t`, where `x_t` is `xqs[t * xq_len ..][.. xq_len]`.
/// Each chunk is decoded once for up to four inputs.
pub fn mxfp4_i16_row_multi(
    packed: &[u8],
    scales: &[u8],
    xqs: &[u32],
    xq_len: usize,
    out: &mut [f32],
) {
    use crate::mxfp4_i16_contract::CHUNK_WORDS;
    let table = e2m1_doubled_table();
    let n_chunks = xq_len / CHUNK_WORDS;
    let inputs = xqs.len() / xq_len.max(1);
    for (o, t0) in out.chunks_mut(4).zip((0..).step_by(4)) {
        let x = |t: usize| &xqs[(t0 + t) * xq_len..];
        let decode = |words| decode_i16(words, table);
        if o.len() == 4 && inputs >= t0 + 4 {
            let sum = |w: &_, t, c, v| i16_lanes(w, &x(t)[c * CHUNK_WORDS..], v);
            let [y] = mxfp4_rows::<_, 1, 4>([(packed, scales)], n_chunks, decode, sum);
            o.copy_from_slice(&y);
        } else {
            for (i, y) in o.iter_mut().enumerate().take(inputs.saturating_sub(t0)) {
                let sum = |w: &_, _, c, v| i16_lanes(w, &x(i)[c * CHUNK_WORDS..], v);
                *y = mxfp4_rows::<_, 1, 1>([(packed, scales)], n_chunks, decode, sum)[0][0];
            }
        }
    }
}

/// NEON twin of [`crate::quantise::abs_max_ref`]: sixteen values a step in four vectors, the rest by the reference.
pub fn abs_max(x: &[f32]) -> Option<f32> {
    let blocks = x.chunks_exact(16);
    let rest = crate::quantise::abs_max_ref(blocks.remainder())?;
    // SAFETY: NEON is part of the aarch64 baseline; each load reads 4 of the block's 16 values.
    unsafe {
        let inf = vdupq_n_f32(f32::INFINITY);
        let mut amax = [zero(); 4];
        let mut finite = vdupq_n_u32(u32::MAX);
        for b in blocks {
            for (k, m) in amax.iter_mut().enumerate() {
                let a = vabsq_f32(vld1q_f32(b.as_ptr().add(4 * k)));
                // NaN compares false, so "less than infinity" is false for NaN and both infinities.
                finite = vandq_u32(finite, vcltq_f32(a, inf));
                *m = vmaxq_f32(*m, a);
            }
        }
        if vminvq_u32(finite) == 0 {
            return None;
        }
        let m = vmaxq_f32(vmaxq_f32(amax[0], amax[1]), vmaxq_f32(amax[2], amax[3]));
        Some(rest.max(vmaxvq_f32(m)))
    }
}

/// NEON twin of [`crate::quantise::quantise_ref`]: eight values a step (`frinta` rounds to nearest with ties away
/// from zero, as `f32::round`), the rest by the reference. Values past `q.len()` are not written.
pub fn quantise(x: &[f32], step: f32, q: &mut [i16]) {
    let n = x.len().min(q.len());
    let whole = n / 8 * 8;
    // SAFETY: NEON is part of the aarch64 baseline; the loads and the store touch values at .. at + 8 of `x` and
    // `q`, within `whole <= n`.
    unsafe {
        let steps = vdupq_n_f32(step);
        let (lo, hi) = (
            vdupq_n_f32(-crate::quantise::Q_MAX),
            vdupq_n_f32(crate::quantise::Q_MAX),
        );
        let one = |p: *const f32| {
            let r = vrndaq_f32(vdivq_f32(vld1q_f32(p), steps));
            // Within ±32767 after the clamp, so the conversion and the narrowing are exact.
            vmovn_s32(vcvtq_s32_f32(vminq_f32(vmaxq_f32(r, lo), hi)))
        };
        for at in (0..whole).step_by(8) {
            let p = x.as_ptr().add(at);
            vst1q_s16(q.as_mut_ptr().add(at), vcombine_s16(one(p), one(p.add(4))));
        }
    }
    crate::quantise::quantise_ref(&x[whole..n], step, &mut q[whole..n]);
}
