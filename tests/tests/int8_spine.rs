//! The row-wise int8 spine copy: conversion on disk, selection with `K3_SPINE`, and its accuracy against the
//! exact path. With the copy present but int8 off, tokens are bit-identical to the foundation path.

use deltafin_runtime::{Engine, EngineOptions, GenerateOptions, SpineMode, convert_spine_int8};
use deltafin_tests::corrupt::ScratchModel;
use deltafin_tests::{Golden, argmax, fixture, mean_nll};

fn open(dir: &std::path::Path, mode: SpineMode) -> Engine {
    Engine::open(dir, EngineOptions::default().with_spine(mode)).expect("open")
}

#[test]
fn int8_spine_is_close_and_bf16_stays_exact() {
    for name in ["k3/k3-tiny-a", "k3/k3-tiny-b"] {
        let m = ScratchModel::copy_of(&fixture(name)).expect("copy");
        let reference = open(&m.dir, SpineMode::Bf16);
        let g = Golden::load(&m.dir).expect("golden");
        let ids = g.ids("input_ids").expect("ids");
        let exact = reference.session().prefill(&ids).expect("prefill").data;

        let report = convert_spine_int8(&m.dir).expect("convert");
        assert!(
            report.tensors > 0 && report.bytes_out < report.bytes_in,
            "{report:?}"
        );

        // int8 off: identical logits to the engine opened before the copy existed.
        let bf16 = open(&m.dir, SpineMode::Bf16);
        assert!(!bf16.spine_is_int8());
        assert_eq!(bf16.session().prefill(&ids).expect("prefill").data, exact);
        let greedy = |e: &Engine| {
            e.session()
                .generate(
                    &ids[..8],
                    &GenerateOptions {
                        max_new: 12,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    |_| true,
                )
                .expect("generate")
                .tokens
        };
        assert_eq!(greedy(&bf16), greedy(&reference));

        // int8 on: close, not exact.
        let int8 = open(&m.dir, SpineMode::Int8);
        assert!(int8.spine_is_int8());
        let approx = int8.session().prefill(&ids).expect("prefill").data;
        assert_ne!(approx, exact);
        let vocab = exact.len() / ids.len();
        let d_nll = (mean_nll(&approx, vocab, &ids) - mean_nll(&exact, vocab, &ids)).abs();
        let agree = exact
            .chunks_exact(vocab)
            .zip(approx.chunks_exact(vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count() as f64
            / ids.len() as f64;
        eprintln!("{name}: int8 spine ΔNLL {d_nll:.5}, top-1 agreement {agree:.3}");
        assert!(d_nll < 0.05, "{name}: ΔNLL {d_nll}");
        // Random tiny models have near-flat logits (top-1/top-2 gaps of 1e-3), so rounding flips many top-1s;
        // far above chance (1/vocab) all the same. Real K3 logits have wide margins.
        assert!(agree >= 0.3, "{name}: top-1 agreement {agree}");
    }
}

#[test]
fn int8_requested_without_a_copy_is_a_clear_error() {
    let err = Engine::open(
        &fixture("k3/k3-tiny-a"),
        EngineOptions::default().with_spine(SpineMode::Int8),
    )
    .expect_err("no copy");
    assert!(err.to_string().contains("convert-spine-int8"), "{err}");
    assert!(SpineMode::parse("fp8").is_err());
}
