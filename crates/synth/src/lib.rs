//! Synthetic checkpoints with Kimi K3's architecture and exactly its released on-disk format (shard per layer,
//! `language_model.` names, bf16 trunk with the f32 exceptions, MXFP4 experts stored back to back in string
//! order, index, config with a nested `text_config`, tiktoken tokenizer), with deterministic random weights.
//!
//! Used for the embedded-demo-sized tests and for benchmarks on models larger than RAM: the `large` preset has
//! K3's real expert shape (latent 3584, inner 3072: 17,547,264 bytes per expert) and top-16.
#![deny(missing_docs)]
#![recursion_limit = "256"]

mod params;
mod writer;

pub use params::{SynthParams, preset, preset_names};
pub use writer::{SynthError, write_model};
