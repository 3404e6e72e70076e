//! MXFP4 as stored by compressed-tensors (`mxfp4-pack-quantized`, group 32), the format of K3's routed experts.
//!
//! Layout of a logical weight `W[rows, cols]`:
//! - `packed[rows, cols / 2]` (u8): byte `j` of a row holds element `2j` in the low nibble (bits 0..4) and element
//!   `2j + 1` in the high nibble. A nibble is an E2M1 code: bit 3 is the sign, bits 0..3 index
//!   {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//! - `scales[rows, cols / 32]` (u8): one E8M0 exponent per 32 consecutive columns; multiplier `2^(e - 127)`, exact.
//!   `e = 255` is NaN in the OCP spec and is rejected; `e = 0` is `2^-127`.
//!
//! Dequantisation is exact in f32, so a kernel's only freedom is its accumulation order, fixed in
//! [`crate::mxfp4_contract`].

use crate::error::{QuantError, Result};
use crate::{mxfp4_bf16_contract, mxfp4_contract, mxfp4_i16_contract};

/// Weight bytes (codes and scales, times the activation rows) one task of a threaded product multiplies: about
/// 240 rows of a K3 expert at one activation row, as much as a dense int8 task (`crate::dense`). Tasks of 16 rows
/// read batched experts more slowly when memory is fast (`docs/performance-log.md`).
const MXFP4_TASK_BYTES: usize = 448 << 10;

/// Inputs from which a product runs in tiles on AVX-512 (`Mxfp4Matrix::rows_f32_tiles`): with fewer, decoding each
/// chunk once for all inputs in registers (`mxfp4_row_multi`) costs less than a decoded copy of the rows.
const TILE_MIN_TOKENS: usize = 4;
/// Inputs per tile (two rows by three: 12 partial sums, 12 accumulators and the loads fit the 32 vector registers).
#[cfg(target_arch = "x86_64")]
const TILE_TOKENS: usize = 3;
/// Chunks per block of a tiled product: a tile's three inputs over a block (24 KiB) stay in L1.
#[cfg(target_arch = "x86_64")]
const TILE_BLOCK_CHUNKS: usize = 16;
/// Rows per task of a tiled product: decoded, 16 rows of a K3 expert are 258 KB, which stay in L2.
const TILE_ROWS_PER_TASK: usize = 16;
/// Inputs from which a product runs with the inputs across the vector lanes ([`Mxfp4Matrix::rows_f32_lanes`];
/// [`crate::mxfp4_lanes`]) on AVX-512 and on AVX2 (where the alternative decodes every weight again for each input).
#[cfg(target_arch = "x86_64")]
fn lanes_min_tokens() -> Option<usize> {
    if crate::simd::has_avx512() {
        Some(12)
    } else if crate::simd::has_avx2_fma() {
        Some(8)
    } else {
        None
    }
}
/// Rows per task of a product with the inputs across the lanes: a task reads all of its inputs once, so more rows
/// share that read. On AVX-512 48 rows' accumulators at 64 inputs (384 KB), their packed block with lanes and chunks
/// swapped (48 KB) and a block of 64 inputs (512 KB) stay in a 2 MB L2 together; on an AMD Zen 3 core (AVX2, 512 KB
/// of L2) 32, 48 and 64 rows ran alike.
#[cfg(target_arch = "x86_64")]
const LANES_ROWS_PER_TASK: usize = 48;
/// Chunks per block of a product with the inputs across the lanes: the groups of inputs over a block (8 KiB each for
/// one lane `k`) stay in L1 while every row of the task passes over them.
#[cfg(target_arch = "x86_64")]
const LANES_BLOCK_CHUNKS: usize = crate::mxfp4_lanes::BLOCK_CHUNKS_MAX;
/// Rows whose lane is decoded at a time in the products of many inputs on AVX-512 (the four rows of the `asm!`
/// tile): a few KiB, written and read in L1.
#[cfg(target_arch = "x86_64")]
const LANES_TILE_ROWS: usize = 4;
/// The same on AVX2 with a single group of inputs, where the `asm!` tile has two rows.
#[cfg(target_arch = "x86_64")]
const AVX2_LANES_TILE_ROWS: usize = 2;
/// Activation rows per piece of a batched product for `input`: [`crate::dense::TOKEN_BLOCK`] (a piece's inputs stay
/// in L2), or 256 for exact f32 inputs on AVX2 without AVX-512, whose lane products stream their inputs block by
/// block and lose less to a piece's last, partial group of inputs the fewer pieces there are (on an AMD Zen 3 core,
/// 97 inputs: 0.42 of the FMA peak in pieces of 64 and 33, 0.50 whole; 200: 0.53 whole; 512: 0.56 either way).
fn token_block(input: Mxfp4Input) -> usize {
    #[cfg(target_arch = "x86_64")]
    if input == Mxfp4Input::F32 && !crate::simd::has_avx512() && crate::simd::has_avx2_fma() {
        return 256;
    }
    let _ = input;
    crate::dense::TOKEN_BLOCK
}

/// Rows per task for `matrix` at `t_rows` activation rows: [`MXFP4_TASK_BYTES`] of work, at least one row pair;
/// [`TILE_ROWS_PER_TASK`] where the product runs in tiles.
fn rows_per_task(matrix: &Mxfp4Matrix<'_>, t_rows: usize, xps: &PermutedInput) -> usize {
    #[cfg(target_arch = "x86_64")]
    if matches!(xps, PermutedInput::F32Lanes(_)) {
        return LANES_ROWS_PER_TASK;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = xps;
    if t_rows >= TILE_MIN_TOKENS {
        return TILE_ROWS_PER_TASK;
    }
    let row_bytes = matrix.cols / 2 + matrix.cols / MXFP4_GROUP;
    let rows = MXFP4_TASK_BYTES / (row_bytes * t_rows).max(1);
    (rows / 2 * 2).max(2)
}

/// Inputs per E8M0 scale.
pub const MXFP4_GROUP: usize = 32;
/// Packed bytes per group (two 4-bit codes a byte).
pub const MXFP4_GROUP_BYTES: usize = MXFP4_GROUP / 2;
/// The E8M0 byte reserved for NaN.
pub const E8M0_NAN: u8 = 255;

const _: () = assert!(MXFP4_GROUP.is_multiple_of(2) && MXFP4_GROUP_BYTES == 16);

/// The sixteen E2M1 values, indexed by code.
pub(crate) const E2M1_TABLE: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The value of a 4-bit E2M1 code (only the low four bits of `code` are read).
pub fn e2m1_value(code: u8) -> f32 {
    E2M1_TABLE[(code & 0x0f) as usize]
}

/// The multiplier of an E8M0 scale byte, `2^(e - 127)`, or `None` for the NaN byte 255.
pub fn e8m0_scale(e: u8) -> Option<f32> {
    if e == E8M0_NAN {
        return None;
    }
    // 2^(e-127) for e in 1..=254 is the normal f32 with biased exponent e; e = 0 is the subnormal 2^-127.
    Some(if e == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((e as u32) << 23)
    })
}

/// One row's packed codes and scale bytes.
type RowBytes<'a> = (&'a [u8], &'a [u8]);

/// A borrowed, shape-checked MXFP4 matrix.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    rows: usize,
    cols: usize,
}

impl<'a> Mxfp4Matrix<'a> {
    /// Wraps `packed` and `scales` as a `[rows, cols]` matrix, checking lengths and every scale byte.
    pub fn new(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        let m = Self::with_checked_scales(packed, scales, rows, cols)?;
        let groups = cols / MXFP4_GROUP;
        // The memchr crate's search (SIMD): every expert read runs it over half a megabyte of scales, on the GPU
        // path in the thread that queues the uploads.
        if let Some(pos) = memchr::memchr(E8M0_NAN, scales) {
            return Err(QuantError::NanScale {
                row: pos / groups,
                group: pos % groups,
            });
        }
        Ok(m)
    }

    /// As [`Self::new`] for bytes whose scales were checked when they were loaded (an expert is checked once when
    /// it is read, not at every product): lengths are checked, the scale bytes are not scanned again. A NaN scale
    /// here would only make NaN outputs.
    pub fn with_checked_scales(
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if !cols.is_multiple_of(MXFP4_GROUP) {
            return Err(QuantError::BadColumns {
                cols,
                group: MXFP4_GROUP,
            });
        }
        let check = |what, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(QuantError::BadLength {
                    what,
                    rows,
                    cols,
                    expected,
                    actual,
                })
            }
        };
        check("packed", rows * cols / 2, packed.len())?;
        check("scales", rows * (cols / MXFP4_GROUP), scales.len())?;
        Ok(Self {
            packed,
            scales,
            rows,
            cols,
        })
    }

    /// Rows of the logical matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the logical matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Writes row `row` as f32 into `out` (`cols` values). Scalar reference.
    pub fn dequantize_row_ref(&self, row: usize, out: &mut [f32]) {
        let groups = self.cols / MXFP4_GROUP;
        let packed = &self.packed[row * self.cols / 2..(row + 1) * self.cols / 2];
        let scales = &self.scales[row * groups..(row + 1) * groups];
        for (g, &e) in scales.iter().enumerate() {
            // Scale bytes were checked in `new`, so the NaN byte cannot appear here.
            let scale = e8m0_scale(e).unwrap_or(f32::NAN);
            let bytes = &packed[g * MXFP4_GROUP_BYTES..(g + 1) * MXFP4_GROUP_BYTES];
            let dst = &mut out[g * MXFP4_GROUP..(g + 1) * MXFP4_GROUP];
            for (j, &b) in bytes.iter().enumerate() {
                dst[2 * j] = e2m1_value(b) * scale;
                dst[2 * j + 1] = e2m1_value(b >> 4) * scale;
            }
        }
    }

    /// The whole matrix as row-major f32. Scalar reference.
    pub fn dequantize_ref(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row_ref(r, row);
        }
        out
    }

    /// The dot product of row `row` with `x`, fused with dequantisation. Scalar reference of the accumulation
    /// contract in [`crate::mxfp4_contract`].
    pub fn dot_row_ref(&self, row: usize, x: &[f32]) -> f32 {
        let (packed, scales) = self.row_bytes(row);
        mxfp4_contract::dot_row_ref(packed, scales, &mxfp4_contract::permute_input(x))
    }

    /// The dot product of row `row` with `x` rounded to bf16: scalar reference of the contract in
    /// [`crate::mxfp4_bf16_contract`].
    pub fn dot_row_bf16_ref(&self, row: usize, x: &[f32]) -> f32 {
        let (packed, scales) = self.row_bytes(row);
        mxfp4_bf16_contract::dot_row_ref(packed, scales, &mxfp4_bf16_contract::permute_input(x))
    }

    /// The dot product of row `row` with `x` quantised to int16 per group: scalar reference of the contract in
    /// [`crate::mxfp4_i16_contract`].
    pub fn dot_row_i16_ref(&self, row: usize, x: &[f32]) -> f32 {
        let (packed, scales) = self.row_bytes(row);
        mxfp4_i16_contract::dot_row_ref(packed, scales, &mxfp4_i16_contract::permute_input(x))
    }

    /// The dot product of row `row` with `x` on the fastest path (bit-identical to [`Self::dot_row_ref`]).
    pub fn dot_row(&self, row: usize, x: &[f32]) -> f32 {
        let mut y = [0.0f32];
        let xp = mxfp4_contract::permute_input(x);
        self.rows_f32(row, &xp, 1, &mut y);
        y[0]
    }

    /// Rows `r0 ..` times the permuted inputs `xps` (`t_rows` of them), into `out` (`[rows_here, t_rows]`,
    /// row-major by weight row).
    fn rows_permuted(&self, r0: usize, xps: &PermutedInput, t_rows: usize, out: &mut [f32]) {
        match xps {
            PermutedInput::F32(xps) => self.rows_f32(r0, xps, t_rows, out),
            #[cfg(target_arch = "x86_64")]
            PermutedInput::F32Lanes(xt) => self.rows_f32_lanes(r0, xt, t_rows, out),
            PermutedInput::Bf16 { words, flush_free } => {
                self.rows_bf16(r0, words, *flush_free, t_rows, out)
            }
            PermutedInput::I16(xqs) => self.rows_i16(r0, xqs, t_rows, out),
        }
    }

    /// [`Self::rows_permuted`] for exact f32 inputs ([`mxfp4_contract`]).
    fn rows_f32(&self, r0: usize, xps: &[f32], t_rows: usize, out: &mut [f32]) {
        let xp_len = mxfp4_contract::chunks(self.cols) * mxfp4_contract::CHUNK;
        if t_rows == 0 || xps.len() != t_rows * xp_len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512() && t_rows >= TILE_MIN_TOKENS {
            return self.rows_f32_tiles(r0, xps, t_rows, out);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx512() {
            // SAFETY: AVX-512F/BW, AVX2 and FMA present; two whole rows (checked in `new`) and one permuted input.
            let pair = |rows| unsafe { crate::simd::avx512::mxfp4_dot_rows::<2>(rows, xps) };
            // SAFETY: as above; one whole row and `out.len()` permuted inputs of `xp_len` values.
            let multi = |(packed, scales): RowBytes<'a>, out: &mut [f32]| unsafe {
                crate::simd::avx512::mxfp4_row_multi(packed, scales, xps, xp_len, out)
            };
            return self.run_rows(r0, t_rows, out, Some(&pair), &multi);
        }
        #[cfg(target_arch = "aarch64")]
        if crate::simd::has_neon() {
            let pair = |rows| crate::simd::neon::mxfp4_dot_rows::<2>(rows, xps);
            let multi = |(packed, scales): RowBytes<'a>, out: &mut [f32]| {
                crate::simd::neon::mxfp4_row_multi(packed, scales, xps, xp_len, out)
            };
            return self.run_rows(r0, t_rows, out, Some(&pair), &multi);
        }
        let each = |(packed, scales): RowBytes<'a>, out: &mut [f32]| {
            for (o, xp) in out.iter_mut().zip(xps.chunks_exact(xp_len)) {
                #[cfg(target_arch = "x86_64")]
                if crate::simd::has_avx2_fma() {
                    // SAFETY: AVX2 and FMA present; one whole row and one permuted input of the right length.
                    *o = unsafe { crate::simd::avx2::mxfp4_dot(packed, scales, xp) };
                    continue;
                }
                *o = mxfp4_contract::dot_row_ref(packed, scales, xp);
            }
        };
        self.run_rows(r0, t_rows, out, None, &each);
    }

    /// [`Self::rows_f32`] for several inputs on AVX-512: the rows are decoded once into a buffer, then multiplied in
    /// tiles of two rows by three inputs over blocks of [`TILE_BLOCK_CHUNKS`] chunks, so a weight is decoded once for
    /// every input and each input block is read from L1 by every row pair. Every result is bit-identical to
    /// [`Self::dot_row_ref`].
    #[cfg(target_arch = "x86_64")]
    fn rows_f32_tiles(&self, r0: usize, xps: &[f32], t_rows: usize, out: &mut [f32]) {
        use crate::simd::avx512::{
            Bf16Acc, DECODED_CHUNK, bf16_finish, mxfp4_decode_rows, mxfp4_tile,
        };
        let n_chunks = mxfp4_contract::chunks(self.cols);
        let xp_len = n_chunks * mxfp4_contract::CHUNK;
        let rows_here = out.len() / t_rows;
        let row_bytes: Vec<RowBytes<'a>> =
            (r0..r0 + rows_here).map(|r| self.row_bytes(r)).collect();
        let mut decoded = crate::aligned::Lines::zeroed(rows_here * n_chunks * DECODED_CHUNK);
        // SAFETY: AVX-512F/BW present (the caller checked); whole rows; `decoded` sized for them.
        unsafe { mxfp4_decode_rows(&row_bytes, n_chunks, &mut decoded) };
        let row =
            |r: usize| &decoded[r * n_chunks * DECODED_CHUNK..(r + 1) * n_chunks * DECODED_CHUNK];
        let input = |t: usize| &xps[t * xp_len..(t + 1) * xp_len];
        // SAFETY: an all-zero bit pattern is a valid vector (the accumulators' start).
        let mut acc: Vec<Bf16Acc> = vec![unsafe { std::mem::zeroed() }; rows_here * t_rows];
        // SAFETY (every call below): AVX-512F present; decoded rows and inputs of `n_chunks` chunks; `acc` holds
        // every pair.
        macro_rules! tile {
            ($r:literal, $r0:expr, $t0:expr, $width:expr, $span:expr, $($t:literal)+) => {{
                $(
                    if $width == $t {
                        let xs: [&[f32]; $t] = std::array::from_fn(|k| input($t0 + k));
                        let rs: [&[f32]; $r] = std::array::from_fn(|k| row($r0 + k));
                        unsafe { mxfp4_tile::<$r, $t>(rs, xs, $span, &mut acc[$r0 * t_rows + $t0..], t_rows) };
                    }
                )+
            }};
        }
        for c0 in (0..n_chunks).step_by(TILE_BLOCK_CHUNKS) {
            let span = (c0, (c0 + TILE_BLOCK_CHUNKS).min(n_chunks));
            for t0 in (0..t_rows).step_by(TILE_TOKENS) {
                let width = TILE_TOKENS.min(t_rows - t0);
                let mut r = 0;
                while r < rows_here {
                    if rows_here - r >= 2 {
                        tile!(2, r, t0, width, span, 1 2 3);
                        r += 2;
                    } else {
                        tile!(1, r, t0, width, span, 1 2 3);
                        r += 1;
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            // SAFETY: AVX-512F present.
            *o = unsafe { bf16_finish(a) };
        }
    }

    /// [`Self::rows_permuted`] for exact f32 inputs laid out across the vector lanes
    /// ([`crate::mxfp4_lanes::token_lanes`], built only where AVX-512 or AVX2 is present), on the wider of the two.
    /// Every result is bit-identical to [`Self::dot_row_ref`].
    #[cfg(target_arch = "x86_64")]
    fn rows_f32_lanes(&self, r0: usize, xt: &[f32], t_rows: usize, out: &mut [f32]) {
        if crate::simd::has_avx512() {
            self.rows_f32_lanes_avx512(r0, xt, t_rows, out)
        } else {
            self.rows_f32_lanes_avx2(r0, xt, t_rows, out)
        }
    }

    /// [`Self::rows_f32_lanes`] on AVX-512: for each block of [`LANES_BLOCK_CHUNKS`] chunks, each lane `k` and each
    /// [`LANES_TILE_ROWS`] rows, that lane of those rows is decoded into a buffer that stays in L1, then tiles of the
    /// rows by two groups of 16 inputs (one group where a single group is left) run over the block.
    #[cfg(target_arch = "x86_64")]
    fn rows_f32_lanes_avx512(&self, r0: usize, xt: &[f32], t_rows: usize, out: &mut [f32]) {
        use crate::mxfp4_lanes::{
            GROUP, accumulators_len, lane_weights, padded_chunks, row_scales, token_lanes_len,
        };
        use crate::simd::avx512_tokens::{
            block_words, decode_lane, decode_scales, finish, tile, transpose_block,
        };
        let n_chunks = mxfp4_contract::chunks(self.cols);
        let n_pad = padded_chunks(self.cols);
        let groups = t_rows.div_ceil(GROUP);
        let rows_here = out.len() / t_rows.max(1);
        if t_rows == 0 || xt.len() < token_lanes_len(self.cols, t_rows) {
            return;
        }
        let row_bytes: Vec<RowBytes<'a>> =
            (r0..r0 + rows_here).map(|r| self.row_bytes(r)).collect();
        LANES_SCRATCH.with_borrow_mut(|(scratch, words)| {
            words.resize(block_words(rows_here), 0);
            let [w, sc, acc] = scratch.take(&[
                lane_weights(LANES_TILE_ROWS),
                rows_here * row_scales(self.cols),
                accumulators_len(rows_here, groups),
            ]);
            // No clearing of `acc`: the first block's tiles start every pair from zero.
            // SAFETY: AVX-512F present (inputs are laid out across the lanes only then); `sc` sized for the rows.
            unsafe { decode_scales(&row_bytes, self.cols, sc) };
            let sc = &*sc;
            for c0 in (0..n_chunks).step_by(LANES_BLOCK_CHUNKS) {
                let span = (c0, (c0 + LANES_BLOCK_CHUNKS).min(n_chunks));
                let nb = (span.1 - c0).div_ceil(2) * 2;
                // SAFETY: as above; `words` sized for the rows, `nb <= LANES_BLOCK_CHUNKS <= BLOCK_CHUNKS_MAX`.
                unsafe { transpose_block(&row_bytes, c0, nb, words) };
                for k in 0..mxfp4_contract::CHUNK_LANES {
                    for q in (0..rows_here).step_by(LANES_TILE_ROWS) {
                        let rows = LANES_TILE_ROWS.min(rows_here - q);
                        // SAFETY: as above; `words` holds rows `q .. q + rows`, `w` lane k of `LANES_TILE_ROWS` rows.
                        unsafe { decode_lane(&words[block_words(q)..], rows, k, w) };
                        let w = &*w;
                        // SAFETY (every call below): AVX-512F and FMA present; the decoded lane, the multipliers,
                        // the inputs and the accumulators hold every tile's rows and groups, and `span.1 <= n_chunks
                        // <= n_pad`.
                        macro_rules! tiles {
                            ($v:literal, $g:expr, $($r:literal)+) => {{
                                let mut r = 0;
                                while r < rows {
                                    let left = rows - r;
                                    let wr = &w[lane_weights(r)..];
                                    $(
                                        if left >= $r {
                                            unsafe {
                                                tile::<$r, $v>((wr, sc), xt, (q + r, $g, k), span, n_pad, acc, groups)
                                            };
                                            r += $r;
                                            continue;
                                        }
                                    )+
                                }
                            }};
                        }
                        for g in (0..groups).step_by(2) {
                            if groups - g >= 2 {
                                tiles!(2, g, 4 2 1);
                            } else {
                                tiles!(1, g, 4 2 1);
                            }
                        }
                    }
                }
            }
            let acc = &*acc;
            // SAFETY: AVX-512F present; `acc` holds every pair.
            let sums = |r, g| unsafe { finish(acc, r, g, groups) };
            crate::simd::copy_group_sums(&mut out[..rows_here * t_rows], t_rows, sums);
        });
    }

    /// [`Self::rows_f32_lanes`] on AVX2: for each block of [`LANES_BLOCK_CHUNKS`] chunks and each lane `k`, that lane
    /// of every row is decoded, then each pair of groups of 16 inputs (two 8-input halves each) runs over every row
    /// while its inputs stay in L1 (`crate::simd::avx2_tokens::tiles`); a single group runs two rows at a time, each
    /// pair decoded right before (a shape that only a last group of inputs, or a product of at most 16, has).
    #[cfg(target_arch = "x86_64")]
    fn rows_f32_lanes_avx2(&self, r0: usize, xt: &[f32], t_rows: usize, out: &mut [f32]) {
        use crate::mxfp4_lanes::{
            GROUP, accumulators_len, lane_weights, padded_chunks, row_scales, token_lanes_len,
        };
        use crate::simd::avx2_tokens::{decode_lane, decode_scales, finish, tiles};
        let n_chunks = mxfp4_contract::chunks(self.cols);
        let n_pad = padded_chunks(self.cols);
        let groups = t_rows.div_ceil(GROUP);
        // Inputs in halves of a group (one 256-bit vector each).
        let halves = t_rows.div_ceil(GROUP / 2);
        let rows_here = out.len() / t_rows.max(1);
        if t_rows == 0 || xt.len() < token_lanes_len(self.cols, t_rows) {
            return;
        }
        let row_bytes: Vec<RowBytes<'a>> =
            (r0..r0 + rows_here).map(|r| self.row_bytes(r)).collect();
        LANES_SCRATCH.with_borrow_mut(|(scratch, _)| {
            let [w, sc, acc] = scratch.take(&[
                lane_weights(rows_here),
                rows_here * row_scales(self.cols),
                accumulators_len(rows_here, groups),
            ]);
            decode_scales(&row_bytes, self.cols, sc);
            let sc = &*sc;
            for c0 in (0..n_chunks).step_by(LANES_BLOCK_CHUNKS) {
                let span = (c0, (c0 + LANES_BLOCK_CHUNKS).min(n_chunks));
                for k in 0..mxfp4_contract::CHUNK_LANES {
                    // With one group, each pair of rows is decoded right before its tiles; with more, every row is
                    // decoded first, then the pairs of groups run over all of them while their inputs stay in L1.
                    let step = if halves <= 2 {
                        AVX2_LANES_TILE_ROWS
                    } else {
                        rows_here
                    };
                    for q in (0..rows_here).step_by(step.max(1)) {
                        let rows = &row_bytes[q..(q + step).min(rows_here)];
                        // SAFETY: AVX2 present (inputs are laid out across the lanes only then); `w` holds lane k
                        // of `rows`.
                        unsafe { decode_lane(rows, c0, span.1 - c0, k, w) };
                        let w = &*w;
                        let sc = &sc[q * row_scales(self.cols)..];
                        let acc = &mut acc[accumulators_len(q, groups)..];
                        let mut h = 0;
                        while h < halves {
                            let (g, nr, here) = (h / 2, rows.len(), (halves - h).min(4));
                            // SAFETY (every arm): AVX2 and FMA present; the decoded lane, the multipliers, the inputs
                            // and the accumulators hold every row and group, and `span.1 <= n_chunks <= n_pad`.
                            match here {
                                1 => unsafe {
                                    tiles::<1>((w, sc), xt, (nr, g, k), span, n_pad, acc, groups)
                                },
                                2 => unsafe {
                                    tiles::<2>((w, sc), xt, (nr, g, k), span, n_pad, acc, groups)
                                },
                                3 => unsafe {
                                    tiles::<3>((w, sc), xt, (nr, g, k), span, n_pad, acc, groups)
                                },
                                _ => unsafe {
                                    tiles::<4>((w, sc), xt, (nr, g, k), span, n_pad, acc, groups)
                                },
                            }
                            h += here;
                        }
                    }
                }
            }
            let acc = &*acc;
            // SAFETY: AVX2 present; `acc` holds every pair.
            let sums = |r, g| unsafe { finish(acc, r, g, groups) };
            crate::simd::copy_group_sums(&mut out[..rows_here * t_rows], t_rows, sums);
        });
    }

    /// [`Self::rows_permuted`] for bf16 inputs ([`mxfp4_bf16_contract`]).
    fn rows_bf16(&self, r0: usize, xbs: &[u32], flush_free: bool, t_rows: usize, out: &mut [f32]) {
        // Only the AVX2 kernels skip flushes.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = flush_free;
        let kernels = WordKernels {
            chunk_words: mxfp4_bf16_contract::CHUNK_WORDS,
            reference: mxfp4_bf16_contract::dot_row_ref,
            #[cfg(target_arch = "x86_64")]
            simd: if crate::simd::has_avx512_bf16() {
                Some((
                    crate::simd::avx512::mxfp4_bf16_dot_rows::<2>,
                    crate::simd::avx512::mxfp4_bf16_row_multi,
                ))
            } else if crate::simd::has_avx2_fma() {
                // The flushes lengthen each lane's chain of FMAs (2.7× the time from L2 on a Zen 3 core); inputs of
                // any trained model's size make them no-ops (`flush_free`), so they run only where one could matter.
                Some(if flush_free {
                    (
                        crate::simd::avx2::mxfp4_bf16_dot_pair::<false>,
                        crate::simd::avx2::mxfp4_bf16_row_multi::<false>,
                    )
                } else {
                    (
                        crate::simd::avx2::mxfp4_bf16_dot_pair::<true>,
                        crate::simd::avx2::mxfp4_bf16_row_multi::<true>,
                    )
                })
            } else {
                None
            },
            // No NEON kernel: see `crate::simd::neon` for why.
            #[cfg(target_arch = "aarch64")]
            simd: None,
        };
        self.rows_words(r0, xbs, t_rows, out, &kernels);
    }

    /// [`Self::rows_permuted`] for inputs quantised to int16 ([`mxfp4_i16_contract`]).
    fn rows_i16(&self, r0: usize, xqs: &[u32], t_rows: usize, out: &mut [f32]) {
        let kernels = WordKernels {
            chunk_words: mxfp4_i16_contract::CHUNK_WORDS,
            reference: mxfp4_i16_contract::dot_row_ref,
            #[cfg(target_arch = "x86_64")]
            simd: if crate::simd::has_avx512_vnni() {
                Some((
                    crate::simd::avx512::mxfp4_i16_dot_rows::<2>,
                    crate::simd::avx512::mxfp4_i16_row_multi,
                ))
            } else if crate::simd::has_avx2_fma() {
                Some((
                    crate::simd::avx2::mxfp4_i16_dot_rows::<2>,
                    crate::simd::avx2::mxfp4_i16_row_multi,
                ))
            } else {
                None
            },
            #[cfg(target_arch = "aarch64")]
            simd: crate::simd::has_neon().then_some((
                crate::simd::neon::mxfp4_i16_dot_rows::<2>,
                crate::simd::neon::mxfp4_i16_row_multi,
            )),
        };
        self.rows_words(r0, xqs, t_rows, out, &kernels);
    }

    /// [`Self::rows_permuted`] for a contract whose permuted inputs are 32-bit words (`xs`, `t_rows` of them).
    fn rows_words(
        &self,
        r0: usize,
        xs: &[u32],
        t_rows: usize,
        out: &mut [f32],
        kernels: &WordKernels,
    ) {
        let x_len = mxfp4_contract::chunks(self.cols) * kernels.chunk_words;
        if t_rows == 0 || xs.len() != t_rows * x_len {
            return;
        }
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if let Some((pair_kernel, multi_kernel)) = kernels.simd {
            // SAFETY: `simd` is set only where the CPU has the kernels' features (`rows_bf16`, `rows_i16`); two
            // whole rows (checked in `new`) and one permuted input of `x_len` words.
            let pair = |rows| unsafe { pair_kernel(rows, xs) };
            // SAFETY: as above; one whole row and `out.len()` permuted inputs of `x_len` words.
            let multi = |(packed, scales): RowBytes<'a>, out: &mut [f32]| unsafe {
                multi_kernel(packed, scales, xs, x_len, out)
            };
            return self.run_rows(r0, t_rows, out, Some(&pair), &multi);
        }
        let each = |(packed, scales): RowBytes<'a>, out: &mut [f32]| {
            for (o, x) in out.iter_mut().zip(xs.chunks_exact(x_len)) {
                *o = (kernels.reference)(packed, scales, x);
            }
        };
        self.run_rows(r0, t_rows, out, None, &each);
    }

    /// Rows `r0 ..` into `out` (`[rows_here, t_rows]`): `multi` multiplies one row by every input; `pair`, where a
    /// kernel has one, multiplies two rows by a single input (`t_rows == 1`), sharing the input's loads.
    fn run_rows(
        &self,
        r0: usize,
        t_rows: usize,
        out: &mut [f32],
        pair: Option<&dyn Fn([RowBytes<'a>; 2]) -> [f32; 2]>,
        multi: &dyn Fn(RowBytes<'a>, &mut [f32]),
    ) {
        let mut r = r0;
        let mut rest = out;
        while !rest.is_empty() {
            match pair {
                Some(pair) if t_rows == 1 && rest.len() >= 2 => {
                    let (two, tail) = rest.split_at_mut(2);
                    two.copy_from_slice(&pair([self.row_bytes(r), self.row_bytes(r + 1)]));
                    (r, rest) = (r + 2, tail);
                }
                _ => {
                    let (one, tail) = rest.split_at_mut(t_rows.min(rest.len()));
                    multi(self.row_bytes(r), one);
                    (r, rest) = (r + 1, tail);
                }
            }
        }
    }

    fn row_bytes(&self, row: usize) -> RowBytes<'a> {
        let groups = self.cols / MXFP4_GROUP;
        (
            &self.packed[row * self.cols / 2..(row + 1) * self.cols / 2],
            &self.scales[row * groups..(row + 1) * groups],
        )
    }

    /// `y = W · x` with the scalar reference kernel.
    pub fn gemv_ref(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        self.check_input(x)?;
        let xp = mxfp4_contract::permute_input(x);
        for (r, out) in y.iter_mut().enumerate().take(self.rows) {
            let (packed, scales) = self.row_bytes(r);
            *out = mxfp4_contract::dot_row_ref(packed, scales, &xp);
        }
        Ok(())
    }

    /// `y[t] = W · x[t]` for `t_rows` rows of activations (`x` is `[t_rows, cols]`, `y` is `[t_rows, rows]`), on
    /// the fastest path, threaded over output rows. Each output is computed exactly as [`Self::dot_row_ref`], so
    /// the result does not depend on `t_rows`, the thread count or the SIMD path.
    pub fn gemm(&self, x: &[f32], t_rows: usize, y: &mut [f32]) -> Result<()> {
        gemm_batch(&mut [Mxfp4Product {
            matrix: *self,
            x,
            t_rows,
            y,
        }])
    }

    fn check_input(&self, x: &[f32]) -> Result<()> {
        if x.len() != self.cols {
            return Err(QuantError::BadInput {
                expected: self.cols,
                actual: x.len(),
            });
        }
        Ok(())
    }
}

/// One product of a batch: `y = W · x` for `t_rows` rows of activations, shaped as in [`Mxfp4Matrix::gemm`].
pub struct Mxfp4Product<'p, 'a> {
    /// The weights.
    pub matrix: Mxfp4Matrix<'a>,
    /// `[t_rows, cols]` activations.
    pub x: &'p [f32],
    /// Activation rows.
    pub t_rows: usize,
    /// `[t_rows, rows]` outputs.
    pub y: &'p mut [f32],
}

/// How the activations of an MXFP4 product are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mxfp4Input {
    /// Exact f32 ([`crate::mxfp4_contract`]): the path that matches the f32 reference.
    #[default]
    F32,
    /// Rounded to bf16 first ([`crate::mxfp4_bf16_contract`]), as the reference does in its native bf16 dtype;
    /// about 1.5× the f32 kernel's compute rate on CPUs with AVX-512 BF16, an exact form of f32 FMAs with AVX2 alone
    /// (slower than the f32 kernel: one chain of eight FMAs a lane), and the scalar reference (slow) on others,
    /// aarch64 included (`crate::simd::neon` says why).
    Bf16,
    /// Quantised to int16 per group of 32 ([`crate::mxfp4_i16_contract`]): each input moves by at most 1/65534 of
    /// its group's largest magnitude, and the products sum exactly in integers; the fast kernels need AVX-512 VNNI,
    /// AVX2 or NEON (aarch64), and others run the scalar reference (slow).
    I16,
}

impl std::str::FromStr for Mxfp4Input {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "i16" => Ok(Self::I16),
            other => Err(format!("expected f32, bf16 or i16, got `{other}`")),
        }
    }
}

impl std::fmt::Display for Mxfp4Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::I16 => "i16",
        })
    }
}

/// The kernels of an MXFP4 contract whose permuted input is 32-bit words (bf16 pairs, or int16 pairs and lane
/// multipliers).
struct WordKernels {
    /// Words per chunk of one permuted input.
    chunk_words: usize,
    /// The scalar reference of one row against one input.
    reference: fn(&[u8], &[u8], &[u32]) -> f32,
    /// The SIMD kernels (two rows against one input; one row against several inputs), set only where the CPU has
    /// the features they need.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    simd: Option<(PairKernel, MultiKernel)>,
}

/// A SIMD kernel of two neighbouring rows against one permuted input of words.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
type PairKernel = unsafe fn([RowBytes<'_>; 2], &[u32]) -> [f32; 2];

/// A SIMD kernel of one row against several permuted inputs of words (`(packed, scales, xs, x_len, out)`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
type MultiKernel = unsafe fn(&[u8], &[u8], &[u32], usize, &mut [f32]);

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread buffers of the tasks that multiply with the inputs across the lanes (a decoded lane of a few rows,
    /// multipliers, accumulators; the packed words of a block with lanes and chunks swapped beside them), kept
    /// between tasks: allocated afresh, each task's hundreds of KiB came from new zeroed pages.
    static LANES_SCRATCH: std::cell::RefCell<(Scratch<3>, Vec<u32>)> =
        std::cell::RefCell::new((Scratch::default(), Vec::new()));
}

/// `N` reusable, line-aligned f32 buffers.
#[cfg(target_arch = "x86_64")]
struct Scratch<const N: usize> {
    bufs: [crate::aligned::Lines; N],
}

#[cfg(target_arch = "x86_64")]
impl<const N: usize> Default for Scratch<N> {
    fn default() -> Self {
        Self {
            bufs: std::array::from_fn(|_| crate::aligned::Lines::zeroed(0)),
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl<const N: usize> Scratch<N> {
    /// The buffers, each grown to at least `lens[i]` values and cut to exactly that (old contents kept, not zeroed).
    fn take(&mut self, lens: &[usize; N]) -> [&mut [f32]; N] {
        for (b, &len) in self.bufs.iter_mut().zip(lens) {
            if b.len() < len {
                *b = crate::aligned::Lines::zeroed(len);
            }
        }
        let mut out = self.bufs.each_mut().map(|b| &mut b[..]);
        for (o, &len) in out.iter_mut().zip(lens) {
            *o = &mut std::mem::take(o)[..len];
        }
        out
    }
}

/// Permuted activation rows of one input, in the layout of the contract that reads them.
enum PermutedInput {
    F32(crate::aligned::Lines),
    /// Exact f32 inputs across the vector lanes ([`crate::mxfp4_lanes::token_lanes`]).
    #[cfg(target_arch = "x86_64")]
    F32Lanes(crate::aligned::Lines),
    Bf16 {
        words: Vec<u32>,
        /// [`mxfp4_bf16_contract::flush_free`] of `words`, checked once for every task that reads them.
        flush_free: bool,
    },
    I16(Vec<u32>),
}

impl PermutedInput {
    /// `t_rows` rows of `cols` activations in `x`, permuted for `input`.
    fn new(x: &[f32], cols: usize, input: Mxfp4Input) -> Self {
        let rows = x.chunks_exact(cols.max(1));
        #[cfg(target_arch = "x86_64")]
        if input == Mxfp4Input::F32 && lanes_min_tokens().is_some_and(|m| rows.len() >= m) {
            let t_rows = rows.len();
            return Self::F32Lanes(crate::mxfp4_lanes::token_lanes(x, cols, t_rows));
        }
        match input {
            Mxfp4Input::F32 => Self::F32(crate::aligned::Lines::copy_of(
                &rows
                    .flat_map(mxfp4_contract::permute_input)
                    .collect::<Vec<f32>>(),
            )),
            Mxfp4Input::Bf16 => {
                let words: Vec<u32> = rows.flat_map(mxfp4_bf16_contract::permute_input).collect();
                let flush_free = mxfp4_bf16_contract::flush_free(&words);
                Self::Bf16 { words, flush_free }
            }
            Mxfp4Input::I16 => {
                Self::I16(rows.flat_map(mxfp4_i16_contract::permute_input).collect())
            }
        }
    }
}

/// [`gemm_batch_with`] on exact f32 inputs.
pub fn gemm_batch(products: &mut [Mxfp4Product<'_, '_>]) -> Result<()> {
    gemm_batch_with(products, Mxfp4Input::F32)
}

/// Runs several products as one threaded job: the row blocks of every product are spread over the threads
/// together, so each thread streams through whole matrices instead of both threads meeting in each one, and the
/// threads fork and join once rather than once per matrix. On this project's 2-core machine, sixteen expert
/// matrices in one call read 1.6× faster than one call each (`examples/kernel_bandwidth.rs`). Every output is
/// bit-identical to the scalar reference of `input`'s contract ([`Mxfp4Matrix::dot_row_ref`],
/// [`Mxfp4Matrix::dot_row_bf16_ref`] or [`Mxfp4Matrix::dot_row_i16_ref`]), whatever the batch, thread count or SIMD
/// path.
pub fn gemm_batch_with(products: &mut [Mxfp4Product<'_, '_>], input: Mxfp4Input) -> Result<()> {
    for p in products.iter() {
        let (m, t) = (&p.matrix, p.t_rows);
        for (expected, actual) in [(t * m.cols, p.x.len()), (t * m.rows, p.y.len())] {
            if expected != actual {
                return Err(QuantError::BadInput { expected, actual });
            }
        }
    }
    let block = token_block(input);
    if products.iter().any(|p| p.t_rows > block) {
        return gemm_pieces(&mut token_blocks(products, block), input);
    }
    gemm_pieces(products, input)
}

/// Cuts every product of more than `block` activation rows into pieces of at most that many (consecutive
/// rows of `x` and `y`), keeping the products that share an input next to each other piece by piece, so that they
/// still share its permuted copy. Each output is computed exactly as before: only which task computes it changes.
fn token_blocks<'q, 'a>(
    products: &'q mut [Mxfp4Product<'_, 'a>],
    block: usize,
) -> Vec<Mxfp4Product<'q, 'a>> {
    let mut pieces = Vec::new();
    let mut rest = products;
    while !rest.is_empty() {
        let (x, cols, t_rows) = (rest[0].x, rest[0].matrix.cols, rest[0].t_rows);
        let n = rest
            .iter()
            .take_while(|p| std::ptr::eq(p.x, x) && p.matrix.cols == cols && p.t_rows == t_rows)
            .count();
        let (group, tail) = std::mem::take(&mut rest).split_at_mut(n);
        rest = tail;
        let matrices: Vec<Mxfp4Matrix<'a>> = group.iter().map(|p| p.matrix).collect();
        let mut ys: Vec<_> = group
            .iter_mut()
            .map(|p| p.y.chunks_mut(block * p.matrix.rows.max(1)))
            .collect();
        for xb in x.chunks(block * cols.max(1)) {
            let t = xb.len() / cols.max(1);
            for (matrix, y) in matrices.iter().zip(ys.iter_mut()) {
                if let Some(y) = y.next() {
                    pieces.push(Mxfp4Product {
                        matrix: *matrix,
                        x: xb,
                        t_rows: t,
                        y,
                    });
                }
            }
        }
    }
    pieces
}

/// [`gemm_batch_with`] for products of at most [`token_block`] activation rows (shapes checked).
fn gemm_pieces(products: &mut [Mxfp4Product<'_, '_>], input: Mxfp4Input) -> Result<()> {
    // Permuted inputs, one per distinct input; `input_of[i]` is product i's. Products over the same input next
    // to each other (an expert's gate and up) share one permuted copy.
    // They are built in parallel: for long prompts, dozens of experts' inputs of megabytes each.
    let mut firsts: Vec<usize> = Vec::with_capacity(products.len());
    let mut input_of = Vec::with_capacity(products.len());
    for (i, p) in products.iter().enumerate() {
        let shares_last = i > 0 && {
            let prev = &products[i - 1];
            std::ptr::eq(prev.x, p.x) && prev.matrix.cols == p.matrix.cols
        };
        if !shares_last {
            firsts.push(i);
        }
        input_of.push(firsts.len() - 1);
    }
    let inputs: Vec<PermutedInput> = {
        use rayon::prelude::*;
        let build = |&i: &usize| PermutedInput::new(products[i].x, products[i].matrix.cols, input);
        if firsts.len() < 2 {
            firsts.iter().map(build).collect()
        } else {
            firsts.par_iter().map(build).collect()
        }
    };
    // Blocks of rows by every input, each written into `y` by its task ([`crate::by_input`]).
    let matrices: Vec<Mxfp4Matrix<'_>> = products.iter().map(|p| p.matrix).collect();
    let grids = products
        .iter_mut()
        .enumerate()
        .map(|(i, p)| crate::by_input::Grid {
            rows: p.matrix.rows,
            t_rows: p.t_rows,
            row_step: if p.t_rows == 0 {
                1
            } else {
                rows_per_task(&p.matrix, p.t_rows, &inputs[input_of[i]])
            },
            input_step: p.t_rows,
            head: 0,
            y: &mut *p.y,
        })
        .collect();
    crate::by_input::fill(grids, |i, r0, tokens, out| {
        matrices[i].rows_permuted(r0, &inputs[input_of[i]], tokens.len(), out)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_table_matches_hand_values() {
        let expect = [
            (0x0, 0.0),
            (0x1, 0.5),
            (0x2, 1.0),
            (0x3, 1.5),
            (0x4, 2.0),
            (0x5, 3.0),
            (0x6, 4.0),
            (0x7, 6.0),
            (0x9, -0.5),
            (0xa, -1.0),
            (0xb, -1.5),
            (0xc, -2.0),
            (0xd, -3.0),
            (0xe, -4.0),
            (0xf, -6.0),
        ];
        for (code, v) in expect {
            assert_eq!(e2m1_value(code), v, "code {code:#x}");
        }
        assert!(e2m1_value(0x8) == 0.0 && e2m1_value(0x8).is_sign_negative());
    }

    #[test]
    fn e8m0_is_an_exact_power_of_two() {
        assert_eq!(e8m0_scale(127), Some(1.0));
        assert_eq!(e8m0_scale(128), Some(2.0));
        assert_eq!(e8m0_scale(126), Some(0.5));
        assert_eq!(e8m0_scale(254), Some(2f32.powi(127)));
        assert_eq!(e8m0_scale(0), Some(2f32.powi(-127)));
        assert_eq!(e8m0_scale(1), Some(2f32.powi(-126)));
        assert_eq!(e8m0_scale(255), None);
    }

    /// One row of 32 values: codes 0..16 then 16 codes of 0x7 (6.0), scale 2^(130-127) = 8.
    fn one_row() -> (Vec<u8>, Vec<u8>) {
        let mut packed = Vec::new();
        for j in 0..8u8 {
            // element 2j = code 2j (low nibble), element 2j+1 = code 2j+1 (high nibble)
            packed.push((2 * j) | ((2 * j + 1) << 4));
        }
        packed.extend(std::iter::repeat_n(0x77u8, 8));
        (packed, vec![130])
    }

    #[test]
    fn dequantize_matches_hand_computed_row() {
        let (packed, scales) = one_row();
        let m = Mxfp4Matrix::new(&packed, &scales, 1, 32).expect("valid shape");
        let w = m.dequantize_ref();
        let mut expect: Vec<f32> = (0..16u8).map(|c| e2m1_value(c) * 8.0).collect();
        expect.extend(std::iter::repeat_n(48.0, 16));
        assert_eq!(w, expect);
        assert_eq!(w[1], 4.0); // 0.5 * 8, from the high nibble of byte 0
        assert_eq!(w[15], -48.0); // code 15 = -6
    }

    #[test]
    fn fused_dot_matches_hand_value() {
        let (packed, scales) = one_row();
        let m = Mxfp4Matrix::new(&packed, &scales, 1, 32).expect("valid shape");
        let mut x = vec![0.0f32; 32];
        x[1] = 1.0; // 4.0
        x[5] = 2.0; // code 5 = 3.0 * 8 = 24 -> 48
        x[31] = -0.5; // 48 * -0.5 = -24
        assert_eq!(m.dot_row_ref(0, &x), 4.0 + 48.0 - 24.0);
        let mut y = [0.0];
        m.gemv_ref(&x, &mut y).expect("right length");
        assert_eq!(y[0], 28.0);
    }

    #[test]
    fn rejects_nan_scale_and_bad_shapes() {
        let (packed, _) = one_row();
        assert_eq!(
            Mxfp4Matrix::new(&packed, &[255], 1, 32).err(),
            Some(QuantError::NanScale { row: 0, group: 0 })
        );
        assert!(matches!(
            Mxfp4Matrix::new(&packed, &[127], 1, 48),
            Err(QuantError::BadColumns { .. })
        ));
        assert!(matches!(
            Mxfp4Matrix::new(&packed[..15], &[127], 1, 32),
            Err(QuantError::BadLength { what: "packed", .. })
        ));
        let m = Mxfp4Matrix::new(&packed, &[127], 1, 32).expect("valid");
        assert!(m.gemv_ref(&[0.0; 31], &mut [0.0]).is_err());
    }
}
