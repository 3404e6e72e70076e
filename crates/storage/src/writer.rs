//! A streaming safetensors writer: the header is planned from names, dtypes and shapes, then each tensor's bytes
//! are produced and written in order, so files larger than RAM can be written. The file appears atomically
//! (temporary name, fsync, rename).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::dtype::Dtype;
use crate::error::{Result, StorageError};

/// One tensor of a planned file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    /// Bytes the tensor occupies.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> StorageError + '_ {
    move |source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `plan` to `path`; `produce(i)` returns tensor `i`'s bytes (exactly `plan[i].nbytes()` of them).
pub fn write_safetensors(
    path: &Path,
    plan: &[PlannedTensor],
    mut produce: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<u64> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in plan {
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype.as_str(),
                "shape": t.shape,
                "data_offsets": [offset, offset + t.nbytes()],
            }),
        );
        offset += t.nbytes();
    }
    let mut json =
        serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| StorageError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp).map_err(io(&tmp))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    w.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(io(&tmp))?;
    w.write_all(&json).map_err(io(&tmp))?;
    for (i, t) in plan.iter().enumerate() {
        let bytes = produce(i)?;
        if bytes.len() != t.nbytes() {
            return Err(StorageError::Io {
                path: tmp.clone(),
                source: std::io::Error::other(format!(
                    "tensor {} produced {} bytes, planned {}",
                    t.name,
                    bytes.len(),
                    t.nbytes()
                )),
            });
        }
        w.write_all(&bytes).map_err(io(&tmp))?;
    }
    let file = w.into_inner().map_err(|e| io(&tmp)(e.into_error()))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(offset as u64)
}
