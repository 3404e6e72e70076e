//! Rendering a conversation in XTML, segment by segment.
//!
//! K3's renderer (`encoding_k3.py`) builds the prompt as a list of segments and
//! BPE-encodes each one *separately*: markup segments (`<|open|>`, `<|sep|>`, ...)
//! with special tokens recognised, text segments with none. Attribute pieces are
//! separate segments too (` role`, `="`, `user`, `"`), and encoding them joined
//! gives different ids, so [`render`] keeps the same boundaries.
//!
//! Order of the prompt: tool declarations, the thinking-effort note, the
//! conversation, tool-choice and response-format notes, the generation prompt.

use serde::{Deserialize, Serialize};

use super::json::{PyJson, Separators};
use super::types::{AssistantMessage, Content, ContentPart, Message, Tool, ToolCall, ToolMessage};
use crate::error::TextError;
use crate::tokenizer::Tokenizer;

/// Opens an XTML element: `<|open|>tag attrs<|sep|>`.
pub const OPEN: &str = "<|open|>";
/// Opens a closing tag: `<|close|>tag<|sep|>`.
pub const CLOSE: &str = "<|close|>";
/// Ends a tag.
pub const SEP: &str = "<|sep|>";
/// Ends a message; the stop token of generation.
pub const END_OF_MSG: &str = "<|end_of_msg|>";
/// Stands for an image in content; a vision front end replaces it.
pub const IMAGE_PLACEHOLDER: &str = "<|kimi_image_placeholder|>";

/// How much the model should think, announced in a system note when thinking is on.
///
/// The reference accepts exactly these three (its note also lists `medium`, but
/// the reference rejects it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThinkingEffort {
    /// `low`.
    Low,
    /// `high`.
    High,
    /// `max`, the reference default.
    #[default]
    Max,
}

impl ThinkingEffort {
    /// The value as written in the prompt.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::High => "high",
            Self::Max => "max",
        }
    }
}

impl std::str::FromStr for ThinkingEffort {
    type Err = TextError;

    fn from_str(s: &str) -> Result<Self, TextError> {
        match s {
            "low" => Ok(Self::Low),
            "high" => Ok(Self::High),
            "max" => Ok(Self::Max),
            other => Err(TextError::BadThinkingEffort(other.to_owned())),
        }
    }
}

/// OpenAI's `tool_choice`, as far as K3's renderer reacts to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoice {
    /// The model decides (no note is rendered).
    #[default]
    Auto,
    /// The model must call a tool.
    Required,
    /// The model must not call tools.
    None,
}

/// OpenAI's `response_format`, as far as K3's renderer reacts to it.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ResponseFormat {
    /// Free text (no note is rendered).
    #[default]
    Text,
    /// Raw JSON, no schema.
    JsonObject,
    /// Raw JSON matching this schema.
    JsonSchema(serde_json::Value),
}

impl ResponseFormat {
    /// Reads OpenAI's `response_format` the way the reference renderer does: a
    /// `type` of `json_object` or `json_schema`; the schema is taken from
    /// `json_schema.schema`, else `json_schema.json_schema`, else `json_schema`
    /// itself. Anything else (including `{"type": "text"}`) is plain text.
    pub fn from_openai(value: &serde_json::Value) -> Self {
        let kind = value
            .get("type")
            .and_then(|t| t.as_str())
            .or_else(|| value.as_str());
        match kind {
            Some("json_object") => Self::JsonObject,
            Some("json_schema") => {
                let wrapper = value.get("json_schema").unwrap_or(&serde_json::Value::Null);
                let schema = wrapper
                    .get("schema")
                    .or_else(|| wrapper.get("json_schema"))
                    .unwrap_or(wrapper);
                Self::JsonSchema(schema.clone())
            }
            _ => Self::Text,
        }
    }
}

/// Rendering options (the reference renderer's keyword arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Thinking on (default): history keeps think elements and the generation
    /// prompt opens a think element; off: both are absent.
    pub thinking: bool,
    /// Announced when thinking is on; `None` omits the note. Default `max`.
    pub thinking_effort: Option<ThinkingEffort>,
    /// Tools declared up front.
    pub tools: Vec<Tool>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// `response_format`.
    pub response_format: ResponseFormat,
    /// Append the opening of the assistant's turn (default true).
    pub add_generation_prompt: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            thinking: true,
            thinking_effort: Some(ThinkingEffort::Max),
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            response_format: ResponseFormat::Text,
            add_generation_prompt: true,
        }
    }
}

/// A run of prompt text and how it must be encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// Markup is encoded with special tokens recognised; text with none.
    pub markup: bool,
}

/// A rendered prompt: its text and its token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The prompt as one string (for display and debugging; never re-encode it whole).
    pub text: String,
    /// The prompt's ids, each segment encoded separately.
    pub ids: Vec<u32>,
}

/// Renders and tokenizes a conversation exactly as K3's reference renderer.
pub fn render(
    tokenizer: &Tokenizer,
    messages: &[Message],
    options: &ChatOptions,
) -> Result<RenderedChat, TextError> {
    let segments = render_segments(messages, options)?;
    Ok(encode_segments(tokenizer, &segments))
}

/// Encodes segments one by one (markup with specials, text without) and concatenates.
pub fn encode_segments(tokenizer: &Tokenizer, segments: &[Segment]) -> RenderedChat {
    let mut text = String::new();
    let mut ids = Vec::new();
    for segment in segments {
        text.push_str(&segment.text);
        if segment.markup {
            ids.extend(tokenizer.encode_with_specials(&segment.text));
        } else {
            ids.extend(tokenizer.encode(&segment.text));
        }
    }
    RenderedChat { text, ids }
}

/// Renders a conversation into segments, without tokenizing.
pub fn render_segments(
    messages: &[Message],
    options: &ChatOptions,
) -> Result<Vec<Segment>, TextError> {
    let mut out = Segments::default();

    if !options.tools.is_empty() {
        out.tool_declare(&options.tools, false);
    }
    if options.thinking
        && let Some(effort) = options.thinking_effort
    {
        out.internal_system_message(
            "thinking-effort",
            &format!(
                "`thinking_effort` guides on how much to think in your thinking channel (not including the \
                 response channel), supported values include `low`, `medium`, `high`, and `max`.\n\
                 Now the system is invoked with `thinking_effort={}`.",
                effort.as_str()
            ),
        );
    }

    // Tool messages are numbered per assistant turn and name their tool.
    let mut last_calls: &[ToolCall] = &[];
    let mut tool_index = 0usize;
    for (position, message) in order_tool_results(messages) {
        match message.as_ref() {
            Message::User(m) => out.plain_message("user", m.name.as_deref(), m.content.as_ref()),
            Message::System(m) => match &m.tools {
                Some(tools) if !tools.is_empty() => out.tool_declare(tools, true),
                _ => out.plain_message("system", m.name.as_deref(), m.content.as_ref()),
            },
            Message::Assistant(m) => {
                // Assistant messages are never reordered, so `position` is theirs.
                if let Message::Assistant(original) = &messages[position] {
                    last_calls = &original.tool_calls;
                }
                tool_index = 0;
                let mut attrs = vec![("role", "assistant".to_owned())];
                push_name(&mut attrs, m.name.as_deref());
                out.open_tag("message", &attrs);
                out.assistant_body(m, options.thinking, position)?;
                out.close_tag("message");
                out.markup(END_OF_MSG);
            }
            Message::Tool(m) => {
                tool_index += 1;
                let name = tool_name(m, last_calls, tool_index)
                    .ok_or(TextError::UnresolvableToolName { message: position })?;
                out.open_tag(
                    "message",
                    &[
                        ("role", "tool".to_owned()),
                        ("tool", name),
                        ("index", tool_index.to_string()),
                    ],
                );
                out.content(m.content.as_ref());
                out.close_tag("message");
                out.markup(END_OF_MSG);
            }
        }
    }

    match options.tool_choice {
        ToolChoice::Auto => {}
        ToolChoice::Required => out.internal_system_message(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        ToolChoice::None => out.internal_system_message(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
    }
    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks (```json) or any \
                            additional formatting.";
    match &options.response_format {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => out.internal_system_message(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
        ),
        ResponseFormat::JsonSchema(schema) => {
            let schema = PyJson::sorted_from_value(schema).dumps(Separators::Compact);
            out.internal_system_message(
                "response-format",
                &format!(
                    "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n\
                     The JSON data must match the following schema:\n```json\n{schema}\n```"
                ),
            );
        }
    }

    if options.add_generation_prompt {
        out.open_tag("message", &[("role", "assistant".to_owned())]);
        out.open_tag(
            if options.thinking {
                "think"
            } else {
                "response"
            },
            &[],
        );
    }
    Ok(out.segments)
}

fn push_name(attrs: &mut Vec<(&'static str, String)>, name: Option<&str>) {
    if let Some(name) = name.filter(|n| !n.is_empty()) {
        attrs.push(("name", name.to_owned()));
    }
}

/// The name a tool message is rendered with: its own `tool`/`name`, else the
/// function name of the call at the same position in the last assistant turn.
fn tool_name(message: &ToolMessage, calls: &[ToolCall], tool_index: usize) -> Option<String> {
    message
        .tool
        .clone()
        .or_else(|| message.name.clone())
        .or_else(|| {
            calls
                .get(tool_index.checked_sub(1)?)
                .map(|c| c.function.name.clone())
        })
}

/// Puts each run of consecutive tool messages into the order of the calls they
/// answer (matched by `tool_call_id` against the latest assistant's calls), and
/// names each after its call. XTML binds a result to its call by position, while
/// OpenAI clients bind by id and may send results in any order. A run with any
/// unmatched message is left as sent. Yields `(original position, message)`.
fn order_tool_results(messages: &[Message]) -> Vec<(usize, std::borrow::Cow<'_, Message>)> {
    use std::borrow::Cow;

    let mut out = Vec::with_capacity(messages.len());
    let mut calls: &[ToolCall] = &[];
    let mut i = 0;
    while i < messages.len() {
        let Message::Tool(_) = &messages[i] else {
            if let Message::Assistant(m) = &messages[i] {
                calls = &m.tool_calls;
            }
            out.push((i, Cow::Borrowed(&messages[i])));
            i += 1;
            continue;
        };
        let run_end = messages[i..]
            .iter()
            .position(|m| !matches!(m, Message::Tool(_)))
            .map_or(messages.len(), |n| i + n);
        // (call position, offset in run, call name) per message, if all match.
        let matched: Option<Vec<(usize, usize, &str)>> = (i..run_end)
            .map(|j| {
                let Message::Tool(m) = &messages[j] else {
                    return None;
                };
                let id = m.tool_call_id.as_deref()?;
                // The first call with this id wins, as in the reference.
                let position = calls.iter().position(|c| c.id.as_deref() == Some(id))?;
                Some((position, j - i, calls[position].function.name.as_str()))
            })
            .collect();
        match matched {
            Some(mut order) => {
                order.sort_by_key(|&(position, offset, _)| (position, offset));
                for (_, offset, name) in order {
                    let j = i + offset;
                    let mut message = messages[j].clone();
                    if let Message::Tool(m) = &mut message {
                        m.tool = Some(name.to_owned());
                        if m.name.is_some() {
                            m.name = Some(name.to_owned());
                        }
                    }
                    out.push((j, Cow::Owned(message)));
                }
            }
            None => out.extend((i..run_end).map(|j| (j, Cow::Borrowed(&messages[j])))),
        }
        i = run_end;
    }
    out
}

/// Escapes an attribute value: `&` first, then `"`.
fn escape_attr(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Accumulates segments; empty text is dropped, as in the reference.
#[derive(Default)]
struct Segments {
    segments: Vec<Segment>,
}

impl Segments {
    fn push(&mut self, text: &str, markup: bool) {
        if !text.is_empty() {
            self.segments.push(Segment {
                text: text.to_owned(),
                markup,
            });
        }
    }

    fn markup(&mut self, text: &str) {
        self.push(text, true);
    }

    fn text(&mut self, text: &str) {
        self.push(text, false);
    }

    fn open_tag(&mut self, tag: &str, attrs: &[(&str, String)]) {
        self.markup(OPEN);
        self.text(tag);
        for (key, value) in attrs {
            self.text(&format!(" {key}"));
            self.text("=\"");
            self.text(&escape_attr(value));
            self.text("\"");
        }
        self.markup(SEP);
    }

    fn close_tag(&mut self, tag: &str) {
        self.markup(CLOSE);
        self.text(tag);
        self.markup(SEP);
    }

    fn content(&mut self, content: Option<&Content>) {
        match content {
            None => {}
            Some(Content::Text(text)) => self.text(text),
            Some(Content::Parts(parts)) => {
                for part in parts {
                    match part {
                        ContentPart::Text { text } => self.text(text),
                        ContentPart::ImageUrl { .. } | ContentPart::Image { .. } => {
                            self.markup(IMAGE_PLACEHOLDER)
                        }
                    }
                }
            }
        }
    }

    fn plain_message(&mut self, role: &str, name: Option<&str>, content: Option<&Content>) {
        let mut attrs = vec![("role", role.to_owned())];
        push_name(&mut attrs, name);
        self.open_tag("message", &attrs);
        self.content(content);
        self.close_tag("message");
        self.markup(END_OF_MSG);
    }

    /// A system note the renderer adds itself (`type="..."`).
    fn internal_system_message(&mut self, kind: &str, body: &str) {
        self.open_tag(
            "message",
            &[("role", "system".to_owned()), ("type", kind.to_owned())],
        );
        self.text(body.trim());
        self.close_tag("message");
        self.markup(END_OF_MSG);
    }

    fn tool_declare(&mut self, tools: &[Tool], dynamic: bool) {
        // Tools are written with every object's keys sorted, compactly.
        let tools = serde_json::to_value(tools)
            .map(|v| PyJson::sorted_from_value(&v).dumps(Separators::Compact));
        // Serializing plain structs of strings and JSON values cannot fail.
        let tools = tools.unwrap_or_default();
        let header = if dynamic {
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n\
             You have access to all existing and extended tools.\nHere are the specs for the extended tools."
        } else {
            "# Tools\nHere are the available tools, described in JSONSchema."
        };
        self.open_tag(
            "message",
            &[
                ("role", "system".to_owned()),
                ("type", "tool-declare".to_owned()),
            ],
        );
        self.text(&format!("{header}\n\n```json\n{tools}\n```"));
        self.close_tag("message");
        self.markup(END_OF_MSG);
    }

    fn assistant_body(
        &mut self,
        message: &AssistantMessage,
        thinking: bool,
        position: usize,
    ) -> Result<(), TextError> {
        if thinking {
            // `reasoning_content or reasoning`: an empty string falls through.
            let reasoning = message
                .reasoning_content
                .as_deref()
                .filter(|r| !r.is_empty())
                .or(message.reasoning.as_deref());
            self.open_tag("think", &[]);
            if let Some(reasoning) = reasoning.filter(|r| !r.trim().is_empty()) {
                self.text(reasoning);
            }
            self.close_tag("think");
        }
        self.open_tag("response", &[]);
        self.content(message.content.as_ref());
        self.close_tag("response");

        if message.tool_calls.is_empty() {
            return Ok(());
        }
        self.open_tag("tools", &[]);
        for (i, call) in message.tool_calls.iter().enumerate() {
            let index = i + 1;
            if call.function.name.is_empty() {
                return Err(TextError::ToolCallWithoutName {
                    message: position,
                    call: index,
                });
            }
            self.open_tag(
                "call",
                &[
                    ("tool", call.function.name.clone()),
                    ("index", index.to_string()),
                ],
            );
            let arguments = &call.function.arguments;
            if !arguments.trim().is_empty() {
                match PyJson::parse(arguments) {
                    Ok(PyJson::Object(entries)) => {
                        for (key, value) in entries {
                            self.open_tag(
                                "argument",
                                &[("key", key), ("type", value.xtml_type().to_owned())],
                            );
                            match value {
                                PyJson::Str(s) => self.text(&s),
                                other => self.text(&other.dumps(Separators::Python)),
                            }
                            self.close_tag("argument");
                        }
                    }
                    Ok(_) => {
                        return Err(TextError::ToolArgumentsNotObject {
                            message: position,
                            call: index,
                        });
                    }
                    // Arguments that are not JSON at all are shown back verbatim.
                    Err(_) => {
                        self.open_tag("json", &[("type", "object".to_owned())]);
                        self.text(arguments);
                        self.close_tag("json");
                    }
                }
            }
            self.close_tag("call");
        }
        self.close_tag("tools");
        Ok(())
    }
}
