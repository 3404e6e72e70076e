//! K3's XTML chat format: rendering conversations and parsing generated output.
//!
//! XTML is an XML-like markup whose brackets are special tokens:
//! `<|open|>message role="user"<|sep|>` ... `<|close|>message<|sep|><|end_of_msg|>`.
//! [`render`] turns OpenAI-shaped [`Message`]s into the prompt text and ids the
//! reference renderer produces; [`OutputParser`] turns generated ids back into
//! reasoning, answer text and tool calls.

pub mod json;
mod parse;
mod render;
mod types;

pub use crate::error::TextError;
pub use parse::{ChatEvent, OutputParser, ParsedToolCall, ParserStart};
pub use render::{
    CLOSE, ChatOptions, END_OF_MSG, IMAGE_PLACEHOLDER, OPEN, RenderedChat, ResponseFormat, SEP,
    Segment, ThinkingEffort, ToolChoice, encode_segments, render, render_segments,
};
pub use types::{
    AssistantMessage, Content, ContentPart, FunctionCall, FunctionDefinition, Message,
    SystemMessage, Tool, ToolCall, ToolMessage, UserMessage,
};
