//! Tokenizer throughput: encode a ≥ 1 MB mixed-script text with the 100k
//! cl100k vocabulary (K3's regex and specials), the same text that
//! `scripts/bench_tokenizer_tiktoken.py` gives Python's `tiktoken`.
//!
//! Run: `cargo bench -p deltafin-text --bench tokenizer`. With
//! `DELTAFIN_BENCH_DUMP=DIR` set, the text and its ids are also written to
//! `DIR/bench_text.txt`, `DIR/bench_ids.json` and `DIR/bench_ids_special.json`
//! for the Python side to check.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use deltafin_text::tokenizer::Tokenizer;
use deltafin_text::tokenizer::pretokenize::PreTokenizer;

/// Size the generated text reaches before it stops growing.
const TARGET_BYTES: usize = 1 << 20;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer/cl100k")
}

/// Deterministic xorshift64, so every run (and the Python side) sees the same text.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}

const LATIN: &[&str] = &[
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "Tokenizer",
    "inference",
    "engine",
    "naïve",
    "café",
    "über",
    "coöperation",
    "Hello,",
    "world!",
    "It's",
    "don't",
    "we've",
    "XMLHttpRequest",
    "camelCase",
    "snake_case",
    "model",
    "weights",
    "attention",
    "expert",
    "routing",
    "déjà",
    "vu",
    "señor",
    "Straße",
];
const CJK: &[&str] = &[
    "中文",
    "你好，世界！",
    "我爱北京天安门",
    "東京タワー",
    "こんにちは",
    "日本語のテキスト。",
    "ひらがなとカタカナ",
    "한국어",
    "価格は1000円です",
    "人工智能",
    "模型推理",
    "大規模言語モデル",
];
const CYRILLIC: &[&str] = &[
    "привет",
    "мир",
    "съешь",
    "же",
    "ещё",
    "этих",
    "мягких",
    "французских",
    "булок",
    "ПРИВЕТ",
    "Ёлка",
    "тест123тест",
];
const CODE: &[&str] = &[
    "fn main() {\n    println!(\"{}\", x);\n}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n",
    "def f(x):\n    return x * 2\n",
    "<html><body>hi</body></html>",
    "{\"a\": [1, 2, 3], \"b\": null}",
    "if (a && b || !c) { return; }",
    "    let y = x.map(|v| v * 2).collect::<Vec<_>>();\n",
];
const EMOJI: &[&str] = &[
    "🙂",
    "😀😃😄",
    "👨\u{200d}👩\u{200d}👧\u{200d}👦",
    "🇺🇸🇯🇵",
    "✓",
    "★☆",
    "∑∫√∞",
];

/// Builds the benchmark text: fixture strings, then generated mixed-script prose.
fn bench_text() -> String {
    let golden_path = fixture_dir().join("golden.json");
    let golden: serde_json::Value = std::fs::read(&golden_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_else(|| panic!("cannot read {}", golden_path.display()));
    let mut text = String::with_capacity(TARGET_BYTES + 1024);
    for case in golden["cases"].as_array().into_iter().flatten() {
        text.push_str(case["text"].as_str().unwrap_or_default());
        text.push('\n');
    }
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut words = 0u64;
    while text.len() < TARGET_BYTES {
        let word = match rng.next() % 20 {
            0..=8 => rng.pick(LATIN).to_owned(),
            9..=11 => rng.pick(CJK).to_owned(),
            12..=14 => rng.pick(CYRILLIC).to_owned(),
            15 => rng.pick(CODE).to_owned(),
            16 => rng.pick(EMOJI).to_owned(),
            17 => (rng.next() % 100_000).to_string(),
            18 => format!("{}.{:02}", rng.next() % 1000, rng.next() % 100),
            _ => format!("2026-{:02}-{:02}", rng.next() % 12 + 1, rng.next() % 28 + 1),
        };
        text.push_str(&word);
        words += 1;
        text.push_str(match words % 97 {
            0 => "\n\n",
            n if n % 13 == 0 => ".\n",
            n if n % 7 == 0 => ", ",
            _ => " ",
        });
    }
    text
}

fn encode(c: &mut Criterion) {
    let tok = Tokenizer::from_dir(fixture_dir()).unwrap_or_else(|e| panic!("{e}"));
    let text = bench_text();
    let ids = tok.encode(&text);
    println!(
        "bench text: {} bytes, {} chars, {} tokens",
        text.len(),
        text.chars().count(),
        ids.len()
    );
    if let Some(dir) = std::env::var_os("DELTAFIN_BENCH_DUMP") {
        let dir = PathBuf::from(dir);
        let written = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(dir.join("bench_text.txt"), &text))
            .and_then(|()| {
                std::fs::write(
                    dir.join("bench_ids.json"),
                    serde_json::to_string(&ids).unwrap_or_default(),
                )
            })
            .and_then(|()| {
                let special = tok.encode_with_specials(&text);
                std::fs::write(
                    dir.join("bench_ids_special.json"),
                    serde_json::to_string(&special).unwrap_or_default(),
                )
            });
        if let Err(e) = written {
            panic!("cannot write to {}: {e}", dir.display());
        }
    }

    let mut group = c.benchmark_group("tokenizer_cl100k_1MB");
    group.throughput(Throughput::BytesDecimal(text.len() as u64));
    group.sample_size(20);
    group.bench_function("encode", |b| b.iter(|| tok.encode(black_box(&text))));
    group.bench_function("encode_with_specials", |b| {
        b.iter(|| tok.encode_with_specials(black_box(&text)))
    });
    let pre = PreTokenizer::new();
    group.bench_function("pretokenize_only", |b| {
        b.iter(|| pre.pieces(black_box(&text)).count())
    });
    group.bench_function("decode", |b| b.iter(|| tok.decode_bytes(black_box(&ids))));
    group.finish();

    let mut group = c.benchmark_group("tokenizer_cl100k_load");
    group.sample_size(10);
    group.bench_function("from_dir", |b| {
        b.iter(|| Tokenizer::from_dir(fixture_dir()))
    });
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
