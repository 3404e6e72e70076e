//! Routed experts on the GPU: a device-memory expert cache (frequency and recency) in front of host RAM, uploads
//! through pinned buffers on the upload stream, and the MXFP4 kernels of `deltafin_quant::cuda::moe`.
//!
//! One MoE call: route (CPU) → look every chosen expert up in the cache → a helper thread reads the missing ones from
//! the [`ExpertSource`] (host RAM or disk) and queues each one's upload on the upload stream as its read lands, while
//! the calling thread runs the caller's overlap work (the shared experts) on the compute stream → the compute stream
//! waits for the uploads → gate/up + SiTU and down for all experts in two launches → combine in the router's order →
//! one download. An expert whose bytes lie in page-locked memory (a read-pool buffer the runtime registered with
//! [`Gpu::pin_host`]) goes up straight from there, held until its copy is done; any other is first copied into a
//! pinned staging buffer (in parallel pieces, while the source reads the next).
//!
//! Cache slots hold an expert's six tensors at 256-byte aligned offsets. Eviction takes the unpinned slot with the
//! fewest uses, the least recently used among equals; use counts are halved every `8 × capacity` lookups so old
//! favourites fade.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use deltafin_quant::cuda::moe::{self, ExpertPtrs, MoeShape, SlotRef};
use deltafin_quant::cuda::{Gpu, StreamTimer, device_address};
use rayon::prelude::*;

use super::cuda_err;
use crate::error::{ModelError, Result};
use crate::moe::Route;
use crate::weights::{ExpertSource, ExpertWeights};

/// Alignment of each tensor inside a cache slot.
const PART_ALIGN: usize = 256;
/// Pinned staging buffers (uploads in flight while the next expert is copied in).
const STAGING_BUFFERS: usize = 3;
/// Bytes per parallel piece of a staging copy.
const COPY_PIECE: usize = 1 << 20;
/// Share of free device memory the cache takes when no size is given.
const DEFAULT_CACHE_SHARE: f64 = 0.5;

/// Counters of the GPU expert cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertCacheStats {
    /// Experts the cache holds at most.
    pub capacity: usize,
    /// Lookups served from device memory.
    pub hits: u64,
    /// Lookups that needed an upload.
    pub misses: u64,
    /// Experts evicted to make room.
    pub evictions: u64,
    /// Bytes uploaded host → device.
    pub uploaded_bytes: u64,
    /// Of those, bytes that went up straight from page-locked read buffers (no staging copy).
    pub uploaded_direct_bytes: u64,
    /// Wall time of the upload helper (host reads, staging copies and queued DMA), summed.
    pub upload_secs: f64,
    /// The upload stream's own time for the experts' copies (device events around each expert's copies), summed:
    /// the DMA alone, without the waits for reads between copies.
    pub upload_dma_secs: f64,
    /// Where an MoE call's wall time goes ([`MoeSplit`]), summed over calls.
    pub split: MoeSplit,
}

/// The wall time of the GPU MoE calls, summed, in the order a call runs its steps. What a call spends outside
/// `reads`, `queue` and `finish` (the lock, the small uploads, slot bookkeeping, waiting for the calling thread's
/// overlap work after the helper is done) is `total` less those.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoeSplit {
    /// Calls.
    pub calls: u64,
    /// Seconds inside the calls.
    pub total: f64,
    /// The upload helper blocked on the expert source (reads in flight, or the RAM cache's lock).
    pub reads: f64,
    /// The upload helper queuing copies (and staging copies for pageable experts) as experts land.
    pub queue: f64,
    /// The calling thread's overlap work (the shared experts), beside the helper.
    pub overlap: f64,
    /// From the (last) helper's end to the combined rows on the host: the uploads' tail, the kernels, the combine and
    /// the download.
    pub finish: f64,
}

impl MoeSplit {
    fn add(&mut self, o: &MoeSplit) {
        self.calls += o.calls;
        self.total += o.total;
        self.reads += o.reads;
        self.queue += o.queue;
        self.overlap += o.overlap;
        self.finish += o.finish;
    }

    /// What was counted between `earlier` and these.
    pub fn since(&self, earlier: &MoeSplit) -> MoeSplit {
        MoeSplit {
            calls: self.calls - earlier.calls,
            total: self.total - earlier.total,
            reads: self.reads - earlier.reads,
            queue: self.queue - earlier.queue,
            overlap: self.overlap - earlier.overlap,
            finish: self.finish - earlier.finish,
        }
    }
}

impl ExpertCacheStats {
    /// Hits over lookups.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    key: Option<(usize, usize)>,
    freq: u32,
    last: u64,
    pinned: bool,
}

struct Staging {
    buf: PinnedHostSlice<u8>,
    done: Option<CudaEvent>,
}

#[derive(Default)]
struct CacheState {
    pool: Option<CudaSlice<u8>>,
    map: HashMap<(usize, usize), usize>,
    entries: Vec<Entry>,
    tick: u64,
    lookups: u64,
    staging: Vec<Staging>,
    /// Event pairs timing each expert's copies on the upload stream, reused from call to call.
    dma_timers: Vec<StreamTimer>,
    stats: ExpertCacheStats,
}

impl CacheState {
    fn touch(&mut self, slot: usize) {
        self.tick += 1;
        self.lookups += 1;
        let e = &mut self.entries[slot];
        e.freq = e.freq.saturating_add(1);
        e.last = self.tick;
        e.pinned = true;
        let period = 8 * self.entries.len().max(1) as u64;
        if self.lookups.is_multiple_of(period) {
            for e in &mut self.entries {
                e.freq >>= 1;
            }
        }
    }

    /// A slot for a new expert: an empty one, else the unpinned one with the fewest uses (oldest on ties).
    fn victim(&self) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.pinned)
            .min_by_key(|(_, e)| (e.key.is_some(), e.freq, e.last))
            .map(|(i, _)| i)
    }
}

/// The routed experts of one model on the GPU.
pub struct GpuExperts {
    gpu: Arc<Gpu>,
    shape: MoeShape,
    /// Bytes of w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale.
    lens: [usize; 6],
    /// Their offsets inside a slot.
    offsets: [usize; 6],
    slot_bytes: usize,
    max_experts: usize,
    /// Bytes of device memory for the slots (0: half of what is free at first use).
    budget: AtomicU64,
    disabled: AtomicBool,
    state: Mutex<CacheState>,
}

impl std::fmt::Debug for GpuExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuExperts({} bytes a slot)", self.slot_bytes)
    }
}

/// Where the upload helper puts experts: the cache's slots, the staging buffers, and the DMA timers from
/// `first_timer` on (those before it time this call's earlier chunks).
struct UploadTargets<'a> {
    pool: &'a mut CudaSlice<u8>,
    staging: &'a mut [Staging],
    timers: &'a mut Vec<StreamTimer>,
    first_timer: usize,
}

/// What the upload helper hands back.
struct Uploaded {
    done: Option<CudaEvent>,
    bytes: u64,
    /// Timers of `dma_timers` used (the first ones), one per expert.
    timed: usize,
    /// Bytes that went up without a staging copy.
    direct_bytes: u64,
    /// The experts whose copies read their host bytes in place.
    held: DmaHold,
    /// Seconds blocked on the source, and seconds queuing copies (see [`MoeSplit`]).
    reads_secs: f64,
    queue_secs: f64,
}

/// Experts whose uploads read their host bytes in place (page-locked read buffers): held until the upload stream
/// has copied them. Dropping the hold waits for the upload stream first, so no error path can hand a buffer back to
/// the read pool (to be read into, or unmapped) while the DMA engine still reads it.
struct DmaHold {
    copy: Arc<cudarc::driver::CudaStream>,
    held: Vec<Arc<ExpertWeights>>,
}

impl Drop for DmaHold {
    fn drop(&mut self) {
        if !self.held.is_empty()
            && let Err(e) = self.copy.synchronize()
        {
            // The stream is broken, so no copy is running any more either; the bytes can go.
            tracing::warn!("waiting for expert uploads before releasing their buffers: {e}");
        }
    }
}

impl GpuExperts {
    /// Experts of `shape` (`max_experts` in the whole model); `budget` bytes of device memory for the cache
    /// (default: half of what is free when the first MoE layer runs).
    pub fn new(gpu: &Arc<Gpu>, shape: MoeShape, max_experts: usize, budget: Option<u64>) -> Self {
        let (w, i) = (shape.width, shape.inter);
        let lens = [
            i * w / 2,
            i * w / 32,
            w * i / 2,
            w * i / 32,
            i * w / 2,
            i * w / 32,
        ];
        let mut offsets = [0usize; 6];
        let mut end = 0;
        for (o, l) in offsets.iter_mut().zip(lens) {
            *o = end;
            end = (end + l).div_ceil(PART_ALIGN) * PART_ALIGN;
        }
        Self {
            gpu: gpu.clone(),
            shape,
            lens,
            offsets,
            slot_bytes: end.max(PART_ALIGN),
            max_experts: max_experts.max(1),
            budget: AtomicU64::new(budget.unwrap_or(0)),
            disabled: AtomicBool::new(false),
            state: Mutex::new(CacheState::default()),
        }
    }

    /// Sets the slots' device memory (before the first MoE call allocates them; later calls change nothing).
    pub(crate) fn set_budget(&self, bytes: u64) {
        self.budget.store(bytes.max(1), Ordering::Relaxed);
    }

    /// The cache's counters.
    pub fn stats(&self) -> ExpertCacheStats {
        self.state
            .lock()
            .map(|s| s.stats.clone())
            .unwrap_or_default()
    }

    /// Bytes of one cache slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, CacheState>> {
        self.state
            .lock()
            .map_err(|_| ModelError::Device("gpu expert cache lock poisoned".to_string()))
    }

    /// Allocates the slot pool and staging buffers on first use.
    fn ensure_pool(&self, st: &mut CacheState) -> Result<()> {
        if st.pool.is_some() {
            return Ok(());
        }
        let budget = match self.budget.load(Ordering::Relaxed) {
            b @ 1.. => b as f64,
            0 => {
                let (free, _) = self.gpu.memory().map_err(cuda_err)?;
                free as f64 * DEFAULT_CACHE_SHARE
            }
        };
        let capacity = ((budget / self.slot_bytes as f64) as usize).clamp(1, self.max_experts);
        st.pool = Some(
            self.gpu
                .zeros::<u8>(capacity * self.slot_bytes)
                .map_err(cuda_err)?,
        );
        self.gpu.synchronize().map_err(cuda_err)?;
        st.entries = vec![Entry::default(); capacity];
        st.stats.capacity = capacity;
        for _ in 0..STAGING_BUFFERS {
            // SAFETY: the buffer is written in full (every byte of a slot) before each upload reads it.
            let buf = unsafe { self.gpu.context().alloc_pinned::<u8>(self.slot_bytes) }
                .map_err(|e| ModelError::Device(format!("cuda: pinned staging buffer: {e}")))?;
            st.staging.push(Staging { buf, done: None });
        }
        Ok(())
    }

    /// Runs the routed experts of layer `layer` for `routes` on `z` (`[T, width]`), with `overlap` run on the
    /// calling thread while missing experts upload. Returns the combined `[T, width]` rows and `overlap`'s result,
    /// or `None` when the experts are not MXFP4 (the caller then uses the CPU path).
    pub(crate) fn run<R>(
        &self,
        layer: usize,
        z: &[f32],
        routes: &[Route],
        source: &dyn ExpertSource,
        overlap: impl FnOnce() -> Result<R>,
    ) -> Result<Option<(Vec<f32>, R)>> {
        if self.disabled.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let entered = Instant::now();
        let mut split = MoeSplit {
            calls: 1,
            ..MoeSplit::default()
        };
        let (width, inter) = (self.shape.width, self.shape.inter);
        let t_len = routes.len();
        let k = routes.iter().map(|r| r.experts.len()).max().unwrap_or(0);
        // Expert -> tokens that chose it (BTreeMap: experts in id order).
        let mut users: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (t, r) in routes.iter().enumerate() {
            for &e in &r.experts {
                users.entry(e).or_default().push(t);
            }
        }
        let ids: Vec<usize> = users.keys().copied().collect();
        let mut pair0 = HashMap::new();
        let mut pair_row = Vec::new();
        for (&e, rows) in &users {
            pair0.insert(e, pair_row.len());
            pair_row.extend(rows.iter().map(|&t| t as i32));
        }
        let n_pairs = pair_row.len();
        let mut tok_pair = vec![-1i32; t_len * k];
        let mut tok_w = vec![0.0f32; t_len * k];
        for (t, r) in routes.iter().enumerate() {
            for (j, (&e, &w)) in r.experts.iter().zip(&r.weights).enumerate() {
                let rank = users[&e].iter().position(|&u| u == t).unwrap_or(0);
                tok_pair[t * k + j] = (pair0[&e] + rank) as i32;
                tok_w[t * k + j] = w;
            }
        }

        let gpu = &self.gpu;
        let mut st = self.lock()?;
        self.ensure_pool(&mut st)?;
        let capacity = st.entries.len();
        let zd = gpu.upload(z).map_err(cuda_err)?;
        let rows_d = gpu.upload(&pair_row).map_err(cuda_err)?;
        let mut act = gpu.zeros::<f32>(n_pairs * inter).map_err(cuda_err)?;
        let mut y = gpu.zeros::<f32>(n_pairs * width).map_err(cuda_err)?;
        let mut overlap = Some(overlap);
        let mut overlap_out = None;
        // Experts uploaded in place stay held until the download below has waited for every kernel (and so for
        // every upload the kernels waited for).
        let mut holds = Vec::new();
        // DMA timers used so far in this call.
        let mut timed = 0usize;
        // When the last chunk's helper was done (the start of `MoeSplit::finish`; chunks run one after another, so
        // every chunk's reads and queuing come before it).
        let mut finish_from: Option<Instant> = None;
        for chunk in ids.chunks(capacity) {
            // Slots for this chunk: hits first, then room for the misses.
            let mut slots = Vec::with_capacity(chunk.len());
            let mut misses = Vec::new();
            for &e in chunk {
                let key = (layer, e);
                if let Some(&s) = st.map.get(&key) {
                    st.stats.hits += 1;
                    st.touch(s);
                    slots.push(s);
                } else {
                    let s = st.victim().ok_or_else(|| {
                        ModelError::Device("gpu expert cache: no free slot".to_string())
                    })?;
                    if let Some(old) = st.entries[s].key.take() {
                        st.map.remove(&old);
                        st.stats.evictions += 1;
                    }
                    st.entries[s] = Entry::default();
                    st.stats.misses += 1;
                    st.touch(s);
                    slots.push(s);
                    misses.push((e, s));
                }
            }
            // Uploads into evicted slots must wait for kernels already queued that read them.
            gpu.copy_stream()
                .join(gpu.stream())
                .map_err(|e| ModelError::Device(format!("cuda: ordering uploads: {e}")))?;
            let started = Instant::now();
            let state = &mut *st;
            let pool = state
                .pool
                .as_mut()
                .ok_or_else(|| ModelError::Device("gpu expert cache pool missing".to_string()))?;
            let staging = &mut state.staging;
            let timers = &mut state.dma_timers;
            let (uploaded, overlap_result) = std::thread::scope(|scope| {
                let to = UploadTargets {
                    pool,
                    staging,
                    timers,
                    first_timer: timed,
                };
                let helper = scope.spawn(|| self.upload(layer, &misses, source, to));
                let o = overlap.take().map(|f| {
                    let t = Instant::now();
                    let r = f();
                    split.overlap += t.elapsed().as_secs_f64();
                    r
                });
                let u = helper.join().unwrap_or_else(|_| {
                    Err(ModelError::Device(
                        "expert upload thread panicked".to_string(),
                    ))
                });
                (u, o)
            });
            let helper_done = Instant::now();
            if let Some(o) = overlap_result {
                overlap_out = Some(o?);
            }
            let uploaded = match uploaded {
                Ok(Some(u)) => u,
                Ok(None) => {
                    // Not MXFP4: forget the slots we claimed and let the CPU path run.
                    for &(_, s) in &misses {
                        st.entries[s] = Entry::default();
                    }
                    st.entries.iter_mut().for_each(|e| e.pinned = false);
                    self.disabled.store(true, Ordering::Relaxed);
                    return Ok(None);
                }
                Err(e) => {
                    for &(_, s) in &misses {
                        st.entries[s] = Entry::default();
                    }
                    st.entries.iter_mut().for_each(|e| e.pinned = false);
                    return Err(e);
                }
            };
            for &(e, s) in &misses {
                st.entries[s].key = Some((layer, e));
                st.map.insert((layer, e), s);
            }
            split.reads += uploaded.reads_secs;
            split.queue += uploaded.queue_secs;
            finish_from = Some(helper_done);
            st.stats.uploaded_bytes += uploaded.bytes;
            st.stats.uploaded_direct_bytes += uploaded.direct_bytes;
            st.stats.upload_secs += started.elapsed().as_secs_f64();
            if let Some(ev) = &uploaded.done {
                gpu.stream()
                    .wait(ev)
                    .map_err(|e| ModelError::Device(format!("cuda: waiting for uploads: {e}")))?;
            }
            holds.push(uploaded.held);
            timed += uploaded.timed;
            let pool = st
                .pool
                .as_ref()
                .ok_or_else(|| ModelError::Device("gpu expert cache pool missing".to_string()))?;
            let base = device_address(gpu.stream(), pool);
            let refs: Vec<SlotRef> = chunk
                .iter()
                .zip(&slots)
                .map(|(e, &s)| SlotRef {
                    ptrs: self.ptrs(base + (s * self.slot_bytes) as u64),
                    pair0: pair0[e],
                    n_rows: users[e].len(),
                })
                .collect();
            moe::run_experts(gpu, &self.shape, &refs, &rows_d, &zd, &mut act, &mut y)
                .map_err(cuda_err)?;
            for &s in &slots {
                st.entries[s].pinned = false;
            }
        }
        let out = moe::combine(gpu, &y, &tok_pair, &tok_w, t_len, k, width).map_err(cuda_err)?;
        let mut combined = gpu.download(&out).map_err(cuda_err)?;
        drop(holds);
        let mut dma = 0.0;
        for t in &st.dma_timers[..timed] {
            dma += t.elapsed().map_err(cuda_err)?.as_secs_f64();
        }
        st.stats.upload_dma_secs += dma;
        let now = Instant::now();
        split.finish += finish_from.map_or(0.0, |t| (now - t).as_secs_f64());
        split.total += (now - entered).as_secs_f64();
        st.stats.split.add(&split);
        combined.truncate(t_len * width);
        drop(st);
        let overlap_out = match (overlap_out, overlap) {
            (Some(o), _) => o,
            (None, Some(f)) => f()?,
            (None, None) => {
                return Err(ModelError::Device("overlap work was lost".to_string()));
            }
        };
        Ok(Some((combined, overlap_out)))
    }

    fn ptrs(&self, base: u64) -> ExpertPtrs {
        let at = |i: usize| base + self.offsets[i] as u64;
        ExpertPtrs {
            w1: at(0),
            s1: at(1),
            w2: at(2),
            s2: at(3),
            w3: at(4),
            s3: at(5),
        }
    }

    /// Reads `misses` from `source` and queues their uploads into their slots on the upload stream. `Ok(None)`
    /// when the experts are not MXFP4.
    fn upload(
        &self,
        layer: usize,
        misses: &[(usize, usize)],
        source: &dyn ExpertSource,
        to: UploadTargets<'_>,
    ) -> Result<Option<Uploaded>> {
        let UploadTargets {
            pool,
            staging,
            timers,
            first_timer,
        } = to;
        let gpu = &self.gpu;
        let copy = gpu.copy_stream();
        let mut held = DmaHold {
            copy: Arc::clone(copy),
            held: Vec::new(),
        };
        if misses.is_empty() {
            return Ok(Some(Uploaded {
                done: None,
                bytes: 0,
                timed: 0,
                direct_bytes: 0,
                held,
                reads_secs: 0.0,
                queue_secs: 0.0,
            }));
        }
        gpu.bind().map_err(cuda_err)?;
        let ids: Vec<usize> = misses.iter().map(|&(e, _)| e).collect();
        let dev_err = |what: &str, e: cudarc::driver::DriverError| {
            ModelError::Device(format!("cuda: {what}: {e}"))
        };
        let mut bytes = 0u64;
        let mut direct_bytes = 0u64;
        let mut staged = 0usize;
        let mut timed = 0usize;
        let mut mxfp4 = true;
        // Each expert goes into a staging buffer and up as soon as its read lands, while the source reads the next.
        let mut queue_experts = |ready: Vec<(usize, Arc<ExpertWeights>)>| -> Result<()> {
            for (i, w) in ready {
                let ExpertWeights::Mxfp4(p) = &*w else {
                    mxfp4 = false;
                    return Ok(());
                };
                let &(e, slot) = misses.get(i).ok_or_else(|| {
                    ModelError::Device(format!(
                        "expert source handed over position {i} of {}",
                        misses.len()
                    ))
                })?;
                let bad = |msg: String| ModelError::BadWeight {
                    name: format!("layer {layer} expert {e}"),
                    msg,
                };
                for (k, r) in p.parts.iter().enumerate() {
                    if r.len() != self.lens[k] || r.end > p.bytes.len() {
                        return Err(bad(format!(
                            "tensor {k} has {} bytes, the config implies {}",
                            r.len(),
                            self.lens[k]
                        )));
                    }
                }
                let off = slot * self.slot_bytes;
                while timers.len() <= first_timer + timed {
                    timers.push(StreamTimer::new(gpu).map_err(cuda_err)?);
                }
                let timer = &timers[first_timer + timed];
                timed += 1;
                if gpu.is_pinned(&p.bytes) {
                    // Straight from the read buffer, in as few copies as the layouts allow.
                    timer.start_on(copy).map_err(cuda_err)?;
                    for (k, len) in self.contiguous_runs(&p.parts) {
                        let src = &p.bytes[p.parts[k].start..p.parts[k].start + len];
                        let dst = off + self.offsets[k];
                        let mut view = pool.slice_mut(dst..dst + len);
                        copy.memcpy_htod(src, &mut view)
                            .map_err(|err| dev_err("expert upload", err))?;
                    }
                    timer.stop_on(copy).map_err(cuda_err)?;
                    held.held.push(Arc::clone(&w));
                    bytes += self.slot_bytes as u64;
                    direct_bytes += self.slot_bytes as u64;
                    continue;
                }
                let stage = &mut staging[staged % staging.len()];
                staged += 1;
                if let Some(ev) = stage.done.take() {
                    ev.synchronize()
                        .map_err(|err| dev_err("waiting for a staging buffer", err))?;
                }
                let dst = stage
                    .buf
                    .as_mut_slice()
                    .map_err(|err| dev_err("staging buffer", err))?;
                // Split the slot into its six tensors (each at its aligned offset) and copy them in parallel pieces.
                let mut pieces: Vec<(&[u8], &mut [u8])> = Vec::new();
                let mut rest: &mut [u8] = dst;
                let mut consumed = 0;
                for (k, r) in p.parts.iter().enumerate() {
                    let (_, tail) = rest.split_at_mut(self.offsets[k] - consumed);
                    let (part, tail) = tail.split_at_mut(self.lens[k]);
                    consumed = self.offsets[k] + self.lens[k];
                    rest = tail;
                    let src = &p.bytes[r.clone()];
                    for (s, d) in src.chunks(COPY_PIECE).zip(part.chunks_mut(COPY_PIECE)) {
                        pieces.push((s, d));
                    }
                }
                pieces
                    .into_par_iter()
                    .for_each(|(s, d)| d.copy_from_slice(s));
                let mut view = pool.slice_mut(off..off + self.slot_bytes);
                timer.start_on(copy).map_err(cuda_err)?;
                copy.memcpy_htod(&stage.buf, &mut view)
                    .map_err(|err| dev_err("expert upload", err))?;
                timer.stop_on(copy).map_err(cuda_err)?;
                stage.done = Some(
                    copy.record_event(None)
                        .map_err(|err| dev_err("recording an upload", err))?,
                );
                bytes += self.slot_bytes as u64;
            }
            Ok(())
        };
        let (started, mut queue_secs) = (Instant::now(), 0.0);
        source.for_each_expert(layer, &ids, &mut |ready| {
            let landed = Instant::now();
            let queued = queue_experts(ready);
            queue_secs += landed.elapsed().as_secs_f64();
            queued
        })?;
        let reads_secs = started.elapsed().as_secs_f64() - queue_secs;
        if !mxfp4 {
            return Ok(None);
        }
        let done = copy
            .record_event(None)
            .map_err(|err| dev_err("recording the uploads", err))?;
        Ok(Some(Uploaded {
            done: Some(done),
            bytes,
            timed,
            direct_bytes,
            held,
            reads_secs,
            queue_secs,
        }))
    }

    /// The copies that move an expert's six tensors (at `parts` of its span) into a slot: `(first tensor, bytes)`
    /// for each run of tensors whose gaps in the span equal their gaps in the slot, so one copy moves the whole run
    /// (K3's six tensors lie back to back in both: one copy).
    fn contiguous_runs(&self, parts: &[std::ops::Range<usize>; 6]) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for k in 0..6 {
            let joins = runs.last().is_some_and(|&(first, _)| {
                parts[k].start >= parts[first].start
                    && parts[k].start - parts[first].start == self.offsets[k] - self.offsets[first]
            });
            match runs.last_mut() {
                Some((first, len)) if joins => {
                    *len = self.offsets[k] - self.offsets[*first] + self.lens[k]
                }
                _ => runs.push((k, self.lens[k])),
            }
        }
        runs
    }
}
