//! The read pool: a fixed set of threads doing one positional read per span, bypassing the page cache.
//!
//! Expert spans are read whole (17,547,264 bytes for K3), so the page cache only costs a copy and evicts
//! what the RAM expert cache would rather keep. On Linux files are opened with `O_DIRECT`: the kernel
//! DMAs straight into our buffers, which must be aligned to [`DIRECT_ALIGN`] in address, file offset and
//! length, so a read covers the aligned superset of the span and the caller gets a slice of it. Where a
//! filesystem refuses `O_DIRECT` (tmpfs, some FUSE mounts) the pool logs it once per file and falls back
//! to ordinary reads. On macOS `F_NOCACHE` asks for the same thing on an ordinary descriptor.
//!
//! A layer's experts are submitted as one batch ([`ReadPool::submit`]) and come back on a channel as
//! each read finishes, so the caller can start on the first expert while the others are in flight. A span longer than
//! two pieces ([`ReadPoolOptions::piece_bytes`]) is read in pieces by several workers at once (`pieces`), so the
//! spans of a batch land one after another, each sooner, instead of together after one worker's whole read.
//! I/O buffers are kept in a free list and reused: a [`PooledBuf`] goes back to the list when dropped. A
//! [`BufferHook`] hears of every buffer mapped and unmapped (a GPU page-locks them, so its DMA engine reads experts
//! straight out of the buffers they were read into).

#[cfg(not(unix))]
use std::alloc::Layout;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Result, StorageError};
use crate::pread::read_exact_at;

mod pieces;

/// Alignment of buffer addresses, file offsets and lengths for direct I/O. 4096 covers every logical
/// block size in use (512-byte and 4K-native disks alike).
pub const DIRECT_ALIGN: u64 = 4096;

/// Default bytes per piece of a span read by several workers (see [`ReadPoolOptions::piece_bytes`]): large enough
/// for a disk's full rate per request, small enough that a K3 expert (17.5 MB) is five pieces.
pub const PIECE_BYTES: usize = 4 << 20;

/// Buffers grow in steps of this many bytes, so spans of slightly different lengths share buffers.
const BUF_GRANULE: usize = 2 << 20;
/// Buffer address alignment: one x86-64/arm64 huge page, so a buffer is whole huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// One file as the read pool sees it: a direct handle where the filesystem allows one, and an ordinary
/// handle for the fallback.
#[derive(Debug)]
pub struct PoolFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Set when a direct read failed with `EINVAL` (the filesystem accepted the flag at open but not
    /// the read); every later read of this file is buffered.
    direct_refused: AtomicBool,
}

impl PoolFile {
    /// Opens `path` for reading, with a page-cache-bypassing handle when `direct` is true.
    ///
    /// # Direct I/O
    /// `O_DIRECT` is not unsafe in Rust's sense, but it changes the rules of a read: address, offset
    /// and length must be multiples of [`DIRECT_ALIGN`], and some filesystems refuse the flag. All of
    /// that is handled here and in the pool's workers: reads cover the aligned superset of a span in an
    /// aligned buffer, and a refusal (at open or at the first read) is logged and falls back to an
    /// ordinary handle, which gives the same bytes through the page cache.
    pub fn open(path: &Path, direct: bool) -> Result<Self> {
        let buffered = File::open(path).map_err(|source| StorageError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let direct = if direct { open_direct(path) } else { None };
        Ok(Self {
            path: path.to_path_buf(),
            buffered,
            direct,
            direct_refused: AtomicBool::new(false),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some() && !self.direct_refused.load(Ordering::Relaxed)
    }
}

/// Opens a page-cache-bypassing handle, or logs why not and returns `None`.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "filesystem refuses O_DIRECT; reading through the page cache"
            );
            None
        }
    }
}

/// Opens a handle with `F_NOCACHE` set: the page cache keeps nothing of its reads, as `O_DIRECT` does on Linux, but
/// without alignment rules. Type-checked in CI (`.ci/macos-check.sh`), not run: there is no macOS machine here.
#[cfg(target_os = "macos")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::fd::AsRawFd;
    let file = File::open(path).ok()?;
    // SAFETY: fcntl on a descriptor we own, with an integer argument; no memory is passed.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
    if rc == -1 {
        tracing::warn!(path = %path.display(), "F_NOCACHE refused; reading through the page cache");
        return None;
    }
    Some(file)
}

/// Other systems: no bypass.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn open_direct(_path: &Path) -> Option<File> {
    None
}

/// Hears of every I/O buffer a read pool maps and unmaps, for example to page-lock the buffers for a GPU's DMA
/// engine. Buffers are long-lived (reused through the pool's free list), so a costly registration is paid once per
/// buffer, not per read.
pub trait BufferHook: Send + Sync + std::fmt::Debug {
    /// The buffer at address `addr`, `len` bytes (page-aligned, zero-filled, not yet read into), was just mapped. A
    /// hook that cannot do its work leaves the buffer as it is: reads into it work the same.
    fn mapped(&self, addr: usize, len: usize);
    /// The buffer mapped at `addr` is about to be unmapped; nobody holds its bytes any more.
    fn unmapping(&self, addr: usize, len: usize);
}

/// A zero-initialised buffer aligned to [`HUGE_PAGE`] (so to [`DIRECT_ALIGN`] as well).
struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// Told before the buffer is unmapped (it was told of the mapping).
    hook: Option<Arc<dyn BufferHook>>,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to [`BUF_GRANULE`]), aligned to [`HUGE_PAGE`].
    ///
    /// On Unix the buffer is its own anonymous mapping: zero-filled by the kernel page by page as it is touched,
    /// and handed back to the system when dropped. (A heap allocation of this size can stay in the allocator's
    /// arenas after it is freed, which grew the resident set by a gigabyte under a streamed spine's many buffer
    /// sizes.) On Linux it is advised to use transparent huge pages before its first touch: a direct read's request
    /// can then cover 2 MiB of physically contiguous memory per segment instead of 4 KiB, so a 17.5 MB read needs
    /// far fewer, larger device requests, and the kernels that multiply the experts in it stream through huge pages
    /// only. A mapping is placed on a huge page boundary only by recent Linux kernels, and only for some lengths;
    /// one that is not has its first and last partial huge pages on 4 KiB pages (an MXFP4 GEMV read them 5–10%
    /// slower, `examples/kernel_bandwidth.rs` of `deltafin-quant`). So the buffer maps a huge page less one page
    /// more than it needs, which holds an aligned range wherever the mapping starts, and unmaps the slack on both
    /// sides of that range.
    #[cfg(unix)]
    fn new(len: usize) -> io::Result<Self> {
        let cap = len.max(1).div_ceil(BUF_GRANULE) * BUF_GRANULE;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two() && *p <= HUGE_PAGE)
            .unwrap_or(4096);
        let mapped = cap + HUGE_PAGE - page;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let head = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
        let tail = mapped - head - cap;
        // SAFETY: both ranges lie inside the fresh mapping (head + cap + tail == mapped, with head at most
        // HUGE_PAGE - page as the mapping is page-aligned) and start on page boundaries; nothing refers to them.
        // A failed unmap only leaves unused address space mapped, never touched.
        unsafe {
            if head > 0 {
                libc::munmap(base, head);
            }
            if tail > 0 {
                libc::munmap(base.cast::<u8>().add(head + cap).cast(), tail);
            }
        }
        // SAFETY: `head` is within the mapping.
        let ptr = NonNull::new(unsafe { base.cast::<u8>().add(head) })
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "buffer mapping"))?;
        #[cfg(target_os = "linux")]
        // SAFETY: the range is exactly our aligned mapping; MADV_HUGEPAGE is only a hint. Its result does not
        // matter: without huge pages the buffer works the same, only more slowly.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), cap, libc::MADV_HUGEPAGE);
        }
        Ok(Self {
            ptr,
            cap,
            hook: None,
        })
    }

    /// A zeroed buffer of at least `len` bytes (rounded up to [`BUF_GRANULE`]), aligned to [`HUGE_PAGE`].
    #[cfg(not(unix))]
    fn new(len: usize) -> io::Result<Self> {
        let cap = len.max(1).div_ceil(BUF_GRANULE) * BUF_GRANULE;
        let layout = Layout::from_size_align(cap, HUGE_PAGE)
            .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "buffer too large"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "buffer allocation"))?;
        Ok(Self {
            ptr,
            cap,
            hook: None,
        })
    }

    /// [`Self::new`], with `hook` told of the mapping now and of the unmapping when the buffer is dropped.
    fn with_hook(len: usize, hook: Option<&Arc<dyn BufferHook>>) -> io::Result<Self> {
        let mut buf = Self::new(len)?;
        if let Some(h) = hook {
            h.mapped(buf.ptr.as_ptr() as usize, buf.cap);
            buf.hook = Some(Arc::clone(h));
        }
        Ok(buf)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialised (zero-filled or read) bytes for as long as self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(h) = self.hook.take() {
            h.unmapping(self.ptr.as_ptr() as usize, self.cap);
        }
        #[cfg(unix)]
        // SAFETY: mapped in `new` with exactly this length, and not used after this.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.cap);
        }
        #[cfg(not(unix))]
        // SAFETY: allocated in `new` with exactly this layout (the layout was valid then).
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, HUGE_PAGE),
            )
        }
    }
}

/// The free list of I/O buffers.
struct BufferPool {
    free: Mutex<Vec<AlignedBuf>>,
    max_idle: usize,
    allocated: AtomicU64,
    hook: Option<Arc<dyn BufferHook>>,
}

impl BufferPool {
    fn lock(&self) -> MutexGuard<'_, Vec<AlignedBuf>> {
        // A worker that panicked while holding the lock left a valid Vec behind; keep going.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The smallest free buffer of at least `len` bytes that wastes no more than `len` again, or a new one.
    ///
    /// Best fit keeps a streamed layer's mix of 176 MB projections and small vectors from taking each other's
    /// buffers, which would make the next large read allocate afresh and the pool grow past a layer's worth. When
    /// none fits, the others stay for the reads they fit (a model whose layers alternate between two kinds, KDA and
    /// MLA, needs both kinds' sizes); only a full list gives up its smallest buffer, so it does not fill up with
    /// useless ones. A new buffer is fresh pages the kernel zeroes (and, with a GPU hook, a page-locking), so
    /// reusing one is worth far more than the idle memory.
    fn take(&self, len: usize) -> io::Result<AlignedBuf> {
        {
            let mut free = self.lock();
            let fit = free
                .iter()
                .enumerate()
                .filter(|(_, b)| {
                    b.cap >= len && b.cap <= len.saturating_mul(2).max(len + BUF_GRANULE)
                })
                .min_by_key(|(_, b)| b.cap)
                .map(|(i, _)| i);
            if let Some(i) = fit {
                return Ok(free.swap_remove(i));
            }
            // None fits: with the list full, drop the smallest, so it does not fill up with useless buffers.
            if free.len() >= self.max_idle
                && let Some(i) = free
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, b)| b.cap)
                    .map(|(i, _)| i)
            {
                free.swap_remove(i);
            }
        }
        self.allocated.fetch_add(1, Ordering::Relaxed);
        AlignedBuf::with_hook(len, self.hook.as_ref())
    }

    /// Unmaps every idle buffer (their pages go back to the system).
    fn release_idle(&self) {
        let idle = std::mem::take(&mut *self.lock());
        drop(idle);
    }

    fn give_back(&self, buf: AlignedBuf) {
        let mut free = self.lock();
        if free.len() < self.max_idle {
            free.push(buf);
        }
    }
}

/// The bytes of one span, in a pooled aligned buffer that returns to the pool when dropped.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    start: usize,
    len: usize,
    pool: Arc<BufferPool>,
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.buf {
            Some(b) => &b.as_slice()[self.start..self.start + self.len],
            None => &[],
        }
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuf").field("len", &self.len).finish()
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf);
        }
    }
}

/// Bytes of one span: from the read pool, or owned (fetched over the network).
#[derive(Debug)]
pub enum SpanBytes {
    /// Read by the pool into a reused buffer.
    Pooled(PooledBuf),
    /// An owned buffer holding exactly the span.
    Owned(Vec<u8>),
}

impl std::ops::Deref for SpanBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            SpanBytes::Pooled(b) => b,
            SpanBytes::Owned(v) => v,
        }
    }
}

impl SpanBytes {
    /// The bytes as an owned vector (a copy for pooled buffers, which then go back to the pool).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            SpanBytes::Pooled(b) => b.to_vec(),
            SpanBytes::Owned(v) => v,
        }
    }
}

/// One read to do.
#[derive(Clone, Debug)]
pub struct ReadRequest {
    /// Caller's tag, returned with the completion (for example an index into the batch).
    pub tag: usize,
    /// The file to read.
    pub file: Arc<PoolFile>,
    /// Absolute byte offset of the span.
    pub offset: u64,
    /// Span length in bytes.
    pub len: u64,
    /// When set, the span's CRC-32 must equal this, else the read fails with
    /// [`StorageError::CorruptSpan`] (used for spans of the streaming cache).
    pub expect_crc: Option<u32>,
}

/// A finished read.
#[derive(Debug)]
pub struct SpanRead {
    /// The request's tag.
    pub tag: usize,
    /// The bytes, or why they could not be had.
    pub result: Result<SpanBytes>,
}

/// Counter totals since the pool was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Span bytes delivered (not counting alignment padding).
    pub bytes: u64,
    /// Bytes the device was asked for, alignment padding included.
    pub device_bytes: u64,
    /// Reads completed.
    pub reads: u64,
    /// Reads that went through the page cache (no direct handle, or it was refused).
    pub buffered_reads: u64,
    /// Time callers spent blocked waiting for completions, in nanoseconds.
    pub wait_ns: u64,
    /// I/O buffers allocated so far (the rest of the reads reused one).
    pub buffers_allocated: u64,
}

#[derive(Default)]
struct Counters {
    bytes: AtomicU64,
    device_bytes: AtomicU64,
    reads: AtomicU64,
    buffered_reads: AtomicU64,
    wait_ns: AtomicU64,
}

/// A queued read.
enum Job {
    /// A whole span, read by one worker; its completion goes to `reply`.
    Whole {
        req: ReadRequest,
        reply: Sender<SpanRead>,
    },
    /// Piece `index` of a span read by several workers.
    Piece {
        split: Arc<pieces::Split>,
        index: usize,
    },
}

struct Queue {
    jobs: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

struct Shared {
    queue: Queue,
    buffers: Arc<BufferPool>,
    counters: Counters,
    /// Bytes per piece of a split span (0: spans are read whole).
    piece_bytes: usize,
}

/// Options of [`ReadPool::new`].
#[derive(Clone, Debug)]
pub struct ReadPoolOptions {
    /// Reader threads, which is also the number of reads in flight (the queue depth).
    pub threads: usize,
    /// Buffers kept for reuse when idle.
    pub max_idle_buffers: usize,
    /// Told of every buffer mapped and unmapped (none by default).
    pub buffer_hook: Option<Arc<dyn BufferHook>>,
    /// A span of at least two pieces of this many bytes (rounded up to [`DIRECT_ALIGN`]) is read in pieces by
    /// several workers at once; 0 reads every span whole. Default [`PIECE_BYTES`].
    pub piece_bytes: usize,
}

impl Default for ReadPoolOptions {
    fn default() -> Self {
        // Four reads in flight saturate the NVMe disks measured in docs/PERFORMANCE.md; a layer's
        // top-16 batch plus the in-flight reads bounds the buffers worth keeping.
        Self {
            threads: 4,
            max_idle_buffers: 24,
            buffer_hook: None,
            piece_bytes: PIECE_BYTES,
        }
    }
}

/// A fixed pool of reader threads. Dropping it stops the threads after the queued reads.
pub struct ReadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ReadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadPool")
            .field("threads", &self.workers.len())
            .finish()
    }
}

impl ReadPool {
    /// Starts `options.threads` reader threads (at least one).
    pub fn new(options: &ReadPoolOptions) -> Result<Self> {
        let shared = Arc::new(Shared {
            queue: Queue {
                jobs: Mutex::new((VecDeque::new(), false)),
                ready: Condvar::new(),
            },
            buffers: Arc::new(BufferPool {
                free: Mutex::new(Vec::new()),
                max_idle: options.max_idle_buffers,
                allocated: AtomicU64::new(0),
                hook: options.buffer_hook.clone(),
            }),
            counters: Counters::default(),
            piece_bytes: options.piece_bytes,
        });
        let mut workers = Vec::new();
        for i in 0..options.threads.max(1) {
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("deltafin-read-{i}"))
                .spawn(move || worker(&shared))
                .map_err(|source| StorageError::Io {
                    path: PathBuf::from("<read pool thread>"),
                    source,
                })?;
            workers.push(handle);
        }
        Ok(Self { shared, workers })
    }

    /// Queues `requests`; each completion is sent on `reply` as soon as its read finishes.
    pub fn submit_to(&self, requests: Vec<ReadRequest>, reply: &Sender<SpanRead>) {
        let mut jobs = lock(&self.shared.queue.jobs);
        for req in requests {
            match pieces::Split::plan(&req, self.shared.piece_bytes, reply) {
                Some(split) => {
                    for index in 0..split.pieces() {
                        jobs.0.push_back(Job::Piece {
                            split: Arc::clone(&split),
                            index,
                        });
                    }
                }
                None => jobs.0.push_back(Job::Whole {
                    req,
                    reply: reply.clone(),
                }),
            }
        }
        drop(jobs);
        self.shared.queue.ready.notify_all();
    }

    /// Queues one batch and returns an iterator over its completions, in completion order.
    pub fn submit(&self, requests: Vec<ReadRequest>) -> Batch<'_> {
        let (tx, rx) = channel();
        let remaining = requests.len();
        self.submit_to(requests, &tx);
        Batch {
            rx,
            remaining,
            pool: self,
        }
    }

    /// Records time a caller spent waiting for completions (for callers that drain their own channel).
    pub fn add_wait(&self, waited: Duration) {
        self.shared
            .counters
            .wait_ns
            .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Unmaps the idle buffers kept for reuse, for a pool that will read little from now on (a spine reader once
    /// the model is loaded with nothing left to stream). Later reads map fresh buffers.
    pub fn release_idle_buffers(&self) {
        self.shared.buffers.release_idle();
    }

    /// The counters so far.
    pub fn stats(&self) -> ReadStats {
        let c = &self.shared.counters;
        ReadStats {
            bytes: c.bytes.load(Ordering::Relaxed),
            device_bytes: c.device_bytes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            buffered_reads: c.buffered_reads.load(Ordering::Relaxed),
            wait_ns: c.wait_ns.load(Ordering::Relaxed),
            buffers_allocated: self.shared.buffers.allocated.load(Ordering::Relaxed),
        }
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        lock(&self.shared.queue.jobs).1 = true;
        self.shared.queue.ready.notify_all();
        for w in self.workers.drain(..) {
            // A worker that panicked has nothing left to clean up.
            let _ = w.join();
        }
    }
}

/// The completions of one [`ReadPool::submit`], in the order the reads finish.
pub struct Batch<'p> {
    rx: Receiver<SpanRead>,
    remaining: usize,
    pool: &'p ReadPool,
}

impl Iterator for Batch<'_> {
    type Item = SpanRead;

    fn next(&mut self) -> Option<SpanRead> {
        if self.remaining == 0 {
            return None;
        }
        let start = Instant::now();
        let got = self.rx.recv().ok();
        self.pool.add_wait(start.elapsed());
        self.remaining -= 1;
        got
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The queue holds plain data that stays consistent even if a holder panicked.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn worker(shared: &Shared) {
    loop {
        let job = {
            let mut jobs = lock(&shared.queue.jobs);
            loop {
                if let Some(job) = jobs.0.pop_front() {
                    break job;
                }
                if jobs.1 {
                    return;
                }
                jobs = shared
                    .queue
                    .ready
                    .wait(jobs)
                    .unwrap_or_else(|e| e.into_inner());
            }
        };
        match job {
            Job::Whole { req, reply } => {
                let result = read_span(shared, &req);
                // The caller may have given up on the batch (an earlier error); the buffer then just returns
                // to the pool when the completion is dropped.
                let _ = reply.send(SpanRead {
                    tag: req.tag,
                    result,
                });
            }
            Job::Piece { split, index } => split.read_piece(shared, index),
        }
    }
}

/// Reads one span into a pooled buffer and checks its CRC when asked to.
fn read_span(shared: &Shared, req: &ReadRequest) -> Result<SpanBytes> {
    let io_err = |source| StorageError::Io {
        path: req.file.path.clone(),
        source,
    };
    let len = usize::try_from(req.len).map_err(|_| StorageError::OutOfRange {
        what: format!("addressable memory ({})", req.file.path.display()),
        offset: req.offset,
        len: req.len,
    })?;
    let c = &shared.counters;
    let direct = req
        .file
        .direct
        .as_ref()
        .filter(|_| !req.file.direct_refused.load(Ordering::Relaxed));
    let read = match direct {
        Some(handle) => {
            let head = (req.offset % DIRECT_ALIGN) as usize;
            let aligned_len = (head + len).div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize;
            let mut buf = shared.buffers.take(aligned_len).map_err(io_err)?;
            match read_direct(handle, &req.file.buffered, &mut buf, req.offset, len) {
                Ok(()) => {
                    c.device_bytes
                        .fetch_add(aligned_len as u64, Ordering::Relaxed);
                    Some((buf, head))
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    refuse_direct(&req.file);
                    shared.buffers.give_back(buf);
                    None
                }
                Err(e) => {
                    shared.buffers.give_back(buf);
                    return Err(io_err(e));
                }
            }
        }
        None => None,
    };
    let (buf, start) = match read {
        Some(r) => r,
        None => {
            let mut buf = shared.buffers.take(len).map_err(io_err)?;
            if let Err(e) = read_exact_at(
                &req.file.buffered,
                &mut buf.as_mut_slice()[..len],
                req.offset,
            ) {
                shared.buffers.give_back(buf);
                return Err(io_err(e));
            }
            c.buffered_reads.fetch_add(1, Ordering::Relaxed);
            c.device_bytes.fetch_add(len as u64, Ordering::Relaxed);
            (buf, 0)
        }
    };
    finish_span(shared, req, buf, start, len)
}

/// Marks `file`'s direct handle refused (`EINVAL` at a read): every later read of it goes through the page cache.
/// Said once per file.
fn refuse_direct(file: &PoolFile) {
    if !file.direct_refused.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            path = %file.path.display(),
            "direct read refused (EINVAL); reading this file through the page cache"
        );
    }
}

/// A span read into `buf` (`len` bytes from `start`): counted, checked against its CRC when the request carries one,
/// and handed out.
fn finish_span(
    shared: &Shared,
    req: &ReadRequest,
    buf: AlignedBuf,
    start: usize,
    len: usize,
) -> Result<SpanBytes> {
    let c = &shared.counters;
    c.bytes.fetch_add(len as u64, Ordering::Relaxed);
    c.reads.fetch_add(1, Ordering::Relaxed);
    let bytes = PooledBuf {
        buf: Some(buf),
        start,
        len,
        pool: Arc::clone(&shared.buffers),
    };
    if let Some(expected) = req.expect_crc {
        let actual = crc32fast::hash(&bytes);
        if actual != expected {
            return Err(StorageError::CorruptSpan {
                path: req.file.path.clone(),
                offset: req.offset,
                len: req.len,
                reason: format!("crc32 {actual:08x}, manifest says {expected:08x}"),
            });
        }
    }
    Ok(SpanBytes::Pooled(bytes))
}

/// Reads `len` bytes at `offset` through the direct handle into `buf`, which must hold the aligned
/// superset. A short read that leaves the position unaligned (possible only at the end of a file) is
/// finished through the buffered handle.
fn read_direct(
    direct: &File,
    buffered: &File,
    buf: &mut AlignedBuf,
    offset: u64,
    len: usize,
) -> io::Result<()> {
    let align = DIRECT_ALIGN as usize;
    let head = (offset % DIRECT_ALIGN) as usize;
    let need = head + len;
    let aligned_len = need.div_ceil(align) * align;
    read_direct_into(
        direct,
        buffered,
        &mut buf.as_mut_slice()[..aligned_len],
        offset - head as u64,
        need,
    )
}

/// Reads `need` bytes at the aligned offset `start` through the direct handle into `dst` (aligned, `need` rounded up
/// to [`DIRECT_ALIGN`] long). A short read that leaves the position unaligned (possible only at the end of a file) is
/// finished through the buffered handle.
fn read_direct_into(
    direct: &File,
    buffered: &File,
    dst: &mut [u8],
    start: u64,
    need: usize,
) -> io::Result<()> {
    let align = DIRECT_ALIGN as usize;
    let mut done = 0usize;
    while done < need {
        if !done.is_multiple_of(align) {
            // Only the tail of the file can come back short and unaligned; finish it buffered.
            return read_exact_at(buffered, &mut dst[done..need], start + done as u64);
        }
        match pread(direct, &mut dst[done..], start + done as u64) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(unix)]
fn pread(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::os::unix::fs::FileExt;
    file.read_at(buf, offset)
}

#[cfg(windows)]
fn pread(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::os::windows::fs::FileExt;
    file.seek_read(buf, offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_reused() {
        let pool = BufferPool {
            free: Mutex::new(Vec::new()),
            max_idle: 2,
            allocated: AtomicU64::new(0),
            hook: None,
        };
        let a = pool.take(10).expect("alloc");
        assert_eq!(a.ptr.as_ptr() as usize % HUGE_PAGE, 0);
        let addr = a.ptr.as_ptr() as usize;
        pool.give_back(a);
        let b = pool.take(BUF_GRANULE).expect("reuse");
        assert_eq!(b.ptr.as_ptr() as usize, addr);
        assert_eq!(pool.allocated.load(Ordering::Relaxed), 1);
    }

    /// A read that fits no idle buffer gets a new one and leaves the idle ones for the reads they fit (two kinds of
    /// layer alternating), until the list is full; then its smallest buffer gives way. Releasing empties the list.
    #[test]
    fn a_misfit_keeps_the_idle_buffers_until_the_list_is_full() {
        let pool = BufferPool {
            free: Mutex::new(Vec::new()),
            max_idle: 2,
            allocated: AtomicU64::new(0),
            hook: None,
        };
        let (small, large) = (BUF_GRANULE, 8 * BUF_GRANULE);
        let a = pool.take(small).expect("alloc");
        pool.give_back(a);
        // Too large for the idle buffer: a new one, and the small one stays.
        let b = pool.take(large).expect("alloc");
        assert_eq!(pool.lock().len(), 1);
        pool.give_back(b);
        assert_eq!(pool.allocated.load(Ordering::Relaxed), 2);
        // Both sizes now come from the list.
        let (a, b) = (
            pool.take(small).expect("reuse"),
            pool.take(large).expect("reuse"),
        );
        assert_eq!(pool.allocated.load(Ordering::Relaxed), 2);
        pool.give_back(a);
        pool.give_back(b);
        // A third size with the list full: the smallest idle buffer gives way.
        let c = pool.take(3 * large).expect("alloc");
        assert_eq!(pool.lock().len(), 1);
        assert!(pool.lock()[0].cap >= large, "the large buffer stayed");
        pool.give_back(c);
        pool.release_idle();
        assert!(pool.lock().is_empty());
    }

    /// Every buffer starts on a huge page boundary, whatever its length (an expert's span is 17.5 MB), and all of
    /// it is usable: the slack mapped for alignment is gone, the buffer itself is not.
    #[test]
    fn buffers_start_on_a_huge_page_and_are_whole() {
        for len in [1, 4096, 3 << 20, 17_547_264 + 4096, 64 << 20] {
            let mut buf = AlignedBuf::new(len).expect("buffer");
            assert_eq!(buf.ptr.as_ptr() as usize % HUGE_PAGE, 0, "len {len}");
            assert!(buf.cap >= len && buf.cap.is_multiple_of(BUF_GRANULE));
            let bytes = buf.as_mut_slice();
            assert!(bytes[0] == 0 && bytes[bytes.len() - 1] == 0, "zero-filled");
            bytes[0] = 1;
            let last = bytes.len() - 1;
            bytes[last] = 2;
            assert_eq!((bytes[0], bytes[last]), (1, 2));
        }
    }
}
