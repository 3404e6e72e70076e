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
    let ctx = Ctx {
        path,
        data_start,
        file_len,
    };
    // A well-formed header goes through the typed reader; anything it does not take (a malformed entry, a repeated
    // name) is read again as a JSON tree, which names what is wrong.
    if let Some(tensors) = fast_entries(&json) {
        let tensors = tensors
            .into_iter()
            .map(|e| ctx.checked(e.name, e.dtype, e.shape, (e.begin, e.end)))
            .collect::<Result<Vec<_>>>()?;
        return finish(path, file_len, data_start, tensors);
    }
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
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in &entries {
        if name == METADATA_KEY {
            continue;
        }
        tensors.push(ctx.entry(name, entry)?);
    }
    finish(path, file_len, data_start, tensors)
}

/// Sorts validated entries by offset and rejects overlaps.
fn finish(
    path: &Path,
    file_len: u64,
    data_start: u64,
    mut tensors: Vec<RawTensor>,
) -> Result<ParsedHeader> {
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
        self.checked(name.to_string(), dtype, shape, (begin, end))
    }

    /// Validates one entry's parts (from either reader): offsets inside the data, a byte length that matches the
    /// shape. The name moves into the entry.
    fn checked(
        &self,
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        (begin, end): (i128, i128),
    ) -> Result<RawTensor> {
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
            .ok_or_else(|| self.bad(&name, "shape overflows a 64-bit byte count"))?;
        if expected != len {
            return Err(StorageError::ByteLength {
                path: self.path.to_path_buf(),
                tensor: name.to_string(),
                expected,
                actual: len,
            });
        }
        Ok(RawTensor {
            name,
            dtype,
            shape,
            offset: self.data_start + begin,
            len,
        })
    }
}

/// One entry as the typed reader takes it: every field present and of its type, a known dtype, offsets not
/// negative.
struct FastEntry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    begin: i128,
    end: i128,
}

/// The entries of a well-formed header without building a JSON tree (a K3 checkpoint's headers hold half a million
/// entries, and the tree's allocations were most of the time before the model load), or `None` for anything else:
/// a value of another type, a missing field, an unknown dtype, a negative number, a name given twice. The caller then reads the
/// header as a tree, which reports what is wrong as before.
fn fast_entries(json: &[u8]) -> Option<Vec<FastEntry>> {
    use serde::Deserialize;
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

    #[derive(Deserialize)]
    struct Fields<'a> {
        #[serde(borrow)]
        dtype: std::borrow::Cow<'a, str>,
        shape: Vec<usize>,
        data_offsets: (u64, u64),
    }

    struct Entries;

    impl<'de> Visitor<'de> for Entries {
        type Value = Vec<FastEntry>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a safetensors header object")
        }

        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
            while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if name == METADATA_KEY {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
                let f: Fields<'de> = map.next_value()?;
                let dtype = Dtype::from_safetensors(&f.dtype)
                    .ok_or_else(|| serde::de::Error::custom("unknown dtype"))?;
                out.push(FastEntry {
                    name: name.into_owned(),
                    dtype,
                    shape: f.shape,
                    begin: i128::from(f.data_offsets.0),
                    end: i128::from(f.data_offsets.1),
                });
            }
            Ok(out)
        }
    }

    let mut de = serde_json::Deserializer::from_slice(json);
    let entries = (&mut de).deserialize_map(Entries).ok()?;
    de.end().ok()?;
    let mut names = std::collections::HashSet::with_capacity(entries.len());
    entries
        .iter()
        .all(|e| names.insert(e.name.as_str()))
        .then_some(entries)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid header: the typed reader gives every tensor entry (metadata skipped, escaped names decoded) with the
    /// fields the JSON tree holds.
    #[test]
    fn typed_reader_takes_what_the_tree_holds() {
        let json = br#"{"__metadata__":{"format":"pt"},"a.w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},
            "b\u002ew":{"dtype":"F32","shape":[],"data_offsets":[12,16],"extra":[1]},"c":{"shape":[4],
            "data_offsets":[16,20],"dtype":"U8"}}"#;
        let fast = fast_entries(json).expect("a well-formed header");
        let tree: Value = serde_json::from_slice(json).expect("json");
        let Value::Object(tree) = tree else {
            panic!("an object")
        };
        let tensors: Vec<_> = tree.iter().filter(|(n, _)| *n != METADATA_KEY).collect();
        assert_eq!(fast.len(), tensors.len());
        for (e, (name, v)) in fast.iter().zip(tensors) {
            assert_eq!(&e.name, name);
            assert_eq!(
                Some(e.dtype),
                v["dtype"].as_str().and_then(Dtype::from_safetensors)
            );
            let shape: Vec<usize> = v["shape"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|d| d.as_u64())
                        .map(|d| d as usize)
                        .collect()
                })
                .unwrap_or_default();
            assert_eq!(e.shape, shape);
            assert_eq!(Some(e.begin), as_int(&v["data_offsets"][0]));
            assert_eq!(Some(e.end), as_int(&v["data_offsets"][1]));
        }
        assert_eq!(fast[1].name, "b.w");
    }

    /// Anything the typed reader does not take goes to the tree, which names the fault.
    #[test]
    fn typed_reader_leaves_malformed_headers_to_the_tree() {
        for json in [
            &br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#[..],
            br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}"#,
            br#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            br#"{"a":{"dtype":3,"shape":[1],"data_offsets":[0,4]}}"#,
            br#"{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}"#,
            br#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#,
            br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
            br#"{"a":[]}"#,
            br#"[1,2]"#,
            br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} trailing"#,
        ] {
            assert!(fast_entries(json).is_none(), "{}", String::from_utf8_lossy(json));
        }
    }
}
