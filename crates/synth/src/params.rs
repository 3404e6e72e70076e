//! The shape of a synthetic model and the named presets.

/// Every size of a synthetic K3-architecture model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthParams {
    /// Seed of every random weight.
    pub seed: u64,
    /// Hidden width.
    pub hidden: usize,
    /// Decoder layers (layer 0 dense, the rest MoE).
    pub layers: usize,
    /// 1-based MLA layers; the others are KDA.
    pub mla_layers: Vec<usize>,
    /// AttnRes block size.
    pub block: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Latent width of the routed experts.
    pub latent: usize,
    /// Inner width of a routed expert.
    pub moe_inter: usize,
    /// Shared experts (fused).
    pub shared: usize,
    /// Dense MLP width (layer 0).
    pub dense_inter: usize,
    /// KDA heads.
    pub kda_heads: usize,
    /// KDA head width.
    pub kda_head_dim: usize,
    /// MLA heads.
    pub mla_heads: usize,
    /// MLA nope width.
    pub nope: usize,
    /// MLA rope width (unrotated).
    pub rope: usize,
    /// MLA value width.
    pub v: usize,
    /// MLA query low rank.
    pub q_lora: usize,
    /// MLA latent width.
    pub kv_lora: usize,
    /// Vocabulary rows of the embedding and the head (the tokenizer is the toy one whatever this is; ids past its
    /// 812 tokens are never produced by it, but the model can predict them).
    pub vocab: usize,
    /// Leave every large matrix except the router, embedding and head as a file hole (reads as zeros), and every
    /// routed expert too: a model of full apparent size that takes a few GB on disk, for measuring memory, open
    /// time and compute at real width (not disk: holes cost no reads).
    pub sparse: bool,
    /// When non-zero, `lm_head` is a scaled copy of the embedding with rows permuted in cycles of this length, so
    /// greedy text tends to repeat with this period (repetitive text for speculation tests and benchmarks).
    pub cycle: usize,
}

impl SynthParams {
    /// Bytes of one MXFP4 expert.
    pub fn expert_bytes(&self) -> u64 {
        let (l, i) = (self.latent as u64, self.moe_inter as u64);
        // w1, w3: [i, l/2] + [i, l/32]; w2: [l, i/2] + [l, i/32]
        2 * (i * l / 2 + i * l / 32) + (l * i / 2 + l * i / 32)
    }

    /// Bytes of all routed experts.
    pub fn total_expert_bytes(&self) -> u64 {
        self.expert_bytes() * self.experts as u64 * (self.layers.saturating_sub(1)) as u64
    }
}

/// Vocabulary of the toy tokenizer every synthetic model ships (556 ranks + 256 specials).
pub const TOY_VOCAB: usize = 812;

/// Names accepted by [`preset`].
pub fn preset_names() -> &'static [&'static str] {
    &["demo", "demo-cyclic", "large", "large-cyclic", "k3"]
}

/// A named preset: `demo` (a few MB, 64 experts top-4) or `large` (K3's real expert shape, top-16, 7 MoE layers
/// of 96 experts: 11.8 GB of experts, 1.97 GB read per token) or `k3` (the released K3 text configuration at full
/// size: 93 layers, hidden 7168, 896 experts, vocabulary 163,840; 1.56 TB, so use it with `sparse` or with fewer
/// layers and experts); the `-cyclic` variants produce repetitive text.
pub fn preset(name: &str) -> Option<SynthParams> {
    if let Some(base) = name.strip_suffix("-cyclic") {
        return preset(base).map(|p| SynthParams { cycle: 8, ..p });
    }
    match name {
        "demo" => Some(SynthParams {
            seed: 1,
            hidden: 64,
            layers: 6,
            mla_layers: vec![4, 6],
            block: 2,
            experts: 64,
            top_k: 4,
            latent: 32,
            moe_inter: 32,
            shared: 2,
            dense_inter: 96,
            kda_heads: 4,
            kda_head_dim: 16,
            mla_heads: 4,
            nope: 16,
            rope: 8,
            v: 16,
            q_lora: 32,
            kv_lora: 24,
            vocab: TOY_VOCAB,
            sparse: false,
            cycle: 0,
        }),
        "large" => Some(SynthParams {
            seed: 3,
            hidden: 1024,
            layers: 8,
            mla_layers: vec![4, 8],
            block: 4,
            experts: 96,
            top_k: 16,
            latent: 3584,
            moe_inter: 3072,
            shared: 2,
            dense_inter: 2048,
            kda_heads: 8,
            kda_head_dim: 128,
            mla_heads: 8,
            nope: 64,
            rope: 32,
            v: 64,
            q_lora: 256,
            kv_lora: 128,
            vocab: TOY_VOCAB,
            sparse: false,
            cycle: 0,
        }),
        "k3" => Some(SynthParams {
            seed: 7,
            hidden: 7168,
            layers: 93,
            // 1-based, as `full_attn_layers` in the released config: every fourth layer, and the last.
            mla_layers: (1..=23).map(|i| 4 * i).chain([93]).collect(),
            block: 12,
            experts: 896,
            top_k: 16,
            latent: 3584,
            moe_inter: 3072,
            shared: 2,
            dense_inter: 33792,
            kda_heads: 96,
            kda_head_dim: 128,
            mla_heads: 96,
            nope: 128,
            rope: 64,
            v: 128,
            q_lora: 1536,
            kv_lora: 512,
            vocab: 163_840,
            sparse: false,
            cycle: 0,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_has_k3_expert_shape() {
        let p = preset("large").expect("preset");
        assert_eq!(p.expert_bytes(), 17_547_264);
        assert!(p.total_expert_bytes() as f64 >= 2.5 * 4.0 * (1u64 << 30) as f64);
    }

    #[test]
    fn k3_is_the_released_configuration() {
        let p = preset("k3").expect("preset");
        assert_eq!(p.expert_bytes(), 17_547_264);
        // 92 MoE layers of 896 experts: 1.446 TB.
        assert_eq!(p.total_expert_bytes(), 92 * 896 * 17_547_264);
        assert_eq!(p.mla_layers.len(), 24);
        assert_eq!(p.mla_layers[..3], [4, 8, 12]);
        assert_eq!(p.mla_layers[22..], [92, 93]);
    }
}
