//! Router tests without a socket: every endpoint and every error, through `tower::ServiceExt::oneshot`, against
//! the `k3-tiny-a` fixture (random weights: the text is noise, greedy answers are deterministic).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use deltafin_runtime::{Engine, EngineOptions, GenerateOptions};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::{AppState, ServerConfig, app};

const MODEL: &str = "k3-tiny-a";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/k3/k3-tiny-a")
}

fn engine(options: EngineOptions) -> Engine {
    Engine::open(&fixture(), options).expect("open the k3-tiny-a fixture")
}

fn state_with(options: EngineOptions, edit: impl FnOnce(&mut ServerConfig)) -> AppState {
    let mut config = ServerConfig::new(MODEL);
    edit(&mut config);
    AppState::start(engine(options), config).expect("start")
}

fn state() -> AppState {
    state_with(EngineOptions::default(), |_| {})
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }

    /// Asserts an OpenAI-style error with this status; returns the `error` object.
    fn error(&self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{}", self.text);
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        e
    }

    /// The `data:` payloads of an SSE body, in order.
    fn sse_data(&self) -> Vec<String> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_owned)
            .collect()
    }
}

async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    body: Option<String>,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    if body.is_some() {
        request = request.header(header::CONTENT_TYPE, "application/json");
    }
    let request = request
        .body(body.map_or_else(Body::empty, Body::from))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    Answer {
        status,
        headers,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn post(app: &Router, uri: &str, body: Value) -> Answer {
    call(app, "POST", uri, Some(body.to_string()), &[]).await
}

fn chat_body(content: &str, max_tokens: u64) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0})
}

/// Reasoning, content and finish reason reassembled from a streamed chat answer; checks the stream's shape.
fn reassemble_chat(answer: &Answer) -> (String, String, String, Value) {
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    assert!(
        answer.headers[header::CONTENT_TYPE]
            .to_str()
            .is_ok_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        answer.headers
    );
    let data = answer.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        answer.text
    );
    let (mut reasoning, mut content, mut finish, mut usage) =
        (String::new(), String::new(), String::new(), Value::Null);
    for (i, d) in data[..data.len() - 1].iter().enumerate() {
        let chunk: Value = serde_json::from_str(d).expect("chunk JSON");
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        if i == 0 {
            assert_eq!(chunk["choices"][0]["delta"]["role"], "assistant");
        }
        if let Some(choice) = chunk["choices"].get(0) {
            let delta = &choice["delta"];
            reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
            content.push_str(delta["content"].as_str().unwrap_or_default());
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = f.to_owned();
            }
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    (reasoning, content, finish, usage)
}

#[tokio::test]
async fn health_and_models() {
    let app = app(state());
    let health = call(&app, "GET", "/health", None, &[]).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.json()["state"], "idle");
    assert_eq!(health.json()["busy"], false);

    let models = call(&app, "GET", "/v1/models", None, &[]).await;
    assert_eq!(models.status, StatusCode::OK);
    let v = models.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["object"], "model");

    let one = call(&app, "GET", &format!("/v1/models/{MODEL}"), None, &[]).await;
    assert_eq!(one.json()["id"], MODEL);
    let e = call(&app, "GET", "/v1/models/gpt-4", None, &[])
        .await
        .error(StatusCode::NOT_FOUND);
    assert_eq!(e["code"], "model_not_found");
}

#[tokio::test]
async fn unknown_routes_and_methods_get_json_errors() {
    let app = app(state());
    call(&app, "GET", "/v2/nothing", None, &[])
        .await
        .error(StatusCode::NOT_FOUND);
    call(&app, "GET", "/v1/chat/completions", None, &[])
        .await
        .error(StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn bad_json_and_wrong_shapes_are_400() {
    let app = app(state());
    for uri in ["/v1/chat/completions", "/v1/completions"] {
        let a = call(&app, "POST", uri, Some("{not json".into()), &[]).await;
        let e = a.error(StatusCode::BAD_REQUEST);
        assert_eq!(e["type"], "invalid_request_error");
        assert!(
            e["message"].as_str().is_some_and(|m| m.contains("JSON")),
            "{e}"
        );
        call(&app, "POST", uri, Some("[]".into()), &[])
            .await
            .error(StatusCode::BAD_REQUEST);
        call(&app, "POST", uri, None, &[])
            .await
            .error(StatusCode::BAD_REQUEST);
    }
    let e = post(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "robot"}]}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "messages");
}

#[tokio::test]
async fn empty_messages_and_empty_prompt_are_400() {
    let app = app(state());
    let e = post(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": []}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "messages");
    for prompt in [json!(""), json!([]), json!([""])] {
        let e = post(
            &app,
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt}),
        )
        .await
        .error(StatusCode::BAD_REQUEST);
        assert_eq!(e["param"], "prompt", "{prompt}");
    }
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": [1, 99999]}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("99999")),
        "{e}"
    );
}

#[tokio::test]
async fn unknown_model_is_404() {
    let app = app(state());
    let e = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await
    .error(StatusCode::NOT_FOUND);
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["param"], "model");
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": "davinci", "prompt": "hi"}),
    )
    .await
    .error(StatusCode::NOT_FOUND);
    assert_eq!(e["code"], "model_not_found");
}

#[tokio::test]
async fn oversized_body_is_413() {
    let app = app(state_with(EngineOptions::default(), |c| {
        c.body_limit = 1024
    }));
    let big = chat_body(&"x".repeat(4096), 1);
    for uri in ["/v1/chat/completions", "/v1/completions"] {
        let e = post(&app, uri, big.clone())
            .await
            .error(StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(e["code"], "request_too_large");
    }
    // Under the limit it is served.
    assert_eq!(
        post(&app, "/v1/chat/completions", chat_body("hi", 1))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn api_key_is_required_when_set() {
    let app = app(state_with(EngineOptions::default(), |c| {
        c.api_key = Some("sekrit".into())
    }));
    for headers in [
        &[][..],
        &[("authorization", "Bearer wrong")][..],
        &[("authorization", "sekrit")][..],
    ] {
        let a = call(&app, "GET", "/v1/models", None, headers).await;
        let e = a.error(StatusCode::UNAUTHORIZED);
        assert_eq!(e["code"], "invalid_api_key");
        assert!(a.headers.contains_key(header::WWW_AUTHENTICATE));
        let a = call(
            &app,
            "POST",
            "/v1/chat/completions",
            Some(chat_body("hi", 1).to_string()),
            headers,
        )
        .await;
        a.error(StatusCode::UNAUTHORIZED);
    }
    let ok = call(
        &app,
        "GET",
        "/v1/models",
        None,
        &[("authorization", "Bearer sekrit")],
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK);
    let ok = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(chat_body("hi", 1).to_string()),
        &[("authorization", "Bearer sekrit")],
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text);
    // Health stays open (it reveals nothing but idle or busy).
    assert_eq!(
        call(&app, "GET", "/health", None, &[]).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn unsupported_fields_are_400_naming_the_field() {
    let app = app(state());
    let mut body = chat_body("hi", 1);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(21);
    let e = post(&app, "/v1/chat/completions", body)
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "top_logprobs");
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("20")),
        "{e}"
    );
    for (field, value) in [
        ("n", json!(2)),
        ("audio", json!({})),
        ("modalities", json!(["text"])),
        ("reasoning_effort", json!("medium")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("chat_template_kwargs", json!({"foo": 1})),
    ] {
        let mut body = chat_body("hi", 1);
        body[field] = value;
        let e = post(&app, "/v1/chat/completions", body)
            .await
            .error(StatusCode::BAD_REQUEST);
        assert!(
            e["param"].as_str().is_some_and(|p| p.starts_with(field)),
            "{field}: {e}"
        );
    }
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "echo": true}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "echo");
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "suffix": "x"}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "suffix");
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "max_tokens");
    let e = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "top_p": 0}),
    )
    .await
    .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "top_p");
}

/// Holds the engine as a generation would, until dropped.
fn hold_engine(state: &AppState) -> crate::queue::EnginePermit {
    match state.inner.queue.join() {
        Some(crate::queue::Place::Run(permit)) => permit,
        _ => panic!("the engine is not free"),
    }
}

/// Waits until `waiting` requests are queued.
async fn until_queued(state: &AppState, waiting: usize) {
    let start = Instant::now();
    while state.waiting() != waiting {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} waiting, expected {waiting}",
            state.waiting()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn requests_wait_in_order_and_a_full_queue_is_429_with_retry_after() {
    let state = state_with(EngineOptions::default(), |c| c.max_queue = 2);
    let app = app(state.clone());
    let permit = hold_engine(&state);
    let health = call(&app, "GET", "/health", None, &[]).await.json();
    assert_eq!(health["state"], "generating");
    assert_eq!(health["queued"], 0);

    // A streamed request starts its answer at once and says where it waits.
    let mut body = chat_body("first in line", 3);
    body["stream"] = json!(true);
    let request = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut streamed = response.into_body().into_data_stream();
    use futures_util::StreamExt;
    let first = streamed.next().await.expect("an event").expect("bytes");
    assert_eq!(
        String::from_utf8_lossy(&first).trim(),
        ": queued, position 1"
    );
    // A second, not streamed, waits behind it.
    let second = tokio::spawn({
        let app = app.clone();
        async move {
            post(
                &app,
                "/v1/completions",
                json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
            )
            .await
        }
    });
    until_queued(&state, 2).await;
    assert_eq!(
        call(&app, "GET", "/health", None, &[]).await.json()["queued"],
        2
    );
    // The queue is full: a third is refused, whatever its endpoint.
    for (uri, body) in [
        ("/v1/chat/completions", chat_body("hi", 2)),
        ("/v1/completions", json!({"model": MODEL, "prompt": "hi"})),
    ] {
        let a = post(&app, uri, body).await;
        let e = a.error(StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e["code"], "server_busy");
        assert_eq!(a.headers[header::RETRY_AFTER], "5");
    }
    let metrics = call(&app, "GET", "/metrics", None, &[]).await.text;
    assert!(
        metrics.lines().any(|l| l == "deltafin_queue_waiting 2"),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "deltafin_requests_rejected_total 2"),
        "{metrics}"
    );

    // Freed, the engine serves them in order: the streamed one runs first and finishes.
    drop(permit);
    let mut rest = String::new();
    while let Some(bytes) = streamed.next().await {
        rest.push_str(&String::from_utf8_lossy(&bytes.expect("bytes")));
    }
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let second = second.await.expect("task");
    assert_eq!(second.status, StatusCode::OK, "{}", second.text);
    assert_eq!(second.json()["usage"]["completion_tokens"], 2);
    assert_eq!(state.waiting(), 0);
}

#[tokio::test]
async fn a_waiter_that_goes_away_leaves_the_queue() {
    let state = state_with(EngineOptions::default(), |c| c.max_queue = 1);
    let app = app(state.clone());
    let permit = hold_engine(&state);
    let waiter = tokio::spawn({
        let app = app.clone();
        async move { post(&app, "/v1/chat/completions", chat_body("hi", 2)).await }
    });
    until_queued(&state, 1).await;
    post(&app, "/v1/chat/completions", chat_body("hi", 2))
        .await
        .error(StatusCode::TOO_MANY_REQUESTS);
    waiter.abort();
    until_queued(&state, 0).await;
    // Its place is free again; and with the engine free nothing is left waiting for the gone client.
    drop(permit);
    let a = post(&app, "/v1/chat/completions", chat_body("hi", 2)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert!(!state.is_busy());
}

#[tokio::test]
async fn a_failed_request_does_not_poison_the_next() {
    let app = app(state());
    let first = post(&app, "/v1/chat/completions", chat_body("same question", 6))
        .await
        .json();
    // A tool message that answers no call cannot be rendered: 400, and nothing changes.
    let bad = json!({"model": MODEL, "messages": [{"role": "tool", "content": "42"}]});
    post(&app, "/v1/chat/completions", bad)
        .await
        .error(StatusCode::BAD_REQUEST);
    let again = post(&app, "/v1/chat/completions", chat_body("same question", 6))
        .await
        .json();
    assert_eq!(
        first["choices"][0]["message"],
        again["choices"][0]["message"]
    );
    assert_eq!(
        first["usage"]["completion_tokens"],
        again["usage"]["completion_tokens"]
    );
}

#[tokio::test]
async fn chat_streamed_and_not_reassemble_to_the_same_answer() {
    let app = app(state());
    let mut body = chat_body("Hello there", 24);
    body["return_token_ids"] = json!(true);
    let full = post(&app, "/v1/chat/completions", body.clone()).await;
    assert_eq!(full.status, StatusCode::OK, "{}", full.text);
    let v = full.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(choice["token_ids"].as_array().map(Vec::len), Some(24));

    // Same tokens as the engine's own greedy generation on the same rendered prompt.
    let prompt: Vec<u32> = serde_json::from_value(v["prompt_token_ids"].clone()).expect("ids");
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    // What the prompt cost: its time, and the bytes it read (the fixture's experts are read from disk).
    assert!(
        v["usage"]["prefill_time_s"]
            .as_f64()
            .is_some_and(|s| s > 0.0),
        "{}",
        v["usage"]
    );
    assert!(
        v["usage"]["prefill_read_bytes"].as_u64().is_some(),
        "{}",
        v["usage"]
    );
    let reference = engine(EngineOptions::default());
    let mut session = reference.session();
    let direct = session
        .generate(
            &prompt,
            &GenerateOptions {
                max_new: 24,
                ..GenerateOptions::default()
            },
            |_| true,
        )
        .expect("generate");
    let served: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).expect("ids");
    assert_eq!(served, direct.tokens);

    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let streamed = post(&app, "/v1/chat/completions", body).await;
    let (reasoning, content, finish, usage) = reassemble_chat(&streamed);
    assert_eq!(
        reasoning,
        choice["message"]["reasoning_content"]
            .as_str()
            .unwrap_or_default()
    );
    assert_eq!(
        content,
        choice["message"]["content"].as_str().unwrap_or_default()
    );
    assert!(
        !(reasoning.is_empty() && content.is_empty()),
        "no text at all"
    );
    assert_eq!(finish, "length");
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(usage["prompt_tokens"], v["usage"]["prompt_tokens"]);
}

#[tokio::test]
async fn thinking_can_be_turned_off() {
    let app = app(state());
    let on = post(&app, "/v1/chat/completions", chat_body("Hello there", 4))
        .await
        .json();
    for switch in [
        json!({"chat_template_kwargs": {"thinking": false}}),
        json!({"reasoning_effort": "none"}),
    ] {
        let mut body = chat_body("Hello there", 4);
        for (k, v) in switch.as_object().expect("object") {
            body[k] = v.clone();
        }
        body["return_token_ids"] = json!(true);
        let off = post(&app, "/v1/chat/completions", body).await.json();
        // Thinking off: no think element in the prompt, and nothing is read as reasoning.
        assert!(
            off["choices"][0]["message"]
                .get("reasoning_content")
                .is_none(),
            "{off}"
        );
        assert_ne!(
            off["usage"]["prompt_tokens"], on["usage"]["prompt_tokens"],
            "{switch}"
        );
    }
    for effort in ["low", "high", "max"] {
        let mut body = chat_body("Hello there", 1);
        body["reasoning_effort"] = json!(effort);
        assert_eq!(
            post(&app, "/v1/chat/completions", body).await.status,
            StatusCode::OK
        );
    }
}

#[tokio::test]
async fn completions_streamed_and_not_agree_and_stop_strings_cut() {
    let app = app(state());
    let body = json!({"model": MODEL, "prompt": "abc", "max_tokens": 40, "temperature": 0});
    let full = post(&app, "/v1/completions", body.clone()).await;
    assert_eq!(full.status, StatusCode::OK, "{}", full.text);
    let v = full.json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 40);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let streamed = post(&app, "/v1/completions", sbody).await;
    let data = streamed.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut joined = String::new();
    let mut finish = None;
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).expect("chunk");
        joined.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
        finish = chunk["choices"][0]["finish_reason"]
            .as_str()
            .map(str::to_owned)
            .or(finish);
    }
    assert_eq!(joined, text);
    assert_eq!(finish.as_deref(), Some("length"));

    // A stop string taken from the middle of the answer: the answer ends right before its first occurrence.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = &text[..text.find(&stop).expect("present")];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!([stop]);
        b["stream"] = json!(stream);
        let a = post(&app, "/v1/completions", b).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        let (got, finish) = if stream {
            let data = a.sse_data();
            let mut got = String::new();
            let mut finish = String::new();
            for d in &data[..data.len() - 1] {
                let chunk: Value = serde_json::from_str(d).expect("chunk");
                got.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
                if let Some(f) = chunk["choices"][0]["finish_reason"].as_str() {
                    finish = f.to_owned();
                }
            }
            (got, finish)
        } else {
            let v = a.json();
            (
                v["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        };
        assert_eq!(got, expected, "stream {stream}, stop {stop:?}");
        assert_eq!(finish, "stop");
    }
}

#[tokio::test]
async fn a_prompt_that_extends_the_session_prefills_only_new_tokens() {
    let app = app(state());
    let prompt: Vec<u32> = vec![64, 65, 66, 67, 68];
    let first = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 5,
        "return_token_ids": true}),
    )
    .await
    .json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let generated: Vec<u32> =
        serde_json::from_value(first["choices"][0]["token_ids"].clone()).expect("ids");
    let mut next = prompt.clone();
    next.extend(&generated);
    next.extend([69, 70]);
    let second = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": next, "max_tokens": 3}),
    )
    .await
    .json();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt.len() + generated.len(),
        "{second}"
    );
    // Reuse changes nothing in the answer.
    let fresh = app_state_answer(&next).await;
    assert_eq!(second["choices"][0]["text"], fresh["choices"][0]["text"]);
}

async fn app_state_answer(prompt: &[u32]) -> Value {
    let app = app(state());
    post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 3}),
    )
    .await
    .json()
}

#[tokio::test]
async fn the_next_chat_turn_reuses_the_previous_prompt() {
    // The engine's own pass length (auto, far longer than these prompts): the checkpoint sits at the end of the
    // first prompt whatever the chunking.
    let app = app(state());
    let first = post(&app, "/v1/chat/completions", chat_body("Hello there", 4))
        .await
        .json();
    let n_first = first["usage"]["prompt_tokens"].as_u64().expect("count");
    let reply = &first["choices"][0]["message"];
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": reply["content"], "reasoning_content": reply["reasoning_content"]},
        {"role": "user", "content": "And then?"},
    ]});
    let second = post(&app, "/v1/chat/completions", body.clone())
        .await
        .json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("count");
    assert!(
        cached >= n_first,
        "cached {cached} of the first prompt's {n_first}"
    );
    // Reuse changes nothing in the answer.
    let fresh = post(&crate::app(state()), "/v1/chat/completions", body)
        .await
        .json();
    assert_eq!(
        second["choices"][0]["message"], fresh["choices"][0]["message"],
        "{second} vs {fresh}"
    );
}

#[tokio::test]
async fn tool_round_trip_is_rendered_and_answered() {
    let app = app(state());
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = json!({"model": MODEL, "max_tokens": 4, "tools": tools, "tool_choice": "auto", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]});
    let a = post(&app, "/v1/chat/completions", body.clone()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert!(
        a.json()["usage"]["prompt_tokens"]
            .as_u64()
            .is_some_and(|n| n > 50)
    );
    // Arguments that are not a JSON object cannot be rendered.
    let mut bad = body;
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = json!("[1]");
    post(&app, "/v1/chat/completions", bad)
        .await
        .error(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn dropping_a_stream_stops_generation_within_a_token() {
    let state = state();
    let app = app(state.clone());
    let mut body = chat_body("Tell me a long story", 100_000);
    body["stream"] = json!(true);
    let request = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.into_body().into_data_stream();
    use futures_util::StreamExt;
    for _ in 0..5 {
        stream.next().await.expect("a chunk").expect("bytes");
    }
    assert!(state.is_busy());
    drop(stream);
    let start = Instant::now();
    while state.is_busy() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "still generating after the client left"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let a = post(&app, "/v1/chat/completions", chat_body("hi", 2)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}

#[tokio::test]
async fn dropping_a_non_streamed_request_stops_generation() {
    let state = state();
    let app = app(state.clone());
    let task = tokio::spawn({
        let app = app.clone();
        async move {
            post(
                &app,
                "/v1/chat/completions",
                chat_body("Tell me a long story", 100_000),
            )
            .await
        }
    });
    let start = Instant::now();
    while !state.is_busy() {
        assert!(start.elapsed() < Duration::from_secs(5), "never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    task.abort();
    let start = Instant::now();
    while state.is_busy() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "still generating after the client left"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn keep_alive_comments_flow_while_waiting() {
    // With a tiny interval, the stream carries keep-alive comments besides data.
    let app = app(state_with(EngineOptions::default(), |c| {
        c.keep_alive = Duration::from_millis(1)
    }));
    let mut body = chat_body("Tell me a long story", 400);
    body["stream"] = json!(true);
    let a = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        a.text.lines().any(|l| l == ": keep-alive"),
        "no keep-alive comment"
    );
    let (_, _, finish, _) = reassemble_chat(&a);
    assert_eq!(finish, "length");
}

#[tokio::test]
async fn dropping_a_request_during_prefill_stops_between_chunks() {
    // One token per prefill pass: reading this prompt takes seconds, so the abort lands inside the prefill.
    let state = state_with(EngineOptions::default().with_prefill_chunk(1), |_| {});
    let app = app(state.clone());
    let prompt: Vec<u32> = (0..4000).map(|i| 64 + i % 200).collect();
    let task = tokio::spawn({
        let app = app.clone();
        async move {
            post(
                &app,
                "/v1/completions",
                json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
            )
            .await
        }
    });
    let start = Instant::now();
    while !state.is_busy() {
        assert!(start.elapsed() < Duration::from_secs(5), "never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    task.abort();
    let start = Instant::now();
    while state.is_busy() {
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "the prefill went on after the client left"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The next request is served (and reuses what the cancelled prefill fed).
    let a = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": [64, 65, 66], "max_tokens": 2}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}

#[tokio::test]
async fn shutting_down_is_503_and_server_errors_hide_their_detail() {
    let state = state();
    let app = app(state.clone());
    state.begin_shutdown();
    let a = post(&app, "/v1/chat/completions", chat_body("hi", 2)).await;
    let e = a.error(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(e["type"], "server_error");
    assert!(!a.text.contains("shutting"), "{}", a.text);

    let secret = "/home/someone/model/shard-00001.safetensors: read failed";
    let body = crate::ApiError::Internal(secret.to_owned()).body();
    assert!(!body.to_string().contains("shard"), "{body}");
    assert_eq!(body["error"]["type"], "server_error");
}

/// `choices[0].message` of a chat answer, checked to be a 200.
fn message(a: &Answer) -> Value {
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    a.json()["choices"][0]["message"].clone()
}

/// A schema only enforcement can satisfy on random weights, with bounded output.
fn weather_schema() -> Value {
    json!({"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "metric": {"type": "boolean"}},
           "required": ["city", "days", "metric"], "additionalProperties": false})
}

/// Checks `v` against [`weather_schema`] by hand.
fn check_weather(v: &Value) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(obj.len(), 3, "{v}");
    assert!(
        ["Paris", "Oslo", "Lima"].contains(&v["city"].as_str().unwrap_or_default()),
        "{v}"
    );
    assert!(
        v["days"].as_i64().is_some_and(|d| (1..=14).contains(&d)),
        "{v}"
    );
    assert!(v["metric"].is_boolean(), "{v}");
}

#[tokio::test]
async fn json_schema_answers_follow_the_schema_greedy_and_sampled() {
    let app = app(state());
    for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2)] {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 200, "temperature": temperature, "seed": seed,
            "reasoning_effort": "none",
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "w", "strict": true, "schema": weather_schema()}}});
        let a = post(&app, "/v1/chat/completions", body.clone()).await;
        let m = message(&a);
        assert_eq!(
            a.json()["choices"][0]["finish_reason"],
            "stop",
            "{}",
            a.text
        );
        let content = m["content"].as_str().expect("content");
        let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content}"));
        check_weather(&v);
        // Streamed, the same answer (greedy, or the same seed).
        let mut streamed = body;
        streamed["stream"] = json!(true);
        let (_, content_streamed, finish, _) =
            reassemble_chat(&post(&app, "/v1/chat/completions", streamed).await);
        assert_eq!(content_streamed, content);
        assert_eq!(finish, "stop");
    }
    // Unconstrained, the same request does not give JSON (so the grammar did the work).
    let free = post(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "max_tokens": 40,
        "messages": [{"role": "user", "content": "Weather?"}], "reasoning_effort": "none"}),
    )
    .await;
    let content = message(&free)["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        serde_json::from_str::<Value>(&content).is_err(),
        "{content}"
    );
    let metrics = call(&app, "GET", "/metrics", None, &[]).await.text;
    assert!(
        metrics
            .lines()
            .any(|l| l == "deltafin_requests_constrained_total 6"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_schema_that_cannot_be_compiled_is_400() {
    let app = app(state());
    for format in [
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
    ] {
        let mut body = chat_body("hi", 4);
        body["response_format"] = format;
        let e = post(&app, "/v1/chat/completions", body)
            .await
            .error(StatusCode::BAD_REQUEST);
        assert_eq!(e["param"], "response_format", "{e}");
    }
    let mut body = chat_body("hi", 4);
    body["tools"] = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]);
    let e = post(&app, "/v1/chat/completions", body)
        .await
        .error(StatusCode::BAD_REQUEST);
    assert_eq!(e["param"], "tools", "{e}");
}

#[tokio::test]
async fn required_tool_calls_follow_each_tools_schema() {
    let app = app(state());
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}},
        // A pattern cannot be written as a raw argument: this tool's calls use K3's json element.
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"],
            "additionalProperties": false}}}
    ]);
    for (temperature, seed) in [(0.0, 0), (1.0, 5), (1.0, 6), (1.0, 7)] {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "max_tokens": 200, "temperature": temperature, "seed": seed, "tools": tools,
            "tool_choice": "required", "reasoning_effort": "none", "parallel_tool_calls": false});
        let a = post(&app, "/v1/chat/completions", body).await;
        let m = message(&a);
        assert_eq!(
            a.json()["choices"][0]["finish_reason"],
            "tool_calls",
            "{}",
            a.text
        );
        let calls = m["tool_calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1, "parallel_tool_calls: false");
        for call in calls {
            let f = &call["function"];
            let args: Value = serde_json::from_str(f["arguments"].as_str().expect("string"))
                .unwrap_or_else(|e| panic!("{e}: {f}"));
            match f["name"].as_str() {
                Some("get_weather") => check_weather(&args),
                Some("lookup") => {
                    let code = args["code"].as_str().expect("code");
                    assert!(
                        code.len() == 3 && code.chars().all(|c| c.is_ascii_uppercase()),
                        "{args}"
                    );
                }
                other => panic!("unknown tool {other:?}"),
            }
        }
    }
}

#[test]
fn the_grammar_accepts_what_k3_writes_and_nothing_else() {
    use deltafin_runtime::TokenMask;
    use deltafin_text::chat::{ResponseFormat, Tool, ToolChoice};

    let tokenizer = std::sync::Arc::new(
        deltafin_text::tokenizer::Tokenizer::from_dir(fixture()).expect("tokenizer"),
    );
    let end = tokenizer.require_special("<|end_of_msg|>").expect("end");
    let grammars = crate::constraint::Grammars::new(&tokenizer, tokenizer.vocab_size(), end)
        .expect("grammars");
    let tools: Vec<Tool> = serde_json::from_value(json!([{"type": "function", "function": {
        "name": "get_weather", "parameters": weather_schema()}}]))
    .expect("tools");
    let schema = ResponseFormat::JsonSchema(weather_schema());
    let cases = [
        // Thinking on, JSON answer.
        (
            true,
            &schema,
            &[][..],
            ToolChoice::Auto,
            "hmm<|close|>think<|sep|><|open|>response<|sep|>{\"city\": \"Oslo\", \"days\": 3, \"metric\": true}\
          <|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
            true,
        ),
        (
            true,
            &schema,
            &[][..],
            ToolChoice::Auto,
            "hmm<|close|>think<|sep|><|open|>response<|sep|>{\"city\": \"Rome\"",
            false,
        ),
        // A tool call in K3's argument form, after some answer text.
        (
            true,
            &ResponseFormat::Text,
            &tools[..],
            ToolChoice::Auto,
            "x<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>\
          <|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
          <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
          <|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
          <|open|>argument key=\"metric\" type=\"boolean\"<|sep|>false<|close|>argument<|sep|>\
          <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
            true,
        ),
        // Plain text is fine with tool_choice auto...
        (
            false,
            &ResponseFormat::Text,
            &tools[..],
            ToolChoice::Auto,
            "Hello.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
            true,
        ),
        // ... but not when a call is required, nor a call of an undeclared tool.
        (
            false,
            &ResponseFormat::Text,
            &tools[..],
            ToolChoice::Required,
            "Hello.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
            false,
        ),
        (
            false,
            &ResponseFormat::Text,
            &tools[..],
            ToolChoice::Auto,
            "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"rm_rf\"",
            false,
        ),
        // A required argument cannot be left out.
        (
            false,
            &ResponseFormat::Text,
            &tools[..],
            ToolChoice::Required,
            "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
          <|close|>call",
            false,
        ),
    ];
    for (i, (thinking, format, tools, choice, text, valid)) in cases.into_iter().enumerate() {
        let spec = crate::grammar::AnswerSpec {
            thinking,
            format,
            tools,
            tool_choice: choice,
            parallel_calls: true,
        };
        let mut mask = grammars
            .compile(&crate::grammar::lark(&spec).expect("lark"))
            .expect("compile");
        let ids = tokenizer.encode_with_specials(text);
        let mut ok = true;
        for &id in &ids {
            let allowed = mask.allowed().expect("mask");
            if !allowed[id as usize] {
                ok = false;
                break;
            }
            if id != end {
                mask.accept(id).expect("accept an allowed token");
            }
        }
        assert_eq!(ok, valid, "case {i}: {text}");
    }
}

#[tokio::test]
async fn logprobs_are_the_log_softmax_of_the_rows_prefill_gives() {
    let state = state();
    let app = app(state.clone());
    let prompt = vec![556u32, 64, 65, 66, 67];
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "logprobs": 5,
                      "return_token_ids": true});
    let a = post(&app, "/v1/completions", body.clone()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let v = a.json();
    let choice = &v["choices"][0];
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).expect("ids");
    let lp = &choice["logprobs"];
    let token_logprobs = lp["token_logprobs"].as_array().expect("token_logprobs");
    assert_eq!(token_logprobs.len(), ids.len());
    assert_eq!(lp["top_logprobs"].as_array().map(Vec::len), Some(ids.len()));
    // The reference: one prefill of prompt + answer, scored as `deltafin nll` scores it.
    let engine = engine(EngineOptions::default());
    let mut all = prompt.clone();
    all.extend_from_slice(&ids);
    let rows = engine.session().prefill(&all).expect("prefill");
    for (i, &id) in ids.iter().enumerate() {
        let row = rows.row(prompt.len() - 1 + i);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let want = row[id as usize] as f64 - lse;
        let got = token_logprobs[i].as_f64().expect("number");
        assert!((got - want).abs() < 1e-4, "token {i}: {got} vs {want}");
        // Greedy: the chosen token is the most likely one, and five alternatives are listed.
        let top = lp["top_logprobs"][i].as_object().expect("top");
        assert!(!top.is_empty() && top.len() <= 5, "{top:?}");
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::NEG_INFINITY, f64::max);
        assert!((best - got).abs() < 1e-9, "{best} vs {got}");
    }
    // Streamed: the same log-probabilities, chunk by chunk.
    let mut streamed_body = body;
    streamed_body["stream"] = json!(true);
    let s = post(&app, "/v1/completions", streamed_body).await;
    let mut streamed = Vec::new();
    for d in s.sse_data().iter().filter(|d| d.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(d).expect("chunk");
        if let Some(values) = chunk["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed.extend(values.iter().filter_map(Value::as_f64));
        }
    }
    let full: Vec<f64> = token_logprobs.iter().filter_map(Value::as_f64).collect();
    assert_eq!(streamed, full);

    // Chat: one entry per generated token, with up to 20 alternatives, streamed too.
    let mut chat = chat_body("Hello there", 6);
    chat["logprobs"] = json!(true);
    chat["top_logprobs"] = json!(20);
    chat["return_token_ids"] = json!(true);
    let c = post(&app, "/v1/chat/completions", chat.clone())
        .await
        .json();
    let content = c["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .clone();
    assert_eq!(content.len(), 6);
    assert_eq!(
        content[0]["top_logprobs"].as_array().map(Vec::len),
        Some(20)
    );
    assert!(
        content
            .iter()
            .all(|e| e["logprob"].as_f64().is_some_and(|x| x <= 0.0))
    );
    chat["stream"] = json!(true);
    let s = post(&app, "/v1/chat/completions", chat).await;
    let mut streamed = Vec::new();
    for d in s.sse_data().iter().filter(|d| d.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(d).expect("chunk");
        if let Some(entries) = chunk["choices"][0]["logprobs"]["content"].as_array() {
            streamed.extend(entries.iter().cloned());
        }
    }
    assert_eq!(streamed, content);
}

#[tokio::test]
async fn metrics_count_requests_tokens_and_engine_work() {
    let app = app(state());
    let a = post(&app, "/v1/chat/completions", chat_body("count me", 5)).await;
    assert_eq!(a.status, StatusCode::OK);
    let usage = a.json()["usage"].clone();
    let m = call(&app, "GET", "/metrics", None, &[]).await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(
        m.headers[header::CONTENT_TYPE]
            .to_str()
            .is_ok_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        m.headers
    );
    let value = |name: &str| -> f64 {
        m.text
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{}", m.text))
    };
    assert_eq!(value("deltafin_requests_total{endpoint=\"chat\"}"), 1.0);
    assert_eq!(
        value("deltafin_generated_tokens_total"),
        usage["completion_tokens"].as_f64().expect("n")
    );
    assert_eq!(
        value("deltafin_prompt_tokens_total"),
        usage["prompt_tokens"].as_f64().expect("n")
    );
    assert!(value("deltafin_prefill_seconds_total") > 0.0);
    assert!(value("deltafin_decode_seconds_total") > 0.0);
    // The fixture's experts are all read through the cache: every request is a hit or a miss.
    assert!(
        value("deltafin_expert_cache_hits_total") + value("deltafin_expert_cache_misses_total")
            > 0.0
    );
    assert_eq!(value("deltafin_queue_waiting"), 0.0);
    for name in [
        "deltafin_read_bytes_total{kind=\"experts\"}",
        "deltafin_speculation_drafted_total",
        "deltafin_speculation_accepted_total",
    ] {
        assert!(value(name) >= 0.0);
    }
}

#[tokio::test]
async fn the_chat_page_is_served_and_loads_nothing_from_elsewhere() {
    let app = app(state_with(EngineOptions::default(), |c| {
        c.api_key = Some("k".into())
    }));
    // No key needed for the page itself; it sends the key the user types to /v1.
    let page = call(&app, "GET", "/", None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.headers[header::CONTENT_TYPE]
            .to_str()
            .is_ok_and(|c| c.starts_with("text/html")),
        "{:?}",
        page.headers
    );
    for id in [
        "id=\"send\"",
        "id=\"stop\"",
        "id=\"thinking\"",
        "id=\"effort\"",
        "reasoning_content",
        "/v1/chat/completions",
    ] {
        assert!(page.text.contains(id), "{id}");
    }
    for outside in ["http://", "https://", "src=", "<link", "@import"] {
        assert!(
            !page.text.contains(outside),
            "the page refers elsewhere: {outside}"
        );
    }
    assert!(page.headers.contains_key(header::CONTENT_SECURITY_POLICY));
}
