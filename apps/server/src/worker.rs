//! The engine thread: owns the [`Engine`] and one long-lived [`Session`], runs one generation at a time and sends
//! each token's [`Delta`] back over a channel.
//!
//! The engine is not async, and a token can take seconds, so generation never runs on the async runtime. The
//! thread takes [`Job`]s from a std channel; the HTTP side holds the receiving end of the job's event channel.
//! When that side goes away (client disconnected) the next token's send fails, or the cancel flag is set, and the
//! token callback returns `false`: generation stops within one token.
//!
//! Prefix reuse: the session keeps its tokens between requests, so a request whose prompt strictly extends them
//! (the next turn of the same chat, when the previous answer re-renders to the same ids) only feeds the new
//! tokens. The thread also keeps a snapshot taken at the end of the previous prompt (before its answer, which
//! costs no extra pass): a chat whose history re-renders differently from what was generated still reuses the
//! previous prompt.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use deltafin_runtime::{Engine, FinishReason, GenerateOptions, Session, Snapshot, TokenMask};
use deltafin_text::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::constraint::GrammarMask;
use crate::logprobs::token_logprob;
use crate::metrics::{EngineCounters, GenerationCounts, Metrics};
use crate::output::{Delta, OutputAssembler, OutputKind};
use crate::queue::EnginePermit;

/// Why an answer ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The turn ended, or a stop string was found.
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The turn ended with tool calls.
    ToolCalls,
    /// Generation was cancelled (client gone, server shutting down).
    Cancelled,
}

impl Finish {
    /// OpenAI's `finish_reason` (a cancelled answer reaches no client, except at shutdown: `stop`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop | Self::Cancelled => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
        }
    }

    /// The finish of a generation that ended with `engine`, given whether a stop string ended it and how many
    /// tool calls it made.
    pub fn of(engine: FinishReason, stop_string: bool, n_tool_calls: usize) -> Self {
        match engine {
            _ if stop_string => Self::Stop,
            FinishReason::Length => Self::Length,
            FinishReason::Cancelled => Self::Cancelled,
            FinishReason::Stop if n_tool_calls > 0 => Self::ToolCalls,
            FinishReason::Stop => Self::Stop,
        }
    }
}

/// Token counts of one request, and what its prompt cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (the end-of-turn token included).
    pub completion_tokens: usize,
    /// Prompt tokens that were not fed again thanks to prefix reuse.
    pub cached_tokens: usize,
    /// Seconds from the request's turn to its first token (the prefill).
    pub prefill_seconds: f64,
    /// Bytes read from storage until the first token (expert spans and streamed spine layers).
    pub prefill_read_bytes: u64,
}

/// How often a long prefill is logged.
const PROGRESS_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// A progress callback that logs a long prefill every [`PROGRESS_LOG_EVERY`].
fn progress_log<'e>() -> deltafin_runtime::ProgressFn<'e> {
    let last = std::cell::Cell::new(std::time::Duration::ZERO);
    Box::new(move |p: &deltafin_runtime::PrefillProgress| {
        if p.elapsed >= last.get() + PROGRESS_LOG_EVERY {
            last.set(p.elapsed);
            tracing::info!(
                "prefill: {}/{} tokens, layer {}/{} of a {}-token pass, {:.0}% after {:.1} s",
                p.tokens_done,
                p.tokens_total,
                p.layers_done,
                p.layers,
                p.pass_tokens,
                100.0 * p.fraction(),
                p.elapsed.as_secs_f64()
            );
        }
    })
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Why.
    pub finish: Finish,
    /// Token counts.
    pub usage: Usage,
}

/// What the engine thread sends back for a job.
#[derive(Debug)]
pub enum Event {
    /// One token's worth of answer (maybe no visible text).
    Delta(Delta),
    /// The end; the engine is idle again when this arrives.
    Done(Outcome),
    /// The generation failed; the detail is for the log.
    Failed(String),
}

/// One generation request.
pub struct Job {
    /// The whole prompt.
    pub prompt: Vec<u32>,
    /// Length, sampling, stop tokens, speculation.
    pub options: GenerateOptions,
    /// How ids become text.
    pub output: OutputKind,
    /// Stop strings.
    pub stops: Arc<[String]>,
    /// Where deltas go.
    pub events: UnboundedSender<Event>,
    /// Set when the client is gone.
    pub cancel: Arc<AtomicBool>,
    /// The engine, released before the final event is sent.
    pub permit: Option<EnginePermit>,
    /// The grammar every token must follow (constrained decoding), if any.
    pub mask: Option<GrammarMask>,
    /// `Some(n)`: report each token's log-probability and the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
}

/// Sets a flag when dropped: held by whatever delivers a job's events to the client, so that dropping it (client
/// gone) cancels the generation.
#[derive(Debug)]
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs jobs until every sender is gone.
pub fn engine_loop(
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    jobs: std::sync::mpsc::Receiver<Job>,
    shutting_down: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
) {
    let mut session = engine.session();
    session.set_progress(Some(progress_log()));
    let mut worker = Worker {
        engine: &engine,
        session,
        checkpoint: None,
        tokenizer,
        shutting_down,
        metrics: Arc::clone(&metrics),
        spec_base: (0, 0),
    };
    worker.publish_engine_counters();
    while let Ok(mut job) = jobs.recv() {
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| worker.run(&mut job)));
        worker.publish_engine_counters();
        let event = match result {
            Ok(Ok(outcome)) => Event::Done(outcome),
            Ok(Err(detail)) => {
                metrics.failed();
                worker.forget();
                Event::Failed(detail)
            }
            Err(panic) => {
                metrics.failed();
                let lost = worker.session.stats();
                worker.spec_base.0 += lost.drafted;
                worker.spec_base.1 += lost.accepted;
                worker.session = engine.session();
                worker.session.set_progress(Some(progress_log()));
                worker.forget();
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                Event::Failed(format!("the engine panicked: {what}"))
            }
        };
        // Idle before the client hears the end, so that its next request is not refused as busy.
        drop(job.permit.take());
        // A client that has gone cannot be told.
        let _ = job.events.send(event);
    }
    tracing::debug!("engine thread: no more jobs");
}

/// The engine's expert cache and read counters.
fn read_counters(engine: &Engine) -> EngineCounters {
    let experts = engine.expert_stats();
    EngineCounters {
        expert_cache_hits: experts.cache.hits,
        expert_cache_misses: experts.cache.misses,
        expert_bytes_read: experts.reader.disk.bytes,
        spine_bytes_read: engine.spine_reads().bytes,
        ..EngineCounters::default()
    }
}

struct Worker<'e> {
    engine: &'e Engine,
    session: Session<'e>,
    /// The session at the end of the previous prompt (see the module docs).
    checkpoint: Option<Snapshot>,
    tokenizer: Arc<Tokenizer>,
    shutting_down: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    /// Speculation counts of sessions replaced after a panic (drafted, accepted), so the exported totals never
    /// go back.
    spec_base: (u64, u64),
}

impl Worker<'_> {
    /// Copies the engine's cumulative counters into the metrics.
    fn publish_engine_counters(&self) {
        let session = self.session.stats();
        self.metrics.set_engine(&EngineCounters {
            spec_drafted: self.spec_base.0 + session.drafted,
            spec_accepted: self.spec_base.1 + session.accepted,
            ..read_counters(self.engine)
        });
    }

    /// Forgets all state after a failure, so the next request starts clean.
    fn forget(&mut self) {
        self.session.reset();
        self.checkpoint = None;
    }

    fn run(&mut self, job: &mut Job) -> Result<Outcome, String> {
        let started = std::time::Instant::now();
        let prompt = &job.prompt[..];
        let read0 = self.engine.read_bytes();
        let input = self.reuse(prompt)?;
        let cached = prompt.len() - input.len();
        let shutting_down = Arc::clone(&self.shutting_down);
        let cancel = Arc::clone(&job.cancel);
        let cancelled = || cancel.load(Ordering::Relaxed) || shutting_down.load(Ordering::Relaxed);
        let mut counts = GenerationCounts {
            prompt_tokens: prompt.len() as u64,
            cached_tokens: cached as u64,
            constrained: job.mask.is_some(),
            ..GenerationCounts::default()
        };
        let Some(row) = self.prefill_prompt(input, &cancelled)? else {
            tracing::info!(
                "request cancelled during prefill: prompt {} tokens ({cached} reused), {:.1} s",
                prompt.len(),
                started.elapsed().as_secs_f64()
            );
            counts.prefill_secs = started.elapsed().as_secs_f64();
            counts.cancelled = true;
            self.metrics.generation(&counts);
            return Ok(Outcome {
                finish: Finish::Cancelled,
                usage: Usage {
                    prompt_tokens: prompt.len(),
                    completion_tokens: 0,
                    cached_tokens: cached,
                    prefill_seconds: counts.prefill_secs,
                    prefill_read_bytes: self.engine.read_bytes() - read0,
                },
            });
        };

        let mut out = OutputAssembler::new(
            Arc::clone(&self.tokenizer),
            job.output,
            Arc::clone(&job.stops),
        )
        .map_err(|e| format!("output parser: {e}"))?;
        let mut first_token = None;
        let mut first_read = None;
        let top_logprobs = job.top_logprobs;
        let events = &job.events;
        let metrics = Arc::clone(&self.metrics);
        let engine = self.engine;
        let mask = job.mask.as_mut().map(|m| m as &mut dyn TokenMask);
        let generation = self
            .session
            .generate_from(row, &job.options, mask, |id, row| {
                first_token.get_or_insert_with(std::time::Instant::now);
                first_read.get_or_insert_with(|| engine.read_bytes());
                let mut delta = out.push(id);
                if let Some(top) = top_logprobs {
                    delta.logprobs.push(token_logprob(row, id, top));
                }
                metrics.set_reads(&read_counters(engine));
                events.send(Event::Delta(delta)).is_ok() && !out.stopped() && !cancelled()
            })
            .map_err(|e| format!("generation: {e}"))?;
        let tail = out.finish();
        if tail.has_output() {
            // A client that has gone cannot be told.
            let _ = job.events.send(Event::Delta(tail));
        }
        let finish = Finish::of(generation.finish, out.stopped(), out.n_tool_calls());
        let ended = std::time::Instant::now();
        let first = first_token.unwrap_or(ended);
        counts.prefill_secs = first.duration_since(started).as_secs_f64();
        counts.decode_secs = ended.duration_since(first).as_secs_f64();
        counts.generated_tokens = generation.tokens.len() as u64;
        counts.cancelled = finish == Finish::Cancelled;
        let mask_cost = job.mask.as_ref().map(GrammarMask::cost);
        if let Some((spent, masks)) = mask_cost {
            counts.mask_secs = spent.as_secs_f64();
            tracing::debug!(
                "grammar: {masks} masks, {:.3} ms per token",
                spent.as_secs_f64() * 1e3 / masks.max(1) as f64
            );
        }
        self.metrics.generation(&counts);
        tracing::info!(
            "generated {} tokens ({finish:?}) after a prompt of {} ({cached} reused) in {:.1} s",
            generation.tokens.len(),
            prompt.len(),
            started.elapsed().as_secs_f64(),
        );
        Ok(Outcome {
            finish,
            usage: Usage {
                prompt_tokens: prompt.len(),
                completion_tokens: generation.tokens.len(),
                cached_tokens: cached,
                prefill_seconds: counts.prefill_secs,
                prefill_read_bytes: first_read.unwrap_or_else(|| self.engine.read_bytes()) - read0,
            },
        })
    }

    /// Positions the session for `prompt` and returns what is left to feed: the suffix after the session's own
    /// tokens, else after the checkpoint, else everything (after a reset).
    fn reuse<'p>(&mut self, prompt: &'p [u32]) -> Result<&'p [u32], String> {
        let extends = |done: &[u32]| prompt.len() > done.len() && prompt.starts_with(done);
        if !extends(self.session.tokens())
            && let Some(snap) = self.checkpoint.as_ref().filter(|s| extends(&s.tokens))
        {
            self.session
                .restore(snap)
                .map_err(|e| format!("restoring the prompt checkpoint: {e}"))?;
        }
        Ok(self.session.reuse_prefix(prompt))
    }

    /// Feeds all of `input` in pieces that end on the engine's pass boundaries (so the passes are those of feeding
    /// it at once, and the row the same), checking `cancelled` between pieces, and records the checkpoint at the end
    /// of the prompt. Returns the logits row after the prompt; `None` when `cancelled` said so between two pieces
    /// (the checkpoint then covers what was fed, for a retry).
    fn prefill_prompt(
        &mut self,
        input: &[u32],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<f32>>, String> {
        if input.is_empty() {
            return Err("an empty prompt".to_owned());
        }
        let chunk = self.engine.prefill_chunk().max(1);
        // Pending tokens are fed first, so pass boundaries count from them.
        let pending = self.session.pending();
        let mut start = 0;
        let row = loop {
            if cancelled() {
                self.checkpoint = Some(self.session.snapshot());
                return Ok(None);
            }
            let next_boundary = ((pending + start) / chunk + 1) * chunk;
            let end = (next_boundary - pending).min(input.len());
            let row = self
                .session
                .prefill_last(&input[start..end])
                .map_err(|e| format!("prefill: {e}"))?;
            start = end;
            if start == input.len() {
                break row;
            }
        };
        self.checkpoint = Some(self.session.snapshot());
        Ok(Some(row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons() {
        assert_eq!(Finish::of(FinishReason::Stop, false, 0), Finish::Stop);
        assert_eq!(Finish::of(FinishReason::Stop, false, 2), Finish::ToolCalls);
        assert_eq!(Finish::of(FinishReason::Length, false, 1), Finish::Length);
        assert_eq!(Finish::of(FinishReason::Cancelled, true, 0), Finish::Stop);
        assert_eq!(
            Finish::of(FinishReason::Cancelled, false, 0).as_str(),
            "stop"
        );
        assert_eq!(Finish::ToolCalls.as_str(), "tool_calls");
    }
}
