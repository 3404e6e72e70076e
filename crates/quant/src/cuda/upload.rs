//! Large host-to-device uploads (spine matrices) through pinned staging buffers on the upload stream, so that an
//! upload runs at the link's rate and beside the kernels of the compute stream instead of between them.
//!
//! The bytes go in pieces of [`PIECE`] through two pinned buffers: while one piece is in flight the next is copied
//! into the other buffer (by the CPU threads). The destination is allocated on the upload stream and the upload
//! ends with an event; whoever reads the buffer on another stream waits for that event first
//! ([`super::dense::DeviceMatrix`] does before each product). Where pinned memory cannot be had, the upload falls
//! back to a plain copy on the compute stream (no event needed).

use std::sync::Mutex;

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
}

impl Gpu {
    /// Copies `src` to a new device buffer, returning it with the event that marks the end of the copy (`None`
    /// when the copy ran on the compute stream). The caller must wait for the event on any other stream before
    /// reading the buffer; the buffer is freed on the upload stream, so its last reader must be done by then (every
    /// product here ends with a download that waits for it).
    pub fn upload_staged(&self, src: &[u8]) -> Result<(CudaSlice<u8>, Option<CudaEvent>)> {
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
        let copy = &self.copy_stream;
        // SAFETY: every byte of the buffer is written by the piece copies below before anyone reads it.
        let mut dst = unsafe { copy.alloc::<u8>(src.len().max(1)) }
            .map_err(|e| driver_err("device allocation", e))?;
        for (i, piece) in src.chunks(PIECE).enumerate() {
            let stage = &mut stages[i % BUFFERS];
            if let Some(ev) = stage.done.take() {
                ev.synchronize()
                    .map_err(|e| driver_err("waiting for a staging buffer", e))?;
            }
            let host = stage
                .buf
                .as_mut_slice()
                .map_err(|e| driver_err("staging buffer", e))?;
            host[..piece.len()]
                .par_chunks_mut(COPY_CHUNK)
                .zip(piece.par_chunks(COPY_CHUNK))
                .for_each(|(d, s)| d.copy_from_slice(s));
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
        Ok((dst, Some(done)))
    }
}
