//! [`Engine`]: an opened model (config, checkpoint files, spine, expert source) shared by sessions.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_model::{ExpertInput, ExpertSource, Model, ModelConfig};
use deltafin_storage::{
    ExpertFormat, ExpertMap, Missing, ModelFiles, NoProgress, Progress, ReadPoolOptions,
    SpanReader, StreamInstall, is_stream_install,
};
use deltafin_text::tokenizer::Tokenizer;

use crate::budget::{self, MemoryPlan, PlanInputs};
use crate::counters::{CountingExperts, ExpertReadStats};
use crate::error::{Result, RuntimeError};
use crate::expert_store::{ExpertStats, ExpertStore, READ_WINDOW};
use crate::options::EngineOptions;
use crate::session::Session;
use crate::spine::{SpineReadStats, SpineSource};

/// The tokenizer's rank file in a model directory.
const TOKENIZER_FILE: &str = "tiktoken.model";

const GIB: f64 = (1u64 << 30) as f64;

/// An opened model.
pub struct Engine {
    dir: PathBuf,
    tokenizer: Option<Arc<Tokenizer>>,
    options: EngineOptions,
    /// How the memory budget is spent.
    plan: MemoryPlan,
    /// Tokens per prefill pass (`K3_PREFILL_CHUNK`, `auto` resolved against the budget).
    prefill_chunk: usize,
    /// Tokens per pass whose scratch the plan reserves; a longer pass borrows the rest from the expert cache.
    reserved_chunk: usize,
    /// Bytes of one routed expert as stored (0 without experts).
    expert_bytes: u64,
    spine_int8: bool,
    spine_bytes: u64,
    spine: Arc<SpineSource>,
    /// The spine reads the open made (bytes, tensors, seconds blocked in them).
    open_reads: SpineReadStats,
    open_times: OpenTimes,
    /// Spine bytes per layer as served (int8 copy or shards).
    layer_bytes: Vec<u64>,
    /// Layers the GPU streams from RAM (the host tier), not from storage.
    host_tier: Vec<usize>,
    fingerprint: u32,
    model: Model,
    experts: CountingExperts<ExpertStore>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.dir).finish()
    }
}

impl Engine {
    /// Opens the model in `dir`: parses `config.json`, reads every shard header, maps the experts and loads the
    /// spine, checking every shape.
    ///
    /// A streaming install (see `deltafin setup --stream`) is opened through storage's `StreamInstall`: any
    /// missing header or spine span is fetched and every cached spine span verified first; experts are then
    /// fetched on demand.
    pub fn open(dir: &Path, options: EngineOptions) -> Result<Self> {
        Self::open_with_progress(dir, options, None)
    }

    /// [`Self::open`], telling `progress` the spine bytes read as the model loads (phase `open`, the total being
    /// the bytes the load reads: the pinned layers and fixed tensors, or the whole spine on a GPU).
    pub fn open_with_progress(
        dir: &Path,
        options: EngineOptions,
        progress: Option<Arc<dyn Progress + Send>>,
    ) -> Result<Self> {
        let opening = std::time::Instant::now();
        // A GPU opens (driver, context, kernels) on its own thread while the headers are parsed: the device is one
        // per process (`shared_gpu`), so whoever asks for it next waits for this opening and gets its outcome.
        #[cfg(feature = "cuda")]
        if options.device.pref != deltafin_model::DevicePref::Cpu {
            let device = options.device.clone();
            std::thread::spawn(move || crate::shared_gpu(&device).is_ok());
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(RuntimeError::NoConfig(dir.to_path_buf()));
        }
        let cfg = ModelConfig::from_file(&config_path)?;
        let config_bytes = std::fs::read(&config_path).unwrap_or_default();
        let budget = options.ram_budget_bytes()?;
        let (files, map, stream) = if is_stream_install(dir)? {
            let s = StreamInstall::open(dir, &options.hub, &NoProgress)?;
            (Arc::clone(s.files()), Arc::clone(s.map()), Some(s))
        } else {
            let files = Arc::new(ModelFiles::open(dir)?);
            let map = Arc::new(ExpertMap::build(&files)?);
            (files, map, None)
        };
        check_experts(dir, &cfg, &map)?;
        let n_layers = cfg.n_layers;
        let on_gpu = gpu_in_use(&options);
        // One page-locking hook for both read pools (spine and experts) on a GPU.
        let pins = gpu_pins(&options, on_gpu);
        let spine = Arc::new(SpineSource::open(
            Arc::clone(&files),
            options.spine,
            Some(spine_budget(&options, on_gpu, budget)?),
            pins.clone(),
        )?);
        let spine_int8 = spine.is_int8();
        let spine_bytes = spine.stored_bytes();
        let layer_prefixes: Vec<String> = (0..n_layers).map(|l| cfg.layer_tensor(l, "")).collect();
        let layer_bytes: Vec<u64> = layer_prefixes
            .iter()
            .map(|p| spine.served_bytes(p))
            .collect();
        let embed_bytes = spine.served_bytes(&cfg.model_tensor("model.embed_tokens.weight"));
        let fixed_bytes = spine
            .served_bytes("")
            .saturating_sub(layer_bytes.iter().sum::<u64>() + embed_bytes);
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut pool = ReadPoolOptions {
            threads: options.read_threads.unwrap_or(EXPERT_READ_THREADS),
            ..ReadPoolOptions::default()
        };
        let expert_bytes = (0..n_layers)
            .find(|&l| map.n_experts(l) > 0)
            .and_then(|l| map.span(l, 0).ok())
            .map_or(0, |s| s.len);
        // Reads in flight and landed (two windows), the pool's idle buffers, and with prefetch a layer's guesses.
        let expert_buffers = (2 * READ_WINDOW + pool.max_idle_buffers) as u64
            + if options.prefetch {
                cfg.moe.top_k as u64
            } else {
                0
            };
        // Under `auto` the plan reserves the base pass's scratch; longer passes borrow from the expert cache.
        let reserved_chunk = match options.prefill_chunk {
            crate::PrefillChunk::Auto => budget::BASE_PREFILL_CHUNK,
            crate::PrefillChunk::Tokens(n) => n.max(1),
        };
        let (plan, over) = budget::plan(
            &PlanInputs {
                budget,
                layer_bytes: &layer_bytes,
                embed_bytes,
                fixed_bytes,
                expert_bytes,
                expert_buffers,
                context: options.context,
                prefill_chunk: reserved_chunk,
            },
            &cfg,
            &options.pin_layers,
        )?;
        if over > 0 {
            tracing::warn!(
                "the layers pinned by K3_PIN_LAYERS overrun the memory budget by {:.2} GiB; the expert cache gets \
                 nothing ({plan})",
                over as f64 / GIB
            );
        }
        let prefill_chunk = match options.prefill_chunk {
            crate::PrefillChunk::Auto => {
                budget::auto_prefill_chunk(&cfg, plan.expert_cache, options.context)
            }
            crate::PrefillChunk::Tokens(_) => reserved_chunk,
        };
        // The layers the load reads are read in order, each while the ones before it are built: the resident ones
        // on the CPU; on a GPU every layer, as the GPU's own memory plan loads them all (in order, the last ones
        // only checked when they do not fit; a read ahead that is not asked for is dropped).
        spine.set_order(
            (0..n_layers)
                .filter(|&l| on_gpu || plan.resident[l])
                .map(|l| layer_prefixes[l].clone())
                .collect(),
            false,
        );
        // Through `load_streamed` even when every layer is pinned: on CUDA the GPU memory plan may stream layers
        // the host keeps (an all-resident plan streams nothing on the CPU).
        let src: deltafin_model::SharedWeightSource = spine.clone();
        if let Some(p) = &progress {
            let pinned: u64 = (0..n_layers)
                .filter(|&l| on_gpu || plan.resident[l])
                .map(|l| layer_bytes[l])
                .sum();
            // With layers streamed on the CPU the embedding is read by rows at every pass, not at open.
            let embed = if !on_gpu && plan.resident.iter().any(|&r| !r) {
                0
            } else {
                embed_bytes
            };
            p.start("open", pinned + fixed_bytes + embed);
            spine.set_progress(Some(Arc::clone(p)));
        }
        let loading = std::time::Instant::now();
        let loaded = Model::load_streamed(cfg, src, &options.device, &plan.resident);
        // The host tier: layers the GPU streams (its memory holds fewer) that the RAM the plan pinned holds are read
        // once now and uploaded from RAM at every pass, not read from storage again.
        let host_tier: Vec<usize> = match &loaded {
            Ok(m) if on_gpu => budget::host_tier(
                &plan,
                &options.pin_layers,
                m.streamed_layers(),
                &layer_bytes,
            ),
            _ => Vec::new(),
        };
        // Empty unless the load succeeded.
        let kept = (!host_tier.is_empty()).then(|| {
            let prefixes: Vec<String> = host_tier
                .iter()
                .map(|&l| layer_prefixes[l].clone())
                .collect();
            spine.keep_layers(&prefixes)
        });
        let load_done = std::time::Instant::now();
        spine.set_progress(None);
        if let Some(p) = &progress {
            p.finish();
        }
        let mut model = loaded?;
        if let Some(kept) = kept {
            let kept = kept?;
            tracing::info!(
                "{} of the layers the GPU streams are kept in RAM ({:.2} GiB) and uploaded from there at every pass",
                host_tier.len(),
                kept as f64 / GIB
            );
        }
        model.set_expert_input(options.expert_input);
        let slow = match options.expert_input {
            ExpertInput::F32 => None,
            ExpertInput::Bf16 => {
                (!deltafin_quant::simd::mxfp4_bf16_is_fast()).then_some("AVX2 or AVX-512 BF16")
            }
            ExpertInput::I16 => {
                (!deltafin_quant::simd::mxfp4_i16_is_fast()).then_some("AVX2, AVX-512 VNNI or NEON")
            }
        };
        if let Some(missing) = slow {
            tracing::warn!(
                "K3_EXPERT_INPUT={} without {missing} on this CPU: its expert kernels run their scalar reference, \
                 far slower than the f32 default",
                options.expert_input
            );
        }
        // Only reads made by forward passes count from here on.
        let open_reads = spine.read_stats();
        spine.reset_reads();
        let streamed = model.streamed_layers();
        // With no layer read from storage at every pass, the buffers the load read into are of no further use.
        if streamed.iter().all(|l| host_tier.contains(l)) {
            spine.release_idle_buffers();
        }
        spine.set_order(
            streamed
                .iter()
                .filter(|l| !host_tier.contains(l))
                .map(|&l| layer_prefixes[l].clone())
                .collect(),
            true,
        );
        tracing::info!("memory budget {plan}");
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut cache_budget = plan.expert_cache;
        #[cfg(feature = "cuda")]
        if model.gpu().is_some() {
            // The plan charged the layers it pins as host memory; the GPU's layers freed their host values once
            // uploaded, so what the host tier does not use of that share goes to the RAM expert cache (which feeds
            // the GPU's uploads).
            let kept: u64 = host_tier.iter().map(|&l| layer_bytes[l]).sum();
            let freed = plan.pinned_layers.saturating_sub(kept);
            cache_budget += freed;
            tracing::info!(
                "{:.2} GiB of pinned layers' RAM is not used by the host tier; the RAM expert cache gets it: {:.2} GiB",
                freed as f64 / GIB,
                cache_budget as f64 / GIB
            );
            // The expert read buffers are page-locked, so experts go up straight from where they were read.
            pool.buffer_hook = pins;
        }
        let reader = SpanReader::new(&files, stream, &pool, true)?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&config_bytes);
        hasher.update(&files.total_tensor_bytes().to_le_bytes());
        let tokenizer = if dir.join(TOKENIZER_FILE).is_file() {
            Some(Arc::new(Tokenizer::from_dir(dir).map_err(|e| {
                RuntimeError::Tokenizer {
                    dir: dir.to_path_buf(),
                    msg: e.to_string(),
                }
            })?))
        } else {
            None
        };
        let experts = CountingExperts::new(
            ExpertStore::new(map, reader, cache_budget, options.prefetch)?,
            n_layers,
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            tokenizer,
            options,
            plan,
            prefill_chunk,
            reserved_chunk,
            expert_bytes,
            spine_int8,
            host_tier,
            spine_bytes,
            fingerprint: hasher.finalize(),
            model,
            spine,
            open_reads,
            open_times: OpenTimes {
                before_load_secs: (loading - opening).as_secs_f64(),
                load_secs: (load_done - loading).as_secs_f64(),
                after_load_secs: load_done.elapsed().as_secs_f64(),
            },
            layer_bytes,
            experts,
        })
    }

    /// Where [`Self::open`]'s time went.
    pub fn open_times(&self) -> OpenTimes {
        self.open_times
    }

    /// The spine reads made while the model was opened (bytes, tensors, and the seconds the load was blocked in
    /// them, the rest of the open being its own work).
    pub fn open_reads(&self) -> SpineReadStats {
        self.open_reads
    }

    /// Host-to-device uploads through the GPU's pinned staging buffers since open began (the spine at open; streamed
    /// layers after), and how the GPU's kernels were compiled or taken from the cache; `None` on the CPU.
    #[cfg(feature = "cuda")]
    pub fn gpu_staging_stats(
        &self,
    ) -> Option<(
        deltafin_quant::cuda::StagingStats,
        deltafin_quant::cuda::KernelInit,
    )> {
        self.model
            .gpu()
            .map(|g| (g.staging_stats(), g.kernel_init()))
    }

    /// Experts not yet on local disk (a streaming install still filling); `None` for a full install.
    pub fn missing_experts(&self) -> Option<Missing> {
        self.experts.inner().missing().filter(|m| m.experts > 0)
    }

    /// The rate at which experts are read from local storage through the engine's own read path (bytes per second,
    /// over `spans` experts; see [`ExpertStore::expert_read_rate`]). Benchmarks take their I/O bound from it.
    pub fn expert_read_rate(&self, spans: usize) -> Result<f64> {
        self.experts.inner().expert_read_rate(spans)
    }

    /// Runs `f` (a pass of `tokens` tokens) with the expert cache shrunk by the scratch the pass needs beyond the
    /// plan's reservation (see `budget::auto_prefill_chunk`), so the engine stays inside its memory budget; the
    /// cache gets its bytes back afterwards (it refills as experts are read).
    pub(crate) fn with_pass_scratch<T>(&self, tokens: usize, f: impl FnOnce() -> T) -> T {
        let extra = budget::extra_scratch(self.config(), tokens, self.reserved_chunk);
        if extra == 0 {
            return f();
        }
        let store = self.experts.inner();
        store.shrink_cache(extra);
        let out = f();
        store.shrink_cache(0);
        out
    }

    /// Empties the expert cache (benchmarks that compare cold runs).
    pub fn clear_expert_cache(&self) {
        self.experts.inner().clear_cache()
    }

    /// Bytes of one routed expert as stored (0 for a model without experts).
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    /// Reads every expert it can into the RAM cache (whole layers, while the cache's budget allows); returns how many
    /// experts the cache holds. For benchmarks of compute with every weight resident.
    pub fn warm_expert_cache(&self) -> Result<usize> {
        self.experts.inner().warm()
    }

    /// Expert cache hits and misses, disk reads and network fetches so far.
    pub fn expert_stats(&self) -> ExpertStats {
        self.experts.inner().stats()
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The model's tokenizer, when the directory has one (`tiktoken.model` + `tokenizer_config.json`).
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The tokenizer, or a clear error naming the model directory.
    pub fn require_tokenizer(&self) -> Result<&Arc<Tokenizer>> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| RuntimeError::Tokenizer {
                dir: self.dir.clone(),
                msg: format!("no {TOKENIZER_FILE}: this model has no tokenizer; use token ids"),
            })
    }

    /// How routed experts read their inputs on the CPU (`K3_EXPERT_INPUT`).
    pub fn expert_input(&self) -> ExpertInput {
        self.model.expert_input()
    }

    /// The memory budget in bytes.
    pub fn memory_budget(&self) -> u64 {
        self.plan.budget
    }

    /// How the memory budget is spent (resident spine, streaming, session state, reads, scratch, expert cache).
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Whether the spine came from the int8 copy.
    pub fn spine_is_int8(&self) -> bool {
        self.spine_int8
    }

    /// Where the model runs: `cpu` or `cuda (<GPU name>)`.
    pub fn device_name(&self) -> &str {
        self.model.device_name()
    }

    /// Counters of the GPU expert cache (`None` on the CPU).
    #[cfg(feature = "cuda")]
    pub fn expert_cache_stats(&self) -> Option<deltafin_model::gpu::ExpertCacheStats> {
        self.model.expert_cache_stats()
    }

    /// The options the engine was opened with.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Tokens per prefill pass: `K3_PREFILL_CHUNK`, or under `auto` the longest pass the memory budget has scratch
    /// room for (`budget::auto_prefill_chunk`).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Identifies the model (config and checkpoint size) in snapshots.
    pub fn fingerprint(&self) -> u32 {
        self.fingerprint
    }

    /// Expert requests per layer since open (or the last [`Self::reset_expert_reads`]).
    pub fn expert_reads(&self) -> ExpertReadStats {
        self.experts.stats()
    }

    /// Zeroes the expert request counters.
    pub fn reset_expert_reads(&self) {
        self.experts.reset()
    }

    /// Bytes of the spine (every non-expert tensor) as stored.
    pub fn spine_bytes(&self) -> u64 {
        self.spine_bytes
    }

    /// Layers read from disk at every forward pass (empty when the whole spine is resident).
    pub fn streamed_layers(&self) -> &[usize] {
        self.model.streamed_layers()
    }

    /// The streamed layers whose spine bytes the host keeps in RAM, uploaded to the GPU from there at every pass
    /// (empty on the CPU, and where the memory budget keeps no streamed layer).
    pub fn host_tier_layers(&self) -> &[usize] {
        &self.host_tier
    }

    /// Bytes of the output head as served (a decode step reads all of it).
    pub fn head_bytes(&self) -> u64 {
        self.spine
            .served_bytes(&self.model.config().model_tensor("lm_head.weight"))
    }

    /// Spine bytes per layer, as served (from the int8 copy where it is in use).
    pub fn layer_spine_bytes(&self) -> &[u64] {
        &self.layer_bytes
    }

    /// Spine bytes read by forward passes since open (streamed layers; zero when the spine is resident).
    pub fn spine_reads(&self) -> SpineReadStats {
        self.spine.read_stats()
    }

    /// Bytes forward passes have read from storage since open: expert spans from the device (the read pool's
    /// device bytes) and streamed spine layers.
    pub fn read_bytes(&self) -> u64 {
        self.expert_stats().reader.disk.device_bytes + self.spine_reads().bytes
    }

    /// Time per phase of every forward pass so far.
    pub fn profile(&self) -> deltafin_model::ProfileSnapshot {
        self.model.profile().snapshot()
    }

    /// A new, empty conversation.
    pub fn session(&self) -> Session<'_> {
        Session::new(self)
    }

    pub(crate) fn model(&self) -> &Model {
        &self.model
    }

    pub(crate) fn experts(&self) -> &dyn ExpertSource {
        &self.experts
    }
}

/// Every MoE layer has `num_experts` experts of the configured shape; nothing else has experts.
fn check_experts(dir: &Path, cfg: &ModelConfig, map: &ExpertMap) -> Result<()> {
    let err = |msg: String| RuntimeError::ExpertLayout {
        dir: dir.to_path_buf(),
        msg,
    };
    let (inter, width) = (cfg.moe.inter, cfg.expert_width());
    for layer in 0..cfg.n_layers {
        let found = map.n_experts(layer);
        if !cfg.is_moe_layer(layer) {
            if found != 0 {
                return Err(err(format!(
                    "layer {layer} is dense but has {found} experts"
                )));
            }
            continue;
        }
        if found != cfg.moe.n_experts {
            return Err(err(format!(
                "layer {layer} has {found} experts, config says {}",
                cfg.moe.n_experts
            )));
        }
        for e in 0..found {
            let span = map.span(layer, e)?;
            let expect: Vec<Vec<usize>> = match span.format {
                ExpertFormat::Mxfp4 => vec![
                    vec![inter, width / 2],
                    vec![inter, width / 32],
                    vec![width, inter / 2],
                    vec![width, inter / 32],
                    vec![inter, width / 2],
                    vec![inter, width / 32],
                ],
                ExpertFormat::Dense(_) => {
                    vec![vec![inter, width], vec![width, inter], vec![inter, width]]
                }
            };
            let actual: Vec<Vec<usize>> = span.parts.iter().map(|p| p.shape.clone()).collect();
            if actual != expect {
                return Err(err(format!(
                    "layer {layer} expert {e}: tensor shapes {actual:?}, config implies {expect:?}"
                )));
            }
        }
    }
    Ok(())
}

/// The phases of [`Engine::open`], in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpenTimes {
    /// Reading the shard headers, building the expert map, planning memory, opening the spine source (and on a GPU
    /// opening the device, its kernels compiled or taken from the cache).
    pub before_load_secs: f64,
    /// Loading the model: reading the resident spine and building its layers (on a GPU, uploading them).
    pub load_secs: f64,
    /// The expert store, tokenizer and the rest after the load.
    pub after_load_secs: f64,
}

/// Expert reader threads when `K3_READ_THREADS` is not set. Four keep one NVMe drive busy on their own, but a
/// decode step waits for its expert reads while the streamed spine's eight readers (one layer ahead, with slack)
/// share the disk: with four of the twelve reads in flight the experts' came in slower than the spine's. On a GPU
/// each read lands in a page-locked buffer that goes up by DMA; with four readers the upload helper waited on reads
/// most of a token, and with 12 or 16 the reads competed with the DMA for host memory (docs/CONFIGURATION.md).
const EXPERT_READ_THREADS: usize = 8;

/// Whether the model will load onto a GPU: one is asked for (`cuda`, or `auto`) and opens. Where CUDA is unavailable
/// the model's load says why (`cuda`) or falls back to the CPU (`auto`).
#[cfg(feature = "cuda")]
fn gpu_in_use(options: &EngineOptions) -> bool {
    options.device.pref != deltafin_model::DevicePref::Cpu
        && crate::shared_gpu(&options.device).is_ok()
}

/// Without CUDA the model loads on the CPU.
#[cfg(not(feature = "cuda"))]
fn gpu_in_use(_options: &EngineOptions) -> bool {
    false
}

/// The memory the spine is weighed against under `K3_SPINE=auto`: on a GPU its memory budget (`--vram-gb`, or what is
/// free), since the spine lives there and the host keeps no copy of it; else the RAM budget `ram`.
#[cfg(feature = "cuda")]
fn spine_budget(options: &EngineOptions, on_gpu: bool, ram: u64) -> Result<u64> {
    if !on_gpu {
        return Ok(ram);
    }
    let gpu = crate::shared_gpu(&options.device)
        .map_err(|e| deltafin_model::ModelError::Device(e.to_string()))?;
    Ok(deltafin_model::gpu::vram_budget(
        &gpu,
        options.device.vram_bytes,
    )?)
}

/// Without CUDA the spine is weighed against the RAM budget.
#[cfg(not(feature = "cuda"))]
fn spine_budget(_options: &EngineOptions, _on_gpu: bool, ram: u64) -> Result<u64> {
    Ok(ram)
}

/// The spine reader's buffer hook: on a GPU (whatever the model then keeps there) its buffers are page-locked, so
/// spine tensors go up straight from where they were read, with no staging copy. `None` on the CPU, or when
/// `stage_uploads` asks for the staging path.
#[cfg(feature = "cuda")]
fn gpu_pins(
    options: &EngineOptions,
    on_gpu: bool,
) -> Option<Arc<dyn deltafin_storage::BufferHook>> {
    if !on_gpu || options.device.stage_uploads {
        return None;
    }
    let gpu = crate::shared_gpu(&options.device).ok()?;
    Some(Arc::new(crate::gpu_pins::GpuPins::new(&gpu)))
}

/// Without CUDA there is nothing to page-lock for.
#[cfg(not(feature = "cuda"))]
fn gpu_pins(
    _options: &EngineOptions,
    _on_gpu: bool,
) -> Option<Arc<dyn deltafin_storage::BufferHook>> {
    None
}
