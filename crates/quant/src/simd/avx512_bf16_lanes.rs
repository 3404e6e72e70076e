//! AVX-512 bf16 products of many inputs with the inputs across the vector lanes (prefill, from
//! `crate::bf16_contract::LANES_MIN_TOKENS` inputs, rows whose length is a multiple of 32).
//!
//! [`crate::bf16_contract`] computes, for one row and one input, 32 independent chains, one per element `e` of a
//! chunk of 32 (`even[l]` is `e = 2l`, `odd[l]` is `e = 2l + 1`): `acc = fma(w[32c + e], x[32c + e], acc)` over the
//! chunks `c` in order, then a fixed reduction. Here a vector's lanes are sixteen *inputs* at one `e`, so a weight is
//! one 32-bit broadcast (the pair of bf16 that holds it, widened by a shift or a mask) shared by every input of the
//! tile, and each input vector is shared by six rows in registers (`rows6`, in `asm!`): four vector loads per 24
//! FMAs, where the two-row tiles of [`crate::bf16_contract::dot_tiles`] load seven per twelve. Per lane the
//! operations and their order are the contract's, so every result is bit-identical to
//! [`crate::bf16_contract::dot_ref`].
//!
//! The layouts are [`crate::bf16_lanes`]'s. The form that widens a block's weights ahead
//! ([`super::avx512_bf16_wide`], on Intel's cores) runs the same `asm!` tile and accumulator helpers, and the tile
//! and its loops are generic over the rows' element type (`LaneRow`), so the f32 products of
//! [`super::avx512_f32_lanes`] run them too.

use std::arch::x86_64::*;

use crate::bf16_contract::{CHUNK, LANES};
use crate::bf16_lanes::{GROUP, acc_at, token_lanes_len};

/// A row's weights as the lane tiles read them: the element type of a row, where element `e` of a chunk lies, and
/// how one weight becomes a vector of sixteen equal f32 values. Chunks are [`CHUNK`] elements apart in a row.
pub(crate) trait LaneRow: Copy {
    /// Where the tile reads element `e` of a chunk (in elements from the chunk's start), and how `rows6` reads it.
    fn at(e: usize) -> (usize, Weights);

    /// Element `e`'s weight, read at `p` (a row's [`LaneRow::at`] moved on by whole chunks), in every lane.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `p` lies inside a row, with the whole chunk's values after it.
    unsafe fn broadcast(p: *const Self, e: usize) -> __m512;
}

/// bf16 rows: a weight is read as the 32-bit word of its pair and widened (a shift for an even element, a mask for
/// an odd one).
impl LaneRow for u16 {
    fn at(e: usize) -> (usize, Weights) {
        let kind = if e % 2 == 1 {
            Weights::OddPair
        } else {
            Weights::EvenPair
        };
        (2 * (e / 2), kind)
    }

    #[inline(always)]
    unsafe fn broadcast(p: *const u16, e: usize) -> __m512 {
        // SAFETY: the caller's `p` is the pair's first element, both inside the row; AVX-512F present.
        unsafe {
            let b = _mm512_set1_epi32((p as *const i32).read_unaligned());
            if e.is_multiple_of(2) {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b))
            } else {
                _mm512_castsi512_ps(_mm512_and_si512(
                    b,
                    _mm512_set1_epi32(0xffff_0000_u32 as i32),
                ))
            }
        }
    }
}

/// The accumulators of every (row, group) pair of `rows` (each `32 · n` weights) against the `groups` groups of
/// inputs in `xt` (laid out for `n` chunks), into `acc` ([`crate::bf16_lanes::accumulators_len`]): for each block of
/// `block` chunks, each six rows, each element of a chunk and each four groups, one [`tile`]. A block's six rows
/// stay in L1 while every element and group goes through them; each tile's accumulators are loaded and stored once
/// per block.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; every row holds `32 · n` weights; `xt` holds `groups` groups of the layout
/// for `n` chunks; `acc` holds every pair; `block >= 1`.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn accumulate<T: LaneRow>(
    rows: &[&[T]],
    xt: &[f32],
    (n, groups): (usize, usize),
    acc: &mut [f32],
    block: usize,
) {
    for c0 in (0..n).step_by(block) {
        let span = (c0, (c0 + block).min(n));
        for r0 in (0..rows.len()).step_by(TILE_ROWS) {
            let here = TILE_ROWS.min(rows.len() - r0);
            for e in 0..CHUNK {
                let mut g = 0;
                while g < groups {
                    let v = (groups - g).min(4);
                    // The tiles' calls: as this function's caller guarantees.
                    crate::simd::lane_tiles!(
                        tile; r in r0, r0 + here; v; (rows, xt, (r, g, e), span, n, acc, groups)
                    );
                    g += v;
                }
            }
        }
    }
}

/// [`LaneRow::at`] for the element type of `rows`.
fn element_at<T: LaneRow>(_: &[&[T]], e: usize) -> (usize, Weights) {
    T::at(e)
}

/// Rows per tile of [`accumulate`] (the `asm!` tile's six).
const TILE_ROWS: usize = 6;

/// One tile: rows `r0 .. r0 + R` of the task (`rows[r0 + r]`, each `32 · n` weights of a [`LaneRow`] type) against
/// groups `g0 .. g0 + V` of the inputs (`xt`, laid out for `n` chunks), element `e`, chunks `c0 .. c1`, into the
/// pairs' accumulators in `acc`. A row's first block (`c0 == 0`) starts its accumulators at zero, whatever `acc`
/// holds. Six evenly spaced rows by four groups run in `rows6`; other shapes (a task's last rows and groups) through
/// intrinsics, with the same operations per lane.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; every row holds `32 · n` weights, `xt` groups `g0 .. g0 + V` of the layout
/// for `n` chunks; `c1 <= n`; `acc` holds the pairs (`groups` groups per row).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn tile<const R: usize, const V: usize>(
    rows: &[&[impl LaneRow]],
    xt: &[f32],
    (r0, g0, e): (usize, usize, usize),
    (c0, c1): (usize, usize),
    n: usize,
    acc: &mut [f32],
    groups: usize,
) {
    debug_assert!(c1 <= n && e < CHUNK && rows.len() >= r0 + R);
    debug_assert!(rows[r0..r0 + R].iter().all(|w| w.len() == n * CHUNK));
    debug_assert!(xt.len() >= token_lanes_len(n * CHUNK, (g0 + V) * GROUP));
    debug_assert!(acc.len() >= acc_at(r0 + R - 1, g0 + V - 1, groups, e) + GROUP);
    if c0 >= c1 {
        return;
    }
    // Element e of chunk c of row r is read at `wr[r] + 32c`, from the block's start.
    let (first, kind) = element_at(rows, e);
    let wr: [*const _; R] = std::array::from_fn(|r| rows[r0 + r][first..].as_ptr());
    let xg: [*const f32; V] =
        std::array::from_fn(|v| xt[((g0 + v) * CHUNK + e) * n * GROUP..].as_ptr());
    // SAFETY: the caller's `acc` holds every pair.
    let (at, mut regs) = unsafe { load_tile::<R, V>(acc, (r0, g0, e), groups, c0 == 0) };
    // Bytes between neighbouring rows, where they are evenly spaced (rows of one matrix).
    let stride = (wr[R - 1] as usize).wrapping_sub(wr[0] as usize) / R.saturating_sub(1).max(1);
    let even = (0..R).all(|r| wr[r] as usize == (wr[0] as usize).wrapping_add(r * stride));
    if R == 6 && V == 4 && even {
        let mut a: [__m512; 24] = std::array::from_fn(|i| regs[i / 4][i % 4]);
        // SAFETY: as the caller guarantees; the six rows lie `stride` bytes apart, each chunk's weight `kind`'s
        // step after the last.
        unsafe {
            rows6(
                &mut a,
                (
                    xg[0].add(c0 * GROUP),
                    (xg[1] as usize).wrapping_sub(xg[0] as usize),
                ),
                (wr[0].add(c0 * CHUNK).cast(), stride),
                c1 - c0,
                kind,
            )
        };
        regs = std::array::from_fn(|r| std::array::from_fn(|v| a[r * 4 + v]));
    } else {
        for c in c0..c1 {
            // SAFETY (every access below): the caller's rows and inputs hold chunk c.
            let xs: [__m512; V] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(xg[v].add(c * GROUP)) });
            for r in 0..R {
                let w = unsafe { LaneRow::broadcast(wr[r].add(c * CHUNK), e) };
                for v in 0..V {
                    regs[r][v] = _mm512_fmadd_ps(w, xs[v], regs[r][v]);
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { store_tile(acc, &at, &regs) };
}

/// A tile's accumulators (rows `r0 ..`, groups `g0 ..`, element `e`) and where they lie in `acc`: zeros for a row's
/// first block (`fresh`), else the values `acc` holds.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds the pairs (`groups` groups per row).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load_tile<const R: usize, const V: usize>(
    acc: &[f32],
    (r0, g0, e): (usize, usize, usize),
    groups: usize,
    fresh: bool,
) -> ([[usize; V]; R], [[__m512; V]; R]) {
    let at: [[usize; V]; R] =
        std::array::from_fn(|r| std::array::from_fn(|v| acc_at(r0 + r, g0 + v, groups, e)));
    let regs = std::array::from_fn(|r| {
        std::array::from_fn(|v| {
            if fresh {
                _mm512_setzero_ps()
            } else {
                // SAFETY: the caller's `acc` holds every pair.
                unsafe { _mm512_loadu_ps(acc.as_ptr().add(at[r][v])) }
            }
        })
    });
    (at, regs)
}

/// Stores a tile's accumulators where [`load_tile`] found them.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds every `at`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store_tile<const R: usize, const V: usize>(
    acc: &mut [f32],
    at: &[[usize; V]; R],
    regs: &[[__m512; V]; R],
) {
    for r in 0..R {
        for v in 0..V {
            // SAFETY: the caller's `acc` holds every pair.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(at[r][v]), regs[r][v]) };
        }
    }
}

/// One row's part of a step of a six-row tile in `asm!` text: its weight broadcast into zmm28 (from `$w`), made f32
/// by `$widen` (a shift for an even element, the mask in zmm29 for an odd one, nothing for a weight widened ahead),
/// then one FMA with each group's inputs (zmm24..27) into the row's accumulators `zmm$a0 .. zmm$a3`.
#[rustfmt::skip]
macro_rules! row_fmas {
    ($w:literal, $widen:literal, $a0:literal $a1:literal $a2:literal $a3:literal) => {
        concat!(
            "vbroadcastss zmm28, dword ptr [", $w, "]\n",
            $widen, "\n",
            "vfmadd231ps zmm", $a0, ", zmm28, zmm24\n",
            "vfmadd231ps zmm", $a1, ", zmm28, zmm25\n",
            "vfmadd231ps zmm", $a2, ", zmm28, zmm26\n",
            "vfmadd231ps zmm", $a3, ", zmm28, zmm27\n",
        )
    };
}

/// The loop of a six-row tile in `asm!` text, with `$widen` the weights' widening and `$step` the bytes from one
/// chunk's weight of a row to the next chunk's.
#[rustfmt::skip]
macro_rules! rows6_loop {
    ($widen:literal, $step:literal) => {
        concat!(
            "2:\n",
            "vmovups zmm24, zmmword ptr [{xa}]\n",
            "vmovups zmm25, zmmword ptr [{xa} + {xs}]\n",
            "vmovups zmm26, zmmword ptr [{xb}]\n",
            "vmovups zmm27, zmmword ptr [{xb} + {xs}]\n",
            row_fmas!("{wa}", $widen, "0" "1" "2" "3"),
            row_fmas!("{wa} + {ws}", $widen, "4" "5" "6" "7"),
            row_fmas!("{wa} + {ws}*2", $widen, "8" "9" "10" "11"),
            row_fmas!("{wb}", $widen, "12" "13" "14" "15"),
            row_fmas!("{wb} + {ws}", $widen, "16" "17" "18" "19"),
            row_fmas!("{wb} + {ws}*2", $widen, "20" "21" "22" "23"),
            "add {xa}, 64\n", "add {xb}, 64\n", "add {wa}, ", $step, "\n", "add {wb}, ", $step, "\n",
            "dec {n}\n", "jnz 2b\n",
        )
    };
}

/// How [`rows6`] reads a row's weight of a chunk.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Weights {
    /// The 32-bit word of a bf16 pair in the row itself (chunks 64 bytes apart), its even element: widened by a shift.
    EvenPair,
    /// The same word's odd element: widened by a mask.
    OddPair,
    /// An f32 value widened ahead (`super::avx512_bf16_wide`), chunks 4 bytes apart.
    Widened,
    /// An f32 row's own value (`super::avx512_f32_lanes`), chunks 128 bytes apart.
    F32,
}

/// Six rows against four groups over `n >= 1` chunks, in `asm!` so that every vector has a fixed register: 24
/// accumulators (zmm0.., row-major), the four groups' inputs, one broadcast weight and the mask, 30 registers.
/// Per lane the operations are the contract's: `acc = fma(w, x, acc)` chunk by chunk.
///
/// # Safety
/// The CPU must support AVX-512F; `x` is group 0's input vector at the first chunk, group `v` at `x + v · xs` bytes;
/// `w` is row 0's weight at the first chunk (as `weights` says), row `r` at `w + r · ws` bytes; each later chunk 64
/// bytes on for the inputs and as `weights` says for the weights, for `n` chunks.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn rows6(
    acc: &mut [__m512; 24],
    (x, xs): (*const f32, usize),
    (w, ws): (*const u8, usize),
    n: usize,
    weights: Weights,
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
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    macro_rules! run {
        ($widen:literal, $step:literal) => {
            // SAFETY: the caller guarantees every address the loop reads.
            unsafe {
                std::arch::asm!(
                    rows6_loop!($widen, $step),
                    xa = inout(reg) x => _, xb = inout(reg) x.wrapping_byte_add(2 * xs) => _, xs = in(reg) xs,
                    wa = inout(reg) w => _, wb = inout(reg) w.wrapping_byte_add(3 * ws) => _, ws = in(reg) ws,
                    n = inout(reg) n => _,
                    inout("zmm0") a0, inout("zmm1") a1, inout("zmm2") a2, inout("zmm3") a3,
                    inout("zmm4") a4, inout("zmm5") a5, inout("zmm6") a6, inout("zmm7") a7,
                    inout("zmm8") a8, inout("zmm9") a9, inout("zmm10") a10, inout("zmm11") a11,
                    inout("zmm12") a12, inout("zmm13") a13, inout("zmm14") a14, inout("zmm15") a15,
                    inout("zmm16") a16, inout("zmm17") a17, inout("zmm18") a18, inout("zmm19") a19,
                    inout("zmm20") a20, inout("zmm21") a21, inout("zmm22") a22, inout("zmm23") a23,
                    out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _,
                    in("zmm29") high,
                    options(nostack, readonly),
                )
            }
        };
    }
    match weights {
        Weights::OddPair => run!("vpandd zmm28, zmm28, zmm29", "64"),
        Weights::EvenPair => run!("vpslld zmm28, zmm28, 16", "64"),
        Weights::Widened => run!("", "4"),
        Weights::F32 => run!("", "128"),
    }
    *acc = [
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
        a20, a21, a22, a23,
    ];
}

/// The contract's reduction of pair (`r`, `g`)'s 32 element accumulators, for its sixteen inputs: `out[t]` for
/// input `16g + t`.
///
/// # Safety
/// The CPU must support AVX-512F; `acc` holds the pair.
#[target_feature(enable = "avx512f")]
pub unsafe fn finish(acc: &[f32], r: usize, g: usize, groups: usize) -> [f32; GROUP] {
    let p = acc.as_ptr();
    // v[l] = even[l] + odd[l]: elements 2l and 2l + 1.
    // SAFETY: the caller's `acc` holds the pair's 32 vectors.
    let v: [__m512; LANES] = std::array::from_fn(|l| unsafe {
        _mm512_add_ps(
            _mm512_loadu_ps(p.add(acc_at(r, g, groups, 2 * l))),
            _mm512_loadu_ps(p.add(acc_at(r, g, groups, 2 * l + 1))),
        )
    });
    let mut out = [0.0f32; GROUP];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), super::avx512::halving_sum(v)) };
    out
}
