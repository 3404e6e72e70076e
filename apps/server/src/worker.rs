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
//! tokens. The thread also keeps a snapshot taken inside the previous prompt (at its last whole prefill chunk,
//! which costs no extra pass): a chat whose history re-renders differently from what was generated still reuses
//! the previous prompt.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use deltafin_model::tokenizer::Tokenizer;
use deltafin_runtime::{Engine, FinishReason, GenerateOptions, Session, Snapshot};
use tokio::sync::mpsc::UnboundedSender;

use crate::output::{Delta, OutputAssembler, OutputKind};

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

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (the end-of-turn token included).
    pub completion_tokens: usize,
    /// Prompt tokens that were not fed again thanks to prefix reuse.
    pub cached_tokens: usize,
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The one-generation-at-a-time slot. Whoever holds a [`BusyPermit`] owns the engine.
#[derive(Debug, Default)]
pub struct BusySlot(AtomicBool);

impl BusySlot {
    /// Takes the slot, or `None` when a generation holds it.
    pub fn try_acquire(self: &Arc<Self>) -> Option<BusyPermit> {
        self.0
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| BusyPermit(Arc::clone(self)))
    }

    /// Whether a generation holds the slot.
    pub fn is_busy(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Holding the engine; released on drop.
#[derive(Debug)]
pub struct BusyPermit(Arc<BusySlot>);

impl Drop for BusyPermit {
    fn drop(&mut self) {
        self.0.0.store(false, Ordering::Release);
    }
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
    /// The slot, released before the final event is sent.
    pub permit: Option<BusyPermit>,
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
) {
    let mut worker = Worker {
        engine: &engine,
        session: engine.session(),
        checkpoint: None,
        tokenizer,
        shutting_down,
    };
    while let Ok(mut job) = jobs.recv() {
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| worker.run(&job)));
        let event = match result {
            Ok(Ok(outcome)) => Event::Done(outcome),
            Ok(Err(detail)) => {
                worker.forget();
                Event::Failed(detail)
            }
            Err(panic) => {
                worker.session = engine.session();
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

struct Worker<'e> {
    engine: &'e Engine,
    session: Session<'e>,
    /// The session inside the previous prompt (see the module docs).
    checkpoint: Option<Snapshot>,
    tokenizer: Arc<Tokenizer>,
    shutting_down: Arc<AtomicBool>,
}

impl Worker<'_> {
    /// Forgets all state after a failure, so the next request starts clean.
    fn forget(&mut self) {
        self.session.reset();
        self.checkpoint = None;
    }

    fn run(&mut self, job: &Job) -> Result<Outcome, String> {
        let started = std::time::Instant::now();
        let prompt = &job.prompt[..];
        let input = self.reuse(prompt)?;
        let cached = prompt.len() - input.len();
        let shutting_down = Arc::clone(&self.shutting_down);
        let cancelled =
            || job.cancel.load(Ordering::Relaxed) || shutting_down.load(Ordering::Relaxed);
        let Some(input) = self.prefill_whole_chunks(input, &cancelled)? else {
            tracing::info!(
                "request cancelled during prefill: prompt {} tokens ({cached} reused), {:.1} s",
                prompt.len(),
                started.elapsed().as_secs_f64()
            );
            return Ok(Outcome {
                finish: Finish::Cancelled,
                usage: Usage {
                    prompt_tokens: prompt.len(),
                    completion_tokens: 0,
                    cached_tokens: cached,
                },
            });
        };

        let mut out = OutputAssembler::new(
            Arc::clone(&self.tokenizer),
            job.output,
            Arc::clone(&job.stops),
        )
        .map_err(|e| format!("output parser: {e}"))?;
        let generation = self
            .session
            .generate(input, &job.options, |id| {
                let delta = out.push(id);
                job.events.send(Event::Delta(delta)).is_ok() && !out.stopped() && !cancelled()
            })
            .map_err(|e| format!("generation: {e}"))?;
        let tail = out.finish();
        if tail.has_output() {
            // A client that has gone cannot be told.
            let _ = job.events.send(Event::Delta(tail));
        }
        let finish = Finish::of(generation.finish, out.stopped(), out.n_tool_calls());
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

    /// Feeds the whole prefill chunks of `input` one chunk at a time (leaving at least one token, so generation
    /// makes the same passes as feeding everything at once), records the checkpoint, and returns the rest; `None`
    /// when `cancelled` said so between two chunks (the checkpoint then covers what was fed, for a retry).
    fn prefill_whole_chunks<'p>(
        &mut self,
        input: &'p [u32],
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Option<&'p [u32]>, String> {
        let chunk = self.engine.options().prefill_chunk.max(1);
        // Pending tokens are fed first, so chunk boundaries count from them.
        let pending = self.session.snapshot().pending;
        let total = pending + input.len();
        let whole = total.saturating_sub(1) / chunk * chunk;
        let head = whole
            .saturating_sub(pending)
            .min(input.len().saturating_sub(1));
        let mut start = 0;
        while start < head {
            if cancelled() {
                self.checkpoint = Some(self.session.snapshot());
                return Ok(None);
            }
            let next_boundary = ((pending + start) / chunk + 1) * chunk;
            let end = (next_boundary - pending).min(head);
            self.session
                .prefill_last(&input[start..end])
                .map_err(|e| format!("prefill: {e}"))?;
            start = end;
        }
        self.checkpoint = Some(self.session.snapshot());
        Ok(Some(&input[head..]))
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

    #[test]
    fn the_slot_is_exclusive_and_released_on_drop() {
        let slot = Arc::new(BusySlot::default());
        let permit = slot.try_acquire().expect("free");
        assert!(slot.is_busy());
        assert!(slot.try_acquire().is_none());
        drop(permit);
        assert!(!slot.is_busy());
        assert!(slot.try_acquire().is_some());
    }
}
