//! [`Engine`]: an opened model (config, checkpoint files, spine, expert source) shared by sessions.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_model::tokenizer::Tokenizer;
use deltafin_model::{DeviceOptions, DevicePref, ExpertInput, ExpertSource, Model, ModelConfig};
use deltafin_storage::{
    ExpertFormat, ExpertMap, HubOptions, Missing, ModelFiles, NoProgress, ReadPoolOptions,
    SpanReader, StreamInstall, is_stream_install,
};

use crate::counters::{CountingExperts, ExpertReadStats};
use crate::error::{Result, RuntimeError};
use crate::pinning::PinLayers;
use crate::session::Session;
use crate::sources::{ExpertStats, ExpertStore};
use crate::spine::{SpineMode, SpineReadStats, SpineSource};

/// The tokenizer's rank file in a model directory.
const TOKENIZER_FILE: &str = "tiktoken.model";

/// Default prefill chunk: tokens per pass, so each expert a chunk needs is read once per layer.
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

/// Options for [`Engine::open`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tokens per prefill pass (`K3_PREFILL_CHUNK`, default 64).
    pub prefill_chunk: usize,
    /// Spine precision (`K3_SPINE`: bf16, int8, auto).
    pub spine: SpineMode,
    /// RAM for weights, in GiB: the resident spine first, the expert cache gets the rest. `None` means
    /// `K3_RAM_GB`, else half of physical memory.
    pub ram_gb: Option<f64>,
    /// Which decoder layers stay in RAM (`K3_PIN_LAYERS`, default `auto`); the others are streamed.
    pub pin_layers: PinLayers,
    /// Reader threads (reads in flight) for expert spans; `None` means the read pool's default.
    pub read_threads: Option<usize>,
    /// Look-ahead prefetch of the next MoE layer's guessed experts (`K3_PREFETCH`, default off).
    pub prefetch: bool,
    /// How routed experts read their inputs on the CPU (`K3_EXPERT_INPUT`: `f32`, the default, matches the f32
    /// reference; `bf16` rounds them as the reference's native dtype does, with faster MXFP4 kernels on CPUs
    /// with AVX-512 BF16).
    pub expert_input: ExpertInput,
    /// How to reach the hub when the model is a streaming install (endpoint, token, retries).
    pub hub: HubOptions,
    /// Where the model runs (`K3_DEV`, default cpu) and the GPU expert cache size (`K3_GPU_CACHE_GB`).
    pub device: DeviceOptions,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            spine: SpineMode::Auto,
            ram_gb: None,
            pin_layers: PinLayers::Auto,
            read_threads: None,
            prefetch: false,
            expert_input: ExpertInput::F32,
            hub: HubOptions::default(),
            device: DeviceOptions::from_env(),
        }
    }
}

impl EngineOptions {
    /// These options with `prefill_chunk` set to `n` (at least 1).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.prefill_chunk = n.max(1);
        self
    }

    /// These options on device `pref` (`cpu`, `cuda` or `auto`).
    pub fn with_device(mut self, pref: DevicePref) -> Self {
        self.device.pref = pref;
        self
    }

    /// These options with the spine precision set to `mode`.
    pub fn with_spine(mut self, mode: SpineMode) -> Self {
        self.spine = mode;
        self
    }

    /// These options with the layer pinning set to `pins`.
    pub fn with_pin_layers(mut self, pins: PinLayers) -> Self {
        self.pin_layers = pins;
        self
    }

    /// These options with look-ahead expert prefetch on or off.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// These options with routed experts reading their inputs as `input`.
    pub fn with_expert_input(mut self, input: ExpertInput) -> Self {
        self.expert_input = input;
        self
    }

    /// Defaults overridden by the environment (`K3_PREFILL_CHUNK`, `K3_SPINE`, `K3_PIN_LAYERS`, `K3_PREFETCH`,
    /// `K3_EXPERT_INPUT`).
    pub fn from_env() -> Result<Self> {
        let expert_input = match std::env::var("K3_EXPERT_INPUT") {
            Ok(v) => v
                .parse()
                .map_err(|e| RuntimeError::Usage(format!("K3_EXPERT_INPUT: {e}")))?,
            Err(_) => ExpertInput::F32,
        };
        let mut o = Self {
            spine: SpineMode::from_env()?,
            pin_layers: PinLayers::from_env()?,
            prefetch: crate::prefetch::prefetch_from_env()?,
            expert_input,
            ..Self::default()
        };
        if let Some(n) = std::env::var("K3_PREFILL_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
        {
            o.prefill_chunk = n;
        }
        Ok(o)
    }
}

/// Copies of a streamed layer's bytes in memory at once, charged to the RAM budget when layers are streamed.
const STREAM_LAYER_COPIES: u64 = 6;

/// Default share of physical memory for weights (resident spine + expert cache) when no budget is given.
const DEFAULT_RAM_SHARE: f64 = 0.5;
/// Budget when physical memory cannot be read.
const FALLBACK_RAM_GB: f64 = 4.0;

impl EngineOptions {
    /// The RAM budget for weights in bytes: `ram_gb`, else `K3_RAM_GB`, else half of physical memory. The
    /// resident spine is charged to it first; the expert cache gets the rest.
    pub fn ram_budget_bytes(&self) -> Result<u64> {
        let gb = match self.ram_gb {
            Some(gb) => gb,
            None => match std::env::var("K3_RAM_GB") {
                Ok(v) => v.trim().parse::<f64>().map_err(|_| {
                    RuntimeError::Usage(format!("K3_RAM_GB={v:?} is not a number of GiB"))
                })?,
                Err(_) => meminfo_bytes("MemTotal")
                    .map_or(FALLBACK_RAM_GB, |b| b as f64 / GIB * DEFAULT_RAM_SHARE),
            },
        };
        if !gb.is_finite() || gb < 0.0 {
            return Err(RuntimeError::Usage(format!(
                "RAM budget {gb} GiB is not a non-negative number"
            )));
        }
        Ok((gb * GIB) as u64)
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// A field of `/proc/meminfo` (`MemTotal`, `MemAvailable`, …) in bytes; `None` where it cannot be read.
fn meminfo_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// An opened model.
pub struct Engine {
    dir: PathBuf,
    tokenizer: Option<Arc<Tokenizer>>,
    options: EngineOptions,
    spine_int8: bool,
    spine_bytes: u64,
    spine: Arc<SpineSource>,
    /// Spine bytes per layer as served (int8 copy or shards).
    layer_bytes: Vec<u64>,
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
        let spine = Arc::new(SpineSource::open(
            Arc::clone(&files),
            options.spine,
            meminfo_bytes("MemAvailable"),
        )?);
        let spine_int8 = spine.is_int8();
        let spine_bytes = spine.stored_bytes();
        let layer_prefixes: Vec<String> = (0..n_layers).map(|l| cfg.layer_tensor(l, "")).collect();
        let layer_bytes: Vec<u64> = layer_prefixes
            .iter()
            .map(|p| spine.served_bytes(p))
            .collect();
        let fixed_bytes = spine
            .served_bytes("")
            .saturating_sub(layer_bytes.iter().sum());
        let resident = options
            .pin_layers
            .resolve(&layer_bytes, fixed_bytes, budget)?;
        let mut model = if resident.iter().all(|&r| r) {
            Model::load_on(cfg, &*spine, &options.device)?
        } else {
            let src: deltafin_model::SharedWeightSource = spine.clone();
            Model::load_streamed(cfg, src, &options.device, &resident)?
        };
        model.set_expert_input(options.expert_input);
        let slow = match options.expert_input {
            ExpertInput::F32 => None,
            ExpertInput::Bf16 => {
                (!deltafin_quant::simd::mxfp4_bf16_is_fast()).then_some("AVX-512 BF16")
            }
            ExpertInput::I16 => {
                (!deltafin_quant::simd::mxfp4_i16_is_fast()).then_some("AVX2 or AVX-512 VNNI")
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
        spine.reset_reads();
        let streamed = model.streamed_layers();
        spine.set_streamed(
            streamed
                .iter()
                .map(|&l| layer_prefixes[l].clone())
                .collect(),
        );
        let resident_bytes = fixed_bytes
            + (0..n_layers)
                .filter(|l| !streamed.contains(l))
                .map(|l| layer_bytes[l])
                .sum::<u64>();
        if resident_bytes > budget {
            tracing::warn!(
                "the resident spine ({:.2} GiB) exceeds the RAM budget ({:.2} GiB); the expert cache gets nothing",
                resident_bytes as f64 / GIB,
                budget as f64 / GIB
            );
        }
        if !streamed.is_empty() {
            tracing::info!(
                "spine: {} of {n_layers} layers streamed, {:.2} GiB resident",
                streamed.len(),
                resident_bytes as f64 / GIB
            );
        }
        // Streaming holds up to six copies of a layer at once: the one computing, the next one built, that one's
        // raw bytes while it is built (read buffers and their copies), and the reads ahead of the two layers after
        // it. They come out of the budget too.
        let stream_bytes =
            STREAM_LAYER_COPIES * streamed.iter().map(|&l| layer_bytes[l]).max().unwrap_or(0);
        let cache_budget = budget.saturating_sub(resident_bytes + stream_bytes);
        let mut pool = ReadPoolOptions::default();
        if let Some(n) = options.read_threads {
            pool.threads = n;
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
            spine_int8,
            spine_bytes,
            fingerprint: hasher.finalize(),
            model,
            spine,
            layer_bytes,
            experts,
        })
    }

    /// Experts not yet on local disk (a streaming install still filling); `None` for a full install.
    pub fn missing_experts(&self) -> Option<Missing> {
        self.experts.inner().missing().filter(|m| m.experts > 0)
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

    /// Spine bytes per layer, as served (from the int8 copy where it is in use).
    pub fn layer_spine_bytes(&self) -> &[u64] {
        &self.layer_bytes
    }

    /// Spine bytes read by forward passes since open (streamed layers; zero when the spine is resident).
    pub fn spine_reads(&self) -> SpineReadStats {
        self.spine.read_stats()
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
