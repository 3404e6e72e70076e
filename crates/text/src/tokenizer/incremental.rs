//! Incremental decoding: ids in, complete UTF-8 text out.
//!
//! Byte-level BPE splits multi-byte characters across tokens (an emoji can be
//! four ids), so text is released only up to the last complete character.
//! Bytes that can never become valid UTF-8 are replaced with U+FFFD at once, so
//! one bad token cannot stall the stream.

use std::sync::Arc;

use super::{Result, Tokenizer};

/// Buffers bytes and releases the longest prefix that is complete UTF-8.
#[derive(Debug, Default, Clone)]
pub struct Utf8Buffer {
    pending: Vec<u8>,
}

impl Utf8Buffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes` and returns all text that is now complete (maybe empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `valid` bytes were just checked to be UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that no continuation can fix.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Returns what is left (an unfinished character becomes U+FFFD) and empties the buffer.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes of an unfinished character are waiting.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Decodes generated ids one at a time, emitting only whole characters.
///
/// Concatenating every [`StreamDecoder::push`] result and the final
/// [`StreamDecoder::finish`] gives the same text as a lossy whole decode.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    buffer: Utf8Buffer,
}

impl StreamDecoder {
    /// A decoder with nothing pending.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            buffer: Utf8Buffer::new(),
        }
    }

    /// Feeds one id; returns the text it completes (often empty mid-character).
    /// Special ids decode to their names, as in [`Tokenizer::decode`].
    pub fn push(&mut self, id: u32) -> Result<String> {
        let bytes = self
            .tokenizer
            .id_to_bytes(id)
            .ok_or(super::TextError::UnknownId {
                id,
                vocab_size: self.tokenizer.vocab_size(),
            })?;
        Ok(self.buffer.push(bytes))
    }

    /// Flushes an unfinished character (as U+FFFD) at the end of a stream.
    pub fn finish(&mut self) -> String {
        self.buffer.finish()
    }

    /// The tokenizer this decoder reads from.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
}
