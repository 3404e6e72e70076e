//! Positional reads: fill a buffer from a given file offset without touching a shared cursor, so one
//! `File` handle can serve many concurrent readers.

use std::fs::File;
use std::io;

/// Reads exactly `buf.len()` bytes at `offset`, or fails with `UnexpectedEof`.
#[cfg(unix)]
pub(crate) fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset)
}

/// Reads exactly `buf.len()` bytes at `offset`, or fails with `UnexpectedEof`.
///
/// Windows has no `read_exact_at`; `seek_read` may return short counts, so loop. Untested here.
#[cfg(windows)]
pub(crate) fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
