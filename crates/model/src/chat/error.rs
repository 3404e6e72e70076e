//! Errors of the chat renderer and the output parser.

use crate::tokenizer::TokenizerError;

/// Everything that can go wrong in [`crate::chat`]. Messages are lower case and
/// name the message (by 0-based position) or markup at fault.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The tokenizer failed (e.g. it lacks a markup special token).
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),

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
