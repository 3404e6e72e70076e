//! Dense weight matrices (f32, bf16, row-wise int8) and their GEMM over a few rows of activations.
//!
//! Every output element is one dot product in the fixed order of [`crate::dot`] (f32), [`crate::bf16_contract`]
//! (bf16, against the input permuted once per product) or an exact integer sum against the input row quantised on
//! its own ([`crate::int8_contract`], int8), so results do not depend on the number of activation rows, the thread
//! count or the SIMD path: a batch of T rows gives bit-identical rows to T calls with one row each.

use rayon::prelude::*;

use crate::bf16_contract;
use crate::dot::{bf16_to_f32, dot_f32, dot_f32_ref, dot_f32_x2};
use crate::error::{QuantError, Result};
use crate::int8_contract::{self, QuantizedInput};
use crate::pages::huge_page_vec;
use crate::words::Words;

/// Storage of a dense `[rows, cols]` weight, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum DenseData {
    /// f32 values.
    F32(Vec<f32>),
    /// Raw bf16 bits (owned, or in place in the buffer they were read into).
    Bf16(Words<u16>),
    /// Row-wise int8: `w[r, c] = q[r, c] · scales[r]`.
    Int8 {
        /// Quantised values (owned, or in place in the buffer they were read into).
        q: Words<i8>,
        /// One scale per row.
        scales: Vec<f32>,
    },
}

/// A dense weight `[rows, cols]` (PyTorch `[out, in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    data: DenseData,
    /// The device copy, when the model runs on CUDA (see `crate::cuda::dense`).
    #[cfg(feature = "cuda")]
    cuda: crate::cuda::dense::CudaTwin,
}

impl DenseMatrix {
    /// Wraps `data` as `[rows, cols]`, checking its length.
    pub fn new(rows: usize, cols: usize, data: DenseData) -> Result<Self> {
        let (len, what) = match &data {
            DenseData::F32(v) => (v.len(), "f32 data"),
            DenseData::Bf16(v) => (v.len(), "bf16 data"),
            DenseData::Int8 { q, scales } => {
                if scales.len() != rows {
                    return Err(QuantError::BadLength {
                        what: "int8 scales",
                        rows,
                        cols,
                        expected: rows,
                        actual: scales.len(),
                    });
                }
                (q.len(), "int8 data")
            }
        };
        if len != rows * cols {
            return Err(QuantError::BadLength {
                what,
                rows,
                cols,
                expected: rows * cols,
                actual: len,
            });
        }
        Ok(Self {
            rows,
            cols,
            data,
            #[cfg(feature = "cuda")]
            cuda: Default::default(),
        })
    }

    /// The slot of the device copy.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_twin(&self) -> &crate::cuda::dense::CudaTwin {
        &self.cuda
    }

    /// Drops the host values, keeping the shape and the kind (the caller holds a device copy).
    #[cfg(feature = "cuda")]
    pub(crate) fn release_values(&mut self) {
        self.data = match &self.data {
            DenseData::F32(_) => DenseData::F32(Vec::new()),
            DenseData::Bf16(_) => DenseData::Bf16(Vec::new().into()),
            DenseData::Int8 { .. } => DenseData::Int8 {
                q: Vec::new().into(),
                scales: Vec::new(),
            },
        };
    }

    /// Rows (outputs).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The storage.
    pub fn data(&self) -> &DenseData {
        &self.data
    }

    /// Elements held on the host: `rows · cols`, or 0 once the values live only on the GPU.
    pub fn host_len(&self) -> usize {
        match &self.data {
            DenseData::F32(v) => v.len(),
            DenseData::Bf16(v) => v.len(),
            DenseData::Int8 { q, .. } => q.len(),
        }
    }

    /// Bytes of weight storage on the host.
    pub fn nbytes(&self) -> usize {
        match &self.data {
            DenseData::F32(v) => v.len() * 4,
            DenseData::Bf16(v) => v.len() * 2,
            DenseData::Int8 { q, scales } => q.len() + scales.len() * 4,
        }
    }

    /// Row `r` as f32 values.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            DenseData::F32(v) => v[span].to_vec(),
            DenseData::Bf16(v) => v[span].iter().map(|&b| bf16_to_f32(b)).collect(),
            DenseData::Int8 { q, scales } => {
                q[span].iter().map(|&v| v as f32 * scales[r]).collect()
            }
        }
    }

    /// Every value as f32, row after row: [`Self::row_f32`] of each row, in one vector.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            DenseData::F32(v) => v.to_vec(),
            DenseData::Bf16(v) => v.iter().map(|&b| bf16_to_f32(b)).collect(),
            DenseData::Int8 { q, scales } => q
                .chunks_exact(self.cols.max(1))
                .zip(scales)
                .flat_map(|(row, &s)| row.iter().map(move |&v| v as f32 * s))
                .collect(),
        }
    }

    /// `w[r] · x` on the fastest path. A bf16 matrix permutes `x`, an f32 one copies it onto whole cache lines and an
    /// int8 one quantises it, for this one row;
    /// [`Self::dot_rows`] and [`Self::gemm`] prepare each input once for all rows.
    #[inline]
    pub fn dot_row(&self, r: usize, x: &[f32]) -> f32 {
        self.row_with(r, &self.prepare(x))
    }

    /// `out[i] = w[r0 + i] · x` on the fastest path, two rows per kernel call where the CPU allows (bf16 rows:
    /// [`bf16_contract::rows_per_call`]), each result bit-identical to [`Self::dot_row`].
    pub fn dot_rows(&self, r0: usize, x: &[f32], out: &mut [f32]) {
        self.rows_with(r0, &self.prepare(x), out);
    }

    /// One input row `x` as this matrix's kernels read it.
    fn prepare(&self, x: &[f32]) -> Prepared {
        match self.data {
            DenseData::F32(_) => Prepared::F32(crate::aligned::Lines::copy_of(x)),
            DenseData::Bf16(_) => Prepared::Bf16(bf16_contract::permute_input(x)),
            DenseData::Int8 { .. } => Prepared::Int8(QuantizedInput::new(x)),
        }
    }

    /// Row `r` against a prepared input.
    fn row_with(&self, r: usize, x: &Prepared) -> f32 {
        let span = r * self.cols..(r + 1) * self.cols;
        match (&self.data, x) {
            (DenseData::F32(v), Prepared::F32(x)) => dot_f32(&v[span], &x[..self.cols]),
            (DenseData::Bf16(v), Prepared::Bf16(xp)) => bf16_contract::dot(&v[span], xp),
            (DenseData::Int8 { q, scales }, Prepared::Int8(xq)) => {
                xq.finish(int8_contract::dot(&q[span], xq), scales[r])
            }
            // `prepare` matches the data kind; a mismatch is a bug, and NaN makes it loud.
            _ => f32::NAN,
        }
    }

    /// Rows `r0 .. r0 + out.len()` against a prepared input, several rows per kernel call where the CPU allows.
    fn rows_with(&self, r0: usize, x: &Prepared, out: &mut [f32]) {
        let c = self.cols;
        let one = |r: usize| self.row_with(r, x);
        match (&self.data, x) {
            (DenseData::F32(v), Prepared::F32(x)) => by_pairs(
                out,
                r0,
                |r| dot_f32_x2(row(v, r, c), row(v, r + 1, c), &x[..c]),
                one,
            ),
            (DenseData::Bf16(v), Prepared::Bf16(xp)) => {
                let by_four = if bf16_contract::rows_per_call() == 4 {
                    out.len() / 4 * 4
                } else {
                    0
                };
                let (fours, rest) = out.split_at_mut(by_four);
                for (i, four) in fours.chunks_exact_mut(4).enumerate() {
                    let r = r0 + 4 * i;
                    let rows = std::array::from_fn(|k| row(v, r + k, c));
                    four.copy_from_slice(&bf16_contract::dot_x4(rows, xp));
                }
                by_pairs(
                    rest,
                    r0 + by_four,
                    |r| bf16_contract::dot_x2(row(v, r, c), row(v, r + 1, c), xp),
                    one,
                );
            }
            (DenseData::Int8 { q, scales }, Prepared::Int8(xq)) => {
                crate::simd::prefetch_slice(scales.get(r0..r0 + out.len()).unwrap_or(&[]));
                let pair = |r: usize| {
                    let [ya, yb] = int8_contract::dot_x2(row(q, r, c), row(q, r + 1, c), xq);
                    [xq.finish(ya, scales[r]), xq.finish(yb, scales[r + 1])]
                };
                by_pairs(out, r0, pair, one);
            }
            _ => out.fill(f32::NAN),
        }
    }

    /// `w[r] · x`, scalar reference.
    pub fn dot_row_ref(&self, r: usize, x: &[f32]) -> f32 {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            DenseData::F32(v) => dot_f32_ref(&v[span], x),
            DenseData::Bf16(v) => bf16_contract::dot_bf16_ref(&v[span], x),
            DenseData::Int8 { q, scales } => {
                let xq = QuantizedInput::new(x);
                xq.finish(int8_contract::dot_ref(&q[span], &xq), scales[r])
            }
        }
    }

    /// `y = x · wᵀ` for `x [t_rows, cols]`, giving `y [t_rows, rows]`: fastest path, threaded over output rows.
    pub fn gemm(&self, x: &[f32], t_rows: usize) -> Result<Vec<f32>> {
        self.check(x, t_rows)?;
        if t_rows == 1 {
            let mut y = vec![0.0f32; self.rows];
            let x = self.prepare(x);
            par_row_blocks(&mut y, |r0, out| self.rows_with(r0, &x, out));
            return Ok(y);
        }
        let mut ys = gemm_tokens(&[self], &[OutputLayout::ByInput], x, t_rows);
        Ok(ys.pop().unwrap_or_default())
    }

    /// Scalar, single-threaded twin of [`Self::gemm`].
    pub fn gemm_ref(&self, x: &[f32], t_rows: usize) -> Result<Vec<f32>> {
        self.check(x, t_rows)?;
        let mut y = vec![0.0f32; t_rows * self.rows];
        for t in 0..t_rows {
            for r in 0..self.rows {
                y[t * self.rows + r] = self.dot_row_ref(r, &x[t * self.cols..(t + 1) * self.cols]);
            }
        }
        Ok(y)
    }

    fn check(&self, x: &[f32], t_rows: usize) -> Result<()> {
        if self.host_len() != self.rows * self.cols {
            return Err(QuantError::HostReleased {
                rows: self.rows,
                cols: self.cols,
            });
        }
        if x.len() != t_rows * self.cols {
            return Err(QuantError::BadInput {
                expected: t_rows * self.cols,
                actual: x.len(),
            });
        }
        Ok(())
    }

    /// Row-wise symmetric int8 quantisation of this matrix: `scale[r] = max|w[r]| / 127`, `q = round(w / scale)`.
    pub fn to_int8(&self) -> DenseMatrix {
        let mut q = huge_page_vec(self.rows * self.cols);
        let mut scales = Vec::with_capacity(self.rows);
        for r in 0..self.rows {
            let row = self.row_f32(r);
            let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
            scales.push(scale);
            q.extend(
                row.iter()
                    .map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8),
            );
        }
        DenseMatrix {
            rows: self.rows,
            cols: self.cols,
            data: DenseData::Int8 {
                q: q.into(),
                scales,
            },
            #[cfg(feature = "cuda")]
            cuda: Default::default(),
        }
    }
}

/// `y_i = x · w_iᵀ` for several matrices that read the same input `x [t_rows, cols]` (a layer's q, k and v
/// projections, say), as one threaded job: the row blocks of every matrix are spread over the threads together,
/// so the threads fork and join once rather than once per matrix, and a thread runs from one matrix into the next
/// instead of waiting at each one's end. Each output is bit-identical to that matrix's [`DenseMatrix::gemm`].
pub fn gemm_many(mats: &[&DenseMatrix], x: &[f32], t_rows: usize) -> Result<Vec<Vec<f32>>> {
    gemm_many_laid_out(mats, &vec![OutputLayout::ByInput; mats.len()], x, t_rows)
}

/// How a product's output `y` for `t_rows` inputs is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputLayout {
    /// `[t_rows, rows]`: each input's outputs together.
    ByInput,
    /// `[rows / h, t_rows, h]` for `Heads(h)`, `h` a divisor of the rows: the outputs in heads of `h`, each head's
    /// outputs for every input together, as attention reads them head by head (a head's `[t_rows, h]` is one
    /// contiguous run instead of `t_rows` runs a whole output row apart). One input's layouts coincide.
    Heads(usize),
}

impl OutputLayout {
    /// `y [t_rows, rows]` (by input) rearranged into this layout (the same values; heads that do not divide `rows`
    /// leave it by input, as [`gemm_many_laid_out`] refuses them).
    pub fn arrange(self, y: Vec<f32>, t_rows: usize, rows: usize) -> Vec<f32> {
        let h = match self {
            OutputLayout::Heads(h) if h > 0 && h < rows && rows.is_multiple_of(h) => h,
            _ => return y,
        };
        let mut out = Vec::with_capacity(y.len());
        for head in 0..rows / h {
            for t in 0..t_rows {
                out.extend_from_slice(&y[t * rows + head * h..t * rows + (head + 1) * h]);
            }
        }
        out
    }
}

/// [`gemm_many`] with each output in its own layout (`layouts[i]` for `mats[i]`). The values are the same bits as
/// [`gemm_many`]'s, only placed differently.
pub fn gemm_many_laid_out(
    mats: &[&DenseMatrix],
    layouts: &[OutputLayout],
    x: &[f32],
    t_rows: usize,
) -> Result<Vec<Vec<f32>>> {
    if layouts.len() != mats.len() {
        return Err(QuantError::BadLayout(format!(
            "{} layouts for {} matrices",
            layouts.len(),
            mats.len()
        )));
    }
    for (m, layout) in mats.iter().zip(layouts) {
        m.check(x, t_rows)?;
        if let OutputLayout::Heads(h) = *layout
            && (h == 0 || !m.rows.is_multiple_of(h))
        {
            return Err(QuantError::BadLayout(format!(
                "heads of {h} outputs for a matrix of {} rows",
                m.rows
            )));
        }
    }
    if t_rows != 1 {
        return Ok(gemm_tokens(mats, layouts, x, t_rows));
    }
    // The input prepared once per kind of matrix that reads it.
    let mut prepared: Vec<Prepared> = Vec::new();
    let mut input_of = Vec::with_capacity(mats.len());
    for m in mats {
        let p = m.prepare(x);
        let at = match prepared.iter().position(|q| q.same_kind(&p)) {
            Some(at) => at,
            None => {
                prepared.push(p);
                prepared.len() - 1
            }
        };
        input_of.push(at);
    }
    let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0.0f32; m.rows]).collect();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, y) in ys.iter_mut().enumerate() {
        for (k, out) in y.chunks_mut(DENSE_ROWS_PER_TASK).enumerate() {
            tasks.push((i, k * DENSE_ROWS_PER_TASK, out));
        }
    }
    let run = |(i, r0, out): (usize, usize, &mut [f32])| {
        mats[i].rows_with(r0, &prepared[input_of[i]], out)
    };
    if tasks.len() < 4 {
        tasks.into_iter().for_each(run);
    } else {
        tasks.into_par_iter().for_each(run);
    }
    Ok(ys)
}

/// [`gemm_many`] for more than one activation row (shapes checked): each input row is prepared once per kind of
/// matrix, in parallel, and the bf16 matrices' tiles all run in one threaded job ([`par_row_tiles`]), so the
/// projections that read one input (KDA's six, a GLU's gate and up) share its permuted copy and one barrier. Each
/// output is written in its layout (checked by the caller).
fn gemm_tokens(
    mats: &[&DenseMatrix],
    layouts: &[OutputLayout],
    x: &[f32],
    t_rows: usize,
) -> Vec<Vec<f32>> {
    let Some(first) = mats.first() else {
        return Vec::new();
    };
    let cols = first.cols.max(1);
    let prepare_all = |m: &DenseMatrix| -> Vec<Prepared> {
        x.par_chunks_exact(cols)
            .take(t_rows)
            .map(|x| m.prepare(x))
            .collect()
    };
    // One prepared set per kind of matrix (`DenseData` variant), built for the first matrix of that kind.
    let mut kinds: Vec<(std::mem::Discriminant<DenseData>, Vec<Prepared>)> = Vec::new();
    let mut input_of = Vec::with_capacity(mats.len());
    for m in mats {
        let kind = std::mem::discriminant(&m.data);
        let at = match kinds.iter().position(|(k, _)| *k == kind) {
            Some(at) => at,
            None => {
                kinds.push((kind, prepare_all(m)));
                kinds.len() - 1
            }
        };
        input_of.push(at);
    }
    let mut ys: Vec<Vec<f32>> = mats
        .iter()
        .map(|m| crate::zeroed::zeroed(t_rows * m.rows))
        .collect();
    // Every matrix in tiles of rows by inputs (each weight row loaded, and widened, once for every input of a tile),
    // together: per matrix, its inputs as the float kernels read them, and as the int8 kernels do.
    let inputs: Vec<Vec<&[f32]>> = input_of
        .iter()
        .map(|&at| {
            kinds[at]
                .1
                .iter()
                .filter_map(|p| match p {
                    Prepared::Bf16(xp) => Some(&**xp),
                    Prepared::F32(x) => Some(&x[..cols]),
                    Prepared::Int8(_) => None,
                })
                .collect()
        })
        .collect();
    let quantised: Vec<Vec<&QuantizedInput>> = input_of
        .iter()
        .map(|&at| {
            kinds[at]
                .1
                .iter()
                .filter_map(|p| match p {
                    Prepared::Int8(xq) => Some(xq),
                    _ => None,
                })
                .collect()
        })
        .collect();
    // The inputs across the vector lanes, one layout per piece of `TOKEN_BLOCK` inputs, where the lane kernels run
    // (`bf16_contract::dot_lanes`, `dot::dot_f32_lanes`). One kind's matrices may have it laid out for the other's, so
    // each kind asks for its own kernel's choice.
    let lanes = lanes_inputs(mats, x, t_rows);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = &lanes;
    {
        let mut outs: Vec<(usize, usize, &mut [f32])> = mats
            .iter()
            .zip(layouts)
            .zip(ys.iter_mut())
            .map(|((m, layout), y)| {
                let head = match *layout {
                    OutputLayout::ByInput => m.rows,
                    OutputLayout::Heads(h) => h,
                };
                (m.rows, head, y.as_mut_slice())
            })
            .collect();
        par_row_tiles(t_rows, &mut outs, |k, r0, tokens, out| {
            let m = mats[k];
            let r1 = r0 + out.len() / tokens.len();
            match &m.data {
                DenseData::Bf16(v) => {
                    let rows: Vec<&[u16]> = (r0..r1).map(|r| row(v, r, m.cols)).collect();
                    #[cfg(target_arch = "x86_64")]
                    if let Some(xt) = lanes
                        .as_ref()
                        .and_then(|l| l.get(tokens.start / TOKEN_BLOCK))
                        && tokens.len() >= bf16_contract::LANES_MIN_TOKENS
                        && bf16_contract::lanes_chosen()
                    {
                        bf16_contract::dot_lanes(&rows, xt, tokens.len(), out);
                        return;
                    }
                    bf16_contract::dot_tiles(&rows, &inputs[k][tokens], out);
                }
                DenseData::F32(v) => {
                    let rows: Vec<&[f32]> = (r0..r1).map(|r| row(v, r, m.cols)).collect();
                    #[cfg(target_arch = "x86_64")]
                    if let Some(xt) = lanes
                        .as_ref()
                        .and_then(|l| l.get(tokens.start / TOKEN_BLOCK))
                        && tokens.len() >= crate::dot::LANES_MIN_TOKENS
                        && crate::dot::f32_lanes_chosen()
                    {
                        crate::dot::dot_f32_lanes(&rows, xt, tokens.len(), out);
                        return;
                    }
                    crate::dot::dot_f32_tiles(&rows, &inputs[k][tokens], out);
                }
                DenseData::Int8 { q, scales } => {
                    let rows: Vec<&[i8]> = (r0..r1).map(|r| row(q, r, m.cols)).collect();
                    int8_contract::dot_tiles(&rows, &scales[r0..r1], &quantised[k][tokens], out);
                }
            }
        });
    }
    ys
}

/// The inputs `x [t_rows, cols]` laid out across the vector lanes for the lane kernels, one layout per piece of
/// [`TOKEN_BLOCK`] inputs (built in parallel), where those kernels run: rows a multiple of 32 long, and a bf16 matrix
/// among `mats` with at least `bf16_contract::LANES_MIN_TOKENS` inputs and `bf16_contract::lanes_chosen`, or an f32
/// one with at least `dot::LANES_MIN_TOKENS` and `dot::f32_lanes_chosen` (one layout serves both).
#[cfg(target_arch = "x86_64")]
fn lanes_inputs(
    mats: &[&DenseMatrix],
    x: &[f32],
    t_rows: usize,
) -> Option<Vec<crate::aligned::Lines>> {
    const _: () = assert!(bf16_contract::CHUNK == crate::dot::BLOCK);
    let cols = mats.first()?.cols;
    let has = |f: fn(&DenseData) -> bool| mats.iter().any(|m| f(&m.data));
    let bf16 = t_rows >= bf16_contract::LANES_MIN_TOKENS
        && has(|d| matches!(d, DenseData::Bf16(_)))
        && bf16_contract::lanes_chosen();
    let f32 = t_rows >= crate::dot::LANES_MIN_TOKENS
        && has(|d| matches!(d, DenseData::F32(_)))
        && crate::dot::f32_lanes_chosen();
    let wanted = cols > 0 && cols.is_multiple_of(bf16_contract::CHUNK) && (bf16 || f32);
    wanted.then(|| {
        x[..t_rows * cols]
            .par_chunks(TOKEN_BLOCK * cols)
            .map(|xb| crate::bf16_lanes::token_lanes(xb, cols, xb.len() / cols))
            .collect()
    })
}

/// Elsewhere there are no lane kernels.
#[cfg(not(target_arch = "x86_64"))]
fn lanes_inputs(_: &[&DenseMatrix], _: &[f32], _: usize) -> Option<Vec<crate::aligned::Lines>> {
    None
}

/// Row `r` of a row-major matrix with `c` columns.
fn row<T>(v: &[T], r: usize, c: usize) -> &[T] {
    &v[r * c..(r + 1) * c]
}

/// Fills `out` (rows `r0 ..`) two rows at a time with `pair(r)` (rows `r`, `r + 1`), and an odd last row with
/// `one(r)`.
fn by_pairs(
    out: &mut [f32],
    r0: usize,
    pair: impl Fn(usize) -> [f32; 2],
    one: impl Fn(usize) -> f32,
) {
    let mut pairs = out.chunks_exact_mut(2);
    let mut r = r0;
    for two in &mut pairs {
        two.copy_from_slice(&pair(r));
        r += 2;
    }
    if let [last] = pairs.into_remainder() {
        *last = one(r);
    }
}

/// One input row as a matrix's kernels read it: as it is (f32 weights), permuted ([`bf16_contract`]) or quantised
/// ([`int8_contract`]).
enum Prepared {
    /// A copy on whole cache lines (the values then the zero padding): with the input at an arbitrary address, every
    /// 64-byte load of the f32 kernels straddled two lines and the multi-token tiles ran 5–20% slower on an Intel
    /// Xeon (AVX-512, 2026-12-04).
    F32(crate::aligned::Lines),
    Bf16(crate::aligned::Lines),
    Int8(QuantizedInput),
}

impl Prepared {
    /// Whether `other` was prepared for the same kind of matrix (and so from the same input, it is the same).
    fn same_kind(&self, other: &Prepared) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// Rows per task for one activation row of a dense matrix (even, so row pairs stay together): larger tasks cost
/// less scheduling per byte (int8 `[7168, 7168]` from memory: 0.63–0.81 of the memory read rate with 16-row tasks,
/// 0.85–0.89 with 64, in the same minutes). MXFP4 tasks are sized the same way, by bytes (`crate::mxfp4`).
const DENSE_ROWS_PER_TASK: usize = 64;

/// Weight rows per task of a multi-token product ([`par_row_tiles`]): a few dozen rows, so that K3's widest layers
/// still give every thread several tasks, and a multiple of every tile's rows (the bf16 lanes' six, the f32 tiles'
/// three, the int8 tiles' four), so no task ends in a narrower, slower tile (with 32, the bf16 lanes ran five tiles of
/// six rows and one of two a task).
const TILE_ROWS_PER_TASK: usize = 48;

/// The fewest weight rows [`tile_rows_per_task`] cuts a task down to (still a multiple of every tile's rows).
const MIN_TILE_ROWS_PER_TASK: usize = 12;

/// Tasks per thread below which [`tile_rows_per_task`] cuts tasks smaller.
const TASKS_PER_THREAD: usize = 8;

/// Weight rows per task for products of `rows` weight rows each over `t_rows` inputs on `threads` threads:
/// [`TILE_ROWS_PER_TASK`], halved down to [`MIN_TILE_ROWS_PER_TASK`] while the products would make fewer than
/// [`TASKS_PER_THREAD`] tasks a thread. A short product (one piece of 64 tokens) on many threads otherwise gives each
/// thread a few long tasks, and the job waits on whichever thread runs late; a smaller task reads its inputs once
/// more per row, which a long prompt's many pieces do not need.
fn tile_rows_per_task(
    rows: impl Iterator<Item = usize> + Clone,
    t_rows: usize,
    threads: usize,
) -> usize {
    let pieces = t_rows.div_ceil(TOKEN_BLOCK);
    let tasks = |step: usize| -> usize { rows.clone().map(|r| r.div_ceil(step) * pieces).sum() };
    let mut step = TILE_ROWS_PER_TASK;
    while step > MIN_TILE_ROWS_PER_TASK && tasks(step) < TASKS_PER_THREAD * threads {
        step /= 2;
    }
    step
}

/// Activation rows per piece of a multi-token product: a piece's inputs (64 × 28 KB at K3's width) stay in a core's
/// L2 while every row task of the piece reads them. A task over all of a long prompt's inputs read them from L3 or
/// memory instead, and got slower per token as prompts grew.
pub const TOKEN_BLOCK: usize = 64;

/// Fills each `(rows, head, y)` of `outs` (`y` as [`crate::by_input::Grid::head`] lays it out) in parallel over
/// tasks of [`tile_rows_per_task`] weight rows by at most [`TOKEN_BLOCK`] inputs, the tasks of every product in one
/// threaded job: `f(k, r0, tokens, out)` fills `out [rows_here, tokens.len()]` (by weight row, zeroed before) for
/// rows `r0 ..` of product `k` and the inputs `tokens`, and the task writes it into `y` ([`crate::by_input`]).
fn par_row_tiles(
    t_rows: usize,
    outs: &mut [(usize, usize, &mut [f32])],
    f: impl Fn(usize, usize, std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    let row_step = tile_rows_per_task(
        outs.iter().map(|(rows, _, _)| *rows),
        t_rows,
        rayon::current_num_threads(),
    );
    let grids = outs
        .iter_mut()
        .map(|(rows, head, y)| crate::by_input::Grid {
            y,
            rows: *rows,
            t_rows,
            row_step,
            input_step: TOKEN_BLOCK,
            head: *head,
        })
        .collect();
    crate::by_input::fill(grids, f);
}

/// Fills `y` (one output per weight row) in parallel over blocks of [`DENSE_ROWS_PER_TASK`] rows: `f(r0, out)`
/// fills the outputs of rows `r0 .. r0 + out.len()`, so a kernel can share the input's loads between neighbouring
/// rows. Fewer than four tasks' worth of rows run on the calling thread.
fn par_row_blocks(y: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let per_task = DENSE_ROWS_PER_TASK;
    if y.len() < 4 * per_task {
        f(0, y);
    } else {
        y.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(chunk, out)| f(chunk * per_task, out));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole matrix widened is every row's [`DenseMatrix::row_f32`], bit for bit, for each kind of value.
    #[test]
    fn to_f32_is_every_row_widened() {
        let (rows, cols) = (3, 5);
        let f: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.37 - 2.0).collect();
        let bits: Vec<u16> = f.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let q: Vec<i8> = (0..rows * cols)
            .map(|i| (i as i32 * 37 % 255 - 127) as i8)
            .collect();
        for data in [
            DenseData::F32(f),
            DenseData::Bf16(bits.into()),
            DenseData::Int8 {
                q: q.into(),
                scales: vec![0.5, -1.25e-3, 3.0],
            },
        ] {
            let m = DenseMatrix::new(rows, cols, data).expect("matrix");
            let by_rows: Vec<u32> = (0..rows)
                .flat_map(|r| m.row_f32(r))
                .map(f32::to_bits)
                .collect();
            let whole: Vec<u32> = m.to_f32().into_iter().map(f32::to_bits).collect();
            assert_eq!(whole, by_rows);
        }
    }

    /// Runs of bf16 rows of every length up to nine, from several first rows, give each row's own bits: the
    /// four-row calls ([`bf16_contract::rows_per_call`]), the pairs after them and a last single row.
    #[test]
    fn bf16_runs_of_rows_match_row_by_row() {
        let (rows, cols) = (23, 7168 + 7);
        let bits: Vec<u16> = (0..rows * cols)
            .map(|i: usize| {
                // Either sign, magnitudes between 2^-16 and 2^16: sums stay finite and show their order.
                let h = i.wrapping_mul(2_654_435_761);
                ((h >> 9) as u16 & 0x8000)
                    | (((0x6f + (h >> 3) % 32) as u16) << 7)
                    | ((h >> 17) as u16 & 0x7f)
            })
            .collect();
        let m = DenseMatrix::new(rows, cols, DenseData::Bf16(bits.into())).expect("matrix");
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for r0 in [0, 1, 3, 6] {
            for len in 1..=9 {
                let mut out = vec![f32::NAN; len];
                m.dot_rows(r0, &x, &mut out);
                for (i, y) in out.iter().enumerate() {
                    assert!(y.is_finite(), "rows {r0}+{i} of {len}: {y}");
                    assert_eq!(
                        y.to_bits(),
                        m.dot_row(r0 + i, &x).to_bits(),
                        "rows {r0}+{i} of {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn short_products_on_many_threads_get_smaller_tasks() {
        // K3's [3072, 7168] over one 64-token piece: 64 tasks of 48 rows on 2 threads, 128 of 24 on 16, 256 of
        // 12 on 32; never below 12 rows.
        assert_eq!(tile_rows_per_task([3072].into_iter(), 64, 2), 48);
        assert_eq!(tile_rows_per_task([3072].into_iter(), 64, 16), 24);
        assert_eq!(tile_rows_per_task([3072].into_iter(), 64, 32), 12);
        assert_eq!(tile_rows_per_task([3072].into_iter(), 64, 1024), 12);
        // Eight pieces of a 512-token prompt give 16 threads enough tasks of 48 rows.
        assert_eq!(tile_rows_per_task([3072].into_iter(), 512, 16), 48);
        // The products of one job count together.
        assert_eq!(tile_rows_per_task([1536, 1536].into_iter(), 64, 16), 24);
        assert_eq!(tile_rows_per_task([96].into_iter(), 1, 1), 12);
        // Every step the halving can reach is a whole number of every tile's rows (6, 4 and 3).
        let mut step = TILE_ROWS_PER_TASK;
        while step >= MIN_TILE_ROWS_PER_TASK {
            assert_eq!(step % 12, 0, "{step} rows a task");
            step /= 2;
        }
    }
}
