//! The grammar a chat answer must follow when a request constrains it, written in llguidance's Lark dialect over
//! K3's XTML output.
//!
//! What the model writes after the generation prompt (see `deltafin_text::chat::parse`) is
//!
//! ```text
//! [reasoning <|close|>think<|sep|><|open|>response<|sep|>]  answer <|close|>response<|sep|>
//! [<|open|>tools<|sep|> call+ <|close|>tools<|sep|>]  <|close|>message<|sep|>  <|end_of_msg|>
//! ```
//!
//! The reasoning is free text (thinking is never constrained). With `response_format` `json_object` or
//! `json_schema` the answer is JSON matching the schema; otherwise it is free text. With tools declared, a call
//! names one of them and its arguments follow the tool's parameter schema, in K3's own form: one `argument`
//! element per property (`key`, `type`, the value raw for strings and as JSON otherwise), required properties
//! always, optional ones at will, in the schema's order; a schema that form cannot express exactly (no
//! `properties`, a property of several types, a string with a pattern, ...) makes the call use K3's `json`
//! element, whose body is the arguments object as JSON matching the whole schema. `tool_choice` `required` forces
//! at least one call right after the reasoning (the answer text is then empty), `none` forbids calls;
//! `parallel_tool_calls: false` allows one call per answer. `<|end_of_msg|>` is the tokenizer's end-of-sequence for the grammar, so
//! it is allowed exactly where the grammar is complete.
//!
//! JSON is written as Python's `json.dumps` writes it (`", "` and `": "`, no other whitespace), the form K3 sees
//! tool arguments in; no free whitespace also keeps a constrained answer finite.

use std::fmt::Write as _;

use deltafin_text::chat::{ResponseFormat, Tool, ToolChoice};
use serde_json::{Map, Value, json};

/// What a request asks the answer to follow.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerSpec<'a> {
    /// Thinking on: the answer starts inside the think element.
    pub thinking: bool,
    /// `response_format`.
    pub format: &'a ResponseFormat,
    /// Declared tools.
    pub tools: &'a [Tool],
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// `parallel_tool_calls`: more than one call per answer (OpenAI's default).
    pub parallel_calls: bool,
}

impl AnswerSpec<'_> {
    /// Whether anything is constrained: a JSON answer, or tools whose calls must follow their schemas.
    pub fn is_constrained(&self) -> bool {
        !matches!(self.format, ResponseFormat::Text) || !self.tools.is_empty()
    }
}

/// Why a grammar cannot be built: the message names the request field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarError {
    /// The field (`response_format`, `tools`).
    pub param: &'static str,
    /// What is wrong.
    pub message: String,
}

/// Options every inline JSON schema carries (llguidance's `x-guidance`).
fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `%json { ... }` for `schema`, with the writing options added; a schema that is not an object is refused.
fn inline_json(schema: &Value, param: &'static str) -> Result<String, GrammarError> {
    let mut schema = match schema {
        Value::Object(map) => map.clone(),
        Value::Bool(true) => Map::new(),
        _ => {
            return Err(GrammarError {
                param,
                message: format!("{param}: a JSON schema must be an object"),
            });
        }
    };
    schema.insert("x-guidance".to_owned(), json_options());
    Ok(format!("%json {}", Value::Object(schema)))
}

/// A Lark string literal (Lark's literals are JSON strings).
fn lit(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// The Lark grammar of an answer to `spec` (call only when [`AnswerSpec::is_constrained`]).
pub fn lark(spec: &AnswerSpec<'_>) -> Result<String, GrammarError> {
    let mut g = String::new();
    let head = if spec.thinking {
        r#"REASONING <|close|> "think" <|sep|> <|open|> "response" <|sep|> "#
    } else {
        ""
    };
    let answer = match spec.format {
        ResponseFormat::Text => "TEXT",
        ResponseFormat::JsonObject | ResponseFormat::JsonSchema(_) => "json_answer",
    };
    let calls_allowed = !spec.tools.is_empty() && spec.tool_choice != ToolChoice::None;
    let body = match (calls_allowed, spec.tool_choice) {
        (false, _) => format!("{answer} close_response"),
        // A required call comes at once, as OpenAI's answers to `required` have no content.
        (true, ToolChoice::Required) => "close_response tools".to_owned(),
        (true, _) => format!("{answer} close_response | TEXT close_response tools"),
    };
    let _ = writeln!(g, "start: {head}body close_message");
    let _ = writeln!(g, "body: {body}");
    g.push_str("close_response: <|close|> \"response\" <|sep|>\n");
    g.push_str("close_message: <|close|> \"message\" <|sep|>\n");
    g.push_str("REASONING: /(?s:.*)/\nTEXT: /(?s:.*)/\n");
    match spec.format {
        ResponseFormat::Text => {}
        ResponseFormat::JsonObject => {
            let _ = writeln!(
                g,
                "json_answer: {}",
                inline_json(&json!({"type": "object"}), "response_format")?
            );
        }
        ResponseFormat::JsonSchema(schema) => {
            let _ = writeln!(
                g,
                "json_answer: {}",
                inline_json(schema, "response_format")?
            );
        }
    }
    if calls_allowed {
        tool_rules(&mut g, spec.tools, spec.parallel_calls)?;
    }
    Ok(g)
}

/// `tools`, `call` and one rule per tool.
fn tool_rules(g: &mut String, tools: &[Tool], parallel: bool) -> Result<(), GrammarError> {
    let calls = if parallel { "call+" } else { "call" };
    let _ = writeln!(
        g,
        "tools: <|open|> \"tools\" <|sep|> {calls} <|close|> \"tools\" <|sep|>"
    );
    let names: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    let _ = writeln!(g, "call: {}", names.join(" | "));
    // The index attribute counts calls from 1; the grammar bounds its length, not its value.
    g.push_str("INDEX: /[1-9][0-9]{0,2}/\n");
    for (i, tool) in tools.iter().enumerate() {
        let name = &tool.function.name;
        if name.is_empty() {
            return Err(GrammarError {
                param: "tools",
                message: format!("tools[{i}].function.name must not be empty"),
            });
        }
        let open = lit(&format!(
            "call tool=\"{}\" index=\"",
            name.replace('&', "&amp;").replace('"', "&quot;")
        ));
        let schema = tool
            .function
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        let args = arguments(g, i, &schema)?;
        let _ = writeln!(
            g,
            "call_{i}: <|open|> {open} INDEX \"\\\"\" <|sep|> {args} <|close|> \"call\" <|sep|>"
        );
    }
    Ok(())
}

/// Keywords that only annotate a schema (they constrain nothing).
const ANNOTATIONS: &[&str] = &[
    "description",
    "title",
    "examples",
    "default",
    "$comment",
    "deprecated",
];

/// The XTML `type` of a property schema K3's argument form can express exactly, or `None`.
fn argument_type(schema: &Value) -> Option<&'static str> {
    let obj = schema.as_object()?;
    let kind = match obj.get("type")?.as_str()? {
        "string" => {
            // Raw text can carry a plain string, an enum or a const of strings; nothing with a pattern or length.
            let plain = obj.keys().all(|k| {
                k == "type" || k == "enum" || k == "const" || ANNOTATIONS.contains(&k.as_str())
            });
            let strings = obj.get("enum").is_none_or(|e| {
                e.as_array()
                    .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_string))
            }) && obj.get("const").is_none_or(Value::is_string);
            return (plain && strings).then_some("string");
        }
        "integer" | "number" => "number",
        "boolean" => "boolean",
        "null" => "null",
        "object" => "object",
        "array" => "array",
        _ => return None,
    };
    Some(kind)
}

/// The arguments of tool `i`: argument elements when the schema allows, else a `json` element. Adds the rules it
/// needs to `g` and returns the expression to use.
fn arguments(g: &mut String, i: usize, schema: &Value) -> Result<String, GrammarError> {
    if let Some(expr) = argument_elements(g, i, schema)? {
        return Ok(expr);
    }
    let _ = writeln!(g, "args_{i}: {}", inline_json(schema, "tools")?);
    Ok(format!(
        "<|open|> {} <|sep|> args_{i} <|close|> \"json\" <|sep|>",
        lit("json type=\"object\"")
    ))
}

/// Argument elements for an object schema whose every property [`argument_type`] can express, and that allows no
/// other properties than those it lists; `None` otherwise.
fn argument_elements(
    g: &mut String,
    i: usize,
    schema: &Value,
) -> Result<Option<String>, GrammarError> {
    let Some(obj) = schema.as_object() else {
        return Ok(None);
    };
    let known = [
        "type",
        "properties",
        "required",
        "additionalProperties",
        "strict",
    ];
    if obj.get("type").and_then(Value::as_str) != Some("object")
        || obj
            .keys()
            .any(|k| !known.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()))
        || obj
            .get("additionalProperties")
            .is_some_and(|a| a != &Value::Bool(false))
    {
        return Ok(None);
    }
    let Some(properties) = obj.get("properties").and_then(Value::as_object) else {
        return Ok(None);
    };
    let required: Vec<&str> = match obj.get("required") {
        None => Vec::new(),
        Some(Value::Array(r)) if r.iter().all(Value::is_string) => {
            r.iter().filter_map(Value::as_str).collect()
        }
        Some(_) => return Ok(None),
    };
    if required.iter().any(|r| !properties.contains_key(*r)) || properties.is_empty() {
        return Ok(None);
    }
    let mut parts = Vec::new();
    let mut rules = String::new();
    for (j, (key, prop)) in properties.iter().enumerate() {
        let Some(kind) = argument_type(prop) else {
            return Ok(None);
        };
        let value = format!("arg_{i}_{j}_value");
        if kind == "string" {
            let choices: Vec<String> = match (prop.get("const"), prop.get("enum")) {
                (Some(Value::String(c)), _) => vec![lit(c)],
                (_, Some(Value::Array(e))) => e.iter().filter_map(Value::as_str).map(lit).collect(),
                _ => vec!["TEXT".to_owned()],
            };
            let _ = writeln!(rules, "{value}: {}", choices.join(" | "));
        } else {
            let _ = writeln!(rules, "{value}: {}", inline_json(prop, "tools")?);
        }
        let open = lit(&format!(
            "argument key=\"{}\" type=\"{kind}\"",
            key.replace('&', "&amp;").replace('"', "&quot;")
        ));
        let element = format!("<|open|> {open} <|sep|> {value} <|close|> \"argument\" <|sep|>");
        parts.push(if required.contains(&key.as_str()) {
            element
        } else {
            format!("({element})?")
        });
    }
    g.push_str(&rules);
    Ok(Some(parts.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Value) -> Tool {
        serde_json::from_value(json!({"type": "function",
            "function": {"name": name, "parameters": parameters}}))
        .expect("tool")
    }

    #[test]
    fn plain_text_without_tools_is_unconstrained() {
        let spec = AnswerSpec {
            thinking: true,
            format: &ResponseFormat::Text,
            tools: &[],
            tool_choice: ToolChoice::Auto,
            parallel_calls: true,
        };
        assert!(!spec.is_constrained());
    }

    #[test]
    fn simple_schemas_use_argument_elements_others_json() {
        let simple = tool(
            "get_weather",
            json!({"type": "object", "properties": {
                "city": {"type": "string", "description": "a city"},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city"], "additionalProperties": false}),
        );
        let pattern = tool(
            "lookup",
            json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
        );
        let tools = [simple, pattern];
        let spec = AnswerSpec {
            thinking: false,
            format: &ResponseFormat::Text,
            tools: &tools,
            tool_choice: ToolChoice::Required,
            parallel_calls: false,
        };
        let g = lark(&spec).expect("grammar");
        assert!(
            g.contains(r#""argument key=\"city\" type=\"string\"""#),
            "{g}"
        );
        assert!(
            g.contains(r#"("<|open|> "#) || g.contains("(<|open|>"),
            "{g}"
        );
        assert!(g.contains(r#""C" | "F""#), "{g}");
        assert!(g.contains(r#""json type=\"object\"""#), "{g}");
        assert!(g.contains("body: close_response tools"), "{g}");
        assert!(g.contains("<|sep|> call <|close|>"), "{g}");
        assert!(!g.contains("REASONING <|close|>"), "{g}");
    }

    #[test]
    fn a_schema_that_is_not_an_object_is_refused() {
        let format = ResponseFormat::JsonSchema(json!([1, 2]));
        let spec = AnswerSpec {
            thinking: true,
            format: &format,
            tools: &[],
            tool_choice: ToolChoice::Auto,
            parallel_calls: true,
        };
        let e = lark(&spec).expect_err("not a schema");
        assert_eq!(e.param, "response_format");
    }
}
