//! [`Session`]: one conversation's state over an [`Engine`], with prefill, single steps and greedy generation.

use deltafin_model::{LogitRows, SessionState};

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};

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

/// The id of the largest logit (the lowest id on exact ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Options for [`Session::generate_greedy`].
#[derive(Clone, Copy, Debug)]
pub struct GreedyOptions {
    /// Tokens to generate at most.
    pub max_new: usize,
    /// Keep going past the end-of-turn token.
    pub ignore_eos: bool,
}

/// One conversation.
pub struct Session<'e> {
    engine: &'e Engine,
    state: SessionState,
}

impl<'e> Session<'e> {
    pub(crate) fn new(engine: &'e Engine) -> Self {
        Self {
            state: engine.model().new_state(),
            engine,
        }
    }

    /// Tokens consumed so far.
    pub fn n_tokens(&self) -> usize {
        self.state.n_tokens
    }

    /// Feeds `ids` in one pass and returns one row of logits per id.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Logits> {
        self.run(ids, LogitRows::All)
    }

    /// Feeds one token and returns the logits for the next.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        Ok(self.run(&[id], LogitRows::Last)?.data)
    }

    fn run(&mut self, ids: &[u32], rows: LogitRows) -> Result<Logits> {
        if ids.is_empty() {
            return Err(RuntimeError::Usage("no tokens to feed".to_string()));
        }
        let model = self.engine.model();
        let t = model.forward(ids, &mut self.state, self.engine.experts(), rows)?;
        let data = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(deltafin_model::ModelError::from)?;
        Ok(Logits {
            vocab: model.config().vocab_size,
            data,
        })
    }

    /// Greedy generation after `prompt`: prefill, then one step per token. Calls `on_token` with each new id;
    /// returning `false` stops early. Returns the new ids.
    pub fn generate_greedy(
        &mut self,
        prompt: &[u32],
        opts: GreedyOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if opts.max_new == 0 {
            return Ok(out);
        }
        let eos = self.engine.config().eos_token_id;
        let logits = self.run(prompt, LogitRows::Last)?;
        let mut next = argmax(&logits.data);
        loop {
            out.push(next);
            let keep_going = on_token(next);
            if !keep_going || out.len() >= opts.max_new || (!opts.ignore_eos && Some(next) == eos) {
                return Ok(out);
            }
            next = argmax(&self.step(next)?);
        }
    }
}
