//! One decoder layer: attention (KDA or MLA) and FFN (dense MLP or MoE), wired through AttnRes (K3) or a plain
//! residual stream (Kimi Linear).

use candle_core::Tensor;
use deltafin_quant::Mxfp4Input;

use crate::attn_res::ResMix;
use crate::config::{AttnKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kda::Kda;
use crate::mla::Mla;
use crate::mlp::Mlp;
use crate::moe::Moe;
use crate::ops::rms_norm;
use crate::profile::{Phase, Profile};
use crate::state::LayerState;
use crate::weights::{ExpertSource, Loader};

/// The attention block of a layer.
#[derive(Debug)]
pub enum Attention {
    /// Kimi Delta Attention.
    Kda(Box<Kda>),
    /// Gated NoPE MLA.
    Mla(Box<Mla>),
}

/// The FFN block of a layer.
#[derive(Debug)]
pub enum Ffn {
    /// Dense gated MLP.
    Dense(Box<Mlp>),
    /// Routed MoE.
    Moe(Box<Moe>),
}

/// What every layer of one forward pass shares.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    /// Where routed experts come from.
    pub experts: &'a dyn ExpertSource,
    /// Where the time of each phase is charged.
    pub profile: &'a Profile,
    /// How routed experts read their inputs on the CPU (exact f32, or rounded to bf16 as the reference's native
    /// dtype does).
    pub expert_input: Mxfp4Input,
}

/// The residual bank of one forward call (AttnRes): stored block sums and the running partial sum.
#[derive(Debug, Default)]
pub struct ResidualBank {
    /// Completed blocks (the embedding first), each `[T, hidden]`.
    pub blocks: Vec<Tensor>,
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer {
    index: usize,
    attn: Attention,
    ffn: Ffn,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    /// (before attention, before FFN) mixes, K3 only.
    res: Option<(ResMix, ResMix)>,
    block_size: Option<usize>,
    eps: f32,
}

impl Layer {
    /// Loads layer `index`.
    pub(crate) fn load(ld: &Loader<'_>, cfg: &ModelConfig, index: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let attn_prefix = cfg.layer_tensor(index, "self_attn.");
        let attn = match cfg.layer_kinds[index] {
            AttnKind::Kda => Attention::Kda(Box::new(Kda::load(
                ld,
                &attn_prefix,
                &cfg.kda,
                h,
                cfg.rms_eps,
            )?)),
            AttnKind::Mla => Attention::Mla(Box::new(Mla::load(ld, &attn_prefix, &cfg.mla, h)?)),
        };
        let ffn = if cfg.is_moe_layer(index) {
            Ffn::Moe(Box::new(Moe::load(ld, cfg, index)?))
        } else {
            Ffn::Dense(Box::new(Mlp::load(
                ld,
                &cfg.layer_tensor(index, "mlp."),
                h,
                cfg.intermediate_size,
                cfg.activation,
            )?))
        };
        let res = match cfg.attn_res_block {
            Some(_) => Some((
                ResMix::load(
                    ld,
                    &cfg.layer_tensor(index, "self_attention"),
                    h,
                    cfg.rms_eps,
                )?,
                ResMix::load(ld, &cfg.layer_tensor(index, "mlp"), h, cfg.rms_eps)?,
            )),
            None => None,
        };
        Ok(Self {
            index,
            attn,
            ffn,
            input_norm: ld.vec(&cfg.layer_tensor(index, "input_layernorm.weight"), &[h])?,
            post_norm: ld.vec(
                &cfg.layer_tensor(index, "post_attention_layernorm.weight"),
                &[h],
            )?,
            res,
            block_size: cfg.attn_res_block,
            eps: cfg.rms_eps,
        })
    }

    /// The layer's index in the model.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The routed MoE of this layer, if it has one.
    pub fn moe(&self) -> Option<&Moe> {
        match &self.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }

    /// Runs the layer on `p` (`[T, hidden]`: the previous layer's output, or the embeddings), returning this
    /// layer's output. `next` is the next MoE layer, if it is loaded (for expert prefetch guesses).
    pub fn forward(
        &self,
        p: Tensor,
        bank: &mut ResidualBank,
        state: &mut LayerState,
        pass: &Pass<'_>,
        next: Option<&Layer>,
    ) -> Result<Tensor> {
        let profile = pass.profile;
        match (&self.res, self.block_size) {
            (Some((attn_mix, mlp_mix)), Some(block)) => {
                let h = if bank.blocks.is_empty() {
                    p.clone()
                } else {
                    attn_mix.mix(&p, &bank.blocks)?
                };
                let partial = if self.index.is_multiple_of(block) {
                    bank.blocks.push(p);
                    None
                } else {
                    Some(p)
                };
                let a = profile.time(self.attention_phase(), || {
                    self.attention(&rms_norm(&h, &self.input_norm, self.eps)?, state, profile)
                })?;
                let p = match partial {
                    Some(p) => (p + a)?,
                    None => a,
                };
                let h2 = mlp_mix.mix(&p, &bank.blocks)?;
                let f =
                    self.feed_forward(&rms_norm(&h2, &self.post_norm, self.eps)?, pass, next)?;
                Ok((p + f)?)
            }
            _ => {
                let a = profile.time(self.attention_phase(), || {
                    self.attention(&rms_norm(&p, &self.input_norm, self.eps)?, state, profile)
                })?;
                let p = (p + a)?;
                let f = self.feed_forward(&rms_norm(&p, &self.post_norm, self.eps)?, pass, next)?;
                Ok((p + f)?)
            }
        }
    }

    /// The profile phase of this layer's attention.
    fn attention_phase(&self) -> Phase {
        match self.attn {
            Attention::Kda(_) => Phase::Kda,
            Attention::Mla(_) => Phase::Mla,
        }
    }

    fn attention(&self, x: &Tensor, state: &mut LayerState, profile: &Profile) -> Result<Tensor> {
        match (&self.attn, state) {
            (Attention::Kda(k), LayerState::Kda(s)) => k.forward(x, s, profile),
            (Attention::Mla(m), LayerState::Mla(c)) => m.forward(x, c, profile),
            _ => Err(ModelError::BadWeight {
                name: format!("layer {}", self.index),
                msg: "session state does not match the layer kind".to_string(),
            }),
        }
    }

    fn feed_forward(&self, x: &Tensor, pass: &Pass<'_>, next: Option<&Layer>) -> Result<Tensor> {
        match &self.ffn {
            Ffn::Dense(m) => pass.profile.time(Phase::DenseFfn, || m.forward(x)),
            Ffn::Moe(m) => m.forward(x, pass, next.and_then(Layer::moe)),
        }
    }
}
