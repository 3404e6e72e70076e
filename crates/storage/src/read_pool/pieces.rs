//! Spans read in pieces by several workers at once: a span longer than two pieces goes into the queue as its pieces,
//! each an aligned part of the same buffer, and the worker that finishes the last piece hands the span over.
//!
//! A layer's reads start together, so read whole, the first expert lands only when one worker has read all of it (17.5
//! MB for K3; 3–4 ms from a RAM-speed source, longer from a disk at low queue depth) and the next ones land together
//! after it; a GPU's DMA engine and the CPU's kernels sit idle until then. In pieces, the workers finish the spans one
//! after another, in the order asked for, each sooner. The bytes are the same either way: a piece reads its part of
//! the span's aligned superset with `O_DIRECT` (or through the page cache where the filesystem refuses it), into the
//! place a whole read would have put it.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use super::{
    AlignedBuf, DIRECT_ALIGN, ReadRequest, Shared, SpanRead, finish_span, lock, read_direct_into,
    refuse_direct,
};
use crate::error::StorageError;
use crate::pread::read_exact_at;

/// One span being read in pieces.
pub(super) struct Split {
    req: ReadRequest,
    reply: Sender<SpanRead>,
    /// The span's offset past the aligned start of its reads (where the span begins in the buffer).
    head: usize,
    /// The span's length.
    len: usize,
    /// Bytes per piece (a multiple of `DIRECT_ALIGN`); the last piece ends at `head + len`.
    piece: usize,
    pieces: usize,
    /// The buffer, allocated by the first piece to run and taken by the last to finish.
    buf: Mutex<Option<AlignedBuf>>,
    /// Its address once allocated (0 before, or when allocating failed).
    base: AtomicUsize,
    /// Pieces not finished yet.
    remaining: AtomicUsize,
    /// The first error of any piece.
    error: Mutex<Option<io::Error>>,
    /// Bytes the device moved for the pieces, and whether any of them went through the page cache.
    device_bytes: AtomicU64,
    buffered: AtomicBool,
}

impl Split {
    /// `req` as pieces of about `piece_bytes`, or `None` when it is read whole: splitting is off (0), the span is
    /// under two pieces, its length does not fit in memory, or its file reads through the page cache anyway.
    pub(super) fn plan(
        req: &ReadRequest,
        piece_bytes: usize,
        reply: &Sender<SpanRead>,
    ) -> Option<Arc<Self>> {
        let align = DIRECT_ALIGN as usize;
        let len = usize::try_from(req.len).ok()?;
        let piece = piece_bytes.div_ceil(align) * align;
        if piece == 0
            || len < 2 * piece
            || req.file.direct.is_none()
            || req.file.direct_refused.load(Ordering::Relaxed)
        {
            return None;
        }
        let head = (req.offset % DIRECT_ALIGN) as usize;
        let pieces = (head + len).div_ceil(piece);
        Some(Arc::new(Self {
            req: req.clone(),
            reply: reply.clone(),
            head,
            len,
            piece,
            pieces,
            buf: Mutex::new(None),
            base: AtomicUsize::new(0),
            remaining: AtomicUsize::new(pieces),
            error: Mutex::new(None),
            device_bytes: AtomicU64::new(0),
            buffered: AtomicBool::new(false),
        }))
    }

    /// How many pieces (queue jobs) the span is.
    pub(super) fn pieces(&self) -> usize {
        self.pieces
    }

    /// Reads piece `index`; the worker that finishes the last piece sends the span's completion.
    pub(super) fn read_piece(&self, shared: &Shared, index: usize) {
        if let Err(e) = self.read_part(shared, index) {
            lock(&self.error).get_or_insert(e);
        }
        // AcqRel: every piece's writes into the buffer happen before its decrement, and the last decrement sees them
        // all.
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.complete(shared);
        }
    }

    fn read_part(&self, shared: &Shared, index: usize) -> io::Result<()> {
        let align = DIRECT_ALIGN as usize;
        let need = self.head + self.len;
        let aligned_len = need.div_ceil(align) * align;
        let base = {
            let mut buf = lock(&self.buf);
            if buf.is_none() {
                if lock(&self.error).is_some() {
                    return Ok(());
                }
                let b = shared.buffers.take(aligned_len)?;
                self.base.store(b.ptr.as_ptr() as usize, Ordering::Relaxed);
                *buf = Some(b);
            }
            self.base.load(Ordering::Relaxed)
        };
        let lo = index * self.piece;
        let hi = (lo + self.piece).min(need);
        if lo >= hi {
            return Ok(());
        }
        let span = (hi - lo).div_ceil(align) * align;
        // SAFETY: the buffer holds at least `aligned_len` bytes and `lo + span <= aligned_len`; the pieces' ranges are
        // disjoint, so this is the only reference to these bytes; the buffer is neither moved out of its mapping nor
        // freed before the last piece has finished (only `complete`, run once every piece is done, takes it).
        let dst = unsafe { std::slice::from_raw_parts_mut((base + lo) as *mut u8, span) };
        let file = &self.req.file;
        let at = self.req.offset - self.head as u64 + lo as u64;
        let direct = file
            .direct
            .as_ref()
            .filter(|_| !file.direct_refused.load(Ordering::Relaxed));
        if let Some(handle) = direct {
            match read_direct_into(handle, &file.buffered, dst, at, hi - lo) {
                Ok(()) => {
                    self.device_bytes.fetch_add(span as u64, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => refuse_direct(file),
                Err(e) => return Err(e),
            }
        }
        read_exact_at(&file.buffered, &mut dst[..hi - lo], at)?;
        self.device_bytes
            .fetch_add((hi - lo) as u64, Ordering::Relaxed);
        self.buffered.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Hands the span over (or the first error), once every piece is done.
    fn complete(&self, shared: &Shared) {
        let buf = lock(&self.buf).take();
        let err = lock(&self.error).take();
        let result = match (buf, err) {
            (Some(buf), None) => {
                let c = &shared.counters;
                c.device_bytes
                    .fetch_add(self.device_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
                if self.buffered.load(Ordering::Relaxed) {
                    c.buffered_reads.fetch_add(1, Ordering::Relaxed);
                }
                finish_span(shared, &self.req, buf, self.head, self.len)
            }
            (buf, err) => {
                if let Some(b) = buf {
                    shared.buffers.give_back(b);
                }
                Err(StorageError::Io {
                    path: self.req.file.path.clone(),
                    source: err.unwrap_or_else(|| io::Error::other("no buffer for the read")),
                })
            }
        };
        // The caller may have given up on the batch; the buffer then returns to the pool with the completion.
        let _ = self.reply.send(SpanRead {
            tag: self.req.tag,
            result,
        });
    }
}
