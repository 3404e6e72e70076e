//! The expert store: the model's [`ExpertSource`] over the checkpoint files. Routed experts come from the RAM cache
//! ([`crate::expert_cache`]) or through storage's span reader (read pool on a full install, sparse cache plus range
//! requests on a streaming one), with optional look-ahead prefetch ([`crate::prefetch`]).

use std::sync::{Arc, Mutex};

use deltafin_model::weights::OnExperts;
use deltafin_model::{
    ExpertBytes, ExpertFetch, ExpertSource, ExpertWeights, ModelError, PackedExpert,
};
use deltafin_storage::{
    ExpertFormat, ExpertMap, ExpertSpan, Missing, ReaderStats, SpanBytes, SpanKey, SpanReader,
    SpanRequest, StorageError,
};

use crate::convert::to_f32;
use crate::error::RuntimeError;
use crate::expert_cache::{CacheStats, ExpertCache};
use crate::prefetch::{Claim, PrefetchState, PrefetchStats};

/// Everything the expert store counts, for the end-of-run report.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// The RAM cache's hits, misses and size.
    pub cache: CacheStats,
    /// Disk reads (read pool) and network fetches.
    pub reader: ReaderStats,
    /// Look-ahead prefetch, when it is on.
    pub prefetch: Option<PrefetchStats>,
}

impl std::fmt::Display for ExpertStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.cache;
        let d = &self.reader.disk;
        write!(
            f,
            "expert cache: {} hits, {} misses ({:.1}% hit rate), {} evictions, {:.1} of {:.1} MiB held; \
             disk: {} reads, {:.1} MiB, {:.3} s waiting",
            c.hits,
            c.misses,
            100.0 * c.hit_rate(),
            c.evictions,
            c.bytes as f64 / MIB,
            c.budget as f64 / MIB,
            d.reads,
            d.bytes as f64 / MIB,
            d.wait_ns as f64 / 1e9,
        )?;
        if let Some(p) = &self.prefetch {
            write!(
                f,
                "; prefetch: {} guesses, recall {:.1}%, {} reads ({} used, {} wasted)",
                p.guesses,
                100.0 * p.recall(),
                p.reads,
                p.used,
                p.wasted
            )?;
        }
        if self.reader.fetched_spans > 0 || self.reader.corrupt_spans > 0 {
            write!(
                f,
                "; network: {} spans fetched, {} corrupt cached spans refetched",
                self.reader.fetched_spans, self.reader.corrupt_spans
            )?;
        }
        Ok(())
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// Routed experts: RAM cache first, then one read (local disk) or one range request (streaming install)
/// per missing expert, a layer's misses submitted as one batch and decoded as each arrives. With prefetch on, a
/// background thread reads guessed experts of the next layer into the cache ([`crate::prefetch`]).
pub struct ExpertStore {
    core: Arc<StoreCore>,
    prefetcher: Option<Prefetcher>,
}

/// What the store and its prefetch thread share.
struct StoreCore {
    map: Arc<ExpertMap>,
    reader: SpanReader,
    cache: Mutex<ExpertCache>,
    prefetch: PrefetchState,
}

/// The prefetch thread and the queue of guesses it reads.
struct Prefetcher {
    jobs: Option<std::sync::mpsc::Sender<(usize, Vec<usize>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the reads it started.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            // A prefetch thread that panicked has nothing left to clean up.
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for ExpertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("reader", &self.core.reader)
            .field("prefetch", &self.prefetcher.is_some())
            .finish()
    }
}

impl ExpertStore {
    /// A store over `reader` for the experts in `map`, with a RAM cache of `cache_budget` bytes and look-ahead
    /// prefetch when `prefetch` is true.
    pub fn new(
        map: Arc<ExpertMap>,
        reader: SpanReader,
        cache_budget: u64,
        prefetch: bool,
    ) -> Result<Self, RuntimeError> {
        let core = Arc::new(StoreCore {
            map,
            reader,
            cache: Mutex::new(ExpertCache::new(cache_budget)),
            prefetch: PrefetchState::default(),
        });
        let prefetcher = if prefetch {
            let (tx, rx) = std::sync::mpsc::channel::<(usize, Vec<usize>)>();
            let worker = Arc::clone(&core);
            let thread = std::thread::Builder::new()
                .name("deltafin-prefetch".to_string())
                .spawn(move || {
                    for (layer, experts) in rx {
                        worker.read_guessed(layer, &experts);
                    }
                })
                .map_err(|e| {
                    RuntimeError::Usage(format!("cannot start the prefetch thread: {e}"))
                })?;
            Some(Prefetcher {
                jobs: Some(tx),
                thread: Some(thread),
            })
        } else {
            None
        };
        Ok(Self { core, prefetcher })
    }

    /// Counters so far.
    pub fn stats(&self) -> ExpertStats {
        ExpertStats {
            cache: self.core.cache().stats(),
            reader: self.core.reader.stats(),
            prefetch: self.prefetcher.as_ref().map(|_| self.core.prefetch.stats()),
        }
    }

    /// Lends `bytes` of the RAM cache's budget to something else (evicting what no longer fits), or with 0 gives
    /// back whatever was lent.
    pub fn shrink_cache(&self, bytes: u64) {
        self.core.cache().lend(bytes);
    }

    /// Empties the RAM cache (benchmarks that compare cold runs).
    pub fn clear_cache(&self) {
        self.core.cache().clear();
    }

    /// Reads every expert of every MoE layer into the RAM cache, layer by layer, until the cache's byte budget is
    /// reached; returns how many experts it now holds. For benchmarks of compute with every weight resident.
    pub fn warm(&self) -> Result<usize, RuntimeError> {
        let mut layers: Vec<usize> = self.core.map.layers();
        layers.sort_unstable();
        for layer in layers {
            let stats = self.core.cache().stats();
            let (held, budget) = (stats.bytes, stats.budget);
            let experts: Vec<usize> = (0..self.core.map.n_experts(layer)).collect();
            let need: u64 = experts
                .iter()
                .filter_map(|&e| self.core.map.get(layer, e))
                .map(|span| span.len)
                .sum();
            if held + need > budget {
                break;
            }
            ExpertSource::begin(self, layer, &experts)
                .and_then(|fetch| fetch.finish(&mut |_| Ok(())))?;
        }
        Ok(self.core.cache().stats().entries as usize)
    }

    /// The rate at which this store reads experts from local storage, in bytes per second: `spans` experts spread
    /// over every MoE layer (a fixed stride through the expert ids, so most are not in the page cache's way), read
    /// two windows at a time as a layer's misses are, bypassing the RAM cache. The I/O bound of a benchmark is
    /// measured with it, in the same run and through the same read path as the decode it bounds.
    pub fn expert_read_rate(&self, spans: usize) -> Result<f64, RuntimeError> {
        let core = &self.core;
        let mut layers: Vec<usize> = core
            .map
            .layers()
            .into_iter()
            .filter(|&l| core.map.n_experts(l) > 0)
            .collect();
        layers.sort_unstable();
        if layers.is_empty() {
            return Ok(0.0);
        }
        let mut requests = Vec::with_capacity(spans);
        for i in 0..spans {
            let layer = layers[i % layers.len()];
            let n = core.map.n_experts(layer);
            let expert = (i / layers.len() * 7 + i * 13) % n;
            requests.push(core.request(layer, expert, i)?);
        }
        let started = std::time::Instant::now();
        let mut bytes = 0u64;
        let mut pending = std::collections::VecDeque::new();
        let mut windows = requests.chunks(READ_WINDOW);
        for _ in 0..2 {
            if let Some(w) = windows.next() {
                pending.push_back(core.reader.read(w));
            }
        }
        while let Some(batch) = pending.pop_front() {
            if let Some(w) = windows.next() {
                pending.push_back(core.reader.read(w));
            }
            for done in batch {
                bytes += done.result?.len() as u64;
            }
        }
        Ok(bytes as f64 / started.elapsed().as_secs_f64())
    }

    /// Experts not yet local (streaming installs only).
    pub fn missing(&self) -> Option<Missing> {
        self.core.reader.stream().map(|s| s.missing_experts(None))
    }
}

impl StoreCore {
    fn cache(&self) -> std::sync::MutexGuard<'_, ExpertCache> {
        // The cache's maps stay consistent between statements; a panic elsewhere does not poison them.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request(
        &self,
        layer: usize,
        expert: usize,
        tag: usize,
    ) -> Result<SpanRequest, RuntimeError> {
        let span = self.map.span(layer, expert)?;
        Ok(SpanRequest {
            tag,
            key: SpanKey {
                shard: span.shard,
                offset: span.offset,
                len: span.len,
            },
        })
    }

    /// The prefetch thread's job: reads `experts` of `layer` (already marked in flight) for their layer.
    fn read_guessed(&self, layer: usize, experts: &[usize]) {
        let mut requests = Vec::with_capacity(experts.len());
        for (i, &e) in experts.iter().enumerate() {
            match self.request(layer, e, i) {
                Ok(r) => requests.push(r),
                Err(_) => self.prefetch.finish(layer, e, None),
            }
        }
        for done in self.reader.read(&requests) {
            let e = experts[done.tag];
            let weights = done
                .result
                .map_err(RuntimeError::from)
                .and_then(|bytes| decode(self.map.span(layer, e)?, bytes));
            let weights = match weights {
                Ok(w) => Some(Arc::new(w)),
                // The layer will read it itself when it asks.
                Err(err) => {
                    tracing::debug!(layer, expert = e, error = %err, "prefetch read failed");
                    None
                }
            };
            self.prefetch.finish(layer, e, weights);
        }
    }

    /// Starts the reads of `experts` missing from the cache (the first two windows go out now); the returned
    /// fetch hands over cache hits first, then experts the prefetcher is still reading, then the reads in the
    /// order they complete.
    fn start(&self, layer: usize, experts: &[usize]) -> Result<StoreFetch<'_>, RuntimeError> {
        let mut requests = Vec::new();
        let mut hits = Vec::new();
        let mut awaited = Vec::new();
        {
            let mut cache = self.cache();
            for (i, &e) in experts.iter().enumerate() {
                match cache.get(layer, e) {
                    Some(w) => hits.push((i, w)),
                    // A miss the prefetcher already read (or is reading): it joins the cache like any miss.
                    None => match self.prefetch.claim(layer, e) {
                        Claim::Landed(w) => {
                            cache.insert(layer, e, Arc::clone(&w));
                            hits.push((i, w));
                        }
                        Claim::Pending => awaited.push(i),
                        Claim::Nothing => requests.push(self.request(layer, e, i)?),
                    },
                }
            }
        }
        // Scored after the claims: until then the guess is outstanding, so a read landing meanwhile is kept.
        self.prefetch.score(layer, experts);
        // At most two windows of reads are outstanding, which bounds the buffers waiting for the multiplier (a
        // prefill chunk can need every expert of a layer) while the disk always has the next window queued.
        let mut fetch = StoreFetch {
            store: self,
            layer,
            experts: experts.to_vec(),
            hits,
            awaited,
            requests,
            next_window: 0,
            in_flight: std::collections::VecDeque::with_capacity(2),
        };
        fetch.submit_next();
        fetch.submit_next();
        Ok(fetch)
    }
}

/// Reads started by [`ExpertStore::start`].
struct StoreFetch<'s> {
    store: &'s StoreCore,
    layer: usize,
    experts: Vec<usize>,
    hits: Vec<(usize, Arc<ExpertWeights>)>,
    /// Positions of experts the prefetcher is reading (queued before this layer's own reads).
    awaited: Vec<usize>,
    requests: Vec<SpanRequest>,
    /// Index in `requests` of the next window to submit.
    next_window: usize,
    in_flight: std::collections::VecDeque<deltafin_storage::SpanBatch<'s>>,
}

impl StoreFetch<'_> {
    fn submit_next(&mut self) {
        if self.next_window < self.requests.len() {
            let end = (self.next_window + READ_WINDOW).min(self.requests.len());
            let batch = self
                .store
                .reader
                .read(&self.requests[self.next_window..end]);
            self.in_flight.push_back(batch);
            self.next_window = end;
        }
    }

    /// Calls `on_expert` with all the hits at once, then with each read as it completes, keeping the next
    /// window queued.
    fn run(mut self, on_expert: &mut OnExperts<'_>) -> Result<(), StreamError> {
        let hits = std::mem::take(&mut self.hits);
        if !hits.is_empty() {
            on_expert(hits).map_err(StreamError::Model)?;
        }
        let mut unfilled = Vec::new();
        for i in std::mem::take(&mut self.awaited) {
            let e = self.experts[i];
            self.store.prefetch.wait(self.layer, e);
            match self.store.prefetch.take_landed(self.layer, e) {
                Some(w) => {
                    self.store.cache().insert(self.layer, e, Arc::clone(&w));
                    on_expert(vec![(i, w)]).map_err(StreamError::Model)?
                }
                None => unfilled.push(self.store.request(self.layer, e, i)?),
            }
        }
        // A prefetch that failed is read here like any miss.
        if !unfilled.is_empty() {
            self.requests.extend(unfilled);
            if self.in_flight.len() < 2 {
                self.submit_next();
            }
        }
        while let Some(mut batch) = self.in_flight.pop_front() {
            self.submit_next();
            // Each wait hands over the read that ended it and every other one of the window that has landed
            // meanwhile, in one call: when the multiplier lags the disk, experts are multiplied several at a time
            // (one threaded job for all of them) instead of one by one.
            while let Some(first) = batch.next() {
                let mut ready = Vec::new();
                let mut done = Some(first);
                while let Some(read) = done {
                    let e = self.experts[read.tag];
                    let weights =
                        Arc::new(decode(self.store.map.span(self.layer, e)?, read.result?)?);
                    self.store
                        .cache()
                        .insert(self.layer, e, Arc::clone(&weights));
                    ready.push((read.tag, weights));
                    done = batch.try_next();
                }
                on_expert(ready).map_err(StreamError::Model)?;
            }
        }
        Ok(())
    }
}

impl ExpertFetch for StoreFetch<'_> {
    fn finish(self: Box<Self>, on_expert: &mut OnExperts<'_>) -> deltafin_model::Result<()> {
        self.run(on_expert).map_err(StreamError::into_model)
    }
}

/// Expert reads per submission window (two windows are outstanding at a time).
pub(crate) const READ_WINDOW: usize = 8;

/// A failure while streaming experts: from storage/decoding, or from the caller's callback.
enum StreamError {
    Runtime(RuntimeError),
    Model(ModelError),
}

impl<E: Into<RuntimeError>> From<E> for StreamError {
    fn from(e: E) -> Self {
        StreamError::Runtime(e.into())
    }
}

impl StreamError {
    fn into_model(self) -> ModelError {
        match self {
            StreamError::Runtime(e) => ModelError::Source(Box::new(e)),
            StreamError::Model(e) => e,
        }
    }
}

/// Turns an expert span's bytes into weights: MXFP4 stays packed, dense parts become f32.
fn decode(span: &ExpertSpan, bytes: SpanBytes) -> Result<ExpertWeights, RuntimeError> {
    let (layer, expert) = (span.layer, span.expert);
    let range = |i: usize| {
        let p = &span.parts[i];
        p.rel_offset as usize..(p.rel_offset + p.len) as usize
    };
    match span.format {
        ExpertFormat::Mxfp4 => {
            // Logical [rows, cols] of w1, w2, w3 from the packed parts' stored [rows, cols / 2].
            let shape = |i: usize| {
                let s = &span.parts[2 * i].shape;
                (
                    s.first().copied().unwrap_or(0),
                    2 * s.get(1).copied().unwrap_or(0),
                )
            };
            let packed = PackedExpert::new(
                // The read buffer itself (no copy): it goes back to the pool when the expert leaves the cache.
                ExpertBytes::new(bytes),
                [range(0), range(1), range(2), range(3), range(4), range(5)],
                [shape(0), shape(1), shape(2)],
            )
            .map_err(|source| ModelError::Expert {
                layer,
                expert,
                source,
            })?;
            Ok(ExpertWeights::Mxfp4(packed))
        }
        ExpertFormat::Dense(dtype) => {
            let conv = |i: usize| {
                to_f32(&bytes[range(i)], dtype).ok_or_else(|| RuntimeError::UnsupportedDtype {
                    name: format!("layer {layer} expert {expert}"),
                    dtype: format!("{dtype:?}"),
                })
            };
            Ok(ExpertWeights::Dense {
                w1: conv(0)?,
                w2: conv(1)?,
                w3: conv(2)?,
            })
        }
    }
}

impl ExpertSource for ExpertStore {
    fn load_experts(
        &self,
        layer: usize,
        experts: &[usize],
    ) -> deltafin_model::Result<Vec<Arc<ExpertWeights>>> {
        let mut out: Vec<Option<Arc<ExpertWeights>>> = vec![None; experts.len()];
        self.for_each_expert(layer, experts, &mut |ready| {
            for (i, w) in ready {
                out[i] = Some(w);
            }
            Ok(())
        })?;
        out.into_iter()
            .zip(experts)
            .map(|(w, &e)| {
                w.ok_or_else(|| {
                    ModelError::Source(Box::new(RuntimeError::Storage(
                        StorageError::NoSuchExpert { layer, expert: e },
                    )))
                })
            })
            .collect()
    }

    fn for_each_expert(
        &self,
        layer: usize,
        experts: &[usize],
        on_expert: &mut OnExperts<'_>,
    ) -> deltafin_model::Result<()> {
        self.begin(layer, experts)?.finish(on_expert)
    }

    fn begin<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
    ) -> deltafin_model::Result<Box<dyn ExpertFetch + 's>> {
        match self.core.start(layer, experts) {
            Ok(fetch) => Ok(Box::new(fetch)),
            Err(e) => Err(ModelError::Source(Box::new(e))),
        }
    }

    fn wants_prefetch(&self) -> bool {
        self.prefetcher.is_some()
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) -> deltafin_model::Result<()> {
        let Some(jobs) = self.prefetcher.as_ref().and_then(|p| p.jobs.as_ref()) else {
            return Ok(());
        };
        let to_read: Vec<usize> = {
            let cache = self.core.cache();
            experts
                .iter()
                .copied()
                .filter(|&e| !cache.contains(layer, e) && !self.core.prefetch.is_pending(layer, e))
                .collect()
        };
        self.core.prefetch.record_guess(layer, experts, &to_read);
        if !to_read.is_empty() && jobs.send((layer, to_read.clone())).is_err() {
            // The thread is gone: nothing will land, so nobody may wait for these.
            for e in to_read {
                self.core.prefetch.finish(layer, e, None);
            }
        }
        Ok(())
    }
}
