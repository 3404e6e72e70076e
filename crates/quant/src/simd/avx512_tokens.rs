//! AVX-512 MXFP4 products of many inputs with the inputs across the vector lanes (prefill, from 12 inputs per
//! matrix: `crate::mxfp4`'s `LANES_MIN_TOKENS`), in the layouts of [`crate::mxfp4_lanes`]: a vector's lanes are
//! sixteen inputs at one of the contract's lanes `k`, so each weight is broadcast from memory once and used by every
//! input, and the inputs' vectors are reused by four rows in registers (`rows4`, in `asm!`). Per input the
//! operations and their order are the contract's, so every result is bit-identical to
//! [`crate::mxfp4_contract::dot_row_ref`]. A task swaps lanes and chunks of its rows' packed words a block at a time
//! ([`transpose_block`]), so that a lane of a row's block is one cache line for [`decode_lane`].

use std::arch::x86_64::*;

use super::avx512::chunk_words;
use crate::mxfp4::{E2M1_TABLE, MXFP4_GROUP};
use crate::mxfp4_contract::{CHUNK, CHUNK_LANES, CODES_PER_LANE};
use crate::mxfp4_lanes::{
    BLOCK_CHUNKS_MAX, GROUP, acc_at, lane_stride, lane_weights, row_scales, row_scales_per_row,
};

/// 32-bit words of [`transpose_block`]`(rows, ..)`.
pub fn block_words(rows: usize) -> usize {
    rows * CHUNK_LANES * BLOCK_CHUNKS_MAX
}

/// The packed words of chunks `c0 .. c0 + nb` (`nb <=` [`BLOCK_CHUNKS_MAX`]) of MXFP4 rows (`(packed, scales)`) with
/// lanes and chunks swapped: word `k` of chunk `c0 + j` of row `r` at `(r · 16 + k) · 16 + j` of `words`
/// ([`block_words`]`(rows.len())` words), 0 past a row's end and past `nb`. One lane of a row's block is then one
/// cache line, which [`decode_lane`] reads for all of its chunks; decoding straight from the chunks read every
/// chunk's line once per lane.
///
/// # Safety
/// The CPU must support AVX-512F; `words` holds [`block_words`]`(rows.len())` words.
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose_block(rows: &[(&[u8], &[u8])], c0: usize, nb: usize, words: &mut [u32]) {
    debug_assert!(nb <= BLOCK_CHUNKS_MAX && words.len() >= block_words(rows.len()));
    for (r, (packed, _)) in rows.iter().enumerate() {
        let mut v: [__m512i; BLOCK_CHUNKS_MAX] = std::array::from_fn(|j| {
            if j < nb {
                // SAFETY: chunk words masked at the row's end (zero past it).
                unsafe { chunk_words(packed, c0 + j) }
            } else {
                _mm512_setzero_si512()
            }
        });
        transpose16(&mut v);
        for (k, lane) in v.iter().enumerate() {
            let at = (r * CHUNK_LANES + k) * BLOCK_CHUNKS_MAX;
            // SAFETY: `at .. at + 16` lies in row r's words.
            unsafe { _mm512_storeu_si512(words.as_mut_ptr().add(at) as *mut _, *lane) };
        }
    }
}

/// Transposes sixteen vectors of sixteen 32-bit words: word `k` of `v[j]` becomes word `j` of `v[k]`. Pairs of words,
/// then of pairs, within each 128-bit lane; then 128-bit lanes across four vectors in two steps.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose16(v: &mut [__m512i; 16]) {
    // After these two steps, lane `l` (128 bits) of `u[4q + m]` holds word `4l + m` of `v[4q .. 4q + 4]`.
    let mut u = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        let [r0, r1, r2, r3] = [v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]];
        let (t0, t1) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
        let (t2, t3) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
        u[4 * q] = _mm512_unpacklo_epi64(t0, t2);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t1, t3);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for m in 0..4 {
        let [a, b, c, d] = [u[m], u[4 + m], u[8 + m], u[12 + m]];
        let s0 = _mm512_shuffle_i32x4::<0x44>(a, b);
        let s1 = _mm512_shuffle_i32x4::<0xEE>(a, b);
        let s2 = _mm512_shuffle_i32x4::<0x44>(c, d);
        let s3 = _mm512_shuffle_i32x4::<0xEE>(c, d);
        v[m] = _mm512_shuffle_i32x4::<0x88>(s0, s2);
        v[4 + m] = _mm512_shuffle_i32x4::<0xDD>(s0, s2);
        v[8 + m] = _mm512_shuffle_i32x4::<0x88>(s1, s3);
        v[12 + m] = _mm512_shuffle_i32x4::<0xDD>(s1, s3);
    }
}

/// Decodes lane `k` of `rows` rows of a block of chunks from their [`transpose_block`] words (`words`: those rows'
/// words) into `w`, [`lane_weights`]`(rows)` values: weight `s` of chunk `j` of the block of row `r` at `(r · 8 + s) ·
/// 16 + j`. Exact; past a row's end and past the block the weights are 0, as the contract reads them. One shift and
/// one table permute decode code `s` of all sixteen chunks. A task decodes one lane of a few rows at a time, just
/// before the tiles that read it, so the decoded weights are written and read in L1: decoding a whole block of rows
/// at once wrote hundreds of KiB that missed L1, and those stores ran at a third of the rate of stores that hit it.
///
/// # Safety
/// The CPU must support AVX-512F; `words` holds [`block_words`]`(rows)` words and `w` [`lane_weights`]`(rows)`
/// values.
#[target_feature(enable = "avx512f")]
pub unsafe fn decode_lane(words: &[u32], rows: usize, k: usize, w: &mut [f32]) {
    debug_assert!(words.len() >= block_words(rows) && w.len() >= lane_weights(rows));
    // SAFETY: the table holds 16 f32.
    let table = unsafe { _mm512_loadu_ps(E2M1_TABLE.as_ptr()) };
    for r in 0..rows {
        // SAFETY: row r's lane k is 16 words in `words`.
        let line = unsafe {
            _mm512_loadu_si512(
                words[(r * CHUNK_LANES + k) * BLOCK_CHUNKS_MAX..].as_ptr() as *const _
            )
        };
        for s in 0..CODES_PER_LANE {
            // The permute reads the low four bits of each index: code s.
            let codes = _mm512_srlv_epi32(line, _mm512_set1_epi32(4 * s as i32));
            let v = _mm512_permutexvar_ps(codes, table);
            // SAFETY: `(r · 8 + s) · 16 .. + 16` lies in `w`.
            unsafe {
                _mm512_storeu_ps(
                    w.as_mut_ptr()
                        .add((r * CODES_PER_LANE + s) * BLOCK_CHUNKS_MAX),
                    v,
                )
            };
        }
    }
}

/// The multipliers of MXFP4 rows (`(packed, scales)` of `cols` weights each) into `sc`, [`row_scales`]`(cols)` per
/// row, group by group (lane `k` of chunk `c` uses group `4c + k / 4`); 1 past a row's end, as the contract reads
/// them.
///
/// # Safety
/// The CPU must support AVX-512F; `sc` holds `rows.len()` rows.
#[target_feature(enable = "avx512f")]
pub unsafe fn decode_scales(rows: &[(&[u8], &[u8])], cols: usize, sc: &mut [f32]) {
    let per_row = row_scales(cols);
    for (r, (_, scales)) in rows.iter().enumerate() {
        let sr = &mut sc[r * per_row..(r + 1) * per_row];
        for (g0, out) in (0..).step_by(16).zip(sr.chunks_mut(16)) {
            let mut m = [0.0f32; 16];
            // SAFETY: `m` holds 16 f32.
            unsafe { _mm512_storeu_ps(m.as_mut_ptr(), super::avx512::scales16(scales, g0)) };
            out.copy_from_slice(&m[..out.len()]);
        }
    }
}

/// One tile: rows `r0 .. r0 + R` of the task (`w`: lane `k` of the tile's `R` rows decoded over a block of chunks
/// from `c0`, [`decode_lane`]; `sc`: the task's multipliers) against groups `g0 .. g0 + V` of the inputs
/// (`xt`), lane `k`, chunks `c0 .. c1`, into the pairs' accumulators in `acc`. A row's first block (`c0 == 0`) starts
/// the pairs' accumulators at zero whatever `acc` holds, so a task need not clear them first (a memset of 393 KB per
/// task, 4% of a prefill). Four rows by one or two groups run in `rows4`; other shapes (a task's last rows) through
/// intrinsics.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; `w` holds `R` rows, `sc` rows `r0 .. r0 + R` and `xt` groups `g0 .. g0 +
/// V` of the layouts for `n_pad` chunks; `c1 <= n_pad`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn tile<const R: usize, const V: usize>(
    (w, sc): (&[f32], &[f32]),
    xt: &[f32],
    (r0, g0, k): (usize, usize, usize),
    (c0, c1): (usize, usize),
    n_pad: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!(c1 <= n_pad && c1 - c0 <= BLOCK_CHUNKS_MAX && w.len() >= lane_weights(R));
    debug_assert!(xt.len() >= (g0 + V) * CHUNK_LANES * lane_stride(n_pad));
    debug_assert!(acc.len() >= acc_at(r0 + R - 1, g0 + V - 1, groups, k) + 2 * GROUP);
    // Weight s of row r's lane k of chunk c is at `wr[r] + s · 16 + c`, the block starting at chunk c0.
    let wr: [*const f32; R] =
        std::array::from_fn(|r| w[lane_weights(r)..].as_ptr().wrapping_sub(c0));
    // Lane k of chunk c uses group 4c + k / 4 of the row.
    let sr: [*const f32; R] =
        std::array::from_fn(|r| sc[(r0 + r) * row_scales_per_row(n_pad) + k / 4..].as_ptr());
    let xg: [*const f32; V] =
        std::array::from_fn(|v| xt[((g0 + v) * CHUNK_LANES + k) * lane_stride(n_pad)..].as_ptr());
    let p = acc.as_mut_ptr();
    let at: [[usize; V]; R] =
        std::array::from_fn(|r| std::array::from_fn(|v| acc_at(r0 + r, g0 + v, groups, k)));
    // The even chunks, then the odd ones: the contract's two accumulators of a lane never meet before its
    // reduction, so one of them at a time is in registers (three vectors per pair with `te` and `to`, which lets a
    // tile hold eight pairs).
    if R == 4 && V <= 2 {
        let at4: [[usize; V]; 4] = std::array::from_fn(|r| at[r]);
        let x1 = if V == 2 { xg[V - 1] } else { xg[0] };
        // SAFETY: as the caller guarantees for this tile.
        return unsafe { tile_rows4::<V>((wr[0], sr[0]), (xg[0], x1), (c0, c1), n_pad, p, &at4) };
    }
    for parity in 0..2 {
        // SAFETY (every access below): the caller's layouts hold every address.
        let mut acc_v: [[__m512; V]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|v| {
                if c0 == 0 {
                    _mm512_setzero_ps()
                } else {
                    unsafe { _mm512_loadu_ps(p.add(at[r][v] + parity * GROUP)) }
                }
            })
        });
        let first = c0 + (c0 + parity) % 2;
        for c in (first..c1).step_by(2) {
            let z = _mm512_setzero_ps();
            let (mut te, mut to) = ([[z; V]; R], [[z; V]; R]);
            for s in 0..CODES_PER_LANE {
                let xs: [__m512; V] = std::array::from_fn(|v| unsafe {
                    _mm512_loadu_ps(xg[v].add((c * CODES_PER_LANE + s) * GROUP))
                });
                for r in 0..R {
                    let b =
                        unsafe { _mm512_set1_ps(*wr[r].wrapping_add(s * BLOCK_CHUNKS_MAX + c)) };
                    for v in 0..V {
                        let t = if s % 2 == 0 {
                            &mut te[r][v]
                        } else {
                            &mut to[r][v]
                        };
                        *t = if s < 2 {
                            _mm512_mul_ps(b, xs[v])
                        } else {
                            _mm512_fmadd_ps(b, xs[v], *t)
                        };
                    }
                }
            }
            for r in 0..R {
                let scale = unsafe { _mm512_set1_ps(*sr[r].add(4 * c)) };
                for v in 0..V {
                    acc_v[r][v] =
                        _mm512_fmadd_ps(_mm512_add_ps(te[r][v], to[r][v]), scale, acc_v[r][v]);
                }
            }
        }
        for r in 0..R {
            for v in 0..V {
                unsafe { _mm512_storeu_ps(p.add(at[r][v] + parity * GROUP), acc_v[r][v]) };
            }
        }
    }
}

/// One row's part of a step of a four-row tile in `asm!` text: its weight broadcast once into zmm26 (from byte `$off`
/// of `$w`), then `$op` (`vmulps` for codes 0 and 1, `vfmadd231ps` after) of it with each input register `zmm$x` into
/// the pair's `te` or `to` register `zmm$t`.
#[rustfmt::skip]
macro_rules! row_products {
    ($w:literal, $off:literal, $op:literal, $($t:literal $x:literal)+) => {
        concat!(
            "vbroadcastss zmm26, dword ptr [", $w, " + ", $off, "]\n",
            $($op, " zmm", $t, ", zmm26, zmm", $x, "\n",)+
        )
    };
}

/// One step `s` of a four-row tile in `asm!` text: the groups' inputs of code `s` (byte `$x` of each group's chunk)
/// into zmm24 (and zmm25), then every row's products ([`row_products`], weight `s` at byte `$w` from the row's chunk) into
/// the `te` or `to` registers `zmm$t`, pairs in order.
#[rustfmt::skip]
macro_rules! step_rows4 {
    (1, $x:literal, $w:literal, $op:literal, $t0:literal $t1:literal $t2:literal $t3:literal) => {
        concat!(
            "vmovups zmm24, zmmword ptr [{xa} + ", $x, "]\n",
            row_products!("{wa}", $w, $op, $t0 "24"),
            row_products!("{wa} + {ws}", $w, $op, $t1 "24"),
            row_products!("{wb}", $w, $op, $t2 "24"),
            row_products!("{wb} + {ws}", $w, $op, $t3 "24"),
        )
    };
    (2, $x:literal, $w:literal, $op:literal,
     $t0:literal $t1:literal $t2:literal $t3:literal $t4:literal $t5:literal $t6:literal $t7:literal) => {
        concat!(
            "vmovups zmm24, zmmword ptr [{xa} + ", $x, "]\n",
            "vmovups zmm25, zmmword ptr [{xa} + {xs} + ", $x, "]\n",
            row_products!("{wa}", $w, $op, $t0 "24" $t1 "25"),
            row_products!("{wa} + {ws}", $w, $op, $t2 "24" $t3 "25"),
            row_products!("{wb}", $w, $op, $t4 "24" $t5 "25"),
            row_products!("{wb} + {ws}", $w, $op, $t6 "24" $t7 "25"),
        )
    };
}

/// One row's end of a chunk in `asm!` text: its multiplier broadcast into zmm27 (from `$s`), then per pair `acc =
/// fma(te + to, multiplier, acc)` into accumulator `zmm$a` (`te` in `zmm$e`, `to` in `zmm$o`, the sum in zmm28).
#[rustfmt::skip]
macro_rules! row_scaled {
    ($s:literal, $($a:literal $e:literal $o:literal)+) => {
        concat!(
            "vbroadcastss zmm27, dword ptr [", $s, "]\n",
            $("vaddps zmm28, zmm", $e, ", zmm", $o, "\n", "vfmadd231ps zmm", $a, ", zmm28, zmm27\n",)+
        )
    };
}

/// The end of a chunk of a four-row tile in `asm!` text: every row's scaled accumulate ([`row_scaled`]), then the
/// pointers move two chunks on (the next chunk of the same parity) and the loop repeats `{n}` times.
#[rustfmt::skip]
macro_rules! finish_rows4 {
    (1) => {
        concat!(
            row_scaled!("{sa}", "0" "8" "16"),
            row_scaled!("{sa} + {ss}", "1" "9" "17"),
            row_scaled!("{sb}", "2" "10" "18"),
            row_scaled!("{sb} + {ss}", "3" "11" "19"),
            finish_rows4!(next),
        )
    };
    (2) => {
        concat!(
            row_scaled!("{sa}", "0" "8" "16" "1" "9" "17"),
            row_scaled!("{sa} + {ss}", "2" "10" "18" "3" "11" "19"),
            row_scaled!("{sb}", "4" "12" "20" "5" "13" "21"),
            row_scaled!("{sb} + {ss}", "6" "14" "22" "7" "15" "23"),
            finish_rows4!(next),
        )
    };
    (next) => {
        concat!(
            "add {xa}, 1024\n", "add {wa}, 8\n", "add {wb}, 8\n", "add {sa}, 32\n", "add {sb}, 32\n",
            "dec {n}\n", "jnz 2b\n",
        )
    };
}

/// Four rows against `V` (1 or 2) groups over the chunks of one parity, in `asm!` so that every vector has a fixed
/// register: 4·V accumulators (zmm0..), 4·V `te` (zmm8..) and `to` (zmm16..), the inputs, one broadcast weight and one
/// multiplier, 29 registers at most. Written with intrinsics, LLVM hoisted a chunk's input loads or folded each weight
/// broadcast into every FMA, and the tile spilled or went load-bound. Per lane the operations are the contract's:
/// `te = w0·x0`, `fma(w2, x2, te)`, …; `to` likewise; `acc = fma(te + to, scale, acc)`.
///
/// # Safety
/// The CPU must support AVX-512F; `n >= 1` chunks of the parity from the pointers: `x` (group 0 at chunk `c`, group 1
/// at `x + xs` bytes), `w` (row 0's weight 0 at chunk `c`, weight `s` 64 · `s` bytes on, row `r` at `w + r · ws`
/// bytes), `sc` (row 0's multiplier of lane `k` at chunk `c`, row `r` at `sc + r · ss` bytes); each chunk after the
/// next at 1024, 8 and 32 bytes on.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn rows4<const V: usize>(
    acc: &mut [__m512; 8],
    (x, xs): (*const f32, usize),
    (w, ws): (*const f32, usize),
    (sc, ss): (*const f32, usize),
    n: usize,
) {
    let [
        mut a0,
        mut a1,
        mut a2,
        mut a3,
        mut a4,
        mut a5,
        mut a6,
        mut a7,
    ] = *acc;
    // SAFETY (both arms): the caller guarantees every address the loop reads.
    unsafe {
        if V == 2 {
            std::arch::asm!(
                "2:",
                step_rows4!(2, "0", "0", "vmulps", "8" "9" "10" "11" "12" "13" "14" "15"),
                step_rows4!(2, "64", "64", "vmulps", "16" "17" "18" "19" "20" "21" "22" "23"),
                step_rows4!(2, "128", "128", "vfmadd231ps", "8" "9" "10" "11" "12" "13" "14" "15"),
                step_rows4!(2, "192", "192", "vfmadd231ps", "16" "17" "18" "19" "20" "21" "22" "23"),
                step_rows4!(2, "256", "256", "vfmadd231ps", "8" "9" "10" "11" "12" "13" "14" "15"),
                step_rows4!(2, "320", "320", "vfmadd231ps", "16" "17" "18" "19" "20" "21" "22" "23"),
                step_rows4!(2, "384", "384", "vfmadd231ps", "8" "9" "10" "11" "12" "13" "14" "15"),
                step_rows4!(2, "448", "448", "vfmadd231ps", "16" "17" "18" "19" "20" "21" "22" "23"),
                finish_rows4!(2),
                xa = inout(reg) x => _, xs = in(reg) xs,
                wa = inout(reg) w => _, wb = inout(reg) w.wrapping_byte_add(2 * ws) => _, ws = in(reg) ws,
                sa = inout(reg) sc => _, sb = inout(reg) sc.wrapping_byte_add(2 * ss) => _, ss = in(reg) ss,
                n = inout(reg) n => _,
                inout("zmm0") a0, inout("zmm1") a1, inout("zmm2") a2, inout("zmm3") a3,
                inout("zmm4") a4, inout("zmm5") a5, inout("zmm6") a6, inout("zmm7") a7,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _,
                options(nostack, readonly),
            );
        } else {
            std::arch::asm!(
                "2:",
                step_rows4!(1, "0", "0", "vmulps", "8" "9" "10" "11"),
                step_rows4!(1, "64", "64", "vmulps", "16" "17" "18" "19"),
                step_rows4!(1, "128", "128", "vfmadd231ps", "8" "9" "10" "11"),
                step_rows4!(1, "192", "192", "vfmadd231ps", "16" "17" "18" "19"),
                step_rows4!(1, "256", "256", "vfmadd231ps", "8" "9" "10" "11"),
                step_rows4!(1, "320", "320", "vfmadd231ps", "16" "17" "18" "19"),
                step_rows4!(1, "384", "384", "vfmadd231ps", "8" "9" "10" "11"),
                step_rows4!(1, "448", "448", "vfmadd231ps", "16" "17" "18" "19"),
                finish_rows4!(1),
                xa = inout(reg) x => _,
                wa = inout(reg) w => _, wb = inout(reg) w.wrapping_byte_add(2 * ws) => _, ws = in(reg) ws,
                sa = inout(reg) sc => _, sb = inout(reg) sc.wrapping_byte_add(2 * ss) => _, ss = in(reg) ss,
                n = inout(reg) n => _,
                inout("zmm0") a0, inout("zmm1") a1, inout("zmm2") a2, inout("zmm3") a3,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                out("zmm24") _, out("zmm26") _, out("zmm27") _, out("zmm28") _,
                options(nostack, readonly),
            );
        }
    }
    *acc = [a0, a1, a2, a3, a4, a5, a6, a7];
}

/// [`tile`] for four rows and one or two groups through [`rows4`]: `w`, `sc` where row 0 of the tile would hold
/// chunk 0 of lane `k` ([`lane_weights`]`(1)` values per row in `w`), `x` at each group's block (lane `k`, chunk 0), `at`
/// where each pair's accumulators lie in `acc`.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx512f")]
unsafe fn tile_rows4<const V: usize>(
    (w, sc): (*const f32, *const f32),
    (x0, x1): (*const f32, *const f32),
    (c0, c1): (usize, usize),
    n_pad: usize,
    acc: *mut f32,
    at: &[[usize; V]; 4],
) {
    let f = std::mem::size_of::<f32>();
    let ws = lane_weights(1) * f;
    let ss = row_scales_per_row(n_pad) * f;
    let xs = (x1 as usize).wrapping_sub(x0 as usize);
    // A row's first block starts from zero (see [`tile`]); a parity with no chunk in it still stores its zeros.
    let fresh = c0 == 0;
    for parity in 0..2 {
        let first = c0 + (c0 + parity) % 2;
        if first >= c1 && !fresh {
            continue;
        }
        let mut regs = [_mm512_setzero_ps(); 8];
        if !fresh {
            for r in 0..4 {
                for v in 0..V {
                    // SAFETY: the caller's `acc` holds every pair.
                    regs[r * V + v] =
                        unsafe { _mm512_loadu_ps(acc.add(at[r][v] + parity * GROUP)) };
                }
            }
        }
        if first < c1 {
            // SAFETY: the caller's layouts hold `n` chunks of this parity from `first` for every row and group.
            unsafe {
                rows4::<V>(
                    &mut regs,
                    (x0.add(first * CODES_PER_LANE * GROUP), xs),
                    (w.wrapping_add(first), ws),
                    (sc.add(first * CHUNK / MXFP4_GROUP), ss),
                    (c1 - first).div_ceil(2),
                )
            };
        }
        for r in 0..4 {
            for v in 0..V {
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(acc.add(at[r][v] + parity * GROUP), regs[r * V + v]) };
            }
        }
    }
}

/// The contract's reduction of pair (`r`, `g`)'s sixteen lanes, for its sixteen inputs: `out[t]` for input `16g +
/// t`.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds the pair.
#[target_feature(enable = "avx512f")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    let p = acc.as_ptr();
    // SAFETY: the caller's `acc` holds the pair's 32 vectors.
    let v: [__m512; CHUNK_LANES] = std::array::from_fn(|k| unsafe {
        let at = acc_at(r, g, groups, k);
        _mm512_add_ps(
            _mm512_loadu_ps(p.add(at)),
            _mm512_loadu_ps(p.add(at + GROUP)),
        )
    });
    let mut out = [0.0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), super::avx512::halving_sum(v)) };
    out
}
