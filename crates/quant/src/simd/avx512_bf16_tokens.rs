//! AVX-512 bf16 products of many inputs with the inputs across the vector lanes (prefill's spine projections at 16
//! or more tokens).
//!
//! [`crate::bf16_contract`] keeps, for one row and one input, 32 independent lanes `j` (the even and odd
//! accumulators' 16 lanes each): lane `j` is one FMA chain over the chunks `c`, `acc = fma(w[32c + j], x[32c + j],
//! acc)`, and a fixed reduction of the lanes ends it. Here a vector holds sixteen *inputs* at one lane `j`, so each
//! weight is one broadcast load shared by every input of a tile, and six rows by four groups of inputs run in `asm!`
//! with fixed registers ([`rows6x4`]): 24 accumulators, one FMA per product, 10 loads per 24 FMAs. Per lane the
//! operations and their order are the contract's, so every result is bit-identical to
//! [`crate::bf16_contract::dot_ref`].
//!
//! Layouts (`n` chunks of 32 in a row):
//! - inputs ([`token_lanes`]): group `g` of 16 inputs, lane `j`, chunk `c`, input `t` at `(g · 32 + j) · stride + c ·
//!   16 + t` (`stride` = `n · 16` and one line, so the blocks of a tile do not share L1 sets);
//! - rows, a block of `nb` chunks at a time ([`decode_block`]): lane `j` of chunk `c0 + i` of row `r` at
//!   `(r · 32 + j) · nb + i`, as exact f32.

use std::arch::x86_64::*;

use rayon::prelude::*;

use crate::aligned::Lines;
use crate::bf16_contract::{CHUNK, LANES};

/// Inputs per vector (one group).
pub const GROUP: usize = 16;

/// Values of one (group, lane) block of the inputs' layout: its chunks and one cache line more.
fn lane_stride(n: usize) -> usize {
    n * GROUP + GROUP
}

/// Values of [`token_lanes`]`(_, cols, t_rows)`.
pub fn token_lanes_len(cols: usize, t_rows: usize) -> usize {
    t_rows.div_ceil(GROUP) * CHUNK * lane_stride(cols.div_ceil(CHUNK))
}

/// `t_rows` inputs of `cols` values (`x`, row-major) in the inputs' layout (module header), zero past the row and
/// past the last input; built in parallel, one (group, lane) block per task.
pub fn token_lanes(x: &[f32], cols: usize, t_rows: usize) -> Lines {
    let n = cols.div_ceil(CHUNK);
    let stride = lane_stride(n);
    let mut xt = Lines::zeroed(token_lanes_len(cols, t_rows));
    xt.par_chunks_mut(stride)
        .enumerate()
        .for_each(|(block, out)| {
            let (g, j) = (block / CHUNK, block % CHUNK);
            for lane in 0..GROUP {
                let Some(row) = x.get((g * GROUP + lane) * cols..(g * GROUP + lane + 1) * cols)
                else {
                    break;
                };
                if g * GROUP + lane >= t_rows {
                    break;
                }
                for (c, &v) in row.iter().skip(j).step_by(CHUNK).enumerate() {
                    out[c * GROUP + lane] = v;
                }
            }
        });
    xt
}

/// Values of the decoded block of `rows` rows over `nb` chunks ([`decode_block`]).
pub fn block_weights(rows: usize, nb: usize) -> usize {
    rows * CHUNK * nb
}

/// Decodes chunks `c0 .. c0 + nb` of bf16 rows into `w` ([`block_weights`]`(rows.len(), nb)` values, layout in the
/// module header), exact; past a row's end the weights are 0, as the contract pads them. Each pair of lanes comes
/// from one dword gather (the low half is lane `2l`, the high half lane `2l + 1`).
///
/// # Safety
/// The CPU must support AVX-512F; `w` holds [`block_weights`]`(rows.len(), nb)` values; `nb <= 16`.
#[target_feature(enable = "avx512f")]
pub unsafe fn decode_block(rows: &[&[u16]], c0: usize, nb: usize, w: &mut [f32]) {
    debug_assert!(nb <= 16 && w.len() >= block_weights(rows.len(), nb));
    // Byte offsets of lane pair 0 of chunks 0 .. 16 (64 bytes a chunk); masked to the block's chunks.
    let offsets = _mm512_setr_epi32(
        0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960,
    );
    let mask: __mmask16 = ((1u32 << nb) - 1) as u16;
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    let mut padded = [0u16; 16 * CHUNK];
    for (r, row) in rows.iter().enumerate() {
        let at = c0 * CHUNK;
        // The block's chunks from the row where it holds them all, else from a zero-padded copy.
        let base: *const u16 = match row.get(at..at + nb * CHUNK) {
            Some(whole) => whole.as_ptr(),
            None => {
                padded.fill(0);
                let have = row.get(at..).unwrap_or(&[]);
                padded[..have.len()].copy_from_slice(have);
                padded.as_ptr()
            }
        };
        for l in 0..LANES {
            // SAFETY: the masked lanes read `nb` chunks of 64 bytes from `base`, all inside the row or the copy.
            let pair = unsafe {
                _mm512_mask_i32gather_epi32::<1>(
                    _mm512_setzero_si512(),
                    mask,
                    offsets,
                    base.add(2 * l) as *const i32,
                )
            };
            let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pair));
            let odd = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
            let out = w.as_mut_ptr();
            // SAFETY: lanes 2l and 2l + 1 of row r hold `nb` values each in `w`; the masked stores write `nb`.
            unsafe {
                _mm512_mask_storeu_ps(out.add((r * CHUNK + 2 * l) * nb), mask, even);
                _mm512_mask_storeu_ps(out.add((r * CHUNK + 2 * l + 1) * nb), mask, odd);
            }
        }
    }
}

/// Values of the accumulators of every lane of every (row, group) pair of a task: `[rows][groups][32]` vectors.
pub fn accumulators_len(rows: usize, groups: usize) -> usize {
    rows * groups * CHUNK * GROUP
}

/// Where pair (`r`, `g`)'s lane-`j` accumulator starts ([`accumulators_len`]`(_, groups)`).
#[inline]
fn acc_at(r: usize, g: usize, groups: usize, j: usize) -> usize {
    ((r * groups + g) * CHUNK + j) * GROUP
}

/// One tile: rows `r0 .. r0 + R` of the task's decoded block (`w`, `nb` chunks from `c0`) against groups `g0 .. g0 +
/// V` of the inputs (`xt`, rows of `n` chunks), lane `j`, chunks `c0 .. c1`, into the pairs' accumulators in `acc`.
/// Six rows by four groups run in [`rows6x4`]; other shapes (a task's last rows, short prompts) through intrinsics.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; `w` holds rows `r0 .. r0 + R` of the block, `xt` groups `g0 .. g0 + V` of
/// the layout for `n` chunks; `c1 - c0 <= nb`, `c1 <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub unsafe fn tile<const R: usize, const V: usize>(
    (w, nb): (&[f32], usize),
    xt: &[f32],
    (r0, g0, j): (usize, usize, usize),
    (c0, c1): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!(c1 <= n && c1 - c0 <= nb && w.len() >= block_weights(r0 + R, nb));
    debug_assert!(xt.len() >= (g0 + V) * CHUNK * lane_stride(n));
    debug_assert!(acc.len() >= acc_at(r0 + R - 1, g0 + V - 1, groups, j) + GROUP);
    let wr: [*const f32; R] = std::array::from_fn(|r| w[((r0 + r) * CHUNK + j) * nb..].as_ptr());
    let xg: [*const f32; V] = std::array::from_fn(|v| {
        xt[((g0 + v) * CHUNK + j) * lane_stride(n) + c0 * GROUP..].as_ptr()
    });
    let p = acc.as_mut_ptr();
    let at: [[usize; V]; R] =
        std::array::from_fn(|r| std::array::from_fn(|v| acc_at(r0 + r, g0 + v, groups, j)));
    // SAFETY (every access below): the caller's layouts hold every address.
    let mut a: [[__m512; V]; R] = std::array::from_fn(|r| {
        std::array::from_fn(|v| unsafe { _mm512_loadu_ps(p.add(at[r][v])) })
    });
    if R == 6 && V == 4 && c1 > c0 {
        let mut regs: [__m512; 24] = std::array::from_fn(|i| a[i / 4][i % 4]);
        let f = std::mem::size_of::<f32>();
        // SAFETY: as above: `c1 - c0` chunks of every row and group from the pointers.
        unsafe {
            rows6x4(
                &mut regs,
                (xg[0], CHUNK * lane_stride(n) * f),
                (wr[0], CHUNK * nb * f),
                c1 - c0,
            )
        };
        for (i, v) in regs.into_iter().enumerate() {
            a[i / 4][i % 4] = v;
        }
    } else {
        for i in 0..c1 - c0 {
            let xs: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(xg[v].add(i * GROUP)) });
            for r in 0..R {
                let b = unsafe { _mm512_set1_ps(*wr[r].add(i)) };
                for v in 0..V {
                    a[r][v] = _mm512_fmadd_ps(b, xs[v], a[r][v]);
                }
            }
        }
    }
    for r in 0..R {
        for v in 0..V {
            unsafe { _mm512_storeu_ps(p.add(at[r][v]), a[r][v]) };
        }
    }
}

/// One row of [`rows6x4`] in `asm!` text: its weight broadcast (zmm28, from `$w`) and an FMA into the four groups'
/// accumulators `zmm$a..` (inputs in zmm24..27).
macro_rules! row6x4 {
    ($w:literal, $a0:literal $a1:literal $a2:literal $a3:literal) => {
        concat!(
            "vbroadcastss zmm28, dword ptr [",
            $w,
            "]\n",
            "vfmadd231ps zmm",
            $a0,
            ", zmm28, zmm24\n",
            "vfmadd231ps zmm",
            $a1,
            ", zmm28, zmm25\n",
            "vfmadd231ps zmm",
            $a2,
            ", zmm28, zmm26\n",
            "vfmadd231ps zmm",
            $a3,
            ", zmm28, zmm27\n",
        )
    };
}

/// Six rows by four groups over `n` chunks, in `asm!` so that every vector has a fixed register: the 24
/// accumulators (zmm0..23, row-major), the four groups' inputs (zmm24..27) and the broadcast weight (zmm28). Per chunk
/// and pair one `fma(w, x, acc)`, the contract's operation. With intrinsics LLVM hoisted loads across chunks or
/// folded each broadcast into every FMA, as in the MXFP4 tiles (`super::avx512_tokens`).
///
/// # Safety
/// The CPU must support AVX-512F; `n >= 1`; from `x` (group `g` at `x + g · xs` bytes) 64 bytes per chunk, from `w`
/// (row `r` at `w + r · ws` bytes) 4 bytes per chunk, for `n` chunks.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn rows6x4(
    acc: &mut [__m512; 24],
    (x, xs): (*const f32, usize),
    (w, ws): (*const f32, usize),
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
        mut a8,
        mut a9,
        mut a10,
        mut a11,
        mut a12,
        mut a13,
        mut a14,
        mut a15,
        mut a16,
        mut a17,
        mut a18,
        mut a19,
        mut a20,
        mut a21,
        mut a22,
        mut a23,
    ] = *acc;
    // SAFETY: the caller guarantees every address the loop reads.
    unsafe {
        std::arch::asm!(
            "2:",
            "vmovups zmm24, zmmword ptr [{xa}]",
            "vmovups zmm25, zmmword ptr [{xa} + {xs}]",
            "vmovups zmm26, zmmword ptr [{xa} + {xs} * 2]",
            "vmovups zmm27, zmmword ptr [{xb}]",
            row6x4!("{wa}", "0" "1" "2" "3"),
            row6x4!("{wa} + {ws}", "4" "5" "6" "7"),
            row6x4!("{wa} + {ws} * 2", "8" "9" "10" "11"),
            row6x4!("{wb}", "12" "13" "14" "15"),
            row6x4!("{wb} + {ws}", "16" "17" "18" "19"),
            row6x4!("{wb} + {ws} * 2", "20" "21" "22" "23"),
            "add {xa}, 64",
            "add {xb}, 64",
            "add {wa}, 4",
            "add {wb}, 4",
            "dec {n}",
            "jnz 2b",
            xa = inout(reg) x => _, xb = inout(reg) x.wrapping_byte_add(3 * xs) => _, xs = in(reg) xs,
            wa = inout(reg) w => _, wb = inout(reg) w.wrapping_byte_add(3 * ws) => _, ws = in(reg) ws,
            n = inout(reg) n => _,
            inout("zmm0") a0, inout("zmm1") a1, inout("zmm2") a2, inout("zmm3") a3,
            inout("zmm4") a4, inout("zmm5") a5, inout("zmm6") a6, inout("zmm7") a7,
            inout("zmm8") a8, inout("zmm9") a9, inout("zmm10") a10, inout("zmm11") a11,
            inout("zmm12") a12, inout("zmm13") a13, inout("zmm14") a14, inout("zmm15") a15,
            inout("zmm16") a16, inout("zmm17") a17, inout("zmm18") a18, inout("zmm19") a19,
            inout("zmm20") a20, inout("zmm21") a21, inout("zmm22") a22, inout("zmm23") a23,
            out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _,
            options(nostack, readonly),
        );
    }
    *acc = [
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
        a20, a21, a22, a23,
    ];
}

/// The contract's reduction of pair (`r`, `g`)'s 32 lanes, for its sixteen inputs: `out[t]` for input `16g + t`.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds the pair.
#[target_feature(enable = "avx512f")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    let p = acc.as_ptr();
    // SAFETY: the caller's `acc` holds the pair's 32 vectors.
    let lane = |j: usize| unsafe { _mm512_loadu_ps(p.add(acc_at(r, g, groups, j))) };
    // v[l] = even[l] + odd[l]: lanes 2l and 2l + 1.
    let mut v: [__m512; LANES] =
        std::array::from_fn(|l| _mm512_add_ps(lane(2 * l), lane(2 * l + 1)));
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] = _mm512_add_ps(v[l], v[l + width]);
        }
        width /= 2;
    }
    let mut out = [0.0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v[0]) };
    out
}
