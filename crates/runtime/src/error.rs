//! The error type of the runtime crate.

use std::path::PathBuf;

/// Everything that can go wrong while opening a model or running a session.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The checkpoint files are missing or malformed.
    #[error(transparent)]
    Storage(#[from] deltafin_storage::StorageError),
    /// The config, a weight or the graph failed.
    #[error(transparent)]
    Model(#[from] deltafin_model::ModelError),
    /// The model directory has no `config.json`.
    #[error("{0}: no config.json (is this a model directory?)")]
    NoConfig(PathBuf),
    /// The checkpoint's experts disagree with the config.
    #[error("{dir}: {msg}")]
    ExpertLayout {
        /// Model directory.
        dir: PathBuf,
        /// What disagrees.
        msg: String,
    },
    /// A tensor has a dtype the engine cannot convert to f32.
    #[error("tensor {name}: unsupported dtype {dtype} for a dense weight")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// The model's tokenizer files are missing or malformed.
    #[error("tokenizer in {dir}: {msg}")]
    Tokenizer {
        /// Model directory.
        dir: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A snapshot file is unreadable, corrupt or from another model.
    #[error("snapshot {path}: {msg}")]
    Snapshot {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The memory budget cannot be given by this machine, or cannot hold what the model needs.
    #[error("{0}")]
    Budget(String),
    /// A session was asked to do something impossible (empty prompt, …).
    #[error("{0}")]
    Usage(String),
    /// A token mask (constrained decoding) failed or allowed no token.
    #[error("constrained decoding: {0}")]
    Constraint(String),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, RuntimeError>;
