//! `config.json` of Kimi K3 (`kimi_k3` with a nested `text_config`) and Kimi Linear (flat `kimi_linear`), reduced
//! to the values the graph needs.

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};

/// Which member of the family a checkpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Kimi K3: AttnRes, SiTU, latent MoE, bounded KDA gate, MXFP4 experts.
    K3,
    /// Kimi Linear (48B): plain residual, SwiGLU, hidden-width MoE.
    KimiLinear,
}

/// The attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda,
    /// Gated multi-head latent attention without positional encoding.
    Mla,
}

/// Gate/up activation of every MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `4 tanh(g/4) σ(g) · 25 tanh(u/25)` with the two betas.
    Situ {
        /// `activation_situ_beta` (4 in K3).
        beta: f32,
        /// `activation_situ_linear_beta` (25 in K3).
        linear_beta: f32,
    },
    /// `silu(g) · u`.
    Silu,
}

/// KDA hyper-parameters (`linear_attn_config`).
#[derive(Clone, Debug, PartialEq)]
pub struct KdaConfig {
    /// Heads.
    pub n_heads: usize,
    /// Key/value width per head.
    pub head_dim: usize,
    /// Short-conv kernel (4).
    pub conv_kernel: usize,
    /// `gate_lower_bound`: present selects the bounded decay gate.
    pub gate_lower_bound: Option<f32>,
    /// Full-rank output gate `g_proj` (K3) or low-rank `g_a_proj`/`g_b_proj` (Kimi Linear).
    pub full_rank_gate: bool,
}

/// MLA hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// Heads.
    pub n_heads: usize,
    /// Query low-rank width, or `None` for a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Latent (compressed KV) width.
    pub kv_lora_rank: usize,
    /// Per-head query/key width without position.
    pub nope_dim: usize,
    /// Width of the shared key part that would carry RoPE (unrotated here).
    pub rope_dim: usize,
    /// Per-head value width.
    pub v_dim: usize,
    /// `σ(g_proj x)` multiplies the attention output (K3).
    pub output_gate: bool,
}

/// MoE hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub n_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Inner width of one routed expert.
    pub inter: usize,
    /// Shared experts (fused into one MLP of width `n_shared * inter`).
    pub n_shared: usize,
    /// Latent width the experts run at (K3), or `None` for hidden width.
    pub latent: Option<usize>,
    /// RMSNorm after combining in the latent space.
    pub latent_norm: bool,
    /// Renormalise the chosen weights to sum to one.
    pub renormalize: bool,
    /// Multiplies the routing weights.
    pub routed_scaling: f32,
}

/// Everything the graph needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub family: Family,
    /// Prefix of every text tensor (`language_model.` for K3).
    pub tensor_prefix: String,
    /// Hidden width.
    pub hidden_size: usize,
    /// Vocabulary rows of the embedding and the head.
    pub vocab_size: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// Width of the dense MLP (layers before `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Layers before this index use the dense MLP.
    pub first_k_dense_replace: usize,
    /// MoE on every n-th layer after the dense ones.
    pub moe_layer_freq: usize,
    /// Attention kind per layer, from `kda_layers`.
    pub layer_kinds: Vec<AttnKind>,
    /// KDA parameters.
    pub kda: KdaConfig,
    /// MLA parameters.
    pub mla: MlaConfig,
    /// MoE parameters.
    pub moe: MoeConfig,
    /// MLP activation.
    pub activation: Activation,
    /// AttnRes block size (K3), or `None` for a plain residual stream.
    pub attn_res_block: Option<usize>,
    /// `rms_norm_eps`.
    pub rms_eps: f32,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
    /// End-of-turn id (generation stops here).
    pub eos_token_id: Option<u32>,
}

/// Eps of the MLA `q_a_layernorm`/`kv_a_layernorm`: the reference builds them without `eps`, so the class default.
pub const MLA_LORA_NORM_EPS: f32 = 1e-6;

struct Keys<'a> {
    file: &'a str,
    obj: &'a Value,
}

impl Keys<'_> {
    fn err(&self, msg: impl Into<String>) -> ModelError {
        ModelError::Config {
            file: self.file.to_string(),
            msg: msg.into(),
        }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("missing required key `{key}`")))?;
        v.as_u64().map(|n| n as usize).ok_or_else(|| {
            self.err(format!(
                "key `{key}` must be a non-negative integer, found {v}"
            ))
        })
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        if self.get(key).is_some() {
            self.usize(key).map(Some)
        } else {
            Ok(None)
        }
    }
    fn f32(&self, key: &str) -> Result<f32> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("missing required key `{key}`")))?;
        v.as_f64()
            .map(|n| n as f32)
            .ok_or_else(|| self.err(format!("key `{key}` must be a number, found {v}")))
    }
    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        if self.get(key).is_some() {
            self.f32(key).map(Some)
        } else {
            Ok(None)
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("key `{key}` must be a boolean, found {v}"))),
        }
    }
    fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
    fn id(&self, key: &str) -> Option<u32> {
        self.get(key).and_then(Value::as_u64).map(|n| n as u32)
    }
    fn layer_list(&self, key: &str) -> Result<Vec<usize>> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("missing required key `linear_attn_config.{key}`")))?;
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(format!("`linear_attn_config.{key}` must be a list")))?;
        arr.iter()
            .map(|x| {
                x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    self.err(format!(
                        "`linear_attn_config.{key}` holds a non-integer {x}"
                    ))
                })
            })
            .collect()
    }
}

impl ModelConfig {
    /// Reads and parses `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Config {
            file: file.clone(),
            msg: format!("cannot read: {e}"),
        })?;
        Self::from_json_str(&text, &file)
    }

    /// Parses the text of a `config.json`; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
            file: file.to_string(),
            msg: format!("not valid JSON: {e}"),
        })?;
        Self::from_value(&root, file)
    }

    /// Builds the config from parsed JSON.
    pub fn from_value(root: &Value, file: &str) -> Result<Self> {
        let top = Keys { file, obj: root };
        if !root.is_object() {
            return Err(top.err("top level must be a JSON object"));
        }
        let (family, text, prefix) = match top.str("model_type") {
            Some("kimi_k3") => {
                let text = top
                    .get("text_config")
                    .filter(|v| v.is_object())
                    .ok_or_else(|| top.err("missing required key `text_config`"))?;
                (Family::K3, text, "language_model.")
            }
            Some("kimi_linear") => (Family::KimiLinear, root, ""),
            Some(other) => {
                return Err(top.err(format!(
                    "unsupported model_type `{other}` (expected kimi_k3 or kimi_linear)"
                )));
            }
            None => return Err(top.err("missing required key `model_type`")),
        };
        let c = Keys { file, obj: text };
        let lin_obj = c
            .get("linear_attn_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| c.err("missing required key `linear_attn_config`"))?;
        let lin = Keys { file, obj: lin_obj };

        let n_layers = c.usize("num_hidden_layers")?;
        let layer_kinds = layer_kinds(&lin, n_layers)?;

        let activation = match c.str("hidden_act") {
            Some("situ") => Activation::Situ {
                beta: c.f32("activation_situ_beta")?,
                linear_beta: c.f32("activation_situ_linear_beta")?,
            },
            Some("silu") => Activation::Silu,
            Some(other) => return Err(c.err(format!("unsupported hidden_act `{other}`"))),
            None => return Err(c.err("missing required key `hidden_act`")),
        };

        let kda = KdaConfig {
            n_heads: lin.usize("num_heads")?,
            head_dim: lin.usize("head_dim")?,
            conv_kernel: lin.usize("short_conv_kernel_size")?,
            gate_lower_bound: lin.opt_f32("gate_lower_bound")?,
            full_rank_gate: lin.bool_or("use_full_rank_gate", false)?,
        };
        if kda.conv_kernel == 0 {
            return Err(c.err("`linear_attn_config.short_conv_kernel_size` must be at least 1"));
        }
        let mla = MlaConfig {
            n_heads: c.usize("num_attention_heads")?,
            q_lora_rank: c.opt_usize("q_lora_rank")?,
            kv_lora_rank: c.usize("kv_lora_rank")?,
            nope_dim: c.usize("qk_nope_head_dim")?,
            rope_dim: c.usize("qk_rope_head_dim")?,
            v_dim: c.usize("v_head_dim")?,
            output_gate: c.bool_or("mla_use_output_gate", false)?,
        };
        if family == Family::K3 && !c.bool_or("mla_use_nope", false)? {
            return Err(c.err("only NoPE MLA (`mla_use_nope: true`) is supported"));
        }
        let latent = c.opt_usize("routed_expert_hidden_size")?;
        let moe = MoeConfig {
            n_experts: c.usize("num_experts")?,
            top_k: c.usize("num_experts_per_token")?,
            inter: c.usize("moe_intermediate_size")?,
            n_shared: c.usize_or("num_shared_experts", 0)?,
            latent,
            latent_norm: latent.is_some() && c.bool_or("latent_moe_use_norm", false)?,
            renormalize: c.bool_or("moe_renormalize", true)?,
            routed_scaling: c.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
        };
        if moe.top_k == 0 || moe.top_k > moe.n_experts {
            return Err(c.err(format!(
                "num_experts_per_token {} must be in 1..={}",
                moe.top_k, moe.n_experts
            )));
        }
        if let Some(f) = c.str("moe_router_activation_func")
            && f != "sigmoid"
        {
            return Err(c.err(format!("unsupported moe_router_activation_func `{f}`")));
        }
        if c.usize_or("num_expert_group", 1)? != 1 {
            return Err(c.err("grouped routing with num_expert_group > 1 is not supported"));
        }
        let attn_res_block = c.opt_usize("attn_res_block_size")?;
        if attn_res_block == Some(0) {
            return Err(c.err("`attn_res_block_size` must be at least 1"));
        }
        let moe_layer_freq = c.usize_or("moe_layer_freq", 1)?;
        if moe_layer_freq == 0 {
            return Err(c.err("`moe_layer_freq` must be at least 1"));
        }
        let cfg = ModelConfig {
            family,
            tensor_prefix: prefix.to_string(),
            hidden_size: c.usize("hidden_size")?,
            vocab_size: c.usize("vocab_size")?,
            n_layers,
            intermediate_size: c.usize("intermediate_size")?,
            first_k_dense_replace: c.usize_or("first_k_dense_replace", 0)?,
            moe_layer_freq,
            layer_kinds,
            kda,
            mla,
            moe,
            activation,
            attn_res_block,
            rms_eps: c.f32("rms_norm_eps")?,
            bos_token_id: c.id("bos_token_id").or_else(|| top.id("bos_token_id")),
            eos_token_id: c.id("eos_token_id").or_else(|| top.id("eos_token_id")),
        };
        if cfg.hidden_size == 0 || cfg.vocab_size == 0 || cfg.n_layers == 0 {
            return Err(c.err("hidden_size, vocab_size and num_hidden_layers must be positive"));
        }
        Ok(cfg)
    }

    /// Whether layer `layer` uses the routed MoE (otherwise the dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    /// The checkpoint name of a tensor of layer `layer`, e.g. `layer_tensor(3, "self_attn.o_proj.weight")`.
    pub fn layer_tensor(&self, layer: usize, suffix: &str) -> String {
        format!("{}model.layers.{layer}.{suffix}", self.tensor_prefix)
    }

    /// The checkpoint name of a model-level tensor, e.g. `model_tensor("lm_head.weight")`.
    pub fn model_tensor(&self, name: &str) -> String {
        format!("{}{name}", self.tensor_prefix)
    }

    /// Width the routed experts run at (latent for K3, hidden for Kimi Linear).
    pub fn expert_width(&self) -> usize {
        self.moe.latent.unwrap_or(self.hidden_size)
    }
}

/// Layer kinds from the 1-based `kda_layers`; `full_attn_layers`, when present, must be its complement.
fn layer_kinds(lin: &Keys<'_>, n_layers: usize) -> Result<Vec<AttnKind>> {
    let kda = lin.layer_list("kda_layers")?;
    let mut kinds = vec![AttnKind::Mla; n_layers];
    for &l in &kda {
        if l == 0 || l > n_layers {
            return Err(lin.err(format!(
                "`linear_attn_config.kda_layers` holds {l}, outside 1..={n_layers} (the list is 1-based)"
            )));
        }
        kinds[l - 1] = AttnKind::Kda;
    }
    if lin.get("full_attn_layers").is_some() {
        let mut full = lin.layer_list("full_attn_layers")?;
        full.sort_unstable();
        let expect: Vec<usize> = (1..=n_layers)
            .filter(|l| kinds[l - 1] == AttnKind::Mla)
            .collect();
        if full != expect {
            return Err(lin.err(format!(
                "`linear_attn_config.full_attn_layers` {full:?} disagrees with `kda_layers` (expected {expect:?})"
            )));
        }
    }
    Ok(kinds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k3_json() -> Value {
        serde_json::json!({
            "model_type": "kimi_k3",
            "text_config": {
                "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 100, "intermediate_size": 96,
                "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                    "gate_lower_bound": -5.0, "use_full_rank_gate": true,
                    "kda_layers": [1, 2], "full_attn_layers": [3]},
                "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": true, "mla_use_output_gate": true,
                "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 32,
                "num_shared_experts": 2, "routed_expert_hidden_size": 32, "latent_moe_use_norm": true,
                "first_k_dense_replace": 1, "attn_res_block_size": 2, "rms_norm_eps": 1e-5
            }
        })
    }

    #[test]
    fn parses_k3_layout() {
        let cfg = ModelConfig::from_value(&k3_json(), "t").expect("valid config");
        assert_eq!(cfg.family, Family::K3);
        assert_eq!(
            cfg.layer_kinds,
            vec![AttnKind::Kda, AttnKind::Kda, AttnKind::Mla]
        );
        assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1));
        assert_eq!(
            cfg.layer_tensor(2, "mlp.x"),
            "language_model.model.layers.2.mlp.x"
        );
    }

    #[test]
    fn rejects_disagreeing_layer_lists() {
        let mut v = k3_json();
        v["text_config"]["linear_attn_config"]["full_attn_layers"] = serde_json::json!([2, 3]);
        let err = ModelConfig::from_value(&v, "t").expect_err("must reject");
        assert!(err.to_string().contains("disagrees"), "{err}");
    }

    #[test]
    fn names_a_missing_key() {
        let mut v = k3_json();
        v["text_config"]
            .as_object_mut()
            .expect("object")
            .remove("kv_lora_rank");
        let err = ModelConfig::from_value(&v, "cfg.json").expect_err("must reject");
        assert_eq!(
            err.to_string(),
            "config cfg.json: missing required key `kv_lora_rank`"
        );
    }
}
