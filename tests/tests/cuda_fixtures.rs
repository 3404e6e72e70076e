//! CUDA against the CPU f32 path on every fixture (feature `cuda`; needs a GPU: run on the device machine, see
//! docs/PLATFORMS.md): full-prefill logits, decode-mode logits and greedy tokens.
#![cfg(feature = "cuda")]

use std::path::Path;

use deltafin_runtime::{DevicePref, Engine, EngineOptions, GreedyOptions};
use deltafin_tests::{Golden, fixture, max_abs_diff};

/// Max |Δlogit| allowed between CUDA and the CPU.
const TOL: f32 = 1e-3;

fn open(dir: &Path, pref: DevicePref) -> Engine {
    let e = Engine::open(dir, EngineOptions::default().with_device(pref)).expect("fixture opens");
    if pref == DevicePref::Cuda {
        assert!(e.device_name().starts_with("cuda"), "{}", e.device_name());
    }
    e
}

fn check(name: &str) {
    let dir = fixture(name);
    let g = Golden::load(&dir).expect("golden");
    let ids = g.ids("input_ids").expect("ids");
    let prompt = g.ids("greedy_prompt").expect("prompt");
    let cpu = open(&dir, DevicePref::Cpu);
    let gpu = open(&dir, DevicePref::Cuda);

    // Whole sequence (prefill in chunks of 64).
    let a = cpu.session().prefill(&ids).expect("cpu prefill").data;
    let b = gpu.session().prefill(&ids).expect("cuda prefill").data;
    let d = max_abs_diff(&a, &b);
    eprintln!(
        "{name}: prefill {} tokens, max |Δlogit| cuda vs cpu = {d:.3e}",
        ids.len()
    );
    assert!(d <= TOL, "{name}: prefill max |Δlogit| {d}");

    // Decode: half prefill, then one token per step.
    let split = ids.len() / 2;
    let decode = |e: &Engine| {
        let mut s = e.session();
        let mut out = s.prefill(&ids[..split]).expect("prefill").data;
        for &id in &ids[split..] {
            out.extend(s.step(id).expect("step"));
        }
        out
    };
    let d = max_abs_diff(&decode(&cpu), &decode(&gpu));
    eprintln!("{name}: decode max |Δlogit| cuda vs cpu = {d:.3e}");
    assert!(d <= TOL, "{name}: decode max |Δlogit| {d}");

    // Greedy tokens.
    let opts = GreedyOptions {
        max_new: 16,
        ignore_eos: true,
    };
    let ta = cpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cpu greedy");
    let tb = gpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cuda greedy");
    eprintln!("{name}: greedy {tb:?}");
    assert_eq!(ta, tb, "{name}: greedy tokens differ");
}

#[test]
fn k3_tiny_a_cuda_matches_cpu() {
    check("k3/k3-tiny-a");
}

#[test]
fn k3_tiny_b_cuda_matches_cpu() {
    check("k3/k3-tiny-b");
}

#[test]
fn kimi_linear_qlora_cuda_matches_cpu() {
    check("kimi-linear/qlora");
}

#[test]
fn kimi_linear_noqlora_cuda_matches_cpu() {
    check("kimi-linear/noqlora");
}
