//! Incremental parsing of generated XTML: ids in, reasoning / answer / tool calls out.
//!
//! The generation prompt leaves the model inside an open assistant message, in a
//! think element (thinking on) or a response element (thinking off). From there
//! the model writes, in token ids:
//!
//! ```text
//! reasoning<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>
//! <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!   <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
//! <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
//! ```
//!
//! Text inside think and response is released as it arrives (whole characters
//! only); a tool call is released when its `call` element closes, with its
//! arguments rebuilt as one JSON object string.

use std::sync::Arc;

use super::json::write_string;
use super::render::{CLOSE, END_OF_MSG, OPEN, SEP};
use crate::error::TextError;
use crate::tokenizer::{Tokenizer, Utf8Buffer};

/// Where generation starts: right after the generation prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParserStart {
    /// Thinking on: the prompt ended with `<|open|>think<|sep|>`.
    Thinking,
    /// Thinking off: the prompt ended with `<|open|>response<|sep|>`.
    Response,
}

impl ParserStart {
    /// The start matching a rendering option (`ChatOptions::thinking`).
    pub fn for_thinking(thinking: bool) -> Self {
        if thinking {
            Self::Thinking
        } else {
            Self::Response
        }
    }
}

/// A tool call the model completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    /// The `index` attribute (1-based position in the message), or the call's
    /// position if the attribute is missing or not a number.
    pub index: usize,
    /// The function name (`tool` attribute).
    pub name: String,
    /// The arguments as a JSON object string, keys in the order generated.
    pub arguments: String,
}

/// What the parser reports as generation proceeds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatEvent {
    /// More reasoning text.
    Reasoning(String),
    /// More answer text.
    Content(String),
    /// A complete tool call.
    ToolCall(ParsedToolCall),
    /// `<|end_of_msg|>`: the turn is over.
    End,
}

/// An open XTML element.
#[derive(Debug)]
enum Element {
    Message,
    Think,
    Response,
    Tools,
    Call(CallState),
    Argument {
        key: String,
        kind: String,
        value: Vec<u8>,
    },
    Json {
        value: Vec<u8>,
    },
}

impl Element {
    fn tag(&self) -> &'static str {
        match self {
            Self::Message => "message",
            Self::Think => "think",
            Self::Response => "response",
            Self::Tools => "tools",
            Self::Call(_) => "call",
            Self::Argument { .. } => "argument",
            Self::Json { .. } => "json",
        }
    }
}

#[derive(Debug, Default)]
struct CallState {
    name: String,
    index: Option<usize>,
    /// `(key, JSON text of the value)` from argument elements.
    arguments: Vec<(String, String)>,
    /// The body of a `json` element, if the call used one.
    json: Option<String>,
}

/// The ids of the four markup tokens.
#[derive(Debug, Clone, Copy)]
struct MarkupIds {
    open: u32,
    close: u32,
    sep: u32,
    end: u32,
}

#[derive(Debug)]
enum Mode {
    /// Inside element bodies.
    Body,
    /// After `<|open|>` (or `<|close|>` when `closing`), collecting the tag up to `<|sep|>`.
    Tag { closing: bool, bytes: Vec<u8> },
    /// After `<|end_of_msg|>`.
    Done,
}

/// Incremental parser over generated ids. Feed ids with [`OutputParser::push`].
#[derive(Debug)]
pub struct OutputParser {
    tokenizer: Arc<Tokenizer>,
    ids: MarkupIds,
    stack: Vec<Element>,
    mode: Mode,
    reasoning: Utf8Buffer,
    content: Utf8Buffer,
    n_calls: usize,
}

impl OutputParser {
    /// A parser positioned right after the generation prompt.
    ///
    /// Fails if the tokenizer lacks one of K3's markup tokens.
    pub fn new(tokenizer: Arc<Tokenizer>, start: ParserStart) -> Result<Self, TextError> {
        let ids = MarkupIds {
            open: tokenizer.require_special(OPEN)?,
            close: tokenizer.require_special(CLOSE)?,
            sep: tokenizer.require_special(SEP)?,
            end: tokenizer.require_special(END_OF_MSG)?,
        };
        let first = match start {
            ParserStart::Thinking => Element::Think,
            ParserStart::Response => Element::Response,
        };
        Ok(Self {
            tokenizer,
            ids,
            stack: vec![Element::Message, first],
            mode: Mode::Body,
            reasoning: Utf8Buffer::new(),
            content: Utf8Buffer::new(),
            n_calls: 0,
        })
    }

    /// Whether `<|end_of_msg|>` has been seen.
    pub fn is_done(&self) -> bool {
        matches!(self.mode, Mode::Done)
    }

    /// Feeds one generated id; returns the events it completes (often none).
    pub fn push(&mut self, id: u32) -> Result<Vec<ChatEvent>, TextError> {
        let mut events = Vec::new();
        let ids = self.ids;
        let tokenizer = Arc::clone(&self.tokenizer);
        let token = tokenizer.id_to_bytes(id).ok_or(TextError::UnknownId {
            id,
            vocab_size: tokenizer.vocab_size(),
        })?;
        match &mut self.mode {
            Mode::Done => return Err(TextError::AfterEnd),
            _ if id == ids.end => {
                self.flush_text(&mut events);
                events.push(ChatEvent::End);
                self.mode = Mode::Done;
            }
            Mode::Tag { closing, bytes } => {
                if id == ids.sep {
                    let (closing, tag) = (*closing, String::from_utf8_lossy(bytes).into_owned());
                    self.mode = Mode::Body;
                    if closing {
                        self.close_element(&tag, &mut events)?;
                    } else {
                        self.open_element(&tag, &mut events)?;
                    }
                } else if id == ids.open || id == ids.close {
                    return Err(TextError::UnexpectedMarkup(format!(
                        "{} inside the tag {:?}",
                        if id == ids.open { OPEN } else { CLOSE },
                        String::from_utf8_lossy(bytes)
                    )));
                } else {
                    bytes.extend_from_slice(token);
                }
            }
            Mode::Body => {
                if id == ids.open || id == ids.close {
                    self.mode = Mode::Tag {
                        closing: id == ids.close,
                        bytes: Vec::new(),
                    };
                } else if id == ids.sep {
                    return Err(TextError::UnexpectedMarkup(format!("{SEP} outside a tag")));
                } else {
                    self.body_text(token, &mut events);
                }
            }
        }
        Ok(events)
    }

    /// Ends a stream that stopped without `<|end_of_msg|>` (e.g. at a length
    /// limit): releases buffered text. An unfinished tool call is dropped.
    pub fn finish(&mut self) -> Vec<ChatEvent> {
        let mut events = Vec::new();
        if !self.is_done() {
            self.flush_text(&mut events);
            self.mode = Mode::Done;
        }
        events
    }

    fn body_text(&mut self, bytes: &[u8], events: &mut Vec<ChatEvent>) {
        match self.stack.last_mut() {
            Some(Element::Think) => {
                push_text(&mut self.reasoning, bytes, ChatEvent::Reasoning, events)
            }
            Some(Element::Response) => {
                push_text(&mut self.content, bytes, ChatEvent::Content, events)
            }
            // Text directly in the message, outside think/response: keep it as
            // answer text, except layout whitespace between elements.
            Some(Element::Message) | None => {
                let text = self.content.push(bytes);
                if !text.trim().is_empty() {
                    events.push(ChatEvent::Content(text));
                }
            }
            Some(Element::Argument { value, .. } | Element::Json { value }) => {
                value.extend_from_slice(bytes)
            }
            // Between the elements of a tool list: only layout whitespace is expected.
            Some(Element::Tools | Element::Call(_)) => {}
        }
    }

    fn flush_text(&mut self, events: &mut Vec<ChatEvent>) {
        let reasoning = self.reasoning.finish();
        if !reasoning.is_empty() {
            events.push(ChatEvent::Reasoning(reasoning));
        }
        let content = self.content.finish();
        if !content.is_empty() {
            events.push(ChatEvent::Content(content));
        }
    }

    fn open_element(&mut self, tag: &str, events: &mut Vec<ChatEvent>) -> Result<(), TextError> {
        let (name, attrs) = parse_tag(tag)
            .ok_or_else(|| TextError::UnexpectedMarkup(format!("malformed tag {tag:?}")))?;
        let attr = |key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        let element = match name {
            "think" => Element::Think,
            "response" => Element::Response,
            "tools" => Element::Tools,
            "call" => Element::Call(CallState {
                name: attr("tool").unwrap_or_default(),
                index: attr("index").and_then(|i| i.parse().ok()),
                ..Default::default()
            }),
            "argument" => Element::Argument {
                key: attr("key").unwrap_or_default(),
                kind: attr("type").unwrap_or_else(|| "string".to_owned()),
                value: Vec::new(),
            },
            "json" => Element::Json { value: Vec::new() },
            _ => {
                return Err(TextError::UnexpectedMarkup(format!(
                    "unknown element {tag:?}"
                )));
            }
        };
        // Leaving a text channel: release what it holds.
        self.flush_text(events);
        self.stack.push(element);
        Ok(())
    }

    fn close_element(&mut self, tag: &str, events: &mut Vec<ChatEvent>) -> Result<(), TextError> {
        let name = tag.trim();
        if !self.stack.iter().any(|e| e.tag() == name) {
            return Err(TextError::UnexpectedMarkup(format!(
                "closing tag {name:?} with no open element"
            )));
        }
        self.flush_text(events);
        // Close any elements left open inside the one being closed.
        while let Some(element) = self.stack.pop() {
            let done = element.tag() == name;
            match element {
                Element::Argument { key, kind, value } => {
                    if let Some(Element::Call(call)) = self.stack.last_mut() {
                        call.arguments
                            .push((key, argument_json(&kind, &String::from_utf8_lossy(&value))));
                    }
                }
                Element::Json { value } => {
                    if let Some(Element::Call(call)) = self.stack.last_mut() {
                        call.json = Some(String::from_utf8_lossy(&value).into_owned());
                    }
                }
                Element::Call(call) => {
                    self.n_calls += 1;
                    events.push(ChatEvent::ToolCall(finish_call(call, self.n_calls)));
                }
                Element::Message | Element::Think | Element::Response | Element::Tools => {}
            }
            if done {
                break;
            }
        }
        Ok(())
    }
}

fn push_text(
    buffer: &mut Utf8Buffer,
    bytes: &[u8],
    event: fn(String) -> ChatEvent,
    events: &mut Vec<ChatEvent>,
) {
    let text = buffer.push(bytes);
    if !text.is_empty() {
        events.push(event(text));
    }
}

/// Splits `name key="value" ...` into the name and unescaped attributes.
fn parse_tag(tag: &str) -> Option<(&str, Vec<(String, String)>)> {
    let tag = tag.trim();
    let (name, mut rest) = tag.split_once(' ').unwrap_or((tag, ""));
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some((name, attrs));
        }
        let (key, after) = rest.split_once("=\"")?;
        let (value, after) = after.split_once('"')?;
        attrs.push((
            key.trim().to_owned(),
            value.replace("&quot;", "\"").replace("&amp;", "&"),
        ));
        rest = after;
    }
}

/// JSON text for an argument value of the given XTML type. Strings are quoted;
/// other types are the value's own JSON when it parses, else quoted as a string.
fn argument_json(kind: &str, value: &str) -> String {
    if kind != "string" && serde_json::from_str::<serde::de::IgnoredAny>(value).is_ok() {
        return value.trim().to_owned();
    }
    let mut out = String::new();
    write_string(&mut out, value);
    out
}

fn finish_call(call: CallState, position: usize) -> ParsedToolCall {
    let arguments = match call.json {
        Some(json) => json.trim().to_owned(),
        None => {
            let mut out = String::from("{");
            for (i, (key, value)) in call.arguments.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(&mut out, key);
                out.push(':');
                out.push_str(value);
            }
            out.push('}');
            out
        }
    };
    ParsedToolCall {
        index: call.index.unwrap_or(position),
        name: call.name,
        arguments,
    }
}
