//! The graph's CUDA path (feature `cuda`): which device a model runs on, and the GPU halves of the blocks.
//!
//! - Dense (spine) weights are uploaded once at load (`Loader::matrix` attaches a device copy) and every
//!   `ops::linear` with such a weight runs `dense_gemm_*` on the GPU.
//! - KDA: the whole layer runs on the GPU ([`kda::kda_forward`]: projections, conv, gates, recurrence, gated norm),
//!   one row up and one down per call. The new state stays on the device ([`DeviceKdaState`]); the host copies it
//!   only when something reads it there.
//! - MLA: the absorbed attention over the latent cache runs on the GPU ([`MlaGpu`]), with a device mirror of the
//!   cache that uploads only rows it has not seen.
//! - Routed experts: a GPU-memory expert cache in front of host RAM, uploads from pinned buffers on a second
//!   stream, and the MXFP4 kernels ([`experts::GpuExperts`]).
//!
//! - Spine layers stay on the GPU as far as the memory budget allows ([`VramPlan`]); the others are uploaded by the
//!   spine reader at every forward pass, one layer ahead of the compute.
//!
//! Activations cross PCIe between blocks (rows of `hidden` floats per token): small next to the weights. KDA states
//! are immutable values either way, so snapshots and speculation rollbacks keep the old one, wherever it lives.

pub mod experts;
pub(crate) mod kda;
mod vram;

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_quant::DenseMatrix;
use deltafin_quant::cuda::Gpu;

use crate::device::{DeviceOptions, DevicePref};
use crate::error::{ModelError, Result};
use crate::state::MlaCache;

pub use experts::{ExpertCacheStats, GpuExperts};
pub use kda::DeviceKdaState;
pub(crate) use vram::VramPlan;

/// Maps a CUDA failure into the model's error.
pub(crate) fn cuda_err(e: deltafin_quant::QuantError) -> ModelError {
    ModelError::Device(e.to_string())
}

/// Resolves `opts` to a GPU, or `None` for the CPU. `cuda` fails with the reason when CUDA is unavailable; `auto`
/// falls back to the CPU with a warning.
pub(crate) fn open(opts: &DeviceOptions) -> Result<Option<Arc<Gpu>>> {
    match opts.pref {
        DevicePref::Cpu => Ok(None),
        DevicePref::Cuda => Gpu::shared().map(Some).map_err(cuda_err),
        DevicePref::Auto => match Gpu::shared() {
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
}

impl std::fmt::Debug for GpuHandles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuHandles({})", self.gpu.name())
    }
}

/// The rows of the latent cache already on the device, and the host blocks they came from.
#[derive(Default)]
struct Mirror {
    blocks: Vec<Arc<Vec<f32>>>,
    buf: Option<CudaSlice<f32>>,
    cap_rows: usize,
}

/// One MLA layer's absorbed-attention weights on the GPU and its device mirror of the latent cache.
pub(crate) struct MlaGpu {
    gpu: Arc<Gpu>,
    /// `[heads, kv_lora, nope]`.
    w_uk_t: CudaSlice<f32>,
    /// `[heads, v, kv_lora]`.
    w_uv: CudaSlice<f32>,
    heads: usize,
    nope: usize,
    rope: usize,
    kvl: usize,
    vd: usize,
    mirror: Mutex<Mirror>,
}

impl std::fmt::Debug for MlaGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MlaGpu({} heads)", self.heads)
    }
}

/// Threads per block of `mla_attend`.
const MLA_THREADS: usize = 256;

impl MlaGpu {
    /// Stacks the per-head matrices and uploads them.
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        w_uk_t: &[DenseMatrix],
        w_uv: &[DenseMatrix],
        (nope, rope, kvl, vd): (usize, usize, usize, usize),
    ) -> Result<Self> {
        let stack = |ms: &[DenseMatrix]| -> Vec<f32> {
            ms.iter()
                .flat_map(|m| (0..m.rows()).flat_map(move |r| m.row_f32(r)))
                .collect()
        };
        Ok(Self {
            gpu: gpu.clone(),
            w_uk_t: gpu.upload(&stack(w_uk_t)).map_err(cuda_err)?,
            w_uv: gpu.upload(&stack(w_uv)).map_err(cuda_err)?,
            heads: w_uk_t.len(),
            nope,
            rope,
            kvl,
            vd,
            mirror: Mutex::new(Mirror::default()),
        })
    }

    /// Attention of the `t_len` query rows `q [T, heads, nope + rope]` over `cache` (which already holds these
    /// rows after its first `past`), returning `[T, heads · v]`.
    pub(crate) fn attend(
        &self,
        q: &[f32],
        cache: &MlaCache,
        past: usize,
        t_len: usize,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let gpu = &self.gpu;
        let row = self.kvl + self.rope;
        let n_cache = cache.len();
        let mut mirror = self
            .mirror
            .lock()
            .map_err(|_| ModelError::Device("mla cache mirror lock poisoned".to_string()))?;
        sync_mirror(gpu, &mut mirror, cache, row)?;
        let Some(cache_dev) = mirror.buf.as_ref() else {
            return Err(ModelError::Device("mla cache mirror is empty".to_string()));
        };
        let qd = gpu.upload(q).map_err(cuda_err)?;
        let mut scores = gpu
            .zeros::<f32>(self.heads * t_len * n_cache)
            .map_err(cuda_err)?;
        let mut out = gpu
            .zeros::<f32>(t_len * self.heads * self.vd)
            .map_err(cuda_err)?;
        let f = gpu.function("mla_attend").map_err(cuda_err)?;
        let smem = (2 * self.kvl + self.nope + self.rope + MLA_THREADS / 32) * 4;
        let cfg = LaunchConfig {
            grid_dim: (self.heads as u32, t_len as u32, 1),
            block_dim: (MLA_THREADS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let ints = [
            t_len as i32,
            past as i32,
            n_cache as i32,
            self.heads as i32,
            self.nope as i32,
            self.rope as i32,
            self.kvl as i32,
            self.vd as i32,
        ];
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&qd)
            .arg(cache_dev)
            .arg(&self.w_uk_t)
            .arg(&self.w_uv)
            .arg(&mut scores)
            .arg(&mut out);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        // SAFETY: q is [t_len, heads, nope+rope]; the mirror holds n_cache rows of kvl+rope floats (synced above);
        // the weights are [heads, kvl, nope] and [heads, vd, kvl]; scores and out have the sizes the kernel
        // indexes; past + t_len == n_cache, so every visible row exists.
        unsafe { b.launch(cfg) }
            .map_err(|e| ModelError::Device(format!("cuda: mla_attend: {e}")))?;
        let mut o = gpu.download(&out).map_err(cuda_err)?;
        o.truncate(t_len * self.heads * self.vd);
        Ok(o)
    }
}

/// Makes the device mirror hold exactly `cache`'s rows, uploading only blocks it does not share with the host
/// cache (blocks are immutable, so pointer identity means equal contents; the mirror keeps them alive).
fn sync_mirror(gpu: &Gpu, m: &mut Mirror, cache: &MlaCache, row: usize) -> Result<()> {
    let blocks = cache.blocks();
    let n_rows = cache.len();
    let mut common = m
        .blocks
        .iter()
        .zip(blocks)
        .take_while(|(a, b)| Arc::ptr_eq(a, b))
        .count();
    if n_rows > m.cap_rows || m.buf.is_none() {
        let cap = n_rows.max(2 * m.cap_rows).max(256);
        m.buf = Some(gpu.zeros::<f32>(cap * row).map_err(cuda_err)?);
        m.cap_rows = cap;
        common = 0;
    }
    let Some(buf) = m.buf.as_mut() else {
        return Ok(());
    };
    let mut offset: usize = blocks[..common].iter().map(|b| b.len()).sum();
    for b in &blocks[common..] {
        let mut dst = buf.slice_mut(offset..offset + b.len());
        gpu.stream()
            .memcpy_htod(b.as_slice(), &mut dst)
            .map_err(|e| ModelError::Device(format!("cuda: latent cache upload: {e}")))?;
        offset += b.len();
    }
    m.blocks = blocks.to_vec();
    Ok(())
}
