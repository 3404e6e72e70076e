//! `--dev` / `K3_DEV`: the binary starts everywhere and says clearly when CUDA cannot be used.

use std::process::{Command, Output};

/// Runs the binary with its own model root per test (tests run in parallel and each materialises the demo model).
fn deltafin(test: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .env(
            "DELTAFIN_ROOT",
            std::env::temp_dir().join(format!("deltafin-cli-dev-{test}")),
        )
        .env_remove("K3_DEV")
        .output()
        .expect("run deltafin")
}

#[test]
fn cuda_where_unavailable_is_a_clear_error() {
    let out = deltafin(
        "cuda",
        &["--dev", "cuda", "run", "--max-new", "2", "--json"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Only a CUDA build on a machine with a usable GPU may succeed.
    let built_with_cuda = cfg!(feature = "cuda");
    if out.status.success() {
        assert!(built_with_cuda, "cuda ran in a build without CUDA");
    } else {
        assert!(
            stderr.contains("CUDA is unavailable"),
            "unclear error: {stderr}"
        );
    }
}

#[test]
fn auto_runs_without_a_gpu() {
    let out = deltafin(
        "auto",
        &["--dev", "auto", "run", "--max-new", "2", "--json"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cpu = deltafin("auto", &["run", "--dev", "cpu", "--max-new", "2", "--json"]);
    assert!(cpu.status.success());
    // Same tokens whichever device ran them (the demo model has wide margins).
    assert_eq!(out.stdout, cpu.stdout);
}

#[test]
fn unknown_device_is_rejected() {
    let out = deltafin("metal", &["--dev", "metal", "run", "--max-new", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected cpu, cuda or auto"));
}
