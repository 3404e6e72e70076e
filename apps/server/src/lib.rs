//! deltafin's OpenAI-compatible HTTP server: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
//! `/metrics` and a chat page at `/`.
//!
//! [`app`] builds the router over an [`AppState`]; [`serve`] runs it on a socket with graceful shutdown. The
//! state holds a channel to a dedicated engine thread (`worker`), which owns the [`Engine`] and one long-lived
//! session and runs one generation at a time; other requests wait their turn in a bounded FIFO queue (`queue`),
//! and a request that finds it full is answered 429 with `Retry-After`. Tokens come back over a channel as they
//! are decided and are streamed as server-sent events (with keep-alive comments while a token is being computed,
//! and the queue position while waiting) or gathered into one JSON answer. A client that goes away drops the
//! receiving side (or its place in the queue), and generation stops within one token. Requests may constrain the
//! answer to a grammar (`grammar`, `constraint`: JSON response formats and tool schemas) and ask for
//! log-probabilities (`logprobs`); `metrics` counts what the server and the engine did.
//!
//! **Invariant:** this crate knows HTTP and OpenAI's JSON shapes; it knows no model math and no storage. It uses
//! the runtime's `Engine`/`Session` (and its `TokenMask` hook) and the model crate's chat renderer, parser and
//! tokenizer, nothing below.

#![deny(missing_docs)]

mod api;
pub mod constraint;
pub mod error;
mod grammar;
mod logprobs;
mod metrics;
mod output;
mod page;
mod queue;
mod routes;
mod worker;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use deltafin_runtime::Engine;
use deltafin_text::chat::END_OF_MSG;
use deltafin_text::tokenizer::Tokenizer;

use constraint::Grammars;
pub use error::{ApiError, ServerError};
use metrics::Metrics;
use queue::{EngineQueue, Place};
use worker::Job;

/// Default request body limit: 16 MiB (a long conversation is a few MiB of JSON).
pub const DEFAULT_BODY_LIMIT: usize = 16 << 20;
/// Default interval of SSE keep-alive comments.
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(15);
/// Default `max_tokens` of a chat completion when the request gives none.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 4096;
/// Default `max_tokens` of a text completion (OpenAI's default).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;
/// Default number of requests that may wait behind the running one (editors and agents often send two or three
/// at once).
pub const DEFAULT_MAX_QUEUE: usize = 4;

/// Settings of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients name in `model` (and `/v1/models` lists).
    pub model_id: String,
    /// When set, every `/v1/...` request needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body, in bytes (413 above).
    pub body_limit: usize,
    /// Interval of SSE keep-alive comments.
    pub keep_alive: Duration,
    /// `max_tokens` of a chat completion when the request gives none.
    pub default_chat_max_tokens: usize,
    /// Draft depth of n-gram speculation for greedy requests (0 = off; lossless).
    pub speculation_depth: usize,
    /// Requests that may wait behind the running one; more are answered 429.
    pub max_queue: usize,
}

impl ServerConfig {
    /// Defaults for serving `model_id`.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            api_key: None,
            body_limit: DEFAULT_BODY_LIMIT,
            keep_alive: DEFAULT_KEEP_ALIVE,
            default_chat_max_tokens: DEFAULT_CHAT_MAX_TOKENS,
            speculation_depth: 1,
            max_queue: DEFAULT_MAX_QUEUE,
        }
    }
}

/// Shared state of the router: the configuration and the channel to the engine thread.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: ServerConfig,
    jobs: std::sync::mpsc::Sender<Job>,
    queue: Arc<EngineQueue>,
    metrics: Arc<Metrics>,
    grammars: Arc<Grammars>,
    shutting_down: Arc<AtomicBool>,
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    end_of_msg: u32,
    created: u64,
}

impl AppState {
    /// Logs what is served and starts the engine thread. Fails if the model has no tokenizer with K3's chat
    /// markup.
    pub fn start(engine: Engine, config: ServerConfig) -> Result<Self, ServerError> {
        let model_error = |msg: String| ServerError::Model {
            model: config.model_id.clone(),
            msg,
        };
        let tokenizer = Arc::clone(
            engine
                .require_tokenizer()
                .map_err(|e| model_error(e.to_string()))?,
        );
        let end_of_msg = tokenizer
            .require_special(END_OF_MSG)
            .map_err(|e| model_error(format!("the tokenizer lacks K3's chat markup: {e}")))?;
        log_startup(&engine, &config);
        let vocab_size = engine.config().vocab_size;
        let grammars = Arc::new(
            Grammars::new(&tokenizer, vocab_size, end_of_msg).map_err(|e| {
                model_error(format!("cannot index the vocabulary for grammars: {e}"))
            })?,
        );
        let (jobs, job_rx) = std::sync::mpsc::channel();
        let shutting_down = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(Metrics::default());
        let thread_tokenizer = Arc::clone(&tokenizer);
        let thread_shutdown = Arc::clone(&shutting_down);
        let thread_metrics = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("deltafin-engine".to_owned())
            .spawn(move || {
                worker::engine_loop(
                    engine,
                    thread_tokenizer,
                    job_rx,
                    thread_shutdown,
                    thread_metrics,
                )
            })
            .map_err(ServerError::Thread)?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            inner: Arc::new(Inner {
                queue: EngineQueue::new(config.max_queue),
                config,
                jobs,
                metrics,
                grammars,
                shutting_down,
                tokenizer,
                vocab_size,
                end_of_msg,
                created,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    /// Whether a generation is running.
    pub fn is_busy(&self) -> bool {
        self.inner.queue.is_running()
    }

    /// Requests waiting for the engine.
    pub fn waiting(&self) -> usize {
        self.inner.queue.waiting()
    }

    /// Stops the running generation (within one token) and makes new requests fail with 503.
    pub fn begin_shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::Relaxed);
    }

    fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::Relaxed)
    }

    /// Joins the engine's queue: run now, or wait with a ticket; 429 when the queue is full, 503 at shutdown.
    fn join_queue(&self) -> Result<Place, ApiError> {
        if self.is_shutting_down() {
            return Err(ApiError::Unavailable(
                "the server is shutting down".to_owned(),
            ));
        }
        self.inner.queue.join().ok_or_else(|| {
            self.inner.metrics.rejected();
            ApiError::Busy
        })
    }
}

/// The router: every endpoint, the API key check, the body limit and OpenAI-style errors for everything else.
pub fn app(state: AppState) -> Router {
    routes::router(state)
}

/// Serves `app(state)` on `listener` until `shutdown` completes, then stops the running generation and lets
/// open requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = listener
        .local_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    tracing::info!(
        "listening on http://{addr}/v1 (model `{}`)",
        state.config().model_id
    );
    let on_shutdown = state.clone();
    axum::serve(listener, app(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: stopping the running generation");
            on_shutdown.begin_shutdown();
        })
        .await
        .map_err(|source| ServerError::Io { addr, source })
}

/// Completes on Ctrl-C or (on Unix) SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// States model, spine, expert inputs, device and memory budget, and warns about missing experts.
fn log_startup(engine: &Engine, config: &ServerConfig) {
    let spine = if engine.spine_is_int8() {
        "int8 (row-wise copy)"
    } else {
        "bf16"
    };
    let device = engine.device_name();
    tracing::info!(
        "model `{}` from {} ({} layers, vocab {}); spine {spine}; expert inputs {}; device {device}; memory \
         budget {}",
        config.model_id,
        engine.dir().display(),
        engine.config().n_layers,
        engine.config().vocab_size,
        engine.expert_input(),
        memory_budget(engine),
    );
    if let Some(missing) = engine.missing_experts() {
        tracing::warn!(
            "{} experts ({:.1} GB) are not installed yet (streaming install): tokens that need them are fetched \
             from the network and are much slower; `deltafin setup fetch-experts-all` fills the install",
            missing.experts,
            missing.bytes as f64 / 1e9
        );
    }
    if config.api_key.is_none() {
        tracing::info!("no API key: every client that reaches the socket may use the model");
    }
}

/// The engine's memory budget, for the start-up line.
fn memory_budget(engine: &Engine) -> String {
    format!(
        "{:.1} GiB",
        engine.memory_budget() as f64 / (1u64 << 30) as f64
    )
}
