//! K3's pre-tokenizer: the `pat_str` regex that splits text into pieces before BPE.
//!
//! The reference pattern (`tokenization_kimi.py`, eight alternatives joined by `|`)
//! contains one look-ahead, `\s+(?!\S)`, which the linear-time `regex` engine does
//! not support. Instead of a backtracking engine we drop that alternative and
//! emulate it after the fact, which keeps matching linear and fast:
//!
//! * Only three alternatives can produce a piece made purely of whitespace:
//!   `\s*[\r\n]+` (ends in a line break), `\s+(?!\S)` and `\s+`.
//! * When `\s*[\r\n]+` fails, the whitespace run holds no line break, so `\s+`
//!   takes the whole run, which is then followed by a non-space or the end.
//! * `\s+(?!\S)` matches that same run when it ends the text, and otherwise the
//!   run minus its last character (if that leaves at least one character).
//!
//! So: a match whose last character is whitespace other than `\r`/`\n` came from
//! `\s+`; if it is followed by more text and holds at least two characters, give
//! its last character back. A test checks this against `fancy-regex` running the
//! original pattern.
//!
//! Every character is matched by some alternative, so each piece starts where
//! the previous one ended; searching *anchored* there (`regex-automata`'s meta
//! engine) needs one forward scan and no reverse scan to locate the start,
//! which roughly doubles throughput over `regex::Regex::find_at`.

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};

/// The reference pattern's alternatives, in order (`\s+(?!\S)` is the 7th).
pub const PATTERN_PARTS: [&str; 8] = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
];

/// Index in [`PATTERN_PARTS`] of the look-ahead alternative that is emulated.
const LOOKAHEAD_PART: usize = 6;

/// K3's reference pre-tokenizer pattern (with the look-ahead), e.g. for `tiktoken`.
pub fn reference_pattern() -> String {
    PATTERN_PARTS.join("|")
}

/// Splits text into the pieces K3's BPE encodes one by one.
#[derive(Debug, Clone)]
pub struct PreTokenizer {
    regex: Regex,
}

impl PreTokenizer {
    /// Compiles the look-ahead-free pattern.
    pub fn new() -> Self {
        let pattern = PATTERN_PARTS
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != LOOKAHEAD_PART)
            .map(|(_, part)| *part)
            .collect::<Vec<_>>()
            .join("|");
        // The pattern is a compile-time constant that the tests compile, so this
        // cannot fail at run time.
        #[allow(clippy::expect_used)]
        let regex = Regex::new(&pattern).expect("reason: constant pattern is valid");
        Self { regex }
    }

    /// Iterates over the pieces of `text`, in order.
    pub fn pieces<'t>(&'t self, text: &'t str) -> Pieces<'t> {
        Pieces {
            regex: &self.regex,
            text,
            pos: 0,
        }
    }
}

impl Default for PreTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

/// Iterator over the pre-tokenized pieces of a text; see [`PreTokenizer::pieces`].
pub struct Pieces<'t> {
    regex: &'t Regex,
    text: &'t str,
    pos: usize,
}

impl<'t> Iterator for Pieces<'t> {
    type Item = &'t str;

    fn next(&mut self) -> Option<&'t str> {
        if self.pos >= self.text.len() {
            return None;
        }
        // Every character is matched by some alternative, so the match starts at
        // `pos`; like tiktoken we would skip unmatched text if it ever did not.
        // Anchored at `pos`: one forward scan, no reverse scan for the start.
        let input = Input::new(self.text).range(self.pos..);
        let m = match self.regex.search(&input.clone().anchored(Anchored::Yes)) {
            Some(m) => m,
            None => self.regex.search(&input)?,
        };
        let (start, mut end) = (m.start(), m.end());
        let piece = &self.text[start..end];
        let mut chars = piece.chars();
        if let Some(last) = chars.next_back()
            && last.is_whitespace()
            && last != '\r'
            && last != '\n'
            && end < self.text.len()
            && chars.next().is_some()
        {
            // `\s+(?!\S)`: leave the last space to start the next piece.
            end -= last.len_utf8();
        }
        self.pos = end;
        Some(&self.text[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookahead_emulation_examples() {
        let pre = PreTokenizer::new();
        let split = |s: &'static str| pre.pieces(s).map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(split("a   b"), ["a", "  ", " b"]);
        assert_eq!(split("a \tb"), ["a", " ", "\tb"]);
        assert_eq!(split("x   "), ["x", "   "]);
        assert_eq!(split("\n\nx"), ["\n\n", "x"]);
        assert_eq!(split("  \n  x"), ["  \n", " ", " x"]);
    }
}
