//! The spine (every dense weight): read from the shards, or from the row-wise int8 copy written by
//! [`convert_spine_int8`] when `K3_SPINE` asks for it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use deltafin_model::{HostTensor, ModelError, WeightSource};
use deltafin_quant::{DenseData, DenseMatrix};
use deltafin_storage::{
    Dtype, ModelFiles, PlannedTensor, Progress, SpanBytes, TensorInfo, write_safetensors,
};

use crate::convert::{dense_data, dense_data_in_place, int8_in_place, to_f32};
use crate::error::{Result, RuntimeError};
use crate::spine_batch::{LayerReader, Origin, Stored, layer_prefix};

/// File name of the int8 spine copy, next to the model's shards.
pub const INT8_SPINE_FILE: &str = "spine-int8.safetensors";
/// Suffix of a quantised weight in the int8 file.
const QWEIGHT: &str = ".qweight";
/// Suffix of its per-row scales.
const ROW_SCALE: &str = ".row_scale";
/// Narrower matrices are kept as they are (vectors, AttnRes projections, tiny ranks).
const MIN_INT8_COLS: usize = 32;

/// Which precision the spine is kept in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpineMode {
    /// As stored (bf16 in K3): exact.
    Bf16,
    /// The row-wise int8 copy (about half the bytes; lossy).
    Int8,
    /// int8 when the copy exists and the bf16 spine would not fit in the memory budget, else bf16.
    Auto,
}

impl SpineMode {
    /// Parses `bf16`, `int8` or `auto`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "int8" => Ok(Self::Int8),
            "auto" => Ok(Self::Auto),
            other => Err(RuntimeError::Usage(format!(
                "K3_SPINE must be bf16, int8 or auto, got `{other}`"
            ))),
        }
    }
}

/// `K3_SPINE=auto`: the int8 copy when it exists and the spine as stored (`stored_bytes`) is larger than the memory
/// budget, else the stored spine.
pub fn auto_uses_int8(copy_exists: bool, stored_bytes: u64, budget_bytes: Option<u64>) -> bool {
    copy_exists && budget_bytes.is_some_and(|b| stored_bytes > b)
}

/// Whether a checkpoint tensor is a dense spine matrix that gets an int8 copy.
fn quantisable(name: &str, shape: &[usize], dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F32 | Dtype::F16)
        && shape.len() == 2
        && shape[0] > 1
        && shape[1] >= MIN_INT8_COLS
        && !name.contains(".experts.")
        && !name.ends_with("embed_tokens.weight")
}

/// What [`convert_spine_int8`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Int8Report {
    /// The file written.
    pub path: PathBuf,
    /// Matrices converted.
    pub tensors: usize,
    /// Their bytes in the checkpoint.
    pub bytes_in: u64,
    /// Bytes of the int8 copy (values and scales).
    pub bytes_out: u64,
}

/// Writes the row-wise int8 copy of every dense 2-D spine matrix of the model in `dir` to
/// `dir/spine-int8.safetensors` (`NAME.qweight` int8 `[rows, cols]`, `NAME.row_scale` f32 `[rows]`).
pub fn convert_spine_int8(dir: &Path) -> Result<Int8Report> {
    let files = ModelFiles::open(dir)?;
    let sources: Vec<_> = files
        .tensors()
        .filter(|t| quantisable(&t.name, &t.shape, t.dtype))
        .cloned()
        .collect();
    let mut plan = Vec::with_capacity(sources.len() * 2);
    for t in &sources {
        plan.push(PlannedTensor {
            name: format!("{}{QWEIGHT}", t.name),
            dtype: Dtype::I8,
            shape: t.shape.clone(),
        });
        plan.push(PlannedTensor {
            name: format!("{}{ROW_SCALE}", t.name),
            dtype: Dtype::F32,
            shape: vec![t.shape[0]],
        });
    }
    let path = dir.join(INT8_SPINE_FILE);
    let mut current: Option<(Vec<i8>, Vec<f32>)> = None;
    let bytes_out = write_safetensors(&path, &plan, |i| {
        let t = &sources[i / 2];
        if i % 2 == 0 {
            let raw = files.read_tensor(t)?;
            let data = dense_data(&raw, t.dtype).unwrap_or(DenseData::F32(Vec::new()));
            let m = DenseMatrix::new(t.shape[0], t.shape[1], data).map_err(|e| {
                deltafin_storage::StorageError::Io {
                    path: PathBuf::from(&t.name),
                    source: std::io::Error::other(e.to_string()),
                }
            })?;
            let (q, scales) = match m.to_int8().data() {
                DenseData::Int8 { q, scales } => (q.to_vec(), scales.clone()),
                _ => (Vec::new(), Vec::new()),
            };
            let bytes = q.iter().map(|&v| v as u8).collect();
            current = Some((q, scales));
            Ok(bytes)
        } else {
            let scales = current.take().map(|c| c.1).unwrap_or_default();
            Ok(scales.iter().flat_map(|s| s.to_le_bytes()).collect())
        }
    })?;
    Ok(Int8Report {
        path,
        tensors: sources.len(),
        bytes_in: sources.iter().map(|t| t.len).sum(),
        bytes_out,
    })
}

/// Dense weights for the model: from the int8 copy where it has the tensor (when enabled), else the shards.
/// Counts the bytes it reads, so a streamed spine shows up in the engine's byte counters.
pub struct SpineSource {
    files: Arc<ModelFiles>,
    int8: Option<ModelFiles>,
    stored_bytes: u64,
    read_bytes: AtomicU64,
    reads: AtomicU64,
    /// The layer reader's wait counter (`ReadStats::wait_ns`) when the read counters were last reset.
    wait_base_ns: AtomicU64,
    /// Told every spine byte read while set (the progress of an open).
    progress: std::sync::Mutex<Option<Arc<dyn Progress + Send>>>,
    /// Reads a decoder layer's tensors in one direct-I/O batch (for the streamed spine and the load at open).
    layers: LayerReader,
    /// Bytes served per decoder layer prefix, and for the whole spine (each a scan of every tensor's name, which at
    /// K3's half a million expert tensors takes tens of milliseconds: done once here).
    layer_served: HashMap<String, u64>,
    total_served: u64,
    /// The host tier: tensors of the layers [`Self::keep_layers`] read once and keeps, in the buffers they were read
    /// into (page-locked on a GPU, so every pass uploads them from there), by stored name (the int8 copy's names
    /// carry suffixes, so no shard tensor shares one). Served without a read; never dropped while the source lives.
    kept: RwLock<HashMap<String, Arc<SpanBytes>>>,
}

/// Bytes of the spine (every non-expert tensor) as stored in the shards.
pub fn spine_bytes(files: &ModelFiles) -> u64 {
    files
        .tensors()
        .filter(|t| !t.name.contains(".experts."))
        .map(|t| t.len)
        .sum()
}

/// Bytes and reads of spine tensors served since open (or the last reset).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpineReadStats {
    /// Bytes read from the shards or the int8 copy.
    pub bytes: u64,
    /// Tensors read (an int8 weight counts its values and its scales as two).
    pub reads: u64,
    /// Seconds the callers were blocked waiting for those reads to land (the layer reader's pool counts them; a layer
    /// read ahead may have landed already).
    pub wait_secs: f64,
    /// I/O buffers the layer reader has mapped since the source was opened (not reset; a pass whose reads all find
    /// a buffer given back adds none).
    pub buffers_allocated: u64,
}

impl SpineSource {
    /// Chooses the spine for `mode`. `budget_bytes` is the memory the spine may use (for `Auto`); `buffer_hook`
    /// hears of the layer reader's I/O buffers (see `LayerReader::new`).
    pub fn open(
        files: Arc<ModelFiles>,
        mode: SpineMode,
        budget_bytes: Option<u64>,
        buffer_hook: Option<Arc<dyn deltafin_storage::BufferHook>>,
    ) -> Result<Self> {
        let path = files.dir().join(INT8_SPINE_FILE);
        let stored_bytes = spine_bytes(&files);
        let use_int8 = match mode {
            SpineMode::Bf16 => false,
            SpineMode::Int8 => {
                if !path.is_file() {
                    return Err(RuntimeError::Usage(format!(
                        "K3_SPINE=int8 but {} does not exist: run `cargo xtask convert-spine-int8 --model {}`",
                        path.display(),
                        files.dir().display()
                    )));
                }
                true
            }
            SpineMode::Auto => auto_uses_int8(path.is_file(), stored_bytes, budget_bytes),
        };
        let int8 = if use_int8 {
            Some(ModelFiles::open_file(&path)?)
        } else {
            None
        };
        // One pass over the spine's tensors: each layer's batch, and the bytes served (from the int8 copy where it
        // holds the tensor) per layer and in all.
        let mut by_layer: HashMap<String, Vec<Stored>> = HashMap::new();
        let mut layer_served: HashMap<String, u64> = HashMap::new();
        let mut total_served = 0u64;
        for t in files.tensors().filter(|t| !t.name.contains(".experts.")) {
            let parts = int8.as_ref().and_then(|f| int8_parts_of(f, &t.name));
            let served = parts.map_or(t.len, |(q, sc)| q.len + sc.len);
            total_served += served;
            let Some(prefix) = layer_prefix(&t.name) else {
                continue;
            };
            *layer_served.entry(prefix.to_string()).or_default() += served;
            let stored = by_layer.entry(prefix.to_string()).or_default();
            match parts {
                Some((q, sc)) => {
                    for info in [q, sc] {
                        stored.push(Stored {
                            origin: Origin::Int8,
                            info: info.clone(),
                        });
                    }
                }
                None => stored.push(Stored {
                    origin: Origin::Shards,
                    info: t.clone(),
                }),
            }
        }
        let layers = LayerReader::new(&files, int8.as_ref(), by_layer, buffer_hook)?;
        Ok(Self {
            files,
            int8,
            stored_bytes,
            read_bytes: AtomicU64::new(0),
            progress: std::sync::Mutex::new(None),
            reads: AtomicU64::new(0),
            wait_base_ns: AtomicU64::new(0),
            layers,
            layer_served,
            total_served,
            kept: RwLock::new(HashMap::new()),
        })
    }

    /// Unmaps the layer reader's idle I/O buffers: for a model that streams no layer, the buffers the load read
    /// into (on a GPU, page-locked) are of no further use.
    pub fn release_idle_buffers(&self) {
        self.layers.release_idle_buffers();
    }

    /// Bytes of the spine as stored in the shards (bf16), whichever copy is served.
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// Whether the int8 copy is in use.
    pub fn is_int8(&self) -> bool {
        self.int8.is_some()
    }

    /// Bytes a [`WeightSource::load`] of every spine tensor whose name starts with `prefix` reads (from the int8
    /// copy where it serves the tensor). `prefix` `""` gives the whole spine as served.
    pub fn served_bytes(&self, prefix: &str) -> u64 {
        if prefix.is_empty() {
            return self.total_served;
        }
        if layer_prefix(prefix) == Some(prefix) {
            return self.layer_served.get(prefix).copied().unwrap_or(0);
        }
        self.files
            .tensors()
            .filter(|t| t.name.starts_with(prefix) && !t.name.contains(".experts."))
            .map(|t| {
                self.int8_parts(&t.name)
                    .map_or(t.len, |(q, s)| q.len + s.len)
            })
            .sum()
    }

    /// Tells the batch reader the order decoder layers will be read in (by their tensor prefixes): the resident
    /// layers once while the model loads, then the streamed ones at every forward pass (`cyclic`). Each layer's
    /// read then starts while the one before it is built.
    pub fn set_order(&self, prefixes: Vec<String>, cyclic: bool) {
        self.layers.set_order(prefixes, cyclic);
    }

    /// Reads the decoder layers with these tensor prefixes now and keeps their bytes for good (the host tier): on a
    /// GPU whose memory holds fewer layers than the host's budget, the layers the GPU streams are then uploaded at
    /// every pass from host memory, page-locked, instead of read from storage again. Returns the bytes kept. The
    /// caller charges them to the memory budget, and leaves these layers out of the streamed order.
    pub fn keep_layers(&self, prefixes: &[String]) -> deltafin_model::Result<u64> {
        self.set_order(prefixes.to_vec(), false);
        let mut kept = 0;
        for prefix in prefixes {
            for s in self.layers.tensors(prefix) {
                let bytes = self.read_stored(s.origin, &s.info)?;
                kept += bytes.len() as u64;
                self.kept_map_mut().insert(s.info.name.clone(), bytes);
            }
        }
        Ok(kept)
    }

    /// Bytes the host tier holds ([`Self::keep_layers`]).
    pub fn kept_bytes(&self) -> u64 {
        self.kept_map().values().map(|b| b.len() as u64).sum()
    }

    fn kept_map(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<SpanBytes>>> {
        // A plain map, consistent between statements even if a holder panicked.
        self.kept.read().unwrap_or_else(|e| e.into_inner())
    }

    fn kept_map_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<SpanBytes>>> {
        self.kept.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes and reads since open or the last [`Self::reset_reads`].
    pub fn read_stats(&self) -> SpineReadStats {
        let pool = self.layers.pool_stats();
        SpineReadStats {
            bytes: self.read_bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            wait_secs: pool
                .wait_ns
                .saturating_sub(self.wait_base_ns.load(Ordering::Relaxed))
                as f64
                * 1e-9,
            buffers_allocated: pool.buffers_allocated,
        }
    }

    /// Zeroes the read counters.
    pub fn reset_reads(&self) {
        self.read_bytes.store(0, Ordering::Relaxed);
        self.reads.store(0, Ordering::Relaxed);
        self.wait_base_ns
            .store(self.layers.pool_stats().wait_ns, Ordering::Relaxed);
    }

    /// The int8 copy's values and scales of `name`, when the int8 copy is in use and has it.
    fn int8_parts(&self, name: &str) -> Option<(&TensorInfo, &TensorInfo)> {
        int8_parts_of(self.int8.as_ref()?, name)
    }

    /// The bytes of a stored tensor: from the host tier when it keeps them (no read), else read with its whole layer
    /// in one batch when it belongs to a decoder layer, or alone.
    fn read_stored(
        &self,
        origin: Origin,
        info: &TensorInfo,
    ) -> deltafin_model::Result<Arc<SpanBytes>> {
        if let Some(b) = self.kept_map().get(&info.name) {
            return Ok(Arc::clone(b));
        }
        let files = match (origin, &self.int8) {
            (Origin::Int8, Some(f)) => f,
            _ => &*self.files,
        };
        // int8 names carry a suffix; the layer prefix is the same.
        let batched = match layer_prefix(&info.name) {
            Some(prefix) => self
                .layers
                .take(prefix, origin, &info.name)
                .map_err(source_err)?,
            None => None,
        };
        let bytes = match batched {
            Some(b) => b,
            // A tensor of no layer (head, embedding, norms) with direct I/O into a huge-page buffer; a filesystem
            // that refuses direct I/O gets the pool's logged buffered fallback.
            None => match self.layers.read_one(origin, info) {
                Ok(b) => b,
                Err(_) => SpanBytes::Owned(files.read_tensor(info).map_err(source_err)?),
            },
        };
        self.count(bytes.len());
        Ok(Arc::new(bytes))
    }

    fn count(&self, bytes: usize) {
        self.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        if let Some(p) = self
            .progress
            .lock()
            .ok()
            .as_deref()
            .and_then(Option::as_ref)
        {
            p.advance(bytes as u64);
        }
    }

    /// Reports every spine byte read to `progress` from now on (`None`: to nobody).
    pub fn set_progress(&self, progress: Option<Arc<dyn Progress + Send>>) {
        if let Ok(mut p) = self.progress.lock() {
            *p = progress;
        }
    }
}

/// The int8 copy's values and scales of `name` in `int8`.
fn int8_parts_of<'f>(int8: &'f ModelFiles, name: &str) -> Option<(&'f TensorInfo, &'f TensorInfo)> {
    Some((
        int8.get(&format!("{name}{QWEIGHT}"))?,
        int8.get(&format!("{name}{ROW_SCALE}"))?,
    ))
}

fn source_err(e: impl std::error::Error + Send + Sync + 'static) -> ModelError {
    ModelError::Source(Box::new(e))
}

impl WeightSource for SpineSource {
    fn load(&self, name: &str) -> deltafin_model::Result<Option<HostTensor>> {
        if let Some((q, s)) = self.int8_parts(name) {
            let qb = self.read_stored(Origin::Int8, q)?;
            let sb = self.read_stored(Origin::Int8, s)?;
            let scales = to_f32(&sb, Dtype::F32).unwrap_or_default();
            return Ok(Some(HostTensor {
                shape: q.shape.clone(),
                data: DenseData::Int8 {
                    q: int8_in_place(qb),
                    scales,
                },
            }));
        }
        let Some(info) = self.files.get(name) else {
            return Ok(None);
        };
        let bytes = self.read_stored(Origin::Shards, info)?;
        let data = dense_data_in_place(bytes, info.dtype).ok_or_else(|| {
            source_err(RuntimeError::UnsupportedDtype {
                name: name.to_string(),
                dtype: info.dtype.to_string(),
            })
        })?;
        Ok(Some(HostTensor {
            shape: info.shape.clone(),
            data,
        }))
    }

    /// From the shard headers: the int8 copy keeps every shape.
    fn shape(&self, name: &str) -> deltafin_model::Result<Option<Vec<usize>>> {
        Ok(self.files.get(name).map(|t| t.shape.clone()))
    }

    /// One positional read per row, from the shards (the int8 copy never holds a table read by rows).
    fn rows_f32(&self, name: &str, rows: &[usize]) -> deltafin_model::Result<Option<Vec<f32>>> {
        let Some(info) = self.files.get(name) else {
            return Ok(None);
        };
        let bad = |msg: String| {
            source_err(RuntimeError::UnsupportedDtype {
                name: name.to_string(),
                dtype: msg,
            })
        };
        let [n, cols] = info.shape[..] else {
            return Err(bad(format!(
                "{} read by rows (shape {:?})",
                info.dtype, info.shape
            )));
        };
        let row_bytes = info.len / n.max(1) as u64;
        let mut out = Vec::with_capacity(rows.len() * cols);
        let mut buf = vec![0u8; row_bytes as usize];
        for &r in rows {
            if r >= n {
                return Err(source_err(RuntimeError::Usage(format!(
                    "{name}: row {r} of {n}"
                ))));
            }
            self.files
                .read_span(
                    info.shard,
                    info.offset + r as u64 * row_bytes,
                    row_bytes,
                    &mut buf,
                )
                .map_err(source_err)?;
            out.extend(to_f32(&buf, info.dtype).ok_or_else(|| bad(info.dtype.to_string()))?);
            self.count(buf.len());
        }
        Ok(Some(out))
    }
}
