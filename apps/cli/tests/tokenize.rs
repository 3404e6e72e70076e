//! `deltafin tokenize` against the tokenizer and chat goldens.
//!
//! `main.rs` belongs to the CLI's integrator, so this test includes the module
//! directly and parses arguments through the same `tokenize` subcommand shape.

// A test that fails should fail loudly at the failing call.
#![allow(clippy::unwrap_used)]

// `run` (printing) is not called here; `output` is what it prints.
#[allow(dead_code)]
#[path = "../src/tokenize.rs"]
mod tokenize;

use std::path::PathBuf;

use clap::Parser as _;

#[derive(clap::Parser)]
#[command(name = "deltafin")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    Tokenize(tokenize::TokenizeArgs),
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn parse(args: &[&str]) -> Result<tokenize::TokenizeArgs, clap::Error> {
    let Command::Tokenize(args) =
        Cli::try_parse_from(["deltafin", "tokenize"].iter().chain(args))?.command;
    Ok(args)
}

/// Runs `deltafin tokenize ARGS` and parses its JSON output.
fn check(args: &[&str]) -> serde_json::Value {
    let out = tokenize::output(&parse(args).unwrap()).unwrap();
    assert!(!out.contains('\n'), "--json output is one line: {out}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn text_form_matches_goldens() {
    let dir = fixtures().join("tokenizer/toy");
    let model = dir.to_str().unwrap();
    let golden: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap();
    for case in golden["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let plain = check(&["--model", model, "--text", text, "--json"]);
        assert_eq!(plain, serde_json::json!({"ids": case["ids"]}), "{text:?}");
        let special = check(&["--model", model, "--text", text, "--special", "--json"]);
        assert_eq!(
            special,
            serde_json::json!({"ids": case["ids_special"]}),
            "{text:?}"
        );
    }
}

#[test]
fn chat_form_matches_goldens() {
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("tokenizer/chat/golden.json")).unwrap(),
    )
    .unwrap();
    let model = fixtures().join("tokenizer/toy");
    let tmp = tempfile::tempdir().unwrap();
    for conv in golden["conversations"].as_array().unwrap() {
        let name = conv["name"].as_str().unwrap();
        let messages = tmp.path().join(format!("{name}.messages.json"));
        std::fs::write(&messages, conv["messages"].to_string()).unwrap();
        let mut args: Vec<String> = vec![
            "--model".into(),
            model.display().to_string(),
            "--chat-file".into(),
            messages.display().to_string(),
            "--json".into(),
        ];
        let kwargs = &conv["kwargs"];
        if kwargs["thinking"] == serde_json::json!(false) {
            args.push("--no-thinking".into());
        }
        if let Some(effort) = kwargs["thinking_effort"].as_str() {
            args.extend(["--effort".into(), effort.into()]);
        }
        if let Some(tools) = kwargs.get("tools") {
            let path = tmp.path().join(format!("{name}.tools.json"));
            std::fs::write(&path, tools.to_string()).unwrap();
            args.extend(["--tools-file".into(), path.display().to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = tokenize::output(&parse(&args).unwrap()).unwrap();
        // Key order is part of the stable form: text, then ids.
        assert!(out.starts_with("{\"text\":"), "{out}");
        let out: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            out,
            serde_json::json!({"text": conv["text"], "ids": conv["ids"]}),
            "{name}"
        );
    }
}

#[test]
fn bad_invocations_are_rejected() {
    let model = fixtures().join("tokenizer/toy");
    let model = model.to_str().unwrap();
    assert!(
        parse(&["--model", model, "--json"]).is_err(),
        "needs --text or --chat-file"
    );
    assert!(parse(&["--model", model, "--text", "a", "--chat-file", "m.json"]).is_err());
    assert!(parse(&["--model", model, "--chat-file", "m.json", "--special"]).is_err());
    assert!(parse(&["--model", model, "--text", "a", "--no-thinking"]).is_err());
    let err = parse(&[
        "--model",
        model,
        "--chat-file",
        "m.json",
        "--effort",
        "medium",
    ])
    .err()
    .unwrap();
    assert!(
        err.to_string()
            .contains("unsupported thinking_effort \"medium\""),
        "{err}"
    );

    let missing = parse(&["--model", "/nonexistent/model", "--text", "a"]).unwrap();
    let err = format!("{:#}", tokenize::output(&missing).unwrap_err());
    assert!(err.contains("/nonexistent/model/tiktoken.model"), "{err}");
}
