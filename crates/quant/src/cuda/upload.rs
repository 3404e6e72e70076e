//! Large host-to-device uploads (spine matrices) on the weights' upload stream, so that an upload runs at the link's
//! rate and beside the kernels of the compute stream instead of between them.
//!
//! Bytes that lie in page-locked memory (a read buffer registered by [`Gpu::pin_host`]) go up in one copy straight
//! from there, and the call waits for it, so the caller may reuse the bytes once it returns. Other bytes go in pieces
//! of [`PIECE`] through two pinned staging buffers: while one piece is in flight the next is copied into the other
//! buffer (by the CPU threads). The destination is allocated on that stream and the upload
//! ends with an event; whoever reads the buffer on another stream waits for that event first
//! ([`super::dense::DeviceMatrix`] does before each product). Where pinned memory cannot be had, the upload falls
//! back to a plain copy on the compute stream (no event needed).

use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use rayon::prelude::*;

use super::{Gpu, driver_err};
use crate::error::Result;

/// Bytes per staged piece (and per pinned buffer).
const PIECE: usize = 64 << 20;
/// Pinned buffers.
const BUFFERS: usize = 2;
/// Bytes per CPU thread's share of a staging copy.
const COPY_CHUNK: usize = 1 << 20;

/// One pinned buffer and the event of the last upload that read it.
struct Stage {
    buf: PinnedHostSlice<u8>,
    done: Option<CudaEvent>,
}

/// The upload staging of one device (allocated on first use; `None` inside once pinned memory was refused).
#[derive(Default)]
pub(crate) struct Staging {
    stages: Mutex<Option<Option<Vec<Stage>>>>,
    stats: Mutex<StagingStats>,
}

/// Where [`Gpu::upload_large`]'s time went, summed over its calls (the host's wall time of each step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StagingStats {
    /// Calls.
    pub uploads: u64,
    /// Bytes they uploaded.
    pub bytes: u64,
    /// Of those, the bytes that went up straight from page-locked memory (no staging copy).
    pub direct_bytes: u64,
    /// Seconds inside the calls.
    pub secs: f64,
    /// Of those, copying into the pinned buffers (all CPU threads at once).
    pub copy_secs: f64,
    /// Of those, waiting for a pinned buffer's previous copy to the device to finish, or for a copy straight from
    /// page-locked memory.
    pub wait_secs: f64,
    /// Of those, allocating the destinations in device memory.
    pub alloc_secs: f64,
}

impl Gpu {
    /// Copies `src` to a new device buffer, returning it with the event that marks the end of the copy (`None`
    /// when the copy ran on the compute stream). The caller must wait for the event on any other stream before
    /// reading the buffer; the buffer is freed on the weights' upload stream, so its last reader must be done by then
    /// (every product here ends with a download that waits for it). `src` is no longer read once this returns.
    pub fn upload_large(&self, src: &[u8]) -> Result<(CudaSlice<u8>, Option<CudaEvent>)> {
        if self.is_pinned(src) {
            return self.upload_pinned(src);
        }
        let started = Instant::now();
        let (mut copy_secs, mut wait_secs) = (0.0, 0.0);
        let mut guard = self
            .staging
            .stages
            .lock()
            .map_err(|_| driver_err("upload staging", "lock poisoned"))?;
        if guard.is_none() {
            let mut stages = Vec::with_capacity(BUFFERS);
            for _ in 0..BUFFERS {
                // SAFETY: a staging buffer is written in full up to the length of each piece before the upload
                // that reads that many bytes is queued.
                match unsafe { self.ctx.alloc_pinned::<u8>(PIECE) } {
                    Ok(buf) => stages.push(Stage { buf, done: None }),
                    Err(e) => {
                        tracing::warn!(
                            "no pinned staging memory ({e}); uploads go from pageable memory"
                        );
                        break;
                    }
                }
            }
            *guard = Some((stages.len() == BUFFERS).then_some(stages));
        }
        let Some(Some(stages)) = guard.as_mut() else {
            return Ok((self.upload(src)?, None));
        };
        let copy = &self.weights_stream;
        let t = Instant::now();
        // SAFETY: every byte of the buffer is written by the piece copies below before anyone reads it.
        let mut dst = unsafe { copy.alloc::<u8>(src.len().max(1)) }
            .map_err(|e| driver_err("device allocation", e))?;
        let alloc_secs = t.elapsed().as_secs_f64();
        for (i, piece) in src.chunks(PIECE).enumerate() {
            let stage = &mut stages[i % BUFFERS];
            if let Some(ev) = stage.done.take() {
                let t = Instant::now();
                ev.synchronize()
                    .map_err(|e| driver_err("waiting for a staging buffer", e))?;
                wait_secs += t.elapsed().as_secs_f64();
            }
            let host = stage
                .buf
                .as_mut_slice()
                .map_err(|e| driver_err("staging buffer", e))?;
            let t = Instant::now();
            host[..piece.len()]
                .par_chunks_mut(COPY_CHUNK)
                .zip(piece.par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
            copy_secs += t.elapsed().as_secs_f64();
            let off = i * PIECE;
            let mut view = dst.slice_mut(off..off + piece.len());
            let staged: &[u8] = &stage
                .buf
                .as_slice()
                .map_err(|e| driver_err("staging buffer", e))?[..piece.len()];
            copy.memcpy_htod(staged, &mut view)
                .map_err(|e| driver_err("staged upload", e))?;
            stage.done = Some(
                copy.record_event(None)
                    .map_err(|e| driver_err("recording an upload", e))?,
            );
        }
        let done = copy
            .record_event(None)
            .map_err(|e| driver_err("recording an upload", e))?;
        self.count_upload(StagingStats {
            uploads: 1,
            bytes: src.len() as u64,
            direct_bytes: 0,
            secs: started.elapsed().as_secs_f64(),
            copy_secs,
            wait_secs,
            alloc_secs,
        });
        Ok((dst, Some(done)))
    }

    /// [`Self::upload_large`] of bytes inside a page-locked range: one copy on the weights' upload stream, waited for.
    fn upload_pinned(&self, src: &[u8]) -> Result<(CudaSlice<u8>, Option<CudaEvent>)> {
        let started = Instant::now();
        let copy = &self.weights_stream;
        // SAFETY: every byte of the buffer is written by the copy below before anyone reads it.
        let mut dst = unsafe { copy.alloc::<u8>(src.len().max(1)) }
            .map_err(|e| driver_err("device allocation", e))?;
        let alloc_secs = started.elapsed().as_secs_f64();
        copy.memcpy_htod(src, &mut dst.slice_mut(0..src.len()))
            .map_err(|e| driver_err("upload from page-locked memory", e))?;
        let done = copy
            .record_event(None)
            .map_err(|e| driver_err("recording an upload", e))?;
        let t = Instant::now();
        // The DMA reads `src` until the event: the caller may hand the bytes back to its read pool on return.
        done.synchronize()
            .map_err(|e| driver_err("waiting for an upload", e))?;
        self.count_upload(StagingStats {
            uploads: 1,
            bytes: src.len() as u64,
            direct_bytes: src.len() as u64,
            secs: started.elapsed().as_secs_f64(),
            copy_secs: 0.0,
            wait_secs: t.elapsed().as_secs_f64(),
            alloc_secs,
        });
        Ok((dst, Some(done)))
    }

    /// Adds one upload's counts to [`Self::staging_stats`].
    fn count_upload(&self, one: StagingStats) {
        let mut s = self.staging.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.uploads += one.uploads;
        s.bytes += one.bytes;
        s.direct_bytes += one.direct_bytes;
        s.secs += one.secs;
        s.copy_secs += one.copy_secs;
        s.wait_secs += one.wait_secs;
        s.alloc_secs += one.alloc_secs;
    }

    /// Keeps device memory freed by stream-ordered frees in the default pool for the next allocations, instead of
    /// handing it back to the driver at every synchronisation (the pool's release threshold, 0 by default): a
    /// streamed layer's buffers then reuse the last one's memory instead of mapping fresh memory each pass.
    pub fn keep_freed_memory(&self) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device is this context's.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(|e| driver_err("the default memory pool", e))?;
        let mut keep: u64 = u64::MAX;
        // SAFETY: the release threshold attribute takes a pointer to a u64.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| driver_err("the memory pool's release threshold", e))
    }

    /// What [`Self::upload_large`] has done so far.
    pub fn staging_stats(&self) -> StagingStats {
        *self.staging.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}
