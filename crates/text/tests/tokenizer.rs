//! Tokenizer tests against the reference goldens in `tests/fixtures/tokenizer`.
//!
//! `toy` and `cl100k` hold ids computed by tiktoken with K3's pre-tokenizer and
//! specials; every case is checked for plain and special-aware encoding, and
//! every text must survive a decode round trip.

// A test that fails should fail loudly at the failing call.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use deltafin_text::tokenizer::pretokenize::{PreTokenizer, reference_pattern};
use deltafin_text::tokenizer::{StreamDecoder, TextError, Tokenizer, Utf8Buffer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn load(name: &str) -> Tokenizer {
    let dir = fixtures().join("tokenizer").join(name);
    Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

#[derive(serde::Deserialize)]
struct Golden {
    n_ranks: u32,
    vocab_size: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_special: Vec<u32>,
}

fn golden(name: &str) -> Golden {
    let path = fixtures().join("tokenizer").join(name).join("golden.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// Checks one golden case: both encodings, and decoding back to the text.
fn check(tok: &Tokenizer, case: &Case) {
    let text = &case.text;
    assert_eq!(tok.encode(text), case.ids, "encode({text:?})");
    assert_eq!(
        tok.encode_with_specials(text),
        case.ids_special,
        "encode_with_specials({text:?})"
    );
    assert_eq!(
        tok.decode(&case.ids).unwrap(),
        *text,
        "decode(ids) of {text:?}"
    );
    assert_eq!(
        tok.decode(&case.ids_special).unwrap(),
        *text,
        "decode(ids_special) of {text:?}"
    );
}

fn check_all(name: &str) {
    let tok = load(name);
    let golden = golden(name);
    assert_eq!(tok.n_ranks(), golden.n_ranks);
    assert_eq!(tok.vocab_size(), golden.vocab_size);
    assert!(golden.cases.len() > 100, "{name}: suspiciously few cases");
    for case in &golden.cases {
        check(&tok, case);
    }
}

#[test]
fn toy_goldens() {
    check_all("toy");
}

#[test]
fn cl100k_goldens() {
    check_all("cl100k");
}

#[test]
fn k3_tiny_tokenizer_matches_config_vocab_size() {
    for name in ["k3-tiny-a", "k3-tiny-b"] {
        let dir = fixtures().join("k3").join(name);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let vocab = config["text_config"]["vocab_size"].as_u64().unwrap() as usize;
        assert_eq!(tok.vocab_size(), vocab, "{name}");
        // The K3 special order: [BOS], [EOS], <|end_of_msg|>, <|open|>, <|close|>, <|sep|> ...
        let base = tok.n_ranks();
        for (offset, name) in [
            "[BOS]",
            "[EOS]",
            "<|end_of_msg|>",
            "<|open|>",
            "<|close|>",
            "<|sep|>",
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(tok.special_id(name), Some(base + offset as u32), "{name}");
        }
        assert_eq!(tok.special_id("[PAD]"), Some(base + 255));
        let reserved = format!("<|reserved_token_{}|>", base + 8);
        assert_eq!(tok.special_id(&reserved), Some(base + 8));
    }
}

#[test]
fn specials_and_lookup() {
    let tok = load("toy");
    let open = tok.require_special("<|open|>").unwrap();
    assert!(tok.is_special(open));
    assert_eq!(tok.token_to_id("<|open|>"), Some(open));
    assert_eq!(tok.token_to_id("a"), Some(64));
    assert_eq!(tok.token_to_id("not a token at all"), None);
    assert_eq!(tok.id_to_bytes(64), Some(b"a".as_slice()));
    assert_eq!(tok.special_tokens().count(), 256);
    // Specials are only recognised by encode_with_specials.
    assert_eq!(tok.encode_with_specials("<|open|>"), [open]);
    assert_ne!(tok.encode("<|open|>"), [open]);

    let err = tok.require_special("<|im_end|>").unwrap_err();
    assert!(matches!(err, TextError::UnknownSpecial { .. }));
    assert_eq!(err.to_string(), "unknown special token \"<|im_end|>\"");

    let bad_id = tok.vocab_size() as u32;
    let err = tok.decode(&[64, bad_id]).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}

#[test]
fn decode_rejects_or_replaces_invalid_utf8() {
    let tok = load("toy");
    let ids = tok.encode("🙂");
    assert!(ids.len() > 1, "the toy vocabulary splits an emoji");
    assert!(matches!(
        tok.decode(&ids[..1]),
        Err(TextError::InvalidUtf8(_))
    ));
    assert_eq!(tok.decode_lossy(&ids[..1]).unwrap(), "\u{fffd}");
}

/// Strings with multi-byte characters split across tokens by the toy vocabulary.
const STREAM_TEXTS: [&str; 6] = [
    "naïve café 🙂 done",
    "你好，世界！",
    "👨\u{200d}👩\u{200d}👧\u{200d}👦 family",
    "Привет, мир! €100",
    "mixed English и русский 和日本語 🇺🇸",
    "ascii only, nothing fancy",
];

#[test]
fn stream_decoder_matches_whole_decode() {
    for name in ["toy", "cl100k"] {
        let tok = Arc::new(load(name));
        for text in STREAM_TEXTS {
            let ids = tok.encode(text);
            let mut decoder = StreamDecoder::new(Arc::clone(&tok));
            let mut streamed = String::new();
            for (k, &id) in ids.iter().enumerate() {
                streamed.push_str(&decoder.push(id).unwrap());
                // After each id, everything emitted is complete text and a prefix
                // of the whole decode, and at most one character is held back.
                let prefix_bytes = tok.decode_bytes(&ids[..=k]).unwrap();
                assert!(
                    text.starts_with(&streamed),
                    "{name}: {streamed:?} is not a prefix of {text:?}"
                );
                assert!(
                    prefix_bytes.len() - streamed.len() < 4,
                    "{name}: held back too much at {k}"
                );
            }
            streamed.push_str(&decoder.finish());
            assert_eq!(streamed, tok.decode(&ids).unwrap(), "{name}: {text:?}");
        }
    }
}

#[test]
fn utf8_buffer_every_split_point() {
    for text in STREAM_TEXTS {
        let bytes = text.as_bytes();
        for split in 0..=bytes.len() {
            let mut buffer = Utf8Buffer::new();
            let first = buffer.push(&bytes[..split]);
            assert!(text.starts_with(&first));
            let second = buffer.push(&bytes[split..]);
            assert!(buffer.is_empty());
            assert_eq!(first + &second + &buffer.finish(), text, "split at {split}");
        }
    }
    // Bytes that can never be UTF-8 are replaced at once rather than stalling.
    let mut buffer = Utf8Buffer::new();
    assert_eq!(buffer.push(b"a\xffb\xe4"), "a\u{fffd}b");
    assert_eq!(buffer.finish(), "\u{fffd}");
}

#[test]
fn round_trip_every_fixture_string() {
    for name in ["toy", "cl100k"] {
        let tok = load(name);
        for case in golden(name).cases {
            assert_eq!(
                tok.decode(&tok.encode(&case.text)).unwrap(),
                case.text,
                "{name}"
            );
            assert_eq!(
                tok.decode(&tok.encode_with_specials(&case.text)).unwrap(),
                case.text,
                "{name}"
            );
        }
    }
}

/// The linear-time pre-tokenizer (look-ahead emulated) against the reference
/// pattern run by a backtracking engine, on fixture strings and generated ones.
#[test]
fn pretokenizer_matches_reference_regex() {
    let reference = fancy_regex::Regex::new(&reference_pattern()).unwrap();
    let pre = PreTokenizer::new();
    let check = |text: &str| {
        let expected: Vec<&str> = reference
            .find_iter(text)
            .map(|m| m.unwrap().as_str())
            .collect();
        let actual: Vec<&str> = pre.pieces(text).collect();
        assert_eq!(actual, expected, "pieces of {text:?}");
    };
    for case in golden("toy").cases {
        check(&case.text);
    }
    // Characters from every class the pattern distinguishes.
    let alphabet: Vec<char> = " \t\n\r\u{a0}\u{3000}\u{2028}aBǅʰの中\u{301}1٣Ⅻ!'sStTlLdDmrv\"-_😀é"
        .chars()
        .collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..20_000 {
        let len = (next() % 24) as usize;
        let text: String = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        check(&text);
    }
}

/// A valid minimal vocabulary: the 256 single bytes, as tiktoken lines.
fn byte_lines() -> String {
    use base64::Engine as _;
    (0..=255u8)
        .map(|b| {
            format!(
                "{} {b}\n",
                base64::engine::general_purpose::STANDARD.encode([b])
            )
        })
        .collect()
}

const EMPTY_CONFIG: &str = r#"{"added_tokens_decoder": {}}"#;

/// Checks that loading `model`/`config` fails with a message containing `expected`.
fn check_load_error(model: &str, config: &str, expected: &str) {
    match Tokenizer::from_bytes(model.as_bytes(), config.as_bytes()) {
        Ok(_) => panic!("expected an error containing {expected:?}"),
        Err(e) => assert!(
            e.to_string().contains(expected),
            "error {:?} lacks {expected:?}",
            e.to_string()
        ),
    }
}

#[test]
fn malformed_files_give_clear_errors() {
    let bytes = byte_lines();
    // The minimal vocabulary itself loads, with reserved names for unnamed slots.
    let tok = Tokenizer::from_bytes(bytes.as_bytes(), EMPTY_CONFIG.as_bytes()).unwrap();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.special_id("<|reserved_token_256|>"), Some(256));

    check_load_error(
        &format!("{bytes}YWI=\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: missing rank",
    );
    check_load_error(
        &format!("{bytes}Y!!= 256\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: bad base64",
    );
    check_load_error(
        &format!("{bytes}YWI= x1\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: rank \"x1\" is not a non-negative integer",
    );
    check_load_error(
        &format!("{bytes}YWI= -3\n"),
        EMPTY_CONFIG,
        "is not a non-negative integer",
    );
    check_load_error(
        &format!("{bytes}YWI= 256 7\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: expected `base64 rank`",
    );
    check_load_error(
        &format!("{bytes}YWI= 12\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: duplicate rank 12 (first seen on line 13)",
    );
    check_load_error(
        &format!("{bytes}YQ== 256\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: duplicate token bytes (first seen on line 98)",
    );
    check_load_error(
        &format!("{bytes}YWI= 9999\n"),
        EMPTY_CONFIG,
        "tiktoken.model:257: rank 9999 is out of range",
    );
    let without_a: String = bytes
        .lines()
        .filter(|l| *l != "YQ== 97")
        .map(|l| format!("{l}\n"))
        .collect();
    check_load_error(
        &format!("{without_a}YWI= 97\n"),
        EMPTY_CONFIG,
        "no token for the single byte 0x61",
    );

    check_load_error(
        &bytes,
        "{not json",
        "tokenizer_config.json: invalid tokenizer config",
    );
    check_load_error(
        &bytes,
        r#"{"added_tokens_decoder": {"x": {"content": "[BOS]"}}}"#,
        "key \"x\" is not a token id",
    );
    check_load_error(
        &bytes,
        r#"{"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[BOS]"}}}"#,
        "special token name \"[BOS]\" is used by ids 256 and 257",
    );

    let missing = Tokenizer::from_dir(fixtures().join("no-such-model")).unwrap_err();
    assert!(
        missing.to_string().contains("no-such-model/tiktoken.model"),
        "{missing}"
    );
}

/// Long texts are cut where the reference cuts them: a run of more than 25,000
/// non-space (or space) characters, and every 400,000 characters.
#[test]
fn long_texts_are_sliced_like_the_reference() {
    let tok = load("toy");
    let joined = |parts: &[&str]| parts.iter().flat_map(|p| tok.encode(p)).collect::<Vec<_>>();
    let run = "ab".repeat(12_500);
    assert_eq!(tok.encode(&format!("{run}c")), joined(&[&run, "c"]));
    let words = "hello ".repeat(66_667); // 400,002 characters
    let (head, tail) = words.split_at(400_000);
    assert_eq!(tok.encode(&words), joined(&[head, tail]));
    assert_eq!(tok.encode_with_specials(&words), joined(&[head, tail]));
}

/// Encoding long pieces must stay fast (no quadratic merge): a megabyte of one
/// repeated letter, and of a two-letter pattern.
#[test]
fn long_pieces_are_not_quadratic() {
    let tok = load("cl100k");
    let long = "a".repeat(1 << 20);
    let start = std::time::Instant::now();
    let ids = tok.encode(&long);
    assert_eq!(tok.decode(&ids).unwrap(), long);
    let mixed: String = (0..(1 << 18))
        .map(|i| if i % 7 == 0 { 'Q' } else { 'x' })
        .collect();
    let ids = tok.encode(&mixed);
    assert_eq!(tok.decode(&ids).unwrap(), mixed);
    // Generous bound for an unoptimised debug build; quadratic would take minutes.
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
}
