//! The engine flags every command that opens a model shares (`run`, `nll`, `serve`, `bench-decode`), and the one
//! way they become [`EngineOptions`]: a flag, else its `K3_*` variable (read by [`EngineOptions::from_env`]), else
//! the default.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use deltafin_runtime::{DevicePref, Engine, EngineOptions, PinLayers, SpineMode};

/// Engine flags; each overrides the `K3_*` variable named in its help.
#[derive(Args, Debug, Default, Clone)]
pub struct EngineArgs {
    /// Memory for the engine in GiB: weights, caches, session state and scratch [K3_RAM_GB; default: half of
    /// physical memory or of the cgroup limit, whichever is smaller].
    #[arg(long)]
    pub ram_gb: Option<f64>,
    /// Decoder layers kept in RAM: auto, all, none, a count N, or ranges such as 0-9,90-92; the rest are streamed
    /// from disk at every forward pass [K3_PIN_LAYERS; default auto].
    #[arg(long)]
    pub pin_layers: Option<String>,
    /// Spine precision: bf16, int8 (the copy written by `cargo xtask convert-spine-int8`) or auto [K3_SPINE; default auto].
    #[arg(long)]
    pub spine: Option<String>,
    /// Look-ahead expert prefetch, on or off: guess the next MoE layer's experts and start reading them early (a
    /// wrong guess costs a read) [K3_PREFETCH; default off].
    #[arg(long, value_parser = parse_on_off)]
    pub prefetch: Option<bool>,
    /// How routed experts read their inputs on the CPU: f32 (exact; matches the f32 reference), bf16 (rounded as
    /// the reference's native dtype does; faster kernels with AVX-512 BF16, slower ones with AVX2 alone) or i16
    /// (quantised per group of 32, within 1/65534 of the group's largest input; faster kernels with AVX-512 VNNI,
    /// AVX2 or NEON) [K3_EXPERT_INPUT; default f32].
    #[arg(long)]
    pub expert_input: Option<deltafin_model::ExpertInput>,
    /// Tokens per prefill pass: auto (the longest pass the memory budget has scratch room for) or a count
    /// [K3_PREFILL_CHUNK; default auto].
    #[arg(long)]
    pub prefill_chunk: Option<String>,
    /// GPU memory for the model in GiB (with `--dev cuda`): spine layers stay on the GPU as far as they fit, the
    /// rest are uploaded at every forward pass [K3_VRAM_GB; default: the free GPU memory less 1 GiB].
    #[arg(long)]
    pub vram_gb: Option<f64>,
    /// Spine layers kept on the GPU at most (with `--dev cuda`); the rest are uploaded at every forward pass
    /// [K3_GPU_LAYERS; default: as many as `--vram-gb` holds].
    #[arg(long)]
    pub gpu_layers: Option<usize>,
    /// Tokens of context reserved for a session's attention cache, charged to the memory budget [K3_CONTEXT;
    /// default 8192].
    #[arg(long)]
    pub context: Option<usize>,
    /// Expert reads in flight (reader threads): more for several NVMe drives or a fast array [K3_READ_THREADS;
    /// default 8].
    #[arg(long)]
    pub read_threads: Option<usize>,
}

/// `on`/`off` (also `1`/`0`, `true`/`false`).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    deltafin_runtime::parse_on_off(s).ok_or_else(|| format!("expected on or off, got `{s}`"))
}

impl EngineArgs {
    /// Opens the model in `model` (the installed demo model when `None`) with [`Self::options`], with the open's
    /// progress bar on a terminal; gives the directory opened with the engine.
    pub fn open(
        &self,
        model: Option<&Path>,
        dev: Option<DevicePref>,
    ) -> anyhow::Result<(PathBuf, Engine)> {
        let dir = match model {
            Some(dir) => dir.to_path_buf(),
            None => crate::demo::default_model_dir()?,
        };
        let engine =
            Engine::open_with_progress(&dir, self.options(dev)?, crate::progress::open_bar())
                .with_context(|| format!("opening model {}", dir.display()))?;
        Ok((dir, engine))
    }

    /// The engine options: these flags over the `K3_*` variables over the defaults; `dev` is the global `--dev`.
    pub fn options(&self, dev: Option<DevicePref>) -> anyhow::Result<EngineOptions> {
        // A variable whose flag is given is not read at all: the flag wins even over a malformed value.
        let overridden = |var: &str| match var {
            "K3_RAM_GB" => self.ram_gb.is_some(),
            "K3_PIN_LAYERS" => self.pin_layers.is_some(),
            "K3_SPINE" => self.spine.is_some(),
            "K3_PREFETCH" => self.prefetch.is_some(),
            "K3_EXPERT_INPUT" => self.expert_input.is_some(),
            "K3_PREFILL_CHUNK" => self.prefill_chunk.is_some(),
            "K3_CONTEXT" => self.context.is_some(),
            "K3_READ_THREADS" => self.read_threads.is_some(),
            "K3_DEV" => dev.is_some(),
            "K3_VRAM_GB" => self.vram_gb.is_some(),
            "K3_GPU_LAYERS" => self.gpu_layers.is_some(),
            _ => false,
        };
        let mut o = EngineOptions::from_vars(|var| {
            (!overridden(var))
                .then(|| std::env::var(var).ok())
                .flatten()
        })
        .context("reading the K3_* settings")?;
        if let Some(gb) = self.ram_gb {
            o.ram_gb = Some(gb);
        }
        if let Some(p) = &self.pin_layers {
            o.pin_layers = PinLayers::parse(p)?;
        }
        if let Some(s) = &self.spine {
            o.spine = SpineMode::parse(s)?;
        }
        if let Some(p) = self.prefetch {
            o.prefetch = p;
        }
        if let Some(i) = self.expert_input {
            o.expert_input = i;
        }
        if let Some(n) = &self.prefill_chunk {
            o.prefill_chunk =
                deltafin_runtime::PrefillChunk::parse(n).context("--prefill-chunk")?;
        }
        if let Some(n) = self.context {
            anyhow::ensure!(n > 0, "--context must be at least 1");
            o.context = n;
        }
        if let Some(n) = self.read_threads {
            anyhow::ensure!(n > 0, "--read-threads must be at least 1");
            o.read_threads = Some(n);
        }
        if let Some(gb) = self.vram_gb {
            anyhow::ensure!(
                gb.is_finite() && gb > 0.0,
                "--vram-gb must be a positive number of GiB"
            );
            o.device.vram_bytes = Some((gb * (1u64 << 30) as f64) as u64);
        }
        if let Some(n) = self.gpu_layers {
            o.device.gpu_layers = Some(n);
        }
        if let Some(d) = dev {
            o.device.pref = d;
        }
        o.device.kernel_cache = Some(crate::paths::root_dir().join("kernels"));
        Ok(o)
    }
}
