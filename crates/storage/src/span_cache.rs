//! The raw-span cache of a streaming install: each shard is a sparse file of its original length holding
//! the bytes fetched so far at their original offsets, and a manifest lists the spans that are complete
//! and verified, each with the CRC-32 of its bytes.
//!
//! A span enters the manifest only after its bytes are durable (`fdatasync` of the shard file), and the
//! manifest record is itself synced, so a crash loses at most the spans in flight. The manifest is an
//! append-only log of fixed-size records (rewriting a whole list per span would cost O(n²) for the
//! ~89,000 experts of K3), each record carrying its own checksum: a torn or damaged record is detected
//! and dropped, and the log is then compacted by writing a temporary file and renaming it over the old
//! one. A manifest that is not a manifest at all is set aside (`.bad`) and the cache starts empty:
//! spans are fetched again rather than trusted.
//!
//! Readers verify a span's CRC before using it (the read pool does it in its workers), so bytes damaged
//! on disk after they were recorded are caught too.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::error::{Result, StorageError};

/// First bytes of a manifest file: magic and format version.
const MAGIC: &[u8; 8] = b"DFSPANS1";
/// Marker at the start of every record.
const RECORD_MAGIC: u32 = 0x5053_4644; // "DFSP" little-endian
/// Bytes per record: magic, shard, offset, len, data crc, record crc.
const RECORD_LEN: usize = 32;

/// A span of one shard file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpanKey {
    /// Index into the shard table (shards sorted by file name, as in [`crate::ModelFiles::shards`]).
    pub shard: usize,
    /// Absolute offset in the shard file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A manifest record: a span and the CRC-32 of its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    key: SpanKey,
    crc: u32,
}

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        out[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&(self.key.shard as u32).to_le_bytes());
        out[8..16].copy_from_slice(&self.key.offset.to_le_bytes());
        out[16..24].copy_from_slice(&self.key.len.to_le_bytes());
        out[24..28].copy_from_slice(&self.crc.to_le_bytes());
        let rec_crc = crc32fast::hash(&out[..28]);
        out[28..32].copy_from_slice(&rec_crc.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let u32_at = |i: usize| {
            b.get(i..i + 4)
                .and_then(|s| s.try_into().ok())
                .map(u32::from_le_bytes)
        };
        let u64_at = |i: usize| {
            b.get(i..i + 8)
                .and_then(|s| s.try_into().ok())
                .map(u64::from_le_bytes)
        };
        if u32_at(0)? != RECORD_MAGIC || u32_at(28)? != crc32fast::hash(b.get(..28)?) {
            return None;
        }
        Some(Record {
            key: SpanKey {
                shard: u32_at(4)? as usize,
                offset: u64_at(8)?,
                len: u64_at(16)?,
            },
            crc: u32_at(24)?,
        })
    }
}

/// What loading a manifest found wrong (for logs and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManifestRepairs {
    /// Records whose checksum or marker was wrong.
    pub damaged_records: usize,
    /// Bytes of a torn last record.
    pub torn_bytes: usize,
    /// The file was not a manifest at all and was set aside.
    pub replaced: bool,
}

struct Inner {
    log: File,
    spans: HashMap<(usize, u64), Record>,
}

/// The manifest of verified spans, shared by every thread that fetches or reads.
pub struct SpanManifest {
    path: PathBuf,
    inner: Mutex<Inner>,
    repairs: ManifestRepairs,
}

impl std::fmt::Debug for SpanManifest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanManifest")
            .field("path", &self.path)
            .field("spans", &self.len())
            .finish()
    }
}

impl SpanManifest {
    /// Opens (or creates) the manifest at `path`, dropping damaged records and compacting if any were
    /// found.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| StorageError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut repairs = ManifestRepairs::default();
        let mut spans = HashMap::new();
        let needs_rewrite;
        match std::fs::read(path) {
            Ok(bytes) if bytes.len() >= MAGIC.len() && &bytes[..MAGIC.len()] == MAGIC => {
                let body = &bytes[MAGIC.len()..];
                let whole = body.len() / RECORD_LEN * RECORD_LEN;
                for chunk in body[..whole].chunks_exact(RECORD_LEN) {
                    match Record::decode(chunk) {
                        Some(r) => {
                            spans.insert((r.key.shard, r.key.offset), r);
                        }
                        None => repairs.damaged_records += 1,
                    }
                }
                repairs.torn_bytes = body.len() - whole;
                needs_rewrite = repairs.damaged_records > 0 || repairs.torn_bytes > 0;
            }
            Ok(bytes) if bytes.is_empty() => needs_rewrite = true,
            Ok(_) => {
                let bad = path.with_extension("bad");
                tracing::warn!(
                    manifest = %path.display(),
                    moved_to = %bad.display(),
                    "span manifest is not a deltafin manifest; starting an empty cache"
                );
                std::fs::rename(path, &bad).map_err(io)?;
                repairs.replaced = true;
                needs_rewrite = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => needs_rewrite = true,
            Err(e) => return Err(io(e)),
        }
        if repairs.damaged_records > 0 || repairs.torn_bytes > 0 {
            tracing::warn!(
                manifest = %path.display(),
                damaged = repairs.damaged_records,
                torn_bytes = repairs.torn_bytes,
                "span manifest had damaged records; they are dropped and those spans will be fetched again"
            );
        }
        if needs_rewrite {
            write_atomically(path, spans.values())?;
        }
        let log = OpenOptions::new().append(true).open(path).map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            inner: Mutex::new(Inner { log, spans }),
            repairs,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The map stays consistent even if a holder panicked between statements.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The manifest file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What was repaired at open.
    pub fn repairs(&self) -> ManifestRepairs {
        self.repairs
    }

    /// Number of recorded spans.
    pub fn len(&self) -> usize {
        self.lock().spans.len()
    }

    /// True when no span is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The recorded CRC of exactly this span, if it is recorded with this length.
    pub fn crc_of(&self, key: SpanKey) -> Option<u32> {
        self.lock()
            .spans
            .get(&(key.shard, key.offset))
            .filter(|r| r.key.len == key.len)
            .map(|r| r.crc)
    }

    /// Whether exactly this span is recorded.
    pub fn contains(&self, key: SpanKey) -> bool {
        self.crc_of(key).is_some()
    }

    /// Appends a record for a span whose bytes are already durable, and syncs the manifest.
    pub fn record(&self, key: SpanKey, crc: u32) -> Result<()> {
        let rec = Record { key, crc };
        let mut inner = self.lock();
        let io = |source| StorageError::Io {
            path: self.path.clone(),
            source,
        };
        inner.log.write_all(&rec.encode()).map_err(io)?;
        inner.log.sync_data().map_err(io)?;
        inner.spans.insert((key.shard, key.offset), rec);
        Ok(())
    }

    /// Forgets a span (its bytes were found corrupt); it will be fetched again. The log keeps the old
    /// record until the new one supersedes it, which is harmless: readers verify before use.
    pub fn forget(&self, key: SpanKey) {
        self.lock().spans.remove(&(key.shard, key.offset));
    }

    /// Forgets every span of `shard` (its file was recreated) and rewrites the manifest without them.
    pub fn forget_shard(&self, shard: usize) -> Result<()> {
        let mut inner = self.lock();
        inner.spans.retain(|&(s, _), _| s != shard);
        write_atomically(&self.path, inner.spans.values())?;
        inner.log = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|source| StorageError::Io {
                path: self.path.clone(),
                source,
            })?;
        Ok(())
    }
}

/// Writes a manifest holding `records` to `path` through a synced temporary file and a rename.
fn write_atomically<'a>(path: &Path, records: impl Iterator<Item = &'a Record>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| StorageError::Io { path: p, source }
    };
    let mut buf = MAGIC.to_vec();
    let mut sorted: Vec<&Record> = records.collect();
    sorted.sort_by_key(|r| r.key);
    for r in sorted {
        buf.extend_from_slice(&r.encode());
    }
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&buf).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    if let Some(dir) = path.parent() {
        fsync_dir(dir)?;
    }
    Ok(())
}

/// Syncs a directory so that a rename or a new file in it survives a crash.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| StorageError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes `bytes` at `offset` of the sparse shard file `path` and makes them durable.
pub(crate) fn write_span_durably(path: &Path, offset: u64, bytes: &[u8]) -> Result<()> {
    let io = |source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new().write(true).open(path).map_err(io)?;
    write_all_at(&file, bytes, offset).map_err(io)?;
    file.sync_data().map_err(io)
}

#[cfg(unix)]
fn write_all_at(file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(buf, offset)
}

#[cfg(windows)]
fn write_all_at(file: &File, mut buf: &[u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        let n = file.seek_write(buf, offset)?;
        buf = &buf[n..];
        offset += n as u64;
    }
    Ok(())
}

/// Makes sure the sparse file for a shard exists with length `len`. Returns true when it was created
/// (or recreated because its length was wrong), in which case nothing in it is valid.
pub(crate) fn ensure_sparse_file(path: &Path, len: u64) -> Result<bool> {
    let io = |source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::metadata(path) {
        Ok(m) if m.len() == len => return Ok(false),
        Ok(m) => tracing::warn!(
            path = %path.display(),
            have = m.len(),
            want = len,
            "cached shard has the wrong length; starting it over"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    // Shard names may contain subdirectories (validated against `..` and absolute paths by the index).
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let f = File::create(path).map_err(io)?;
    f.set_len(len).map_err(io)?;
    f.sync_all().map_err(io)?;
    if let Some(dir) = path.parent() {
        fsync_dir(dir)?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(shard: usize, offset: u64, len: u64) -> SpanKey {
        SpanKey { shard, offset, len }
    }

    #[test]
    fn records_survive_reopen_and_damage_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("spans.log");
        {
            let m = SpanManifest::open(&path).expect("create");
            m.record(key(0, 0, 100), 7).expect("record");
            m.record(key(1, 4096, 10), 9).expect("record");
            m.record(key(2, 8, 3), 11).expect("record");
        }
        // Flip a byte inside the second record and add half a record at the end.
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[MAGIC.len() + RECORD_LEN + 10] ^= 0xff;
        bytes.extend_from_slice(&[1, 2, 3]);
        std::fs::write(&path, &bytes).expect("write");
        let m = SpanManifest::open(&path).expect("reopen");
        assert_eq!(m.repairs().damaged_records, 1);
        assert_eq!(m.repairs().torn_bytes, 3);
        assert_eq!(m.crc_of(key(0, 0, 100)), Some(7));
        assert_eq!(m.crc_of(key(2, 8, 3)), Some(11));
        assert!(!m.contains(key(1, 4096, 10)));
        // A length mismatch is not a hit.
        assert!(!m.contains(key(0, 0, 99)));
        drop(m);
        // Compacted: a third open finds nothing to repair.
        let m = SpanManifest::open(&path).expect("third open");
        assert_eq!(m.repairs(), ManifestRepairs::default());
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn garbage_manifest_is_set_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("spans.log");
        std::fs::write(&path, b"{\"not\": \"a manifest\"}").expect("write");
        let m = SpanManifest::open(&path).expect("open");
        assert!(m.repairs().replaced);
        assert!(m.is_empty());
        assert!(dir.path().join("spans.bad").is_file());
    }
}
