//! `K3_EXPERT_INPUT=bf16`: routed experts read their inputs rounded to bf16 (the reference's native cast). It is a
//! faster path, so it is held against its plain twin, the exact f32 path, on every fixture: close (stated
//! tolerances below), not identical, and with prefill and decode still bit-identical to each other.
//!
//! The tolerances are on NLL and top-1 agreement, as the fixtures' notes advise for a bf16 path: these random
//! tiny models have router near-ties, so a 2^-9 relative change in an expert's input can flip a later layer's
//! expert choice and move logits by far more than the rounding (k3-tiny-b: max |Δlogit| 2.7 with 104 of 130
//! top-1s kept). The kernels themselves are held bit for bit to their scalar twin in `crates/quant`.

use deltafin_model::ExpertInput;
use deltafin_runtime::{Engine, EngineOptions};
use deltafin_tests::{Golden, argmax, fixture, max_abs_diff, mean_nll};

/// Largest |ΔNLL| allowed against the f32 path, in nats per token.
const NLL_TOL: f64 = 2e-2;
/// Smallest share of positions whose top-1 token agrees with the f32 path.
const TOP1_AGREEMENT: f64 = 0.75;

fn open(name: &str, input: ExpertInput) -> Engine {
    Engine::open(
        &fixture(name),
        EngineOptions::default().with_expert_input(input),
    )
    .expect("fixture opens")
}

#[test]
fn bf16_expert_inputs_are_close_to_the_f32_path() {
    close_to_the_f32_path(ExpertInput::Bf16, NLL_TOL, TOP1_AGREEMENT);
}

#[test]
fn i16_expert_inputs_are_close_to_the_f32_path() {
    close_to_the_f32_path(ExpertInput::I16, 1e-4, 1.0);
}

/// Holds `input` against the f32 path on every fixture: |ΔNLL| at most `nll_tol`, at least `top1` of the top-1 tokens
/// kept, and prefill equal to decode.
fn close_to_the_f32_path(input: ExpertInput, nll_tol: f64, top1: f64) {
    for name in [
        "k3/k3-tiny-a",
        "k3/k3-tiny-b",
        "kimi-linear/qlora",
        "kimi-linear/noqlora",
    ] {
        let g = Golden::load(&fixture(name)).expect("golden");
        let ids = g.ids("input_ids").expect("ids");
        let exact = open(name, ExpertInput::F32)
            .session()
            .prefill(&ids)
            .expect("prefill")
            .data;
        let bf16_engine = open(name, input);
        let bf16 = bf16_engine.session().prefill(&ids).expect("prefill").data;
        let vocab = exact.len() / ids.len();
        let diff = max_abs_diff(&bf16, &exact);
        let d_nll = (mean_nll(&bf16, vocab, &ids) - mean_nll(&exact, vocab, &ids)).abs();
        let agree = exact
            .chunks_exact(vocab)
            .zip(bf16.chunks_exact(vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        let scale = exact.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        eprintln!(
            "{name}: {input} expert inputs: max |Δlogit| {diff:.3e} (max |logit| {scale:.2}), ΔNLL {d_nll:.2e}, top-1 agreement {agree}/{}",
            ids.len()
        );
        assert!(diff > 0.0, "{name}: the {input} mode changed nothing");
        assert!(d_nll <= nll_tol, "{name}: ΔNLL {d_nll}");
        assert!(
            agree as f64 >= top1 * ids.len() as f64,
            "{name}: top-1 agreement {agree}/{}",
            ids.len()
        );

        // The bf16 kernels are batch-invariant like the f32 ones: one token at a time gives the same logits.
        let mut session = bf16_engine.session();
        let stepped: Vec<f32> = ids
            .iter()
            .flat_map(|&id| session.step(id).expect("step"))
            .collect();
        assert_eq!(stepped, bf16, "{name}: decode differs from prefill");
    }
}

#[test]
fn expert_input_setting_parses_and_rejects() {
    assert_eq!("bf16".parse::<ExpertInput>(), Ok(ExpertInput::Bf16));
    assert_eq!(" F32 ".parse::<ExpertInput>(), Ok(ExpertInput::F32));
    let err = "fp8".parse::<ExpertInput>().expect_err("unknown");
    assert!(err.contains("f32, bf16 or i16"), "{err}");
}
