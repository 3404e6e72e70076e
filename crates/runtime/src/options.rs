//! [`EngineOptions`]: every knob of [`crate::Engine::open`], and the one place that reads them from the
//! environment.
//!
//! Precedence is the same for every frontend: a command-line flag, else the `K3_*` variable, else the default.
//! [`EngineOptions::default`] is the defaults alone (it reads nothing); [`EngineOptions::from_env`] lays the
//! variables over them, and a frontend then sets the fields its flags name. Nothing here writes the environment.
//! A variable with a value that does not parse is an error naming it, never silently ignored.

use deltafin_model::{DeviceOptions, DevicePref, ExpertInput};
use deltafin_storage::HubOptions;

use crate::error::{Result, RuntimeError};
use crate::memory::SystemMemory;
use crate::pinning::PinLayers;
use crate::prefetch::parse_on_off;
use crate::spine::SpineMode;

/// Tokens per prefill pass (`K3_PREFILL_CHUNK`): each expert a pass needs is read once per layer, and a streamed
/// spine layer once per pass, so the longer the pass the fewer bytes a prompt reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillChunk {
    /// The longest pass whose scratch the memory budget gives room for (`auto`, the default; see
    /// `budget::auto_prefill_chunk`).
    Auto,
    /// This many tokens per pass.
    Tokens(usize),
}

impl PrefillChunk {
    /// `auto` or a count of at least 1.
    pub fn parse(v: &str) -> Result<Self> {
        if v.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        Ok(Self::Tokens(parse_count("K3_PREFILL_CHUNK", v)?))
    }
}

impl std::fmt::Display for PrefillChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Tokens(n) => write!(f, "{n}"),
        }
    }
}

/// Default context reserved for a session's MLA latent cache, in tokens (`K3_CONTEXT`).
pub const DEFAULT_CONTEXT: usize = 8192;

/// Every `K3_*` variable [`EngineOptions::from_env`] reads, for help texts and docs.
pub const ENGINE_VARS: &[&str] = &[
    "K3_RAM_GB",
    "K3_PIN_LAYERS",
    "K3_SPINE",
    "K3_PREFETCH",
    "K3_EXPERT_INPUT",
    "K3_PREFILL_CHUNK",
    "K3_CONTEXT",
    "K3_READ_THREADS",
    "K3_DEV",
    "K3_GPU_CACHE_GB",
    "K3_VRAM_GB",
    "K3_GPU_LAYERS",
];

/// Options for [`crate::Engine::open`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tokens per prefill pass (`K3_PREFILL_CHUNK`: `auto`, the default, or a count).
    pub prefill_chunk: PrefillChunk,
    /// Spine precision (`K3_SPINE`: bf16, int8, auto).
    pub spine: SpineMode,
    /// Memory for the engine, in GiB (`K3_RAM_GB`): weights, caches, session state and scratch all come out of
    /// it. `None` means half of what the machine gives this process (physical memory, or the cgroup limit when
    /// that is smaller).
    pub ram_gb: Option<f64>,
    /// Which decoder layers stay in RAM (`K3_PIN_LAYERS`, default `auto`); the others are streamed.
    pub pin_layers: PinLayers,
    /// Reader threads (reads in flight) for expert spans (`K3_READ_THREADS`); `None` means the engine's default, 8
    /// (its `EXPERT_READ_THREADS`).
    pub read_threads: Option<usize>,
    /// Look-ahead prefetch of the next MoE layer's guessed experts (`K3_PREFETCH`, default off).
    pub prefetch: bool,
    /// How routed experts read their inputs on the CPU (`K3_EXPERT_INPUT`: `f32`, the default, matches the f32
    /// reference; `bf16` and `i16` trade a little accuracy for faster kernels).
    pub expert_input: ExpertInput,
    /// Tokens of context a session's MLA latent cache is reserved for (`K3_CONTEXT`); charged to the budget.
    pub context: usize,
    /// How to reach the hub when the model is a streaming install (endpoint, token, retries).
    pub hub: HubOptions,
    /// Where the model runs (`K3_DEV`, default cpu), the GPU memory budget (`K3_VRAM_GB`) and the GPU expert cache
    /// size (`K3_GPU_CACHE_GB`).
    pub device: DeviceOptions,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            prefill_chunk: PrefillChunk::Auto,
            spine: SpineMode::Auto,
            ram_gb: None,
            pin_layers: PinLayers::Auto,
            read_threads: None,
            prefetch: false,
            expert_input: ExpertInput::F32,
            context: DEFAULT_CONTEXT,
            hub: HubOptions::default(),
            device: DeviceOptions::default(),
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Default share of usable memory for the engine when no budget is given.
const DEFAULT_RAM_SHARE: f64 = 0.5;
/// Largest share of usable memory a budget may ask for: the rest is the process's code, the allocator's slack, the
/// page cache of streamed reads and the rest of the system.
pub const MAX_RAM_SHARE: f64 = 0.9;
/// Budget when the platform gives no memory figure.
const FALLBACK_RAM_GB: f64 = 4.0;

impl EngineOptions {
    /// The defaults with every `K3_*` variable of [`ENGINE_VARS`] that is set laid over them.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`Self::from_env`], reading variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut o = Self::default();
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let bad = |name: &str, v: &str, want: &str| {
            RuntimeError::Usage(format!("{name}={v:?}: expected {want}"))
        };
        if let Some(v) = var("K3_RAM_GB") {
            o.ram_gb = Some(parse_gib("K3_RAM_GB", &v)?);
        }
        if let Some(v) = var("K3_PIN_LAYERS") {
            o.pin_layers = PinLayers::parse(&v)?;
        }
        if let Some(v) = var("K3_SPINE") {
            o.spine = SpineMode::parse(&v)?;
        }
        if let Some(v) = var("K3_PREFETCH") {
            o.prefetch = parse_on_off(&v).ok_or_else(|| bad("K3_PREFETCH", &v, "on or off"))?;
        }
        if let Some(v) = var("K3_EXPERT_INPUT") {
            o.expert_input = v
                .parse()
                .map_err(|e| RuntimeError::Usage(format!("K3_EXPERT_INPUT: {e}")))?;
        }
        if let Some(v) = var("K3_PREFILL_CHUNK") {
            o.prefill_chunk = PrefillChunk::parse(&v)?;
        }
        if let Some(v) = var("K3_CONTEXT") {
            o.context = parse_count("K3_CONTEXT", &v)?;
        }
        if let Some(v) = var("K3_READ_THREADS") {
            o.read_threads = Some(parse_count("K3_READ_THREADS", &v)?);
        }
        if let Some(v) = var("K3_DEV") {
            o.device.pref = v
                .parse::<DevicePref>()
                .map_err(|e| RuntimeError::Usage(format!("K3_DEV: {e}")))?;
        }
        if let Some(v) = var("K3_GPU_CACHE_GB") {
            o.device.gpu_cache_bytes = Some((parse_gib("K3_GPU_CACHE_GB", &v)? * GIB) as u64);
        }
        if let Some(v) = var("K3_VRAM_GB") {
            o.device.vram_bytes = Some((parse_gib("K3_VRAM_GB", &v)? * GIB) as u64);
        }
        if let Some(v) = var("K3_GPU_LAYERS") {
            o.device.gpu_layers = Some(parse_whole("K3_GPU_LAYERS", &v)?);
        }
        Ok(o)
    }

    /// These options with `prefill_chunk` set to `n` (at least 1).
    pub fn with_prefill_chunk(mut self, n: usize) -> Self {
        self.prefill_chunk = PrefillChunk::Tokens(n.max(1));
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

    /// These options with a memory budget of `gb` GiB.
    pub fn with_ram_gb(mut self, gb: f64) -> Self {
        self.ram_gb = Some(gb);
        self
    }

    /// The memory budget in bytes on this machine: see [`ram_budget`].
    pub fn ram_budget_bytes(&self) -> Result<u64> {
        ram_budget(self.ram_gb, SystemMemory::detect().as_ref())
    }
}

/// The engine's memory budget in bytes: `ram_gb` when given, else half of what `sys` says this process may use.
///
/// A budget larger than 90% of that (physical memory, or the cgroup limit when smaller) is refused with a message
/// that says where the limit comes from: the kernel would otherwise kill the process part way through a run. With
/// no memory figure (an unknown platform) a given budget is taken as it is and the default is 4 GiB.
pub fn ram_budget(ram_gb: Option<f64>, sys: Option<&SystemMemory>) -> Result<u64> {
    let Some(gb) = ram_gb else {
        return Ok(match sys {
            Some(m) => (m.usable() as f64 * DEFAULT_RAM_SHARE) as u64,
            None => (FALLBACK_RAM_GB * GIB) as u64,
        });
    };
    if !gb.is_finite() || gb <= 0.0 {
        return Err(RuntimeError::Usage(format!(
            "memory budget {gb} GiB: expected a positive number of GiB"
        )));
    }
    let bytes = (gb * GIB) as u64;
    if let Some(m) = sys {
        let most = (m.usable() as f64 * MAX_RAM_SHARE) as u64;
        if bytes > most {
            return Err(RuntimeError::Budget(format!(
                "a memory budget of {gb} GiB is more than this machine can give: {} allows this process {:.1} GiB, \
                 and a budget may use at most {:.0}% of that ({:.1} GiB); set K3_RAM_GB (or --ram-gb) to {:.1} or less",
                m.usable_source(),
                m.usable() as f64 / GIB,
                MAX_RAM_SHARE * 100.0,
                most as f64 / GIB,
                most as f64 / GIB,
            )));
        }
    }
    Ok(bytes)
}

/// A positive number of GiB (fractions allowed).
fn parse_gib(name: &str, v: &str) -> Result<f64> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|g| g.is_finite() && *g > 0.0)
        .ok_or_else(|| {
            RuntimeError::Usage(format!("{name}={v:?}: expected a positive number of GiB"))
        })
}

/// A whole number, zero included.
fn parse_whole(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| RuntimeError::Usage(format!("{name}={v:?}: expected a whole number")))
}

/// A positive whole number.
fn parse_count(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            RuntimeError::Usage(format!("{name}={v:?}: expected a positive whole number"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryLimit;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn defaults_read_nothing() {
        let o = EngineOptions::from_vars(vars(&[])).expect("no variables");
        assert_eq!(o.ram_gb, None);
        assert_eq!(o.spine, SpineMode::Auto);
        assert_eq!(o.prefill_chunk, PrefillChunk::Auto);
        assert_eq!(o.context, DEFAULT_CONTEXT);
        assert_eq!(o.read_threads, None);
        assert_eq!(o.device.pref, DevicePref::Cpu);
        assert!(!o.prefetch);
    }

    #[test]
    fn every_variable_is_read() {
        let o = EngineOptions::from_vars(vars(&[
            ("K3_RAM_GB", "12.5"),
            ("K3_PIN_LAYERS", "0-3"),
            ("K3_SPINE", "int8"),
            ("K3_PREFETCH", "on"),
            ("K3_EXPERT_INPUT", "i16"),
            ("K3_PREFILL_CHUNK", "128"),
            ("K3_CONTEXT", "4096"),
            ("K3_READ_THREADS", "8"),
            ("K3_DEV", "auto"),
            ("K3_GPU_CACHE_GB", "2"),
            ("K3_VRAM_GB", "24"),
            ("K3_GPU_LAYERS", "0"),
        ]))
        .expect("valid values");
        assert_eq!(o.ram_gb, Some(12.5));
        assert_eq!(o.pin_layers, PinLayers::Ranges(vec![0..=3]));
        assert_eq!(o.spine, SpineMode::Int8);
        assert!(o.prefetch);
        assert_eq!(o.expert_input, ExpertInput::I16);
        assert_eq!(o.prefill_chunk, PrefillChunk::Tokens(128));
        assert_eq!(o.context, 4096);
        assert_eq!(o.read_threads, Some(8));
        assert_eq!(o.device.pref, DevicePref::Auto);
        assert_eq!(o.device.gpu_cache_bytes, Some(2 << 30));
        assert_eq!(o.device.vram_bytes, Some(24 << 30));
        assert_eq!(o.device.gpu_layers, Some(0));
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (name, value) in [
            ("K3_RAM_GB", "lots"),
            ("K3_RAM_GB", "-1"),
            ("K3_PIN_LAYERS", "some"),
            ("K3_SPINE", "fp8"),
            ("K3_PREFETCH", "maybe"),
            ("K3_EXPERT_INPUT", "f64"),
            ("K3_PREFILL_CHUNK", "0"),
            ("K3_CONTEXT", "x"),
            ("K3_READ_THREADS", "0"),
            ("K3_DEV", "metal"),
            ("K3_GPU_CACHE_GB", "nan"),
            ("K3_VRAM_GB", "-3"),
            ("K3_GPU_LAYERS", "-1"),
        ] {
            let err = EngineOptions::from_vars(vars(&[(name, value)]))
                .expect_err("a bad value is an error")
                .to_string();
            assert!(err.contains(name), "{name}={value}: {err}");
        }
    }

    fn machine(total_gib: u64, limit_gib: Option<u64>) -> SystemMemory {
        SystemMemory {
            total: total_gib << 30,
            available: None,
            limit: limit_gib.map(|g| MemoryLimit {
                bytes: g << 30,
                file: "/sys/fs/cgroup/memory.max".into(),
            }),
        }
    }

    #[test]
    fn the_default_budget_is_half_of_the_cgroup_limit() {
        assert_eq!(
            ram_budget(None, Some(&machine(128, None))).ok(),
            Some(64 << 30)
        );
        assert_eq!(
            ram_budget(None, Some(&machine(128, Some(4)))).ok(),
            Some(2 << 30)
        );
        assert_eq!(ram_budget(None, None).ok(), Some(4 << 30));
    }

    #[test]
    fn a_budget_the_machine_cannot_give_is_refused() {
        let m = machine(128, Some(14));
        assert_eq!(ram_budget(Some(12.0), Some(&m)).ok(), Some(12 << 30));
        let err = ram_budget(Some(13.0), Some(&m)).expect_err("over 90% of 14 GiB");
        let msg = err.to_string();
        assert!(msg.contains("cgroup") && msg.contains("12.6"), "{msg}");
        let err = ram_budget(Some(120.0), Some(&machine(128, None))).expect_err("over 90% of 128");
        assert!(err.to_string().contains("physical memory"), "{err}");
        assert!(ram_budget(Some(0.0), None).is_err());
        assert_eq!(ram_budget(Some(1000.0), None).ok(), Some(1000 << 30));
    }
}
