//! The deltafin runtime: [`Engine`] (an opened model) and [`Session`] (one conversation's state), with prefill,
//! decode steps and greedy generation.
//!
//! **Invariant:** no HTTP, JSON wire formats or terminals here; apps call this crate.
#![deny(missing_docs)]

pub mod budget;
pub mod constraint;
pub mod convert;
pub mod counters;
pub mod engine;
pub mod error;
pub mod expert_cache;
pub mod expert_store;
#[cfg(feature = "cuda")]
mod gpu_pins;
pub mod memory;
pub mod ngram;
pub mod options;
pub mod pinning;
pub mod prefetch;
pub mod sampling;
pub mod session;
pub mod snapshot_file;
pub mod spine;
mod spine_batch;

pub use budget::MemoryPlan;
pub use constraint::TokenMask;
pub use deltafin_model::{DeviceOptions, DevicePref};
/// The GPU's memory bound benchmarks measure against: a device copy's rate (bytes/s, reads and writes).
#[cfg(feature = "cuda")]
pub use deltafin_quant::cuda::copy_rate::copy_rate as device_copy_rate;
/// The host-to-device link's rate from pinned memory (bytes/s), the bound uploads are held against.
#[cfg(feature = "cuda")]
pub use deltafin_quant::cuda::copy_rate::upload_rate as pinned_upload_rate;
/// The process's GPU (device 0), opened with `device`'s kernel cache by the first call; later calls return the same
/// device whatever their options. The engine opens it this way; benchmarks call it before their own GPU probes so
/// that those load the cached kernels too.
#[cfg(feature = "cuda")]
pub fn shared_gpu(
    device: &DeviceOptions,
) -> deltafin_quant::Result<std::sync::Arc<deltafin_quant::cuda::Gpu>> {
    deltafin_quant::cuda::Gpu::shared_with_cache(device.kernel_cache.as_deref())
}
/// The allocator's settings, and the bounds benchmarks measure against (all-core memory read, FMA peak),
/// re-exported for the apps.
pub use deltafin_quant::{allocator, flops, membw};
pub use deltafin_storage::{HubOptions, Missing, Secret};
pub use engine::{Engine, OpenTimes};
pub use error::{Result, RuntimeError};
pub use expert_cache::CacheStats;
pub use expert_store::ExpertStats;
pub use memory::SystemMemory;
pub use options::{
    DEFAULT_CONTEXT, ENGINE_VARS, EngineOptions, MAX_RAM_SHARE, PrefillChunk, ram_budget,
};
pub use pinning::PinLayers;
pub use prefetch::{PrefetchStats, parse_on_off};
pub use sampling::{Sampler, SamplingParams, argmax};
pub use session::{
    FinishReason, GenerateOptions, Generation, GreedyOptions, Logits, PrefillProgress, ProgressFn,
    Session, SessionStats, Snapshot,
};
pub use spine::{
    INT8_SPINE_FILE, Int8Report, SpineMode, SpineReadStats, SpineSource, convert_spine_int8,
    spine_bytes,
};

/// Threads the CPU kernels run on (rayon's global pool: `RAYON_NUM_THREADS`, default one per core).
pub fn compute_threads() -> usize {
    rayon::current_num_threads()
}
