//! The crate's one error type.
//!
//! Every message is lower case and names the file, tensor, layer or expert at fault, so that a user who
//! points the engine at a broken checkpoint learns what to fix without reading code.

use std::path::PathBuf;

/// Everything that can go wrong while opening a checkpoint, mapping its experts or reading its bytes.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An operating-system error while opening, measuring or reading a file.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file being accessed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The directory holds neither `model.safetensors.index.json` nor `model.safetensors`.
    #[error("no model.safetensors.index.json or model.safetensors in {dir}")]
    NoModelFiles {
        /// The directory that was opened.
        dir: PathBuf,
    },

    /// `model.safetensors.index.json` is not valid JSON.
    #[error("index {path} is not valid json: {source}")]
    IndexJson {
        /// The index file.
        path: PathBuf,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },

    /// `model.safetensors.index.json` is JSON but not the expected shape (no `weight_map`, a non-string
    /// shard name, no tensors at all, ...).
    #[error("index {path} is malformed: {reason}")]
    IndexFormat {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A shard file name in the index is absolute or escapes the model directory with `..`.
    #[error("index {index} names shard {name:?}, which is absolute or leaves the model directory")]
    UnsafeShardName {
        /// The index file.
        index: PathBuf,
        /// The offending shard name as written in the index.
        name: String,
    },

    /// A shard named in the index does not exist on disk.
    #[error("shard {path} named in {index} does not exist")]
    MissingShard {
        /// The expected shard path.
        path: PathBuf,
        /// The index that names it.
        index: PathBuf,
    },

    /// The file is too short to hold its own header: shorter than the 8-byte length prefix, or the prefix
    /// announces more header bytes than the file holds.
    #[error("truncated header in {path}: header needs {needed} bytes but the file has {file_len}")]
    TruncatedHeader {
        /// The shard file.
        path: PathBuf,
        /// Bytes needed for the prefix plus the announced header.
        needed: u64,
        /// Actual file length.
        file_len: u64,
    },

    /// The header length prefix is larger than any sane safetensors header.
    #[error("header of {path} claims {header_len} bytes, more than the {max} allowed")]
    HeaderTooLarge {
        /// The shard file.
        path: PathBuf,
        /// The announced header length.
        header_len: u64,
        /// The limit.
        max: u64,
    },

    /// The header bytes are not valid JSON.
    #[error("header of {path} is not valid json: {source}")]
    HeaderJson {
        /// The shard file.
        path: PathBuf,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },

    /// The header is JSON but not an object mapping tensor names to entries.
    #[error("header of {path} is not a json object")]
    HeaderNotObject {
        /// The shard file.
        path: PathBuf,
    },

    /// A tensor entry in a header is malformed: not an object, or `dtype`, `shape` or `data_offsets`
    /// missing or of the wrong JSON type.
    #[error("tensor {tensor} in {path}: {reason}")]
    BadEntry {
        /// The shard file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with the entry.
        reason: String,
    },

    /// A tensor's dtype string is not one this crate knows.
    #[error("tensor {tensor} in {path} has unknown dtype {dtype:?}")]
    UnknownDtype {
        /// The shard file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype string as written.
        dtype: String,
    },

    /// A tensor's `data_offsets` are out of order, negative (pointing into the header) or run past the
    /// end of the file.
    #[error("tensor {tensor} in {path} has bad data_offsets [{begin}, {end}]: {reason}")]
    BadOffsets {
        /// The shard file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Begin offset as written (relative to the end of the header).
        begin: i128,
        /// End offset as written (relative to the end of the header).
        end: i128,
        /// Why the offsets are rejected.
        reason: String,
    },

    /// Two tensors in the same shard claim overlapping bytes.
    #[error("tensors {first} and {second} overlap in {path}")]
    OverlappingTensors {
        /// The shard file.
        path: PathBuf,
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside the first one.
        second: String,
    },

    /// A tensor's byte length differs from product(shape) × dtype size.
    #[error(
        "tensor {tensor} in {path} holds {actual} bytes but its dtype and shape need {expected}"
    )]
    ByteLength {
        /// The shard file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Bytes implied by dtype and shape.
        expected: u64,
        /// Bytes given by `data_offsets`.
        actual: u64,
    },

    /// The index says a tensor lives in a shard whose header does not contain it.
    #[error("index {index} puts tensor {tensor} in {shard}, but that shard does not contain it")]
    TensorNotInShard {
        /// The index file.
        index: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shard file the index names.
        shard: PathBuf,
    },

    /// A tensor name was looked up that the checkpoint does not contain.
    #[error("tensor {name} is not in the checkpoint")]
    MissingTensor {
        /// The name that was looked up.
        name: String,
    },

    /// A read asked for bytes outside a shard, or for a shard that does not exist.
    #[error("read of {len} bytes at offset {offset} is outside {what}")]
    OutOfRange {
        /// The shard file (or shard number) that was addressed.
        what: String,
        /// Absolute byte offset requested.
        offset: u64,
        /// Length requested.
        len: u64,
    },

    /// `read_span` was handed a buffer whose length differs from the requested span length.
    #[error("read of {len} bytes from {path} given a buffer of {buf_len} bytes")]
    BufferSize {
        /// The shard file.
        path: PathBuf,
        /// The requested span length.
        len: u64,
        /// The buffer's length.
        buf_len: usize,
    },

    /// A tensor under `block_sparse_moe.experts.` does not follow the
    /// `experts.{E}.w{1,2,3}.{weight_packed|weight_scale|weight}` naming scheme.
    #[error("tensor {tensor} looks like a routed-expert tensor but its name is not understood")]
    UnknownExpertTensor {
        /// The tensor's name.
        tensor: String,
    },

    /// The same expert part is named twice (for example `experts.1` and `experts.01`).
    #[error("layer {layer} expert {expert}: tensor {tensor} duplicates {other}")]
    DuplicateExpertTensor {
        /// MoE layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// The second name seen.
        tensor: String,
        /// The first name seen.
        other: String,
    },

    /// An expert lacks one of its tensors.
    #[error("layer {layer} expert {expert}: missing tensor {part}")]
    MissingExpertPart {
        /// MoE layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// The missing part, for example `w2.weight_scale`.
        part: String,
    },

    /// A layer's expert ids are not exactly `0..n`.
    #[error("layer {layer}: expert {expert} is missing (layer has experts up to {max})")]
    MissingExpert {
        /// MoE layer.
        layer: usize,
        /// The first absent expert id.
        expert: usize,
        /// The largest expert id present.
        max: usize,
    },

    /// A layer (or a single expert) mixes MXFP4 and dense expert tensors.
    #[error(
        "layer {layer}: expert {expert} is {found} but {expected} was expected; mixed expert formats"
    )]
    MixedExpertFormats {
        /// MoE layer.
        layer: usize,
        /// The first expert whose format disagrees.
        expert: usize,
        /// The format that expert uses.
        found: String,
        /// The format established before it.
        expected: String,
    },

    /// An expert's tensors are not stored back to back, in the required order, in one shard.
    #[error("layer {layer} expert {expert}: tensors are not contiguous in order: {detail}")]
    ExpertNotContiguous {
        /// MoE layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// Which pair of tensors breaks the layout.
        detail: String,
    },

    /// An expert tensor has a dtype its format does not allow.
    #[error(
        "layer {layer} expert {expert}: tensor {tensor} has dtype {dtype}, expected {expected}"
    )]
    ExpertDtype {
        /// MoE layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// The tensor's name.
        tensor: String,
        /// Its dtype.
        dtype: crate::Dtype,
        /// What was expected.
        expected: String,
    },

    /// An expert tensor's shape disagrees with its siblings or with the layer.
    #[error("layer {layer} expert {expert}: tensor {tensor} has shape {shape:?}: {reason}")]
    ExpertShape {
        /// MoE layer.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// The tensor's name.
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
        /// What was expected.
        reason: String,
    },

    /// A (layer, expert) pair was looked up that the expert map does not hold.
    #[error("no routed expert {expert} in layer {layer}")]
    NoSuchExpert {
        /// The layer looked up.
        layer: usize,
        /// The expert looked up.
        expert: usize,
    },

    /// A cached span's bytes disagree with the checksum its manifest records (or the manifest record
    /// itself is damaged); the span is treated as missing and fetched again.
    #[error("corrupt span of {len} bytes at offset {offset} in {path}: {reason}")]
    CorruptSpan {
        /// The cache file (or manifest).
        path: PathBuf,
        /// Absolute offset of the span.
        offset: u64,
        /// Span length.
        len: u64,
        /// What disagrees.
        reason: String,
    },

    /// The streaming cache's manifest cannot be read or written.
    #[error("manifest {path}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// An HTTP request to the hub failed for good (after retries, or with a status that retrying
    /// cannot fix). The URL never carries the access token.
    #[error("http request for {url}{range} failed: {reason}")]
    Http {
        /// The URL requested.
        url: String,
        /// The byte range requested, as ` (bytes a-b)`, or empty.
        range: String,
        /// What went wrong, last attempt first.
        reason: String,
    },

    /// A setup or streaming-install problem that is not about one file: bad options, no disk room, an
    /// unfinished install, an unknown repository layout.
    #[error("install in {dir}: {reason}")]
    Install {
        /// The model directory.
        dir: PathBuf,
        /// What is wrong and what to do about it.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, StorageError>;
