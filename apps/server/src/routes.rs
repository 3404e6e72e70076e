//! Handlers: request → prompt ids, options and grammar → a place in the engine's queue → a job on the engine
//! thread → a JSON answer or an SSE stream; plus `/health`, `/metrics` and the chat page.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use deltafin_runtime::{GenerateOptions, SamplingParams};
use deltafin_text::chat::{
    self, ChatOptions, ParsedToolCall, ResponseFormat, ThinkingEffort, ToolChoice,
};
use deltafin_text::tokenizer::Tokenizer;
use futures_util::StreamExt;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::api::{self, ChatRequest, Prompt, SamplingFields};
use crate::constraint::GrammarMask;
use crate::error::ApiError;
use crate::grammar::{self, AnswerSpec};
use crate::logprobs::{self as lp, TokenLogprob};
use crate::metrics::RequestKind;
use crate::output::{Delta, OutputKind};
use crate::queue::{EnginePermit, Place, Ticket};
use crate::worker::{CancelOnDrop, Event, Job, Outcome, Usage};
use crate::{AppState, DEFAULT_COMPLETION_MAX_TOKENS};

pub(crate) fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/", get(crate::page::chat_page))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config().body_limit))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_owned())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Checks `Authorization: Bearer <key>` in constant time when a key is configured.
async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config().api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default()
            .trim();
        // Compares every byte whatever the first difference (only the length can leak).
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

async fn health(State(state): State<AppState>) -> Response {
    let busy = state.is_busy();
    axum::Json(json!({
        "status": "ok",
        "model": state.config().model_id,
        "busy": busy,
        "state": if busy { "generating" } else { "idle" },
        "queued": state.waiting(),
    }))
    .into_response()
}

/// Prometheus' text format (version 0.0.4).
async fn metrics(State(state): State<AppState>) -> Response {
    let text =
        state
            .inner
            .metrics
            .render(&state.config().model_id, state.waiting(), state.is_busy());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.config().model_id,
        "object": "model",
        "created": state.inner.created,
        "owned_by": "deltafin",
    })
}

async fn list_models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

async fn get_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_model(&state, &id)?;
    Ok(axum::Json(model_object(&state)).into_response())
}

fn check_model(state: &AppState, requested: &str) -> Result<(), ApiError> {
    if requested == state.config().model_id {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound {
            requested: requested.to_owned(),
            served: state.config().model_id.clone(),
        })
    }
}

fn read_body(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge {
                limit: state.config().body_limit,
            }
        } else {
            ApiError::bad_request(format!("cannot read the request body: {}", e.body_text()))
        }
    })
}

/// Which endpoint an answer is shaped for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

/// A checked request, ready for the engine.
struct Prepared {
    endpoint: Endpoint,
    prompt: Vec<u32>,
    options: GenerateOptions,
    output: OutputKind,
    stops: Arc<[String]>,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    mask: Option<GrammarMask>,
    top_logprobs: Option<usize>,
}

async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_body(&state, body)?;
    let request = api::parse_chat(&body)?;
    check_model(&state, &request.model)?;
    let options = chat_options(&request)?;
    let max_tokens = request
        .max_completion_tokens
        .or(request.sampling.max_tokens);
    let mut generate = generate_options(
        &state,
        &request.sampling(),
        max_tokens,
        state.config().default_chat_max_tokens,
    )?;
    // The turn ends at `<|end_of_msg|>` even where a config names another end-of-sequence id.
    generate.stop_tokens.push(state.inner.end_of_msg);
    let stops = stop_strings(&request.sampling())?;
    let top_logprobs = request.logprobs()?;
    let tokenizer = Arc::clone(&state.inner.tokenizer);
    let grammars = Arc::clone(&state.inner.grammars);
    let messages = request.messages;
    let thinking = options.thinking;
    let parallel_calls = request.parallel_tool_calls.unwrap_or(true);
    // Rendering and compiling the grammar take a moment for long chats and large schemas: off the async threads.
    let (rendered, mask) = tokio::task::spawn_blocking(move || {
        let rendered = chat::render(&tokenizer, &messages, &options).map_err(|e| {
            if e.is_bad_conversation() {
                ApiError::invalid("messages", e.to_string())
            } else {
                ApiError::Internal(format!("rendering the prompt: {e}"))
            }
        })?;
        let mask = answer_grammar(&grammars, &options, parallel_calls)?;
        Ok::<_, ApiError>((rendered, mask))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("rendering task: {e}")))??;
    let prepared = Prepared {
        endpoint: Endpoint::Chat,
        prompt: rendered.ids,
        options: generate,
        output: OutputKind::Chat { thinking },
        stops,
        stream: request.stream.unwrap_or(false),
        include_usage: request.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: request.return_token_ids.unwrap_or(false),
        mask,
        top_logprobs,
    };
    run(state, prepared).await
}

async fn completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_body(&state, body)?;
    let request = api::parse_completion(&body)?;
    check_model(&state, &request.model)?;
    let sampling = request.sampling();
    let generate = generate_options(
        &state,
        &sampling,
        sampling.max_tokens,
        DEFAULT_COMPLETION_MAX_TOKENS,
    )?;
    let stops = stop_strings(&sampling)?;
    let top_logprobs = request.logprobs()?;
    let prompt = request.prompt.single()?;
    if let Prompt::Ids(ids) = &prompt
        && let Some(bad) = ids
            .iter()
            .find(|&&id| id as usize >= state.inner.vocab_size)
    {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "token id {bad} is out of range (vocabulary of {})",
                state.inner.vocab_size
            ),
        ));
    }
    let ids = match prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            let tokenizer = Arc::clone(&state.inner.tokenizer);
            tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                .await
                .map_err(|e| ApiError::Internal(format!("encoding task: {e}")))?
        }
    };
    let prepared = Prepared {
        endpoint: Endpoint::Completion,
        prompt: ids,
        options: generate,
        output: OutputKind::Text,
        stops,
        stream: request.stream.unwrap_or(false),
        include_usage: request.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: request.return_token_ids.unwrap_or(false),
        mask: None,
        top_logprobs,
    };
    run(state, prepared).await
}

/// The compiled grammar of a chat answer, when the request constrains it (a JSON response format, or tools whose
/// calls must follow their schemas); a schema that cannot be compiled is a 400 naming its field.
fn answer_grammar(
    grammars: &crate::constraint::Grammars,
    options: &ChatOptions,
    parallel_calls: bool,
) -> Result<Option<GrammarMask>, ApiError> {
    let spec = AnswerSpec {
        thinking: options.thinking,
        format: &options.response_format,
        tools: &options.tools,
        tool_choice: options.tool_choice,
        parallel_calls,
    };
    if !spec.is_constrained() {
        return Ok(None);
    }
    let lark = grammar::lark(&spec).map_err(|e| ApiError::invalid(e.param, e.message))?;
    grammars.compile(&lark).map(Some).map_err(|e| {
        let param = if matches!(spec.format, ResponseFormat::Text) {
            "tools"
        } else {
            "response_format"
        };
        ApiError::invalid(
            param,
            format!("cannot constrain the answer to this schema: {e}"),
        )
    })
}

/// K3 rendering options from a chat request: thinking (on by default), effort, tools, tool choice, format.
fn chat_options(request: &ChatRequest) -> Result<ChatOptions, ApiError> {
    let mut options = ChatOptions::default();
    let mut thinking_set = None;
    if let Some(kwargs) = &request.chat_template_kwargs {
        for (key, value) in kwargs {
            let param = format!("chat_template_kwargs.{key}");
            match key.as_str() {
                "thinking" | "enable_thinking" => {
                    let on = value.as_bool().ok_or_else(|| {
                        ApiError::invalid(&param, format!("`{param}` must be a boolean"))
                    })?;
                    thinking_set = Some(on);
                    options.thinking = on;
                }
                "thinking_effort" => {
                    options.thinking_effort = Some(
                        value
                            .as_str()
                            .and_then(|s| s.parse::<ThinkingEffort>().ok())
                            .ok_or_else(|| {
                                ApiError::invalid(
                                    &param,
                                    format!("`{param}` must be low, high or max"),
                                )
                            })?,
                    );
                }
                _ => {
                    return Err(ApiError::unsupported(
                        &param,
                        format!(
                            "unsupported chat template argument `{param}` (supported: thinking, thinking_effort)"
                        ),
                    ));
                }
            }
        }
    }
    if let Some(effort) = &request.reasoning_effort {
        match effort.as_str() {
            "none" => {
                if thinking_set == Some(true) {
                    return Err(ApiError::invalid(
                        "reasoning_effort",
                        "reasoning_effort `none` contradicts chat_template_kwargs.thinking = true",
                    ));
                }
                options.thinking = false;
            }
            "low" | "high" | "max" => {
                if thinking_set == Some(false) {
                    return Err(ApiError::invalid(
                        "reasoning_effort",
                        format!(
                            "reasoning_effort `{effort}` needs thinking on, but chat_template_kwargs.thinking is false"
                        ),
                    ));
                }
                options.thinking_effort = effort.parse::<ThinkingEffort>().ok();
            }
            other => {
                return Err(ApiError::invalid(
                    "reasoning_effort",
                    format!(
                        "unsupported reasoning_effort `{other}`: K3 takes none (thinking off), low, high or max"
                    ),
                ));
            }
        }
    }
    if let Some(tools) = &request.tools {
        if let Some(bad) = tools.iter().find(|t| t.kind != "function") {
            return Err(ApiError::invalid(
                "tools",
                format!("unsupported tool type `{}` (only function)", bad.kind),
            ));
        }
        options.tools = tools.clone();
    }
    if let Some(choice) = &request.tool_choice {
        options.tool_choice = match choice.as_str() {
            Some("auto") => ToolChoice::Auto,
            Some("required") => ToolChoice::Required,
            Some("none") => ToolChoice::None,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice must be auto, required or none (naming one function is not supported)",
                ));
            }
        };
    }
    if let Some(format) = &request.response_format {
        let kind = format.get("type").and_then(Value::as_str);
        if !matches!(kind, Some("text" | "json_object" | "json_schema")) {
            return Err(ApiError::invalid(
                "response_format",
                "response_format.type must be text, json_object or json_schema",
            ));
        }
        options.response_format = ResponseFormat::from_openai(format);
    }
    Ok(options)
}

/// Length and sampling, checked field by field.
fn generate_options(
    state: &AppState,
    s: &SamplingFields,
    max_tokens: Option<u64>,
    default_max: usize,
) -> Result<GenerateOptions, ApiError> {
    let max_new = match max_tokens {
        Some(0) => {
            return Err(ApiError::invalid(
                "max_tokens",
                "max_tokens must be at least 1",
            ));
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => default_max,
    };
    let temperature = s.temperature.unwrap_or(0.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be a finite number >= 0, got {temperature}"),
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let sampling = SamplingParams {
        temperature,
        top_p,
        top_k: s
            .top_k
            .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        // OpenAI's seed is a signed 64-bit integer; its bits seed the stream.
        seed: s.seed.map_or(0, |seed| seed as u64),
    };
    Ok(GenerateOptions {
        max_new,
        sampling,
        ignore_eos: false,
        stop_tokens: Vec::new(),
        speculation_depth: state.config().speculation_depth,
    })
}

fn stop_strings(s: &SamplingFields) -> Result<Arc<[String]>, ApiError> {
    Ok(match &s.stop {
        Some(stop) => stop.clone().strings()?.into(),
        None => Arc::from(Vec::new()),
    })
}

/// Takes a place in the engine's queue, hands the job to the engine thread in its turn and answers as the request
/// asked. A streamed answer starts at once (it says its queue position in SSE comments while it waits).
async fn run(state: AppState, mut prepared: Prepared) -> Result<Response, ApiError> {
    let place = state.join_queue()?;
    state.inner.metrics.request(match prepared.endpoint {
        Endpoint::Chat => RequestKind::Chat,
        Endpoint::Completion => RequestKind::Completion,
    });
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt: prepared.prompt.clone(),
        options: prepared.options.clone(),
        output: prepared.output,
        stops: Arc::clone(&prepared.stops),
        events: tx,
        cancel: Arc::clone(&cancel),
        permit: None,
        mask: prepared.mask.take(),
        top_logprobs: prepared.top_logprobs,
    };
    let wire = Wire::new(&state, &prepared);
    let guard = CancelOnDrop(cancel);
    if prepared.stream {
        return Ok(stream_response(state, wire, rx, guard, place, job));
    }
    // Dropping this future while it waits (client gone) drops the ticket: the request leaves the queue.
    let permit = match place {
        Place::Run(permit) => permit,
        Place::Wait(ticket) => ticket.wait().await,
    };
    submit(&state, job, permit)?;
    collect_response(wire, rx, guard).await
}

/// Gives the job, holding the engine, to the engine thread.
fn submit(state: &AppState, mut job: Job, permit: EnginePermit) -> Result<(), ApiError> {
    if state.is_shutting_down() {
        return Err(ApiError::Unavailable(
            "the server is shutting down".to_owned(),
        ));
    }
    job.permit = Some(permit);
    state
        .inner
        .jobs
        .send(job)
        .map_err(|_| ApiError::Unavailable("the engine thread has stopped".to_owned()))
}

/// Waits for the whole answer. Dropping this future (client gone) drops `guard` and the receiver, which stops
/// generation.
async fn collect_response(
    wire: Wire,
    mut rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
) -> Result<Response, ApiError> {
    let _guard = guard;
    let mut answer = Delta::default();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Delta(d) => answer.append(d),
            Event::Done(outcome) => {
                return Ok(axum::Json(wire.full(&answer, &outcome)).into_response());
            }
            Event::Failed(detail) => return Err(ApiError::Internal(detail)),
        }
    }
    Err(ApiError::Internal(
        "the engine thread ended without an answer".to_owned(),
    ))
}

fn stream_response(
    state: AppState,
    wire: Wire,
    rx: UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    place: Place,
    job: Job,
) -> Response {
    let keep_alive = state.config().keep_alive;
    let (queued, job) = match place {
        Place::Run(permit) => (None, submit(&state, job, permit).err()),
        Place::Wait(ticket) => (Some((ticket, job)), None),
    };
    let streamer = Streamer {
        state,
        queued,
        position: 0,
        rx,
        _guard: guard,
        wire,
        pending_ids: Vec::new(),
        pending_logprobs: Vec::new(),
        text_offset: 0,
        sent_first: false,
        n_tool_calls: 0,
        done: false,
        failed: job,
    };
    let events = futures_util::stream::unfold(streamer, |mut s| async move {
        let batch = s.next_batch().await?;
        Some((
            futures_util::stream::iter(batch.into_iter().map(Ok::<_, Infallible>)),
            s,
        ))
    })
    .flatten();
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive"))
        .into_response()
}

/// Turns engine events into SSE events. Owned by the response body: when the client goes away the body is dropped,
/// and with it the receiver and the cancel guard.
struct Streamer {
    state: AppState,
    /// While waiting in the queue: the ticket and the job to submit in its turn.
    queued: Option<(Ticket, Job)>,
    /// The queue position last told to the client.
    position: usize,
    rx: UnboundedReceiver<Event>,
    _guard: CancelOnDrop,
    wire: Wire,
    /// Ids decided since the last chunk (sent with the next one when `return_token_ids`).
    pending_ids: Vec<u32>,
    /// Their log-probabilities (sent with the next chunk when asked for).
    pending_logprobs: Vec<TokenLogprob>,
    /// Characters of completion text covered by log-probabilities sent so far.
    text_offset: usize,
    sent_first: bool,
    n_tool_calls: usize,
    done: bool,
    /// A job that could not be submitted: its error is the stream's only event.
    failed: Option<ApiError>,
}

impl Streamer {
    /// Waits for this request's turn, telling the client each new queue position as an SSE comment; `Some` with
    /// a batch to send, `None` once the job is with the engine.
    async fn wait_turn(&mut self) -> Option<Vec<SseEvent>> {
        let (ticket, _) = self.queued.as_mut()?;
        if self.position == 0 {
            self.position = ticket.position();
            return Some(vec![queue_comment(self.position)]);
        }
        loop {
            match ticket.next().await {
                Ok(permit) => {
                    let (_, job) = self.queued.take()?;
                    if let Err(e) = submit(&self.state, job, permit) {
                        self.done = true;
                        return Some(vec![data(&e.body())]);
                    }
                    return None;
                }
                Err(position) if position != self.position => {
                    self.position = position;
                    return Some(vec![queue_comment(position)]);
                }
                Err(_) => {}
            }
        }
    }

    async fn next_batch(&mut self) -> Option<Vec<SseEvent>> {
        if self.done {
            return None;
        }
        if let Some(e) = self.failed.take() {
            self.done = true;
            return Some(vec![data(&e.body())]);
        }
        if let Some(batch) = self.wait_turn().await {
            return Some(batch);
        }
        if !self.sent_first && self.wire.endpoint == Endpoint::Chat {
            // The role chunk goes out at once, so the client sees the answer has started.
            self.sent_first = true;
            let chunk = self.wire.chat_chunk(
                json!({"role": "assistant", "content": ""}),
                None,
                &[],
                &[],
                true,
            );
            return Some(vec![data(&chunk)]);
        }
        loop {
            match self.rx.recv().await {
                Some(Event::Delta(d)) => {
                    self.pending_ids.extend_from_slice(&d.token_ids);
                    self.pending_logprobs.extend_from_slice(&d.logprobs);
                    if d.has_output() {
                        let ids = std::mem::take(&mut self.pending_ids);
                        let logprobs = std::mem::take(&mut self.pending_logprobs);
                        let first = !self.sent_first;
                        self.sent_first = true;
                        let chunk = match self.wire.endpoint {
                            Endpoint::Chat => {
                                let delta = chat_delta(&d, &mut self.n_tool_calls);
                                self.wire.chat_chunk(delta, None, &ids, &logprobs, first)
                            }
                            Endpoint::Completion => {
                                let offset = self.text_offset;
                                self.text_offset += lp::text_len(&self.wire.tokenizer, &logprobs);
                                self.wire
                                    .text_chunk(&d.content, None, &ids, &logprobs, offset, first)
                            }
                        };
                        return Some(vec![data(&chunk)]);
                    }
                }
                Some(Event::Done(outcome)) => {
                    self.done = true;
                    let ids = std::mem::take(&mut self.pending_ids);
                    let logprobs = std::mem::take(&mut self.pending_logprobs);
                    let first = !self.sent_first;
                    let finish = Some(outcome.finish.as_str());
                    let last = match self.wire.endpoint {
                        Endpoint::Chat => {
                            self.wire
                                .chat_chunk(json!({}), finish, &ids, &logprobs, first)
                        }
                        Endpoint::Completion => self.wire.text_chunk(
                            "",
                            finish,
                            &ids,
                            &logprobs,
                            self.text_offset,
                            first,
                        ),
                    };
                    let mut batch = vec![data(&last)];
                    if self.wire.include_usage {
                        batch.push(data(&self.wire.usage_chunk(&outcome.usage)));
                    }
                    batch.push(SseEvent::default().data("[DONE]"));
                    return Some(batch);
                }
                Some(Event::Failed(detail)) => {
                    self.done = true;
                    return Some(vec![data(&ApiError::Internal(detail).body())]);
                }
                None => {
                    self.done = true;
                    let e =
                        ApiError::Internal("the engine thread ended without an answer".to_owned());
                    return Some(vec![data(&e.body())]);
                }
            }
        }
    }
}

fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

/// `: queued, position N` (1 = next).
fn queue_comment(position: usize) -> SseEvent {
    SseEvent::default().comment(format!("queued, position {position}"))
}

/// A chat delta object: only the fields this delta has.
fn chat_delta(d: &Delta, n_tool_calls: &mut usize) -> Value {
    let mut delta = serde_json::Map::new();
    if !d.reasoning.is_empty() {
        delta.insert(
            "reasoning_content".into(),
            Value::String(d.reasoning.clone()),
        );
    }
    if !d.content.is_empty() {
        delta.insert("content".into(), Value::String(d.content.clone()));
    }
    if !d.tool_calls.is_empty() {
        let calls = tool_calls_json(&d.tool_calls, *n_tool_calls, true);
        *n_tool_calls += d.tool_calls.len();
        delta.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(delta)
}

/// OpenAI `tool_calls` entries for calls the model made; `first` is the position of the first one in the answer.
/// Streamed entries carry their `index`.
pub(crate) fn tool_calls_json(
    calls: &[ParsedToolCall],
    first: usize,
    with_index: bool,
) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let mut v = json!({
                "id": new_id("call_"),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            });
            if with_index {
                v["index"] = json!(first + i);
            }
            v
        })
        .collect()
}

/// A fresh id in OpenAI's style: `chatcmpl-…`, `cmpl-…`, `call_…`.
fn new_id(prefix: &str) -> String {
    format!("{prefix}{:032x}", rand::random::<u128>())
}

fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        // deltafin's own: what the prompt cost (OpenAI clients ignore unknown fields).
        "prefill_time_s": usage.prefill_seconds,
        "prefill_read_bytes": usage.prefill_read_bytes,
    })
}

/// The parts every answer object of one request shares.
pub(crate) struct Wire {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    return_token_ids: bool,
    prompt_ids: Vec<u32>,
    /// Whether answers carry log-probabilities.
    logprobs: bool,
    tokenizer: Arc<Tokenizer>,
}

impl Wire {
    fn new(state: &AppState, p: &Prepared) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            endpoint: p.endpoint,
            id: new_id(match p.endpoint {
                Endpoint::Chat => "chatcmpl-",
                Endpoint::Completion => "cmpl-",
            }),
            created,
            model: state.config().model_id.clone(),
            include_usage: p.include_usage,
            return_token_ids: p.return_token_ids,
            prompt_ids: if p.return_token_ids {
                p.prompt.clone()
            } else {
                Vec::new()
            },
            logprobs: p.top_logprobs.is_some(),
            tokenizer: Arc::clone(&state.inner.tokenizer),
        }
    }

    /// `choices[].logprobs`: `null` unless the request asked for them.
    fn logprobs_json(&self, tokens: &[TokenLogprob], offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => lp::chat_json(&self.tokenizer, tokens),
            Endpoint::Completion => lp::completion_json(&self.tokenizer, tokens, offset),
        }
    }

    fn object(&self, kind: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The non-streamed answer.
    fn full(&self, answer: &Delta, outcome: &Outcome) -> Value {
        let mut choice = match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant"});
                message["content"] = if answer.content.is_empty() && !answer.tool_calls.is_empty() {
                    Value::Null
                } else {
                    Value::String(answer.content.clone())
                };
                if !answer.reasoning.is_empty() {
                    message["reasoning_content"] = Value::String(answer.reasoning.clone());
                }
                if !answer.tool_calls.is_empty() {
                    message["tool_calls"] =
                        Value::Array(tool_calls_json(&answer.tool_calls, 0, false));
                }
                json!({"index": 0, "message": message,
                       "logprobs": self.logprobs_json(&answer.logprobs, 0),
                       "finish_reason": outcome.finish.as_str()})
            }
            Endpoint::Completion => json!({"index": 0, "text": answer.content,
                                           "logprobs": self.logprobs_json(&answer.logprobs, 0),
                                           "finish_reason": outcome.finish.as_str()}),
        };
        if self.return_token_ids {
            choice["token_ids"] = json!(answer.token_ids);
        }
        let kind = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        };
        let mut object = self.object(kind, json!([choice]));
        object["usage"] = usage_json(&outcome.usage);
        if self.return_token_ids {
            object["prompt_token_ids"] = json!(self.prompt_ids);
        }
        object
    }

    fn chunk(&self, mut choice: Value, ids: &[u32], first: bool) -> Value {
        if self.return_token_ids {
            choice["token_ids"] = json!(ids);
        }
        let kind = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        let mut object = self.object(kind, json!([choice]));
        if self.include_usage {
            object["usage"] = Value::Null;
        }
        if first && self.return_token_ids {
            object["prompt_token_ids"] = json!(self.prompt_ids);
        }
        object
    }

    fn chat_chunk(
        &self,
        delta: Value,
        finish: Option<&str>,
        ids: &[u32],
        logprobs: &[TokenLogprob],
        first: bool,
    ) -> Value {
        let choice = json!({"index": 0, "delta": delta, "logprobs": self.logprobs_json(logprobs, 0),
                            "finish_reason": finish});
        self.chunk(choice, ids, first)
    }

    fn text_chunk(
        &self,
        text: &str,
        finish: Option<&str>,
        ids: &[u32],
        logprobs: &[TokenLogprob],
        offset: usize,
        first: bool,
    ) -> Value {
        let choice = json!({"index": 0, "text": text, "logprobs": self.logprobs_json(logprobs, offset),
                            "finish_reason": finish});
        self.chunk(choice, ids, first)
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut object = self.object(
            match self.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completion => "text_completion",
            },
            json!([]),
        );
        object["usage"] = usage_json(usage);
        object
    }
}

#[cfg(test)]
pub(crate) mod wire_tests {
    //! Shapes of answers built from engine events, without an engine.

    use super::*;
    use crate::worker::Finish;

    pub(crate) fn chat_wire() -> Wire {
        Wire {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-test".into(),
            created: 0,
            model: "m".into(),
            include_usage: true,
            return_token_ids: false,
            prompt_ids: Vec::new(),
            logprobs: false,
            tokenizer: Arc::new(fixture_tokenizer()),
        }
    }

    pub(crate) fn fixture_tokenizer() -> deltafin_text::tokenizer::Tokenizer {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/k3/k3-tiny-a");
        deltafin_text::tokenizer::Tokenizer::from_dir(&dir).expect("fixture tokenizer")
    }

    #[test]
    fn parsed_tool_calls_become_openai_tool_calls() {
        let answer = Delta {
            token_ids: vec![1, 2, 3],
            logprobs: Vec::new(),
            reasoning: "think".into(),
            content: String::new(),
            tool_calls: vec![ParsedToolCall {
                index: 1,
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            }],
        };
        let outcome = Outcome {
            finish: Finish::ToolCalls,
            usage: Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_tokens: 0,
                ..Usage::default()
            },
        };
        let v = chat_wire().full(&answer, &outcome);
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["reasoning_content"], "think");
        let call = &message["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
        assert!(
            call["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_"))
        );
        assert_eq!(v["usage"]["total_tokens"], 8);

        // Streamed: the call is one delta with its index.
        let mut n = 0;
        let delta = chat_delta(&answer, &mut n);
        assert_eq!(n, 1);
        assert_eq!(delta["tool_calls"][0]["index"], 0);
        assert_eq!(delta["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(delta["reasoning_content"], "think");
        assert!(delta.get("content").is_none());
    }

    #[test]
    fn generated_tool_call_markup_ends_as_tool_calls() {
        use crate::output::OutputAssembler;
        use deltafin_runtime::FinishReason;

        let tokenizer = Arc::new(fixture_tokenizer());
        // What K3 writes after the thinking generation prompt when it calls a tool.
        let generated = "let me check<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>\
                         <|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
                         <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
                         <|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
                         <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
        let ids = tokenizer.encode_with_specials(generated);
        let mut out = OutputAssembler::new(
            Arc::clone(&tokenizer),
            OutputKind::Chat { thinking: true },
            Arc::from(Vec::new()),
        )
        .expect("assembler");
        let mut answer = Delta::default();
        let mut streamed = Vec::new();
        let mut n_streamed = 0;
        for &id in &ids {
            let d = out.push(id);
            if d.has_output() {
                streamed.push(chat_delta(&d, &mut n_streamed));
            }
            answer.append(d);
        }
        answer.append(out.finish());
        assert_eq!(answer.reasoning, "let me check");
        assert_eq!(answer.content, "Checking.");
        assert_eq!(answer.tool_calls.len(), 1);
        let finish = Finish::of(FinishReason::Stop, out.stopped(), out.n_tool_calls());
        assert_eq!(finish, Finish::ToolCalls);
        let outcome = Outcome {
            finish,
            usage: Usage {
                prompt_tokens: 1,
                completion_tokens: ids.len(),
                cached_tokens: 0,
                ..Usage::default()
            },
        };
        let v = chat_wire().full(&answer, &outcome);
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["arguments"].as_str().expect("string")).expect("JSON");
        assert_eq!(args, json!({"city": "Paris", "days": 2}));
        let streamed_call = streamed
            .iter()
            .find_map(|d| d.get("tool_calls"))
            .expect("a streamed tool call delta");
        assert_eq!(streamed_call[0]["index"], 0);
        assert_eq!(streamed_call[0]["function"]["name"], "get_weather");
    }
}
