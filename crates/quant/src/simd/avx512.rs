//! AVX-512 kernels (x86-64-v4: AVX-512F and BW, with AVX2/FMA for tails; BF16 and VNNI where named). Each follows
//! its scalar twin's contract exactly: [`crate::dot`] for f32 rows (one 16-lane register holds two of the
//! contract's 8-lane accumulators), [`crate::bf16_contract`] for bf16 rows, [`crate::int8_contract`] for int8 rows, [`crate::mxfp4_contract`],
//! [`crate::mxfp4_bf16_contract`] and [`crate::mxfp4_i16_contract`] for MXFP4 rows. Two rows are computed per call
//! so they share the input's loads (four were slower for every MXFP4 contract: `docs/performance-log.md`).

use std::arch::x86_64::*;

use crate::dot::{BLOCK, LANES};
use crate::int8_contract::SEGMENT_STEPS;
use crate::mxfp4_bf16_contract::CHUNK_WORDS;
use crate::mxfp4_contract::{CHUNK, CHUNK_BYTES, CHUNK_LANES, CODES_PER_LANE, GROUPS_PER_CHUNK};

/// The four 8-lane accumulators of the dense contract, from two 16-lane registers `[a0|a1]`, `[a2|a3]`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn split(a01: __m512, a23: __m512) -> [__m256; 4] {
    let hi = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    [
        _mm512_castps512_ps256(a01),
        hi(a01),
        _mm512_castps512_ps256(a23),
        hi(a23),
    ]
}

/// Finishes one row of the dense contract: the zero-padded tail into accumulator 0, then the reduction.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn finish(a01: __m512, a23: __m512, w: &[f32], x: &[f32], full: usize) -> f32 {
    let [mut a0, a1, a2, a3] = split(a01, a23);
    let n = w.len().min(x.len());
    let mut c = full;
    while c < n {
        let mut wb = [0.0f32; LANES];
        let mut xb = [0.0f32; LANES];
        let k = LANES.min(n - c);
        wb[..k].copy_from_slice(&w[c..c + k]);
        xb[..k].copy_from_slice(&x[c..c + k]);
        // SAFETY: both buffers hold 8 f32.
        a0 = unsafe {
            _mm256_fmadd_ps(
                _mm256_loadu_ps(wb.as_ptr()),
                _mm256_loadu_ps(xb.as_ptr()),
                a0,
            )
        };
        c += LANES;
    }
    super::avx2::reduce(a0, a1, a2, a3)
}

/// How far ahead of the kernels weights are prefetched.
///
/// The two-row kernels read neighbouring rows (row `r + 1` starts where row `r` ends), so a pair is one contiguous
/// span read at two points at once. They prefetch that span in address order, as if one reader went through it
/// at the pair's pace, `PREFETCH_BYTES` ahead of that reader: the memory system sees one sequential stream that
/// runs on into the next pairs, and every line is asked for once. A prefetch per row at its own read point (two
/// interleaved streams) fed the same kernels 10–15% slower whenever memory was the limit, and 12, 24 or 32 KiB
/// instead of 16 were no better (`docs/performance-log.md`).
pub(crate) const PREFETCH_BYTES: usize = 16 << 10;

/// [`PREFETCH_BYTES`] for the two-row MXFP4 kernels, whose rows are short (1792 bytes for K3's experts) and whose
/// arithmetic is heavier per byte: 8 KiB ahead fed them best at both memory speeds of the test machine, 4 KiB about
/// as well, 12–32 KiB a few per cent worse (`docs/performance-log.md`).
pub(crate) const MXFP4_PREFETCH_BYTES: usize = 8 << 10;

/// How many rows ahead the MXFP4 kernels prefetch the rows' scales, which lie apart from the codes, out of reach of
/// the codes' prefetch: read on demand they cost the bf16- and int16-input kernels about 3% of their rate from
/// memory (`docs/performance-log.md`). For a K3 expert that is 1.8 KB of scales, read while the kernels
/// go through 28 KB of codes.
const SCALE_LEAD_ROWS: usize = 16;

/// Prefetches the cache lines `dist` bytes ahead of `p` covering `len` bytes into L1 (a hint: never faults).
#[inline(always)]
fn prefetch<T>(p: *const T, len: usize, dist: usize) {
    super::prefetch_ahead::<_MM_HINT_T0, T>(p, len, dist)
}

/// [`prefetch`] with the non-temporal hint, for lines read once (a GEMV's weights): on the AMD Zen 5 cores measured
/// the bf16 rows' span read 2–4% faster this way at either memory speed (`docs/performance-log.md`, "Session 22").
#[inline(always)]
fn prefetch_once<T>(p: *const T, len: usize, dist: usize) {
    super::prefetch_ahead::<_MM_HINT_NTA, T>(p, len, dist)
}

/// Two rows of the dense contract against one input.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `w0.len() == w1.len() == x.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_x2(w0: &[f32], w1: &[f32], x: &[f32]) -> [f32; 2] {
    let n = x.len().min(w0.len()).min(w1.len());
    let full = n / BLOCK * BLOCK;
    let (p0, p1, xp) = (w0.as_ptr(), w1.as_ptr(), x.as_ptr());
    let z = _mm512_setzero_ps();
    let (mut r0a, mut r0b, mut r1a, mut r1b) = (z, z, z, z);
    let mut b = 0;
    while b < full {
        // The pair's bytes in address order (see PREFETCH_BYTES): a block of both rows is 2 · 32 values.
        prefetch(
            p0.wrapping_add(2 * b),
            2 * size_of::<f32>() * BLOCK,
            PREFETCH_BYTES,
        );
        // SAFETY: b + 32 <= full <= n for all three slices.
        unsafe {
            let xa = _mm512_loadu_ps(xp.add(b));
            let xb = _mm512_loadu_ps(xp.add(b + 16));
            r0a = _mm512_fmadd_ps(_mm512_loadu_ps(p0.add(b)), xa, r0a);
            r0b = _mm512_fmadd_ps(_mm512_loadu_ps(p0.add(b + 16)), xb, r0b);
            r1a = _mm512_fmadd_ps(_mm512_loadu_ps(p1.add(b)), xa, r1a);
            r1b = _mm512_fmadd_ps(_mm512_loadu_ps(p1.add(b + 16)), xb, r1b);
        }
        b += BLOCK;
    }
    [finish(r0a, r0b, w0, x, full), finish(r1a, r1b, w1, x, full)]
}

/// One row of the dense contract.
///
/// # Safety
/// As [`dot_x2`].
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_x1(w: &[f32], x: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let full = n / BLOCK * BLOCK;
    let (p, xp) = (w.as_ptr(), x.as_ptr());
    let (mut a, mut b2) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut b = 0;
    while b < full {
        // SAFETY: b + 32 <= full <= n.
        unsafe {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(b)), _mm512_loadu_ps(xp.add(b)), a);
            b2 = _mm512_fmadd_ps(
                _mm512_loadu_ps(p.add(b + 16)),
                _mm512_loadu_ps(xp.add(b + 16)),
                b2,
            );
        }
        b += BLOCK;
    }
    finish(a, b2, w, x, full)
}

/// The accumulators of one (row, input) product of the dense contract: `[a0|a1]`, `[a2|a3]`.
pub type F32Acc = [__m512; 2];

/// Values `b0 .. b1` (whole blocks of 32) of `R` f32 rows by `T` inputs of the dense contract (multi-token
/// products): per block each row's two vectors are loaded once for all `T` inputs and each input's once for all `R`
/// rows, so a 2 × 4 tile does 16 FMAs for 12 loads where one product at a time does one load per FMA. Each
/// product's accumulators are `acc[r · stride + t]`, read at the start and written back at the end, so a caller can
/// walk the values in blocks that keep the inputs in L1; every product gets its blocks in order, as in
/// [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `b0` and `b1` are multiples of 32 within every row and input; `acc`
/// holds `(R - 1) · stride + T` accumulators.
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
pub unsafe fn dot_f32_tile<const R: usize, const T: usize>(
    rows: [&[f32]; R],
    xs: [&[f32]; T],
    (b0, b1): (usize, usize),
    acc: &mut [F32Acc],
    stride: usize,
) {
    let z = _mm512_setzero_ps();
    let mut a = [[[z; 2]; T]; R];
    for r in 0..R {
        for t in 0..T {
            a[r][t] = acc[r * stride + t];
        }
    }
    let mut b = b0;
    while b < b1 {
        // SAFETY: b + 32 <= b1, within every row and input (caller).
        unsafe {
            let mut w = [[z; 2]; R];
            for r in 0..R {
                let p = rows[r].as_ptr().add(b);
                w[r] = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
            }
            for t in 0..T {
                let p = xs[t].as_ptr().add(b);
                let (xa, xb) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                for r in 0..R {
                    a[r][t][0] = _mm512_fmadd_ps(w[r][0], xa, a[r][t][0]);
                    a[r][t][1] = _mm512_fmadd_ps(w[r][1], xb, a[r][t][1]);
                }
            }
        }
        b += BLOCK;
    }
    for r in 0..R {
        for t in 0..T {
            acc[r * stride + t] = a[r][t];
        }
    }
}

/// One product of the dense contract from its accumulators over the whole blocks: the tail, then the reduction.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `w` and `x` have one length.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_f32_finish(acc: &F32Acc, w: &[f32], x: &[f32]) -> f32 {
    let full = w.len().min(x.len()) / BLOCK * BLOCK;
    finish(acc[0], acc[1], w, x, full)
}

/// The reductions of up to 16 products of the dense contract whose values all lie in whole blocks (no tail): `out[p]`
/// is [`dot_f32_finish`]'s result for `acc[p]` (zero past `acc.len()`). The same additions in the same pairs as one
/// product's reduction (`(a0 + a1) + (a2 + a3)`, then lanes `l` and `l + 4`, `l` and `l + 2`, `l` and `l + 1`), each
/// step done for four to sixteen products by one vector addition after shuffles that line their operands up: about
/// five operations a product where one at a time takes twelve.
///
/// # Safety
/// The CPU must support AVX-512F; `acc.len() <= 16`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_f32_finish16(acc: &[F32Acc]) -> [f32; 16] {
    debug_assert!(acc.len() <= 16);
    let z = _mm512_setzero_ps();
    let a = |p: usize| if p < acc.len() { acc[p] } else { [z, z] };
    // v of products 2k and 2k + 1, as [v(2k) | v(2k + 1)] (each a0 in 128-bit lanes 0 and 1 of `acc[p][0]`, a1 in 2
    // and 3; a2 and a3 likewise in `acc[p][1]`).
    let pairs: [__m512; 8] = std::array::from_fn(|k| {
        let (p, r) = (a(2 * k), a(2 * k + 1));
        let a0 = _mm512_shuffle_f32x4::<0b01_00_01_00>(p[0], r[0]);
        let a1 = _mm512_shuffle_f32x4::<0b11_10_11_10>(p[0], r[0]);
        let a2 = _mm512_shuffle_f32x4::<0b01_00_01_00>(p[1], r[1]);
        let a3 = _mm512_shuffle_f32x4::<0b11_10_11_10>(p[1], r[1]);
        _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))
    });
    // Lanes l and l + 4 of each v: 128-bit lane j of `s4[m]` is product 4m + j's four sums.
    let s4: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (pairs[2 * m], pairs[2 * m + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
        _mm512_add_ps(lo, hi)
    });
    // Lanes l and l + 2: 128-bit lane j of `s2[n]` is [product 8n + j's two sums, product 8n + 4 + j's two].
    let s2: [__m512; 2] = std::array::from_fn(|n| {
        let (u, w) = (s4[2 * n], s4[2 * n + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(u, w),
            _mm512_shuffle_ps::<0b11_10_11_10>(u, w),
        )
    });
    // Lanes l and l + 1: lane 4j + s is product 4s + j.
    let s1 = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(s2[0], s2[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(s2[0], s2[1]),
    );
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 f32.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s1) };
    std::array::from_fn(|p| lanes[4 * (p % 4) + p / 4])
}

/// AVX-512 twin of [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `w.len() == x.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    // SAFETY: forwarded from the caller.
    unsafe { dot_x1(w, x) }
}

/// Two rows at once, each bit-identical to [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `w0.len() == w1.len() == x.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot_f32_x2(w0: &[f32], w1: &[f32], x: &[f32]) -> [f32; 2] {
    // SAFETY: forwarded from the caller.
    unsafe { dot_x2(w0, w1, x) }
}

/// `R` bf16 rows of equal length against one permuted input ([`crate::bf16_contract`]), sharing its loads: per
/// chunk of 32 weights and row, one 64-byte load, a shift (even weights) and a mask (odd weights) to exact f32, and
/// two FMAs. The rows' lines are prefetched into L1 as `how` says ([`crate::bf16_contract::prefetch`] chooses:
/// each row at its own read point, or the rows' span as one stream, as the other dense kernels do,
/// `PREFETCH_BYTES`); the arithmetic is the same either way.
///
/// # Safety
/// The CPU must support AVX-512F and BW; every row has the same length `n` (neighbouring rows of one matrix, for a
/// span's prefetch to fetch theirs), and `xp` holds at least `bf16_contract::padded_len(n)` values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn bf16_rows<const R: usize>(
    rows: [&[u16]; R],
    xp: &[f32],
    how: crate::bf16_contract::Prefetch,
) -> [f32; R] {
    use crate::bf16_contract::{CHUNK, Prefetch};
    let n = rows[0].len();
    let whole = n / CHUNK;
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let z = _mm512_setzero_ps();
    let (mut even, mut odd) = ([z; R], [z; R]);
    let mut step = |c: usize, words: [__m512i; R]| {
        // SAFETY (caller): chunk c of the permuted input lies in `xp`.
        let (xe, xo) = unsafe {
            let at = xp.as_ptr().add(c * CHUNK);
            (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(CHUNK / 2)))
        };
        for r in 0..R {
            let e = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words[r]));
            let o = _mm512_castsi512_ps(_mm512_and_si512(words[r], high));
            even[r] = _mm512_fmadd_ps(e, xe, even[r]);
            odd[r] = _mm512_fmadd_ps(o, xo, odd[r]);
        }
    };
    for c in 0..whole {
        match how {
            Prefetch::Off => {}
            Prefetch::PerRow(ahead) => {
                for w in &rows {
                    prefetch(w.as_ptr().wrapping_add(c * CHUNK), CHUNK * 2, ahead);
                }
            }
            Prefetch::Span(ahead) => prefetch_once(
                rows[0].as_ptr().wrapping_add(R * c * CHUNK),
                R * CHUNK * 2,
                ahead,
            ),
        }
        // SAFETY: chunk c < whole lies whole in every row.
        let words =
            rows.map(|w| unsafe { _mm512_loadu_si512(w.as_ptr().add(c * CHUNK) as *const _) });
        step(c, words);
    }
    if whole * CHUNK < n {
        let mask: __mmask32 = (1u32 << (n - whole * CHUNK)) - 1;
        // SAFETY: only the masked elements, all inside each row, are read; the rest are zero.
        let words = rows.map(|w| unsafe {
            _mm512_maskz_loadu_epi16(mask, w.as_ptr().add(whole * CHUNK) as *const i16)
        });
        step(whole, words);
    }
    std::array::from_fn(|r| reduce16(even[r], odd[r]))
}

/// The even and odd accumulators of one (row, input) pair of a bf16 tile, kept between blocks of chunks.
pub type Bf16Acc = [__m512; 2];

/// Chunks `c0 .. c1` of `R` bf16 rows of equal length against `T` permuted inputs ([`crate::bf16_contract`]): the
/// multi-token form of [`bf16_rows`], for prefill. Each row's chunk is widened once and multiplied into every
/// input's accumulators (`acc[r * stride + t]`, read at the start and written back at the end, so a caller can walk
/// the chunks in blocks that keep the inputs in L1), so per chunk the tile does `2RT` FMAs for `R` weight loads and
/// `2R` widening instructions. Every (row, input) sum gets its chunks in order into its own accumulators, as the
/// contract says; [`bf16_finish`] reduces them.
///
/// # Safety
/// The CPU must support AVX-512F and BW; every row has the same length `n`, every input holds at least
/// `bf16_contract::padded_len(n)` values, `c1 <= n.div_ceil(32)`, and `acc` holds `(R - 1) * stride + T` entries.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn bf16_tile<const R: usize, const T: usize>(
    rows: [&[u16]; R],
    xps: [&[f32]; T],
    (c0, c1): (usize, usize),
    acc: &mut [Bf16Acc],
    stride: usize,
) {
    use crate::bf16_contract::CHUNK;
    let n = rows[0].len();
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let mut even: [[__m512; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| acc[r * stride + t][0]));
    let mut odd: [[__m512; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| acc[r * stride + t][1]));
    for c in c0..c1 {
        let words: [__m512i; R] = if (c + 1) * CHUNK <= n {
            // SAFETY: chunk c lies whole in every row.
            rows.map(|w| unsafe { _mm512_loadu_si512(w.as_ptr().add(c * CHUNK) as *const _) })
        } else {
            let mask: __mmask32 = (1u32 << (n - c * CHUNK)) - 1;
            // SAFETY: only the masked elements, all inside each row, are read; the rest are zero.
            rows.map(|w| unsafe {
                _mm512_maskz_loadu_epi16(mask, w.as_ptr().add(c * CHUNK) as *const i16)
            })
        };
        let e: [__m512; R] =
            std::array::from_fn(|r| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words[r])));
        let o: [__m512; R] =
            std::array::from_fn(|r| _mm512_castsi512_ps(_mm512_and_si512(words[r], high)));
        for t in 0..T {
            // SAFETY (caller): chunk c of every permuted input lies in it.
            let (xe, xo) = unsafe {
                let at = xps[t].as_ptr().add(c * CHUNK);
                (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(CHUNK / 2)))
            };
            for r in 0..R {
                even[r][t] = _mm512_fmadd_ps(e[r], xe, even[r][t]);
                odd[r][t] = _mm512_fmadd_ps(o[r], xo, odd[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            acc[r * stride + t] = [even[r][t], odd[r][t]];
        }
    }
}

/// The contract's reduction of one (row, input) pair's accumulators from [`bf16_tile`].
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn bf16_finish(acc: &Bf16Acc) -> f32 {
    reduce16(acc[0], acc[1])
}

/// `R` neighbouring int8 rows against one quantised input: [`int8_tile`] with one input, whose loads the rows share.
///
/// # Safety
/// As [`int8_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn int8_rows<const R: usize>(rows: [&[i8]; R], xq: &[i16]) -> [i64; R] {
    // SAFETY: forwarded from the caller.
    unsafe { int8_tile(rows, [xq]) }.map(|[sum]| sum)
}

/// `R` neighbouring int8 rows against `T` quantised inputs ([`crate::int8_contract`]): per 32 columns and row, a
/// sign extension to int16 (once for every input), then per input one `vpdpwssd` (two products added to every
/// 32-bit lane), widened to 64 bits every [`SEGMENT_STEPS`] of those steps. The rows are prefetched as one stream in
/// address order, as the dense kernels do. The sums are exact integers, so their order is free and every result
/// equals [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// The CPU must support AVX-512F/BW and AVX-512 VNNI; every row has the same length `n`, and every input holds at
/// least `n` values rounded up to a multiple of 32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn int8_tile<const R: usize, const T: usize>(
    rows: [&[i8]; R],
    xs: [&[i16]; T],
) -> [[i64; T]; R] {
    let n = rows.iter().fold(usize::MAX, |n, q| n.min(q.len()));
    let full = n / 32 * 32;
    let p0 = rows[0].as_ptr();
    let mut wide = [[_mm512_setzero_si512(); T]; R];
    // Adds one segment's 32-bit lanes into the 64-bit sums.
    let widen = |wide: &mut [[__m512i; T]; R], acc: [[__m512i; T]; R]| {
        for (wd, a) in wide.iter_mut().flatten().zip(acc.iter().flatten()) {
            let lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(*a));
            let hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64::<1>(*a));
            *wd = _mm512_add_epi64(*wd, _mm512_add_epi64(lo, hi));
        }
    };
    // One block of 32 columns from column `c` of every input, against the rows' widened weights `w`.
    let block = |acc: &mut [[__m512i; T]; R], c: usize, w: [__m512i; R]| {
        for (t, x) in xs.iter().enumerate() {
            // SAFETY: the caller pads every input to a multiple of 32 past n, and c < n.
            let x = unsafe { _mm512_loadu_si512(x.as_ptr().add(c) as *const _) };
            for (a, w) in acc.iter_mut().zip(&w) {
                a[t] = _mm512_dpwssd_epi32(a[t], *w, x);
            }
        }
    };
    let mut c = 0;
    while c < full {
        let end = full.min(c + 32 * SEGMENT_STEPS);
        let mut acc = [[_mm512_setzero_si512(); T]; R];
        while c < end {
            prefetch(p0.wrapping_add(R * c), R * 32, PREFETCH_BYTES);
            // SAFETY: c + 32 <= full <= n for every row.
            let w = std::array::from_fn(|r| unsafe {
                _mm512_cvtepi8_epi16(_mm256_loadu_si256(rows[r].as_ptr().add(c) as *const __m256i))
            });
            block(&mut acc, c, w);
            c += 32;
        }
        widen(&mut wide, acc);
    }
    if full < n {
        // The partial last block, zero-padded (the inputs are zero past n).
        let mut acc = [[_mm512_setzero_si512(); T]; R];
        let w = std::array::from_fn(|r| {
            let mut tail = [0i8; 32];
            tail[..n - full].copy_from_slice(&rows[r][full..n]);
            // SAFETY: `tail` holds 32 bytes.
            _mm512_cvtepi8_epi16(unsafe { _mm256_loadu_si256(tail.as_ptr() as *const __m256i) })
        });
        block(&mut acc, full, w);
        widen(&mut wide, acc);
    }
    wide.map(|row| row.map(|wd| _mm512_reduce_add_epi64(wd)))
}

/// AVX-512 VNNI twin of [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// As `int8_rows` with one row.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn int8_dot(q: &[i8], xq: &[i16]) -> i64 {
    // SAFETY: forwarded from the caller.
    unsafe { int8_rows([q], xq)[0] }
}

/// Two neighbouring int8 rows against one quantised input, each equal to [`crate::int8_contract::dot_ref`].
///
/// # Safety
/// As `int8_rows` with two rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn int8_dot_x2(q0: &[i8], q1: &[i8], xq: &[i16]) -> [i64; 2] {
    // SAFETY: forwarded from the caller.
    unsafe { int8_rows([q0, q1], xq) }
}

/// The E2M1 values as bf16 bit patterns, twice (the word permute reads five index bits; the fifth is the next
/// code's lowest bit, so both halves must agree).
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_table() -> __m512i {
    const BF16: [u16; 16] = [
        0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80,
        0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    ];
    let mut both = [0u16; 32];
    both[..16].copy_from_slice(&BF16);
    both[16..].copy_from_slice(&BF16);
    // SAFETY: `both` holds 64 bytes.
    unsafe { _mm512_loadu_si512(both.as_ptr() as *const _) }
}

/// The multipliers of groups `g0 .. g0 + 16` of a row (1.0 past its end), exact: straight from the row where all
/// sixteen are in it, through a padded copy at its end. The two-row driver's whole blocks call [`scales16_at`]
/// themselves, with no copy path in the loop (a copy's call made the compiler keep that driver's accumulators on
/// the stack around every block).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn scales16(scales: &[u8], g0: usize) -> __m512 {
    if let Some(whole) = scales.get(g0..g0 + 16) {
        // SAFETY: `whole` holds 16 bytes.
        return unsafe { scales16_at(whole.as_ptr()) };
    }
    let mut padded = [127u8; 16];
    let have = scales.get(g0..).unwrap_or(&[]);
    for (p, &b) in padded.iter_mut().zip(have) {
        *p = b;
    }
    // SAFETY: `padded` holds 16 bytes.
    unsafe { scales16_at(padded.as_ptr()) }
}

/// The multipliers of the sixteen groups whose scale bytes start at `p`, exact.
///
/// # Safety
/// 16 bytes must be readable at `p`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scales16_at(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 readable bytes.
    let e = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) });
    // 2^(e-127): biased exponent e, or the subnormal 2^-127 for e = 0.
    let bits = _mm512_slli_epi32::<23>(e);
    let zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(
        bits,
        zero,
        _mm512_set1_epi32(1 << 22),
    ))
}

/// Lane `k` of chunk `j` of four uses group `4j + k / 4` of the 16 loaded by [`scales16`].
#[inline]
#[target_feature(enable = "avx512f")]
fn chunk_scale(s16: __m512, j: usize) -> __m512 {
    let base = (4 * j) as i32;
    let idx = _mm512_add_epi32(
        _mm512_set1_epi32(base),
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
    );
    _mm512_permutexvar_ps(idx, s16)
}

/// The sixteen code words of chunk `c` of a row (zero past its end).
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn chunk_words(packed: &[u8], c: usize) -> __m512i {
    let at = c * CHUNK_BYTES;
    let have = packed.len().saturating_sub(at).min(CHUNK_BYTES) / 4;
    if have == CHUNK_LANES {
        // SAFETY: 64 bytes from `at` lie in `packed`.
        unsafe { _mm512_loadu_si512(packed.as_ptr().add(at) as *const _) }
    } else {
        let mask: __mmask16 = ((1u32 << have) - 1) as u16;
        // SAFETY: only the `have` lanes in the mask are read, all inside `packed`.
        unsafe { _mm512_maskz_loadu_epi32(mask, packed.as_ptr().add(at) as *const i32) }
    }
}

/// The eight decoded weight vectors of one chunk (code `s` of every lane in vector `s`).
///
/// A word permute (`vpermw`, 32-entry table of bf16 bit patterns) decodes the code in the low bits of every 16-bit
/// half-lane at once: the low half of lane `k` holds codes 0..4 of the lane and the high half codes 4..8. The bf16
/// results become f32 by moving the low half up, or masking the high half in place (exact). Half as many permutes
/// as a dword table.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn decode(words: __m512i, table: __m512i) -> [__m512; 8] {
    let p = |v: __m512i| _mm512_permutexvar_epi16(v, table);
    let r = [
        p(words),
        p(_mm512_srli_epi16::<4>(words)),
        p(_mm512_srli_epi16::<8>(words)),
        p(_mm512_srli_epi16::<12>(words)),
    ];
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let lo = |v: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
    let hi = |v: __m512i| _mm512_castsi512_ps(_mm512_and_si512(v, high));
    [
        lo(r[0]),
        lo(r[1]),
        lo(r[2]),
        lo(r[3]),
        hi(r[0]),
        hi(r[1]),
        hi(r[2]),
        hi(r[3]),
    ]
}

/// `te + to` of one chunk: decoded weights `w` against the permuted input chunk at `xp`.
///
/// # Safety
/// 128 f32 must be readable at `xp`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn chunk_sum(w: &[__m512; 8], xp: *const f32) -> __m512 {
    // SAFETY: the caller guarantees the 128 values.
    let x: [__m512; 8] =
        std::array::from_fn(|s| unsafe { _mm512_loadu_ps(xp.add(s * CHUNK_LANES)) });
    chunk_sum_loaded(w, &x)
}

/// [`chunk_sum`] against an input chunk already loaded (code `s` of every lane in `x[s]`), for rows that share it.
#[inline]
#[target_feature(enable = "avx512f")]
fn chunk_sum_loaded(w: &[__m512; 8], x: &[__m512; 8]) -> __m512 {
    let half = |first: usize| {
        let mut t = _mm512_mul_ps(w[first], x[first]);
        for s in (first + 2..8).step_by(2) {
            t = _mm512_fmadd_ps(w[s], x[s], t);
        }
        t
    };
    _mm512_add_ps(half(0), half(1))
}

/// The contract's reduction of two 16-lane accumulators.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn reduce16(acc0: __m512, acc1: __m512) -> f32 {
    let v = _mm512_add_ps(acc0, acc1);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let v8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
}

/// Drives a one-row MXFP4 kernel against several inputs: `decode` turns the code words of chunk `c` into the
/// contract's weight vectors once, and `sum(&w, t, c)` gives input `t`'s unscaled sum of that chunk; the driver
/// applies the scales into each input's even and odd accumulators (`acc[c % 2] = fma(t, scale, acc[c % 2])`) and
/// reduces into `out[t]`.
///
/// # Safety
/// `n_chunks` chunks of every input must be readable by `sum`; `packed` and `scales` are one row's bytes; the CPU
/// must support AVX-512F/BW, AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn mxfp4_one_row<W>(
    (packed, scales): (&[u8], &[u8]),
    n_chunks: usize,
    out: &mut [f32],
    decode: impl Fn(__m512i) -> W,
    mut sum: impl FnMut(&W, usize, usize) -> __m512,
) {
    let mut acc = vec![[_mm512_setzero_ps(); 2]; out.len()];
    let mut s16 = _mm512_setzero_ps();
    for c in 0..n_chunks {
        if c % 4 == 0 {
            s16 = scales16(scales, c * 4);
        }
        let scale = chunk_scale(s16, c % 4);
        // SAFETY: chunk c of the row (masked at its end).
        let w = decode(unsafe { chunk_words(packed, c) });
        for (t, a) in acc.iter_mut().enumerate() {
            a[c % 2] = _mm512_fmadd_ps(sum(&w, t, c), scale, a[c % 2]);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = reduce16(a[0], a[1]);
    }
}

/// One MXFP4 row (`packed`, `scales`) against rows of the permuted input: `out[t] = row · x_t`, where `x_t` is
/// `xps[t * xp_len ..][.. xp_len]`. Bit-identical to [`crate::mxfp4_contract::dot_row_ref`] for each `t`; each
/// chunk is decoded once for all `t`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `xp_len == chunks(cols) * 128`, `xps.len() >= out.len() * xp_len`,
/// `packed` and `scales` are one row's bytes (no scale byte 255).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn mxfp4_row_multi(
    packed: &[u8],
    scales: &[u8],
    xps: &[f32],
    xp_len: usize,
    out: &mut [f32],
) {
    // SAFETY (each arm): every input holds `xp_len / CHUNK` whole chunks (the caller's lengths); features as
    // required.
    match out.len() {
        2 => unsafe { mxfp4_row_fixed::<2>((packed, scales), xps, xp_len, out) },
        3 => unsafe { mxfp4_row_fixed::<3>((packed, scales), xps, xp_len, out) },
        _ => {
            let table = e2m1_table();
            unsafe {
                mxfp4_one_row(
                    (packed, scales),
                    xp_len / CHUNK,
                    out,
                    |words| decode(words, table),
                    |w, t, c| chunk_sum(w, xps.as_ptr().add(t * xp_len + c * CHUNK)),
                )
            }
        }
    }
}

/// Calls `step(c, odd)` for chunks `c0 .. c1` in order, `odd` being `c % 2 == 1`: the chunks go in even/odd pairs, so
/// at every call `odd` is a constant and a kernel can keep its even and odd accumulators in registers (picking one by
/// a run-time index, `acc[c % 2]`, kept them on the stack; `docs/performance-log.md`).
#[inline(always)]
pub(crate) fn by_parity(c0: usize, c1: usize, mut step: impl FnMut(usize, bool)) {
    let mut c = c0;
    if c < c1 && c % 2 == 1 {
        step(c, true);
        c += 1;
    }
    while c + 1 < c1 {
        step(c, false);
        step(c + 1, true);
        c += 2;
    }
    if c < c1 {
        step(c, false);
    }
}

/// [`mxfp4_row_multi`] for exactly `T` inputs, with every input's even and odd accumulators in registers
/// ([`by_parity`]).
///
/// # Safety
/// As [`mxfp4_row_multi`], with `out.len() == T`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn mxfp4_row_fixed<const T: usize>(
    (packed, scales): (&[u8], &[u8]),
    xps: &[f32],
    xp_len: usize,
    out: &mut [f32],
) {
    let table = e2m1_table();
    let n_chunks = xp_len / CHUNK;
    let z = _mm512_setzero_ps();
    let (mut even, mut odd) = ([z; T], [z; T]);
    // Chunk c's sums against every input, scaled into `into`.
    let step = |c: usize, s16: __m512, into: &mut [__m512; T]| {
        let scale = chunk_scale(s16, c % 4);
        // SAFETY (caller): chunk c of the row (masked at its end) and of every input.
        unsafe {
            let w = decode(chunk_words(packed, c), table);
            for (t, a) in into.iter_mut().enumerate() {
                let sum = chunk_sum(&w, xps.as_ptr().add(t * xp_len + c * CHUNK));
                *a = _mm512_fmadd_ps(sum, scale, *a);
            }
        }
    };
    let mut s16 = z;
    by_parity(0, n_chunks, |c, is_odd| {
        // The scales of chunks c .. c + 4, loaded at every fourth chunk.
        if c % 4 == 0 {
            s16 = scales16(scales, c * 4);
        }
        step(c, s16, if is_odd { &mut odd } else { &mut even });
    });
    for (o, (e, d)) in out.iter_mut().zip(even.iter().zip(&odd)) {
        *o = reduce16(*e, *d);
    }
}

/// `f` of each row's code words, in a plain loop (which the compiler unrolls and keeps in registers, where
/// `array::map` went through memory and made the f32 and bf16 kernels three to four times slower).
#[inline(always)]
fn per_row<const R: usize>(
    words: [__m512i; R],
    mut f: impl FnMut(__m512i) -> __m512,
) -> [__m512; R] {
    // SAFETY: an all-zero bit pattern is a valid vector.
    let mut out = [unsafe { std::mem::zeroed::<__m512>() }; R];
    for (o, w) in out.iter_mut().zip(words) {
        *o = f(w);
    }
    out
}

/// Drives an MXFP4 kernel over `R` neighbouring rows: `sums(c, words)` gives every row's unscaled sum `t` of chunk
/// `c` from its code words; the driver applies the scales into the contracts' even and odd accumulators
/// (`acc[c % 2] = fma(t, scale, acc[c % 2])`, in registers) and reduces. Chunks that lie whole in every row run four
/// at a time, with plain loads and one scale load per row; the rest (a row's partial last chunk) through masked loads.
///
/// # Safety
/// `n_chunks` chunks of input must be readable by `sums`; the CPU must support AVX-512F/BW, AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn mxfp4_rows<const R: usize>(
    rows: [(&[u8], &[u8]); R],
    n_chunks: usize,
    mut sums: impl FnMut(usize, [__m512i; R]) -> [__m512; R],
) -> [f32; R] {
    let z = _mm512_setzero_ps();
    let (mut even, mut odd) = ([z; R], [z; R]);
    let whole = rows.iter().fold(n_chunks, |n, (p, sc)| {
        n.min(p.len() / CHUNK_BYTES)
            .min(sc.len() / GROUPS_PER_CHUNK)
    }) / 4
        * 4;
    let p0 = rows[0].0.as_ptr();
    // The scales of the rows SCALE_LEAD_ROWS ahead (neighbouring rows' scales are contiguous too).
    let sc0 = rows[0].1;
    prefetch(sc0.as_ptr(), R * sc0.len(), SCALE_LEAD_ROWS * sc0.len());
    let mut c = 0;
    while c < whole {
        // SAFETY: chunks c .. c + 4 lie whole in every row, codes and scales (`whole` counts both).
        let s16 = rows.map(|(_, sc)| unsafe { scales16_at(sc.as_ptr().add(c * 4)) });
        for j in 0..4 {
            let at = (c + j) * CHUNK_BYTES;
            // The rows' bytes in address order (see PREFETCH_BYTES): a chunk of R rows is R · 64 bytes.
            prefetch(
                p0.wrapping_add(R * at),
                R * CHUNK_BYTES,
                MXFP4_PREFETCH_BYTES,
            );
            let mut words = [_mm512_setzero_si512(); R];
            for (w, (p, _)) in words.iter_mut().zip(&rows) {
                // SAFETY: chunk c + j < whole lies whole in every row.
                *w = unsafe { _mm512_loadu_si512(p.as_ptr().add(at) as *const _) };
            }
            let t = sums(c + j, words);
            let acc = if j % 2 == 0 { &mut even } else { &mut odd };
            for r in 0..R {
                acc[r] = _mm512_fmadd_ps(t[r], chunk_scale(s16[r], j), acc[r]);
            }
        }
        c += 4;
    }
    while c < n_chunks {
        let s16 = rows.map(|(_, sc)| scales16(sc, c / 4 * 16));
        // SAFETY: chunk c of each row, masked at its end.
        let words = rows.map(|(p, _)| unsafe { chunk_words(p, c) });
        let t = sums(c, words);
        let acc = if c % 2 == 0 { &mut even } else { &mut odd };
        for r in 0..R {
            acc[r] = _mm512_fmadd_ps(t[r], chunk_scale(s16[r], c % 4), acc[r]);
        }
        c += 1;
    }
    std::array::from_fn(|r| reduce16(even[r], odd[r]))
}

/// `R` neighbouring MXFP4 rows against one permuted input `xp`, each bit-identical to
/// [`crate::mxfp4_contract::dot_row_ref`]; the input's loads are shared.
///
/// # Safety
/// As [`mxfp4_row_multi`] with one input row, for every row.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn mxfp4_dot_rows<const R: usize>(rows: [(&[u8], &[u8]); R], xp: &[f32]) -> [f32; R] {
    let table = e2m1_table();
    // SAFETY: `xp` holds `n_chunks` whole chunks; features as required.
    unsafe {
        mxfp4_rows(rows, xp.len() / CHUNK, |c, words| {
            // Every row decoded before any is summed: in this order the two-row kernel computes 5–7% faster than
            // decoding and summing row by row, and faster than with the rows' FMA chains interleaved
            // (`examples/kernel_compute.rs`; docs/performance-log.md).
            let mut decoded = [[_mm512_setzero_ps(); 8]; R];
            for (d, w) in decoded.iter_mut().zip(words) {
                *d = decode(w, table);
            }
            let at = xp.as_ptr().add(c * CHUNK);
            let x: [__m512; 8] = std::array::from_fn(|s| _mm512_loadu_ps(at.add(s * CHUNK_LANES)));
            let mut sums = [_mm512_setzero_ps(); R];
            for (t, d) in sums.iter_mut().zip(&decoded) {
                *t = chunk_sum_loaded(d, &x);
            }
            sums
        })
    }
}

/// f32 values of one decoded chunk of an MXFP4 row ([`mxfp4_decode_rows`]): the contract's eight weight vectors,
/// then the chunk's per-lane scales.
pub const DECODED_CHUNK: usize = CHUNK + CHUNK_LANES;

/// Decodes whole MXFP4 rows (`(packed, scales)`, each `n_chunks` chunks, the last one possibly partial) for the
/// multi-token tiles: chunk `c` of row `r` becomes [`DECODED_CHUNK`] values at `out[(r · n_chunks + c) ·
/// DECODED_CHUNK ..]`, the eight weight vectors of [`crate::mxfp4_contract`] (exact) and the lane scales (exact).
///
/// # Safety
/// The CPU must support AVX-512F/BW; `out` holds `rows.len() · n_chunks · DECODED_CHUNK` values.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub unsafe fn mxfp4_decode_rows(rows: &[(&[u8], &[u8])], n_chunks: usize, out: &mut [f32]) {
    let table = e2m1_table();
    for (r, (packed, scales)) in rows.iter().enumerate() {
        let mut s16 = _mm512_setzero_ps();
        for c in 0..n_chunks {
            if c % 4 == 0 {
                s16 = scales16(scales, c * 4);
            }
            // SAFETY: chunk c of the row (masked at its end); the caller sized `out`.
            unsafe {
                let w = decode(chunk_words(packed, c), table);
                let at = out.as_mut_ptr().add((r * n_chunks + c) * DECODED_CHUNK);
                for (s, v) in w.iter().enumerate() {
                    _mm512_storeu_ps(at.add(s * CHUNK_LANES), *v);
                }
                _mm512_storeu_ps(at.add(CHUNK), chunk_scale(s16, c % 4));
            }
        }
    }
}

/// Chunks `c0 .. c1` of `R` decoded MXFP4 rows ([`mxfp4_decode_rows`]; row `r` starts at `rows[r]`) against `T`
/// permuted inputs ([`crate::mxfp4_contract::permute_input`]): the multi-token form of [`mxfp4_dot_rows`], for
/// prefill, where a row is decoded once for every token routed to its expert. Each (row, input) pair follows the
/// contract exactly: per chunk `te`/`to` chains from a product, then `acc[c % 2] = fma(te + to, scale, acc[c % 2])`
/// with `acc[r * stride + t]` read at the start and written back at the end (so a caller can walk the chunks in
/// blocks that keep the inputs in L1); [`bf16_finish`]'s reduction is the contract's too.
///
/// # Safety
/// The CPU must support AVX-512F; every decoded row holds `c1` chunks and every input `c1 · 128` values;
/// `acc` holds `(R - 1) * stride + T` entries.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn mxfp4_tile<const R: usize, const T: usize>(
    rows: [&[f32]; R],
    xps: [&[f32]; T],
    (c0, c1): (usize, usize),
    acc: &mut [Bf16Acc],
    stride: usize,
) {
    // The even and odd accumulators apart, for `by_parity`.
    let mut even: [[__m512; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| acc[r * stride + t][0]));
    let mut odd: [[__m512; T]; R] =
        std::array::from_fn(|r| std::array::from_fn(|t| acc[r * stride + t][1]));
    // Chunk c's `te + to` of every pair, scaled into `into`.
    let step = |c: usize, into: &mut [[__m512; T]; R]| {
        // SAFETY (caller): chunk c of every decoded row and every input lies in it.
        unsafe {
            let w = rows.map(|p| p.as_ptr().add(c * DECODED_CHUNK));
            let x = xps.map(|p| p.as_ptr().add(c * CHUNK));
            let z = _mm512_setzero_ps();
            let (mut te, mut to) = ([[z; T]; R], [[z; T]; R]);
            for s in 0..CODES_PER_LANE {
                let ws: [__m512; R] =
                    std::array::from_fn(|r| _mm512_loadu_ps(w[r].add(s * CHUNK_LANES)));
                for t in 0..T {
                    let xs = _mm512_loadu_ps(x[t].add(s * CHUNK_LANES));
                    for r in 0..R {
                        let acc_s = if s % 2 == 0 {
                            &mut te[r][t]
                        } else {
                            &mut to[r][t]
                        };
                        *acc_s = if s < 2 {
                            _mm512_mul_ps(ws[r], xs)
                        } else {
                            _mm512_fmadd_ps(ws[r], xs, *acc_s)
                        };
                    }
                }
            }
            for r in 0..R {
                let scale = _mm512_loadu_ps(w[r].add(CHUNK));
                for t in 0..T {
                    let sum = _mm512_add_ps(te[r][t], to[r][t]);
                    into[r][t] = _mm512_fmadd_ps(sum, scale, into[r][t]);
                }
            }
        }
    };
    by_parity(c0, c1, |c, is_odd| {
        step(c, if is_odd { &mut odd } else { &mut even })
    });
    for r in 0..R {
        for t in 0..T {
            acc[r * stride + t] = [even[r][t], odd[r][t]];
        }
    }
}

/// The four decoded weight-pair vectors of one chunk for the bf16-input contract: vector `j` holds, in lane `k`,
/// weight `j` of the lane (low half) and weight `j + 4` (high half) as bf16, straight from the word permute.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn decode_pairs(words: __m512i, table: __m512i) -> [__m512bh; 4] {
    // SAFETY: both are 512-bit plain-data vectors; the lanes are bf16 bit patterns.
    permute_codes(words, table).map(|v| unsafe { std::mem::transmute::<__m512i, __m512bh>(v) })
}

/// The word permute of the pair contracts: vector `j` holds, in lane `k`, `table[code j]` (low half) and
/// `table[code j + 4]` (high half) of the lane's eight codes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn permute_codes(words: __m512i, table: __m512i) -> [__m512i; 4] {
    let p = |v: __m512i| _mm512_permutexvar_epi16(v, table);
    [
        p(words),
        p(_mm512_srli_epi16::<4>(words)),
        p(_mm512_srli_epi16::<8>(words)),
        p(_mm512_srli_epi16::<12>(words)),
    ]
}

/// `t` of one chunk under the bf16-input contract: four pair products into one chain.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn pair_sum(w: &[__m512bh; 4], x: &[__m512bh; 4]) -> __m512 {
    let mut t = _mm512_setzero_ps();
    for j in 0..4 {
        t = _mm512_dpbf16_ps(t, w[j], x[j]);
    }
    t
}

/// The four input vectors of chunk `c` of a paired bf16 input.
///
/// # Safety
/// Words `64c .. 64c + 64` must lie in `xb`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn input_pairs(xb: &[u32], c: usize) -> [__m512bh; 4] {
    std::array::from_fn(|j| {
        // SAFETY: the caller guarantees the chunk's 64 words; the vectors are plain data.
        unsafe {
            let v =
                _mm512_loadu_si512(xb.as_ptr().add(c * CHUNK_WORDS + j * CHUNK_LANES) as *const _);
            std::mem::transmute::<__m512i, __m512bh>(v)
        }
    })
}

/// `R` neighbouring MXFP4 rows against one paired bf16 input `xb`, each bit-identical to
/// [`crate::mxfp4_bf16_contract::dot_row_ref`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512 BF16, AVX2 and FMA; `xb.len() == chunks(cols) * 64`; each row
/// is one row's `packed` and `scales` (no scale byte 255).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub unsafe fn mxfp4_bf16_dot_rows<const R: usize>(
    rows: [(&[u8], &[u8]); R],
    xb: &[u32],
) -> [f32; R] {
    let table = e2m1_table();
    // SAFETY: `xb` holds `n_chunks` whole chunks; features as required.
    unsafe {
        mxfp4_rows(rows, xb.len() / CHUNK_WORDS, |c, words| {
            let x = input_pairs(xb, c);
            per_row(words, |w| pair_sum(&decode_pairs(w, table), &x))
        })
    }
}

/// One MXFP4 row against rows of the paired bf16 input: `out[t] = row · x_t`, where `x_t` is
/// `xbs[t * xb_len ..][.. xb_len]`. Bit-identical to [`crate::mxfp4_bf16_contract::dot_row_ref`] for each `t`; each
/// chunk is decoded once for all `t`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512 BF16, AVX2 and FMA; `xb_len == chunks(cols) * 64`,
/// `xbs.len() >= out.len() * xb_len`; `packed` and `scales` are one row's bytes (no scale byte 255).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub unsafe fn mxfp4_bf16_row_multi(
    packed: &[u8],
    scales: &[u8],
    xbs: &[u32],
    xb_len: usize,
    out: &mut [f32],
) {
    let table = e2m1_table();
    // SAFETY: every input holds `xb_len / CHUNK_WORDS` whole chunks (the caller's lengths); features as required.
    unsafe {
        mxfp4_one_row(
            (packed, scales),
            xb_len / CHUNK_WORDS,
            out,
            |words| decode_pairs(words, table),
            |w, t, c| pair_sum(w, &input_pairs(&xbs[t * xb_len..], c)),
        )
    }
}

/// Twice the E2M1 values as int16, twice over (the word permute reads five index bits; the fifth is the next code's
/// lowest bit, so both halves must agree).
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_doubled_table() -> __m512i {
    // A constant, so that the compiler keeps it in the binary instead of building it on every call.
    const BOTH: [i16; 32] = {
        let mut both = [0i16; 32];
        let mut i = 0;
        while i < 32 {
            both[i] = crate::mxfp4_i16_contract::E2M1_DOUBLED[i % 16];
            i += 1;
        }
        both
    };
    // SAFETY: `BOTH` holds 64 bytes.
    unsafe { _mm512_loadu_si512(BOTH.as_ptr() as *const _) }
}

/// The four pair vectors and the lane multipliers of chunk `c` of a quantised input.
///
/// # Safety
/// Words `80c .. 80c + 80` must lie in `xq`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn input_i16(xq: &[u32], c: usize) -> ([__m512i; 4], __m512) {
    use crate::mxfp4_i16_contract::{CHUNK_WORDS, PAIR_WORDS};
    // SAFETY: the caller guarantees the chunk's 80 words.
    unsafe {
        let p = xq.as_ptr().add(c * CHUNK_WORDS);
        (
            std::array::from_fn(|j| _mm512_loadu_si512(p.add(j * CHUNK_LANES) as *const _)),
            _mm512_loadu_ps(p.add(PAIR_WORDS) as *const f32),
        )
    }
}

/// `u` of one chunk under the int16 contract: the exact integer sum of the pair products (two `vpdpwssd` chains;
/// integer addition is exact in any order), converted and multiplied by the lanes' multipliers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn i16_chunk(w: &[__m512i; 4], (x, m): &([__m512i; 4], __m512)) -> __m512 {
    let mut t = _mm512_madd_epi16(w[0], x[0]);
    for j in 1..4 {
        t = dpwssd(t, w[j], x[j]);
    }
    _mm512_mul_ps(_mm512_cvtepi32_ps(t), *m)
}

/// `acc + Σ pairs of a · b` (`vpdpwssd`), as one instruction. The intrinsic is split by the compiler into a multiply
/// (`vpmaddwd`) and an add unless it tunes for a CPU where the fused form is fast; the one-instruction form keeps the
/// int16-input MXFP4 kernel 10–15% faster on AMD Zen 5 (`examples/kernel_compute.rs`).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut out = acc;
    // SAFETY: `vpdpwssd` only reads its register operands and writes its destination; the caller's target features
    // include AVX-512 VNNI, which the instruction needs.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) out,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

/// `R` neighbouring MXFP4 rows against one quantised input `xq`, each bit-identical to
/// [`crate::mxfp4_i16_contract::dot_row_ref`].
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512 VNNI, AVX2 and FMA; `xq.len() == chunks(cols) * 80`; each row
/// is one row's `packed` and `scales` (no scale byte 255).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn mxfp4_i16_dot_rows<const R: usize>(
    rows: [(&[u8], &[u8]); R],
    xq: &[u32],
) -> [f32; R] {
    use crate::mxfp4_i16_contract::CHUNK_WORDS;
    let table = e2m1_doubled_table();
    // SAFETY: `xq` holds `n_chunks` whole chunks; features as required.
    unsafe {
        mxfp4_rows(rows, xq.len() / CHUNK_WORDS, |c, words| {
            let x = input_i16(xq, c);
            per_row(words, |w| i16_chunk(&permute_codes(w, table), &x))
        })
    }
}

/// One MXFP4 row against rows of the quantised input: `out[t] = row · x_t`, where `x_t` is
/// `xqs[t * xq_len ..][.. xq_len]`. Bit-identical to [`crate::mxfp4_i16_contract::dot_row_ref`] for each `t`; each
/// chunk is decoded once for all `t`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX-512 VNNI, AVX2 and FMA; `xq_len == chunks(cols) * 80`,
/// `xqs.len() >= out.len() * xq_len`; `packed` and `scales` are one row's bytes (no scale byte 255).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn mxfp4_i16_row_multi(
    packed: &[u8],
    scales: &[u8],
    xqs: &[u32],
    xq_len: usize,
    out: &mut [f32],
) {
    use crate::mxfp4_i16_contract::CHUNK_WORDS;
    let table = e2m1_doubled_table();
    // SAFETY: every input holds `xq_len / CHUNK_WORDS` whole chunks (the caller's lengths); features as required.
    unsafe {
        mxfp4_one_row(
            (packed, scales),
            xq_len / CHUNK_WORDS,
            out,
            |words| permute_codes(words, table),
            |w, t, c| i16_chunk(w, &input_i16(&xqs[t * xq_len..], c)),
        )
    }
}

/// AVX-512 twin of [`crate::quantise::abs_max_ref`]: the maximum is exact, so its order is free.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn abs_max(x: &[f32]) -> Option<f32> {
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let inf = _mm512_set1_ps(f32::INFINITY);
    let mut amax = _mm512_setzero_ps();
    let mut bad: __mmask16 = 0;
    for at in (0..x.len()).step_by(16) {
        let mask = lanes_mask(x.len() - at);
        // SAFETY: only the lanes in the mask are read, all inside `x`; the others are 0.
        let v = unsafe { _mm512_maskz_loadu_ps(mask, x.as_ptr().add(at)) };
        let a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude));
        // NaN compares unordered, so "not less than infinity" catches NaN and both infinities.
        bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a, inf);
        amax = _mm512_max_ps(amax, a);
    }
    (bad == 0).then(|| _mm512_reduce_max_ps(amax))
}

/// AVX-512 twin of [`crate::quantise::quantise_ref`]: the same IEEE division, then ties away from zero as the
/// truncation plus one step towards the sign where the (exact) fraction is at least a half.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn quantise(x: &[f32], step: f32, q: &mut [i16]) {
    let n = x.len().min(q.len());
    let steps = _mm512_set1_ps(step);
    let sign = _mm512_set1_epi32(i32::MIN);
    let one = _mm512_set1_ps(1.0);
    let half = _mm512_set1_ps(0.5);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let (lo, hi) = (
        _mm512_set1_ps(-crate::quantise::Q_MAX),
        _mm512_set1_ps(crate::quantise::Q_MAX),
    );
    for at in (0..n).step_by(16) {
        let mask = lanes_mask(n - at);
        // SAFETY: only the lanes in the mask are read and written, all inside `x` and `q`.
        unsafe {
            let y = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, x.as_ptr().add(at)), steps);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(y, t)), magnitude);
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_castsi512_ps(frac), half);
            let away = _mm512_or_si512(
                _mm512_castps_si512(one),
                _mm512_and_si512(_mm512_castps_si512(y), sign),
            );
            let r = _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(away));
            let i = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            _mm512_mask_cvtsepi32_storeu_epi16(q.as_mut_ptr().add(at), mask, i);
        }
    }
}

/// The mask of the first `left.min(16)` lanes.
#[inline]
fn lanes_mask(left: usize) -> __mmask16 {
    if left >= 16 {
        u16::MAX
    } else {
        (1u16 << left) - 1
    }
}

/// The sum of sixteen vectors in the lanes contracts' order (`v[k] + v[k + 8]`, then `+ 4`, `+ 2`, `+ 1`): the end of
/// a reduction of the products of many inputs (`avx512_tokens::finish`, `avx512_bf16_lanes::finish`), one input per
/// vector lane.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn halving_sum(mut v: [__m512; 16]) -> __m512 {
    let mut width = 8;
    while width > 0 {
        for k in 0..width {
            v[k] = _mm512_add_ps(v[k], v[k + width]);
        }
        width /= 2;
    }
    v[0]
}
