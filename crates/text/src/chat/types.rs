//! Chat messages and tool declarations in OpenAI's JSON shapes.
//!
//! These deserialize straight from an OpenAI-style request body (`messages`,
//! `tools`) and serialize back to the same shapes. Fields K3 adds or reads
//! beyond OpenAI's (`reasoning_content`, a tool message's `name`) are optional.

use serde::{Deserialize, Serialize};

/// One message of a conversation, tagged by its `role`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    /// Instructions from the operator (`developer` is accepted as an alias).
    #[serde(alias = "developer")]
    System(SystemMessage),
    /// A user turn.
    User(UserMessage),
    /// An earlier assistant turn (history).
    Assistant(AssistantMessage),
    /// The result of a tool call.
    Tool(ToolMessage),
}

impl Message {
    /// A system message with plain-text content.
    pub fn system(content: impl Into<String>) -> Self {
        Self::System(SystemMessage {
            content: Some(Content::Text(content.into())),
            ..Default::default()
        })
    }

    /// A user message with plain-text content.
    pub fn user(content: impl Into<String>) -> Self {
        Self::User(UserMessage {
            content: Some(Content::Text(content.into())),
            name: None,
        })
    }

    /// An assistant message with plain-text content and optional reasoning.
    pub fn assistant(content: impl Into<String>, reasoning_content: Option<String>) -> Self {
        Self::Assistant(AssistantMessage {
            content: Some(Content::Text(content.into())),
            reasoning_content,
            ..Default::default()
        })
    }
}

/// `{"role": "system", ...}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemMessage {
    /// The instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// Optional participant name (rendered as a `name` attribute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tools announced mid-conversation (K3's lazy-loaded "New Tools Available").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
}

/// `{"role": "user", ...}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UserMessage {
    /// What the user wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// Optional participant name (rendered as a `name` attribute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `{"role": "assistant", ...}`: a previous model turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// The answer text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The reasoning that preceded the answer (K3 keeps it in history).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Alternative field name some clients use for `reasoning_content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool calls the assistant made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Optional participant name (rendered as a `name` attribute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `{"role": "tool", ...}`: a tool's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolMessage {
    /// The result text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The id of the assistant tool call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool's name (optional: resolved from the matching call otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// K3's own field for the tool's name; wins over `name` when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

/// Message content: a string, or OpenAI's list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Text and image parts.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// `{"type": "text", "text": ...}`.
    Text {
        /// The text.
        text: String,
    },
    /// `{"type": "image_url", "image_url": {...}}`; rendered as an image placeholder.
    ImageUrl {
        /// The image reference, as sent.
        image_url: serde_json::Value,
    },
    /// `{"type": "image", ...}`; rendered as an image placeholder.
    Image {
        /// The image reference, as sent.
        #[serde(default)]
        image: serde_json::Value,
    },
}

/// A tool call inside an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id, matched by a later tool message's `tool_call_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// Which function, with what arguments.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".to_owned()
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON object string (OpenAI's shape); empty means none.
    #[serde(default)]
    pub arguments: String,
}

/// A tool declaration (`tools[i]` of an OpenAI request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function's schema.
    pub function: FunctionDefinition,
    /// Any other fields, kept so that the declaration is rendered as sent.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The function schema of a [`Tool`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    /// Function name.
    pub name: String,
    /// What the function does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// Any other fields (`strict`, ...), kept so that the declaration is rendered as sent.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}
