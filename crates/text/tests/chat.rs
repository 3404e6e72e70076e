//! XTML renderer and output-parser tests against `tests/fixtures/tokenizer/chat`.
//!
//! The goldens were rendered by K3's reference renderer with the toy tokenizer.
//! Each conversation must render to the same text and the same per-segment ids;
//! every historical assistant turn in the golden ids must parse back into its
//! reasoning, answer and tool calls.

// A test that fails should fail loudly at the failing call.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use deltafin_text::chat::{
    self, AssistantMessage, ChatEvent, ChatOptions, Content, FunctionCall, Message, OutputParser,
    ParserStart, ResponseFormat, Segment, ThinkingEffort, Tool, ToolCall, ToolChoice, ToolMessage,
};
use deltafin_text::tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn toy() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_dir(fixtures().join("tokenizer/toy")).unwrap())
}

#[derive(serde::Deserialize)]
struct Golden {
    conversations: Vec<Conversation>,
}

#[derive(serde::Deserialize)]
struct Conversation {
    tokenizer: String,
    name: String,
    kwargs: Kwargs,
    messages: Vec<Message>,
    text: String,
    ids: Vec<u32>,
    ids_whole_string: Vec<u32>,
    per_segment_differs: bool,
}

#[derive(serde::Deserialize)]
struct Kwargs {
    thinking: Option<bool>,
    thinking_effort: Option<String>,
    tools: Option<Vec<Tool>>,
}

impl Kwargs {
    fn options(&self) -> ChatOptions {
        let mut options = ChatOptions::default();
        if let Some(thinking) = self.thinking {
            options.thinking = thinking;
        }
        if let Some(effort) = &self.thinking_effort {
            options.thinking_effort = Some(effort.parse().unwrap());
        }
        options.tools = self.tools.clone().unwrap_or_default();
        options
    }
}

fn golden() -> Golden {
    let path = fixtures().join("tokenizer/chat/golden.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Checks one golden conversation: rendered text, per-segment ids, and that
/// encoding the text whole would indeed differ where the golden says so.
fn check(tok: &Tokenizer, conv: &Conversation) {
    assert_eq!(conv.tokenizer, "toy");
    let rendered = chat::render(tok, &conv.messages, &conv.kwargs.options()).unwrap();
    assert_eq!(rendered.text, conv.text, "{}: text", conv.name);
    assert_eq!(rendered.ids, conv.ids, "{}: ids", conv.name);
    let whole = tok.encode_with_specials(&conv.text);
    assert_eq!(
        whole, conv.ids_whole_string,
        "{}: whole-string ids",
        conv.name
    );
    assert_eq!(
        whole != rendered.ids,
        conv.per_segment_differs,
        "{}",
        conv.name
    );
}

#[test]
fn golden_conversations_render_exactly() {
    let tok = toy();
    let golden = golden();
    assert_eq!(golden.conversations.len(), 6);
    for conv in &golden.conversations {
        check(&tok, conv);
    }
}

/// What the parser reconstructed from one assistant turn.
#[derive(Debug, Default, PartialEq)]
struct Turn {
    reasoning: String,
    content: String,
    /// `(name, arguments as a JSON value)`.
    calls: Vec<(String, serde_json::Value)>,
}

impl Turn {
    fn expected(message: &AssistantMessage, thinking: bool) -> Self {
        let text = |c: &Option<Content>| match c {
            Some(Content::Text(t)) => t.clone(),
            _ => String::new(),
        };
        Turn {
            reasoning: if thinking {
                message.reasoning_content.clone().unwrap_or_default()
            } else {
                String::new()
            },
            content: text(&message.content),
            calls: message
                .tool_calls
                .iter()
                .map(|c| {
                    (
                        c.function.name.clone(),
                        arguments_value(&c.function.arguments),
                    )
                })
                .collect(),
        }
    }
}

fn arguments_value(arguments: &str) -> serde_json::Value {
    if arguments.trim().is_empty() {
        return serde_json::json!({});
    }
    serde_json::from_str(arguments)
        .unwrap_or_else(|_| serde_json::Value::String(arguments.to_owned()))
}

/// Feeds ids to a fresh parser until `End`; returns the turn and the ids used.
fn parse_turn(tok: &Arc<Tokenizer>, start: ParserStart, ids: &[u32]) -> (Turn, usize) {
    let mut parser = OutputParser::new(Arc::clone(tok), start).unwrap();
    let mut turn = Turn::default();
    for (n, &id) in ids.iter().enumerate() {
        for event in parser.push(id).unwrap() {
            match event {
                ChatEvent::Reasoning(t) => turn.reasoning.push_str(&t),
                ChatEvent::Content(t) => turn.content.push_str(&t),
                ChatEvent::ToolCall(call) => {
                    assert_eq!(call.index, turn.calls.len() + 1);
                    let value = serde_json::from_str(&call.arguments)
                        .unwrap_or(serde_json::Value::String(call.arguments.clone()));
                    turn.calls.push((call.name, value));
                }
                ChatEvent::End => {
                    assert!(parser.is_done());
                    return (turn, n + 1);
                }
            }
        }
    }
    panic!("no <|end_of_msg|> in {} ids", ids.len());
}

/// The ids of the generation prompt, which also open every assistant turn.
fn assistant_prefix(tok: &Tokenizer, thinking: bool) -> Vec<u32> {
    let seg = |text: &str, markup: bool| Segment {
        text: text.to_owned(),
        markup,
    };
    let channel = if thinking { "think" } else { "response" };
    let segments = [
        seg(chat::OPEN, true),
        seg("message", false),
        seg(" role", false),
        seg("=\"", false),
        seg("assistant", false),
        seg("\"", false),
        seg(chat::SEP, true),
        seg(chat::OPEN, true),
        seg(channel, false),
        seg(chat::SEP, true),
    ];
    chat::encode_segments(tok, &segments).ids
}

/// Parses every historical assistant turn out of `ids` and compares it with the message.
fn check_parse(
    tok: &Arc<Tokenizer>,
    name: &str,
    messages: &[Message],
    thinking: bool,
    ids: &[u32],
) -> usize {
    let prefix = assistant_prefix(tok, thinking);
    let starts: Vec<usize> = (0..ids.len())
        .filter(|&i| ids[i..].starts_with(&prefix))
        .collect();
    let history: Vec<&AssistantMessage> = messages
        .iter()
        .filter_map(|m| {
            if let Message::Assistant(a) = m {
                Some(a)
            } else {
                None
            }
        })
        .collect();
    // One occurrence per historical turn plus the generation prompt at the very end.
    assert_eq!(starts.len(), history.len() + 1, "{name}");
    assert_eq!(
        starts.last().map(|s| s + prefix.len()),
        Some(ids.len()),
        "{name}"
    );
    for (message, start) in history.iter().zip(&starts) {
        let body = &ids[start + prefix.len()..];
        let (turn, _) = parse_turn(tok, ParserStart::for_thinking(thinking), body);
        assert_eq!(turn, Turn::expected(message, thinking), "{name}");
    }
    history.len()
}

#[test]
fn parser_reconstructs_golden_assistant_turns() {
    let tok = toy();
    let mut n_turns = 0;
    for conv in golden().conversations {
        let thinking = conv.kwargs.options().thinking;
        n_turns += check_parse(&tok, &conv.name, &conv.messages, thinking, &conv.ids);
    }
    assert_eq!(
        n_turns, 3,
        "the goldens hold three historical assistant turns"
    );
}

/// A conversation exercising every argument type, a non-JSON arguments string
/// (rendered as a `json` element), escaped attributes, multi-byte text split
/// across tokens, and several calls, rendered with our renderer and parsed back.
fn rich_conversation() -> Vec<Message> {
    let call = |id: &str, name: &str, arguments: &str| ToolCall {
        id: Some(id.to_owned()),
        kind: "function".to_owned(),
        function: FunctionCall {
            name: name.to_owned(),
            arguments: arguments.to_owned(),
        },
    };
    vec![
        Message::system("Be brief. Ünïcödé 🙂"),
        Message::user("Plan a trip to 東京 & \"Kyoto\""),
        Message::Assistant(AssistantMessage {
            content: Some(Content::Text("Let me check — 🚄 first.".to_owned())),
            reasoning_content: Some("Two lookups: 天気 then trains.\n".to_owned()),
            tool_calls: vec![
                call(
                    "a",
                    "search&\"find\"",
                    r#"{"q": "東京 weather", "days": 3, "ratio": 0.25, "exact": true, "none": null,
                        "tags": ["a", 1, {"k": "v"}], "opts": {"units": "metric", "n": -2}}"#,
                ),
                call("b", "raw", "not json {"),
                call("c", "empty", ""),
            ],
            ..Default::default()
        }),
        Message::Tool(ToolMessage {
            content: Some(Content::Text("sunny".to_owned())),
            tool_call_id: Some("a".to_owned()),
            ..Default::default()
        }),
        Message::user("Thanks"),
    ]
}

#[test]
fn parser_round_trips_rendered_turns() {
    let tok = toy();
    let messages = rich_conversation();
    for thinking in [true, false] {
        let options = ChatOptions {
            thinking,
            ..Default::default()
        };
        let rendered = chat::render(&tok, &messages, &options).unwrap();
        assert_eq!(
            check_parse(&tok, "rich", &messages, thinking, &rendered.ids),
            1
        );
    }
}

#[test]
fn rendering_details() {
    let tok = toy();
    let messages = rich_conversation();
    let text = |options: &ChatOptions| chat::render(&tok, &messages, options).unwrap().text;

    let on = text(&ChatOptions::default());
    // Attribute values are escaped, `&` first.
    assert!(
        on.contains(r#"<|open|>call tool="search&amp;&quot;find&quot;" index="1"<|sep|>"#),
        "{on}"
    );
    // Non-string values are Python-style JSON; strings are raw.
    assert!(on.contains(r#"key="ratio" type="number"<|sep|>0.25<|close|>"#));
    assert!(on.contains(r#"key="exact" type="boolean"<|sep|>true<|close|>"#));
    assert!(on.contains(r#"key="none" type="null"<|sep|>null<|close|>"#));
    assert!(on.contains(r#"key="tags" type="array"<|sep|>["a", 1, {"k": "v"}]<|close|>"#));
    assert!(on.contains(r#"key="opts" type="object"<|sep|>{"units": "metric", "n": -2}<|close|>"#));
    assert!(on.contains(r#"key="q" type="string"<|sep|>東京 weather<|close|>"#));
    // Arguments that are not JSON are kept verbatim in a json element; empty ones render no children.
    assert!(on.contains(r#"<|open|>json type="object"<|sep|>not json {<|close|>json<|sep|>"#));
    assert!(on.contains(r#"<|open|>call tool="empty" index="3"<|sep|><|close|>call<|sep|>"#));
    // The tool result is named after the call it answers and numbered in its turn.
    assert!(on.contains(
        r#"<|open|>message role="tool" tool="search&amp;&quot;find&quot;" index="1"<|sep|>sunny"#
    ));
    assert!(on.contains("thinking_effort=max"));
    assert!(on.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"));

    let off = text(&ChatOptions {
        thinking: false,
        ..Default::default()
    });
    assert!(!off.contains("think"));
    assert!(off.ends_with("<|open|>response<|sep|>"));

    let high = text(&ChatOptions {
        thinking_effort: Some(ThinkingEffort::High),
        ..Default::default()
    });
    assert!(high.contains("Now the system is invoked with `thinking_effort=high`."));
    let none = text(&ChatOptions {
        thinking_effort: None,
        ..Default::default()
    });
    assert!(!none.contains("thinking-effort"));

    let required = text(&ChatOptions {
        tool_choice: ToolChoice::Required,
        ..Default::default()
    });
    assert!(required.contains("<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`."));

    assert!("medium".parse::<ThinkingEffort>().is_err());

    let schema = serde_json::json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "a": 1.5e-5}}});
    let format = ResponseFormat::from_openai(&schema);
    let with_schema = text(&ChatOptions {
        response_format: format,
        ..Default::default()
    });
    assert!(
        with_schema.contains("must match the following schema:\n```json\n{\"a\":1.5e-05,\"type\":\"object\"}\n```<|close|>"),
        "{with_schema}"
    );
    let object = ResponseFormat::from_openai(&serde_json::json!({"type": "json_object"}));
    assert!(
        text(&ChatOptions {
            response_format: object,
            ..Default::default()
        })
        .contains("`response_format=json_object`")
    );
    assert_eq!(
        ResponseFormat::from_openai(&serde_json::json!({"type": "text"})),
        ResponseFormat::Text
    );
}

#[test]
fn tool_results_follow_call_order() {
    let tok = toy();
    let call = |id: &str, name: &str| ToolCall {
        id: Some(id.to_owned()),
        kind: "function".to_owned(),
        function: FunctionCall {
            name: name.to_owned(),
            arguments: "{}".to_owned(),
        },
    };
    let result = |id: &str, content: &str| {
        Message::Tool(ToolMessage {
            content: Some(Content::Text(content.to_owned())),
            tool_call_id: Some(id.to_owned()),
            ..Default::default()
        })
    };
    let messages = vec![
        Message::user("go"),
        Message::Assistant(AssistantMessage {
            tool_calls: vec![call("x", "first"), call("y", "second")],
            ..Default::default()
        }),
        result("y", "from second"),
        result("x", "from first"),
    ];
    let text = chat::render(&tok, &messages, &ChatOptions::default())
        .unwrap()
        .text;
    let first = text
        .find(r#"tool="first" index="1"<|sep|>from first"#)
        .unwrap();
    let second = text
        .find(r#"tool="second" index="2"<|sep|>from second"#)
        .unwrap();
    assert!(first < second, "{text}");

    // A tool message that names nothing and follows no call is an error, not a panic.
    let orphan = vec![Message::Tool(ToolMessage {
        content: None,
        ..Default::default()
    })];
    let err = chat::render(&tok, &orphan, &ChatOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("message 0: tool message needs a resolvable tool name"),
        "{err}"
    );
}

#[test]
fn parser_streams_and_rejects_bad_markup() {
    let tok = toy();
    let mut parser = OutputParser::new(Arc::clone(&tok), ParserStart::Response).unwrap();
    // A multi-byte character split over tokens is released only when complete.
    let ids = tok.encode("é🙂");
    let mut content = String::new();
    for &id in &ids {
        for event in parser.push(id).unwrap() {
            let ChatEvent::Content(text) = event else {
                panic!("unexpected {event:?}")
            };
            assert!(!text.contains('\u{fffd}'));
            content.push_str(&text);
        }
    }
    assert_eq!(content, "é🙂");
    let end = tok.require_special("<|end_of_msg|>").unwrap();
    assert_eq!(parser.push(end).unwrap(), [ChatEvent::End]);
    assert!(parser.push(end).is_err(), "nothing may follow the end");

    // Unknown elements and stray separators are reported, never panicked on.
    let mut parser = OutputParser::new(Arc::clone(&tok), ParserStart::Thinking).unwrap();
    let bad = tok.encode_with_specials("<|open|>bogus<|sep|>");
    let err = bad
        .iter()
        .map(|&id| parser.push(id))
        .find_map(Result::err)
        .unwrap();
    assert!(
        err.to_string().contains("unknown element \"bogus\""),
        "{err}"
    );
    let mut parser = OutputParser::new(Arc::clone(&tok), ParserStart::Thinking).unwrap();
    let err = parser
        .push(tok.require_special("<|sep|>").unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("outside a tag"), "{err}");

    // Layout whitespace between elements is not answer text; other loose text is.
    let mut parser = OutputParser::new(Arc::clone(&tok), ParserStart::Thinking).unwrap();
    let ids = tok.encode_with_specials(
        "hm<|close|>think<|sep|>\n<|open|>response<|sep|>A<|close|>response<|sep|>\nB",
    );
    let (mut reasoning, mut content) = (String::new(), String::new());
    for event in ids.iter().flat_map(|&id| parser.push(id).unwrap()) {
        match event {
            ChatEvent::Reasoning(t) => reasoning.push_str(&t),
            ChatEvent::Content(t) => content.push_str(&t),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("hm", "AB"));

    // A stream cut off mid-answer still releases its text.
    let mut parser = OutputParser::new(Arc::clone(&tok), ParserStart::Response).unwrap();
    for &id in &tok.encode("partial") {
        parser.push(id).unwrap();
    }
    let rest: String = parser
        .finish()
        .into_iter()
        .map(|e| {
            if let ChatEvent::Content(t) = e {
                t
            } else {
                String::new()
            }
        })
        .collect();
    assert!("partial".ends_with(&rest));
}

#[test]
fn messages_deserialize_from_openai_json() {
    let json = r#"[
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}
    ]"#;
    let messages: Vec<Message> = serde_json::from_str(json).unwrap();
    assert!(matches!(messages[0], Message::System(_)));
    let text = chat::render(&toy(), &messages, &ChatOptions::default())
        .unwrap()
        .text;
    assert!(
        text.contains("look<|kimi_image_placeholder|><|close|>message"),
        "{text}"
    );
    assert!(text.contains(r#"role="tool" tool="f" index="1""#), "{text}");
}
