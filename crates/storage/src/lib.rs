//! Checkpoint storage for deltafin: safetensors headers, the shard index, and the expert span map.
//!
//! [`ModelFiles::open`] reads and validates every shard header of a model directory (sharded with
//! `model.safetensors.index.json`, or a single `model.safetensors`) without reading tensor data, and
//! serves positional reads. [`ExpertMap::build`] maps each routed expert to one contiguous byte span
//! so that an expert costs exactly one read.
//!
//! **Invariant:** this crate knows bytes, names, dtypes and shapes; it does no tensor math.

#![deny(missing_docs)]

mod dtype;
mod error;
mod experts;
mod files;
mod header;
mod index;
mod pread;
mod writer;

pub use dtype::Dtype;
pub use error::{Result, StorageError};
pub use experts::{ExpertFormat, ExpertMap, ExpertPart, ExpertSpan};
pub use files::{ModelFiles, ShardInfo, TensorInfo};
pub use writer::{PlannedTensor, write_safetensors};
