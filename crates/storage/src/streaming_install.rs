//! Streaming installs and the span reader that serves expert bytes from a full or a streaming install.
//!
//! A streaming install is a model directory whose small files (config, tokenizer, index) are whole and
//! whose shards are sparse files at their original length: every header and every non-expert tensor (the
//! spine) is present, experts arrive on demand. `.deltafin/install.json` says which repository and
//! revision it mirrors; `.deltafin/spans.log` is the manifest of verified spans ([`SpanManifest`]).
//!
//! [`SpanReader`] is what the runtime asks for expert bytes. On a full install it reads shard files with
//! the [`ReadPool`]. On a streaming install it reads recorded spans from the sparse files through the
//! same pool, checking each span's CRC in the worker, and fetches the others with one range request per
//! span; a span that fails its CRC is forgotten and fetched again. Either way the caller gets the bytes
//! exactly as they are in the original shard.

use std::collections::{HashMap, HashSet};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};
use crate::experts::ExpertMap;
use crate::files::ModelFiles;
use crate::header::MAX_HEADER_LEN;
use crate::index::{INDEX_FILE, read_index};
use crate::read_pool::{
    PoolFile, ReadPool, ReadPoolOptions, ReadRequest, ReadStats, SpanBytes, SpanRead,
};
use crate::remote::{Hub, HubClient, HubOptions, RepoRef};
use crate::span_cache::{SpanKey, SpanManifest, ensure_sparse_file, write_span_durably};

/// Directory inside a model directory that holds deltafin's own install files.
pub const STATE_DIR: &str = ".deltafin";
/// The install description inside [`STATE_DIR`].
pub const INSTALL_FILE: &str = "install.json";
/// The span manifest inside [`STATE_DIR`].
pub const MANIFEST_FILE: &str = "spans.log";
/// The record of the last full verification of the spine inside [`STATE_DIR`]: a digest of the spine spans and
/// their checksums as they were when every one of them was read back and matched.
pub const SPINE_VERIFIED_FILE: &str = "spine-verified";
/// File name of a single-file (unsharded) checkpoint.
const SINGLE_FILE: &str = "model.safetensors";
/// Spine runs longer than this are fetched as several spans, so a retry never repeats much.
pub const MAX_SPINE_SPAN: u64 = 256 << 20;

/// How a model directory was installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstallMode {
    /// Every file whole.
    Full,
    /// Spine local, experts on demand.
    Stream,
}

/// `.deltafin/install.json`: what a model directory mirrors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstallInfo {
    /// Full or streaming.
    pub mode: InstallMode,
    /// `owner/name` on the hub.
    pub repo: String,
    /// The revision asked for (branch, tag or commit).
    pub revision: String,
    /// The endpoint used at setup (a mirror, if `HF_ENDPOINT` was set then).
    pub endpoint: String,
    /// The commit `revision` resolved to at setup (from the hub's `X-Repo-Commit`); every later request
    /// asks for this commit, so a branch moving on cannot mix two revisions' bytes in one install.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// True once every file (full) or every header and spine span (stream) is in place.
    pub complete: bool,
}

impl InstallInfo {
    /// Reads `dir/.deltafin/install.json`; `Ok(None)` when there is none (a plain directory).
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(STATE_DIR).join(INSTALL_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| StorageError::Install {
                        dir: dir.to_path_buf(),
                        reason: format!("{} is not valid: {e}", path.display()),
                    })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StorageError::Io { path, source }),
        }
    }

    /// Writes `dir/.deltafin/install.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let state = dir.join(STATE_DIR);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StorageError::Io { path, source }
        };
        std::fs::create_dir_all(&state).map_err(io(&state))?;
        let path = state.join(INSTALL_FILE);
        let tmp = state.join("install.json.tmp");
        let json = serde_json::to_vec_pretty(self).map_err(|e| StorageError::Install {
            dir: dir.to_path_buf(),
            reason: format!("cannot encode install.json: {e}"),
        })?;
        std::fs::write(&tmp, json).map_err(io(&tmp))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        crate::span_cache::fsync_dir(&state)
    }

    /// The repository reference, with the endpoint resolved against `opts` and the environment.
    pub fn repo_ref(&self, opts: &HubOptions) -> RepoRef {
        RepoRef {
            endpoint: opts.resolve_endpoint(Some(&self.endpoint)),
            repo: self.repo.clone(),
            revision: self.commit.clone().unwrap_or_else(|| self.revision.clone()),
        }
    }
}

/// Whether `dir` is a streaming install (per its install file).
pub fn is_stream_install(dir: &Path) -> Result<bool> {
    Ok(InstallInfo::read(dir)?.is_some_and(|i| i.mode == InstallMode::Stream))
}

/// The shard file names of the checkpoint in `dir`, in shard order (validated: relative, no `..`).
pub(crate) fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        Ok(read_index(&index)?.shard_names)
    } else {
        Ok(vec![SINGLE_FILE.to_string()])
    }
}

/// The spine of a checkpoint as spans: maximal runs of adjacent non-expert tensor bytes per shard (split
/// at [`MAX_SPINE_SPAN`]), in file order. Headers are not included (see [`header_span`]).
pub fn spine_spans(files: &ModelFiles, map: &ExpertMap) -> Vec<SpanKey> {
    let mut experts: Vec<(usize, u64, u64)> = Vec::new();
    for layer in map.layers() {
        for e in 0..map.n_experts(layer) {
            if let Some(s) = map.get(layer, e) {
                experts.push((s.shard, s.offset, s.offset + s.len));
            }
        }
    }
    experts.sort_unstable();
    let in_expert = |shard: usize, offset: u64| {
        let i = experts.partition_point(|&(s, o, _)| (s, o) <= (shard, offset));
        i > 0 && {
            let (s, _, end) = experts[i - 1];
            s == shard && offset < end
        }
    };
    let mut out: Vec<SpanKey> = Vec::new();
    for t in files.tensors() {
        if t.len == 0 || in_expert(t.shard, t.offset) {
            continue;
        }
        match out.last_mut() {
            Some(cur)
                if cur.shard == t.shard
                    && cur.offset + cur.len == t.offset
                    && cur.len + t.len <= MAX_SPINE_SPAN =>
            {
                cur.len += t.len;
            }
            _ => out.push(SpanKey {
                shard: t.shard,
                offset: t.offset,
                len: t.len,
            }),
        }
    }
    // A single tensor longer than the cap is cut into cap-sized pieces.
    out.into_iter()
        .flat_map(|s| {
            let pieces = s.len.div_ceil(MAX_SPINE_SPAN).max(1);
            (0..pieces).map(move |i| {
                let offset = s.offset + i * MAX_SPINE_SPAN;
                SpanKey {
                    shard: s.shard,
                    offset,
                    len: (s.offset + s.len - offset).min(MAX_SPINE_SPAN),
                }
            })
        })
        .collect()
}

/// The header span of a shard: its length prefix and JSON, `0..data_start`.
pub fn header_span(files: &ModelFiles, shard: usize) -> Option<SpanKey> {
    files.shards().get(shard).map(|s| SpanKey {
        shard,
        offset: 0,
        len: s.data_start,
    })
}

/// Missing experts of a streaming install.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Missing {
    /// Experts not in the cache.
    pub experts: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// What a task that fetches spans needs; cheap to clone into tasks.
#[derive(Clone)]
struct FetchCtx {
    client: HubClient,
    manifest: Arc<SpanManifest>,
    names: Arc<Vec<String>>,
    paths: Arc<Vec<PathBuf>>,
    lens: Arc<Vec<u64>>,
}

impl FetchCtx {
    /// Fetches one span, checks it against the shard's known length, writes it durably and records it.
    async fn fetch(self, key: SpanKey) -> Result<Vec<u8>> {
        let name = &self.names[key.shard];
        let body = self
            .client
            .get_range_async(name, key.offset, key.len)
            .await?;
        if let Some(total) = body.total
            && total != self.lens[key.shard]
        {
            return Err(StorageError::Http {
                url: self.client.repo().url(name),
                range: format!(" (bytes {}-{})", key.offset, key.offset + key.len - 1),
                reason: format!(
                    "the remote file has {total} bytes but the install expects {}; did the revision change?",
                    self.lens[key.shard]
                ),
            });
        }
        let path = self.paths[key.shard].clone();
        let manifest = Arc::clone(&self.manifest);
        let joined = tokio::task::spawn_blocking(move || -> Result<Vec<u8>> {
            let crc = crc32fast::hash(&body.bytes);
            write_span_durably(&path, key.offset, &body.bytes)?;
            manifest.record(key, crc)?;
            Ok(body.bytes)
        })
        .await;
        joined.map_err(|e| StorageError::Manifest {
            path: self.manifest.path().to_path_buf(),
            reason: format!("writer task failed: {e}"),
        })?
    }
}

/// An opened streaming install: headers and spine verified present, experts fetched on demand.
pub struct StreamInstall {
    dir: PathBuf,
    info: InstallInfo,
    hub: Hub,
    ctx: FetchCtx,
    files: Arc<ModelFiles>,
    map: Arc<ExpertMap>,
    fetched: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for StreamInstall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamInstall")
            .field("dir", &self.dir)
            .field("info", &self.info)
            .finish()
    }
}

/// Reports progress of long operations: bytes done, with a total set up front.
pub trait Progress: Sync {
    /// A new phase with `total` bytes to go.
    fn start(&self, label: &str, total: u64);
    /// `bytes` more done.
    fn advance(&self, bytes: u64);
    /// The phase is over.
    fn finish(&self);
}

/// Progress that nobody watches.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _label: &str, _total: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

impl StreamInstall {
    /// Opens the streaming install in `dir`: fetches any header or spine span that is missing (an
    /// interrupted setup resumes here), verifies the CRC of every spine span already present, then
    /// opens the checkpoint and maps its experts.
    pub fn open(dir: &Path, opts: &HubOptions, progress: &dyn Progress) -> Result<Self> {
        let install_err = |reason: String| StorageError::Install {
            dir: dir.to_path_buf(),
            reason,
        };
        let info = InstallInfo::read(dir)?.ok_or_else(|| {
            install_err("no .deltafin/install.json: not a streaming install".to_string())
        })?;
        if info.mode != InstallMode::Stream {
            return Err(install_err(
                "install.json says this is a full install".to_string(),
            ));
        }
        let hub = Hub::new(info.repo_ref(opts), opts)?;
        let manifest = Arc::new(SpanManifest::open(
            &dir.join(STATE_DIR).join(MANIFEST_FILE),
        )?);
        let names = shard_names(dir)?;
        let paths: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
        // Headers first: nothing else can be known without them.
        let mut lens = Vec::with_capacity(names.len());
        for (shard, (name, path)) in names.iter().zip(&paths).enumerate() {
            lens.push(ensure_header(&hub, &manifest, shard, name, path)?);
        }
        let files = Arc::new(ModelFiles::open(dir)?);
        let map = Arc::new(ExpertMap::build(&files)?);
        let ctx = FetchCtx {
            client: hub.client().clone(),
            manifest,
            names: Arc::new(names),
            paths: Arc::new(paths),
            lens: Arc::new(lens),
        };
        let this = Self {
            dir: dir.to_path_buf(),
            info,
            hub,
            ctx,
            files,
            map,
            fetched: std::sync::atomic::AtomicU64::new(0),
        };
        this.ensure_spine(progress)?;
        Ok(this)
    }

    /// Verifies every recorded spine span and fetches the rest, once: after a verification in which every spine
    /// span was present and matched its checksum, [`SPINE_VERIFIED_FILE`] records the spans and checksums, and a
    /// later open with the same ones skips reading the spine back (114 GB at K3's size). Any span fetched or
    /// forgotten since changes the digest and brings the full verification back; deleting the file forces one.
    fn ensure_spine(&self, progress: &dyn Progress) -> Result<()> {
        let spine = spine_spans(&self.files, &self.map);
        let marker = self.dir.join(STATE_DIR).join(SPINE_VERIFIED_FILE);
        let digest = self.spine_digest(&spine);
        if digest.is_some() && std::fs::read_to_string(&marker).ok().as_deref() == digest.as_deref()
        {
            return Ok(());
        }
        let mut missing = Vec::new();
        let mut buf = Vec::new();
        for &key in &spine {
            let Some(crc) = self.ctx.manifest.crc_of(key) else {
                missing.push(key);
                continue;
            };
            buf.resize(key.len as usize, 0);
            self.files
                .read_span(key.shard, key.offset, key.len, &mut buf)?;
            if crc32fast::hash(&buf) != crc {
                tracing::warn!(
                    path = %self.ctx.paths[key.shard].display(),
                    offset = key.offset,
                    len = key.len,
                    "cached spine span fails its checksum; fetching it again"
                );
                self.ctx.manifest.forget(key);
                missing.push(key);
            }
        }
        if !missing.is_empty() {
            self.fetch_all(&missing, "spine", progress)?;
        }
        if let Some(digest) = self.spine_digest(&spine) {
            let tmp = marker.with_extension("tmp");
            let write = std::fs::write(&tmp, digest).and_then(|()| std::fs::rename(&tmp, &marker));
            if let Err(e) = write {
                // Only the next open's shortcut is lost: it verifies again.
                tracing::warn!(path = %marker.display(), error = %e, "cannot record the spine verification");
            }
        }
        Ok(())
    }

    /// A digest of every spine span with its recorded checksum, or `None` while any span is not recorded.
    fn spine_digest(&self, spine: &[SpanKey]) -> Option<String> {
        let mut h = crc32fast::Hasher::new();
        for key in spine {
            let crc = self.ctx.manifest.crc_of(*key)?;
            for v in [key.shard as u64, key.offset, key.len, crc as u64] {
                h.update(&v.to_le_bytes());
            }
        }
        Some(format!(
            "{} spans, digest {:08x}\n",
            spine.len(),
            h.finalize()
        ))
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the install mirrors.
    pub fn info(&self) -> &InstallInfo {
        &self.info
    }

    /// The opened checkpoint (sparse shard files).
    pub fn files(&self) -> &Arc<ModelFiles> {
        &self.files
    }

    /// The expert map.
    pub fn map(&self) -> &Arc<ExpertMap> {
        &self.map
    }

    /// The span manifest.
    pub fn manifest(&self) -> &SpanManifest {
        &self.ctx.manifest
    }

    /// Spans fetched over the network since open (by this process).
    pub fn fetched_spans(&self) -> u64 {
        self.fetched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The expert spans of `layers` (all MoE layers when `None`) that are not in the cache.
    pub fn missing_expert_spans(&self, layers: Option<&RangeInclusive<usize>>) -> Vec<SpanKey> {
        let mut out = Vec::new();
        for layer in self.map.layers() {
            if layers.is_some_and(|r| !r.contains(&layer)) {
                continue;
            }
            for e in 0..self.map.n_experts(layer) {
                if let Some(s) = self.map.get(layer, e) {
                    let key = SpanKey {
                        shard: s.shard,
                        offset: s.offset,
                        len: s.len,
                    };
                    if !self.ctx.manifest.contains(key) {
                        out.push(key);
                    }
                }
            }
        }
        out
    }

    /// How many experts (and bytes) of `layers` are not in the cache yet.
    pub fn missing_experts(&self, layers: Option<&RangeInclusive<usize>>) -> Missing {
        let spans = self.missing_expert_spans(layers);
        Missing {
            experts: spans.len() as u64,
            bytes: spans.iter().map(|s| s.len).sum(),
        }
    }

    /// Fetches `spans` with several requests in flight, recording each as it lands. Keeps going past
    /// failures and reports the first one at the end (spans fetched before it stay recorded).
    pub fn fetch_all(&self, spans: &[SpanKey], label: &str, progress: &dyn Progress) -> Result<()> {
        progress.start(label, spans.iter().map(|s| s.len).sum());
        let (tx, rx) = channel();
        for (tag, &key) in spans.iter().enumerate() {
            self.spawn_fetch(tag, key, tx.clone());
        }
        drop(tx);
        let mut first_err = None;
        let mut failed = 0usize;
        for done in rx {
            match done.result {
                Ok(bytes) => progress.advance(bytes.len() as u64),
                Err(e) => {
                    failed += 1;
                    first_err.get_or_insert(e);
                }
            }
        }
        progress.finish();
        match first_err {
            None => Ok(()),
            Some(e) => {
                tracing::error!(failed, of = spans.len(), "some spans could not be fetched");
                Err(e)
            }
        }
    }

    /// Starts fetching one span; its completion (owned bytes) goes to `reply` with `tag`.
    fn spawn_fetch(&self, tag: usize, key: SpanKey, reply: Sender<SpanRead>) {
        self.fetched
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ctx = self.ctx.clone();
        self.hub.runtime().spawn(async move {
            let result = ctx.fetch(key).await.map(SpanBytes::Owned);
            // The reader may have stopped listening (an earlier error); the span is recorded anyway.
            let _ = reply.send(SpanRead { tag, result });
        });
    }
}

/// Makes sure shard `shard`'s sparse file exists with its header recorded; returns the file length.
fn ensure_header(
    hub: &Hub,
    manifest: &SpanManifest,
    shard: usize,
    name: &str,
    path: &Path,
) -> Result<u64> {
    // Already there and intact?
    if let Ok(file) = std::fs::File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut prefix = [0u8; 8];
        if crate::pread::read_exact_at(&file, &mut prefix, 0).is_ok() {
            let n = u64::from_le_bytes(prefix);
            if n <= MAX_HEADER_LEN && 8 + n <= len {
                let key = SpanKey {
                    shard,
                    offset: 0,
                    len: 8 + n,
                };
                if let Some(crc) = manifest.crc_of(key) {
                    let mut bytes = vec![0u8; key.len as usize];
                    if crate::pread::read_exact_at(&file, &mut bytes, 0).is_ok()
                        && crc32fast::hash(&bytes) == crc
                    {
                        return Ok(len);
                    }
                    manifest.forget(key);
                }
            }
        }
    }
    let prefix = hub.get_range(name, 0, 8)?;
    let url = || hub.repo().url(name);
    let total = prefix.total.ok_or_else(|| StorageError::Http {
        url: url(),
        range: " (bytes 0-7)".to_string(),
        reason: "content-range does not give the file length".to_string(),
    })?;
    let n =
        u64::from_le_bytes(
            prefix
                .bytes
                .as_slice()
                .try_into()
                .map_err(|_| StorageError::Http {
                    url: url(),
                    range: " (bytes 0-7)".to_string(),
                    reason: "header prefix is not 8 bytes".to_string(),
                })?,
        );
    if n > MAX_HEADER_LEN || 8 + n > total {
        return Err(StorageError::TruncatedHeader {
            path: path.to_path_buf(),
            needed: 8u64.saturating_add(n),
            file_len: total,
        });
    }
    let json = hub.get_range(name, 8, n)?;
    if ensure_sparse_file(path, total)? {
        manifest.forget_shard(shard)?;
    }
    let mut bytes = prefix.bytes;
    bytes.extend_from_slice(&json.bytes);
    write_span_durably(path, 0, &bytes)?;
    manifest.record(
        SpanKey {
            shard,
            offset: 0,
            len: bytes.len() as u64,
        },
        crc32fast::hash(&bytes),
    )?;
    Ok(total)
}

/// One span to read, with the caller's tag.
#[derive(Clone, Copy, Debug)]
pub struct SpanRequest {
    /// Returned with the completion.
    pub tag: usize,
    /// The span.
    pub key: SpanKey,
}

/// Counters of a [`SpanReader`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderStats {
    /// The read pool's counters (local disk).
    pub disk: ReadStats,
    /// Spans fetched over the network.
    pub fetched_spans: u64,
    /// Cached spans that failed their checksum and were fetched again.
    pub corrupt_spans: u64,
}

/// Serves spans from a full install (read pool) or a streaming install (read pool + hub).
pub struct SpanReader {
    pool: ReadPool,
    files: Vec<Arc<PoolFile>>,
    stream: Option<StreamInstall>,
    corrupt: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SpanReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanReader")
            .field("pool", &self.pool)
            .field("stream", &self.stream)
            .finish()
    }
}

impl SpanReader {
    /// A reader over the shard files of `files`, bypassing the page cache when `direct` is true.
    pub fn new(
        files: &ModelFiles,
        stream: Option<StreamInstall>,
        pool: &ReadPoolOptions,
        direct: bool,
    ) -> Result<Self> {
        let handles = files
            .shards()
            .iter()
            .map(|s| PoolFile::open(&s.path, direct).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            pool: ReadPool::new(pool)?,
            files: handles,
            stream,
            corrupt: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The streaming install, if this reader serves one.
    pub fn stream(&self) -> Option<&StreamInstall> {
        self.stream.as_ref()
    }

    /// Counters so far.
    pub fn stats(&self) -> ReaderStats {
        ReaderStats {
            disk: self.pool.stats(),
            fetched_spans: self.stream.as_ref().map_or(0, StreamInstall::fetched_spans),
            corrupt_spans: self.corrupt.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Starts reading `requests` (one batch, e.g. a layer's experts); completions arrive in the order
    /// they finish.
    pub fn read(&self, requests: &[SpanRequest]) -> SpanBatch<'_> {
        let (tx, rx) = channel();
        let mut local = Vec::new();
        let mut keys = HashMap::new();
        for r in requests {
            keys.insert(r.tag, r.key);
            let Some(file) = self.files.get(r.key.shard) else {
                let _ = tx.send(SpanRead {
                    tag: r.tag,
                    result: Err(StorageError::OutOfRange {
                        what: format!("the model (shard {} of {})", r.key.shard, self.files.len()),
                        offset: r.key.offset,
                        len: r.key.len,
                    }),
                });
                continue;
            };
            let expect_crc = match &self.stream {
                None => None,
                Some(s) => match s.manifest().crc_of(r.key) {
                    Some(crc) => Some(crc),
                    None => {
                        s.spawn_fetch(r.tag, r.key, tx.clone());
                        continue;
                    }
                },
            };
            local.push(ReadRequest {
                tag: r.tag,
                file: Arc::clone(file),
                offset: r.key.offset,
                len: r.key.len,
                expect_crc,
            });
        }
        self.pool.submit_to(local, &tx);
        SpanBatch {
            reader: self,
            rx,
            tx,
            remaining: requests.len(),
            keys,
            refetched: HashSet::new(),
        }
    }
}

/// The completions of one [`SpanReader::read`].
pub struct SpanBatch<'r> {
    reader: &'r SpanReader,
    rx: Receiver<SpanRead>,
    tx: Sender<SpanRead>,
    remaining: usize,
    keys: HashMap<usize, SpanKey>,
    refetched: HashSet<usize>,
}

impl SpanBatch<'_> {
    /// The next completion if one has already arrived, without waiting (a corrupt cached span is sent for again
    /// as in [`Iterator::next`], and does not count as arrived).
    pub fn try_next(&mut self) -> Option<SpanRead> {
        self.take(false)
    }

    /// The next completion; waits for one when `wait`, else only takes one that has arrived.
    fn take(&mut self, wait: bool) -> Option<SpanRead> {
        loop {
            if self.remaining == 0 {
                return None;
            }
            let read = if wait {
                let start = Instant::now();
                let got = self.rx.recv().ok();
                self.reader.pool.add_wait(start.elapsed());
                got?
            } else {
                self.rx.try_recv().ok()?
            };
            if let (Err(StorageError::CorruptSpan { path, reason, .. }), Some(stream)) =
                (&read.result, &self.reader.stream)
                && let Some(&key) = self.keys.get(&read.tag)
                && self.refetched.insert(read.tag)
            {
                tracing::warn!(
                    path = %path.display(),
                    offset = key.offset,
                    len = key.len,
                    reason = %reason,
                    "cached span is corrupt; fetching it again"
                );
                self.reader
                    .corrupt
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                stream.manifest().forget(key);
                stream.spawn_fetch(read.tag, key, self.tx.clone());
                continue;
            }
            self.remaining -= 1;
            return Some(read);
        }
    }
}

impl Iterator for SpanBatch<'_> {
    type Item = SpanRead;

    fn next(&mut self) -> Option<SpanRead> {
        self.take(true)
    }
}
