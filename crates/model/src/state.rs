//! Per-conversation decode state: KDA recurrent states and conv windows, MLA latent caches.
//!
//! State is passed explicitly (`&mut SessionState`), so a snapshot is a clone and a rollback is keeping the old
//! value. KDA states sit behind `Arc`, so a clone shares them until one side writes (copy on write).

use std::sync::Arc;

use crate::config::{AttnKind, ModelConfig};

/// The state of one KDA layer.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// The last `kernel - 1` pre-conv projection rows of q, k and v, oldest first (`[(K-1) * C]` each).
    pub conv: [Vec<f32>; 3],
    /// Recurrent states, `[heads, head_dim (k), head_dim (v)]`.
    pub s: Vec<f32>,
}

/// The latent cache of one MLA layer: per token the normalised `c` (kv_lora) and the shared `k_pe`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlaCache {
    /// `[len, kv_lora_rank]`.
    pub c: Vec<f32>,
    /// `[len, rope_dim]`.
    pub k_pe: Vec<f32>,
    /// Cached tokens.
    pub len: usize,
}

/// The state of one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// KDA layer.
    Kda(Arc<KdaState>),
    /// MLA layer.
    Mla(MlaCache),
}

/// The whole decode state of one conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionState {
    /// One entry per layer.
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub n_tokens: usize,
}

impl SessionState {
    /// The empty state for a model.
    pub fn new(cfg: &ModelConfig) -> Self {
        let c = cfg.kda.n_heads * cfg.kda.head_dim;
        let window = (cfg.kda.conv_kernel - 1) * c;
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                AttnKind::Kda => LayerState::Kda(Arc::new(KdaState {
                    conv: [vec![0.0; window], vec![0.0; window], vec![0.0; window]],
                    s: vec![0.0; cfg.kda.n_heads * cfg.kda.head_dim * cfg.kda.head_dim],
                })),
                AttnKind::Mla => LayerState::Mla(MlaCache::default()),
            })
            .collect();
        Self {
            layers,
            n_tokens: 0,
        }
    }
}
