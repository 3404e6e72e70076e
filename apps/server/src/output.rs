//! Generated ids to what a client sees: text (completions) or reasoning, answer and tool calls (chat), with stop
//! strings cut out.
//!
//! This runs on the engine thread inside the token callback, so a stop string ends generation at the token that
//! completes it, and the streamed and non-streamed answers come from the very same deltas.

use std::sync::Arc;

use deltafin_text::chat::{ChatEvent, OutputParser, ParsedToolCall, ParserStart};
use deltafin_text::tokenizer::{StreamDecoder, Tokenizer};

use crate::logprobs::TokenLogprob;

/// How generated ids are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// Plain text (`/v1/completions`).
    Text,
    /// K3's XTML assistant turn; `thinking` tells whether it starts in the think element.
    Chat {
        /// The generation prompt opened a think element.
        thinking: bool,
    },
}

/// What one generated token (or the end of generation) adds to the answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// The ids this delta covers.
    pub token_ids: Vec<u32>,
    /// Their log-probabilities, when the request asked for them (one per id).
    pub logprobs: Vec<TokenLogprob>,
    /// More reasoning text.
    pub reasoning: String,
    /// More answer text.
    pub content: String,
    /// Tool calls completed.
    pub tool_calls: Vec<ParsedToolCall>,
}

impl Delta {
    /// Whether it carries anything a client would see (text or calls).
    pub fn has_output(&self) -> bool {
        !self.reasoning.is_empty() || !self.content.is_empty() || !self.tool_calls.is_empty()
    }

    /// Appends `other` to this delta.
    pub fn append(&mut self, other: Delta) {
        self.token_ids.extend(other.token_ids);
        self.logprobs.extend(other.logprobs);
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

/// Finds stop strings in a stream of text pieces, holding back a tail that could still become one.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Arc<[String]>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (none: text passes straight through).
    pub fn new(stops: Arc<[String]>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    /// Adds `text`; returns the text that is now safe to release and whether a stop string was completed (then
    /// the released text ends right before it, and the rest is dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        let keep = self.partial_tail();
        let out = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// Releases whatever is held (the text that follows can no longer complete a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest tail of `held` that is a proper prefix of some stop string.
    fn partial_tail(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = self.held.len().saturating_sub(longest.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= from)
            .map(|i| &self.held[i..])
            .find(|tail| self.stops.iter().any(|s| s.starts_with(tail)))
            .map_or(0, str::len)
    }
}

enum Source {
    Text(StreamDecoder),
    Chat(Box<OutputParser>),
}

/// Turns generated ids into [`Delta`]s.
pub struct OutputAssembler {
    source: Source,
    reasoning: StopMatcher,
    content: StopMatcher,
    stopped: bool,
    n_tool_calls: usize,
}

impl OutputAssembler {
    /// An assembler for `kind`, cutting at `stops`.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        kind: OutputKind,
        stops: Arc<[String]>,
    ) -> Result<Self, deltafin_text::chat::TextError> {
        let source = match kind {
            OutputKind::Text => Source::Text(StreamDecoder::new(tokenizer)),
            OutputKind::Chat { thinking } => Source::Chat(Box::new(OutputParser::new(
                tokenizer,
                ParserStart::for_thinking(thinking),
            )?)),
        };
        Ok(Self {
            source,
            reasoning: StopMatcher::new(Arc::clone(&stops)),
            content: StopMatcher::new(stops),
            stopped: false,
            n_tool_calls: 0,
        })
    }

    /// Whether a stop string was found (generation should end; nothing more is released).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tool calls released so far.
    pub fn n_tool_calls(&self) -> usize {
        self.n_tool_calls
    }

    /// Feeds one generated id.
    pub fn push(&mut self, id: u32) -> Delta {
        let mut delta = Delta {
            token_ids: vec![id],
            ..Delta::default()
        };
        if self.stopped {
            return delta;
        }
        let events = match &mut self.source {
            Source::Text(decoder) => match decoder.push(id) {
                Ok(text) => vec![ChatEvent::Content(text)],
                Err(e) => {
                    tracing::debug!("generated id {id} does not decode: {e}");
                    Vec::new()
                }
            },
            // Markup the parser cannot place (rare for a trained model, common for random weights) loses that
            // token's text; the answer goes on.
            Source::Chat(parser) => parser.push(id).unwrap_or_else(|e| {
                tracing::debug!("generated id {id}: {e}");
                Vec::new()
            }),
        };
        self.apply(events, &mut delta);
        delta
    }

    /// Ends the answer: releases buffered text (unless a stop string already ended it).
    pub fn finish(&mut self) -> Delta {
        let mut delta = Delta::default();
        if self.stopped {
            return delta;
        }
        let events = match &mut self.source {
            Source::Text(decoder) => vec![ChatEvent::Content(decoder.finish())],
            Source::Chat(parser) => parser.finish(),
        };
        self.apply(events, &mut delta);
        if !self.stopped {
            delta.reasoning.push_str(&self.reasoning.flush());
            delta.content.push_str(&self.content.flush());
        }
        delta
    }

    fn apply(&mut self, events: Vec<ChatEvent>, delta: &mut Delta) {
        for event in events {
            let hit = match event {
                ChatEvent::Reasoning(text) => {
                    let (out, hit) = self.reasoning.push(&text);
                    delta.reasoning.push_str(&out);
                    hit
                }
                ChatEvent::Content(text) => {
                    // The reasoning is over: what it held back can no longer start a stop string.
                    delta.reasoning.push_str(&self.reasoning.flush());
                    let (out, hit) = self.content.push(&text);
                    delta.content.push_str(&out);
                    hit
                }
                ChatEvent::ToolCall(call) => {
                    delta.reasoning.push_str(&self.reasoning.flush());
                    delta.content.push_str(&self.content.flush());
                    self.n_tool_calls += 1;
                    delta.tool_calls.push(call);
                    false
                }
                ChatEvent::End => {
                    delta.reasoning.push_str(&self.reasoning.flush());
                    delta.content.push_str(&self.content.flush());
                    false
                }
            };
            if hit {
                self.stopped = true;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, hit) = m.push(p);
            out.push_str(&text);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(
            run(&["END"], &["hello E", "N", "D tail"]),
            ("hello ".into(), true)
        );
        assert_eq!(
            run(&["END"], &["hello EN", "x"]),
            ("hello ENx".into(), false)
        );
        assert_eq!(run(&["xy", "b"], &["axyb"]), ("a".into(), true));
        // Multi-byte characters are never split.
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }

    #[test]
    fn matcher_releases_text_that_cannot_start_a_stop() {
        let mut m = StopMatcher::new(vec!["STOP".to_string()].into());
        assert_eq!(m.push("abc S"), ("abc ".into(), false));
        assert_eq!(m.push("T"), (String::new(), false));
        assert_eq!(m.push("x"), ("STx".into(), false));
    }
}
