//! A child process for the crash test: `fetch_child MODEL_DIR ENDPOINT` fills a streaming install with
//! `fetch_experts_all`, logging at debug level to stderr (the test checks that `HF_TOKEN` never shows).
//! The test SIGKILLs it mid-download and runs it again.

use std::path::PathBuf;
use std::time::Duration;

use deltafin_storage::install::fetch_experts_all;
use deltafin_storage::{HubOptions, NoProgress};

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("debug"))
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(endpoint)) = (args.next(), args.next()) else {
        eprintln!("usage: fetch_child MODEL_DIR ENDPOINT");
        return std::process::ExitCode::from(2);
    };
    let hub = HubOptions {
        endpoint: Some(endpoint),
        // Token from HF_TOKEN, as a user would set it.
        token: None,
        max_in_flight: 2,
        max_attempts: 8,
        backoff: Duration::from_millis(10),
        idle_timeout: Duration::from_secs(5),
        ..HubOptions::default()
    };
    match fetch_experts_all(&PathBuf::from(dir), None, false, &hub, &NoProgress) {
        Ok(m) => {
            println!("fetched {} experts, {} bytes", m.experts, m.bytes);
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
