//! AVX2 MXFP4 products of many inputs with the inputs across the vector lanes (prefill on CPUs without AVX-512),
//! in the layouts of [`crate::mxfp4_lanes`]: a group of sixteen inputs at one of the contract's lanes `k` is two
//! 256-bit halves, each decoded weight is broadcast from memory once for both, and the halves are reused by two rows
//! in registers or two groups share a row's weights (`rows2`, `row_groups2`, in `asm!`). Per input the operations and
//! their order are the contract's, so every result is bit-identical to [`crate::mxfp4_contract::dot_row_ref`].
//!
//! Without the lanes every input of a prefill decoded every weight again (one product at a time), a sixth of the
//! FMA peak on an AMD Zen 3 core; here a weight is decoded once per task and block.

use std::arch::x86_64::*;

use super::avx2::{E2m1Bytes, decode_half_chunk};
use crate::mxfp4::MXFP4_GROUP;
use crate::mxfp4_contract::{CHUNK, CHUNK_BYTES, CHUNK_LANES, CODES_PER_LANE, group_scale};
use crate::mxfp4_lanes::{
    BLOCK_CHUNKS_MAX, GROUP, acc_at, lane_stride, lane_weights, row_scales, row_scales_per_row,
};

/// Inputs per 256-bit vector: half a group.
const HALF: usize = GROUP / 2;

/// Decodes lane `k` of chunks `c0 .. c0 + nb` (`nb <=` [`BLOCK_CHUNKS_MAX`]) of MXFP4 rows (`(packed, scales)`) into
/// `w`, [`lane_weights`]`(rows.len())` values: weight `s` of chunk `c0 + j` of row `r` at `(r · 8 + s) · 16 + j`.
/// Exact; past a row's end and past `nb` the weights are 0, as the contract reads them. The lane's words are read
/// one by one (one per chunk line, which the tiles of every lane of the block read again from L1; two gathers were no
/// faster), then eight chunks' words are decoded at once by byte lookups (`avx2::decode_half_chunk`: the same eight
/// 32-bit words of eight codes as eight lanes of a half chunk).
///
/// # Safety
/// The CPU must support AVX2; `w` holds [`lane_weights`]`(rows.len())` values.
#[target_feature(enable = "avx2")]
pub unsafe fn decode_lane(rows: &[(&[u8], &[u8])], c0: usize, nb: usize, k: usize, w: &mut [f32]) {
    debug_assert!(nb <= BLOCK_CHUNKS_MAX && w.len() >= lane_weights(rows.len()));
    let tables = E2m1Bytes::new();
    for (r, (packed, _)) in rows.iter().enumerate() {
        let mut words = [0u32; BLOCK_CHUNKS_MAX];
        for (j, d) in words.iter_mut().enumerate().take(nb) {
            let at = (c0 + j) * CHUNK_BYTES + 4 * k;
            if let Some(b) = packed.get(at..at + 4) {
                *d = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        for half in 0..2 {
            // SAFETY: `words` holds 16 words.
            let line =
                unsafe { _mm256_loadu_si256(words.as_ptr().add(HALF * half) as *const __m256i) };
            for (s, &v) in decode_half_chunk(&tables, line).iter().enumerate() {
                // SAFETY: `(r · 8 + s) · 16 + 8 · half .. + 8` lies in `w`.
                unsafe {
                    _mm256_storeu_ps(
                        w.as_mut_ptr()
                            .add((r * CODES_PER_LANE + s) * BLOCK_CHUNKS_MAX + HALF * half),
                        v,
                    )
                };
            }
        }
    }
}

/// The multipliers of MXFP4 rows (`(packed, scales)` of `cols` weights each) into `sc`, [`row_scales`]`(cols)` per
/// row, group by group; 1 past a row's end, as the contract reads them.
pub fn decode_scales(rows: &[(&[u8], &[u8])], cols: usize, sc: &mut [f32]) {
    let per_row = row_scales(cols);
    for (r, (_, scales)) in rows.iter().enumerate() {
        for (g, m) in sc[r * per_row..(r + 1) * per_row].iter_mut().enumerate() {
            *m = group_scale(scales, g);
        }
    }
}

/// Every row of a task (`w`: lane `k` of its `rows` rows decoded over a block of chunks from `c0`, [`decode_lane`];
/// `sc`: its multipliers) against `H` (1 to 4) halves of groups of the inputs (`xt`) from group `g`'s first half,
/// lane `k`, chunks `c0 .. c1`, into the pairs' accumulators in `acc`: with four halves (two groups) one row at a
/// time (`row_groups2`), with two (one group) two rows at a time (`rows2`, an odd last row alone), with one or
/// three (the last inputs of a product, in halves of 8 so that few lanes go to waste) one row at a time
/// (`row_halves`). The halves' inputs over the block (4 KiB each) stay in L1 while every row passes over them. A
/// row's first block (`c0 == 0`) starts the pairs' accumulators at zero whatever `acc` holds, so a task need not
/// clear them first. The even chunks run first, then the odd ones: the contract's two accumulators of a lane never
/// meet before its reduction. One row by two groups runs fastest on AMD Zen 3, where a broadcast from memory takes a
/// vector unit's slot: its weight serves four FMAs instead of two.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `w` holds `rows` rows, `sc` `rows` rows and `xt` groups `g .. g + H / 2` (the
/// last one whole) of the layouts for `n_pad` chunks; `c1 <= n_pad`, `c1 - c0 <=` [`BLOCK_CHUNKS_MAX`]; `acc` holds
/// the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tiles<const H: usize>(
    (w, sc): (&[f32], &[f32]),
    xt: &[f32],
    (rows, g, k): (usize, usize, usize),
    (c0, c1): (usize, usize),
    n_pad: usize,
    acc: &mut [f32],
    groups: usize,
) {
    // Groups touched (the last one perhaps by half).
    let v_groups = H.div_ceil(2);
    debug_assert!((1..=4).contains(&H) && c1 <= n_pad && c1 - c0 <= BLOCK_CHUNKS_MAX);
    debug_assert!(w.len() >= lane_weights(rows) && sc.len() >= rows * row_scales_per_row(n_pad));
    debug_assert!(xt.len() >= (g + v_groups) * CHUNK_LANES * lane_stride(n_pad));
    debug_assert!(
        rows == 0 || acc.len() >= acc_at(rows - 1, g + v_groups - 1, groups, k) + 2 * GROUP
    );
    let f = std::mem::size_of::<f32>();
    // Weight s of row r's lane k of chunk c is at `w + r · ws + s · 64 + 4c` bytes, the block starting at chunk c0.
    let ws = lane_weights(1) * f;
    // Lane k of chunk c of row r uses group 4c + k / 4 of the row, at `sc + r · ss` bytes.
    let ss = row_scales_per_row(n_pad) * f;
    let xp = xt[(g * CHUNK_LANES + k) * lane_stride(n_pad)..].as_ptr();
    // From one group's inputs to the next group's, in bytes.
    let xs = CHUNK_LANES * lane_stride(n_pad) * f;
    let p = acc.as_mut_ptr();
    let fresh = c0 == 0;
    // Row r's first input, weight and multiplier of the parity's first chunk, and the chunks of the parity.
    let starts = |r: usize, parity: usize| {
        let first = c0 + (c0 + parity) % 2;
        let w = w
            .as_ptr()
            .wrapping_byte_add(r * ws)
            .wrapping_sub(c0)
            .wrapping_add(first);
        let s = sc[k / 4..]
            .as_ptr()
            .wrapping_byte_add(r * ss)
            .wrapping_add(first * CHUNK / MXFP4_GROUP);
        let x = xp.wrapping_add(first * CODES_PER_LANE * GROUP);
        (x, w, s, c1.saturating_sub(first).div_ceil(2))
    };
    // Runs `$kernel` on the pairs (row, group) `$pairs` (the first `$n` of them), each parity's accumulators loaded
    // (unless fresh) into `regs` and stored after. A macro, not a closure: the kernels and the vectors stay inside
    // this function's target features.
    macro_rules! on_pairs {
        ($pairs:expr, $n:expr, |$regs:ident, $parity:ident| $kernel:expr) => {
            for $parity in 0..2 {
                let at: [usize; 2] = $pairs
                    .map(|(r, v): (usize, usize)| acc_at(r, g + v, groups, k) + $parity * GROUP);
                let mut $regs = [[_mm256_setzero_ps(); 2]; 2];
                if !fresh {
                    for (i, regs) in $regs.iter_mut().enumerate().take($n) {
                        for (half, a) in regs.iter_mut().enumerate() {
                            // SAFETY: the caller's `acc` holds every pair.
                            *a = unsafe { _mm256_loadu_ps(p.add(at[i] + HALF * half)) };
                        }
                    }
                }
                $kernel;
                for (i, regs) in $regs.iter().enumerate().take($n) {
                    for (half, a) in regs.iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { _mm256_storeu_ps(p.add(at[i] + HALF * half), *a) };
                    }
                }
            }
        };
    }
    // SAFETY (every kernel below): the caller's layouts hold `n` chunks of the parity from the starts, for every
    // row and group.
    if H == 2 {
        let mut r = 0;
        while r + 2 <= rows {
            on_pairs!([(r, 0), (r + 1, 0)], 2, |regs, parity| {
                let (x, w, s, n) = starts(r, parity);
                if n > 0 {
                    unsafe { rows2(&mut regs, x, (w, ws), (s, ss), n) };
                }
            });
            r += 2;
        }
        if r < rows {
            on_pairs!([(r, 0), (r, 0)], 1, |regs, parity| {
                let (x, w, s, n) = starts(r, parity);
                if n > 0 {
                    unsafe { row_halves::<2>(&mut regs, (x, xs), w, s, n) };
                }
            });
        }
        return;
    }
    for r in 0..rows {
        on_pairs!([(r, 0), (r, 1)], v_groups, |regs, parity| {
            let (x, w, s, n) = starts(r, parity);
            if n > 0 {
                if H == 4 {
                    unsafe { row_groups2(&mut regs, (x, xs), w, s, n) };
                } else {
                    unsafe { row_halves::<H>(&mut regs, (x, xs), w, s, n) };
                }
            }
        });
    }
}

/// Step `s` of a one-row, two-group tile in `asm!` text: the row's weight broadcast once into ymm12 (from byte `$w`),
/// then `$op` (`vmulps` for codes 0 and 1, `vfmadd231ps` after) of it with the four input halves of code `s` straight
/// from memory (byte `$x` of each group's chunk) into the `te` (even `s`: ymm4..8) or `to` (odd: ymm8..12) registers.
#[rustfmt::skip]
macro_rules! step_groups2 {
    ($x:literal, $w:literal, $op:literal, $t0:literal $t1:literal $t2:literal $t3:literal) => {
        concat!(
            "vbroadcastss ymm12, dword ptr [{w} + ", $w, "]\n",
            $op, " ymm", $t0, ", ymm12, ymmword ptr [{x} + ", $x, "]\n",
            $op, " ymm", $t1, ", ymm12, ymmword ptr [{x} + ", $x, " + 32]\n",
            $op, " ymm", $t2, ", ymm12, ymmword ptr [{x} + {xs} + ", $x, "]\n",
            $op, " ymm", $t3, ", ymm12, ymmword ptr [{x} + {xs} + ", $x, " + 32]\n",
        )
    };
}

/// One row against both halves of two groups over the chunks of one parity, in `asm!`: four accumulators (ymm0..4),
/// four `te` (ymm4..8) and four `to` (ymm8..12), one broadcast weight; the inputs are the FMAs' memory operands. Per
/// input the operations are the contract's.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `n >= 1` chunks of the parity from the pointers: `x` (group 0's inputs at chunk
/// `c`, group 1's `xs` bytes on), `w` (the row's weight 0 at chunk `c`, weight `s` 64 · `s` bytes on), `sc` (its
/// multiplier of lane `k` at chunk `c`); each chunk after the next at 1024, 8 and 32 bytes on.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_groups2(
    acc: &mut [[__m256; 2]; 2],
    (x, xs): (*const f32, usize),
    w: *const f32,
    sc: *const f32,
    n: usize,
) {
    let [[mut a0, mut a1], [mut a2, mut a3]] = *acc;
    // SAFETY: the caller guarantees every address the loop reads.
    unsafe {
        std::arch::asm!(
            "2:",
            step_groups2!("0", "0", "vmulps", "4" "5" "6" "7"),
            step_groups2!("64", "64", "vmulps", "8" "9" "10" "11"),
            step_groups2!("128", "128", "vfmadd231ps", "4" "5" "6" "7"),
            step_groups2!("192", "192", "vfmadd231ps", "8" "9" "10" "11"),
            step_groups2!("256", "256", "vfmadd231ps", "4" "5" "6" "7"),
            step_groups2!("320", "320", "vfmadd231ps", "8" "9" "10" "11"),
            step_groups2!("384", "384", "vfmadd231ps", "4" "5" "6" "7"),
            step_groups2!("448", "448", "vfmadd231ps", "8" "9" "10" "11"),
            "vbroadcastss ymm12, dword ptr [{s}]\n",
            "vaddps ymm4, ymm4, ymm8\n", "vfmadd231ps ymm0, ymm4, ymm12\n",
            "vaddps ymm5, ymm5, ymm9\n", "vfmadd231ps ymm1, ymm5, ymm12\n",
            "vaddps ymm6, ymm6, ymm10\n", "vfmadd231ps ymm2, ymm6, ymm12\n",
            "vaddps ymm7, ymm7, ymm11\n", "vfmadd231ps ymm3, ymm7, ymm12\n",
            "add {x}, 1024\n", "add {w}, 8\n", "add {s}, 32\n",
            "dec {n}\n", "jnz 2b\n",
            x = inout(reg) x => _, xs = in(reg) xs,
            w = inout(reg) w => _,
            s = inout(reg) sc => _,
            n = inout(reg) n => _,
            inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _,
            options(nostack, readonly),
        );
    }
    *acc = [[a0, a1], [a2, a3]];
}

/// One row's products of step `s` in `asm!` text: its weight broadcast once into ymm14 (from byte `$off` of `$w`),
/// then `$op` (`vmulps` for codes 0 and 1, `vfmadd231ps` after) of it with both halves (ymm12, ymm13) into the row's
/// `te` or `to` registers `ymm$t0` and `ymm$t1`.
#[rustfmt::skip]
macro_rules! row2_products {
    ($w:literal, $off:literal, $op:literal, $t0:literal $t1:literal) => {
        concat!(
            "vbroadcastss ymm14, dword ptr [", $w, " + ", $off, "]\n",
            $op, " ymm", $t0, ", ymm14, ymm12\n",
            $op, " ymm", $t1, ", ymm14, ymm13\n",
        )
    };
}

/// Step `s` of a two-row tile in `asm!` text: both halves of the inputs of code `s` (byte `$x` of the chunk) into
/// ymm12 and ymm13, then each row's products into its `te` (even `s`: ymm4..8) or `to` (odd: ymm8..12) registers.
#[rustfmt::skip]
macro_rules! step_rows2 {
    ($x:literal, $w:literal, $op:literal, $t0:literal $t1:literal $t2:literal $t3:literal) => {
        concat!(
            "vmovups ymm12, ymmword ptr [{x} + ", $x, "]\n",
            "vmovups ymm13, ymmword ptr [{x} + ", $x, " + 32]\n",
            row2_products!("{w}", $w, $op, $t0 $t1),
            row2_products!("{w} + {ws}", $w, $op, $t2 $t3),
        )
    };
}

/// Two rows against both halves of a group over the chunks of one parity, in `asm!` so that every vector has a fixed
/// register: four accumulators (ymm0..4), four `te` (ymm4..8) and four `to` (ymm8..12), the two input halves, one
/// broadcast weight: 15 of the 16 registers. Per input the operations are the contract's: `te = w0·x0`, `fma(w2, x2,
/// te)`, …; `to` likewise; `acc = fma(te + to, scale, acc)`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `n >= 1` chunks of the parity from the pointers: `x` (the group's inputs at
/// chunk `c`), `w` (row 0's weight 0 at chunk `c`, weight `s` 64 · `s` bytes on, row 1 `ws` bytes on), `sc` (row 0's
/// multiplier of lane `k` at chunk `c`, row 1 `ss` bytes on); each chunk after the next at 1024, 8 and 32 bytes on.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows2(
    acc: &mut [[__m256; 2]; 2],
    x: *const f32,
    (w, ws): (*const f32, usize),
    (sc, ss): (*const f32, usize),
    n: usize,
) {
    let [[mut a0, mut a1], [mut a2, mut a3]] = *acc;
    // SAFETY: the caller guarantees every address the loop reads.
    unsafe {
        std::arch::asm!(
            "2:",
            step_rows2!("0", "0", "vmulps", "4" "5" "6" "7"),
            step_rows2!("64", "64", "vmulps", "8" "9" "10" "11"),
            step_rows2!("128", "128", "vfmadd231ps", "4" "5" "6" "7"),
            step_rows2!("192", "192", "vfmadd231ps", "8" "9" "10" "11"),
            step_rows2!("256", "256", "vfmadd231ps", "4" "5" "6" "7"),
            step_rows2!("320", "320", "vfmadd231ps", "8" "9" "10" "11"),
            step_rows2!("384", "384", "vfmadd231ps", "4" "5" "6" "7"),
            step_rows2!("448", "448", "vfmadd231ps", "8" "9" "10" "11"),
            "vbroadcastss ymm14, dword ptr [{s}]\n",
            "vaddps ymm4, ymm4, ymm8\n", "vfmadd231ps ymm0, ymm4, ymm14\n",
            "vaddps ymm5, ymm5, ymm9\n", "vfmadd231ps ymm1, ymm5, ymm14\n",
            "vbroadcastss ymm14, dword ptr [{s} + {ss}]\n",
            "vaddps ymm6, ymm6, ymm10\n", "vfmadd231ps ymm2, ymm6, ymm14\n",
            "vaddps ymm7, ymm7, ymm11\n", "vfmadd231ps ymm3, ymm7, ymm14\n",
            "add {x}, 1024\n", "add {w}, 8\n", "add {s}, 32\n",
            "dec {n}\n", "jnz 2b\n",
            x = inout(reg) x => _,
            w = inout(reg) w => _, ws = in(reg) ws,
            s = inout(reg) sc => _, ss = in(reg) ss,
            n = inout(reg) n => _,
            inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _,
            options(nostack, readonly),
        );
    }
    *acc = [[a0, a1], [a2, a3]];
}

/// One row against the first `H` (1 to 3) halves of two groups, with intrinsics: a task's last, odd row against one
/// group (`H` 2), or the last inputs of a product. Per input the operations are the contract's.
///
/// # Safety
/// As [`row_groups2`] for the halves used.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_halves<const H: usize>(
    acc: &mut [[__m256; 2]; 2],
    (x, xs): (*const f32, usize),
    w: *const f32,
    sc: *const f32,
    n: usize,
) {
    // Half h: group h / 2, lanes 8 · (h % 2) ..
    let at = |h: usize| (h / 2) * xs + (h % 2) * HALF * std::mem::size_of::<f32>();
    for i in 0..n {
        // SAFETY (every access): the caller guarantees `n` chunks of the parity from the pointers.
        let (x, w) = unsafe { (x.add(i * 2 * CODES_PER_LANE * GROUP), w.add(2 * i)) };
        let xs = |s: usize, h: usize| unsafe {
            _mm256_loadu_ps(x.add(s * GROUP).wrapping_byte_add(at(h)))
        };
        let b = |s: usize| unsafe { _mm256_set1_ps(*w.add(s * BLOCK_CHUNKS_MAX)) };
        let scale = unsafe { _mm256_set1_ps(*sc.add(i * 2 * CHUNK / MXFP4_GROUP)) };
        let mut te = [_mm256_setzero_ps(); H];
        let mut to = [_mm256_setzero_ps(); H];
        for s in (0..CODES_PER_LANE).step_by(2) {
            let (be, bo) = (b(s), b(s + 1));
            for h in 0..H {
                if s == 0 {
                    te[h] = _mm256_mul_ps(be, xs(s, h));
                    to[h] = _mm256_mul_ps(bo, xs(s + 1, h));
                } else {
                    te[h] = _mm256_fmadd_ps(be, xs(s, h), te[h]);
                    to[h] = _mm256_fmadd_ps(bo, xs(s + 1, h), to[h]);
                }
            }
        }
        for h in 0..H {
            let a = &mut acc[h / 2][h % 2];
            *a = _mm256_fmadd_ps(_mm256_add_ps(te[h], to[h]), scale, *a);
        }
    }
}

/// The contract's reduction of pair (`r`, `g`)'s sixteen lanes, for its sixteen inputs: `out[t]` for input `16g +
/// t`.
///
/// # Safety
/// The CPU must support AVX2; `acc` holds the pair.
#[target_feature(enable = "avx2")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    debug_assert!(acc.len() >= acc_at(r, g, groups, CHUNK_LANES - 1) + 2 * GROUP);
    let p = acc.as_ptr();
    let mut out = [0.0f32; GROUP];
    for half in 0..2 {
        // SAFETY: the caller's `acc` holds the pair's 32 vectors of 16.
        let v: [__m256; CHUNK_LANES] = std::array::from_fn(|k| unsafe {
            let at = acc_at(r, g, groups, k) + HALF * half;
            _mm256_add_ps(
                _mm256_loadu_ps(p.add(at)),
                _mm256_loadu_ps(p.add(at + GROUP)),
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
