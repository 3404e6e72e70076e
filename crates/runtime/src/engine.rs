//! [`Engine`]: an opened model (config, checkpoint files, spine, expert source) shared by sessions.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_model::{DeviceOptions, DevicePref, ExpertSource, Model, ModelConfig};
use deltafin_storage::{ExpertFormat, ExpertMap, ModelFiles};

use crate::counters::{CountingExperts, ExpertReadStats};
use crate::error::{Result, RuntimeError};
use crate::session::Session;
use crate::sources::{ExpertsFromFiles, SpineFromFiles};

/// Default prefill chunk: tokens per pass, so each expert a chunk needs is read once per layer.
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

/// Options for [`Engine::open`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tokens per prefill pass (`K3_PREFILL_CHUNK`, default 64).
    pub prefill_chunk: usize,
    /// Where the model runs (`K3_DEV`, default cpu) and the GPU expert cache size (`K3_GPU_CACHE_GB`).
    pub device: DeviceOptions,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
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

    /// Defaults overridden by the environment (`K3_PREFILL_CHUNK`).
    pub fn from_env() -> Self {
        let mut o = Self::default();
        if let Some(n) = std::env::var("K3_PREFILL_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
        {
            o.prefill_chunk = n;
        }
        o
    }
}

/// An opened model.
pub struct Engine {
    dir: PathBuf,
    options: EngineOptions,
    fingerprint: u32,
    model: Model,
    experts: CountingExperts<ExpertsFromFiles>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.dir).finish()
    }
}

impl Engine {
    /// Opens the model in `dir`: parses `config.json`, reads every shard header, maps the experts and loads the
    /// spine, checking every shape.
    pub fn open(dir: &Path, options: EngineOptions) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(RuntimeError::NoConfig(dir.to_path_buf()));
        }
        let cfg = ModelConfig::from_file(&config_path)?;
        let config_bytes = std::fs::read(&config_path).unwrap_or_default();
        let files = Arc::new(ModelFiles::open(dir)?);
        let map = Arc::new(ExpertMap::build(&files)?);
        check_experts(dir, &cfg, &map)?;
        let n_layers = cfg.n_layers;
        let model = Model::load_on(cfg, &SpineFromFiles { files: &files }, &options.device)?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&config_bytes);
        hasher.update(&files.total_tensor_bytes().to_le_bytes());
        Ok(Self {
            dir: dir.to_path_buf(),
            options,
            fingerprint: hasher.finalize(),
            model,
            experts: CountingExperts::new(ExpertsFromFiles { files, map }, n_layers),
        })
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
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
