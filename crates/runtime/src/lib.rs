//! The deltafin runtime: [`Engine`] (an opened model) and [`Session`] (one conversation's state), with prefill,
//! decode steps and greedy generation.
//!
//! **Invariant:** no HTTP, JSON wire formats or terminals here; apps call this crate.
#![deny(missing_docs)]

pub mod convert;
pub mod engine;
pub mod error;
pub mod expert_cache;
pub mod session;
pub mod sources;

pub use deltafin_storage::{HubOptions, Missing, Secret};
pub use engine::{Engine, EngineOptions};
pub use error::{Result, RuntimeError};
pub use expert_cache::CacheStats;
pub use session::{GreedyOptions, Logits, Session, argmax};
pub use sources::ExpertStats;
