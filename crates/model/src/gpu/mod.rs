//! The graph's CUDA path (feature `cuda`): which device a model runs on, and the GPU halves of the blocks.
//!
//! - Dense (spine) weights are uploaded once at load (`Loader::matrix` attaches a device copy) and every
//!   `ops::linear` with such a weight runs `dense_gemm_*` on the GPU.
//! - KDA: the whole layer runs on the GPU (`kda::kda_forward`: projections, conv, gates, recurrence, gated norm),
//!   one row up and one down per call. The new state stays on the device ([`DeviceKdaState`]); the host copies it
//!   only when something reads it there.
//! - MLA: the whole layer runs on the GPU (`mla::MlaGpu::forward`: projections, norms, the absorbed attention
//!   over a device mirror of the latent cache, gate and output projection), one row up and one down per call; the
//!   mirror uploads only rows it has not seen.
//! - Routed experts: a GPU-memory expert cache in front of host RAM, uploads from pinned buffers on a second
//!   stream, and the MXFP4 kernels ([`experts::GpuExperts`]).
//!
//! - Spine layers stay on the GPU as far as the memory budget allows (`VramPlan`); the others are uploaded by the
//!   spine reader at every forward pass, one layer ahead of the compute.
//!
//! Activations cross PCIe between blocks (rows of `hidden` floats per token): small next to the weights. KDA states
//! are immutable values either way, so snapshots and speculation rollbacks keep the old one, wherever it lives.

pub mod experts;
pub(crate) mod kda;
pub(crate) mod kda_heads;
pub(crate) mod mla;
mod vram;

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use deltafin_quant::cuda::{Gpu, StreamTimer};

use crate::device::{DeviceOptions, DevicePref};
use crate::error::{ModelError, Result};

pub use experts::{ExpertCacheStats, GpuExperts, MoeSplit};
pub use kda::DeviceKdaState;
pub(crate) use mla::{Absorbed, MlaGpu};
pub(crate) use vram::VramPlan;
pub use vram::vram_budget;

/// Maps a CUDA failure into the model's error.
pub(crate) fn cuda_err(e: deltafin_quant::QuantError) -> ModelError {
    ModelError::Device(e.to_string())
}

/// [`deltafin_quant::cuda::sized`] with the model's error: a layer's reused scratch buffer, grown on demand.
pub(crate) fn sized<'a>(
    gpu: &Gpu,
    slot: &'a mut Option<CudaSlice<f32>>,
    len: usize,
) -> Result<&'a mut CudaSlice<f32>> {
    deltafin_quant::cuda::sized(gpu, slot, len).map_err(cuda_err)
}

/// The timer kept in `slot` (made on first use), started on the compute stream: a layer's device time runs from
/// here to its `stop`.
pub(crate) fn started_timer<'a>(
    gpu: &Gpu,
    slot: &'a mut Option<StreamTimer>,
) -> Result<&'a mut StreamTimer> {
    let timer = match slot {
        Some(t) => t,
        None => slot.insert(StreamTimer::new(gpu).map_err(cuda_err)?),
    };
    timer.start(gpu).map_err(cuda_err)?;
    Ok(timer)
}

/// Resolves `opts` to a GPU, or `None` for the CPU. `cuda` fails with the reason when CUDA is unavailable; `auto`
/// falls back to the CPU with a warning.
pub(crate) fn open(opts: &DeviceOptions) -> Result<Option<Arc<Gpu>>> {
    match opts.pref {
        DevicePref::Cpu => Ok(None),
        DevicePref::Cuda => Gpu::shared_with_cache(opts.kernel_cache.as_deref())
            .map(Some)
            .map_err(cuda_err),
        DevicePref::Auto => match Gpu::shared_with_cache(opts.kernel_cache.as_deref()) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                tracing::warn!("K3_DEV=auto: {e}; running on the CPU");
                Ok(None)
            }
        },
    }
}

/// The GPU parts shared by a model's blocks.
#[derive(Clone)]
pub(crate) struct GpuHandles {
    /// The device.
    pub gpu: Arc<Gpu>,
    /// The routed-expert cache (one per model, shared by its MoE layers).
    pub experts: Arc<GpuExperts>,
    /// The KDA layers' reused device buffers (one per model).
    pub kda: Arc<kda::KdaScratch>,
    /// The MLA layers' reused device buffers (one per model).
    pub mla: Arc<mla::MlaScratch>,
}

impl std::fmt::Debug for GpuHandles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuHandles({})", self.gpu.name())
    }
}
