//! Dense weights resident on the GPU and their GEMM (`kernels/dense.cu`), plus the slot on [`DenseMatrix`] that
//! holds a matrix's device copy. Row-wise int8 weights stay int8 there and multiply by the int8 contract
//! ([`crate::int8_contract`]: inputs quantised to int16 on the device, exact integer sums, scales in f64), so their
//! products are the CPU's bits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PushKernelArg};

use super::{Gpu, driver_err};
use crate::dense::{DenseData, DenseMatrix};
use crate::error::{QuantError, Result};

/// Warps per block and rows per warp of `dense_gemm_*` (must match `kernels/dense.cu`).
const DENSE_WARPS: usize = 8;
const DENSE_RPW: usize = 4;
/// Threads per block of `dense_gemm_*`.
pub(crate) const BLOCK_THREADS: usize = DENSE_WARPS * 32;
/// The column splits the kernel takes (divisors of its warps).
pub const SPLITS: [usize; 4] = [1, 2, 4, 8];
/// Fewest 16-byte words of a row per column part (two of a warp's steps).
const MIN_PART_WORDS: usize = 128;
/// Waves of blocks below which a launch splits its columns. Measured on an H200 (`deltafin-cudabench dense-bw
/// --splits 1,2,4,8`, 2026-12-04): a lone `[12288, 7168]` product (1.45 waves) went from 0.74 to 0.83 of the copy
/// rate split in two at one token and from 0.56 to 0.69 at three; four of them in one launch (5.8 waves) lost with
/// any split; `[7168, 12288]` (0.85 waves) ran 2-3% slower split at one token and 16% faster split in four at three.
const SPLIT_WAVES: usize = 2;

/// The column split of a launch of `blocks` blocks (unsplit) over rows of `words` 16-byte words for `tokens` input
/// rows, on a device that holds `slots` blocks at once: the fewest parts that make `SPLIT_WAVES` waves, as long
/// as each part keeps `MIN_PART_WORDS`; none for one token when every block runs at once anyway.
pub fn launch_split(blocks: usize, words: usize, tokens: usize, slots: usize) -> usize {
    if tokens <= 1 && blocks <= slots {
        return 1;
    }
    let mut split = 1;
    for s in SPLITS {
        if s > 1 && words / s < MIN_PART_WORDS {
            break;
        }
        split = s;
        if blocks * s >= SPLIT_WAVES * slots {
            break;
        }
    }
    split
}

/// Blocks of a `[rows, ·]` product split `split` ways.
fn blocks_for(rows: usize, split: usize) -> usize {
    rows.div_ceil(DENSE_WARPS * DENSE_RPW / split)
}

/// The most matrices [`DeviceMatrix::gemm_many_device`] puts in one launch (`DENSE_MAX_JOBS` in the kernel).
pub const MAX_JOBS: usize = 8;

/// The jobs of `dense_gemm_multi_*`, passed by value: the layout of `DenseJobs` in `kernels/dense.cu` (device
/// addresses of the weights and outputs, rows, first block of each job and the count).
#[repr(C)]
#[derive(Clone, Copy)]
struct DenseJobs {
    w: [u64; MAX_JOBS],
    y: [u64; MAX_JOBS],
    /// int8 only: the device addresses of the rows' scales.
    s: [u64; MAX_JOBS],
    rows: [i32; MAX_JOBS],
    split: [i32; MAX_JOBS],
    first: [i32; MAX_JOBS + 1],
    n: i32,
}

// SAFETY: plain old data with the C layout of the kernel's parameter struct.
unsafe impl cudarc::driver::DeviceRepr for DenseJobs {}

/// The bytes of `v` as they lie in memory (little-endian on every target this crate builds for with CUDA).
fn le_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type (f32, u16) with no padding; the byte view covers exactly the slice's
    // memory and lives as long as the borrow of `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// How a device matrix stores its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    F32,
    Bf16,
    /// Row-wise int8 values, with the rows' scales in [`DeviceMatrix::scales`].
    Int8,
}

impl Kind {
    /// Values per 16-byte word.
    fn lanes(self) -> usize {
        match self {
            Kind::F32 => 4,
            Kind::Bf16 => 8,
            Kind::Int8 => 16,
        }
    }
}

/// A dense `[rows, cols]` weight copied to the GPU once (f32, bf16 or row-wise int8; an int8 matrix whose rows are
/// not whole 16-byte words goes up dequantised to f32).
pub struct DeviceMatrix {
    gpu: Arc<Gpu>,
    buf: CudaSlice<u8>,
    /// The rows' scales of an int8 matrix (f32 values), uploaded as the values are.
    scales: Option<CudaSlice<u8>>,
    /// The end of the scales' upload, when it ran on the weights' upload stream.
    scales_ready: Option<CudaEvent>,
    /// The end of the upload, when it ran on the weights' upload stream (products wait for it).
    ready: Option<CudaEvent>,
    rows: usize,
    cols: usize,
    kind: Kind,
    /// A column split fixed for every launch ([`Self::set_split`]); otherwise each launch picks its own
    /// ([`launch_split`]).
    split: Option<usize>,
    /// Set once the upload behind `ready` is known to be done, so later products skip the wait (each wait is a
    /// driver call on the path from a layer's input to its first kernel).
    uploaded: AtomicBool,
}

impl std::fmt::Debug for DeviceMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceMatrix({}x{}, {:?})",
            self.rows, self.cols, self.kind
        )
    }
}

impl DeviceMatrix {
    /// Uploads `m`, or returns `None` when its shape does not suit the kernel (columns must allow 16-byte loads:
    /// a multiple of 4 for f32, of 8 for bf16); such matrices stay on the CPU.
    pub fn upload(gpu: &Arc<Gpu>, m: &DenseMatrix) -> Result<Option<Self>> {
        let kind = match m.data() {
            DenseData::Bf16(_) => Kind::Bf16,
            DenseData::Int8 { .. } if m.cols().is_multiple_of(Kind::Int8.lanes()) => Kind::Int8,
            DenseData::F32(_) | DenseData::Int8 { .. } => Kind::F32,
        };
        if m.rows() == 0 || m.cols() == 0 || !m.cols().is_multiple_of(kind.lanes()) {
            return Ok(None);
        }
        // Values go up from where they lie (the device is little-endian, like every host this builds for), but
        // int8 rows that are not whole 16-byte words, which are dequantised to f32 first.
        let (mut scales, mut scales_ready) = (None, None);
        let (buf, ready) = match (m.data(), kind) {
            (DenseData::F32(v), _) => gpu.upload_large(le_bytes(v))?,
            (DenseData::Bf16(v), _) => gpu.upload_large(le_bytes(v))?,
            (DenseData::Int8 { q, scales: s }, Kind::Int8) => {
                // Through the upload path too: a copy on the compute stream would wait for its queued kernels.
                let (b, ev) = gpu.upload_large(le_bytes(s))?;
                (scales, scales_ready) = (Some(b), ev);
                gpu.upload_large(le_bytes(q))?
            }
            (DenseData::Int8 { .. }, _) => {
                let vals = m.to_f32();
                gpu.upload_large(le_bytes(&vals))?
            }
        };
        Ok(Some(Self {
            gpu: gpu.clone(),
            buf,
            scales,
            scales_ready,
            ready,
            rows: m.rows(),
            cols: m.cols(),
            kind,
            split: None,
            uploaded: AtomicBool::new(false),
        }))
    }

    /// The values as uploaded, for a kernel that lays them out anew on the weights' upload stream (after the
    /// upload, in stream order; the buffer is freed on that stream too): the buffer and whether it holds bf16 bits
    /// (else f32). `None` for int8 values, and when the upload ran on the compute stream (no pinned staging
    /// memory), where a kernel on the weights' stream would not be ordered after it.
    pub fn float_values(&self) -> Option<(&CudaSlice<u8>, bool)> {
        let bf16 = match self.kind {
            Kind::Bf16 => true,
            Kind::F32 => false,
            Kind::Int8 => return None,
        };
        self.ready.as_ref().map(|_| (&self.buf, bf16))
    }

    /// 16-byte words of a row.
    fn words(&self) -> usize {
        self.cols / self.kind.lanes()
    }

    /// The column split a launch of this matrix alone uses for `tokens` input rows.
    pub fn split(&self, tokens: usize) -> usize {
        self.split.unwrap_or_else(|| {
            launch_split(
                blocks_for(self.rows, 1),
                self.words(),
                tokens,
                self.gpu.dense_slots(),
            )
        })
    }

    /// Fixes the column split of every launch (one of [`SPLITS`]; benchmarks and tests compare them), or with
    /// `None` leaves it to each launch again. The sums change with it.
    pub fn set_split(&mut self, split: Option<usize>) -> Result<()> {
        if let Some(s) = split.filter(|s| !SPLITS.contains(s)) {
            return Err(QuantError::BadInput {
                expected: 1,
                actual: s,
            });
        }
        self.split = split;
        Ok(())
    }

    /// The device address of the values and whether they are bf16 bits (else f32; either way whole 16-byte words a
    /// row), for a kernel that reads a small matrix itself; the compute stream first waits for the upload if it
    /// may still be running. An int8 matrix is an error (such kernels read floats: upload its values as f32).
    pub fn values_for_kernel(&self) -> Result<(u64, bool)> {
        if self.kind == Kind::Int8 {
            return Err(QuantError::Cuda(format!(
                "a {}x{} int8 matrix cannot be read as floats by a kernel",
                self.rows, self.cols
            )));
        }
        let stream = self.gpu.stream();
        self.wait_uploaded(stream)?;
        Ok((
            super::device_address(stream, &self.buf),
            self.kind == Kind::Bf16,
        ))
    }

    /// Makes `stream` wait for the matrix's upload while it may still be running.
    fn wait_uploaded(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        if self.uploaded.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut done = true;
        for ev in [&self.ready, &self.scales_ready].into_iter().flatten() {
            if !ev.is_complete() {
                done = false;
                stream
                    .wait(ev)
                    .map_err(|e| driver_err("waiting for a weight upload", e))?;
            }
        }
        if done {
            self.uploaded.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// The device holding the matrix.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Rows (outputs).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes on the device.
    pub fn nbytes(&self) -> usize {
        self.buf.len() + self.scales.as_ref().map_or(0, |s| s.len())
    }

    /// Whether the values are row-wise int8 (products by the int8 contract).
    pub fn is_int8(&self) -> bool {
        self.kind == Kind::Int8
    }

    /// The rows' scales of an int8 matrix (f32 values).
    fn scales(&self) -> Result<&CudaSlice<u8>> {
        self.scales
            .as_ref()
            .ok_or_else(|| QuantError::Cuda("an int8 device matrix without its scales".to_string()))
    }

    /// `y = x · wᵀ` on device buffers: `x [t_rows, cols]` → `y [t_rows, rows]` (queued on the compute stream).
    pub fn gemm_device(
        &self,
        x: &CudaSlice<f32>,
        t_rows: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if x.len() < t_rows * self.cols || y.len() < t_rows * self.rows {
            return Err(QuantError::BadInput {
                expected: t_rows * self.cols,
                actual: x.len(),
            });
        }
        let name = match self.kind {
            Kind::F32 => "dense_gemm_f32",
            Kind::Bf16 => "dense_gemm_bf16",
            Kind::Int8 => "dense_gemm_int8",
        };
        let gpu = &self.gpu;
        let f = gpu.function(name)?;
        self.wait_uploaded(gpu.stream())?;
        // An int8 matrix reads the input quantised on the device first (`Int8Inputs`).
        let mut inputs = (self.kind == Kind::Int8).then(|| gpu.int8_inputs());
        let quantised = match inputs.as_mut() {
            Some(i) => Some((i.quantise(gpu, x, t_rows, self.cols)?, self.scales()?)),
            None => None,
        };
        let split = self.split(t_rows);
        let (rows, cols, t, split_i) = (
            self.rows as i32,
            self.cols as i32,
            t_rows as i32,
            split as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(self.rows, split) as u32, 1, 1),
            block_dim: (BLOCK_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&self.buf);
        match &quantised {
            Some(((xq, xs), scales)) => b.arg(*scales).arg(&**xq).arg(&**xs),
            None => b.arg(x),
        };
        b.arg(y).arg(&rows).arg(&cols).arg(&t).arg(&split_i);
        // SAFETY: the kernel reads rows*cols weights of the matrix's kind from `buf` (its exact size; int8: with
        // `rows` scales), t_rows*cols floats of x (int8: as many int16 values and t_rows scales, which `quantise`
        // just sized and queued) and writes t_rows*rows floats of y; both lengths were checked above.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(name, e))?;
        Ok(())
    }

    /// `ys[j] = x · msⱼᵀ` for several matrices reading the same device rows `x [t_rows, cols]`, queued as one
    /// launch when they share a device, kind and width (at most [`MAX_JOBS`]), else one launch each. The column
    /// split of a matrix without a fixed one is the launch's ([`launch_split`] of all its blocks); with the same
    /// split, the bits are those of [`Self::gemm_device`].
    pub fn gemm_many_device(
        ms: &[&DeviceMatrix],
        x: &CudaSlice<f32>,
        t_rows: usize,
        ys: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        if ms.len() != ys.len() {
            return Err(QuantError::BadInput {
                expected: ms.len(),
                actual: ys.len(),
            });
        }
        let Some(first) = ms.first() else {
            return Ok(());
        };
        let one_launch = ms.len() > 1
            && ms.len() <= MAX_JOBS
            && ms.iter().all(|m| {
                Arc::ptr_eq(&m.gpu, &first.gpu) && m.kind == first.kind && m.cols == first.cols
            });
        if !one_launch {
            for (m, y) in ms.iter().zip(ys.iter_mut()) {
                m.gemm_device(x, t_rows, y)?;
            }
            return Ok(());
        }
        let cols = first.cols;
        if x.len() < t_rows * cols {
            return Err(QuantError::BadInput {
                expected: t_rows * cols,
                actual: x.len(),
            });
        }
        let gpu = &first.gpu;
        let stream = gpu.stream();
        let mut jobs = DenseJobs {
            w: [0; MAX_JOBS],
            y: [0; MAX_JOBS],
            s: [0; MAX_JOBS],
            rows: [0; MAX_JOBS],
            split: [1; MAX_JOBS],
            first: [0; MAX_JOBS + 1],
            n: ms.len() as i32,
        };
        // Matrices without a fixed split take the launch's.
        let unsplit: usize = ms.iter().map(|m| blocks_for(m.rows, 1)).sum();
        let split = launch_split(unsplit, first.words(), t_rows, gpu.dense_slots());
        let mut blocks = 0usize;
        for (j, (m, y)) in ms.iter().zip(ys.iter()).enumerate() {
            if y.len() < t_rows * m.rows {
                return Err(QuantError::BadInput {
                    expected: t_rows * m.rows,
                    actual: y.len(),
                });
            }
            m.wait_uploaded(stream)?;
            let s = m.split.unwrap_or(split);
            jobs.w[j] = super::device_address(stream, &m.buf);
            jobs.y[j] = super::device_address(stream, &**y);
            if m.kind == Kind::Int8 {
                jobs.s[j] = super::device_address(stream, m.scales()?);
            }
            jobs.rows[j] = m.rows as i32;
            jobs.split[j] = s as i32;
            jobs.first[j] = blocks as i32;
            blocks += blocks_for(m.rows, s);
        }
        jobs.first[ms.len()] = blocks as i32;
        let name = match first.kind {
            Kind::F32 => "dense_gemm_multi_f32",
            Kind::Bf16 => "dense_gemm_multi_bf16",
            Kind::Int8 => "dense_gemm_multi_int8",
        };
        let f = gpu.function(name)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols_i, t) = (cols as i32, t_rows as i32);
        // int8 matrices read the input quantised once for all of them.
        let mut inputs = (first.kind == Kind::Int8).then(|| gpu.int8_inputs());
        let quantised = match inputs.as_mut() {
            Some(i) => Some(i.quantise(gpu, x, t_rows, cols)?),
            None => None,
        };
        let mut b = stream.launch_builder(f);
        b.arg(&jobs);
        match &quantised {
            Some((xq, xs)) => b.arg(&**xq).arg(&**xs),
            None => b.arg(x),
        };
        b.arg(&cols_i).arg(&t);
        // SAFETY: every job's matrix is `rows * cols` values of the shared kind at `w` (int8: with `rows` scales at
        // `s`), and its `y` holds at least t_rows * rows floats (checked above); x holds t_rows * cols floats (int8:
        // its quantised copy, t_rows * cols int16 and t_rows scales); job j owns the blocks first[j] ..
        // first[j + 1], each covering DENSE_WARPS * DENSE_RPW / split[j] of its rows as in the one-matrix kernel.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(name, e))?;
        Ok(())
    }

    /// `y = x · wᵀ` for host rows `x [t_rows, cols]`, giving `[t_rows, rows]`. The device buffers are the
    /// device's reused pair (`HostGemmBuffers`); the call returns once `y` is on the host.
    pub fn gemm(&self, x: &[f32], t_rows: usize) -> Result<Vec<f32>> {
        if x.len() != t_rows * self.cols {
            return Err(QuantError::BadInput {
                expected: t_rows * self.cols,
                actual: x.len(),
            });
        }
        if t_rows == 0 {
            return Ok(Vec::new());
        }
        let n_out = t_rows * self.rows;
        let gpu = &self.gpu;
        let mut bufs = gpu.host_gemm.lock().unwrap_or_else(|e| e.into_inner());
        let HostGemmBuffers { x: xs, y: ys } = &mut *bufs;
        let mut rows = gpu.row_copies();
        let xd = super::sized(gpu, xs, x.len())?;
        rows.upload(x, xd)?;
        let yd = super::sized(gpu, ys, n_out)?;
        self.gemm_device(xd, t_rows, yd)?;
        let r = rows.download(&yd.slice(0..n_out))?;
        rows.synchronize()?;
        Ok(rows.downloaded(r)?.to_vec())
    }
}

/// The device buffers of [`DeviceMatrix::gemm`] (input rows, output rows), grown to the largest product so far.
#[derive(Default)]
pub(crate) struct HostGemmBuffers {
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
}

/// The device buffers an int8 product's input goes into ([`Int8Inputs::quantise`]), grown to the largest so far and
/// reused (products queue on one stream, so the next product's quantisation runs after the last one's kernel).
#[derive(Default)]
pub(crate) struct Int8Inputs {
    q: Option<CudaSlice<i16>>,
    scales: Option<CudaSlice<f32>>,
}

impl Int8Inputs {
    /// Queues the int8 contract's quantisation of `x [t_rows, cols]` (`dense_quantise_i16`) on the compute stream
    /// and returns its buffers: the int16 values `[t_rows, cols]` and each row's scale.
    fn quantise(
        &mut self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        t_rows: usize,
        cols: usize,
    ) -> Result<(&mut CudaSlice<i16>, &mut CudaSlice<f32>)> {
        if x.len() < t_rows * cols {
            return Err(QuantError::BadInput {
                expected: t_rows * cols,
                actual: x.len(),
            });
        }
        let name = "dense_quantise_i16";
        let f = gpu.function(name)?;
        let q = super::sized(gpu, &mut self.q, t_rows * cols)?;
        let scales = super::sized(gpu, &mut self.scales, t_rows)?;
        if t_rows == 0 {
            // Nothing to quantise (a launch of no blocks is an error).
            return Ok((q, scales));
        }
        let cfg = LaunchConfig {
            grid_dim: (t_rows as u32, 1, 1),
            block_dim: (QUANTISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let cols_i = cols as i32;
        let mut b = gpu.stream().launch_builder(f);
        b.arg(x).arg(&mut *q).arg(&mut *scales).arg(&cols_i);
        // SAFETY: the kernel reads t_rows * cols floats of x (checked above) and writes as many int16 values into q
        // and t_rows floats into scales (both sized above); one block per row.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(name, e))?;
        Ok((q, scales))
    }
}

impl Gpu {
    /// The reused buffers of int8 products' quantised inputs, held while a product queues (a panic elsewhere left
    /// them valid: whatever was queued last is overwritten by the next quantisation).
    fn int8_inputs(&self) -> std::sync::MutexGuard<'_, Int8Inputs> {
        self.int8_inputs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Threads of a `dense_quantise_i16` block (one block a row).
const QUANTISE_THREADS: u32 = 256;

/// The optional device copy attached to a [`DenseMatrix`]. Clones share the device memory; equality ignores it.
#[derive(Clone, Default)]
pub struct CudaTwin(OnceLock<Arc<DeviceMatrix>>);

impl CudaTwin {
    /// The device copy, if one was attached.
    pub fn get(&self) -> Option<&Arc<DeviceMatrix>> {
        self.0.get()
    }

    /// Attaches `m` (the first attachment wins).
    pub fn set(&self, m: Arc<DeviceMatrix>) {
        let _ = self.0.set(m);
    }
}

impl std::fmt::Debug for CudaTwin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.get() {
            Some(m) => write!(f, "{m:?}"),
            None => write!(f, "host only"),
        }
    }
}

impl PartialEq for CudaTwin {
    fn eq(&self, _other: &Self) -> bool {
        // Where a copy of the values lives does not change the matrix.
        true
    }
}

impl DenseMatrix {
    /// Uploads this matrix to `gpu` so that later products can run there; `false` when its shape keeps it on the
    /// CPU.
    pub fn attach_cuda(&self, gpu: &Arc<Gpu>) -> Result<bool> {
        if self.cuda().is_some() {
            return Ok(true);
        }
        match DeviceMatrix::upload(gpu, self)? {
            Some(m) => {
                self.cuda_twin().set(Arc::new(m));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The device copy, when one is attached.
    pub fn cuda(&self) -> Option<&Arc<DeviceMatrix>> {
        self.cuda_twin().get()
    }

    /// Frees the host values of a matrix whose device copy is attached (`false`, and nothing freed, when none is):
    /// its products then run only on the GPU. Host products (`gemm`, `gemm_many`) fail with
    /// [`QuantError::HostReleased`]; row reads (`row_f32`, `dot_rows`) must not be used on it: the model keeps
    /// the host values of the matrices it reads by rows.
    pub fn release_host(&mut self) -> bool {
        if self.cuda().is_none() {
            return false;
        }
        self.release_values();
        true
    }
}
