//! The whole text model: embedding, decoder layers, final mix, norm and the untied head.

use candle_core::{Device, Tensor};
use deltafin_quant::DenseMatrix;

use crate::attn_res::ResMix;
use crate::config::ModelConfig;
use crate::device::DeviceOptions;
use crate::error::{ModelError, Result};
use crate::layer::{Layer, ResidualBank};
use crate::ops::{linear, rms_norm, tensor};
use crate::profile::{Phase, Profile};
use crate::state::SessionState;
use crate::weights::{ExpertSource, Loader, WeightSource};

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// One row per input token.
    All,
    /// Only the last input token's row (generation).
    Last,
    /// The last `n` rows (speculative verification).
    Tail(usize),
}

/// A loaded model (spine weights in memory; routed experts come from an [`ExpertSource`] per call).
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    embed: DenseMatrix,
    layers: Vec<Layer>,
    output_mix: Option<ResMix>,
    norm: Vec<f32>,
    head: DenseMatrix,
    profile: Profile,
    /// `cpu`, or the GPU the spine lives on.
    device: String,
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::GpuHandles>,
}

impl Model {
    /// Loads every spine weight from `src`, checking each shape against `cfg`.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_on(cfg, src, &DeviceOptions::default())
    }

    /// Loads the model onto the device `opts` asks for: on CUDA every spine matrix is uploaded as it is read and
    /// attention and the routed experts run there. Asking for `cuda` where it cannot run fails with the reason.
    pub fn load_on(cfg: ModelConfig, src: &dyn WeightSource, opts: &DeviceOptions) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        let (ld, device) = match opts.pref {
            crate::device::DevicePref::Cuda => {
                return Err(ModelError::Device(
                    "CUDA is unavailable: this build has no CUDA support (rebuild with --features cuda, see \
                     docs/PLATFORMS.md)"
                        .to_string(),
                ));
            }
            crate::device::DevicePref::Cpu | crate::device::DevicePref::Auto => {
                (Loader::new(src), "cpu".to_string())
            }
        };
        #[cfg(feature = "cuda")]
        let (ld, device) = {
            let mut ld = Loader::new(src);
            let device = match crate::gpu::open(opts)? {
                Some(gpu) => {
                    let shape = deltafin_quant::cuda::moe::MoeShape {
                        width: cfg.expert_width(),
                        inter: cfg.moe.inter,
                        glu: match cfg.activation {
                            crate::config::Activation::Situ { beta, linear_beta } => {
                                deltafin_quant::cuda::moe::Glu::Situ { beta, linear_beta }
                            }
                            crate::config::Activation::Silu => deltafin_quant::cuda::moe::Glu::Silu,
                        },
                    };
                    let n_moe = (0..cfg.n_layers).filter(|&l| cfg.is_moe_layer(l)).count();
                    let experts = crate::gpu::GpuExperts::new(
                        &gpu,
                        shape,
                        n_moe * cfg.moe.n_experts,
                        opts.gpu_cache_bytes,
                    );
                    let name = format!("cuda ({})", gpu.name());
                    ld.gpu = Some(crate::gpu::GpuHandles {
                        gpu,
                        experts: std::sync::Arc::new(experts),
                    });
                    name
                }
                None => "cpu".to_string(),
            };
            (ld, device)
        };
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.n_layers)
            .map(|l| Layer::load(&ld, &cfg, l))
            .collect::<Result<Vec<_>>>()?;
        let output_mix = match cfg.attn_res_block {
            Some(_) => Some(ResMix::load(
                &ld,
                &cfg.model_tensor("model.output_attn"),
                h,
                cfg.rms_eps,
            )?),
            None => None,
        };
        Ok(Self {
            embed: ld.matrix(&cfg.model_tensor("model.embed_tokens.weight"), v, h)?,
            norm: ld.vec(&cfg.model_tensor("model.norm.weight"), &[h])?,
            head: ld.matrix(&cfg.model_tensor("lm_head.weight"), v, h)?,
            layers,
            output_mix,
            cfg,
            profile: Profile::default(),
            device,
            #[cfg(feature = "cuda")]
            gpu: ld.gpu.clone(),
        })
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Time spent per phase by every forward call so far.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Where the model runs: `cpu` or `cuda (<GPU name>)`.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// Counters of the GPU expert cache (`None` on the CPU).
    #[cfg(feature = "cuda")]
    pub fn expert_cache_stats(&self) -> Option<crate::gpu::ExpertCacheStats> {
        self.gpu.as_ref().map(|g| g.experts.stats())
    }

    /// A fresh, empty decode state for this model.
    pub fn new_state(&self) -> SessionState {
        SessionState::new(&self.cfg)
    }

    /// Feeds `ids` after whatever `state` has seen and returns `[rows, vocab]` logits.
    pub fn forward(
        &self,
        ids: &[u32],
        state: &mut SessionState,
        experts: &dyn ExpertSource,
        logit_rows: LogitRows,
    ) -> Result<Tensor> {
        if ids.is_empty() {
            return Ok(Tensor::zeros(
                (0, self.cfg.vocab_size),
                candle_core::DType::F32,
                &Device::Cpu,
            )?);
        }
        let vocab = self.cfg.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id, vocab });
        }
        let hidden = self.cfg.hidden_size;
        let rows: Vec<f32> = ids
            .iter()
            .flat_map(|&id| self.embed.row_f32(id as usize))
            .collect();
        let mut p = tensor(rows, ids.len(), hidden)?; // [T, hidden]
        let mut bank = ResidualBank::default();
        // Work on a copy so a failed call leaves `state` untouched.
        let mut next = state.clone();
        for (layer, layer_state) in self.layers.iter().zip(next.layers.iter_mut()) {
            p = layer.forward(p, &mut bank, layer_state, experts, &self.profile)?;
        }
        next.n_tokens += ids.len();
        *state = next;
        let head_from = std::time::Instant::now();
        let h = match &self.output_mix {
            Some(mix) => mix.mix(&p, &bank.blocks)?,
            None => p,
        };
        let h = match logit_rows {
            LogitRows::All => h,
            LogitRows::Last => h.narrow(0, ids.len() - 1, 1)?,
            LogitRows::Tail(n) => {
                let n = n.clamp(1, ids.len());
                h.narrow(0, ids.len() - n, n)?
            }
        };
        let y = rms_norm(&h, &self.norm, self.cfg.rms_eps)?;
        let logits = linear(&y, &self.head);
        self.profile.add(Phase::Head, head_from.elapsed());
        logits
    }
}
