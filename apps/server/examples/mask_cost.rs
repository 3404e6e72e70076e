//! Per-token cost of grammar masking (constrained decoding) at K3's vocabulary size.
//!
//! ```sh
//! cargo run -p deltafin-server --example mask_cost            # synthetic 163,840-entry vocabulary
//! cargo run -p deltafin-server --example mask_cost -- --tiktoken DIR/tiktoken.model   # a real rank file
//! ```
//!
//! Builds the vocabulary trie, compiles a JSON-schema grammar (in K3's chat envelope, with a reasoning prefix),
//! and walks it along a fixed valid answer: at each step it computes the mask of allowed tokens (timed) and takes
//! the longest allowed token that spells the answer's next bytes. Prints the time to build the trie and to
//! compile the grammar, and the mask time per token (mean, median, 99th percentile, max) for the reasoning and the
//! JSON part. The synthetic vocabulary is 256 bytes, then space-led and bare lower/capitalised ASCII words,
//! digit runs, punctuation and whitespace runs, and 2- and 3-byte UTF-8 words, deduplicated, drawn from a
//! fixed-seed generator, then 256 special tokens: its token lengths resemble a BPE vocabulary's.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use deltafin_runtime::TokenMask;
use deltafin_server::constraint::{GrammarMask, Grammars};

/// K3's vocabulary: 163,584 ranks and 256 special slots.
const K3_VOCAB: usize = 163_840;
const N_SPECIAL: usize = 256;

/// A small fixed-seed generator (xorshift64*), so the vocabulary is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn synthetic_ranks(n: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut seen = HashSet::new();
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    seen.extend(words.iter().cloned());
    let letters = b"etaoinshrdlcumwfgypbvkjxqz";
    let punct = b".,;:!?()[]{}<>\"'`-_=+*/\\|&^%$#@~";
    let cyrillic: Vec<char> = ('\u{430}'..='\u{44F}').collect();
    while words.len() < n {
        let w: Vec<u8> = match rng.below(100) {
            0..=59 => {
                // A word, often led by a space; short words are commonest.
                let len = 2 + (rng.below(6) + rng.below(6)) as usize;
                let mut w = Vec::with_capacity(len + 1);
                if rng.below(3) != 0 {
                    w.push(b' ');
                }
                for i in 0..len {
                    // Skewed towards frequent letters.
                    let c = letters[(rng.below(26) * rng.below(26) / 25) as usize];
                    w.push(if i == 0 && rng.below(5) == 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    });
                }
                w
            }
            60..=69 => (0..1 + rng.below(3))
                .map(|_| b'0' + rng.below(10) as u8)
                .collect(),
            70..=79 => (0..1 + rng.below(3))
                .map(|_| punct[rng.below(punct.len() as u64) as usize])
                .collect(),
            80..=84 => {
                let c = [b' ', b'\n', b'\t'][rng.below(3) as usize];
                vec![c; 1 + rng.below(8) as usize]
            }
            85..=92 => {
                let s: String = (0..1 + rng.below(4))
                    .map(|_| cyrillic[rng.below(cyrillic.len() as u64) as usize])
                    .collect();
                s.into_bytes()
            }
            _ => {
                let s: String = (0..1 + rng.below(2))
                    .filter_map(|_| char::from_u32(0x4E00 + rng.below(0x5000) as u32))
                    .collect();
                s.into_bytes()
            }
        };
        if seen.insert(w.clone()) {
            words.push(w);
        }
    }
    words
}

/// Ranks from a tiktoken file (`base64(bytes) rank` per line), in rank order.
fn tiktoken_ranks(path: &str) -> Vec<Vec<u8>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut ranks: Vec<(usize, Vec<u8>)> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (b64, rank) = l.split_once(' ').expect("`base64 rank` lines");
            (rank.parse().expect("rank"), decode_base64(b64))
        })
        .collect();
    ranks.sort();
    ranks.into_iter().map(|(_, w)| w).collect()
}

fn decode_base64(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => 0,
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= (value(c) as u32) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    out
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 40},
  "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
  "days": {"type": "integer", "minimum": 1, "maximum": 30},
  "budget": {"type": "number"},
  "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
  "stops": {"type": "array", "items": {"type": "object", "properties": {
      "place": {"type": "string"}, "nights": {"type": "integer"}}, "required": ["place", "nights"],
      "additionalProperties": false}},
  "confirmed": {"type": "boolean"}},
 "required": ["name", "city", "days", "budget", "tags", "stops", "confirmed"], "additionalProperties": false}"#;

const REASONING: &str = "The user wants a trip plan as JSON. I will pick a city, a few stops and a budget, \
                         and keep the tags short. Kyoto in spring seems right; two stops are enough.";
const ANSWER: &str = r#"{"name": "Spring in Kyoto", "city": "Kyoto", "days": 9, "budget": 2450.5, "tags": ["temples", "food", "gardens"], "stops": [{"place": "Higashiyama", "nights": 4}, {"place": "Arashiyama", "nights": 5}], "confirmed": true}"#;

fn stats(mut t: Vec<Duration>) -> String {
    t.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = t.iter().map(|&d| us(d)).sum::<f64>() / t.len().max(1) as f64;
    let pick = |q: f64| us(t[((t.len() - 1) as f64 * q) as usize]);
    format!(
        "{} tokens: mean {mean:.0} µs, median {:.0} µs, p99 {:.0} µs, max {:.0} µs",
        t.len(),
        pick(0.5),
        pick(0.99),
        pick(1.0)
    )
}

/// Walks `text` through the grammar: times each mask, takes the longest allowed token spelling the next bytes.
fn walk(mask: &mut GrammarMask, words: &[Vec<u8>], text: &[u8], times: &mut Vec<Duration>) {
    let mut logits = vec![0.0f32; words.len()];
    let mut at = 0;
    while at < text.len() {
        logits.fill(0.0);
        let start = Instant::now();
        mask.restrict(&mut logits).expect("mask");
        times.push(start.elapsed());
        let rest = &text[at..];
        let best = (0..words.len())
            .filter(|&i| {
                logits[i].is_finite() && !words[i].is_empty() && rest.starts_with(&words[i])
            })
            .max_by_key(|&i| words[i].len())
            .unwrap_or_else(|| {
                panic!(
                    "no allowed token spells {:?}",
                    String::from_utf8_lossy(rest)
                )
            });
        mask.accept(best as u32).expect("accept");
        at += words[best].len();
    }
}

fn special(name: &str) -> Vec<u8> {
    let mut w = vec![0xFF];
    w.extend_from_slice(name.as_bytes());
    w
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut ranks = match args.iter().position(|a| a == "--tiktoken") {
        Some(i) => tiktoken_ranks(args.get(i + 1).expect("--tiktoken PATH")),
        None => synthetic_ranks(K3_VOCAB - N_SPECIAL),
    };
    let source = if args.iter().any(|a| a == "--tiktoken") {
        "tiktoken file"
    } else {
        "synthetic"
    };
    let names = [
        "[BOS]",
        "[EOS]",
        "<|end_of_msg|>",
        "<|open|>",
        "<|close|>",
        "<|sep|>",
    ];
    let mut words = std::mem::take(&mut ranks);
    let n_ranks = words.len();
    for i in 0..N_SPECIAL {
        words.push(special(
            names
                .get(i)
                .copied()
                .unwrap_or(&format!("<|reserved_{i}|>")),
        ));
    }
    let end = (n_ranks + 2) as u32;
    let vocab = words.len();

    let start = Instant::now();
    let grammars = Grammars::from_words(words.clone(), end, None).expect("grammars");
    let trie = start.elapsed();

    let lark = format!(
        "start: REASONING <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> answer <|close|> \"response\" \
         <|sep|> <|close|> \"message\" <|sep|>\nREASONING: /(?s:.*)/\nanswer: %json {}",
        SCHEMA.trim_end_matches('}').to_owned()
            + r#", "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}"#
    );
    let start = Instant::now();
    let mut mask = grammars.compile(&lark).expect("compile");
    let compile = start.elapsed();

    let mut reasoning = Vec::new();
    walk(&mut mask, &words, REASONING.as_bytes(), &mut reasoning);
    // The envelope between the reasoning and the answer, token by token.
    let mut envelope = Vec::new();
    let ids = |name: &str| {
        words
            .iter()
            .position(|w| w == &special(name))
            .expect("special") as u32
    };
    for piece in [
        "<|close|>",
        "think",
        "<|sep|>",
        "<|open|>",
        "response",
        "<|sep|>",
    ] {
        if piece.starts_with("<|") {
            let mut logits = vec![0.0f32; vocab];
            let start = Instant::now();
            mask.restrict(&mut logits).expect("mask");
            envelope.push(start.elapsed());
            mask.accept(ids(piece)).expect("special");
        } else {
            walk(&mut mask, &words, piece.as_bytes(), &mut envelope);
        }
    }
    let mut json = Vec::new();
    walk(&mut mask, &words, ANSWER.as_bytes(), &mut json);
    let first_json = json[0];

    println!("vocabulary: {vocab} ids ({n_ranks} ranks from the {source}, {N_SPECIAL} special)");
    println!(
        "trie: {:.0} ms to build; grammar: {:.1} ms to compile",
        trie.as_secs_f64() * 1e3,
        compile.as_secs_f64() * 1e3
    );
    println!("reasoning (free text): {}", stats(reasoning));
    println!("envelope (markup): {}", stats(envelope));
    println!(
        "JSON answer: {} (first {:.0} µs)",
        stats(json),
        first_json.as_secs_f64() * 1e6
    );
}
