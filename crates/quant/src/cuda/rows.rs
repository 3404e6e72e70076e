//! A layer's activation rows to and from the device through reused pinned buffers.
//!
//! A layer on the GPU sends its input rows up and its output rows down (tens of KB a token). From pageable memory
//! such a copy cost 16–40 µs on the H200, each waited for by the stream, where a pinned one is a few. The buffers
//! belong to the device and are taken through [`Gpu::row_copies`], which holds them until the guard drops; uploads and
//! downloads are queued on the compute stream at rising offsets, so nothing in flight is overwritten, and a
//! download's values are read only after [`RowCopies::synchronize`]. On a device with unified addressing a small kernel
//! on the compute stream (`copy_f32`) moves the rows, reading and writing the pinned buffers through the host's
//! pointers: a copy engine's copy of a 28 KB row took 9–19 µs between its neighbours' kernels, the kernel a few. Where
//! pinned memory cannot be had, plain vectors serve (the driver then stages the copies itself).

use std::ops::Range;
use std::sync::MutexGuard;

use cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::{Gpu, driver_err};
use crate::error::{QuantError, Result};

/// Floats a buffer holds at least once allocated (the rows of a few hundred tokens at K3's width).
const MIN_CAPACITY: usize = 1 << 16;
/// Threads a block of `copy_f32`, one float each (a row of K3's width: 28 blocks).
const COPY_THREADS: usize = 256;
/// Blocks of `copy_f32` at most (longer copies loop).
const COPY_MAX_BLOCKS: usize = 1024;

/// Host memory for row copies: pinned when the driver gives it.
enum HostBuf {
    Pinned(PinnedHostSlice<f32>),
    Plain(Vec<f32>),
}

impl HostBuf {
    /// A buffer of `len` floats (page-locked, cached: the host reads downloads from it).
    fn new(gpu: &Gpu, len: usize) -> Self {
        // SAFETY: every range of the buffer is written (by the host or by a copy) before it is read.
        match unsafe { gpu.ctx.alloc_pinned_with_flags::<f32>(len, 0) } {
            Ok(p) => Self::Pinned(p),
            Err(e) => {
                tracing::warn!(
                    "no pinned memory for row copies ({e}); they go from pageable memory"
                );
                Self::Plain(vec![0.0; len])
            }
        }
    }

    /// The buffer's address for the device's kernels, where they may use it: pinned memory on a device with unified
    /// addressing.
    fn device_address(&self, gpu: &Gpu) -> Option<u64> {
        match self {
            Self::Pinned(p) if gpu.unified => p.as_slice().ok().map(|s| s.as_ptr() as u64),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Pinned(p) => p.len(),
            Self::Plain(v) => v.len(),
        }
    }

    fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        match self {
            Self::Pinned(p) => p
                .as_mut_slice()
                .map_err(|e| driver_err("row staging buffer", e)),
            Self::Plain(v) => Ok(v),
        }
    }

    fn as_slice(&self) -> Result<&[f32]> {
        match self {
            Self::Pinned(p) => p
                .as_slice()
                .map_err(|e| driver_err("row staging buffer", e)),
            Self::Plain(v) => Ok(v),
        }
    }
}

/// The device's row buffers (allocated on first use, grown when a call needs more).
#[derive(Default)]
pub(crate) struct RowStaging {
    up: Option<HostBuf>,
    down: Option<HostBuf>,
}

/// A row copied into the up buffer by [`RowCopies::stage`], not yet sent. Staged rows keep their place for the
/// guard's life (offsets only rise).
#[derive(Debug)]
#[must_use = "a staged row is sent with RowCopies::send"]
pub struct Staged(Range<usize>);

/// The device's row buffers, held until dropped. Uploads and downloads go at rising offsets for the guard's life,
/// so a queued copy never shares memory with a later one and every download stays readable.
pub struct RowCopies<'a> {
    gpu: &'a Gpu,
    bufs: MutexGuard<'a, RowStaging>,
    up_used: usize,
    down_used: usize,
    /// Copies queued since the stream was last waited for.
    pending: bool,
}

impl Gpu {
    /// The device's row buffers (waits for another caller holding them).
    pub fn row_copies(&self) -> RowCopies<'_> {
        RowCopies {
            gpu: self,
            bufs: self.rows.lock().unwrap_or_else(|e| e.into_inner()),
            up_used: 0,
            down_used: 0,
            pending: false,
        }
    }
}

impl RowCopies<'_> {
    /// Makes the up (or down) buffer hold at least `need` floats. A replaced buffer's used values move to the new
    /// one after the queued copies are waited for (one in flight may still use the old buffer).
    fn room(&mut self, up: bool, need: usize) -> Result<()> {
        let gpu = self.gpu;
        let used = if up { self.up_used } else { self.down_used };
        let cur = if up { &self.bufs.up } else { &self.bufs.down };
        if cur.as_ref().is_some_and(|b| b.len() >= need) {
            return Ok(());
        }
        if self.pending {
            self.wait()?;
        }
        let slot = if up {
            &mut self.bufs.up
        } else {
            &mut self.bufs.down
        };
        let cap = need
            .max(MIN_CAPACITY)
            .max(2 * slot.as_ref().map_or(0, HostBuf::len));
        let mut fresh = HostBuf::new(gpu, cap);
        if let Some(old) = slot.as_ref() {
            fresh.as_mut_slice()?[..used].copy_from_slice(&old.as_slice()?[..used]);
        }
        *slot = Some(fresh);
        Ok(())
    }

    fn wait(&mut self) -> Result<()> {
        self.gpu.synchronize()?;
        self.pending = false;
        Ok(())
    }

    /// Queues the copy of `src` into the start of `dst` on the compute stream (`src` may be reused at once).
    pub fn upload(&mut self, src: &[f32], dst: &mut CudaSlice<f32>) -> Result<()> {
        let staged = self.stage(src)?;
        self.send(staged, dst)
    }

    /// Copies `src` into the pinned buffer (host work only); [`Self::send`] queues its copy to the device. Apart so
    /// that a caller timing the device can stage its row before the device's time starts.
    pub fn stage(&mut self, src: &[f32]) -> Result<Staged> {
        let at = self.up_used;
        self.room(true, at + src.len())?;
        let Some(buf) = self.bufs.up.as_mut() else {
            return Err(QuantError::Cuda("row staging buffer missing".to_string()));
        };
        buf.as_mut_slice()?[at..at + src.len()].copy_from_slice(src);
        self.up_used = at + src.len();
        Ok(Staged(at..at + src.len()))
    }

    /// Queues the copy of a row staged by [`Self::stage`] into the start of `dst` on the compute stream.
    pub fn send(&mut self, staged: Staged, dst: &mut CudaSlice<f32>) -> Result<()> {
        let Staged(r) = staged;
        if dst.len() < r.len() {
            return Err(QuantError::BadInput {
                expected: r.len(),
                actual: dst.len(),
            });
        }
        if r.is_empty() {
            return Ok(());
        }
        let Some(buf) = self.bufs.up.as_ref() else {
            return Err(QuantError::Cuda("row staging buffer missing".to_string()));
        };
        let n = r.len();
        let host = buf
            .as_slice()?
            .get(r.clone())
            .ok_or_else(|| QuantError::Cuda("staged row out of range".to_string()))?;
        match buf.device_address(self.gpu) {
            Some(base) => {
                let from = base + (r.start * 4) as u64;
                let to = super::device_address(&self.gpu.stream, dst);
                copy_f32(self.gpu, from, to, n)?;
            }
            None => self
                .gpu
                .stream
                .memcpy_htod(host, &mut dst.slice_mut(0..n))
                .map_err(|e| driver_err("row upload", e))?,
        }
        self.pending = true;
        Ok(())
    }

    /// Queues the copy of `src` down; its values are [`Self::downloaded`] once [`Self::synchronize`] has run.
    pub fn download(&mut self, src: &CudaView<'_, f32>) -> Result<Range<usize>> {
        let n = src.len();
        let at = self.down_used;
        self.room(false, at + n)?;
        let Some(buf) = self.bufs.down.as_mut() else {
            return Err(QuantError::Cuda("row staging buffer missing".to_string()));
        };
        match buf.device_address(self.gpu) {
            Some(base) => {
                let (from, _sync) = src.device_ptr(&self.gpu.stream);
                copy_f32(self.gpu, from, base + (at * 4) as u64, n)?;
            }
            None => {
                let host = &mut buf.as_mut_slice()?[at..at + n];
                self.gpu
                    .stream
                    .memcpy_dtoh(src, host)
                    .map_err(|e| driver_err("row download", e))?;
            }
        }
        self.down_used = at + n;
        self.pending = true;
        Ok(at..at + n)
    }

    /// Waits for every copy and kernel queued on the compute stream.
    pub fn synchronize(&mut self) -> Result<()> {
        self.wait()
    }

    /// The values of a download queued since the buffers were taken (after [`Self::synchronize`]).
    pub fn downloaded(&self, r: Range<usize>) -> Result<&[f32]> {
        if self.pending {
            return Err(QuantError::Cuda(
                "row download read before the stream was waited for".to_string(),
            ));
        }
        let Some(buf) = self.bufs.down.as_ref() else {
            return Err(QuantError::Cuda("row staging buffer missing".to_string()));
        };
        buf.as_slice()?
            .get(r)
            .ok_or_else(|| QuantError::Cuda("row download out of range".to_string()))
    }
}

/// Queues `copy_f32` of `n` floats from address `from` to address `to` (device memory, or pinned host memory seen
/// through unified addressing) on the compute stream.
fn copy_f32(gpu: &Gpu, from: u64, to: u64, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("copy_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(COPY_THREADS).min(COPY_MAX_BLOCKS) as u32, 1, 1),
        block_dim: (COPY_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let len = n as u64;
    let mut b = gpu.stream.launch_builder(f);
    b.arg(&from).arg(&to).arg(&len);
    // SAFETY: the callers pass `n` floats at both addresses: a range of a device buffer, and a range of a pinned
    // buffer that stays allocated (and unread by the host) until the stream is waited for (`RowCopies` holds it).
    unsafe { b.launch(cfg) }.map_err(|e| driver_err("row copy kernel", e))?;
    Ok(())
}

impl Drop for RowCopies<'_> {
    /// Copies still in flight read or write the buffers: wait for them before another caller takes them.
    fn drop(&mut self) {
        if self.pending {
            let _ = self.gpu.synchronize();
        }
    }
}
