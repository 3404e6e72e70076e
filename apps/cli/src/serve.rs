//! `deltafin serve`: the OpenAI-compatible HTTP server (see `docs/SERVER.md`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use deltafin_runtime::DevicePref;
use deltafin_server::{AppState, ServerConfig};

use crate::engine_args::EngineArgs;

/// Arguments of `deltafin serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model directory (default: the installed model under DELTAFIN_ROOT, else the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to bind (default: loopback only; use 0.0.0.0 to accept other machines, with --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long, env = "DELTAFIN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model id clients send in `model` (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest accepted request body, in MiB.
    #[arg(long, default_value_t = deltafin_server::DEFAULT_BODY_LIMIT >> 20)]
    max_body_mib: usize,
    /// Seconds between SSE keep-alive comments while a token is computed.
    #[arg(long, default_value_t = deltafin_server::DEFAULT_KEEP_ALIVE.as_secs())]
    keep_alive_secs: u64,
    /// `max_tokens` of a chat completion that gives none.
    #[arg(long, default_value_t = deltafin_server::DEFAULT_CHAT_MAX_TOKENS)]
    default_max_tokens: usize,
    /// Requests that may wait behind the running generation (first in, first out); more are answered 429.
    #[arg(long, default_value_t = deltafin_server::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// n-gram speculation for greedy requests (lossless).
    #[arg(long, env = "K3_SPEC", default_value = "on", value_parser = crate::engine_args::parse_on_off)]
    spec: bool,
    /// Draft tokens verified per pass.
    #[arg(long, env = "K3_SPEC_DEPTH", default_value_t = 1)]
    spec_depth: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Runs `deltafin serve` until Ctrl-C or SIGTERM.
pub fn run(args: ServeArgs, dev: Option<DevicePref>) -> anyhow::Result<()> {
    let (model_dir, engine) = args.engine.open(args.model.as_deref(), dev)?;
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        model_dir
            .canonicalize()
            .unwrap_or_else(|_| model_dir.clone())
            .file_name()
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
    });
    let config = ServerConfig {
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        body_limit: args.max_body_mib.max(1) << 20,
        keep_alive: std::time::Duration::from_secs(args.keep_alive_secs.max(1)),
        default_chat_max_tokens: args.default_max_tokens.max(1),
        speculation_depth: if args.spec { args.spec_depth } else { 0 },
        max_queue: args.max_queue,
        ..ServerConfig::new(model_id)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let state = AppState::start(engine, config)?;
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        deltafin_server::serve(listener, state, deltafin_server::shutdown_signal()).await?;
        anyhow::Ok(())
    })
}
