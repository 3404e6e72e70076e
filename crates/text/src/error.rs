//! The crate's one error type: loading a tokenizer, encoding and decoding ids, rendering a chat and parsing
//! generated output.

use std::path::PathBuf;

/// Everything that can go wrong in [`crate::tokenizer`] and [`crate::chat`].
///
/// Messages are lower case and name the file (and line) at fault, so a user who
/// points the engine at a broken model directory learns which file to fix.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A `tiktoken.model` line is not `base64(bytes) rank`.
    #[error("{path}:{line}: {reason}")]
    MalformedLine {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line (bad base64, missing or non-numeric rank, ...).
        reason: String,
    },

    /// Two lines of `tiktoken.model` carry the same rank.
    #[error("{path}:{line}: duplicate rank {rank} (first seen on line {first_line})")]
    DuplicateRank {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// 1-based line number of the second occurrence.
        line: usize,
        /// The repeated rank.
        rank: u32,
        /// 1-based line number of the first occurrence.
        first_line: usize,
    },

    /// Two lines of `tiktoken.model` carry the same token bytes.
    #[error("{path}:{line}: duplicate token bytes (first seen on line {first_line})")]
    DuplicateToken {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// 1-based line number of the second occurrence.
        line: usize,
        /// 1-based line number of the first occurrence.
        first_line: usize,
    },

    /// The ranks of `tiktoken.model` are not exactly `0..n`.
    #[error("{path}: ranks are not contiguous: {n_ranks} tokens but rank {missing} is missing")]
    RankGap {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// Number of tokens in the file.
        n_ranks: usize,
        /// The smallest rank in `0..n_ranks` that no line carries.
        missing: u32,
    },

    /// Byte-level BPE needs every single byte as a token; this one is absent.
    #[error("{path}: no token for the single byte 0x{byte:02x}, so some text could not be encoded")]
    MissingByte {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// The byte without a token.
        byte: u8,
    },

    /// `tokenizer_config.json` is not valid JSON or lacks the expected shape.
    #[error("{path}: {reason}")]
    BadConfig {
        /// The `tokenizer_config.json` file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A special token name was required but the tokenizer has no such token.
    #[error("unknown special token {name:?}")]
    UnknownSpecial {
        /// The name that was asked for, e.g. `<|open|>`.
        name: String,
    },

    /// A token id outside the vocabulary was given to a decoder.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    UnknownId {
        /// The offending id.
        id: u32,
        /// The vocabulary size (ids must be below it).
        vocab_size: usize,
    },

    /// Decoded bytes are not valid UTF-8 (use `decode_bytes` or a lossy decode).
    #[error("decoded tokens are not valid utf-8: {0}")]
    InvalidUtf8(#[from] std::string::FromUtf8Error),

    /// `thinking_effort` is not one K3 accepts.
    #[error("unsupported thinking_effort {0:?}; supported values are low, high and max")]
    BadThinkingEffort(String),

    /// A tool call in an assistant message has an empty function name.
    #[error("message {message}: tool call {call} has no function name")]
    ToolCallWithoutName {
        /// 0-based message position.
        message: usize,
        /// 1-based call position within the message.
        call: usize,
    },

    /// Tool-call arguments parsed as JSON but not as an object.
    #[error("message {message}: tool call {call} arguments must be a JSON object")]
    ToolArgumentsNotObject {
        /// 0-based message position.
        message: usize,
        /// 1-based call position within the message.
        call: usize,
    },

    /// A tool message carries no name and matches no preceding tool call.
    #[error(
        "message {message}: tool message needs a resolvable tool name: set `name`/`tool`, or follow an assistant tool call"
    )]
    UnresolvableToolName {
        /// 0-based message position.
        message: usize,
    },

    /// Generated markup the output parser cannot place.
    #[error("unexpected markup in generated output: {0}")]
    UnexpectedMarkup(String),

    /// A token was fed to the output parser after `<|end_of_msg|>`.
    #[error("token fed to the output parser after the end of the message")]
    AfterEnd,
}

impl TextError {
    /// Whether the error is the caller's conversation (a message the renderer refuses), as opposed to the tokenizer
    /// or its files: a server answers the first with 400 and the second with 500.
    pub fn is_bad_conversation(&self) -> bool {
        matches!(
            self,
            Self::BadThinkingEffort(_)
                | Self::ToolCallWithoutName { .. }
                | Self::ToolArgumentsNotObject { .. }
                | Self::UnresolvableToolName { .. }
        )
    }
}

/// A result whose error is [`TextError`].
pub type Result<T, E = TextError> = std::result::Result<T, E>;
