//! The deltafin runtime: [`Engine`] (an opened model) and [`Session`] (one conversation's state), with prefill,
//! decode steps and greedy generation.
//!
//! **Invariant:** no HTTP, JSON wire formats or terminals here; apps call this crate.
#![deny(missing_docs)]

pub mod convert;
pub mod engine;
pub mod error;
pub mod session;
pub mod sources;

pub use engine::{Engine, EngineOptions};
pub use error::{Result, RuntimeError};
pub use session::{GreedyOptions, Logits, Session, argmax};
