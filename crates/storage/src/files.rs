//! An opened checkpoint directory: every shard's header, a name → tensor table, and positional reads.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::dtype::Dtype;
use crate::error::{Result, StorageError};
use crate::header::{ParsedHeader, RawTensor, read_header};
use crate::index::{INDEX_FILE, read_index};
use crate::pread::read_exact_at;
use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};

/// File name of a single-file (unsharded) checkpoint.
const SINGLE_FILE: &str = "model.safetensors";

/// Where one tensor's bytes live.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Full tensor name as written in the checkpoint (for K3, with its `language_model.` prefix).
    pub name: String,
    /// Index into [`ModelFiles::shards`].
    pub shard: usize,
    /// Element type.
    pub dtype: Dtype,
    /// Shape in PyTorch `[out, in]` order.
    pub shape: Vec<usize>,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Length in bytes (= product(shape) × dtype size, checked at open).
    pub len: u64,
}

/// One safetensors file of the checkpoint.
#[derive(Clone, Debug)]
pub struct ShardInfo {
    /// File name as given by the index (or `model.safetensors`).
    pub file_name: String,
    /// Full path of the file.
    pub path: PathBuf,
    /// File length in bytes at open time.
    pub file_len: u64,
    /// Offset of the first data byte: 8 + header length.
    pub data_start: u64,
}

/// An opened checkpoint: headers parsed and validated, one open handle per shard, no tensor data read.
///
/// Reads are positional, so a `&ModelFiles` can be shared by many reader threads.
#[derive(Debug)]
pub struct ModelFiles {
    dir: PathBuf,
    shards: Vec<ShardInfo>,
    handles: Vec<File>,
    /// Sorted by (shard, offset), so iteration follows file order.
    tensors: Vec<TensorInfo>,
    /// Name → position in `tensors`. Fx hashing: half a million names at K3's size, hashed several times faster
    /// than with the standard hasher; the names come from the checkpoint the user opens.
    by_name: FxHashMap<String, usize>,
}

impl ModelFiles {
    /// Opens a model dir: `model.safetensors.index.json` (+ every shard it names) or a single
    /// `model.safetensors`.
    ///
    /// Reads only headers (never tensor data). Validates every shard header, and checks that every
    /// tensor the index names is in the shard it names. A tensor present in a shard but missing from
    /// the index is kept and logged as a warning.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.is_file() {
            Self::open_sharded(dir, &index_path)
        } else if single_path.is_file() {
            Self::open_single(dir, &single_path)
        } else {
            Err(StorageError::NoModelFiles {
                dir: dir.to_path_buf(),
            })
        }
    }

    /// Opens one safetensors file on its own (for example the int8 spine copy next to a model).
    pub fn open_file(path: &Path) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::open_named(dir, path, &name)
    }

    fn open_single(dir: &Path, path: &Path) -> Result<Self> {
        Self::open_named(dir, path, SINGLE_FILE)
    }

    fn open_named(dir: &Path, path: &Path, name: &str) -> Result<Self> {
        let (shard, handle, header) = open_shard(name, path, None)?;
        let mut builder = Builder::default();
        for raw in header.tensors {
            builder.insert(0, raw);
        }
        Ok(builder.finish(dir, vec![shard], vec![handle]))
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self> {
        let index = read_index(index_path)?;
        // Every shard's header at once: K3's 98 headers list half a million tensors, and parsing them one shard
        // after another was the largest step of an open before the weights are read. (Which error is reported
        // when several shards are broken is then not fixed; each one names its shard.)
        let opened: Vec<(ShardInfo, File, ParsedHeader)> = index
            .shard_names
            .par_iter()
            .map(|name| open_shard(name, &dir.join(name), Some(index_path)))
            .collect::<Result<_>>()?;
        let shard_idx: FxHashMap<&str, usize> = index
            .shard_names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        // The shard the index names for each tensor. shard_names was built from these very values, so the
        // lookup cannot miss; report rather than panic all the same.
        let mut named: FxHashMap<&str, usize> =
            FxHashMap::with_capacity_and_hasher(index.weight_map.len(), Default::default());
        for (tensor, shard_name) in &index.weight_map {
            let Some(&shard) = shard_idx.get(shard_name.as_str()) else {
                return Err(StorageError::IndexFormat {
                    path: index_path.to_path_buf(),
                    reason: format!("internal: shard {shard_name} not in the shard table"),
                });
            };
            named.insert(tensor.as_str(), shard);
        }

        let mut shards = Vec::with_capacity(opened.len());
        let mut handles = Vec::with_capacity(opened.len());
        let mut builder = Builder::default();
        // Tensors the index does not place in the shard that holds them, inserted after the indexed ones.
        let mut unlisted: Vec<(usize, RawTensor)> = Vec::new();
        let mut found = 0usize;
        for (shard, (info, handle, header)) in opened.into_iter().enumerate() {
            shards.push(info);
            handles.push(handle);
            for raw in header.tensors {
                if named.get(raw.name.as_str()) == Some(&shard) {
                    found += 1;
                    builder.insert(shard, raw);
                } else {
                    unlisted.push((shard, raw));
                }
            }
        }
        if found < index.weight_map.len() {
            // Some tensor the index names is not in its shard: report the first one in index order.
            let held: FxHashSet<(&str, usize)> = builder
                .tensors
                .iter()
                .map(|t| (t.name.as_str(), t.shard))
                .collect();
            if let Some((tensor, shard)) = index
                .weight_map
                .iter()
                .filter_map(|(t, _)| named.get(t.as_str()).map(|&shard| (t, shard)))
                .find(|(t, shard)| !held.contains(&(t.as_str(), *shard)))
            {
                return Err(StorageError::TensorNotInShard {
                    index: index_path.to_path_buf(),
                    tensor: tensor.clone(),
                    shard: shards[shard].path.clone(),
                });
            }
        }
        // Whatever is left in a header is absent from the index (or placed elsewhere by it): kept unless a tensor of
        // that name is already in.
        let mut extra: FxHashSet<String> = FxHashSet::default();
        for (shard, raw) in unlisted {
            tracing::warn!(
                tensor = %raw.name,
                shard = %shards[shard].path.display(),
                "tensor is in a shard but not in {}",
                index_path.display()
            );
            if !named.contains_key(raw.name.as_str()) && extra.insert(raw.name.clone()) {
                builder.insert(shard, raw);
            }
        }
        let files = builder.finish(dir, shards, handles);
        if let Some(total) = index.total_size
            && total != files.total_tensor_bytes()
        {
            tracing::warn!(
                index_total = total,
                header_total = files.total_tensor_bytes(),
                "metadata.total_size in {} disagrees with the shard headers",
                index_path.display()
            );
        }
        Ok(files)
    }

    /// The directory the model was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every shard, in the order [`TensorInfo::shard`] indexes.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Looks a tensor up by its full name.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Looks a tensor up by its full name; [`StorageError::MissingTensor`] if absent.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.get(name).ok_or_else(|| StorageError::MissingTensor {
            name: name.to_string(),
        })
    }

    /// Every tensor, in file order (by shard, then offset).
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.iter()
    }

    /// Reads one tensor's bytes with a single positional read.
    pub fn read_tensor(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        // Check the range before allocating, so a forged `TensorInfo` cannot demand a huge buffer.
        self.checked_shard(info.shard, info.offset, info.len)?;
        let len = usize::try_from(info.len).map_err(|_| StorageError::OutOfRange {
            what: format!("addressable memory (tensor {})", info.name),
            offset: info.offset,
            len: info.len,
        })?;
        let mut buf = vec![0u8; len];
        self.read_span(info.shard, info.offset, info.len, &mut buf)?;
        Ok(buf)
    }

    /// Reads `len` bytes at absolute `offset` of shard `shard` into `buf`, whose length must be `len`.
    ///
    /// The span may cover any bytes of the file, header included (the raw-span cache copies shard
    /// bytes verbatim).
    pub fn read_span(&self, shard: usize, offset: u64, len: u64, buf: &mut [u8]) -> Result<()> {
        let (info, file) = self.checked_shard(shard, offset, len)?;
        if buf.len() as u64 != len {
            return Err(StorageError::BufferSize {
                path: info.path.clone(),
                len,
                buf_len: buf.len(),
            });
        }
        read_exact_at(file, buf, offset).map_err(|source| StorageError::Io {
            path: info.path.clone(),
            source,
        })
    }

    /// The shard and its handle, if `shard` exists and `offset..offset + len` lies inside it.
    fn checked_shard(&self, shard: usize, offset: u64, len: u64) -> Result<(&ShardInfo, &File)> {
        let (Some(info), Some(file)) = (self.shards.get(shard), self.handles.get(shard)) else {
            return Err(StorageError::OutOfRange {
                what: format!("the model (shard {shard} of {})", self.shards.len()),
                offset,
                len,
            });
        };
        if offset
            .checked_add(len)
            .is_none_or(|end| end > info.file_len)
        {
            return Err(StorageError::OutOfRange {
                what: format!("{} ({} bytes)", info.path.display(), info.file_len),
                offset,
                len,
            });
        }
        Ok((info, file))
    }

    /// Sum of all tensor lengths.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// Opens one shard file and validates its header. `index` is the index that named it, if any, so a
/// missing file is reported as a missing shard rather than a bare i/o error.
fn open_shard(
    name: &str,
    path: &Path,
    index: Option<&Path>,
) -> Result<(ShardInfo, File, ParsedHeader)> {
    let file = File::open(path).map_err(|source| match (source.kind(), index) {
        (io::ErrorKind::NotFound, Some(index)) => StorageError::MissingShard {
            path: path.to_path_buf(),
            index: index.to_path_buf(),
        },
        _ => StorageError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    let header = read_header(path, &file)?;
    let shard = ShardInfo {
        file_name: name.to_string(),
        path: path.to_path_buf(),
        file_len: header.file_len,
        data_start: header.data_start,
    };
    Ok((shard, file, header))
}

/// Collects tensors from all shards, then sorts them into file order.
#[derive(Default)]
struct Builder {
    tensors: Vec<TensorInfo>,
}

impl Builder {
    fn insert(&mut self, shard: usize, raw: RawTensor) {
        self.tensors.push(TensorInfo {
            name: raw.name,
            shard,
            dtype: raw.dtype,
            shape: raw.shape,
            offset: raw.offset,
            len: raw.len,
        });
    }

    fn finish(mut self, dir: &Path, shards: Vec<ShardInfo>, handles: Vec<File>) -> ModelFiles {
        self.tensors.sort_by_key(|t| (t.shard, t.offset, t.len));
        let by_name = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        ModelFiles {
            dir: dir.to_path_buf(),
            shards,
            handles,
            tensors: self.tensors,
            by_name,
        }
    }
}
