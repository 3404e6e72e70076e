//! Text in and out of Kimi K3: the tokenizer ([`tokenizer`]: tiktoken ranks, K3's pre-tokenizer, rank BPE,
//! incremental decoding) and the XTML chat format ([`chat`]: rendering conversations, parsing generated output).
//!
//! Nothing here knows the model's graph or weights; reading the tokenizer's two files is the crate's only I/O.
#![deny(missing_docs)]

pub mod chat;
mod error;
pub mod tokenizer;

pub use error::{Result, TextError};
