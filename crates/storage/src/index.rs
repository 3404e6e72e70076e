//! Parsing `model.safetensors.index.json`: which shard holds which tensor.

use std::collections::BTreeSet;
use std::path::{Component, Path};

use serde::de::{self, Deserialize, Deserializer};
use serde_json::Value;

use crate::error::{Result, StorageError};

/// File name of the shard index in a sharded checkpoint.
pub(crate) const INDEX_FILE: &str = "model.safetensors.index.json";

/// A parsed index.
#[derive(Debug)]
pub(crate) struct Index {
    /// `(tensor, shard file name)` pairs from `weight_map`.
    pub weight_map: Vec<(String, String)>,
    /// Distinct shard names, sorted (zero-padded names sort in shard order).
    pub shard_names: Vec<String>,
    /// `metadata.total_size`, if present.
    pub total_size: Option<u64>,
}

/// Reads and validates the index at `path`. Shard names are checked to stay inside the model directory.
///
/// The file is read by a streaming visitor ([`IndexFile`]) rather than into a JSON tree: K3's index lists half a
/// million tensors, and a tree of them (an ordered map of values) took 0.4 s to build on one core. The entries keep
/// the file's order.
pub(crate) fn read_index(path: &Path) -> Result<Index> {
    let bytes = std::fs::read(path).map_err(|source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file: IndexFile =
        serde_json::from_slice(&bytes).map_err(|source| StorageError::IndexJson {
            path: path.to_path_buf(),
            source,
        })?;
    let format = |reason: String| StorageError::IndexFormat {
        path: path.to_path_buf(),
        reason,
    };
    let IndexFile::Object {
        weight_map,
        metadata,
    } = file
    else {
        return Err(format("not a json object".to_string()));
    };
    let entries = match weight_map {
        None => return Err(format("no weight_map".to_string())),
        Some(Entries::Object(entries)) => entries,
        Some(Entries::NotObject) => {
            return Err(format("weight_map is not an object".to_string()));
        }
    };
    if entries.is_empty() {
        return Err(format("weight_map names no tensors".to_string()));
    }
    let mut weight_map = Vec::with_capacity(entries.len());
    let mut shard_names = BTreeSet::new();
    for (tensor, shard) in entries {
        let ShardName::Name(shard) = shard else {
            return Err(format(format!(
                "weight_map entry for {tensor} is not a string"
            )));
        };
        if !shard_names.contains(shard.as_str()) {
            check_shard_name(path, &shard)?;
            shard_names.insert(shard.clone());
        }
        weight_map.push((tensor, shard));
    }
    let shard_names = shard_names.into_iter().collect();
    let total_size = metadata
        .as_ref()
        .and_then(|m| m.get("total_size"))
        .and_then(Value::as_u64);
    Ok(Index {
        weight_map,
        shard_names,
        total_size,
    })
}

/// What an index file holds, as far as the engine reads it; anything else in it is skipped unread.
enum IndexFile {
    /// The top level is an object: its `weight_map` and `metadata`, when present (the last of repeated keys).
    Object {
        weight_map: Option<Entries>,
        metadata: Option<Value>,
    },
    /// The top level is something else.
    NotObject,
}

/// The `weight_map` member: `(tensor, shard)` pairs in file order, or a note that it is not an object.
enum Entries {
    Object(Vec<(String, ShardName)>),
    NotObject,
}

/// One `weight_map` value: a shard file name, or a note that it is not a string.
enum ShardName {
    Name(String),
    NotString,
}

/// Implements `visit_*` for every JSON value other than the ones a visitor handles itself, each one consumed and
/// answered with `$other` (a shape the caller reports in its own words).
macro_rules! other_shapes {
    ($other:expr; $($skip:ident)*) => {
        $(other_shapes!(@one $skip, $other);)*
    };
    (@one bool, $other:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one i64, $other:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one u64, $other:expr) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one f64, $other:expr) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one str, $other:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one unit, $other:expr) => {
        fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
            Ok($other)
        }
    };
    (@one seq, $other:expr) => {
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Self::Value, A::Error> {
            while seq.next_element::<de::IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
    (@one map, $other:expr) => {
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            while map.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
            Ok($other)
        }
    };
}

impl<'de> Deserialize<'de> for IndexFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = IndexFile;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a safetensors index")
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<IndexFile, A::Error> {
                let (mut weight_map, mut metadata) = (None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "weight_map" => weight_map = Some(map.next_value()?),
                        "metadata" => metadata = Some(map.next_value()?),
                        _ => {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(IndexFile::Object {
                    weight_map,
                    metadata,
                })
            }
            other_shapes!(IndexFile::NotObject; bool i64 u64 f64 str unit seq);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a weight_map")
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(entry) = map.next_entry::<String, ShardName>()? {
                    entries.push(entry);
                }
                Ok(Entries::Object(entries))
            }
            other_shapes!(Entries::NotObject; bool i64 u64 f64 str unit seq);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for ShardName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = ShardName;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a shard file name")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<ShardName, E> {
                Ok(ShardName::Name(s.to_string()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> std::result::Result<ShardName, E> {
                Ok(ShardName::Name(s))
            }
            other_shapes!(ShardName::NotString; bool i64 u64 f64 unit seq map);
        }
        d.deserialize_any(V)
    }
}

/// Accepts only relative names made of ordinary components (`.` allowed), so an index cannot make
/// the engine open files outside the model directory.
fn check_shard_name(index: &Path, name: &str) -> Result<()> {
    let path = Path::new(name);
    let ok = !name.is_empty()
        && path.file_name().is_some()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if ok {
        Ok(())
    } else {
        Err(StorageError::UnsafeShardName {
            index: index.to_path_buf(),
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        let idx = Path::new("index.json");
        for good in ["model-00001-of-000096.safetensors", "sub/model.safetensors"] {
            assert!(check_shard_name(idx, good).is_ok(), "{good}");
        }
        for bad in ["", "/etc/passwd", "../x.safetensors", "a/../../x", "a/.."] {
            assert!(check_shard_name(idx, bad).is_err(), "{bad}");
        }
    }
}
