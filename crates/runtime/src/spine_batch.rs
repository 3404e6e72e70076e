//! Reads a whole decoder layer's spine tensors at once: one submission to a direct-I/O read pool, several reads in
//! flight, instead of one buffered read per tensor as the model asks for them. The streamed spine loader builds
//! a layer tensor by tensor; the first request of a layer brings in all of it, and the rest are served from
//! memory.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use deltafin_storage::{
    ModelFiles, PoolFile, ReadPool, ReadPoolOptions, ReadRequest, SpanBytes, StorageError,
    TensorInfo,
};

/// Reads in flight for spine layers (beside the expert reads).
const SPINE_READ_THREADS: usize = 4;
/// Idle I/O buffers kept for reuse (a layer has a few dozen tensors; most are small).
const SPINE_IDLE_BUFFERS: usize = 8;

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
    /// A reader over `files` (and the int8 copy, when in use) for the layers listed in `layers`.
    pub fn new(
        files: &ModelFiles,
        int8: Option<&ModelFiles>,
        layers: HashMap<String, Vec<Stored>>,
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

    fn state(&self) -> MutexGuard<'_, ReadAhead> {
        // Plain maps, consistent between statements even if a holder panicked.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes of `t` (a tensor of layer `prefix`): from the read-ahead when its layer was read in one batch,
    /// else by reading the whole layer now. `None` when the tensor is not one this reader batches (the caller
    /// then reads it alone), or when it was already served once for this layer.
    pub fn take(&self, prefix: &str, t: &Stored) -> Result<Option<SpanBytes>, StorageError> {
        let key = (t.origin, t.info.name.clone());
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
        // A new layer: drop what is left of the previous one and read this one whole.
        st.ready.clear();
        st.served.clear();
        st.prefix = Some(prefix.to_string());
        drop(st);
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
        let mut ready = HashMap::with_capacity(tensors.len());
        for done in self.pool.submit(requests) {
            let s = &tensors[done.tag];
            ready.insert((s.origin, s.info.name.clone()), done.result?);
        }
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
