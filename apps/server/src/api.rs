//! OpenAI request bodies as this server accepts them, and the checks that turn anything it cannot honour into a
//! 400 naming the field.
//!
//! A body is parsed in two steps: first as a JSON object whose keys are checked against what the endpoint
//! supports (a `null` value counts as absent, so clients that send every field work), then into a typed request
//! with the path of any type error (`messages[2].role: unknown variant ...`).

use deltafin_text::chat::{Message, Tool};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::logprobs::MAX_TOP_LOGPROBS;

/// A field accepted only with its default (or a harmless) value; `ok` tells which values pass.
struct Restricted {
    name: &'static str,
    ok: fn(&Value) -> bool,
    what: &'static str,
}

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}
fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn is_one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn is_empty_object(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty)
}
fn is_string(v: &Value) -> bool {
    v.is_string()
}

/// Fields of `/v1/chat/completions` that are honoured.
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "chat_template_kwargs",
    "response_format",
    "return_token_ids",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
];

/// Fields of `/v1/completions` that are honoured.
const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "return_token_ids",
    "logprobs",
];

/// Fields accepted by both endpoints when they ask for nothing this server would do differently.
const COMMON_RESTRICTED: &[Restricted] = &[
    Restricted {
        name: "n",
        ok: is_one,
        what: "only n = 1 is supported",
    },
    Restricted {
        name: "presence_penalty",
        ok: is_zero,
        what: "only 0 is supported",
    },
    Restricted {
        name: "frequency_penalty",
        ok: is_zero,
        what: "only 0 is supported",
    },
    Restricted {
        name: "logit_bias",
        ok: is_empty_object,
        what: "logit_bias is not supported (only an empty object)",
    },
    Restricted {
        name: "user",
        ok: is_string,
        what: "must be a string (it is accepted and ignored)",
    },
];

const CHAT_RESTRICTED: &[Restricted] = &[];

const COMPLETION_RESTRICTED: &[Restricted] = &[
    Restricted {
        name: "echo",
        ok: is_false,
        what: "echo is not supported (only false)",
    },
    Restricted {
        name: "best_of",
        ok: is_one,
        what: "only best_of = 1 is supported",
    },
];

/// Parses `body` as a JSON object and rejects fields outside `supported` and `restricted`.
fn checked_object(
    body: &[u8],
    supported: &[&str],
    restricted: &[&[Restricted]],
) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    for (key, value) in &object {
        if value.is_null() || supported.contains(&key.as_str()) {
            continue;
        }
        match restricted
            .iter()
            .flat_map(|r| r.iter())
            .find(|r| r.name == key)
        {
            Some(r) if (r.ok)(value) => {}
            Some(r) => {
                return Err(ApiError::unsupported(
                    key,
                    format!("unsupported value for `{key}`: {}", r.what),
                ));
            }
            None => {
                return Err(ApiError::unsupported(
                    key,
                    format!("unsupported field `{key}`"),
                ));
            }
        }
    }
    Ok(object)
}

/// Deserializes a checked request object, naming the path of the first type error. The shared sampling fields
/// are flattened into each request, and serde loses the path inside a flattened struct, so they are checked on
/// their own first.
fn typed<T: DeserializeOwned>(object: Map<String, Value>) -> Result<T, ApiError> {
    let object = Value::Object(object);
    with_path::<SamplingFields>(&object)?;
    with_path(&object)
}

/// Deserializes `value` as a `T`, naming the path of the first type error.
fn with_path<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(inner.to_string())
        } else {
            let field = path.split(['.', '[']).next().unwrap_or_default().to_owned();
            let field = if field.is_empty() {
                path.clone()
            } else {
                field
            };
            ApiError::invalid(field, format!("{path}: {inner}"))
        }
    })
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

impl StopField {
    /// The stop strings, checked: at most [`MAX_STOP_STRINGS`], none empty.
    pub fn strings(self) -> Result<Vec<String>, ApiError> {
        let stops = match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        };
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        Ok(stops)
    }
}

/// The sampling and length fields both endpoints share (flattened into each request).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// `max_tokens`.
    pub max_tokens: Option<u64>,
    /// `stop`.
    pub stop: Option<StopField>,
    /// `temperature` (default 0: greedy, as the engine).
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k` (an extension; 0 = off).
    pub top_k: Option<u64>,
    /// `seed`.
    pub seed: Option<i64>,
}

/// A `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model id; must be the served one.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<u64>,
    /// `max_tokens`, `stop`, `temperature`, `top_p`, `top_k`, `seed`.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Tools the model may call.
    pub tools: Option<Vec<Tool>>,
    /// `auto`, `required` or `none`.
    pub tool_choice: Option<Value>,
    /// `none` (thinking off), `low`, `high` or `max` (the default).
    pub reasoning_effort: Option<String>,
    /// Rendering switches: `thinking` (bool), `thinking_effort` (string).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `response_format`.
    pub response_format: Option<Value>,
    /// Return the prompt's and the answer's token ids (vLLM's extension).
    pub return_token_ids: Option<bool>,
    /// Return each answer token's log-probability.
    pub logprobs: Option<bool>,
    /// With `logprobs`, also this many most likely tokens at each position (0 to 20).
    pub top_logprobs: Option<u64>,
    /// `false`: at most one tool call per answer.
    pub parallel_tool_calls: Option<bool>,
}

/// `prompt` of `/v1/completions`: text or token ids, one prompt only.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch of texts (only one is accepted).
    Texts(Vec<String>),
    /// A batch of id lists (only one is accepted).
    IdLists(Vec<Vec<u32>>),
}

/// A prompt as the engine takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text to encode.
    Text(String),
    /// Ids as given.
    Ids(Vec<u32>),
}

impl PromptField {
    /// The one prompt, checked for emptiness.
    pub fn single(self) -> Result<Prompt, ApiError> {
        let batch = |n: usize| {
            ApiError::invalid(
                "prompt",
                format!("one prompt per request is supported, got {n}"),
            )
        };
        let prompt = match self {
            Self::Text(t) => Prompt::Text(t),
            Self::Ids(ids) => Prompt::Ids(ids),
            Self::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
            Self::Texts(v) => return Err(batch(v.len())),
            Self::IdLists(mut v) if v.len() == 1 => Prompt::Ids(v.remove(0)),
            Self::IdLists(v) => return Err(batch(v.len())),
        };
        let empty = match &prompt {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Ids(ids) => ids.is_empty(),
        };
        if empty {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"));
        }
        Ok(prompt)
    }
}

/// A `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model id; must be the served one.
    pub model: String,
    /// The prompt.
    pub prompt: PromptField,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// `max_tokens`, `stop`, `temperature`, `top_p`, `top_k`, `seed`.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Return the prompt's and the answer's token ids (vLLM's extension).
    pub return_token_ids: Option<bool>,
    /// Return each answer token's log-probability and this many most likely alternatives (0 to 20; `false` =
    /// none).
    pub logprobs: Option<Value>,
}

impl ChatRequest {
    /// The sampling and length fields.
    pub fn sampling(&self) -> SamplingFields {
        self.sampling.clone()
    }

    /// `Some(n)`: log-probabilities with `n` alternatives per token; checked against OpenAI's rules.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let top = match self.top_logprobs {
            Some(n) if n > MAX_TOP_LOGPROBS as u64 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ));
            }
            Some(n) => n as usize,
            None => 0,
        };
        match self.logprobs {
            Some(true) => Ok(Some(top)),
            _ if top > 0 => Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            )),
            _ => Ok(None),
        }
    }
}

impl CompletionRequest {
    /// The sampling and length fields.
    pub fn sampling(&self) -> SamplingFields {
        self.sampling.clone()
    }

    /// `Some(n)`: log-probabilities with `n` alternatives per token (`logprobs: n`; `false` means none).
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= MAX_TOP_LOGPROBS as u64 => Ok(Some(n as usize)),
                _ => Err(ApiError::invalid(
                    "logprobs",
                    format!("logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}"),
                )),
            },
        }
    }
}

/// Parses and checks a chat request body.
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let object = checked_object(body, CHAT_FIELDS, &[COMMON_RESTRICTED, CHAT_RESTRICTED])?;
    if !object.contains_key("messages") {
        return Err(ApiError::invalid("messages", "`messages` is required"));
    }
    require_model(&object)?;
    let request: ChatRequest = typed(object)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    Ok(request)
}

/// Parses and checks a completion request body.
pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let object = checked_object(
        body,
        COMPLETION_FIELDS,
        &[COMMON_RESTRICTED, COMPLETION_RESTRICTED],
    )?;
    if !object.contains_key("prompt") {
        return Err(ApiError::invalid("prompt", "`prompt` is required"));
    }
    if object.contains_key("suffix") {
        return Err(ApiError::unsupported(
            "suffix",
            "unsupported field `suffix`",
        ));
    }
    require_model(&object)?;
    typed(object)
}

fn require_model(object: &Map<String, Value>) -> Result<(), ApiError> {
    match object.get("model") {
        Some(Value::String(_)) => Ok(()),
        Some(_) => Err(ApiError::invalid("model", "`model` must be a string")),
        None => Err(ApiError::invalid("model", "`model` is required")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_err(body: &str) -> ApiError {
        parse_chat(body.as_bytes()).expect_err("should be rejected")
    }

    fn param(e: &ApiError) -> Option<&str> {
        match e {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            _ => None,
        }
    }

    #[test]
    fn unsupported_and_restricted_fields_are_named() {
        let base = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        for (extra, field) in [
            (r#""frobnicate":1"#, "frobnicate"),
            (r#""n":2"#, "n"),
            (r#""presence_penalty":0.5"#, "presence_penalty"),
            (r#""functions":[]"#, "functions"),
        ] {
            let e = chat_err(&format!("{{{base},{extra}}}"));
            assert_eq!(param(&e), Some(field), "{extra}: {e:?}");
            assert!(e.to_string().contains(field), "{e}");
        }
        // Defaults and nulls pass.
        let ok = format!(
            r#"{{{base},"n":1,"logprobs":false,"presence_penalty":0,"functions":null,"user":"u"}}"#
        );
        parse_chat(ok.as_bytes()).expect("defaults are accepted");
    }

    #[test]
    fn logprobs_fields_are_checked() {
        let base = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        let chat = |extra: &str| {
            parse_chat(format!("{{{base},{extra}}}").as_bytes()).and_then(|r| r.logprobs())
        };
        assert_eq!(chat(r#""logprobs":true"#), Ok(Some(0)));
        assert_eq!(chat(r#""logprobs":true,"top_logprobs":20"#), Ok(Some(20)));
        assert_eq!(chat(r#""logprobs":false"#), Ok(None));
        let e = chat(r#""logprobs":true,"top_logprobs":21"#).expect_err("21");
        assert_eq!(param(&e), Some("top_logprobs"));
        let e = chat(r#""top_logprobs":3"#).expect_err("needs logprobs");
        assert_eq!(param(&e), Some("top_logprobs"));
        let completion = |extra: &str| {
            parse_completion(format!(r#"{{"model":"m","prompt":"x",{extra}}}"#).as_bytes())
                .and_then(|r| r.logprobs())
        };
        assert_eq!(completion(r#""logprobs":5"#), Ok(Some(5)));
        assert_eq!(completion(r#""logprobs":0"#), Ok(Some(0)));
        assert_eq!(completion(r#""logprobs":false"#), Ok(None));
        for bad in [r#""logprobs":21"#, r#""logprobs":true"#, r#""logprobs":-1"#] {
            let e = completion(bad).expect_err(bad);
            assert_eq!(param(&e), Some("logprobs"), "{bad}");
        }
    }

    #[test]
    fn type_errors_name_the_path() {
        let e = chat_err(r#"{"model":"m","messages":[{"role":"robot","content":"hi"}]}"#);
        assert_eq!(param(&e), Some("messages"));
        assert!(e.to_string().contains("messages[0]"), "{e}");
        let e = chat_err(r#"{"model":"m","messages":[{"role":"user"}],"temperature":"hot"}"#);
        assert_eq!(param(&e), Some("temperature"), "{e:?}");
    }

    #[test]
    fn required_and_empty_fields() {
        assert_eq!(param(&chat_err(r#"{"model":"m"}"#)), Some("messages"));
        assert_eq!(
            param(&chat_err(r#"{"model":"m","messages":[]}"#)),
            Some("messages")
        );
        assert_eq!(
            param(&chat_err(r#"{"messages":[{"role":"user","content":"x"}]}"#)),
            Some("model")
        );
        assert!(matches!(
            chat_err("[1]"),
            ApiError::BadRequest { param: None, .. }
        ));
        let e = parse_completion(br#"{"model":"m","prompt":""}"#)
            .and_then(|r| r.prompt.single().map(|_| ()))
            .expect_err("empty prompt");
        assert_eq!(param(&e), Some("prompt"));
        let e = parse_completion(br#"{"model":"m","prompt":["a","b"]}"#)
            .and_then(|r| r.prompt.single().map(|_| ()))
            .expect_err("batch");
        assert_eq!(param(&e), Some("prompt"));
    }

    #[test]
    fn prompts_in_every_shape() {
        let one = |body: &str| {
            parse_completion(body.as_bytes())
                .and_then(|r| r.prompt.single())
                .expect("accepted")
        };
        assert_eq!(
            one(r#"{"model":"m","prompt":"hi"}"#),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            one(r#"{"model":"m","prompt":["hi"]}"#),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            one(r#"{"model":"m","prompt":[1,2]}"#),
            Prompt::Ids(vec![1, 2])
        );
        assert_eq!(one(r#"{"model":"m","prompt":[[3]]}"#), Prompt::Ids(vec![3]));
    }

    #[test]
    fn stop_strings_are_checked() {
        assert_eq!(
            StopField::One("x".into()).strings().expect("one"),
            vec!["x"]
        );
        assert!(StopField::Many(vec![String::new()]).strings().is_err());
        assert!(StopField::Many(vec!["a".into(); 5]).strings().is_err());
    }
}
