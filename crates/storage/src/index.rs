//! Parsing `model.safetensors.index.json`: which shard holds which tensor.

use std::collections::BTreeSet;
use std::path::{Component, Path};

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
pub(crate) fn read_index(path: &Path) -> Result<Index> {
    let bytes = std::fs::read(path).map_err(|source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|source| StorageError::IndexJson {
            path: path.to_path_buf(),
            source,
        })?;
    let format = |reason: String| StorageError::IndexFormat {
        path: path.to_path_buf(),
        reason,
    };
    let Value::Object(top) = value else {
        return Err(format("not a json object".to_string()));
    };
    let map = match top.get("weight_map") {
        None => return Err(format("no weight_map".to_string())),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(format("weight_map is not an object".to_string())),
    };
    if map.is_empty() {
        return Err(format("weight_map names no tensors".to_string()));
    }
    let mut weight_map = Vec::with_capacity(map.len());
    let mut shard_names = BTreeSet::new();
    for (tensor, shard) in map {
        let Value::String(shard) = shard else {
            return Err(format(format!(
                "weight_map entry for {tensor} is not a string"
            )));
        };
        if shard_names.insert(shard.as_str()) {
            check_shard_name(path, shard)?;
        }
        weight_map.push((tensor.clone(), shard.clone()));
    }
    let shard_names = shard_names.into_iter().map(str::to_string).collect();
    let total_size = top
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(Value::as_u64);
    Ok(Index {
        weight_map,
        shard_names,
        total_size,
    })
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
