//! Reads a whole decoder layer's spine tensors at once: one submission to a direct-I/O read pool, several reads in
//! flight, instead of one buffered read per tensor as the model asks for them. The streamed spine loader builds
//! a layer tensor by tensor; the first request of a layer brings in all of it, and the rest are served from
//! memory. Meanwhile the next streamed layers' batches are already being read (after the last streamed layer, the
//! first ones, for the next forward pass), so the disk does not wait for a pass to start.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex, MutexGuard};

use deltafin_storage::{
    ModelFiles, PoolFile, ReadPool, ReadPoolOptions, ReadRequest, SpanBytes, SpanRead,
    StorageError, TensorInfo,
};

/// Reads in flight for spine layers (beside the expert reads).
const SPINE_READ_THREADS: usize = 8;
/// Streamed layers whose batches are read ahead of the one being built. One: with the layer computing and the
/// built one waiting for it, three streamed layers are in memory at once (the weights are used in the buffers they
/// were read into, so a layer has no second copy); the engine charges that to the memory budget.
pub(crate) const READ_AHEAD_LAYERS: usize = 1;
/// Layers read ahead while the model loads (the order is read once): each one read early is one the load keeps
/// (resident on the CPU; on a GPU uploaded and its buffers reused), so it costs no memory the plan does not count.
const OPEN_READ_AHEAD_LAYERS: usize = 2;
/// Idle I/O buffers kept for reuse: a whole layer's tensors (a few dozen), so a finished layer's buffers take the
/// next read instead of fresh pages, which the kernel would have to zero first.
const SPINE_IDLE_BUFFERS: usize = 48;

/// Which file set a tensor lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Origin {
    /// The model's shards.
    Shards,
    /// The int8 spine copy.
    Int8,
}

/// A stored tensor to read: where it lives and its header entry.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub origin: Origin,
    pub info: TensorInfo,
}

/// The batch reader and what it has read ahead of the requests.
pub(crate) struct LayerReader {
    pool: ReadPool,
    shards: Vec<Arc<PoolFile>>,
    int8: Vec<Arc<PoolFile>>,
    /// Layer prefix (`…layers.N.`) → its stored spine tensors.
    layers: HashMap<String, Vec<Stored>>,
    state: Mutex<ReadAhead>,
}

/// Tensors read with their layer but not yet asked for, and those of the current layer already served.
#[derive(Default)]
struct ReadAhead {
    ready: HashMap<(Origin, String), SpanBytes>,
    prefix: Option<String>,
    served: HashSet<(Origin, String)>,
    /// The layers' prefixes in the order they are asked for (set by the engine).
    order: Vec<String>,
    /// Whether the order repeats (forward passes: after the last layer, the first), or is read once (open).
    cyclic: bool,
    /// The next streamed layers' batches in flight, in order: prefix and where the completions arrive.
    next: VecDeque<(String, Receiver<SpanRead>)>,
}

/// The layer prefix of a tensor name (`model.layers.12.self_attn.q_proj.weight` → `model.layers.12.`).
pub(crate) fn layer_prefix(name: &str) -> Option<&str> {
    let at = name.find("layers.")? + "layers.".len();
    let digits = name[at..].bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || name.as_bytes().get(at + digits) != Some(&b'.') {
        return None;
    }
    Some(&name[..at + digits + 1])
}

impl LayerReader {
    /// A reader over `files` (and the int8 copy, when in use) for the layers listed in `layers`; `buffer_hook` hears
    /// of its I/O buffers (on a GPU they are page-locked, so tensors go up straight from where they were read).
    pub fn new(
        files: &ModelFiles,
        int8: Option<&ModelFiles>,
        layers: HashMap<String, Vec<Stored>>,
        buffer_hook: Option<Arc<dyn deltafin_storage::BufferHook>>,
    ) -> Result<Self, StorageError> {
        let open = |f: &ModelFiles| -> Result<Vec<Arc<PoolFile>>, StorageError> {
            f.shards()
                .iter()
                .map(|s| PoolFile::open(&s.path, true).map(Arc::new))
                .collect()
        };
        Ok(Self {
            pool: ReadPool::new(&ReadPoolOptions {
                threads: SPINE_READ_THREADS,
                max_idle_buffers: SPINE_IDLE_BUFFERS,
                buffer_hook,
                piece_bytes: deltafin_storage::PIECE_BYTES,
            })?,
            shards: open(files)?,
            int8: match int8 {
                Some(f) => open(f)?,
                None => Vec::new(),
            },
            layers,
            state: Mutex::new(ReadAhead::default()),
        })
    }

    /// The counters of the reader's pool: among them the time callers waited for its reads (the batches of
    /// [`Self::take`] and [`Self::read_one`]) and the buffers it mapped (each one pages the kernel had to zero first).
    pub fn pool_stats(&self) -> deltafin_storage::ReadStats {
        self.pool.stats()
    }

    /// Unmaps the pool's idle buffers (see [`deltafin_storage::ReadPool::release_idle_buffers`]).
    pub fn release_idle_buffers(&self) {
        self.pool.release_idle_buffers();
    }

    /// The stored spine tensors of the decoder layer with tensor prefix `prefix` (none for a prefix it does not
    /// know).
    pub fn tensors(&self, prefix: &str) -> &[Stored] {
        self.layers.get(prefix).map_or(&[], Vec::as_slice)
    }

    /// One tensor that belongs to no decoder layer (the head, the embedding, the final norm) read alone with direct
    /// I/O, into a pool buffer on huge pages that the weight then uses in place.
    pub fn read_one(&self, origin: Origin, info: &TensorInfo) -> Result<SpanBytes, StorageError> {
        let stored = [Stored {
            origin,
            info: info.clone(),
        }];
        let mut batch = self.pool.submit(self.requests(&stored)?);
        match batch.next() {
            Some(done) => done.result,
            None => Err(StorageError::Io {
                path: std::path::PathBuf::from("<spine read pool>"),
                source: std::io::Error::other("the read pool stopped"),
            }),
        }
    }

    /// The layers read in this order from now on (the resident ones once while the model loads, then the streamed
    /// ones at every forward pass, `cyclic`): while one is built, the next one's batch is already being read (and,
    /// when cyclic, after the last the first, for the next pass).
    pub fn set_order(&self, prefixes: Vec<String>, cyclic: bool) {
        let mut st = self.state();
        st.order = prefixes;
        st.cyclic = cyclic;
        st.next.clear();
    }

    /// The read requests of a layer's tensors.
    fn requests(&self, tensors: &[Stored]) -> Result<Vec<ReadRequest>, StorageError> {
        let mut requests = Vec::with_capacity(tensors.len());
        for (tag, s) in tensors.iter().enumerate() {
            let files = match s.origin {
                Origin::Shards => &self.shards,
                Origin::Int8 => &self.int8,
            };
            let Some(file) = files.get(s.info.shard) else {
                return Err(StorageError::OutOfRange {
                    what: format!(
                        "the spine files (shard {} of {})",
                        s.info.shard,
                        files.len()
                    ),
                    offset: s.info.offset,
                    len: s.info.len,
                });
            };
            requests.push(ReadRequest {
                tag,
                file: Arc::clone(file),
                offset: s.info.offset,
                len: s.info.len,
                expect_crc: None,
            });
        }
        Ok(requests)
    }

    /// Starts reading the [`READ_AHEAD_LAYERS`] streamed layers after `prefix` (in `order`, wrapping around) that
    /// are not in flight yet.
    fn read_ahead(&self, st: &mut ReadAhead, prefix: &str) -> Result<(), StorageError> {
        let Some(pos) = st.order.iter().position(|p| p == prefix) else {
            return Ok(());
        };
        let depth = if st.cyclic {
            READ_AHEAD_LAYERS
        } else {
            OPEN_READ_AHEAD_LAYERS
        };
        for ahead in 1..=depth {
            if !st.cyclic && pos + ahead >= st.order.len() {
                break;
            }
            let next = st.order[(pos + ahead) % st.order.len()].clone();
            if next == prefix {
                break;
            }
            if st.next.iter().any(|(p, _)| *p == next) {
                continue;
            }
            let Some(tensors) = self.layers.get(&next) else {
                continue;
            };
            let (tx, rx) = channel();
            self.pool.submit_to(self.requests(tensors)?, &tx);
            st.next.push_back((next, rx));
        }
        Ok(())
    }

    fn state(&self) -> MutexGuard<'_, ReadAhead> {
        // Plain maps, consistent between statements even if a holder panicked.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes of tensor `name` in `origin` (a tensor of layer `prefix`): from the read-ahead when its layer was read in one batch,
    /// else by reading the whole layer now. `None` when the tensor is not one this reader batches (the caller
    /// then reads it alone), or when it was already served once for this layer.
    pub fn take(
        &self,
        prefix: &str,
        origin: Origin,
        name: &str,
    ) -> Result<Option<SpanBytes>, StorageError> {
        let key = (origin, name.to_string());
        let mut st = self.state();
        if let Some(b) = st.ready.remove(&key) {
            st.served.insert(key);
            return Ok(Some(b));
        }
        let Some(tensors) = self.layers.get(prefix) else {
            return Ok(None);
        };
        if st.prefix.as_deref() == Some(prefix) && st.served.contains(&key) {
            // Asked for twice while building one layer: read alone rather than the whole layer again.
            return Ok(None);
        }
        // A new layer: drop what is left of the previous one and read this one whole (or collect the read
        // started while the previous layer was built), then start reading the layer after it.
        st.ready.clear();
        st.served.clear();
        st.prefix = Some(prefix.to_string());
        let in_flight = match st.next.pop_front() {
            Some((p, rx)) if p == prefix => Some(rx),
            // Reads ahead that were not needed (the order changed): their buffers are dropped as they complete.
            _ => {
                st.next.clear();
                None
            }
        };
        self.read_ahead(&mut st, prefix)?;
        drop(st);
        let rx = match in_flight {
            Some(rx) => rx,
            None => {
                let (tx, rx) = channel();
                self.pool.submit_to(self.requests(tensors)?, &tx);
                rx
            }
        };
        let mut ready = HashMap::with_capacity(tensors.len());
        let started = std::time::Instant::now();
        for _ in 0..tensors.len() {
            let done = rx.recv().map_err(|_| StorageError::Io {
                path: std::path::PathBuf::from("<spine read pool>"),
                source: std::io::Error::other("the read pool stopped"),
            })?;
            let s = &tensors[done.tag];
            ready.insert((s.origin, s.info.name.clone()), done.result?);
        }
        self.pool.add_wait(started.elapsed());
        let mut st = self.state();
        st.ready = ready;
        let got = st.ready.remove(&key);
        st.served.insert(key);
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_prefixes() {
        assert_eq!(
            layer_prefix("language_model.model.layers.12.self_attn.q_proj.weight"),
            Some("language_model.model.layers.12.")
        );
        assert_eq!(
            layer_prefix("model.layers.0.mlp.gate.weight"),
            Some("model.layers.0.")
        );
        assert_eq!(layer_prefix("model.embed_tokens.weight"), None);
        assert_eq!(layer_prefix("model.layers.x.foo"), None);
        assert_eq!(layer_prefix("model.layers.3"), None);
    }
}
