//! Checkpoint storage for deltafin: safetensors headers, the shard index, and the expert span map.
//!
//! [`ModelFiles::open`] reads and validates every shard header of a model directory (sharded with
//! `model.safetensors.index.json`, or a single `model.safetensors`) without reading tensor data, and
//! serves positional reads. [`ExpertMap::build`] maps each routed expert to one contiguous byte span
//! so that an expert costs exactly one read.
//!
//! Reading those spans fast is the [`ReadPool`]'s job (a fixed set of threads doing page-cache-bypassing
//! positional reads into reused aligned buffers, long spans in pieces over several threads). A streaming install ([`StreamInstall`]) keeps shards as
//! sparse files plus a manifest of verified spans ([`SpanManifest`]) and fetches missing experts from the
//! hub with one HTTP range request each ([`Hub`]); [`SpanReader`] serves either kind of install.
//! [`install`] holds `setup` and `fetch-experts-all`, shared by `cargo xtask` and the CLI.
//!
//! **Invariant:** this crate knows bytes, names, dtypes and shapes, and where bytes come from (files or
//! the hub); it does no tensor math and knows no tokens.

#![deny(missing_docs)]

mod dtype;
mod error;
mod experts;
mod files;
mod header;
mod index;
pub mod install;
mod pread;
mod read_pool;
mod read_rate;
mod remote;
mod span_cache;
mod streaming_install;
mod writer;

pub use dtype::Dtype;
pub use error::{Result, StorageError};
pub use experts::{ExpertFormat, ExpertMap, ExpertPart, ExpertSpan};
pub use files::{ModelFiles, ShardInfo, TensorInfo};
pub use read_pool::{
    Batch, BufferHook, DIRECT_ALIGN, PIECE_BYTES, PoolFile, PooledBuf, ReadPool, ReadPoolOptions,
    ReadRequest, ReadStats, SpanBytes, SpanRead,
};
pub use read_rate::expert_spans_read_rate;
pub use remote::{DEFAULT_ENDPOINT, Hub, HubClient, HubOptions, RangeBody, RepoRef, Secret};
pub use span_cache::{ManifestRepairs, SpanKey, SpanManifest};
pub use streaming_install::{
    INSTALL_FILE, InstallInfo, InstallMode, MANIFEST_FILE, MAX_SPINE_SPAN, Missing, NoProgress,
    Progress, ReaderStats, SPINE_VERIFIED_FILE, STATE_DIR, SpanBatch, SpanReader, SpanRequest,
    StreamInstall, header_span, is_stream_install, spine_spans,
};
pub use writer::{PlannedTensor, write_safetensors};
