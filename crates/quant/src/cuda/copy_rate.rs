//! The device's bounds, measured: event-timed launches, the rate of a device-to-device copy, the host-to-device
//! link's rate from pinned memory, and the tensor cores' `mma.sync` rate.
//!
//! Benchmarks hold kernels against [`copy_rate`] and uploads against [`pinned_upload_rate`] measured in the same
//! process (HBM's rate moves with clocks and temperature, the link's with the host's load, so a datasheet figure or
//! another run's number is not the bound of this one).

use std::time::Instant;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{Gpu, StreamTimer, driver_err};
use crate::error::{QuantError, Result};

/// The warm-up before timed launches: long enough (~0.3 s of work) for the SM clock to leave its idle level.
const WARM_UP_S: f64 = 0.3;

/// Times `f` (which queues its work on the compute stream) `reps` times between device events after a warm-up;
/// the median in milliseconds. `reps` of 0 counts as 1.
pub fn median_event_ms<E: From<QuantError>>(
    gpu: &Gpu,
    reps: usize,
    mut f: impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<f64, E> {
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < WARM_UP_S {
        f()?;
        gpu.synchronize()?;
    }
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        times.push(event_ms(gpu, gpu.stream(), &mut f)?);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The device time of the work `f` queues on `stream`, in milliseconds, between two events.
fn event_ms<E: From<QuantError>>(
    gpu: &Gpu,
    stream: &CudaStream,
    f: &mut impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<f64, E> {
    let timer = StreamTimer::new(gpu)?;
    timer.start_on(stream)?;
    f()?;
    timer.stop_on(stream)?;
    Ok(timer.elapsed()?.as_secs_f64() * 1e3)
}

/// A device-to-device copy of one buffer, timed two ways (medians of event-timed copies).
#[derive(Clone, Copy, Debug)]
pub struct CopyTimes {
    /// Bytes copied.
    pub bytes: usize,
    /// Through the `copy16` kernel (16-byte words, every multiprocessor), µs.
    pub kernel_us: f64,
    /// Through `cuMemcpyDtoD`, µs.
    pub memcpy_us: f64,
}

impl CopyTimes {
    /// The memory rate of the faster copy, reads and writes counted (bytes per second): the bound a kernel that
    /// streams its weights once is held against.
    pub fn rate(&self) -> f64 {
        2.0 * self.bytes as f64 / (self.kernel_us.min(self.memcpy_us) * 1e-6)
    }
}

/// Copies `bytes` (rounded down to 16) from one device buffer to another, `reps` times each way.
pub fn copy_times(gpu: &Gpu, bytes: usize, reps: usize) -> Result<CopyTimes> {
    let n16 = bytes / 16;
    if n16 == 0 {
        return Err(QuantError::Cuda(
            "a copy-rate probe needs 16 bytes or more".to_string(),
        ));
    }
    let src = gpu.upload(&vec![0x5au8; n16 * 16])?;
    let mut dst = gpu.zeros::<u8>(n16 * 16)?;
    let copy = gpu.function("copy16")?;
    let n = n16 as u64;
    let kernel_ms = median_event_ms(gpu, reps, || {
        // Sixteen 256-thread blocks a multiprocessor of the largest parts: the copy loops over the rest.
        let cfg = LaunchConfig {
            grid_dim: (132 * 16, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(copy);
        b.arg(&src).arg(&mut dst).arg(&n);
        // SAFETY: both buffers hold n16 16-byte words, and copy16 touches no more.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err("copy16 launch", e))?;
        Ok::<(), QuantError>(())
    })?;
    let memcpy_ms = median_event_ms(gpu, reps, || {
        gpu.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| driver_err("device-to-device copy", e))
    })?;
    Ok(CopyTimes {
        bytes: n16 * 16,
        kernel_us: kernel_ms * 1e3,
        memcpy_us: memcpy_ms * 1e3,
    })
}

/// The device's memory rate (reads and writes, bytes per second) of a `bytes` copy on the shared device: see
/// [`CopyTimes::rate`].
pub fn copy_rate(bytes: usize, reps: usize) -> Result<f64> {
    let gpu = Gpu::shared()?;
    gpu.bind()?;
    Ok(copy_times(&gpu, bytes, reps)?.rate())
}

/// The host-to-device link's rate (bytes per second) for copies of `bytes` from one pinned host buffer on the upload
/// stream: the median of `reps` event-timed copies after one untimed copy. The bound uploads are held against.
pub fn pinned_upload_rate(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
    if bytes == 0 {
        return Err(QuantError::Cuda(
            "an upload-rate probe needs at least one byte".to_string(),
        ));
    }
    gpu.bind()?;
    let stream = gpu.copy_stream();
    // SAFETY: every byte is written just below, before any copy reads it.
    let mut host = unsafe { gpu.context().alloc_pinned::<u8>(bytes) }
        .map_err(|e| driver_err("pinned host memory", e))?;
    host.as_mut_slice()
        .map_err(|e| driver_err("pinned host memory", e))?
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i.wrapping_mul(31) >> 3) as u8);
    // SAFETY: written by the copies below before anything reads it (nothing does).
    let mut dev =
        unsafe { stream.alloc::<u8>(bytes) }.map_err(|e| driver_err("device allocation", e))?;
    let mut times = Vec::with_capacity(reps.max(1));
    for i in 0..=reps.max(1) {
        let ms = event_ms(gpu, stream, &mut || {
            stream
                .memcpy_htod(&host, &mut dev)
                .map_err(|e| driver_err("pinned upload", e))
        })?;
        if i > 0 {
            times.push(ms);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(bytes as f64 / (times[times.len() / 2] * 1e-3))
}

/// [`pinned_upload_rate`] on the shared device.
pub fn upload_rate(bytes: usize, reps: usize) -> Result<f64> {
    pinned_upload_rate(&*Gpu::shared()?, bytes, reps)
}

/// Blocks of the [`mma_sync_rate`] probe: enough to fill every multiprocessor of the largest parts several times.
const MMA_PEAK_BLOCKS: u32 = 132 * 8;
/// Threads a block of the probe.
const MMA_PEAK_THREADS: u32 = 256;
/// Rounds of eight mmas a warp runs in one probe launch (about a millisecond on an H200).
const MMA_PEAK_ROUNDS: i32 = 2048;

/// The tensor cores' rate for `mma.sync.m16n8k16` with fp16 inputs and f32 accumulators (FLOP per second, a
/// multiply-add counting two), every multiprocessor busy and no memory traffic: the median of `reps` event-timed
/// launches of the `mma_peak` kernel. The ceiling the mma.sync MoE kernels are held against.
pub fn mma_sync_rate(gpu: &Gpu, reps: usize) -> Result<f64> {
    gpu.bind()?;
    let f = gpu.function("mma_peak")?;
    let warps = (MMA_PEAK_BLOCKS * MMA_PEAK_THREADS / 32) as usize;
    let mut out = gpu.zeros::<f32>(warps)?;
    let rounds = MMA_PEAK_ROUNDS;
    let ms = median_event_ms(gpu, reps, || {
        let cfg = LaunchConfig {
            grid_dim: (MMA_PEAK_BLOCKS, 1, 1),
            block_dim: (MMA_PEAK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&mut out).arg(&rounds);
        // SAFETY: `out` holds one float per warp of the grid, the only memory the kernel touches.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err("mma_peak launch", e))?;
        Ok::<(), QuantError>(())
    })?;
    let sums = gpu.download(&out)?;
    if sums.iter().any(|v| !v.is_finite() || *v == 0.0) {
        return Err(QuantError::Cuda(
            "the mma_peak probe wrote a zero or non-finite sum".to_string(),
        ));
    }
    // Per mma: 16 x 8 x 16 multiply-adds.
    let flop = warps as f64 * rounds as f64 * 8.0 * (2 * 16 * 8 * 16) as f64;
    Ok(flop / (ms * 1e-3))
}
