//! Parsing and validating one safetensors file header.
//!
//! Layout: `[u64 LE header_len][header_len bytes of JSON][data]`. Each JSON entry maps a tensor name to
//! `{dtype, shape, data_offsets: [begin, end]}`, offsets relative to the end of the header. Only the
//! header is read; tensor bytes are never touched here.

use std::fs::File;
use std::path::Path;

use serde_json::{Map, Value};

use crate::dtype::Dtype;
use crate::error::{Result, StorageError};
use crate::pread::read_exact_at;

/// Size of the little-endian header length prefix.
const PREFIX_LEN: u64 = 8;

/// Largest header accepted. The real K3 shards have headers under 1 MB (about 5,400 entries); the
/// `safetensors` crate uses the same 100 MB ceiling. It bounds the allocation a corrupt prefix can cause.
pub(crate) const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// Key safetensors reserves for free-form string metadata.
const METADATA_KEY: &str = "__metadata__";

/// One validated header entry.
#[derive(Clone, Debug)]
pub(crate) struct RawTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute offset in the file.
    pub offset: u64,
    pub len: u64,
}

/// A validated header: where data starts, how long the file is, and its tensors sorted by offset.
#[derive(Debug)]
pub(crate) struct ParsedHeader {
    pub file_len: u64,
    pub data_start: u64,
    pub tensors: Vec<RawTensor>,
}

/// Reads and validates the header of the open file `file`, found at `path` (used in messages).
pub(crate) fn read_header(path: &Path, file: &File) -> Result<ParsedHeader> {
    let io_err = |source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_len = file.metadata().map_err(io_err)?.len();
    if file_len < PREFIX_LEN {
        return Err(StorageError::TruncatedHeader {
            path: path.to_path_buf(),
            needed: PREFIX_LEN,
            file_len,
        });
    }
    let mut prefix = [0u8; PREFIX_LEN as usize];
    read_exact_at(file, &mut prefix, 0).map_err(io_err)?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(StorageError::HeaderTooLarge {
            path: path.to_path_buf(),
            header_len,
            max: MAX_HEADER_LEN,
        });
    }
    // Cannot overflow: header_len <= MAX_HEADER_LEN.
    let data_start = PREFIX_LEN + header_len;
    if data_start > file_len {
        return Err(StorageError::TruncatedHeader {
            path: path.to_path_buf(),
            needed: data_start,
            file_len,
        });
    }
    // header_len <= MAX_HEADER_LEN (100 MiB) fits in usize on every supported target.
    let mut json = vec![0u8; header_len as usize];
    read_exact_at(file, &mut json, PREFIX_LEN).map_err(io_err)?;
    let value: Value =
        serde_json::from_slice(&json).map_err(|source| StorageError::HeaderJson {
            path: path.to_path_buf(),
            source,
        })?;
    let Value::Object(entries) = value else {
        return Err(StorageError::HeaderNotObject {
            path: path.to_path_buf(),
        });
    };
    let ctx = Ctx {
        path,
        data_start,
        file_len,
    };
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in &entries {
        if name == METADATA_KEY {
            continue;
        }
        tensors.push(ctx.entry(name, entry)?);
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    check_overlaps(path, &tensors)?;
    Ok(ParsedHeader {
        file_len,
        data_start,
        tensors,
    })
}

/// What entry validation needs to know about the file.
struct Ctx<'a> {
    path: &'a Path,
    data_start: u64,
    file_len: u64,
}

impl Ctx<'_> {
    fn bad(&self, tensor: &str, reason: impl Into<String>) -> StorageError {
        StorageError::BadEntry {
            path: self.path.to_path_buf(),
            tensor: tensor.to_string(),
            reason: reason.into(),
        }
    }

    fn entry(&self, name: &str, entry: &Value) -> Result<RawTensor> {
        let obj: &Map<String, Value> = entry
            .as_object()
            .ok_or_else(|| self.bad(name, "entry is not a json object"))?;

        let dtype_str = match obj.get("dtype") {
            None => return Err(self.bad(name, "entry has no dtype")),
            Some(Value::String(s)) => s,
            Some(_) => return Err(self.bad(name, "dtype is not a string")),
        };
        let dtype =
            Dtype::from_safetensors(dtype_str).ok_or_else(|| StorageError::UnknownDtype {
                path: self.path.to_path_buf(),
                tensor: name.to_string(),
                dtype: dtype_str.clone(),
            })?;

        let shape = match obj.get("shape") {
            None => return Err(self.bad(name, "entry has no shape")),
            Some(Value::Array(dims)) => dims
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| self.bad(name, "shape is not a list of non-negative integers"))?,
            Some(_) => return Err(self.bad(name, "shape is not a list")),
        };

        let (begin, end) = match obj.get("data_offsets") {
            None => return Err(self.bad(name, "entry has no data_offsets")),
            Some(Value::Array(pair)) if pair.len() == 2 => {
                match (as_int(&pair[0]), as_int(&pair[1])) {
                    (Some(b), Some(e)) => (b, e),
                    _ => return Err(self.bad(name, "data_offsets are not two integers")),
                }
            }
            Some(_) => return Err(self.bad(name, "data_offsets is not a list of two integers")),
        };
        let bad_offsets = |reason: String| StorageError::BadOffsets {
            path: self.path.to_path_buf(),
            tensor: name.to_string(),
            begin,
            end,
            reason,
        };
        if begin < 0 || end < 0 {
            return Err(bad_offsets(
                "negative offset points into the header".to_string(),
            ));
        }
        if begin > end {
            return Err(bad_offsets("begin is after end".to_string()));
        }
        let data_len = i128::from(self.file_len - self.data_start);
        if end > data_len {
            return Err(bad_offsets(format!(
                "past the end of the file ({} data bytes after the header)",
                data_len
            )));
        }
        // Both are in 0..=data_len, which came from a u64.
        let (begin, end) = (begin as u64, end as u64);
        let len = end - begin;

        let expected = shape
            .iter()
            .try_fold(dtype.size_bytes() as u64, |acc, &d| {
                acc.checked_mul(d as u64)
            })
            .ok_or_else(|| self.bad(name, "shape overflows a 64-bit byte count"))?;
        if expected != len {
            return Err(StorageError::ByteLength {
                path: self.path.to_path_buf(),
                tensor: name.to_string(),
                expected,
                actual: len,
            });
        }
        Ok(RawTensor {
            name: name.to_string(),
            dtype,
            shape,
            offset: self.data_start + begin,
            len,
        })
    }
}

/// A JSON integer widened to i128 so negative offsets can be reported as written.
fn as_int(v: &Value) -> Option<i128> {
    v.as_u64()
        .map(i128::from)
        .or_else(|| v.as_i64().map(i128::from))
}

/// Rejects any two non-empty tensors sharing a byte. `tensors` must be sorted by offset.
fn check_overlaps(path: &Path, tensors: &[RawTensor]) -> Result<()> {
    let mut last: Option<&RawTensor> = None;
    for t in tensors.iter().filter(|t| t.len > 0) {
        if let Some(prev) = last
            && t.offset < prev.offset + prev.len
        {
            return Err(StorageError::OverlappingTensors {
                path: path.to_path_buf(),
                first: prev.name.clone(),
                second: t.name.clone(),
            });
        }
        // No overlap, so `t` ends after every tensor before it.
        last = Some(t);
    }
    Ok(())
}
