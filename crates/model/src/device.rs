//! Where the graph runs (`cpu`, `cuda`, `auto`; the runtime reads `K3_DEV`), the GPU memory budget and the size of
//! the GPU expert cache.
//!
//! `auto` means CUDA when this build has the `cuda` feature and a usable GPU, the CPU otherwise. Asking for `cuda`
//! where it cannot run is an error that says why.

use std::str::FromStr;

/// The device a user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePref {
    /// The f32 CPU kernels.
    #[default]
    Cpu,
    /// CUDA, or an error saying why it is unavailable.
    Cuda,
    /// CUDA when available, else the CPU.
    Auto,
}

impl FromStr for DevicePref {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda),
            "auto" => Ok(Self::Auto),
            other => Err(format!(
                "unknown device `{other}` (expected cpu, cuda or auto)"
            )),
        }
    }
}

impl std::fmt::Display for DevicePref {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Auto => "auto",
        })
    }
}

/// Device choice and GPU knobs for loading a model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceOptions {
    /// Requested device.
    pub pref: DevicePref,
    /// Bytes of GPU memory for routed experts (default: half of the free memory after the spine is loaded, or
    /// what `vram_bytes` leaves).
    pub gpu_cache_bytes: Option<u64>,
    /// Bytes of GPU memory the model may use: spine layers stay on the GPU as far as they fit (with room for two
    /// streamed layers and the expert cache), the rest are uploaded at every forward pass (default: the memory
    /// free when the model opens, less a margin).
    pub vram_bytes: Option<u64>,
    /// At most this many spine layers stay on the GPU (the first ones); the rest are streamed even when the
    /// budget would hold them (default: as many as fit).
    pub gpu_layers: Option<usize>,
    /// Uploads (routed experts, spine tensors) go through a pinned staging copy even where their read buffers could
    /// be page-locked. Default `false`: the read pools' buffers are page-locked and weights go up straight from
    /// them (tests set it to run the staging path too).
    pub stage_uploads: bool,
    /// A directory for the GPU kernels compiled for this machine's GPU, so that later opens load them instead of
    /// compiling (`None`: compile at every open). The frontends pass `{root}/kernels`.
    pub kernel_cache: Option<std::path::PathBuf>,
}

impl DeviceOptions {
    /// These options on device `pref`.
    pub fn with_pref(mut self, pref: DevicePref) -> Self {
        self.pref = pref;
        self
    }
}

/// Whether this build can run on CUDA at all (the `cuda` feature).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_devices() {
        assert_eq!("cpu".parse(), Ok(DevicePref::Cpu));
        assert_eq!("CUDA".parse(), Ok(DevicePref::Cuda));
        assert_eq!("auto".parse(), Ok(DevicePref::Auto));
        assert!("metal".parse::<DevicePref>().is_err());
        assert_eq!(DevicePref::Auto.to_string(), "auto");
    }
}
