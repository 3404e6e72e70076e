//! The error type of the model crate.

/// Boxed error from a weight or expert source implemented outside this crate.
pub type SourceError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while parsing a config, loading weights or running the graph.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` is malformed, misses a key or holds an unsupported value.
    #[error("config {file}: {msg}")]
    Config {
        /// The config file (or `<memory>`).
        file: String,
        /// What is wrong.
        msg: String,
    },
    /// A weight the graph needs is absent from the checkpoint.
    #[error("missing tensor {0}")]
    MissingWeight(String),
    /// A weight has a shape the config does not allow.
    #[error("tensor {name}: expected shape {expected:?}, found {actual:?}")]
    Shape {
        /// Full tensor name.
        name: String,
        /// Shape derived from the config.
        expected: Vec<usize>,
        /// Shape in the checkpoint.
        actual: Vec<usize>,
    },
    /// A weight holds values the graph cannot use.
    #[error("tensor {name}: {msg}")]
    BadWeight {
        /// Full tensor name.
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// A packed routed expert failed to decode.
    #[error("layer {layer} expert {expert}: {source}")]
    Expert {
        /// Layer index (0-based).
        layer: usize,
        /// Expert index.
        expert: usize,
        /// The decoding error.
        source: deltafin_quant::QuantError,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The requested device cannot be used (CUDA unavailable or not built in), or a device call failed.
    #[error("{0}")]
    Device(String),
    /// The background reader of the streamed spine did not deliver a layer.
    #[error("streamed spine, layer {layer}: {msg}")]
    SpineStream {
        /// The layer the forward pass was waiting for.
        layer: usize,
        /// What went wrong.
        msg: String,
    },
    /// The weight or expert source failed (I/O, format).
    #[error(transparent)]
    Source(SourceError),
    /// A tensor operation failed.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
