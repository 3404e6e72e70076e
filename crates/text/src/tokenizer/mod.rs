//! K3's tiktoken-format tokenizer: load, encode, decode.
//!
//! K3 ships `tiktoken.model` (one `base64(bytes) rank` per line; the ranks are the
//! token ids) and `tokenizer_config.json`, whose `added_tokens_decoder` names some
//! of the 256 special slots that follow the ranks. Encoding is tiktoken's: split
//! the text with K3's pre-tokenizer regex ([`pretokenize`]), then rank-BPE each
//! piece in tiktoken's merge order.
//!
//! A [`Tokenizer`] is immutable once loaded: share one through an `Arc` between
//! threads. [`StreamDecoder`] turns a stream of generated ids into text without
//! ever cutting a UTF-8 character in half.

mod bpe;
mod incremental;
mod load;
pub mod pretokenize;

use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};
use rustc_hash::FxHashMap;

pub use crate::error::{Result, TextError};
pub use incremental::{StreamDecoder, Utf8Buffer};
pub use load::N_SPECIAL_SLOTS;

use bpe::{RankMap, Vocab};
use pretokenize::PreTokenizer;

/// File name of the mergeable ranks inside a model directory.
pub const TIKTOKEN_MODEL_FILE: &str = "tiktoken.model";
/// File name of the tokenizer config (special-token names) inside a model directory.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Longest slice, in characters, that K3's `tokenization_kimi.py` hands to
/// tiktoken in one call; longer text is cut at every multiple of it.
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// Longest run of consecutive whitespace (or of consecutive non-whitespace)
/// characters the reference encodes in one call; a longer run is cut.
pub const MAX_RUN_CHARS: usize = 25_000;

/// A loaded K3 tokenizer. Cheap to share (`Arc<Tokenizer>`), `Send + Sync`.
pub struct Tokenizer {
    /// Mergeable token bytes to rank (= id).
    ranks: Vocab,
    /// Bytes of every id (ranks, then special names) back to back.
    id_bytes: Vec<u8>,
    /// `id_bytes[id_offsets[id]..id_offsets[id + 1]]` are the bytes of `id`.
    id_offsets: Vec<usize>,
    /// Number of mergeable ranks; special ids start here.
    n_ranks: u32,
    /// Special-token name to id.
    special_ids: FxHashMap<String, u32>,
    /// Finds special-token names in text, for [`Tokenizer::encode_with_specials`].
    special_matcher: AhoCorasick,
    pre: PreTokenizer,
}

impl std::fmt::Debug for Tokenizer {
    // The tables hold hundreds of thousands of entries: show their sizes only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_ranks", &self.n_ranks)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        Self::from_files(
            dir.join(TIKTOKEN_MODEL_FILE),
            dir.join(TOKENIZER_CONFIG_FILE),
        )
    }

    /// Loads a tokenizer from explicit paths to `tiktoken.model` and `tokenizer_config.json`.
    pub fn from_files(model_path: impl AsRef<Path>, config_path: impl AsRef<Path>) -> Result<Self> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TextError::Io {
                path: path.to_path_buf(),
                source,
            })
        };
        let (model_path, config_path) = (model_path.as_ref(), config_path.as_ref());
        Self::from_parts(
            &read(model_path)?,
            model_path,
            &read(config_path)?,
            config_path,
        )
    }

    /// Builds a tokenizer from the contents of the two files (errors name them
    /// `tiktoken.model` and `tokenizer_config.json`).
    pub fn from_bytes(tiktoken_model: &[u8], tokenizer_config: &[u8]) -> Result<Self> {
        Self::from_parts(
            tiktoken_model,
            Path::new(TIKTOKEN_MODEL_FILE),
            tokenizer_config,
            Path::new(TOKENIZER_CONFIG_FILE),
        )
    }

    fn from_parts(
        model: &[u8],
        model_path: &Path,
        config: &[u8],
        config_path: &Path,
    ) -> Result<Self> {
        let parsed = load::parse_tiktoken_model(model, model_path)?;
        let n_ranks = u32::try_from(parsed.tokens.len())
            .ok()
            .filter(|n| n.checked_add(N_SPECIAL_SLOTS).is_some())
            .ok_or_else(|| TextError::BadConfig {
                path: model_path.to_path_buf(),
                reason: format!(
                    "{} ranks do not fit in 32-bit token ids",
                    parsed.tokens.len()
                ),
            })?;
        let special_names = load::parse_special_names(config, config_path, n_ranks)?;

        let total_bytes = parsed.tokens.iter().map(Vec::len).sum::<usize>()
            + special_names.iter().map(String::len).sum::<usize>();
        let mut id_bytes = Vec::with_capacity(total_bytes);
        let mut id_offsets = Vec::with_capacity(parsed.tokens.len() + special_names.len() + 1);
        let mut ranks = RankMap::with_capacity_and_hasher(parsed.tokens.len(), Default::default());
        for (rank, token) in parsed.tokens.into_iter().enumerate() {
            id_offsets.push(id_bytes.len());
            id_bytes.extend_from_slice(&token);
            // `rank < n_ranks`, which fits in u32 (checked above).
            ranks.insert(token.into_boxed_slice(), rank as u32);
        }
        let mut special_ids = FxHashMap::default();
        for (slot, name) in special_names.iter().enumerate() {
            id_offsets.push(id_bytes.len());
            id_bytes.extend_from_slice(name.as_bytes());
            special_ids.insert(name.clone(), n_ranks + slot as u32);
        }
        id_offsets.push(id_bytes.len());

        let special_matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&special_names)
            .map_err(|e| TextError::BadConfig {
                path: config_path.to_path_buf(),
                reason: format!("cannot build the special-token matcher: {e}"),
            })?;

        Ok(Self {
            ranks: Vocab::new(ranks),
            id_bytes,
            id_offsets,
            n_ranks,
            special_ids,
            special_matcher,
            pre: PreTokenizer::new(),
        })
    }

    /// Total number of ids: mergeable ranks plus the 256 special slots.
    pub fn vocab_size(&self) -> usize {
        self.id_offsets.len() - 1
    }

    /// Number of mergeable ranks; the first special id.
    pub fn n_ranks(&self) -> u32 {
        self.n_ranks
    }

    /// Encodes text with no special tokens recognised: `<|open|>` in the text is
    /// ordinary characters. This is how user-supplied text must be encoded.
    ///
    /// Like the reference `encode`, text is first cut every [`MAX_ENCODE_CHARS`]
    /// characters and wherever a whitespace or non-whitespace run exceeds
    /// [`MAX_RUN_CHARS`], and the slices are encoded separately (this only
    /// matters for texts longer than 25,000 characters).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Vec::new();
        reference_slices(text, |slice| {
            self.encode_ordinary_into(slice, &mut scratch, &mut out)
        });
        out
    }

    /// Encodes text with every special token recognised (tiktoken's
    /// `allowed_special="all"`): each occurrence of a special name becomes its id.
    /// Slicing of long texts is as in [`Tokenizer::encode`].
    pub fn encode_with_specials(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Vec::new();
        reference_slices(text, |slice| {
            let mut last = 0;
            for m in self.special_matcher.find_iter(slice) {
                self.encode_ordinary_into(&slice[last..m.start()], &mut scratch, &mut out);
                // Pattern i of the matcher is special slot i.
                out.push(self.n_ranks + m.pattern().as_u32());
                last = m.end();
            }
            self.encode_ordinary_into(&slice[last..], &mut scratch, &mut out);
        });
        out
    }

    fn encode_ordinary_into(
        &self,
        text: &str,
        scratch: &mut Vec<(usize, u32)>,
        out: &mut Vec<u32>,
    ) {
        for piece in self.pre.pieces(text) {
            bpe::encode_piece(&self.ranks, piece.as_bytes(), scratch, out);
        }
    }

    /// The bytes of one id (a special id yields its name), or `None` if out of range.
    pub fn id_to_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.id_offsets.get(i)?, *self.id_offsets.get(i + 1)?);
        Some(&self.id_bytes[start..end])
    }

    /// Concatenated bytes of `ids`; special ids decode to their names.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.id_to_bytes(id).ok_or(TextError::UnknownId {
                id,
                vocab_size: self.vocab_size(),
            })?);
        }
        Ok(out)
    }

    /// Decodes `ids` to text, failing with [`TextError::InvalidUtf8`] if the
    /// bytes are not valid UTF-8 (for example when a sequence ends inside a
    /// character). Strict so that silent corruption cannot hide; use
    /// [`Tokenizer::decode_lossy`] or [`StreamDecoder`] where U+FFFD is acceptable.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8(self.decode_bytes(ids)?)?)
    }

    /// Decodes `ids` to text, replacing invalid UTF-8 with U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// The id of a special token such as `<|open|>`, if the tokenizer has it.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    /// The id of a special token that must exist; a clear error if it does not.
    pub fn require_special(&self, name: &str) -> Result<u32> {
        self.special_id(name)
            .ok_or_else(|| TextError::UnknownSpecial {
                name: name.to_owned(),
            })
    }

    /// Whether `id` is one of the 256 special slots.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_ranks && (id as usize) < self.vocab_size()
    }

    /// The id of an exact token: a mergeable byte string or a special name.
    pub fn token_to_id(&self, token: impl AsRef<[u8]>) -> Option<u32> {
        let token = token.as_ref();
        if let Some(id) = self.ranks.get(token) {
            return Some(id);
        }
        std::str::from_utf8(token)
            .ok()
            .and_then(|name| self.special_id(name))
    }

    /// All special tokens as `(id, name)`, in id order.
    pub fn special_tokens(&self) -> impl Iterator<Item = (u32, &str)> + '_ {
        (self.n_ranks..self.vocab_size() as u32).map(move |id| {
            // Special ids decode to their UTF-8 names, which were `String`s.
            let name = self
                .id_to_bytes(id)
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default();
            (id, name)
        })
    }
}

/// Python's `str.isspace`: Unicode White_Space plus U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Calls `f` on the slices the reference tokenizer encodes one by one: cuts
/// every [`MAX_ENCODE_CHARS`] characters, and inside each such chunk wherever a
/// run of whitespace or of non-whitespace grows past [`MAX_RUN_CHARS`]
/// characters (the run count restarts with each chunk). One pass over the text.
fn reference_slices(text: &str, mut f: impl FnMut(&str)) {
    // Fewer bytes than the limit means fewer characters: nothing to cut.
    if text.len() <= MAX_RUN_CHARS {
        f(text);
        return;
    }
    let mut start = 0;
    let mut chunk_chars = 0;
    let mut run_len = 0;
    let mut run_is_space = false;
    for (i, c) in text.char_indices() {
        if chunk_chars == MAX_ENCODE_CHARS {
            f(&text[start..i]);
            start = i;
            chunk_chars = 0;
        }
        let is_space = is_python_space(c);
        if chunk_chars == 0 || is_space != run_is_space {
            run_is_space = is_space;
            run_len = 1;
        } else {
            run_len += 1;
            if run_len > MAX_RUN_CHARS {
                f(&text[start..i]);
                start = i;
                run_len = 1;
            }
        }
        chunk_chars += 1;
    }
    f(&text[start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<std::sync::Arc<Tokenizer>>();
    }

    fn slices(text: &str) -> Vec<usize> {
        let mut lens = Vec::new();
        reference_slices(text, |s| lens.push(s.chars().count()));
        lens
    }

    #[test]
    fn reference_slicing() {
        assert_eq!(slices(""), [0]);
        assert_eq!(slices("short text"), [10]);
        // A run of 25,001 non-spaces is cut after 25,000 characters.
        let run = "é".repeat(MAX_RUN_CHARS + 1);
        assert_eq!(slices(&run), [MAX_RUN_CHARS, 1]);
        // Alternating runs below the limit are never cut, until 400k characters.
        let words = "ab ".repeat(MAX_ENCODE_CHARS / 3 + 2);
        assert_eq!(
            slices(&words),
            [MAX_ENCODE_CHARS, words.len() - MAX_ENCODE_CHARS]
        );
        // The run count restarts at a 400k-character cut.
        let tail = "y".repeat(MAX_RUN_CHARS + 5);
        let crossing = format!("{}{tail}", "ab ".repeat((MAX_ENCODE_CHARS - 10) / 3));
        let head = MAX_ENCODE_CHARS - 10;
        assert_eq!(
            slices(&crossing),
            [
                MAX_ENCODE_CHARS,
                head + MAX_RUN_CHARS + 5 - MAX_ENCODE_CHARS
            ]
        );
        // U+001F counts as space (Python's isspace), so it breaks a run.
        let mut mixed = "x".repeat(MAX_RUN_CHARS);
        mixed.push('\u{1f}');
        mixed.push_str(&"x".repeat(10));
        assert_eq!(slices(&mixed), [MAX_RUN_CHARS + 11]);
    }
}
