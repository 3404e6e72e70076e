//! The contract of the row-wise int8 kernels: int8 weights against an input quantised to int16, summed exactly.
//!
//! An int8 row is `w[c] = q[c] · s_w` (one scale per row, see [`crate::DenseMatrix::to_int8`]). The input is
//! quantised once per product, for all rows: `s_x = max|x| / 32767`, `x_q[c] = round(x[c] / s_x)` (nearest, ties
//! away from zero, clamped to ±32767). A row's result is `y = (Σ q[c] · x_q[c]) · s_w · s_x`, where the sum is an
//! exact integer (`i64`) and the product with the scales is taken in f64 and rounded once to f32.
//!
//! Because the sum is exact, its order is free: the scalar reference, AVX2 (`vpmaddwd`) and AVX-512 VNNI
//! (`vpdpwssd`, two int16 products per 32-bit lane and instruction) all give the same bits, and a kernel only has to
//! keep its 32-bit lanes from overflowing: a product is at most 128 · 32767 in size, two per lane and step, so 256
//! steps fit (see [`SEGMENT_STEPS`]) before the lanes are widened to 64 bits.
//!
//! The quantised input adds an error of at most `s_x / 2` per input value, that is `max|x| / 65534`: far below the
//! weights' own rounding (`max|w| / 254` per weight), so the int8 spine's accuracy is set by its weights. An input
//! with a NaN or an infinity gives NaN results, as the f32 arithmetic would.

use crate::quantise;

/// Largest magnitude of a quantised input value.
pub const X_MAX: f32 = quantise::Q_MAX;

/// Steps of two products per 32-bit lane that cannot overflow it: `256 · 2 · 128 · 32767 < 2^31`.
pub const SEGMENT_STEPS: usize = 256;

/// An input vector quantised for the int8 kernels: `x ≈ scale · q`, with `q` zero-padded to a whole number of
/// 64-value blocks so that kernels may load whole vectors.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedInput {
    q: Vec<i16>,
    len: usize,
    scale: f32,
}

impl QuantizedInput {
    /// Values padded to a multiple of this.
    pub const PAD: usize = 64;

    /// Quantises `x` as the contract says.
    pub fn new(x: &[f32]) -> Self {
        let padded = x.len().div_ceil(Self::PAD) * Self::PAD;
        let mut q = vec![0i16; padded];
        let scale = quantise::symmetric(x, &mut q[..x.len()]);
        Self {
            q,
            len: x.len(),
            scale,
        }
    }

    /// The quantised values, zero-padded to a multiple of [`Self::PAD`].
    pub fn values(&self) -> &[i16] {
        &self.q
    }

    /// The number of input values (before padding).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the input has no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `s_x`: `x ≈ scale · q` (NaN for an input with a non-finite value).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// A row's result from its exact integer sum and its weight scale.
    #[inline]
    pub fn finish(&self, sum: i64, row_scale: f32) -> f32 {
        (sum as f64 * row_scale as f64 * self.scale as f64) as f32
    }
}

/// `Σ q[c] · x_q[c]` over the row `q` (as long as the input): the scalar reference.
pub fn dot_ref(q: &[i8], x: &QuantizedInput) -> i64 {
    q.iter()
        .zip(x.values())
        .take(x.len())
        .map(|(&w, &v)| w as i64 * v as i64)
        .sum()
}

/// `Σ q[c] · x_q[c]` on the fastest path (equal to [`dot_ref`]).
pub fn dot(q: &[i8], x: &QuantizedInput) -> i64 {
    let q = &q[..q.len().min(x.len())];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512_vnni() {
        // SAFETY: AVX-512F/BW and VNNI present; `x` is padded to a multiple of 64 past `q.len()`.
        return unsafe { crate::simd::avx512::int8_dot(q, x.values()) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 present; `x` is padded to a multiple of 64 past `q.len()`.
        return unsafe { crate::simd::avx2::int8_dot(q, x.values()) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::int8_dot(q, x.values());
    }
    dot_ref(q, x)
}

/// `out[i · xs.len() + t] = xs[t].finish(Σ rows[i] · xs[t], scales[i])` for every row and input (prefill's
/// multi-token form), each equal to what [`dot`] and [`QuantizedInput::finish`] give one product. On x86-64 the sums
/// run in tiles of rows by inputs, each row's 32 weights widened once for all of a tile's inputs: four rows by four
/// inputs with AVX-512 VNNI ([`crate::simd::avx512::int8_tile`]), two by four with AVX2 alone
/// ([`crate::simd::avx2::int8_tile`]); elsewhere, or for rows and inputs of unequal lengths, one product at a time.
pub fn dot_tiles(rows: &[&[i8]], scales: &[f32], xs: &[&QuantizedInput], out: &mut [f32]) {
    let tokens = xs.len();
    let n = rows.first().map_or(0, |q| q.len());
    let fits = rows.iter().all(|q| q.len() == n)
        && xs.iter().all(|x| x.len() == n)
        && scales.len() >= rows.len()
        && out.len() >= rows.len() * tokens;
    #[cfg(target_arch = "x86_64")]
    let (vnni, avx2) = (crate::simd::has_avx512_vnni(), crate::simd::has_avx2_fma());
    #[cfg(target_arch = "x86_64")]
    if fits && (vnni || avx2) {
        let tiles = Tiles {
            rows,
            scales,
            xs,
            out,
        };
        if vnni {
            use crate::simd::avx512::int8_tile;
            tiles.walk((&[4, 1], &[4, 2, 1]), |tile, at, shape| {
                // SAFETY (every arm): AVX-512F/BW and VNNI present; rows of one length `n`, inputs of `n`
                // values padded to a multiple of 64 (checked above).
                unsafe {
                    match shape {
                        (4, 4) => tile.run(at, int8_tile::<4, 4>),
                        (4, 2) => tile.run(at, int8_tile::<4, 2>),
                        (4, _) => tile.run(at, int8_tile::<4, 1>),
                        (_, 4) => tile.run(at, int8_tile::<1, 4>),
                        (_, 2) => tile.run(at, int8_tile::<1, 2>),
                        _ => tile.run(at, int8_tile::<1, 1>),
                    }
                }
            });
        } else {
            use crate::simd::avx2::int8_tile;
            tiles.walk((&[2, 1], &[4, 3, 2, 1]), |tile, at, shape| {
                // SAFETY (every arm): AVX2 present; rows of one length `n`, inputs of `n` values padded to a
                // multiple of 64 (checked above).
                unsafe {
                    match shape {
                        (2, 4) => tile.run(at, int8_tile::<2, 4>),
                        (2, 3) => tile.run(at, int8_tile::<2, 3>),
                        (2, 2) => tile.run(at, int8_tile::<2, 2>),
                        (2, _) => tile.run(at, int8_tile::<2, 1>),
                        (_, 4) => tile.run(at, int8_tile::<1, 4>),
                        (_, 3) => tile.run(at, int8_tile::<1, 3>),
                        (_, 2) => tile.run(at, int8_tile::<1, 2>),
                        _ => tile.run(at, int8_tile::<1, 1>),
                    }
                }
            });
        }
        return;
    }
    let _ = fits;
    for (i, q) in rows.iter().enumerate() {
        for (t, x) in xs.iter().enumerate() {
            out[i * tokens + t] = x.finish(dot(q, x), scales[i]);
        }
    }
}

/// A tile kernel: the exact sums of `R` rows by `T` quantised inputs.
#[cfg(target_arch = "x86_64")]
type TileKernel<const R: usize, const T: usize> =
    unsafe fn([&[i8]; R], [&[i16]; T]) -> [[i64; T]; R];

/// The operands of [`dot_tiles`], walked in tiles of rows by inputs.
#[cfg(target_arch = "x86_64")]
struct Tiles<'a, 'o> {
    rows: &'a [&'a [i8]],
    scales: &'a [f32],
    xs: &'a [&'a QuantizedInput],
    out: &'o mut [f32],
}

#[cfg(target_arch = "x86_64")]
impl Tiles<'_, '_> {
    /// Calls `f(self, (r0, t0), (rows, inputs))` for every tile, rows outermost (a tile's rows stay in cache across
    /// the inputs); a tile's rows and inputs are each the largest of `sizes` (descending, ending in 1) that fit.
    fn walk(
        mut self,
        sizes: (&[usize], &[usize]),
        mut f: impl FnMut(&mut Self, (usize, usize), (usize, usize)),
    ) {
        let step =
            |left: usize, sizes: &[usize]| sizes.iter().copied().find(|&s| s <= left).unwrap_or(1);
        let (rows, tokens) = (self.rows.len(), self.xs.len());
        let mut r0 = 0;
        while r0 < rows {
            let nr = step(rows - r0, sizes.0);
            let mut t0 = 0;
            while t0 < tokens {
                let nt = step(tokens - t0, sizes.1);
                f(&mut self, (r0, t0), (nr, nt));
                t0 += nt;
            }
            r0 += nr;
        }
    }

    /// The tile of rows `r0 .. r0 + R` by inputs `t0 .. t0 + T` through `kernel` (its exact sums), into `out`.
    ///
    /// # Safety
    /// `kernel` must be safe to call on this CPU with `R` rows of one length `n` and `T` inputs of `n` values padded
    /// to a multiple of 64; the tile lies within the rows and inputs.
    unsafe fn run<const R: usize, const T: usize>(
        &mut self,
        (r0, t0): (usize, usize),
        kernel: TileKernel<R, T>,
    ) {
        let tokens = self.xs.len();
        let tile_rows: [&[i8]; R] = std::array::from_fn(|k| self.rows[r0 + k]);
        let inputs: [&[i16]; T] = std::array::from_fn(|k| self.xs[t0 + k].values());
        // SAFETY: forwarded from the caller; `QuantizedInput` pads its values to a multiple of 64.
        let sums = unsafe { kernel(tile_rows, inputs) };
        for (k, row) in sums.iter().enumerate() {
            for (j, &sum) in row.iter().enumerate() {
                self.out[(r0 + k) * tokens + t0 + j] =
                    self.xs[t0 + j].finish(sum, self.scales[r0 + k]);
            }
        }
    }
}

/// Two rows against one input (neighbouring rows of a matrix read fastest), each equal to [`dot_ref`].
pub fn dot_x2(q0: &[i8], q1: &[i8], x: &QuantizedInput) -> [i64; 2] {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512_vnni() && q0.len() == x.len() && q1.len() == x.len() {
        // SAFETY: AVX-512F/BW and VNNI present; equal lengths, `x` padded to a multiple of 64.
        return unsafe { crate::simd::avx512::int8_dot_x2(q0, q1, x.values()) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && q0.len() == x.len() && q1.len() == x.len() {
        // SAFETY: AVX2 present; equal lengths, `x` padded to a multiple of 64.
        return unsafe { crate::simd::avx2::int8_dot_x2(q0, q1, x.values()) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() && q0.len() == x.len() && q1.len() == x.len() {
        return crate::simd::neon::int8_dot_x2(q0, q1, x.values());
    }
    [dot(q0, x), dot(q1, x)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantises_to_the_largest_magnitude() {
        let x = QuantizedInput::new(&[0.5, -2.0, 1.0, 0.0]);
        assert_eq!(x.scale(), 2.0 / X_MAX);
        assert_eq!(&x.values()[..4], &[8192, -32767, 16384, 0]);
        assert_eq!(x.values().len(), QuantizedInput::PAD);
        assert!(x.values()[4..].iter().all(|&v| v == 0));
        assert_eq!(x.len(), 4);
    }

    #[test]
    fn zero_and_non_finite_inputs() {
        let zero = QuantizedInput::new(&[0.0; 3]);
        assert_eq!(zero.finish(dot_ref(&[1, 2, 3], &zero), 0.5), 0.0);
        for bad in [f32::NAN, f32::INFINITY] {
            let x = QuantizedInput::new(&[1.0, bad]);
            assert!(x.finish(dot_ref(&[1, 1], &x), 1.0).is_nan());
        }
        assert!(QuantizedInput::new(&[]).is_empty());
    }

    #[test]
    fn result_is_close_to_the_f32_product() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let q: Vec<i8> = (0..1000i32).map(|i| (i * 53 % 255 - 127) as i8).collect();
        let row_scale = 0.004f32;
        let xq = QuantizedInput::new(&x);
        let got = xq.finish(dot_ref(&q, &xq), row_scale) as f64;
        let exact: f64 = q
            .iter()
            .zip(&x)
            .map(|(&w, &v)| w as f64 * row_scale as f64 * v as f64)
            .sum();
        // Each input value is off by at most s_x / 2.
        let bound: f64 = q
            .iter()
            .map(|&w| (w as f64 * row_scale as f64).abs())
            .sum::<f64>()
            * xq.scale() as f64
            / 2.0;
        assert!(
            (got - exact).abs() <= bound + 1e-6 * exact.abs(),
            "{got} vs {exact}"
        );
    }
}
