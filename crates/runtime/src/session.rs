//! [`Session`]: one conversation over an [`Engine`]: chunked prefill, single steps, generation with sampling and
//! lossless n-gram speculation, snapshots and prefix reuse.
//!
//! The session keeps a *committed* state (every token in it has been fed) and a few *pending* tokens that are
//! known but not yet fed. A speculative pass feeds `pending ++ drafts` on a copy of the committed state; if every
//! draft is accepted the copy becomes the committed state, otherwise the committed state is kept untouched (the
//! old immutable objects, no copying back) and the accepted tokens join the pending ones, fed by the next pass.
//! Rows of a pass do not depend on how many tokens share it (fixed-order kernels), so this is bit-exact.

use std::time::Instant;

use deltafin_model::{LogitRows, SessionState};

use crate::constraint::{TokenMask, masked_row};
use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::ngram;
use crate::sampling::{Sampler, SamplingParams, argmax};

/// Logits for several positions, row-major `[rows, vocab]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    /// Vocabulary size (row length).
    pub vocab: usize,
    /// Values.
    pub data: Vec<f32>,
}

impl Logits {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.data.len() / self.vocab.max(1)
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Options for [`Session::generate_greedy`] (the plain greedy form used by tools).
#[derive(Clone, Copy, Debug)]
pub struct GreedyOptions {
    /// Tokens to generate at most.
    pub max_new: usize,
    /// Keep going past the end-of-turn token.
    pub ignore_eos: bool,
}

/// Options for [`Session::generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new: usize,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// Keep going past the end-of-turn token.
    pub ignore_eos: bool,
    /// Extra token ids that end generation (after being emitted).
    pub stop_tokens: Vec<u32>,
    /// Draft depth of n-gram speculation (0 = off). Used only for greedy sampling.
    pub speculation_depth: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new: 16,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop_tokens: Vec::new(),
            speculation_depth: 0,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The end-of-turn token (or a stop token) was produced.
    Stop,
    /// `max_new` tokens were produced.
    Length,
    /// The token callback asked to stop (client gone, Ctrl-C, stop string).
    Cancelled,
}

/// The result of [`Session::generate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// New tokens, in order (the stop token included when there was one).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
}

/// Counters of one session (printed by `--stats`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionStats {
    /// Forward passes run.
    pub passes: u64,
    /// Tokens fed through the model (re-fed pending tokens count again).
    pub tokens_fed: u64,
    /// Tokens produced by generation.
    pub generated: u64,
    /// Draft tokens proposed by speculation.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Decode passes (one per generated token without speculation).
    pub decode_passes: u64,
    /// Tokens skipped thanks to prefix reuse.
    pub reused_tokens: u64,
    /// Tokens fed by prefills: feeds of more than one token (a prompt, or its tail after a reused prefix).
    pub prefill_tokens: u64,
    /// Time those feeds took.
    pub prefill_seconds: f64,
    /// Bytes those feeds read from storage: expert spans from the device and streamed spine layers.
    pub prefill_read_bytes: u64,
}

/// Where a prefill stands, as reported to [`Session::set_progress`] after every decoder layer of every pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillProgress {
    /// Tokens of this feed already through every layer.
    pub tokens_done: usize,
    /// Tokens in the pass under way.
    pub pass_tokens: usize,
    /// Tokens of the whole feed.
    pub tokens_total: usize,
    /// Decoder layers the pass under way has finished.
    pub layers_done: usize,
    /// Decoder layers of the model.
    pub layers: usize,
    /// Time since the feed began.
    pub elapsed: std::time::Duration,
}

impl PrefillProgress {
    /// Share of the feed's work done (layers × tokens), from 0 to 1.
    pub fn fraction(&self) -> f64 {
        let total = (self.tokens_total * self.layers).max(1) as f64;
        ((self.tokens_done * self.layers + self.layers_done * self.pass_tokens) as f64 / total)
            .min(1.0)
    }
}

/// A progress report callback ([`Session::set_progress`]).
pub type ProgressFn<'e> = Box<dyn Fn(&PrefillProgress) + 'e>;

/// A copy of a session's position that can be restored later (cheap: states are shared, not copied).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Every token consumed (committed and pending).
    pub tokens: Vec<u32>,
    /// How many of the last `tokens` are not yet in `state`.
    pub pending: usize,
    /// The committed state.
    pub state: SessionState,
}

/// One conversation.
pub struct Session<'e> {
    engine: &'e Engine,
    committed: SessionState,
    tokens: Vec<u32>,
    pending: usize,
    stats: SessionStats,
    /// Longest pass this session runs (at most the engine's; see [`Session::limit_prefill_chunk`]).
    chunk_limit: usize,
    progress: Option<ProgressFn<'e>>,
}

impl<'e> Session<'e> {
    pub(crate) fn new(engine: &'e Engine) -> Self {
        Self {
            committed: engine.model().new_state(),
            engine,
            tokens: Vec::new(),
            pending: 0,
            stats: SessionStats::default(),
            chunk_limit: usize::MAX,
            progress: None,
        }
    }

    /// Caps this session's passes at `n` tokens (at least 1). The engine's pass length is the longest its memory
    /// budget has room for, so a session can ask for shorter passes (benchmarks compare them), never longer.
    pub fn limit_prefill_chunk(&mut self, n: usize) {
        self.chunk_limit = n.max(1);
    }

    /// Calls `f` after every decoder layer of every pass of a feed of more than one token (a prompt), with where
    /// the feed stands; `None` stops the reports.
    pub fn set_progress(&mut self, f: Option<ProgressFn<'e>>) {
        self.progress = f;
    }

    /// Every token the session has consumed, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens consumed so far.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Consumed tokens not yet fed through the model (the last generated token, and speculated tokens kept after a
    /// pass that fed later drafts); the next feed feeds them first.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// The session's counters.
    pub fn stats(&self) -> &SessionStats {
        &self.stats
    }

    /// Forgets everything (a fresh state).
    pub fn reset(&mut self) {
        self.committed = self.engine.model().new_state();
        self.tokens.clear();
        self.pending = 0;
    }

    /// Feeds `ids` (chunked) and returns one row of logits per id.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Logits> {
        self.feed(ids, true)
    }

    /// Feeds `ids` (chunked) and returns the logits after the last one.
    pub fn prefill_last(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        Ok(self.feed(ids, false)?.data)
    }

    /// Feeds one token and returns the logits for the next.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        self.prefill_last(&[id])
    }

    /// Feeds pending tokens so that the committed state covers every consumed token.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending > 0 {
            self.feed(&[], false)?;
        }
        Ok(())
    }

    /// The committed state (after [`Self::flush`], the state after every consumed token).
    pub fn state(&self) -> &SessionState {
        &self.committed
    }

    /// A snapshot of the current position.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            tokens: self.tokens.clone(),
            pending: self.pending,
            state: self.committed.clone(),
        }
    }

    /// Returns to a snapshot taken from a session of the same engine.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        if snap.state.layers.len() != self.committed.layers.len()
            || snap.pending > snap.tokens.len()
        {
            return Err(RuntimeError::Usage(
                "snapshot does not belong to this model".to_string(),
            ));
        }
        self.tokens = snap.tokens.clone();
        self.pending = snap.pending;
        self.committed = snap.state.clone();
        Ok(())
    }

    /// Saves the current position to `path` (atomic, checksummed).
    pub fn save_snapshot(&self, path: &std::path::Path) -> Result<()> {
        crate::snapshot_file::save(path, &self.snapshot(), self.engine.fingerprint())
    }

    /// Restores a position saved by [`Self::save_snapshot`] (possibly by another process).
    pub fn load_snapshot(&mut self, path: &std::path::Path) -> Result<()> {
        let snap =
            crate::snapshot_file::load(path, self.engine.config(), self.engine.fingerprint())?;
        self.restore(&snap)
    }

    /// The part of `sequence` this session still has to feed: the suffix after its own tokens when `sequence`
    /// strictly extends them (prefix reuse), else everything after a reset.
    pub fn reuse_prefix<'a>(&mut self, sequence: &'a [u32]) -> &'a [u32] {
        if sequence.len() > self.tokens.len() && sequence.starts_with(&self.tokens) {
            self.stats.reused_tokens += self.tokens.len() as u64;
            &sequence[self.tokens.len()..]
        } else {
            self.reset();
            sequence
        }
    }

    /// Feeds pending tokens plus `ids` in chunks of the engine's prefill chunk, committing each chunk (so each
    /// expert a chunk needs is read once per layer). Returns all rows for `ids` when `all_rows`, else the last row.
    /// On failure, the ids not yet fed are forgotten and the session stays consistent.
    fn feed(&mut self, ids: &[u32], all_rows: bool) -> Result<Logits> {
        let vocab = self.engine.config().vocab_size;
        let n_pending = self.pending;
        if n_pending + ids.len() == 0 {
            return Err(RuntimeError::Usage("no tokens to feed".to_string()));
        }
        self.tokens.extend_from_slice(ids);
        self.pending += ids.len();
        let input: Vec<u32> = self.tokens[self.tokens.len() - self.pending..].to_vec();
        // A pass returning every row's logits holds them all: such passes stay within the budget's logit rows.
        let (chunk, rows) = if all_rows {
            (
                self.engine
                    .prefill_chunk()
                    .min(crate::budget::ALL_LOGITS_CHUNK),
                LogitRows::All,
            )
        } else {
            (self.engine.prefill_chunk(), LogitRows::Last)
        };
        let chunk = chunk.min(self.chunk_limit).max(1);
        let started = Instant::now();
        let is_prefill = input.len() > 1;
        let read0 = self.engine.read_bytes();
        let mut data = Vec::new();
        let mut offset = 0;
        // Taken out while the passes run (they borrow the session mutably), put back below.
        let progress = self.progress.take();
        let layers = self.engine.config().n_layers;
        for piece in input.chunks(chunk) {
            let report = |layers_done: usize| {
                if let (true, Some(f)) = (is_prefill, &progress) {
                    f(&PrefillProgress {
                        tokens_done: offset,
                        pass_tokens: piece.len(),
                        tokens_total: input.len(),
                        layers_done,
                        layers,
                        elapsed: started.elapsed(),
                    });
                }
            };
            let (logits, state) = match self.pass(piece, rows, &|l| report(l + 1)) {
                Ok(x) => x,
                Err(e) => {
                    self.progress = progress;
                    let unfed_new = ids.len().min(self.pending);
                    self.tokens.truncate(self.tokens.len() - unfed_new);
                    self.pending -= unfed_new;
                    return Err(e);
                }
            };
            self.committed = state;
            self.pending -= piece.len();
            if all_rows {
                // Rows of tokens that were already pending before this call are not returned.
                let skip = n_pending.saturating_sub(offset).min(piece.len());
                data.extend_from_slice(&logits[skip * vocab..]);
            } else {
                data = logits;
            }
            offset += piece.len();
        }
        self.progress = progress;
        if is_prefill {
            self.stats.prefill_tokens += input.len() as u64;
            self.stats.prefill_seconds += started.elapsed().as_secs_f64();
            self.stats.prefill_read_bytes += self.engine.read_bytes().saturating_sub(read0);
        }
        Ok(Logits { vocab, data })
    }

    /// One forward pass of `input` on a copy of the committed state; returns the rows and the new state.
    fn pass(
        &mut self,
        input: &[u32],
        rows: LogitRows,
        layer_done: &dyn Fn(usize),
    ) -> Result<(Vec<f32>, SessionState)> {
        let context = self.engine.options().context;
        if self.committed.n_tokens + input.len() > context {
            return Err(RuntimeError::Budget(format!(
                "the session's context is full: {} tokens are in it, {} more would pass the {context} the memory \
                 budget reserves (K3_CONTEXT or --context)",
                self.committed.n_tokens,
                input.len()
            )));
        }
        let mut st = self.committed.clone();
        let engine = self.engine;
        let t = engine.with_pass_scratch(input.len(), || {
            engine
                .model()
                .forward_observed(input, &mut st, engine.experts(), rows, layer_done)
        })?;
        let data = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(deltafin_model::ModelError::from)?;
        self.stats.passes += 1;
        self.stats.tokens_fed += input.len() as u64;
        Ok((data, st))
    }

    /// Greedy generation after `prompt` without speculation. Calls `on_token` with each new id; returning `false`
    /// stops early. Returns the new ids.
    pub fn generate_greedy(
        &mut self,
        prompt: &[u32],
        opts: GreedyOptions,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        let g = self.generate(
            prompt,
            &GenerateOptions {
                max_new: opts.max_new,
                ignore_eos: opts.ignore_eos,
                ..GenerateOptions::default()
            },
            on_token,
        )?;
        Ok(g.tokens)
    }

    /// Feeds `input` (may be empty when tokens are pending) and generates. `on_token` sees each new id as it is
    /// decided; returning `false` stops generation.
    pub fn generate(
        &mut self,
        input: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation> {
        self.generate_with(input, opts, None, |id, _| on_token(id))
    }

    /// [`Self::generate`] with an optional [`TokenMask`] that restricts every token chosen (speculation is then
    /// off), and a callback that also sees the raw logits row the token was chosen from (before any mask or
    /// temperature: the row `prefill` would give at that position).
    pub fn generate_with(
        &mut self,
        input: &[u32],
        opts: &GenerateOptions,
        mask: Option<&mut dyn TokenMask>,
        on_token: impl FnMut(u32, &[f32]) -> bool,
    ) -> Result<Generation> {
        opts.sampling.validate()?;
        if opts.max_new == 0 {
            return Ok(Generation {
                tokens: Vec::new(),
                finish: FinishReason::Length,
            });
        }
        let row = self.prefill_last(input)?;
        self.generate_from(row, opts, mask, on_token)
    }

    /// [`Self::generate_with`] after the caller fed the prompt itself: `row` is the logits row after the last token
    /// fed (what [`Self::prefill_last`] returned). A caller that feeds the prompt in pieces (to check for
    /// cancellation, or to snapshot the end of the prompt) goes on from here.
    pub fn generate_from(
        &mut self,
        mut row: Vec<f32>,
        opts: &GenerateOptions,
        mut mask: Option<&mut dyn TokenMask>,
        mut on_token: impl FnMut(u32, &[f32]) -> bool,
    ) -> Result<Generation> {
        opts.sampling.validate()?;
        let mut out = Vec::new();
        if opts.max_new == 0 {
            return Ok(Generation {
                tokens: out,
                finish: FinishReason::Length,
            });
        }
        if row.len() != self.engine.config().vocab_size {
            return Err(RuntimeError::Usage(format!(
                "a logits row has {} entries, the vocabulary {}",
                row.len(),
                self.engine.config().vocab_size
            )));
        }
        let eos = self.engine.config().eos_token_id;
        let spec_depth = if opts.sampling.is_greedy() && mask.is_none() {
            opts.speculation_depth
        } else {
            0
        };
        let mut sampler = Sampler::new(opts.sampling);
        let vocab = self.engine.config().vocab_size;
        loop {
            let next = match mask.as_deref_mut() {
                Some(mask) => {
                    let id = sampler.sample(&masked_row(mask, &row)?);
                    mask.accept(id).map_err(RuntimeError::Constraint)?;
                    id
                }
                None => sampler.sample(&row),
            };
            // `emit` records a decided token as pending and reports whether generation must end.
            let mut emit =
                |s: &mut Self, id: u32, row: &[f32], out: &mut Vec<u32>| -> Option<FinishReason> {
                    s.tokens.push(id);
                    s.pending += 1;
                    s.stats.generated += 1;
                    out.push(id);
                    if !on_token(id, row) {
                        Some(FinishReason::Cancelled)
                    } else if (!opts.ignore_eos && Some(id) == eos)
                        || opts.stop_tokens.contains(&id)
                    {
                        Some(FinishReason::Stop)
                    } else if out.len() >= opts.max_new {
                        Some(FinishReason::Length)
                    } else {
                        None
                    }
                };
            if let Some(finish) = emit(self, next, &row, &mut out) {
                return Ok(Generation {
                    tokens: out,
                    finish,
                });
            }
            let budget = opts.max_new - out.len();
            let drafts = if spec_depth > 0 {
                ngram::draft(&self.tokens, spec_depth.min(budget))
            } else {
                Vec::new()
            };
            let mut input: Vec<u32> = self.tokens[self.tokens.len() - self.pending..].to_vec();
            input.extend_from_slice(&drafts);
            let (rows, state) = self.pass(&input, LogitRows::Tail(drafts.len() + 1), &|_| {})?;
            self.stats.decode_passes += 1;
            self.stats.drafted += drafts.len() as u64;
            let mut accepted = 0;
            while accepted < drafts.len() {
                let draft_row = &rows[accepted * vocab..(accepted + 1) * vocab];
                let g = argmax(draft_row);
                if g != drafts[accepted] {
                    break;
                }
                accepted += 1;
                self.stats.accepted += 1;
                if let Some(finish) = emit(self, g, draft_row, &mut out) {
                    // The pass also fed later drafts: keep the committed state, the accepted tokens stay pending.
                    return Ok(Generation {
                        tokens: out,
                        finish,
                    });
                }
            }
            if accepted == drafts.len() {
                self.committed = state;
                self.pending = 0;
            }
            row = rows[accepted * vocab..(accepted + 1) * vocab].to_vec();
        }
    }
}
