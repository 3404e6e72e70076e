//! The `deltafin` binary's stable command forms, run as a user would, against the fixtures' reference outputs.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn golden(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).expect("golden.json");
    serde_json::from_str(&text).expect("golden JSON")
}

fn ids_of(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

fn join(ids: &[u64]) -> String {
    ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// Runs the binary and parses its stdout as one JSON object.
fn deltafin_json(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .env(
            "DELTAFIN_ROOT",
            std::env::temp_dir().join("deltafin-cli-test-root"),
        )
        .output()
        .expect("run deltafin");
    assert!(
        out.status.success(),
        "deltafin {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn check_nll(mode: &str) {
    let g = golden("k3/k3-tiny-b");
    let ids = ids_of(&g["input_ids"]);
    let dir = fixture("k3/k3-tiny-b");
    let r = deltafin_json(&[
        "nll",
        "--model",
        dir.to_str().expect("utf-8 path"),
        "--ids",
        &join(&ids),
        "--mode",
        mode,
        "--json",
    ]);
    assert_eq!(r["n_tokens"].as_u64(), Some(ids.len() as u64));
    assert_eq!(r["nll"].as_array().expect("nll").len(), ids.len() - 1);
    let mean = r["mean_nll"].as_f64().expect("mean");
    let expect = g["mean_nll"].as_f64().expect("golden mean");
    assert!(
        (mean - expect).abs() <= 1e-4,
        "{mode}: mean NLL {mean} vs {expect}"
    );
    let top5 = r["top5"].as_array().expect("top5");
    let gold5 = g["top5_ids"].as_array().expect("golden top5");
    assert_eq!(top5.len(), gold5.len());
    for (t, (a, b)) in top5.iter().zip(gold5).enumerate() {
        assert_eq!(a[0], b[0], "{mode}: top-1 at position {t}");
    }
    assert_eq!(r["top5_logits"][0].as_array().map(Vec::len), Some(5));
}

#[test]
fn nll_prefill_matches_reference() {
    check_nll("prefill");
}

#[test]
fn nll_decode_matches_reference() {
    check_nll("decode");
}

#[test]
fn run_prompt_ids_gives_reference_greedy_tokens() {
    for name in ["k3/k3-tiny-a", "k3/k3-tiny-b"] {
        let g = golden(name);
        let prompt = ids_of(&g["greedy_prompt"]);
        let expect = ids_of(&g["greedy_new_tokens"]);
        let dir = fixture(name);
        let r = deltafin_json(&[
            "run",
            "--model",
            dir.to_str().expect("utf-8 path"),
            "--prompt-ids",
            &join(&prompt),
            "--max-new",
            &expect.len().to_string(),
            "--ignore-eos",
            "--json",
        ]);
        assert_eq!(ids_of(&r["prompt_ids"]), prompt, "{name}");
        assert_eq!(ids_of(&r["new_ids"]), expect, "{name}");
    }
}

#[test]
fn run_without_a_model_uses_the_demo_and_says_so() {
    let root = tempfile::tempdir().expect("tmp");
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(["run", "--max-new", "4", "--ignore-eos", "--json"])
        .env("DELTAFIN_ROOT", root.path())
        .output()
        .expect("run deltafin");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("demo model"), "stderr: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // The demo is k3-tiny-a and its default prompt is that fixture's greedy prompt.
    let g = golden("k3/k3-tiny-a");
    assert_eq!(ids_of(&r["prompt_ids"]), ids_of(&g["greedy_prompt"]));
    assert_eq!(ids_of(&r["new_ids"]), ids_of(&g["greedy_new_tokens"])[..4]);
}

/// Runs `deltafin args`, which must fail without a panic, and gives its stderr.
fn failure_message(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .expect("run deltafin");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{args:?} succeeded; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
    stderr
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let stderr = failure_message(&[
        "nll",
        "--model",
        "/nonexistent/model",
        "--ids",
        "1,2",
        "--json",
    ]);
    assert!(stderr.contains("/nonexistent/model"), "stderr: {stderr}");
}

/// `bench-decode --hbm-mib` in a build without CUDA says so before it opens anything.
#[cfg(not(feature = "cuda"))]
#[test]
fn hbm_probe_needs_cuda() {
    let stderr = failure_message(&[
        "bench-decode",
        "--model",
        "/nonexistent/model",
        "--membw-gib",
        "0",
        "--hbm-mib",
        "64",
    ]);
    assert!(
        stderr.contains("--hbm-mib needs a build with the `cuda` feature"),
        "stderr: {stderr}"
    );
}

/// A snapshot saved by one process and loaded by another continues exactly like an uninterrupted run.
#[test]
fn snapshot_continues_in_a_new_process() {
    let g = golden("k3/k3-tiny-b");
    let prompt = ids_of(&g["greedy_prompt"]);
    let dir = fixture("k3/k3-tiny-b");
    let model = dir.to_str().expect("utf-8 path");
    let tmp = tempfile::tempdir().expect("tmp");
    let snap = tmp.path().join("prefix.snap");
    let snap_s = snap.to_str().expect("utf-8 path");
    let first = deltafin_json(&[
        "run",
        "--model",
        model,
        "--prompt-ids",
        &join(&prompt),
        "--max-new",
        "4",
        "--ignore-eos",
        "--json",
        "--save-snapshot",
        snap_s,
    ]);
    let gen1 = ids_of(&first["new_ids"]);
    let more = [17u64, 18, 19];
    let resumed = deltafin_json(&[
        "run",
        "--model",
        model,
        "--prompt-ids",
        &join(&more),
        "--max-new",
        "6",
        "--ignore-eos",
        "--json",
        "--load-snapshot",
        snap_s,
    ]);
    let mut whole = prompt.clone();
    whole.extend(&gen1);
    whole.extend(more);
    let straight = deltafin_json(&[
        "run",
        "--model",
        model,
        "--prompt-ids",
        &join(&whole),
        "--max-new",
        "6",
        "--ignore-eos",
        "--json",
    ]);
    assert_eq!(ids_of(&resumed["new_ids"]), ids_of(&straight["new_ids"]));
}

/// `run --prompt TEXT` encodes with the model's tokenizer, and `--chat` renders K3's chat format: the prompt ids
/// equal what `tokenize` gives for the same input.
#[test]
fn run_takes_text_and_chat_prompts() {
    let dir = fixture("k3/k3-tiny-a");
    let model = dir.to_str().expect("utf-8 path");
    let plain = deltafin_json(&[
        "run",
        "--model",
        model,
        "--prompt",
        "hello world",
        "--max-new",
        "3",
        "--json",
    ]);
    let tok = deltafin_json(&[
        "tokenize",
        "--model",
        model,
        "--text",
        "hello world",
        "--json",
    ]);
    assert_eq!(plain["prompt_ids"], tok["ids"]);
    let tmp = tempfile::tempdir().expect("tmp");
    let chat_file = tmp.path().join("chat.json");
    std::fs::write(&chat_file, r#"[{"role": "user", "content": "hello"}]"#).expect("write");
    let chat = deltafin_json(&[
        "run",
        "--model",
        model,
        "--prompt",
        "hello",
        "--chat",
        "--max-new",
        "3",
        "--json",
    ]);
    let rendered = deltafin_json(&[
        "tokenize",
        "--model",
        model,
        "--chat-file",
        chat_file.to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(chat["prompt_ids"], rendered["ids"]);
    // Text output mode prints something and exits cleanly.
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "run",
            "--model",
            model,
            "--prompt",
            "hello",
            "--chat",
            "--max-new",
            "8",
        ])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[thinking]"), "{text}");
    // Piped output carries no colour: no ANSI escapes on stdout or in the log.
    assert!(!text.contains('\x1b'), "escapes in piped stdout: {text:?}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains('\x1b'),
        "escapes in piped stderr"
    );
}

/// `--spec off` and `--spec on --spec-depth 3` parse and give the same greedy tokens.
#[test]
fn speculation_flag_takes_on_and_off() {
    let dir = fixture("k3/k3-tiny-a");
    let model = dir.to_str().expect("utf-8 path");
    let base = [
        "run",
        "--model",
        model,
        "--prompt-ids",
        "1,2,3,1,2,3",
        "--max-new",
        "12",
        "--ignore-eos",
        "--json",
    ];
    let off = deltafin_json(&[&base[..], &["--spec", "off"]].concat());
    let on = deltafin_json(&[&base[..], &["--spec", "on", "--spec-depth", "3"]].concat());
    assert_eq!(off["new_ids"], on["new_ids"]);
}

/// `--pin-layers none` streams every layer and still gives the reference greedy tokens; `--stats` reports the
/// streamed spine; a bad `K3_PIN_LAYERS` is a clear error.
#[test]
fn pin_layers_streams_the_spine_and_rejects_bad_values() {
    let g = golden("k3/k3-tiny-a");
    let prompt = ids_of(&g["greedy_prompt"]);
    let expect = ids_of(&g["greedy_new_tokens"]);
    let dir = fixture("k3/k3-tiny-a");
    let model = dir.to_str().expect("utf-8 path");
    let (ids, max_new) = (join(&prompt), expect.len().to_string());
    let args = [
        "run",
        "--model",
        model,
        "--prompt-ids",
        &ids,
        "--max-new",
        &max_new,
        "--ignore-eos",
        "--json",
        "--stats",
        "--pin-layers",
        "none",
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .expect("run deltafin");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(ids_of(&r["new_ids"]), expect);
    assert!(stderr.contains("layers streamed"), "stderr: {stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(["nll", "--model", model, "--ids", "1,2,3", "--json"])
        .env("K3_PIN_LAYERS", "0-2,x")
        .output()
        .expect("run deltafin");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("K3_PIN_LAYERS"), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
}

/// `--expert-input bf16` reaches the engine: `--stats` names it and `nll` scores change but stay close to the f32
/// default; a bad `K3_EXPERT_INPUT` is a clear error.
#[test]
fn expert_input_flag_reaches_the_engine() {
    let dir = fixture("k3/k3-tiny-a");
    let model = dir.to_str().expect("utf-8 path");
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "run",
            "--model",
            model,
            "--prompt-ids",
            "1,2,3",
            "--max-new",
            "2",
            "--ignore-eos",
            "--json",
            "--stats",
            "--expert-input",
            "bf16",
        ])
        .output()
        .expect("run deltafin");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(stderr.contains("expert inputs bf16"), "stderr: {stderr}");

    let nll = |input: &str| {
        let args = ["nll", "--model", model, "--ids", "1,2,3,4,5,6", "--json"];
        let r = deltafin_json(&[&args[..], &["--expert-input", input]].concat());
        r["mean_nll"].as_f64().expect("mean_nll")
    };
    let (f32_nll, bf16_nll) = (nll("f32"), nll("bf16"));
    assert_ne!(f32_nll, bf16_nll);
    assert!((f32_nll - bf16_nll).abs() < 0.02, "{f32_nll} vs {bf16_nll}");

    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(["nll", "--model", model, "--ids", "1,2", "--json"])
        .env("K3_EXPERT_INPUT", "fp8")
        .output()
        .expect("run deltafin");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("f32, bf16 or i16"), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
}

/// `bench-prefill` on a fixture: one report per pass length asked for (token by token is one pass a token), the
/// engine's read bytes and the bounds in it, and the model's block device with its bytes read where
/// `/proc/diskstats` lists that device (null together otherwise).
#[test]
fn bench_prefill_reports_each_pass_length_and_the_device_reads() {
    let dir = fixture("k3/k3-tiny-a");
    let model = dir.to_str().expect("utf-8 path");
    let r = deltafin_json(&[
        "bench-prefill",
        "--model",
        model,
        "--prompt-len",
        "19",
        "--chunks",
        "auto,1",
        "--disk-spans",
        "4",
    ]);
    assert_eq!(r["prompt_len"], 19);
    assert!(r["flop"].as_f64().is_some_and(|f| f > 0.0), "{r}");
    let runs = r["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{r}");
    assert_eq!(runs[0]["passes"], 1, "{r}");
    assert_eq!(runs[1]["chunk"], 1, "{r}");
    assert_eq!(runs[1]["passes"], 19, "{r}");
    for run in runs {
        assert!(run["ttft_s"].as_f64().is_some_and(|t| t > 0.0), "{run}");
        assert!(
            run["distinct_experts"].as_u64().is_some_and(|n| n > 0),
            "{run}"
        );
        assert!(
            run["goal_ratio"].as_f64().is_some_and(f64::is_finite),
            "{run}"
        );
        assert_eq!(
            r["device"].is_null(),
            run["device_read_bytes"].is_null(),
            "{r}"
        );
    }
    // Each pass length read at least the experts it used (the cache is emptied before each).
    let expert_bytes = |run: &Value| {
        run["engine_read_bytes"]
            .as_u64()
            .expect("engine_read_bytes")
    };
    assert!(
        expert_bytes(&runs[0]) > 0 && expert_bytes(&runs[1]) >= expert_bytes(&runs[0]),
        "{r}"
    );
}
