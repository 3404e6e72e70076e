//! Parsing of K3's two tokenizer files: `tiktoken.model` and `tokenizer_config.json`.
//!
//! Both parsers work on in-memory bytes plus the path they came from, so that
//! every error can name the file (and line) at fault.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine as _;
use rustc_hash::FxHashMap;

use crate::error::{Result, TextError};

/// Number of special-token slots K3 reserves right after the mergeable ranks.
pub const N_SPECIAL_SLOTS: u32 = 256;

/// The mergeable ranks of a `tiktoken.model`, indexed by rank.
pub(crate) struct Ranks {
    /// `tokens[rank]` is the byte string of that rank.
    pub tokens: Vec<Vec<u8>>,
}

/// Parses `tiktoken.model`: one `base64(bytes) rank` per line.
///
/// Blank lines are skipped (as the reference loader does). Ranks must be
/// unique and cover `0..n` exactly, token byte strings must be unique, and
/// every single byte must be a token (byte-level BPE cannot encode otherwise).
pub(crate) fn parse_tiktoken_model(data: &[u8], path: &Path) -> Result<Ranks> {
    let malformed = |line: usize, reason: String| TextError::MalformedLine {
        path: path.to_path_buf(),
        line,
        reason,
    };

    // (token bytes, line number) per rank, filled as ranks appear.
    let mut by_rank: Vec<Option<(Vec<u8>, usize)>> = Vec::new();
    let mut seen_bytes: FxHashMap<Vec<u8>, usize> = FxHashMap::default();
    let mut n_tokens = 0usize;
    // Ranks must be exactly 0..n, so a rank >= the number of token lines is
    // an error; checking it up front also bounds the `by_rank` allocation.
    let n_lines = data
        .split(|&b| b == b'\n')
        .filter(|l| !l.trim_ascii().is_empty())
        .count();

    for (line_idx, raw_line) in data.split(|&b| b == b'\n').enumerate() {
        let line_no = line_idx + 1;
        let line = raw_line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        let mut fields = line
            .split(|b| b.is_ascii_whitespace())
            .filter(|f| !f.is_empty());
        let (Some(b64), rank_field, extra) = (fields.next(), fields.next(), fields.next()) else {
            continue; // unreachable: the line is non-empty after trimming
        };
        let Some(rank_field) = rank_field else {
            return Err(malformed(
                line_no,
                "missing rank after the base64 token".into(),
            ));
        };
        if extra.is_some() {
            return Err(malformed(
                line_no,
                "expected `base64 rank`, found more than two fields".into(),
            ));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| {
                malformed(
                    line_no,
                    format!("bad base64 {:?}: {e}", String::from_utf8_lossy(b64)),
                )
            })?;
        let rank: u32 = std::str::from_utf8(rank_field)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                malformed(
                    line_no,
                    format!(
                        "rank {:?} is not a non-negative integer",
                        String::from_utf8_lossy(rank_field)
                    ),
                )
            })?;
        if bytes.is_empty() {
            return Err(malformed(line_no, "token decodes to zero bytes".into()));
        }

        let slot = rank as usize;
        if slot >= n_lines {
            return Err(malformed(
                line_no,
                format!("rank {rank} is out of range: the file holds only {n_lines} tokens"),
            ));
        }
        if slot >= by_rank.len() {
            by_rank.resize(slot + 1, None);
        }
        if let Some((_, first_line)) = &by_rank[slot] {
            return Err(TextError::DuplicateRank {
                path: path.to_path_buf(),
                line: line_no,
                rank,
                first_line: *first_line,
            });
        }
        if let Some(&first_line) = seen_bytes.get(&bytes) {
            return Err(TextError::DuplicateToken {
                path: path.to_path_buf(),
                line: line_no,
                first_line,
            });
        }
        seen_bytes.insert(bytes.clone(), line_no);
        by_rank[slot] = Some((bytes, line_no));
        n_tokens += 1;
    }

    let mut tokens = Vec::with_capacity(by_rank.len());
    for (rank, entry) in by_rank.into_iter().enumerate() {
        match entry {
            Some((bytes, _)) => tokens.push(bytes),
            None => {
                return Err(TextError::RankGap {
                    path: path.to_path_buf(),
                    n_ranks: n_tokens,
                    // Ranks were checked to fit in u32 when parsed.
                    missing: rank as u32,
                });
            }
        }
    }
    for byte in 0..=u8::MAX {
        if !seen_bytes.contains_key([byte].as_slice()) {
            return Err(TextError::MissingByte {
                path: path.to_path_buf(),
                byte,
            });
        }
    }
    Ok(Ranks { tokens })
}

/// One entry of `added_tokens_decoder`; only the text matters here.
#[derive(serde::Deserialize)]
struct AddedToken {
    content: String,
}

/// The part of `tokenizer_config.json` the tokenizer reads.
#[derive(serde::Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    added_tokens_decoder: BTreeMap<String, AddedToken>,
}

/// Builds the names of the 256 special slots `n_ranks..n_ranks + 256`.
///
/// Named slots come from `added_tokens_decoder`; the rest are
/// `<|reserved_token_{id}|>`, as in K3's `tokenization_kimi.py`. Entries
/// outside the special range are ignored with a warning, as the reference does.
pub(crate) fn parse_special_names(data: &[u8], path: &Path, n_ranks: u32) -> Result<Vec<String>> {
    let bad = |reason: String| TextError::BadConfig {
        path: path.to_path_buf(),
        reason,
    };
    let config: TokenizerConfig =
        serde_json::from_slice(data).map_err(|e| bad(format!("invalid tokenizer config: {e}")))?;

    let mut names: Vec<String> = (0..N_SPECIAL_SLOTS)
        .map(|i| format!("<|reserved_token_{}|>", n_ranks + i))
        .collect();
    for (key, token) in config.added_tokens_decoder {
        let id: u32 = key.parse().map_err(|_| {
            bad(format!(
                "added_tokens_decoder key {key:?} is not a token id"
            ))
        })?;
        match id.checked_sub(n_ranks) {
            Some(slot) if slot < N_SPECIAL_SLOTS => names[slot as usize] = token.content,
            _ => tracing::warn!(
                id,
                content = %token.content,
                "{}: added token outside the special range {}..{} is ignored",
                path.display(),
                n_ranks,
                n_ranks + N_SPECIAL_SLOTS
            ),
        }
    }

    let mut seen: FxHashMap<&str, usize> = FxHashMap::default();
    for (slot, name) in names.iter().enumerate() {
        if name.is_empty() {
            return Err(bad(format!(
                "special token {} has an empty name",
                n_ranks as usize + slot
            )));
        }
        if let Some(first) = seen.insert(name, slot) {
            return Err(bad(format!(
                "special token name {name:?} is used by ids {} and {}",
                n_ranks as usize + first,
                n_ranks as usize + slot
            )));
        }
    }
    Ok(names)
}
