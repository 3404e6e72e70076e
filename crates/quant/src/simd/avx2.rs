//! AVX2/FMA kernels (x86-64-v3). Each follows its scalar twin's contract exactly: [`crate::dot`] for f32 and bf16
//! rows, [`crate::int8_contract`] for int8 rows, [`crate::mxfp4_contract`], [`crate::mxfp4_bf16_contract`] and
//! [`crate::mxfp4_i16_contract`] for MXFP4 rows, [`crate::quantise`] for the int16 quantisation. The dense and int8 kernels take two neighbouring rows
//! per call and, like the AVX-512 ones, prefetch the weights ahead as one stream in address order.

use std::arch::x86_64::*;

use crate::dot::{BLOCK, LANES};
use crate::int8_contract::SEGMENT_STEPS;
use crate::simd::avx512::PREFETCH_BYTES;

/// Reduces four accumulators in the contract's order.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn reduce(a0: __m256, a1: __m256, a2: __m256, a3: __m256) -> f32 {
    let v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    // lanes l and l+4
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    // lanes l and l+2
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    // lane 0 + lane 1
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// Prefetches the cache lines `distance` bytes ahead of the `len` bytes at `p`, a streaming kernel's weights (a
/// hint: it never faults, even past the weights): [`PREFETCH_BYTES`] for dense rows,
/// [`MXFP4_PREFETCH_BYTES`](crate::simd::avx512::MXFP4_PREFETCH_BYTES) for MXFP4 ones. The AVX-512 kernels read the
/// same way; without a software prefetch the hardware prefetchers keep too few lines in flight on this project's
/// machine (`docs/performance-log.md`).
#[inline(always)]
fn prefetch_ahead<T>(p: *const T, len: usize, distance: usize) {
    super::prefetch_ahead::<_MM_HINT_T0, T>(p, len, distance)
}

/// `R` neighbouring rows of the dot contract ([`crate::dot`]) against one input, sharing its loads: the whole
/// blocks of 32 into four 8-lane accumulators a row, then each row's zero-padded tail into its accumulator 0 and the
/// contract's reduction. The rows are prefetched as one stream in address order (row `r + 1` starts where row `r`
/// ends), as the AVX-512 kernels do.
///
/// # Safety
/// The CPU must support AVX2 and FMA; every row is as long as `x`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_rows<const R: usize>(rows: [&[f32]; R], x: &[f32]) -> [f32; R] {
    let n = rows.iter().fold(x.len(), |n, w| n.min(w.len()));
    let full = n / BLOCK * BLOCK;
    let (p0, xp) = (rows[0].as_ptr(), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut b = 0;
    while b < full {
        prefetch_ahead(
            p0.wrapping_add(R * b),
            R * BLOCK * size_of::<f32>(),
            PREFETCH_BYTES,
        );
        for k in 0..4 {
            // SAFETY: b + 32 <= full <= n for the input and every row.
            unsafe {
                let xv = _mm256_loadu_ps(xp.add(b + 8 * k));
                for (a, w) in acc.iter_mut().zip(&rows) {
                    a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(w.as_ptr().add(b + 8 * k)), xv, a[k]);
                }
            }
        }
        b += BLOCK;
    }
    let mut out = [0.0f32; R];
    for ((o, a), w) in out.iter_mut().zip(acc).zip(&rows) {
        *o = finish(a, w, x, full);
    }
    out
}

/// The end of one product of the dot contract whose whole blocks (`..full`) are in `acc`: the zero-padded tail in
/// chunks of 8 into accumulator 0, then the reduction.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn finish([mut a0, a1, a2, a3]: F32Acc, w: &[f32], x: &[f32], full: usize) -> f32 {
    let n = w.len().min(x.len());
    let mut c = full;
    while c < n {
        let mut wb = [0.0f32; LANES];
        let mut xb = [0.0f32; LANES];
        let k = LANES.min(n - c);
        wb[..k].copy_from_slice(&w[c..c + k]);
        xb[..k].copy_from_slice(&x[c..c + k]);
        // SAFETY: both buffers hold 8 f32.
        unsafe {
            a0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(wb.as_ptr()),
                _mm256_loadu_ps(xb.as_ptr()),
                a0,
            );
        }
        c += LANES;
    }
    reduce(a0, a1, a2, a3)
}

/// One product's four 8-lane accumulators of the dot contract ([`crate::dot`]).
pub type F32Acc = [__m256; 4];

/// One product's result from its accumulators after [`dot_f32_tile`] over every whole block: the tail, then the
/// reduction (bit-identical to [`crate::dot::dot_f32_ref`]).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_finish(acc: &F32Acc, w: &[f32], x: &[f32]) -> f32 {
    let full = w.len().min(x.len()) / BLOCK * BLOCK;
    finish(*acc, w, x, full)
}

/// Values `b0 .. b1` (whole blocks of 32) of `R` rows by `T` inputs of the dot contract (multi-token products). The
/// contract keeps four 8-lane accumulators a product, the `k`-th taking the `k`-th 8 values of every block of 32;
/// each is its own chain over the blocks in order, so they are run one after the other: per accumulator, a tile of
/// `R · T` products (twelve registers at 3 × 4) loads each row's 8 values once for all inputs and each input's once
/// for all rows (seven loads a dozen FMAs; all four at once would need 48 registers). Product `(r, t)`'s
/// accumulators are `acc[r · stride + t]`, read at the start and written back at the end, so a caller can walk the
/// values in blocks that stay in L1.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `b0` and `b1` are multiples of 32 within every row and input; `acc` holds the
/// products `r · stride + t` for `r < R`, `t < T`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_tile<const R: usize, const T: usize>(
    rows: [&[f32]; R],
    xs: [&[f32]; T],
    (b0, b1): (usize, usize),
    acc: &mut [F32Acc],
    stride: usize,
) {
    // Accumulator `k` takes the values at `8 k` within every block.
    for (k, offset) in [0usize, 8, 16, 24].into_iter().enumerate() {
        let mut a: [[__m256; T]; R] =
            std::array::from_fn(|r| std::array::from_fn(|t| acc[r * stride + t][k]));
        let mut b = b0 + offset;
        while b < b1 {
            // SAFETY: b + 8 <= b1, within every row and input (caller).
            unsafe {
                let wv: [__m256; R] =
                    std::array::from_fn(|r| _mm256_loadu_ps(rows[r].as_ptr().add(b)));
                for (t, x) in xs.iter().enumerate() {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(b));
                    for (ar, w) in a.iter_mut().zip(&wv) {
                        ar[t] = _mm256_fmadd_ps(*w, xv, ar[t]);
                    }
                }
            }
            b += BLOCK;
        }
        for (r, ar) in a.iter().enumerate() {
            for (t, v) in ar.iter().enumerate() {
                acc[r * stride + t][k] = *v;
            }
        }
    }
}

/// AVX2 twin of [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    // SAFETY: forwarded from the caller; one row.
    unsafe { dense_rows([w], x)[0] }
}

/// Two neighbouring f32 rows against one input, each bit-identical to [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX2 and FMA; `w0.len() == w1.len() == x.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_x2(w0: &[f32], w1: &[f32], x: &[f32]) -> [f32; 2] {
    // SAFETY: forwarded from the caller.
    unsafe { dense_rows([w0, w1], x) }
}

/// `R` bf16 rows of equal length against one permuted input ([`crate::bf16_contract`]), sharing its loads: each
/// chunk of 32 weights is two 32-byte loads a row, each widened to exact f32 by a shift (even weights) and a mask
/// (odd weights); the contract's 16-lane accumulators are two 8-lane halves here. The rows' lines are prefetched as
/// `how` says, as the AVX-512 kernel does ([`crate::bf16_contract::prefetch`]; a span's prefetch needs neighbouring
/// rows: row `r + 1` starts where row `r` ends).
///
/// # Safety
/// The CPU must support AVX2 and FMA; every row has the same length `n`, and `xp` holds at least
/// `bf16_contract::padded_len(n)` values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn bf16_rows<const R: usize>(
    rows: [&[u16]; R],
    xp: &[f32],
    how: crate::bf16_contract::Prefetch,
) -> [f32; R] {
    use crate::bf16_contract::{CHUNK, Prefetch};
    let n = rows[0].len();
    let whole = n / CHUNK;
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let z = _mm256_setzero_ps();
    // Per row: even lanes 0..8, even lanes 8..16, odd lanes 0..8, odd lanes 8..16.
    let mut acc = [[z; 4]; R];
    // Chunk `c` of the rows, 32 weights at each `p[r]`.
    let mut step = |c: usize, p: [*const u16; R]| {
        // SAFETY (caller): chunk c of the permuted input lies in `xp`.
        let x: [__m256; 4] =
            std::array::from_fn(|k| unsafe { _mm256_loadu_ps(xp.as_ptr().add(c * CHUNK + 8 * k)) });
        for (a, p) in acc.iter_mut().zip(p) {
            for half in 0..2 {
                // SAFETY (caller): 16 weights (32 bytes) at `p + 16 · half`.
                let v = unsafe { _mm256_loadu_si256(p.add(16 * half) as *const __m256i) };
                let e = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                let o = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                a[half] = _mm256_fmadd_ps(e, x[half], a[half]);
                a[2 + half] = _mm256_fmadd_ps(o, x[2 + half], a[2 + half]);
            }
        }
    };
    for c in 0..whole {
        match how {
            Prefetch::Off => {}
            Prefetch::PerRow(ahead) => {
                for w in &rows {
                    prefetch_ahead(
                        w.as_ptr().wrapping_add(c * CHUNK),
                        CHUNK * size_of::<u16>(),
                        ahead,
                    );
                }
            }
            // Read once: the non-temporal hint, as the AVX-512 kernel's span (`prefetch_once` there).
            Prefetch::Span(ahead) => super::prefetch_ahead::<_MM_HINT_NTA, u16>(
                rows[0].as_ptr().wrapping_add(R * c * CHUNK),
                R * CHUNK * size_of::<u16>(),
                ahead,
            ),
        }
        // Chunk c < whole lies whole in every row.
        step(c, rows.map(|w| w[c * CHUNK..].as_ptr()));
    }
    if whole * CHUNK < n {
        // The last chunk zero-padded, as the contract reads it.
        let padded: [[u16; CHUNK]; R] = std::array::from_fn(|r| {
            let mut chunk = [0u16; CHUNK];
            chunk[..n - whole * CHUNK].copy_from_slice(&rows[r][whole * CHUNK..]);
            chunk
        });
        step(whole, std::array::from_fn(|r| padded[r].as_ptr()));
    }
    acc.map(|[e_lo, e_hi, o_lo, o_hi]| {
        // v[l] = even[l] + odd[l]; then lanes l and l + 8, l + 4, l + 2, 1.
        let v8 = _mm256_add_ps(_mm256_add_ps(e_lo, o_lo), _mm256_add_ps(e_hi, o_hi));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    })
}

/// `R` neighbouring int8 rows against one quantised input: [`int8_tile`] with one input, whose loads the rows share.
///
/// # Safety
/// As [`int8_tile`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn int8_rows<const R: usize>(rows: [&[i8]; R], xq: &[i16]) -> [i64; R] {
    // SAFETY: forwarded from the caller.
    unsafe { int8_tile(rows, [xq]) }.map(|[sum]| sum)
}

/// `R` neighbouring int8 rows against `T` quantised inputs ([`crate::int8_contract`]): per 32 columns and row, two
/// sign extensions to int16, then per input two `vpmaddwd` (each adds two products to every 32-bit lane), widened
/// to 64 bits every [`SEGMENT_STEPS`] of those steps. Each row's 32 weights are widened once for every input, and
/// the rows are prefetched as one stream in address order, as the AVX-512 kernels do. The sums are exact integers,
/// so their order is free and every result equals [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// The CPU must support AVX2; every row has the same length `n`, and every input holds at least `n` values rounded up
/// to a multiple of 32.
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn int8_tile<const R: usize, const T: usize>(
    rows: [&[i8]; R],
    xs: [&[i16]; T],
) -> [[i64; T]; R] {
    let n = rows.iter().fold(usize::MAX, |n, q| n.min(q.len()));
    let full = n / 32 * 32;
    let p0 = rows[0].as_ptr();
    let mut wide = [[_mm256_setzero_si256(); T]; R];
    // Adds one segment's 32-bit lanes into the 64-bit sums.
    let widen = |wide: &mut [[__m256i; T]; R], acc: [[__m256i; T]; R]| {
        for (wd, a) in wide.iter_mut().flatten().zip(acc.iter().flatten()) {
            let lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(*a));
            let hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256::<1>(*a));
            *wd = _mm256_add_epi64(*wd, _mm256_add_epi64(lo, hi));
        }
    };
    // One block of 32 columns from column `c` of every row and input: `w(row)` gives the row's 32 weights.
    let block = |acc: &mut [[__m256i; T]; R], c: usize, w: &dyn Fn(usize) -> [__m128i; 2]| {
        let w: [[__m256i; 2]; R] =
            std::array::from_fn(|r| w(r).map(|half| _mm256_cvtepi8_epi16(half)));
        for (t, x) in xs.iter().enumerate() {
            // SAFETY: the caller pads every input to a multiple of 32 past n, and c < n.
            let x = unsafe {
                [
                    _mm256_loadu_si256(x.as_ptr().add(c) as *const __m256i),
                    _mm256_loadu_si256(x.as_ptr().add(c + 16) as *const __m256i),
                ]
            };
            for (a, w) in acc.iter_mut().zip(&w) {
                let p0 = _mm256_madd_epi16(w[0], x[0]);
                let p1 = _mm256_madd_epi16(w[1], x[1]);
                a[t] = _mm256_add_epi32(a[t], _mm256_add_epi32(p0, p1));
            }
        }
    };
    let mut c = 0;
    while c < full {
        // Two steps per block of 32 columns.
        let end = full.min(c + 32 * (SEGMENT_STEPS / 2));
        let mut acc = [[_mm256_setzero_si256(); T]; R];
        while c < end {
            prefetch_ahead(p0.wrapping_add(R * c), R * 32, PREFETCH_BYTES);
            block(&mut acc, c, &|r| {
                // SAFETY: c + 32 <= full <= n for every row.
                unsafe {
                    let q = rows[r].as_ptr().add(c);
                    [
                        _mm_loadu_si128(q as *const __m128i),
                        _mm_loadu_si128(q.add(16) as *const __m128i),
                    ]
                }
            });
            c += 32;
        }
        widen(&mut wide, acc);
    }
    if full < n {
        // The partial last block, zero-padded (the inputs are zero past n).
        let mut acc = [[_mm256_setzero_si256(); T]; R];
        block(&mut acc, full, &|r| {
            let mut tail = [0i8; 32];
            tail[..n - full].copy_from_slice(&rows[r][full..n]);
            // SAFETY: `tail` holds 32 bytes.
            unsafe {
                [
                    _mm_loadu_si128(tail.as_ptr() as *const __m128i),
                    _mm_loadu_si128(tail.as_ptr().add(16) as *const __m128i),
                ]
            }
        });
        widen(&mut wide, acc);
    }
    wide.map(|row| {
        row.map(|wd| {
            let mut lanes = [0i64; 4];
            // SAFETY: `lanes` holds 32 bytes.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, wd) };
            lanes.iter().sum()
        })
    })
}

/// AVX2 twin of [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// As `int8_rows` with one row.
#[target_feature(enable = "avx2")]
pub unsafe fn int8_dot(q: &[i8], xq: &[i16]) -> i64 {
    // SAFETY: forwarded from the caller.
    unsafe { int8_rows([q], xq)[0] }
}

/// Two neighbouring int8 rows against one quantised input, each equal to [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// As `int8_rows` with two rows.
#[target_feature(enable = "avx2")]
pub unsafe fn int8_dot_x2(q0: &[i8], q1: &[i8], xq: &[i16]) -> [i64; 2] {
    // SAFETY: forwarded from the caller.
    unsafe { int8_rows([q0, q1], xq) }
}

/// AVX2 twin of [`crate::mxfp4_contract::dot_row_ref`]: the contract's sixteen lanes as two 8-lane halves, each
/// half's 64 weights decoded by byte lookups (`decode_half_chunk`), the row prefetched ahead
/// (`prefetch_chunk_ahead`). One row at a time: two rows sharing the input's loads need more than AVX2's sixteen vector registers, and ran slower.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `xp.len() == chunks(cols) * 128` and `packed`, `scales` are one row's
/// bytes (no scale byte 255).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_dot(packed: &[u8], scales: &[u8], xp: &[f32]) -> f32 {
    use crate::mxfp4_contract::{CHUNK, CHUNK_LANES};
    let tables = E2m1Bytes::new();
    // acc[c % 2][half]
    let mut acc = [[_mm256_setzero_ps(); 2]; 2];
    for c in 0..xp.len() / CHUNK {
        prefetch_chunk_ahead(packed, c);
        for (half, a) in acc[c % 2].iter_mut().enumerate() {
            let w = half_chunk_weights(&tables, packed, c, half);
            // SAFETY: chunk c of `xp` is whole; lanes 8·half .. 8·half + 8 of each code vector.
            let x = |s: usize| unsafe {
                _mm256_loadu_ps(xp.as_ptr().add(c * CHUNK + s * CHUNK_LANES + 8 * half))
            };
            let mut te = _mm256_mul_ps(w[0], x(0));
            let mut to = _mm256_mul_ps(w[1], x(1));
            te = _mm256_fmadd_ps(w[2], x(2), te);
            to = _mm256_fmadd_ps(w[3], x(3), to);
            te = _mm256_fmadd_ps(w[4], x(4), te);
            to = _mm256_fmadd_ps(w[5], x(5), to);
            te = _mm256_fmadd_ps(w[6], x(6), te);
            to = _mm256_fmadd_ps(w[7], x(7), to);
            let scale = half_chunk_scales(scales, c, half);
            *a = _mm256_fmadd_ps(_mm256_add_ps(te, to), scale, *a);
        }
    }
    reduce16(acc)
}

/// AVX2 twin of [`crate::mxfp4_bf16_contract::dot_row_ref`]: the contract's sixteen lanes as two 8-lane halves, the
/// weights decoded by byte lookups (`decode_half_chunk`), each pair's two bf16 inputs widened to exact f32 by a
/// shift (low half) and a mask (high half), and the lane's chain of eight FMAs run in the contract's order. With
/// `FLUSH` every input and every partial sum that is denormal becomes a zero of its sign, as the contract (after
/// `vdpbf16ps`) says; without it the caller has checked [`flush_free`](crate::mxfp4_bf16_contract::flush_free) on the
/// input, under which no flush can change a value.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `xb.len() == chunks(cols) * 64` and `packed`, `scales` are one row's bytes (no
/// scale byte 255).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_bf16_dot<const FLUSH: bool>(packed: &[u8], scales: &[u8], xb: &[u32]) -> f32 {
    use crate::mxfp4_bf16_contract::{CHUNK_WORDS, PAIRS};
    use crate::mxfp4_contract::CHUNK_LANES;
    let tables = E2m1Bytes::new();
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    let min_normal = _mm256_set1_epi32(f32::MIN_POSITIVE.to_bits() as i32);
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    // A denormal to a zero of its sign (only with `FLUSH`).
    let flush = |v: __m256| {
        if !FLUSH {
            return v;
        }
        let bits = _mm256_castps_si256(v);
        let tiny = _mm256_cmpgt_epi32(min_normal, _mm256_and_si256(bits, magnitude));
        _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(tiny, magnitude), bits))
    };
    // acc[c % 2][half]
    let mut acc = [[_mm256_setzero_ps(); 2]; 2];
    for c in 0..xb.len() / CHUNK_WORDS {
        prefetch_chunk_ahead(packed, c);
        for (half, a) in acc[c % 2].iter_mut().enumerate() {
            let w = half_chunk_weights(&tables, packed, c, half);
            let mut t = _mm256_setzero_ps();
            for j in 0..PAIRS {
                // SAFETY: chunk c of `xb` is whole; lanes 8·half .. 8·half + 8 of pair j.
                let pair = unsafe {
                    _mm256_loadu_si256(
                        xb.as_ptr()
                            .add(c * CHUNK_WORDS + j * CHUNK_LANES + 8 * half)
                            as *const __m256i,
                    )
                };
                let x_low = flush(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(pair)));
                let x_high = flush(_mm256_castsi256_ps(_mm256_and_si256(pair, high)));
                t = flush(_mm256_fmadd_ps(w[j + 4], x_high, t));
                t = flush(_mm256_fmadd_ps(w[j], x_low, t));
            }
            let scale = half_chunk_scales(scales, c, half);
            *a = _mm256_fmadd_ps(t, scale, *a);
        }
    }
    reduce16(acc)
}

/// [`mxfp4_bf16_dot`] for two rows against one input.
///
/// # Safety
/// As [`mxfp4_bf16_dot`], for both rows.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_bf16_dot_pair<const FLUSH: bool>(
    rows: [(&[u8], &[u8]); 2],
    xb: &[u32],
) -> [f32; 2] {
    // SAFETY: forwarded from the caller.
    rows.map(|(packed, scales)| unsafe { mxfp4_bf16_dot::<FLUSH>(packed, scales, xb) })
}

/// [`mxfp4_bf16_dot`] of one row against several inputs: `out[t] = row · x_t`, where `x_t` is `xbs[t * xb_len ..][..
/// xb_len]`.
///
/// # Safety
/// As [`mxfp4_bf16_dot`] for every input; `xbs.len() >= out.len() * xb_len`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_bf16_row_multi<const FLUSH: bool>(
    packed: &[u8],
    scales: &[u8],
    xbs: &[u32],
    xb_len: usize,
    out: &mut [f32],
) {
    for (o, xb) in out.iter_mut().zip(xbs.chunks_exact(xb_len.max(1))) {
        // SAFETY: forwarded from the caller, one input of `xb_len` words.
        *o = unsafe { mxfp4_bf16_dot::<FLUSH>(packed, scales, xb) };
    }
}

/// Prefetches the line [`MXFP4_PREFETCH_BYTES`](crate::simd::avx512::MXFP4_PREFETCH_BYTES) past chunk `c` of a row's
/// codes, as the AVX-512 kernels do (a hint: it never faults, even past the row).
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_chunk_ahead(packed: &[u8], c: usize) {
    use crate::mxfp4_contract::CHUNK_BYTES;
    prefetch_ahead(
        packed.as_ptr().wrapping_add(c * CHUNK_BYTES),
        CHUNK_BYTES,
        crate::simd::avx512::MXFP4_PREFETCH_BYTES,
    );
}

/// The exact weights of half `half` of chunk `c` of a row ([`decode_half_chunk`]; zero past the row's end).
#[inline]
#[target_feature(enable = "avx2")]
fn half_chunk_weights(t: &E2m1Bytes, packed: &[u8], c: usize, half: usize) -> [__m256; 8] {
    // SAFETY: AVX2 present; the half chunk is read within `packed` or zero-padded.
    decode_half_chunk(t, unsafe { half_chunk_codes(packed, c, half) })
}

/// The top two bytes of the f32 value of every E2M1 code, as byte tables for [`decode_half_chunk`]: every E2M1
/// value is a bf16, so its f32 has zeros in the low two bytes.
pub(crate) struct E2m1Bytes {
    /// Byte 3 (sign and high exponent bits) of the f32 of code `n` at byte `n` of each 128-bit half.
    high: __m256i,
    /// Byte 2 (low exponent bit and mantissa) likewise.
    low: __m256i,
}

impl E2m1Bytes {
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn new() -> Self {
        const fn table(byte: u32) -> [u8; 32] {
            let mut t = [0u8; 32];
            let mut i = 0;
            while i < 32 {
                t[i] = (crate::mxfp4::E2M1_TABLE[i % 16].to_bits() >> (8 * byte)) as u8;
                i += 1;
            }
            t
        }
        const HIGH: [u8; 32] = table(3);
        const LOW: [u8; 32] = table(2);
        // SAFETY: both tables hold 32 bytes.
        unsafe {
            Self {
                high: _mm256_loadu_si256(HIGH.as_ptr() as *const __m256i),
                low: _mm256_loadu_si256(LOW.as_ptr() as *const __m256i),
            }
        }
    }
}

/// The exact f32 weights `w[s]` (code `s` of each of the eight 32-bit lanes, lane order kept) of a half chunk's 32
/// code bytes. AVX2 has no 16-entry permute of 32-bit values, and its 8-entry one (`vpermps`) costs a Zen 3 core
/// more than a cycle, so the codes go through byte lookups instead, a few cheap shuffles for 64 weights:
/// - a byte shuffle orders each 128-bit half's bytes as lane 0's bytes 0, 1, lane 1's bytes 0, 1, …, then the lanes'
///   bytes 2, 3 likewise; the low nibbles of that vector are the even codes, the high nibbles the odd ones;
/// - each nibble vector is looked up in the two byte tables ([`E2m1Bytes`]), and interleaving the two results gives
///   16-bit words, the top halves of the weights' f32 values: in the 32-bit lane of contract lane `k`, codes 0 and 2
///   (then 4 and 6; odd codes alike) as its low and high word;
/// - a low word shifted up, or a high word with the low word cleared, is the weight.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn decode_half_chunk(t: &E2m1Bytes, codes: __m256i) -> [__m256; 8] {
    let order = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
        10, 11, 14, 15,
    );
    let nibble = _mm256_set1_epi8(0x0f);
    let bytes = _mm256_shuffle_epi8(codes, order);
    let even = _mm256_and_si256(bytes, nibble);
    let odd = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble);
    let words = |n: __m256i| {
        let (high, low) = (
            _mm256_shuffle_epi8(t.high, n),
            _mm256_shuffle_epi8(t.low, n),
        );
        (
            _mm256_unpacklo_epi8(low, high),
            _mm256_unpackhi_epi8(low, high),
        )
    };
    let ((e02, e46), (o13, o57)) = (words(even), words(odd));
    let low_word = |w: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
    let high_word =
        |w: __m256i| _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
    [
        low_word(e02),
        low_word(o13),
        high_word(e02),
        high_word(o13),
        low_word(e46),
        low_word(o57),
        high_word(e46),
        high_word(o57),
    ]
}

/// The MXFP4 contracts' reduction ([`crate::mxfp4_contract::reduce16`]) of `acc[c % 2][half]`, the sixteen lanes of
/// each accumulator as two 8-lane halves.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce16(acc: [[__m256; 2]; 2]) -> f32 {
    // v[k] = acc0[k] + acc1[k]; then lanes k and k + 8 (the two halves), k + 4, k + 2, k + 1.
    let v8 = _mm256_add_ps(
        _mm256_add_ps(acc[0][0], acc[1][0]),
        _mm256_add_ps(acc[0][1], acc[1][1]),
    );
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)))
}

/// The 32 code bytes of half `half` of chunk `c` of a row (zero past its end).
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_chunk_codes(packed: &[u8], c: usize, half: usize) -> __m256i {
    use crate::mxfp4_contract::CHUNK_BYTES;
    let at = c * CHUNK_BYTES + 32 * half;
    if at + 32 <= packed.len() {
        // SAFETY: 32 bytes from `at` lie in `packed`.
        return unsafe { _mm256_loadu_si256(packed.as_ptr().add(at) as *const __m256i) };
    }
    let mut buf = [0u8; 32];
    let have = packed.len().saturating_sub(at).min(32);
    if have > 0 {
        buf[..have].copy_from_slice(&packed[at..at + have]);
    }
    // SAFETY: `buf` holds 32 bytes.
    unsafe { _mm256_loadu_si256(buf.as_ptr() as *const __m256i) }
}

/// The multipliers of half `half` of chunk `c`: lanes 0..4 use group `4c + 2·half`, lanes 4..8 the next.
#[inline]
#[target_feature(enable = "avx2")]
fn half_chunk_scales(scales: &[u8], c: usize, half: usize) -> __m256 {
    use crate::mxfp4_contract::{GROUPS_PER_CHUNK, group_scale};
    let g = c * GROUPS_PER_CHUNK + 2 * half;
    _mm256_set_m128(
        _mm_set1_ps(group_scale(scales, g + 1)),
        _mm_set1_ps(group_scale(scales, g)),
    )
}

/// The pair contract's four weight vectors of one half chunk: vector `j` holds, in every 16-bit word of `codes`
/// (the low word of a lane holds its codes 0..4, the high word codes 4..8), twice the E2M1 value of the word's nibble
/// `j`, as int16. Two byte shuffles replace the low and the high nibble of every byte by its signed value; each
/// word's two bytes are then brought down with their sign by arithmetic shifts.
#[inline]
#[target_feature(enable = "avx2")]
fn doubled_pair_weights(codes: __m256i, table: __m256i) -> [__m256i; 4] {
    let nibbles = _mm256_set1_epi8(0x0f);
    // Bytes (n1 n0, n3 n2) of a word become (v(n0), v(n2)) and (v(n1), v(n3)); the index bytes' bit 7 is clear, so
    // no byte is zeroed.
    let low = _mm256_shuffle_epi8(table, _mm256_and_si256(codes, nibbles));
    let high = _mm256_shuffle_epi8(
        table,
        _mm256_and_si256(_mm256_srli_epi16::<4>(codes), nibbles),
    );
    let low_byte = |v: __m256i| _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(v));
    let high_byte = |v: __m256i| _mm256_srai_epi16::<8>(v);
    [
        low_byte(low),
        low_byte(high),
        high_byte(low),
        high_byte(high),
    ]
}

/// AVX2 twin of [`crate::mxfp4_i16_contract::dot_row_ref`] for `R` neighbouring rows against one quantised input
/// `xq`, whose loads they share; the contract's sixteen lanes as two 8-lane halves. `vpmaddwd` gives each lane's
/// pair products summed, an exact integer like every sum of the contract before its conversion to f32.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `xq.len() == chunks(cols) * 80`; each row is one row's `packed` and `scales`
/// (no scale byte 255).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_i16_dot_rows<const R: usize>(
    rows: [(&[u8], &[u8]); R],
    xq: &[u32],
) -> [f32; R] {
    use crate::mxfp4_contract::{CHUNK_BYTES, CHUNK_LANES};
    use crate::mxfp4_i16_contract::{CHUNK_WORDS, E2M1_DOUBLED, PAIR_WORDS};
    use crate::simd::avx512::MXFP4_PREFETCH_BYTES;
    // The byte table in each 128-bit half, a constant so that it is not rebuilt on every call.
    const BYTES: [i8; 32] = {
        let mut bytes = [0i8; 32];
        let mut i = 0;
        while i < 32 {
            bytes[i] = E2M1_DOUBLED[i % 16] as i8;
            i += 1;
        }
        bytes
    };
    // SAFETY: `BYTES` holds 32 bytes.
    let table = unsafe { _mm256_loadu_si256(BYTES.as_ptr() as *const __m256i) };
    let p0 = rows[0].0.as_ptr();
    let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; R];
    for c in 0..xq.len() / CHUNK_WORDS {
        // The rows' bytes in address order, as the AVX-512 kernels prefetch them.
        prefetch_ahead(
            p0.wrapping_add(R * c * CHUNK_BYTES),
            R * CHUNK_BYTES,
            MXFP4_PREFETCH_BYTES,
        );
        for half in 0..2 {
            // SAFETY: chunk c of `xq` is whole (c < len / CHUNK_WORDS); lanes 8·half .. 8·half + 8 of each vector.
            let (x, m) = unsafe {
                let at = xq.as_ptr().add(c * CHUNK_WORDS + 8 * half);
                let x: [__m256i; 4] = std::array::from_fn(|j| {
                    _mm256_loadu_si256(at.add(j * CHUNK_LANES) as *const __m256i)
                });
                (x, _mm256_loadu_ps(at.add(PAIR_WORDS) as *const f32))
            };
            for (a, &(packed, scales)) in acc.iter_mut().zip(&rows) {
                // SAFETY: AVX2 present; the half chunk is read within `packed` or zero-padded.
                let codes = unsafe { half_chunk_codes(packed, c, half) };
                let w = doubled_pair_weights(codes, table);
                let t = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(w[0], x[0]), _mm256_madd_epi16(w[1], x[1])),
                    _mm256_add_epi32(_mm256_madd_epi16(w[2], x[2]), _mm256_madd_epi16(w[3], x[3])),
                );
                let u = _mm256_mul_ps(_mm256_cvtepi32_ps(t), m);
                let scale = half_chunk_scales(scales, c, half);
                a[c % 2][half] = _mm256_fmadd_ps(u, scale, a[c % 2][half]);
            }
        }
    }
    let mut out = [0.0f32; R];
    for (o, a) in out.iter_mut().zip(acc) {
        *o = reduce16(a);
    }
    out
}

/// One MXFP4 row against rows of the quantised input, each bit-identical to
/// [`crate::mxfp4_i16_contract::dot_row_ref`]: `out[t] = row · x_t`, where `x_t` is `xqs[t * xq_len ..][.. xq_len]`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `xq_len == chunks(cols) * 80`, `xqs.len() >= out.len() * xq_len`; `packed`
/// and `scales` are one row's bytes (no scale byte 255).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_i16_row_multi(
    packed: &[u8],
    scales: &[u8],
    xqs: &[u32],
    xq_len: usize,
    out: &mut [f32],
) {
    for (o, xq) in out.iter_mut().zip(xqs.chunks_exact(xq_len.max(1))) {
        // SAFETY: forwarded from the caller, one input of `xq_len` words.
        *o = unsafe { mxfp4_i16_dot_rows([(packed, scales)], xq) }[0];
    }
}

/// AVX2 twin of [`crate::quantise::abs_max_ref`]: eight values a step, the rest by the reference.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn abs_max(x: &[f32]) -> Option<f32> {
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_ps(f32::INFINITY);
    let (mut amax, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let eights = x.chunks_exact(8);
    let rest = crate::quantise::abs_max_ref(eights.remainder())?;
    for v in eights {
        // SAFETY: `v` holds 8 values.
        let a = _mm256_and_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, magnitude);
        // NaN compares unordered, so "not less than infinity" catches NaN and both infinities.
        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        amax = _mm256_max_ps(amax, a);
    }
    if _mm256_movemask_ps(bad) != 0 {
        return None;
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 values.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
    Some(lanes.iter().fold(rest, |m, &v| m.max(v)))
}

/// AVX2 twin of [`crate::quantise::quantise_ref`], as the AVX-512 one: eight values a step, the rest by the
/// reference.
///
/// # Safety
/// The CPU must support AVX2; `q.len() >= x.len()`.
#[target_feature(enable = "avx2")]
pub unsafe fn quantise(x: &[f32], step: f32, q: &mut [i16]) {
    let n = x.len().min(q.len());
    let whole = n / 8 * 8;
    let steps = _mm256_set1_ps(step);
    let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (one, half) = (_mm256_set1_ps(1.0), _mm256_set1_ps(0.5));
    let (lo, hi) = (
        _mm256_set1_ps(-crate::quantise::Q_MAX),
        _mm256_set1_ps(crate::quantise::Q_MAX),
    );
    for at in (0..whole).step_by(8) {
        // SAFETY: values at .. at + 8 lie in `x` and `q` (at + 8 <= whole <= n).
        unsafe {
            let y = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(at)), steps);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm256_and_ps(_mm256_sub_ps(y, t), magnitude);
            let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half);
            let away = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(y, sign)));
            let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, away), lo), hi);
            let i = _mm256_cvttps_epi32(r);
            // The eight int32 values are within ±32767, so the saturating pack is exact; it packs within 128-bit
            // halves, so values 0..4 and 4..8 are the low words of each half.
            let packed = _mm256_packs_epi32(i, i);
            let words = _mm256_permute4x64_epi64::<0b1000>(packed);
            _mm_storeu_si128(
                q.as_mut_ptr().add(at) as *mut __m128i,
                _mm256_castsi256_si128(words),
            );
        }
    }
    crate::quantise::quantise_ref(&x[whole..n], step, &mut q[whole..n]);
}

/// The sum of sixteen vectors in the lanes contracts' order (`v[k] + v[k + 8]`, then `+ 4`, `+ 2`, `+ 1`): the end of
/// a reduction of the products of many inputs (`avx2_tokens::finish`, `avx2_bf16_lanes::finish`), one input per
/// vector lane.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn halving_sum(mut v: [__m256; 16]) -> __m256 {
    let mut width = 8;
    while width > 0 {
        for k in 0..width {
            v[k] = _mm256_add_ps(v[k], v[k + width]);
        }
        width /= 2;
    }
    v[0]
}
