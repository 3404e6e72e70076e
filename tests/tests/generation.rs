//! Generation: lossless speculation, rollback of rejected drafts, chunked prefill, expert reads per chunk,
//! snapshots and sampling, on the fixtures and on a synthetic model.

use std::path::{Path, PathBuf};

use deltafin_runtime::{
    Engine, EngineOptions, FinishReason, GenerateOptions, SamplingParams, Session,
};
use deltafin_tests::{Golden, fixture, max_abs_diff};

fn open_with_chunk(dir: &Path, chunk: usize) -> Engine {
    Engine::open(dir, EngineOptions::default().with_prefill_chunk(chunk)).expect("open")
}

/// A synthetic model written once per test binary run into a temporary directory.
fn synthetic(preset: &'static str) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static DIRS: OnceLock<Mutex<HashMap<&'static str, tempfile::TempDir>>> = OnceLock::new();
    let mut dirs = DIRS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .expect("lock");
    let tmp = dirs.entry(preset).or_insert_with(|| {
        let tmp = tempfile::tempdir().expect("tmp");
        let p = deltafin_synth::preset(preset).expect("preset");
        deltafin_synth::write_model(&p, tmp.path()).expect("write synthetic model");
        tmp
    });
    tmp.path().to_path_buf()
}

fn synthetic_demo() -> PathBuf {
    synthetic("demo")
}

/// The cyclic demo model continues 0 1 2 … 7 0 1 … (cycles of 8 ids): repetitive text.
fn synthetic_cyclic() -> PathBuf {
    synthetic("demo-cyclic")
}

/// A prompt that repeats itself.
fn repetitive_prompt() -> Vec<u32> {
    let phrase = [1u32, 40, 41, 42, 43, 44, 45, 46];
    phrase.iter().cycle().take(40).copied().collect()
}

/// For the cyclic model: "… 3 4 5 9 …" earlier in the prompt makes the drafter propose 9 after "4 5", which the
/// model (continuing 4 5 6 7) rejects; later drafts from its own cycles are accepted.
fn misleading_prompt() -> Vec<u32> {
    vec![1, 2, 3, 4, 5, 9, 1, 2, 3]
}

fn greedy(session: &mut Session<'_>, prompt: &[u32], depth: usize, n: usize) -> Vec<u32> {
    session
        .generate(
            prompt,
            &GenerateOptions {
                max_new: n,
                ignore_eos: true,
                speculation_depth: depth,
                ..GenerateOptions::default()
            },
            |_| true,
        )
        .expect("generate")
        .tokens
}

fn model_dirs() -> Vec<PathBuf> {
    vec![
        fixture("k3/k3-tiny-a"),
        fixture("k3/k3-tiny-b"),
        fixture("kimi-linear/qlora"),
        synthetic_demo(),
        synthetic_cyclic(),
    ]
}

#[test]
fn speculation_gives_the_same_tokens_as_plain_greedy() {
    for dir in model_dirs() {
        let engine = open_with_chunk(&dir, 64);
        let mut prompts = vec![repetitive_prompt(), misleading_prompt()];
        if let Ok(p) = Golden::load(&dir).and_then(|g| g.ids("greedy_prompt")) {
            prompts.push(p);
        }
        for prompt in prompts {
            let plain = greedy(&mut engine.session(), &prompt, 0, 32);
            for depth in [1, 3] {
                let mut s = engine.session();
                let spec = greedy(&mut s, &prompt, depth, 32);
                assert_eq!(spec, plain, "{}: depth {depth}", dir.display());
            }
        }
    }
    // On repetitive text drafts are accepted and rejected, and passes drop.
    let engine = open_with_chunk(&synthetic_cyclic(), 64);
    let mut rejected = 0;
    for depth in [1, 3] {
        let mut s = engine.session();
        greedy(&mut s, &misleading_prompt(), depth, 32);
        let st = s.stats();
        assert!(st.accepted > 0, "depth {depth}: nothing accepted: {st:?}");
        assert!(
            st.decode_passes < 31,
            "depth {depth}: speculation saved no pass: {st:?}"
        );
        rejected += st.drafted - st.accepted;
    }
    assert!(rejected > 0, "no draft was rejected");
    {}
}

/// After generating with speculation (some drafts rejected), flushing the session gives exactly the state of a
/// session that fed the same tokens one at a time and never saw a draft.
#[test]
fn rejected_drafts_leave_no_trace_in_the_state() {
    let dir = synthetic_cyclic();
    let engine = open_with_chunk(&dir, 64);
    let tmp = tempfile::tempdir().expect("tmp");
    let mut rejected_seen = false;
    for depth in [1, 3] {
        let mut spec = engine.session();
        greedy(&mut spec, &misleading_prompt(), depth, 24);
        let st = spec.stats().clone();
        rejected_seen |= st.drafted > st.accepted;
        spec.flush().expect("flush");
        let mut plain = engine.session();
        for &t in spec.tokens() {
            plain.step(t).expect("step");
        }
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        spec.save_snapshot(&a).expect("save");
        plain.save_snapshot(&b).expect("save");
        assert!(
            std::fs::read(&a).expect("read") == std::fs::read(&b).expect("read"),
            "depth {depth}: states differ"
        );
    }
    assert!(
        rejected_seen,
        "no draft was rejected: the test did not exercise rollback"
    );
}

#[test]
fn chunked_prefill_matches_token_by_token() {
    for dir in [fixture("k3/k3-tiny-b"), synthetic_demo()] {
        let ids: Vec<u32> = (0..100u32).map(|i| 1 + (i * 37 % 500)).collect();
        let ids: Vec<u32> = if dir.ends_with("k3-tiny-b") {
            Golden::load(&dir)
                .expect("golden")
                .ids("input_ids")
                .expect("ids")
        } else {
            ids
        };
        let chunked = open_with_chunk(&dir, 16)
            .session()
            .prefill(&ids)
            .expect("prefill")
            .data;
        let engine = open_with_chunk(&dir, 1);
        let mut s = engine.session();
        let stepped: Vec<f32> = ids.iter().flat_map(|&t| s.step(t).expect("step")).collect();
        let diff = max_abs_diff(&chunked, &stepped);
        assert!(
            diff <= 1e-4,
            "{}: chunked vs token-by-token {diff}",
            dir.display()
        );
        let a = greedy(&mut open_with_chunk(&dir, 16).session(), &ids, 0, 8);
        let b = greedy(&mut engine.session(), &ids, 0, 8);
        assert_eq!(a, b);
    }
}

#[test]
fn a_chunk_reads_each_selected_expert_once_per_layer() {
    let dir = synthetic_demo();
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 13 + 7) % 800).collect();
    let chunked = open_with_chunk(&dir, 64);
    chunked.session().prefill(&prompt).expect("prefill");
    let per_token = open_with_chunk(&dir, 1);
    per_token.session().prefill(&prompt).expect("prefill");
    let (c, t) = (chunked.expert_reads(), per_token.expert_reads());
    let n_layers = chunked.config().n_layers;
    for l in 1..n_layers {
        assert!(!c.distinct[l].is_empty(), "layer {l} read no experts");
        assert_eq!(
            c.reads[l],
            c.distinct[l].len() as u64,
            "layer {l}: an expert was read twice"
        );
        // The same experts are selected whether tokens come one by one or as a chunk.
        assert_eq!(
            c.distinct[l], t.distinct[l],
            "layer {l}: different selections"
        );
    }
    assert!(c.total_reads() < t.total_reads());
}

#[test]
fn snapshot_files_are_checked() {
    let dir = synthetic_demo();
    let engine = open_with_chunk(&dir, 64);
    let mut s = engine.session();
    greedy(&mut s, &repetitive_prompt(), 0, 4);
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("snap");
    s.save_snapshot(&path).expect("save");
    let mut restored = engine.session();
    restored.load_snapshot(&path).expect("load");
    assert_eq!(restored.tokens(), s.tokens());
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 10]).expect("truncate");
    let err = engine
        .session()
        .load_snapshot(&path)
        .expect_err("truncated");
    assert!(err.to_string().contains("truncated"), "{err}");
    let mut flipped = bytes.clone();
    let at = flipped.len() - 5;
    flipped[at] ^= 0x40;
    std::fs::write(&path, &flipped).expect("write");
    let err = engine.session().load_snapshot(&path).expect_err("corrupt");
    assert!(err.to_string().contains("checksum"), "{err}");
    std::fs::write(&path, b"hello").expect("write");
    assert!(engine.session().load_snapshot(&path).is_err());
    // A snapshot of another model is refused.
    let other = open_with_chunk(&fixture("k3/k3-tiny-a"), 64);
    std::fs::write(&path, &bytes).expect("write");
    let err = other
        .session()
        .load_snapshot(&path)
        .expect_err("other model");
    assert!(err.to_string().contains("different model"), "{err}");
}

#[test]
fn prefix_reuse_feeds_only_new_tokens_and_changes_nothing() {
    let dir = fixture("k3/k3-tiny-b");
    let engine = open_with_chunk(&dir, 64);
    let first: Vec<u32> = repetitive_prompt();
    let mut s = engine.session();
    let g1 = greedy(&mut s, &first, 0, 5);
    let mut second = first.clone();
    second.extend(&g1);
    second.extend([60u32, 61, 62]);
    let fed_before = s.stats().tokens_fed;
    let new = s.reuse_prefix(&second).to_vec();
    assert_eq!(new, vec![60, 61, 62]);
    let reused = greedy(&mut s, &new, 0, 6);
    // Only the new tokens and the pending last generated one were fed in the first pass.
    assert!(s.stats().tokens_fed - fed_before <= 4 + 6);
    let fresh = greedy(&mut engine.session(), &second, 0, 6);
    assert_eq!(reused, fresh);
    // A sequence that does not extend the session starts over.
    let mut s2 = engine.session();
    greedy(&mut s2, &first, 0, 2);
    assert_eq!(s2.reuse_prefix(&[1, 2, 3]).len(), 3);
    assert_eq!(s2.tokens().len(), 0);
}

#[test]
fn sampling_is_reproducible_and_eos_stops() {
    let engine = open_with_chunk(&fixture("k3/k3-tiny-a"), 64);
    let opts = |seed| GenerateOptions {
        max_new: 20,
        sampling: SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 50,
            seed,
        },
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    let run = |seed| {
        engine
            .session()
            .generate(&[556, 10, 20], &opts(seed), |_| true)
            .expect("generate")
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7).tokens, run(8).tokens);
    assert_eq!(run(7).finish, FinishReason::Length);
    // A stop token ends generation and is reported.
    let first = run(7).tokens[3];
    let g = engine
        .session()
        .generate(
            &[556, 10, 20],
            &GenerateOptions {
                stop_tokens: vec![first],
                ..opts(7)
            },
            |_| true,
        )
        .expect("generate");
    assert_eq!(g.finish, FinishReason::Stop);
    assert_eq!(*g.tokens.last().expect("a token"), first);
    // A callback returning false cancels.
    let g = engine
        .session()
        .generate(&[556, 10, 20], &opts(7), |_| false)
        .expect("generate");
    assert_eq!((g.tokens.len(), g.finish), (1, FinishReason::Cancelled));
}

#[test]
fn a_session_stops_at_its_reserved_context_and_stays_usable() {
    let dir = fixture("k3/k3-tiny-a");
    let options = EngineOptions {
        context: 6,
        ..EngineOptions::default()
    };
    let engine = Engine::open(&dir, options).expect("open");
    let mut s = engine.session();
    s.prefill(&[1, 2, 3, 4]).expect("four tokens fit");
    let err = s
        .prefill(&[5, 6, 7])
        .expect_err("seven tokens do not fit in six");
    assert!(err.to_string().contains("K3_CONTEXT"), "{err}");
    // The failed call fed nothing: two more tokens still fit, and give what a fresh session gives.
    let logits = s.prefill(&[5, 6]).expect("six tokens fit").data;
    let fresh = engine
        .session()
        .prefill(&[1, 2, 3, 4, 5, 6])
        .expect("fresh")
        .data;
    let vocab = engine.config().vocab_size;
    assert_eq!(logits[vocab..], fresh[5 * vocab..]);
}

/// Allows only ids divisible by 7 and records what it was told.
struct Sevens(Vec<u32>);

impl deltafin_runtime::TokenMask for Sevens {
    fn restrict(&mut self, logits: &mut [f32]) -> Result<(), String> {
        for (i, v) in logits.iter_mut().enumerate() {
            if i % 7 != 0 {
                *v = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn accept(&mut self, id: u32) -> Result<(), String> {
        self.0.push(id);
        Ok(())
    }
}

#[test]
fn a_token_mask_restricts_every_choice_and_rows_are_the_prefill_rows() {
    let engine = open_with_chunk(&fixture("k3/k3-tiny-a"), 64);
    let prompt = [556u32, 10, 20, 30];
    for temperature in [0.0, 0.9] {
        let opts = GenerateOptions {
            max_new: 24,
            sampling: SamplingParams {
                temperature,
                seed: 3,
                ..SamplingParams::default()
            },
            ignore_eos: true,
            speculation_depth: 2,
            ..GenerateOptions::default()
        };
        let mut mask = Sevens(Vec::new());
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut session = engine.session();
        let g = session
            .generate_with(&prompt, &opts, Some(&mut mask), |_, row| {
                rows.push(row.to_vec());
                true
            })
            .expect("generate");
        assert_eq!(g.tokens.len(), 24);
        assert!(g.tokens.iter().all(|t| t % 7 == 0), "{:?}", g.tokens);
        assert_eq!(mask.0, g.tokens, "the mask is told every token");
        // Speculation is off under a mask.
        assert_eq!(session.stats().drafted, 0);
        // Each row is the unmasked row prefill gives at that position (what `deltafin nll` scores).
        let mut all = prompt.to_vec();
        all.extend_from_slice(&g.tokens);
        let reference = engine.session().prefill(&all).expect("prefill");
        for (i, row) in rows.iter().enumerate() {
            let want = reference.row(prompt.len() - 1 + i);
            assert!(max_abs_diff(row, want) <= 1e-5, "row {i}");
            assert!(row.iter().all(|v| v.is_finite()));
        }
        // Without the mask, greedy picks ids the mask forbids (the mask did something).
        if temperature == 0.0 {
            let free = greedy(&mut engine.session(), &prompt, 0, 24);
            assert!(free.iter().any(|t| t % 7 != 0), "{free:?}");
        }
    }
}

/// Layer-major prefill: a whole prompt in one pass (`K3_PREFILL_CHUNK=auto` gives the demo models passes far longer
/// than these prompts) ends in the same bits as feeding it token by token, at lengths that fill no chunk evenly;
/// each selected expert is read once per layer for the whole prompt; and generation after it, with and without
/// speculation, gives the same tokens.
#[test]
fn a_whole_prompt_in_one_pass_is_bit_identical_to_token_by_token() {
    for dir in [fixture("k3/k3-tiny-b"), synthetic_demo()] {
        let auto = Engine::open(&dir, EngineOptions::default()).expect("open");
        let stepwise = open_with_chunk(&dir, 1);
        assert!(
            auto.prefill_chunk() >= 300,
            "{}: {}",
            dir.display(),
            auto.prefill_chunk()
        );
        // 300: nine whole MLA query blocks of 32 and a part of one.
        for len in [1usize, 5, 64, 97, 130, 300] {
            let prompt: Vec<u32> = (0..len as u32).map(|i| 1 + (i * 37 + 11) % 500).collect();
            auto.reset_expert_reads();
            let mut one = auto.session();
            let last = one.prefill_last(&prompt).expect("prefill");
            assert_eq!(one.stats().passes, 1, "len {len}: one pass");
            let reads = auto.expert_reads();
            for (l, d) in reads.distinct.iter().enumerate() {
                assert_eq!(
                    reads.reads[l],
                    d.len() as u64,
                    "len {len}, layer {l}: read twice"
                );
            }
            let mut steps = stepwise.session();
            let mut stepped = Vec::new();
            for &t in &prompt {
                stepped = steps.step(t).expect("step");
            }
            assert_eq!(last.len(), stepped.len());
            for (a, b) in last.iter().zip(&stepped) {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{} len {len}: {a} vs {b}",
                    dir.display()
                );
            }
            assert_eq!(
                state_bits(one.state()),
                state_bits(steps.state()),
                "{} len {len}: states differ",
                dir.display()
            );
            let plain = greedy(&mut stepwise.session(), &prompt, 0, 6);
            let speculative = greedy(&mut auto.session(), &prompt, 4, 6);
            assert_eq!(plain, speculative, "{} len {len}", dir.display());
        }
    }
}

/// The bits of every value of a session state, layer by layer: KDA conv windows and recurrent states, MLA cache rows
/// (however the cache groups them into blocks).
fn state_bits(state: &deltafin_model::SessionState) -> Vec<u32> {
    use deltafin_model::state::LayerState;
    let mut bits = Vec::new();
    for layer in &state.layers {
        match layer {
            LayerState::Kda(k) => {
                for v in k
                    .conv()
                    .expect("kda windows")
                    .iter()
                    .flatten()
                    .chain(k.s().expect("kda state"))
                {
                    bits.push(v.to_bits());
                }
            }
            LayerState::Mla(c) => {
                for v in c.rows().flatten() {
                    bits.push(v.to_bits());
                }
            }
        }
    }
    bits
}
