//! Printing results to stdout without panicking when the reader has gone (`deltafin ... | head`).

use std::io::Write;

/// Writes `line` and a newline to stdout. A closed pipe is not an error (the reader chose to stop); other
/// failures are returned.
pub fn emit(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}
