//! Printing results to stdout without panicking when the reader has gone (`deltafin ... | head`).

use std::io::Write;

/// Whether output to a stream may use colour (ANSI escapes): only on a terminal, and never when `NO_COLOR` is set
/// to anything but an empty string (<https://no-color.org>).
pub fn colour(stream_is_terminal: bool) -> bool {
    stream_is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Writes `line` and a newline to stdout. A closed pipe is not an error (the reader chose to stop); other
/// failures are returned.
pub fn emit(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}
