//! Constrained decoding with llguidance: the model's vocabulary as a token trie ([`Grammars`], built once), a
//! compiled grammar per request, and [`GrammarMask`], the runtime's [`TokenMask`] that applies it token by token.
//!
//! llguidance walks the trie of token byte strings against the grammar's lexer and Earley parser to find every
//! token that may come next. K3's tokenizer is byte-level (tiktoken ranks), so a rank's bytes are its trie word;
//! special tokens become `0xFF` + their name, as llguidance expects, which lets a grammar name `<|open|>` and keeps
//! them out of every text terminal.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deltafin_runtime::TokenMask;
use deltafin_text::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

/// The vocabulary as llguidance sees it: the trie, and our tokenizer for turning literal text into ids.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Option<Arc<Tokenizer>>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match (&self.tokenizer, std::str::from_utf8(s)) {
            (Some(tokenizer), Ok(text)) => tokenizer.encode(text),
            _ => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.tokenizer.is_some()
    }
}

/// Compiles grammars against one vocabulary. Built once per server (the trie of a 163,840-token vocabulary takes
/// a moment); shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
    end: u32,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Grammars {
    /// The grammars of `tokenizer`'s vocabulary, for a model whose logits rows have `vocab_size` entries (ids past
    /// the tokenizer are never allowed). `end` is the token that ends an answer: allowed exactly where a grammar
    /// is complete.
    pub fn new(tokenizer: &Arc<Tokenizer>, vocab_size: usize, end: u32) -> Result<Self, String> {
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tokenizer.id_to_bytes(id) {
                Some(bytes) if tokenizer.is_special(id) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                }
                Some(bytes) => bytes.to_vec(),
                None => Vec::new(),
            })
            .collect();
        Self::from_words(words, end, Some(Arc::clone(tokenizer)))
    }

    /// The grammars of a vocabulary given as each id's bytes (special tokens as `0xFF` + name). Without a tokenizer,
    /// literal text is split greedily over the trie.
    pub fn from_words(
        words: Vec<Vec<u8>>,
        end: u32,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Self, String> {
        let vocab_size = words.len();
        let n = u32::try_from(vocab_size).map_err(|_| "vocabulary too large".to_owned())?;
        if end >= n {
            return Err(format!(
                "the end token {end} is outside the vocabulary of {n}"
            ));
        }
        let info = TokRxInfo::new(n, end);
        let env: TokEnv = Arc::new(Vocabulary {
            trie: TokTrie::from(&info, &words),
            tokenizer,
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Grammar problems are answered to the client; llguidance's own log stays quiet.
        factory.quiet();
        Ok(Self {
            factory,
            vocab_size,
            end,
        })
    }

    /// Compiles a Lark grammar into a fresh mask. Fails with llguidance's message when the grammar (or a JSON
    /// schema in it) is malformed or unsupported.
    pub fn compile(&self, lark: &str) -> Result<GrammarMask, String> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_owned()))
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(GrammarMask {
            matcher,
            vocab_size: self.vocab_size,
            end: self.end,
            spent: Duration::ZERO,
            masks: 0,
        })
    }
}

/// One request's grammar state: which tokens may come next.
pub struct GrammarMask {
    matcher: Matcher,
    vocab_size: usize,
    /// The end token: allowed where the grammar is complete, and the last token of a generation.
    end: u32,
    spent: Duration,
    masks: u64,
}

impl std::fmt::Debug for GrammarMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMask")
            .field("masks", &self.masks)
            .finish()
    }
}

impl GrammarMask {
    /// Time spent computing masks and advancing the grammar, and how many masks were computed.
    pub fn cost(&self) -> (Duration, u64) {
        (self.spent, self.masks)
    }

    /// Whether the grammar is complete (the end token would be allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// The allowed set as booleans, one per id (for tests and the cost measurement).
    pub fn allowed(&mut self) -> Result<Vec<bool>, String> {
        let mut all = vec![0.0f32; self.vocab_size];
        self.restrict(&mut all)?;
        Ok(all.iter().map(|v| v.is_finite()).collect())
    }
}

impl TokenMask for GrammarMask {
    fn restrict(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let start = Instant::now();
        // Once the grammar is complete and nothing can follow, only the end token is allowed.
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        // The mask holds one bit per id, 32 to a word; ids past it (a padded vocabulary) are never allowed.
        let words = mask.as_slice();
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            match word {
                u32::MAX => {}
                // Most words of a narrow mask allow nothing: one fill, not 32 tests.
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, v) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        if let Some(rest) = logits.get_mut(words.len() * 32..) {
            rest.fill(f32::NEG_INFINITY);
        }
        self.spent += start.elapsed();
        self.masks += 1;
        Ok(())
    }

    fn accept(&mut self, id: u32) -> Result<(), String> {
        // The end token ends the generation (a stop token): there is nothing after it to constrain.
        if id == self.end {
            return Ok(());
        }
        let start = Instant::now();
        let result = self.matcher.consume_token(id).map_err(|e| e.to_string());
        self.spent += start.elapsed();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes 0..=255 as single tokens, `ab`, then two specials; the end token is the last.
    fn toy() -> Grammars {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"ab".to_vec());
        words.push(b"\xFF<|sep|>".to_vec());
        words.push(b"\xFF<|end|>".to_vec());
        Grammars::from_words(words, 258, None).expect("grammars")
    }

    fn allowed_ids(mask: &mut GrammarMask) -> Vec<usize> {
        let allowed = mask.allowed().expect("mask");
        (0..allowed.len()).filter(|&i| allowed[i]).collect()
    }

    #[test]
    fn the_mask_follows_the_grammar_and_allows_the_end_when_complete() {
        let g = toy();
        let mut m = g
            .compile(r#"start: "a" <|sep|> /[0-9]{2}/"#)
            .expect("compile");
        assert_eq!(allowed_ids(&mut m), vec![b'a' as usize]);
        m.accept(b'a' as u32).expect("a");
        assert_eq!(allowed_ids(&mut m), vec![257]);
        m.accept(257).expect("sep");
        assert_eq!(
            allowed_ids(&mut m),
            (b'0'..=b'9').map(usize::from).collect::<Vec<_>>()
        );
        m.accept(b'4' as u32).expect("4");
        assert!(!m.is_accepting());
        m.accept(b'2' as u32).expect("2");
        assert!(m.is_accepting());
        assert_eq!(allowed_ids(&mut m), vec![258], "only the end token");
        // Logits of allowed ids are left as they were; a padded tail is forbidden.
        let mut logits = vec![1.5f32; 300];
        m.restrict(&mut logits).expect("restrict");
        assert_eq!(logits[258], 1.5);
        assert!(logits[259..].iter().all(|&v| v == f32::NEG_INFINITY));
        assert!(
            m.accept(b'x' as u32).is_err(),
            "a forbidden token is an error"
        );
    }

    #[test]
    fn multi_byte_tokens_are_allowed_when_all_their_bytes_fit() {
        let g = toy();
        let mut m = g.compile(r#"start: /a[b-c]/"#).expect("compile");
        let ids = allowed_ids(&mut m);
        assert!(
            ids.contains(&256) && ids.contains(&(b'a' as usize)),
            "{ids:?}"
        );
    }

    #[test]
    fn local_refs_work_and_remote_ones_are_refused() {
        // The shape pydantic (the openai SDK's `parse`) writes: `$defs` and `#/$defs/...` references.
        let g = toy();
        let local = r##"start: %json {"$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
            "additionalProperties": false}"##;
        let mut m = g.compile(local).expect("local $ref");
        for &b in br#"{"x":7}"# {
            m.accept(u32::from(b)).expect("valid JSON of the schema");
        }
        assert!(m.is_accepting());
        let remote = r#"start: %json {"$ref": "https://example.invalid/schema.json"}"#;
        assert!(g.compile(remote).is_err());
    }

    #[test]
    fn a_bad_schema_is_an_error_not_a_panic() {
        let e = toy()
            .compile(r#"start: %json {"type": "no-such-type"}"#)
            .expect_err("bad schema");
        assert!(!e.is_empty());
    }
}
