//! AVX2/FMA kernels (x86-64-v3). Each follows the contract in [`crate::dot`] exactly.

use std::arch::x86_64::*;

use crate::dot::{BLOCK, LANES};

/// Reduces four accumulators in the contract's order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce(a0: __m256, a1: __m256, a2: __m256, a3: __m256) -> f32 {
    let v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    // lanes l and l+4
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    // lanes l and l+2
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    // lane 0 + lane 1
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// Loads 8 f32 weights.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_f32(p: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 8 readable values at p.
    unsafe { _mm256_loadu_ps(p) }
}

/// Loads 8 bf16 weights (raw bits) as f32: zero-extend and shift into the high half (exact).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_bf16(p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 8 readable values (16 bytes) at p.
    unsafe {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

/// Loads 8 int8 weights as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load_i8(p: *const i8) -> __m256 {
    // SAFETY: the caller guarantees 8 readable bytes at p.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

/// The dot contract over weights read by `$load` from `$w` (a slice) and f32 `$x`; `$get` converts one weight for
/// the zero-padded tail.
macro_rules! dot_body {
    ($w:expr, $x:expr, $load:ident, $get:expr) => {{
        let (w, x) = ($w, $x);
        let n = w.len().min(x.len());
        let full = n / BLOCK * BLOCK;
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut b = 0;
        while b < full {
            // SAFETY: b + 32 <= full <= n for both slices.
            unsafe {
                a0 = _mm256_fmadd_ps($load(wp.add(b)), _mm256_loadu_ps(xp.add(b)), a0);
                a1 = _mm256_fmadd_ps($load(wp.add(b + 8)), _mm256_loadu_ps(xp.add(b + 8)), a1);
                a2 = _mm256_fmadd_ps($load(wp.add(b + 16)), _mm256_loadu_ps(xp.add(b + 16)), a2);
                a3 = _mm256_fmadd_ps($load(wp.add(b + 24)), _mm256_loadu_ps(xp.add(b + 24)), a3);
            }
            b += BLOCK;
        }
        let mut c = full;
        while c < n {
            // Zero-padded chunk of 8 into accumulator 0, as in the contract.
            let mut wb = [0.0f32; LANES];
            let mut xb = [0.0f32; LANES];
            for l in 0..LANES.min(n - c) {
                wb[l] = $get(w[c + l]);
                xb[l] = x[c + l];
            }
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
    }};
}

/// AVX2 twin of [`crate::dot::dot_f32_ref`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    dot_body!(w, x, load_f32, |v: f32| v)
}

/// AVX2 twin of [`crate::dot::dot_bf16_ref`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
    dot_body!(w, x, load_bf16, crate::dot::bf16_to_f32)
}

/// AVX2 twin of [`crate::dot::dot_i8_ref`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
    dot_body!(q, x, load_i8, |v: i8| v as f32)
}

/// AVX2 twin of the MXFP4 row dot (see [`crate::mxfp4`]): decodes each 32-group to exact f32 weights and follows
/// the dot contract (a 32-group is one full block).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `packed.len() * 2 == x.len()`, `scales.len() * 32 == x.len()`, no scale
/// byte is 255.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mxfp4_dot(packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    // Doubled E2M1 values as int8; multiplied by half the scale this is exact.
    let table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let low = _mm_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); 4];
    let xp = x.as_ptr();
    for (g, &e) in scales.iter().enumerate() {
        let hs = _mm256_set1_ps(crate::mxfp4::half_scale(e));
        // SAFETY: group g's 16 bytes lie in `packed` (lengths checked by the caller).
        let bytes = unsafe { _mm_loadu_si128(packed.as_ptr().add(g * 16) as *const __m128i) };
        let lo = _mm_and_si128(bytes, low);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        // Element order: byte j gives elements 2j (low nibble) and 2j+1 (high nibble).
        let codes_a = _mm_unpacklo_epi8(lo, hi); // elements 0..16
        let codes_b = _mm_unpackhi_epi8(lo, hi); // elements 16..32
        let vals_a = _mm_shuffle_epi8(table, codes_a);
        let vals_b = _mm_shuffle_epi8(table, codes_b);
        let parts = [
            vals_a,
            _mm_srli_si128(vals_a, 8),
            vals_b,
            _mm_srli_si128(vals_b, 8),
        ];
        for (a, (acc_a, v)) in acc.iter_mut().zip(parts).enumerate() {
            let w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), hs);
            // SAFETY: group g covers x[g*32 .. g*32 + 32].
            let xv = unsafe { _mm256_loadu_ps(xp.add(g * 32 + a * LANES)) };
            *acc_a = _mm256_fmadd_ps(w, xv, *acc_a);
        }
    }
    reduce(acc[0], acc[1], acc[2], acc[3])
}
