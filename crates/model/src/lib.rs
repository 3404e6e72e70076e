//! The Kimi K3 / Kimi Linear text graph on candle tensors, computed in f32 on the CPU.
//!
//! This crate does no I/O (the tokenizer and chat format are `deltafin-text`'s): spine weights arrive through [`WeightSource`] and routed experts through
//! [`ExpertSource`], both implemented by the runtime. Blocks follow the checkpoint map: one struct per block with a
//! `load` that names its tensors and a `forward`.
#![deny(missing_docs)]

pub mod activation;
pub mod attn_res;
pub mod config;
pub mod device;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kda;
pub mod kda_heads;
pub mod kda_recurrence;
pub mod layer;
pub mod mla;
pub mod mla_attend;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod ops;
pub mod profile;
pub mod state;
pub mod streamed_layers;
pub mod weights;

pub use config::{AttnKind, Family, ModelConfig};
pub use deltafin_quant::Mxfp4Input as ExpertInput;
pub use device::{CUDA_BUILT, DeviceOptions, DevicePref};
pub use error::{ModelError, Result, SourceError};
pub use model::{LogitRows, Model};
pub use profile::{Phase, Profile, ProfileSnapshot};
pub use state::SessionState;
pub use weights::{
    ExpertBytes, ExpertFetch, ExpertSource, ExpertWeights, HostTensor, PackedExpert,
    SharedWeightSource, WeightSource,
};
