//! The whole text model: embedding, decoder layers, final mix, norm and the untied head.

use candle_core::{Device, Tensor};
use deltafin_quant::{DenseMatrix, Mxfp4Input};

use crate::attn_res::ResMix;
use crate::config::ModelConfig;
use crate::device::DeviceOptions;
use crate::error::{ModelError, Result};
use crate::layer::{Layer, Pass, ResidualBank};
use crate::ops::{linear, rms_norm, tensor};
use crate::profile::{Phase, Profile};
use crate::state::SessionState;
use crate::streamed_layers::with_streamed_layers;
use crate::weights::{ExpertSource, Loader, SharedWeightSource, WeightSource};

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

/// A loaded model: the spine's resident part in memory (every layer, unless some are streamed: see
/// [`Model::load_streamed`]); routed experts come from an [`ExpertSource`] per call.
pub struct Model {
    cfg: ModelConfig,
    /// The embedding in memory, or `None` when it is read by rows from `stream` at every call (a model whose
    /// spine does not all fit keeps its 163,840 × 7168 table on disk: one row per token is all a call reads).
    embed: Option<DenseMatrix>,
    /// Resident layers; `None` for a layer streamed from `stream` at every forward call.
    layers: Vec<Option<Layer>>,
    /// Indices of the streamed layers, ascending.
    streamed: Vec<usize>,
    /// Where streamed layers are read from (`None` when every layer is resident).
    stream: Option<SharedWeightSource>,
    output_mix: Option<ResMix>,
    norm: Vec<f32>,
    head: DenseMatrix,
    profile: Profile,
    /// How routed experts read their inputs on the CPU.
    expert_input: Mxfp4Input,
    /// `cpu`, or the GPU the spine lives on.
    device: String,
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::GpuHandles>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("cfg", &self.cfg)
            .field("streamed", &self.streamed)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads every spine weight from `src`, checking each shape against `cfg`.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        Self::load_on(cfg, src, &DeviceOptions::default())
    }

    /// Loads the model onto the device `opts` asks for: on CUDA every spine matrix is uploaded as it is read and
    /// attention and the routed experts run there. Asking for `cuda` where it cannot run fails with the reason.
    pub fn load_on(cfg: ModelConfig, src: &dyn WeightSource, opts: &DeviceOptions) -> Result<Self> {
        Self::load_planned(cfg, src, opts, None)
    }

    /// Like [`Self::load_on`], but only the layers with `resident[layer] == true` stay in memory; the others are
    /// read from `src` again at every forward call, by a background thread one layer ahead of the compute (at
    /// most two streamed layers in memory at once). A streamed layer's names and shapes are checked here from the
    /// source's headers without reading its values. When any layer is streamed the embedding is read by rows at
    /// every call too; the final mix, norm and head stay resident. On CUDA `resident` does not place layers: they
    /// stay on the GPU as far as its memory budget allows (`DeviceOptions::vram_bytes`) and the others are
    /// streamed, uploaded by the reader; the embedding (read by the host) is read by rows only when `resident`
    /// streams a layer. `resident` must have one entry per layer.
    pub fn load_streamed(
        cfg: ModelConfig,
        src: SharedWeightSource,
        opts: &DeviceOptions,
        resident: &[bool],
    ) -> Result<Self> {
        if resident.len() != cfg.n_layers {
            return Err(ModelError::SpineStream {
                layer: resident.len(),
                msg: format!(
                    "a residency plan for {} layers, the model has {}",
                    resident.len(),
                    cfg.n_layers
                ),
            });
        }
        let mut model = Self::load_planned(cfg, &*src, opts, Some(resident))?;
        if !model.streamed.is_empty() {
            model.stream = Some(src);
        }
        Ok(model)
    }

    /// The loader behind [`Self::load_on`] and [`Self::load_streamed`]; `resident: None` keeps every layer.
    fn load_planned(
        cfg: ModelConfig,
        src: &dyn WeightSource,
        opts: &DeviceOptions,
        resident: Option<&[bool]>,
    ) -> Result<Self> {
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
                        kda: std::sync::Arc::default(),
                        mla: std::sync::Arc::default(),
                    });
                    name
                }
                None => "cpu".to_string(),
            };
            (ld, device)
        };
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let checker = Loader::shapes_only(src);
        // On CUDA the GPU memory plan decides which layers stay (on the device; their host values are freed), the
        // host plan does not apply; the head goes up first so that the plan sees it.
        // The embedding is read by rows at every call when the host streams layers; with every layer in the host's
        // plan it stays in memory, also on CUDA, where the GPU's own plan may stream layers that the host keeps
        // (the host tier: those passes then read nothing from storage).
        let host_streams = resident.is_some_and(|r| r.iter().any(|&k| !k));
        #[cfg(feature = "cuda")]
        let can_stream = resident.is_some();
        #[cfg(feature = "cuda")]
        let resident = resident.filter(|_| ld.gpu.is_none());
        #[cfg(feature = "cuda")]
        let mut vram = match &ld.gpu {
            Some(g) => Some(crate::gpu::VramPlan::new(
                &g.gpu,
                opts.vram_bytes,
                opts.gpu_layers,
                2 * cfg.moe.top_k * g.experts.slot_bytes(),
            )?),
            None => None,
        };
        #[cfg(feature = "cuda")]
        let mut head_first = match vram {
            Some(_) => Some(ld.matrix(&cfg.model_tensor("lm_head.weight"), v, h)?),
            None => None,
        };
        let keep = |l: usize| resident.is_none_or(|r| r[l]);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            #[cfg(feature = "cuda")]
            if let Some(plan) = vram.as_mut() {
                if !plan.full() {
                    let before = plan.used()?;
                    let layer = Layer::load(&ld, &cfg, l)?;
                    if plan.keep(before)? {
                        layers.push(Some(layer));
                        continue;
                    }
                    drop(layer);
                    if !can_stream {
                        return Err(ModelError::Device(format!(
                            "the spine does not fit the GPU memory budget of {:.2} GiB (layer {l} of {}), and \
                             this model was opened without a source to stream layers from",
                            plan.budget() as f64 / (1u64 << 30) as f64,
                            cfg.n_layers
                        )));
                    }
                }
                Layer::load(&checker, &cfg, l)?;
                layers.push(None);
                continue;
            }
            if keep(l) {
                layers.push(Some(Layer::load(&ld, &cfg, l)?));
                continue;
            }
            // A streamed layer's names and shapes are checked here from the headers, reading nothing; its values
            // are read at every forward call.
            Layer::load(&checker, &cfg, l)?;
            layers.push(None);
        }
        // Room for two streamed layers as large as the largest one: give resident layers back, last first.
        #[cfg(feature = "cuda")]
        if let Some(plan) = &vram
            && layers.iter().any(Option::is_none)
        {
            while !plan.streaming_fits()? {
                let Some(last) = layers.iter().rposition(Option::is_some) else {
                    return Err(plan.too_small()?);
                };
                layers[last] = None;
            }
        }
        let streamed: Vec<usize> = (0..cfg.n_layers).filter(|&l| layers[l].is_none()).collect();
        let streaming = !streamed.is_empty();
        #[cfg(feature = "cuda")]
        if let (Some(plan), Some(g)) = (&vram, &ld.gpu) {
            if streaming {
                // Freed memory stays in the pool for the next streamed layer (the plan charges two of them), rather
                // than being mapped afresh at every pass.
                g.gpu.keep_freed_memory().map_err(crate::gpu::cuda_err)?;
                tracing::info!(
                    "GPU memory budget {:.1} GiB: {} of {} layers on the GPU, {} streamed",
                    plan.budget() as f64 / (1u64 << 30) as f64,
                    cfg.n_layers - streamed.len(),
                    cfg.n_layers,
                    streamed.len()
                );
            }
            if let Some(b) = plan.expert_budget(streaming)? {
                let b = match opts.gpu_cache_bytes {
                    Some(asked) => asked.min(b),
                    None => b,
                };
                g.experts.set_budget(b);
            }
        }
        let output_mix = match cfg.attn_res_block {
            Some(_) => Some(ResMix::load(
                &ld,
                &cfg.model_tensor("model.output_attn"),
                h,
                cfg.rms_eps,
            )?),
            None => None,
        };
        #[cfg(feature = "cuda")]
        let embed_by_rows = streaming && (ld.gpu.is_none() || host_streams);
        #[cfg(not(feature = "cuda"))]
        let embed_by_rows = streaming && host_streams;
        Ok(Self {
            embed: if embed_by_rows {
                checker.matrix(&cfg.model_tensor("model.embed_tokens.weight"), v, h)?;
                None
            } else {
                Some(ld.matrix(&cfg.model_tensor("model.embed_tokens.weight"), v, h)?)
            },
            norm: ld.vec(&cfg.model_tensor("model.norm.weight"), &[h])?,
            head: {
                #[cfg(feature = "cuda")]
                let first = head_first.take();
                #[cfg(not(feature = "cuda"))]
                let first = None;
                match first {
                    Some(m) => m,
                    None => ld.matrix(&cfg.model_tensor("lm_head.weight"), v, h)?,
                }
            },
            layers,
            streamed,
            stream: None,
            output_mix,
            cfg,
            profile: Profile::default(),
            expert_input: Mxfp4Input::F32,
            device,
            #[cfg(feature = "cuda")]
            gpu: ld.gpu.clone(),
        })
    }

    /// The embedding rows of `ids` (`[T, hidden]`), from memory or read from the spine source.
    fn embed_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if let Some(m) = &self.embed {
            return Ok(ids.iter().flat_map(|&id| m.row_f32(id as usize)).collect());
        }
        let name = self.cfg.model_tensor("model.embed_tokens.weight");
        let src = self
            .stream
            .as_deref()
            .ok_or_else(|| ModelError::SpineStream {
                layer: 0,
                msg: "the embedding is not resident and there is no source to read it from"
                    .to_string(),
            })?;
        let rows: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        let v = src
            .rows_f32(&name, &rows)?
            .ok_or_else(|| ModelError::MissingWeight(name.clone()))?;
        if v.len() != ids.len() * self.cfg.hidden_size {
            return Err(ModelError::BadWeight {
                name,
                msg: format!("{} values for {} rows", v.len(), ids.len()),
            });
        }
        Ok(v)
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Indices of the layers read from the weight source at every forward call (empty: the spine is resident).
    pub fn streamed_layers(&self) -> &[usize] {
        &self.streamed
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

    /// The GPU the model runs on (`None` on the CPU).
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&std::sync::Arc<deltafin_quant::cuda::Gpu>> {
        self.gpu.as_ref().map(|g| &g.gpu)
    }

    /// How routed experts read their inputs on the CPU: exact f32 (the default, which matches the f32
    /// reference) or rounded to bf16 as the reference's native dtype does (about 1.5× the MXFP4 kernels' compute
    /// rate on CPUs with AVX-512 BF16). The CUDA expert path always reads f32.
    pub fn set_expert_input(&mut self, input: Mxfp4Input) {
        self.expert_input = input;
    }

    /// How routed experts read their inputs (see [`Self::set_expert_input`]).
    pub fn expert_input(&self) -> Mxfp4Input {
        self.expert_input
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
        self.forward_observed(ids, state, experts, logit_rows, &|_| {})
    }

    /// [`Self::forward`], calling `layer_done(l)` after each decoder layer `l` (for progress reports).
    pub fn forward_observed(
        &self,
        ids: &[u32],
        state: &mut SessionState,
        experts: &dyn ExpertSource,
        logit_rows: LogitRows,
        layer_done: &dyn Fn(usize),
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
        let rows = self.embed_rows(ids)?;
        let mut p = tensor(rows, ids.len(), hidden)?; // [T, hidden]
        let mut bank = ResidualBank::default();
        // Work on a copy so a failed call leaves `state` untouched.
        let mut next = state.clone();
        let src = self.stream.as_deref();
        let pass = Pass {
            experts,
            profile: &self.profile,
            expert_input: self.expert_input,
        };
        #[cfg(feature = "cuda")]
        let gpu = self.gpu.clone();
        #[cfg(not(feature = "cuda"))]
        let gpu = None;
        p = with_streamed_layers(src, &self.cfg, &self.streamed, gpu, |streamed| {
            for (l, (slot, layer_state)) in
                self.layers.iter().zip(next.layers.iter_mut()).enumerate()
            {
                // The next MoE layer, when it and the layers before it are resident (a streamed one is still
                // being read), for expert prefetch guesses.
                let following = self.layers[l + 1..]
                    .iter()
                    .map_while(Option::as_ref)
                    .find(|layer| layer.moe().is_some());
                let taken;
                let layer = match slot {
                    Some(layer) => layer,
                    None => {
                        taken = streamed.take(l, &self.profile)?;
                        &taken
                    }
                };
                p = layer.forward(p, &mut bank, layer_state, &pass, following)?;
                layer_done(l);
            }
            Ok(p)
        })?;
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
