//! The f32 forward pass against Moonshot's reference outputs on every fixture: full-sequence logits, decode-mode
//! logits, top-1 at every position, greedy tokens and mean NLL.

use std::path::Path;

use deltafin_runtime::{Engine, EngineOptions, GreedyOptions};
use deltafin_tests::{Golden, argmax, fixture, max_abs_diff, mean_nll};

/// Max |Δlogit| allowed against the reference.
const LOGIT_TOL: f32 = 5e-4;
/// Allowed |Δ mean NLL|.
const NLL_TOL: f64 = 1e-4;

fn open(dir: &Path) -> Engine {
    Engine::open(dir, EngineOptions::default()).expect("fixture opens")
}

/// Compares `[T, V]` logits row by row: tolerance and top-1.
fn check_logits(what: &str, ours: &[f32], reference: &[f32], vocab: usize) {
    assert_eq!(ours.len(), reference.len(), "{what}: shape");
    let diff = max_abs_diff(ours, reference);
    eprintln!("{what}: max |Δlogit| = {diff:.3e}");
    assert!(
        diff <= LOGIT_TOL,
        "{what}: max |Δlogit| {diff} > {LOGIT_TOL}"
    );
    for (t, (a, b)) in ours
        .chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .enumerate()
    {
        assert_eq!(
            argmax(a),
            argmax(b),
            "{what}: top-1 differs at position {t}"
        );
    }
}

/// Full forward in one prefill.
fn check_prefill(dir: &Path, ids_key: &str, logits_key: &str) -> Vec<f32> {
    let g = Golden::load(dir).expect("golden");
    let ids = g.ids(ids_key).expect("ids");
    let (shape, reference) = g.f32s(logits_key).expect("logits");
    let engine = open(dir);
    let logits = engine.session().prefill(&ids).expect("prefill");
    check_logits(
        &format!("{} prefill", dir.display()),
        &logits.data,
        &reference,
        shape[1],
    );
    logits.data
}

/// Prefill of the first `split` ids, then one id per step; compared with `logits_key`.
fn check_decode(dir: &Path, ids_key: &str, logits_key: &str, split: usize) {
    let g = Golden::load(dir).expect("golden");
    let ids = g.ids(ids_key).expect("ids");
    let (shape, reference) = g.f32s(logits_key).expect("logits");
    let engine = open(dir);
    let mut s = engine.session();
    let mut ours = Vec::with_capacity(reference.len());
    if split > 0 {
        ours.extend(s.prefill(&ids[..split]).expect("prefill").data);
    }
    for &id in &ids[split..] {
        ours.extend(s.step(id).expect("step"));
    }
    check_logits(
        &format!("{} decode", dir.display()),
        &ours,
        &reference,
        shape[1],
    );
}

/// Greedy tokens and the logits they were chosen from.
fn check_greedy(dir: &Path) {
    let g = Golden::load(dir).expect("golden");
    let prompt = g.ids("greedy_prompt").expect("prompt");
    let expect = g.ids("greedy_tokens").expect("tokens");
    let (shape, step_logits) = g.f32s("greedy_step_logits").expect("step logits");
    let engine = open(dir);
    let new = engine
        .session()
        .generate_greedy(
            &prompt,
            GreedyOptions {
                max_new: shape[0],
                ignore_eos: true,
            },
            |_| true,
        )
        .expect("generate");
    assert_eq!(
        new,
        expect[prompt.len()..],
        "{}: greedy tokens",
        dir.display()
    );
    // Re-run step by step to compare the logits each token was chosen from.
    let mut s = engine.session();
    let mut ours = s
        .prefill(&prompt)
        .expect("prefill")
        .row(prompt.len() - 1)
        .to_vec();
    for &id in &new[..new.len() - 1] {
        ours.extend(s.step(id).expect("step"));
    }
    check_logits(
        &format!("{} greedy steps", dir.display()),
        &ours,
        &step_logits,
        shape[1],
    );
}

fn check_k3(name: &str) {
    let dir = fixture(name);
    let g = Golden::load(&dir).expect("golden");
    let ids = g.ids("input_ids").expect("ids");
    let logits = check_prefill(&dir, "input_ids", "logits");
    let vocab = logits.len() / ids.len();
    let (_, nll) = g.f32s("nll").expect("nll");
    let ref_mean = nll.iter().map(|&x| x as f64).sum::<f64>() / nll.len() as f64;
    let ours = mean_nll(&logits, vocab, &ids);
    eprintln!("{name}: mean NLL {ours:.6} vs reference {ref_mean:.6}");
    assert!(
        (ours - ref_mean).abs() <= NLL_TOL,
        "{name}: mean NLL {ours} vs {ref_mean}"
    );
    check_decode(&dir, "input_ids", "decode_logits", ids.len() / 2);
    check_greedy(&dir);
}

fn check_kimi_linear(name: &str) {
    let dir = fixture(name);
    check_prefill(&dir, "input_ids", "logits");
    check_prefill(&dir, "input_ids_long", "logits_long");
    check_decode(&dir, "input_ids", "logits", 0);
    check_decode(&dir, "input_ids_long", "logits_long", 100);
    check_greedy(&dir);
}

#[test]
fn k3_tiny_a_matches_reference() {
    check_k3("k3/k3-tiny-a");
}

#[test]
fn k3_tiny_b_matches_reference() {
    check_k3("k3/k3-tiny-b");
}

#[test]
fn kimi_linear_qlora_matches_reference() {
    check_kimi_linear("kimi-linear/qlora");
}

#[test]
fn kimi_linear_noqlora_matches_reference() {
    check_kimi_linear("kimi-linear/noqlora");
}

/// Rows do not depend on how many tokens share a pass: prefill logits equal decode logits bit for bit. Speculation
/// and chunked prefill rely on this to be lossless.
#[test]
fn prefill_and_decode_are_bit_identical() {
    for name in ["k3/k3-tiny-b", "kimi-linear/qlora"] {
        let dir = fixture(name);
        let ids = Golden::load(&dir)
            .expect("golden")
            .ids("input_ids")
            .expect("ids");
        let engine = open(&dir);
        let whole = engine.session().prefill(&ids).expect("prefill").data;
        let mut s = engine.session();
        let mut stepped = s.prefill(&ids[..5]).expect("prefill").data;
        for &id in &ids[5..] {
            stepped.extend(s.step(id).expect("step"));
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&whole) == bits(&stepped),
            "{name}: prefill and decode logits differ"
        );
    }
}
