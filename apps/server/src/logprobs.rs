//! Log-probabilities of generated tokens (`logprobs`, `top_logprobs`) and their OpenAI shapes.
//!
//! A token's log-probability is taken from the raw logits row it was chosen from: `row[id] - log Σ exp(row)` in
//! f64, before temperature, top-k/top-p or a grammar mask, which is what `deltafin nll` reports for the same
//! position. Alternatives are the `top` largest logits of that row, ties to the lower id.

use deltafin_text::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

/// Most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f64,
    /// The `top` most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f64)>,
}

/// `log Σ exp(row)` in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The log-probability of `id` under `row`, and the `top` most likely ids.
pub fn token_logprob(row: &[f32], id: u32, top: usize) -> TokenLogprob {
    let lse = log_sum_exp(row);
    let logprob = row
        .get(id as usize)
        .map_or(f64::NEG_INFINITY, |&x| x as f64 - lse);
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        // A partial selection: keep the `top` best seen so far, sorted (top ≤ 20, so insertion is cheap).
        for (i, &x) in row.iter().enumerate() {
            let better = |b: &u32| x > row[*b as usize];
            if best.len() < top || better(best.last().unwrap_or(&0)) {
                let at = best.iter().position(better).unwrap_or(best.len());
                best.insert(at, i as u32);
                best.truncate(top);
            }
        }
    }
    TokenLogprob {
        id,
        logprob,
        top: best
            .into_iter()
            .map(|b| (b, row[b as usize] as f64 - lse))
            .collect(),
    }
}

/// A token's text (lossy for bytes that are not UTF-8 on their own) and its bytes.
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.id_to_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// JSON has no infinities: a token the model gave no probability at all gets the most negative finite value.
fn finite(x: f64) -> f64 {
    if x.is_finite() { x } else { -9999.0 }
}

/// `choices[].logprobs` of a chat answer: `{"content": [...]}`, one entry per token.
pub fn chat_json(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> Value {
    let entry = |id: u32, logprob: f64| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": finite(logprob), "bytes": bytes})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.id, t.logprob);
            e["top_logprobs"] = Value::Array(t.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `choices[].logprobs` of a text completion: `tokens`, `token_logprobs`, `top_logprobs` (token text to
/// log-probability), `text_offset` (characters before each token, counted from `offset`).
pub fn completion_json(tokenizer: &Tokenizer, tokens: &[TokenLogprob], offset: usize) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in tokens {
        let (text, _) = token_text(tokenizer, t.id);
        offsets.push(at);
        at += text.chars().count();
        texts.push(text);
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut m = Map::new();
            for &(id, lp) in &t.top {
                m.entry(token_text(tokenizer, id).0)
                    .or_insert(json!(finite(lp)));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| finite(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Characters the tokens' texts add (the next `offset` of [`completion_json`]).
pub fn text_len(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> usize {
    tokens
        .iter()
        .map(|t| token_text(tokenizer, t.id).0.chars().count())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_log_softmax_and_top_is_sorted() {
        let row = [0.0f32, 2.0, 1.0, 2.0, -1.0];
        let t = token_logprob(&row, 2, 3);
        let lse = (1.0f64 + 2f64.exp() * 2.0 + 1f64.exp() + (-1f64).exp()).ln();
        assert!((t.logprob - (1.0 - lse)).abs() < 1e-12);
        // Ties go to the lower id.
        assert_eq!(t.top.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((t.top[0].1 - (2.0 - lse)).abs() < 1e-12);
        let sum: f64 = row.iter().map(|&x| (x as f64 - lse).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-12);
        assert!(token_logprob(&row, 0, 0).top.is_empty());
        assert_eq!(token_logprob(&row, 0, 20).top.len(), 5);
    }
}
