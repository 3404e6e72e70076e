//! KDA on the GPU: a whole layer per call with the activations on the device from the input row to the output row.
//!
//! One upload (the normed input `[T, hidden]`) and one download (the output `[T, hidden]`) per layer: the six input
//! projections, the decay gate's `f_b`, the short conv with its windows, the L2 norms and gates
//! (`kda_prepare`), the delta-rule recurrence (`kda_recurrent`), the gated RMSNorm (`kda_gated_norm`) and the
//! output projection all run on the compute stream. The recurrent matrices and the conv windows of the new state
//! stay on the device ([`DeviceKdaState`]); the host copies them only when something reads them there.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_quant::cuda::Gpu;
use deltafin_quant::cuda::dense::DeviceMatrix;

use super::cuda_err;
use crate::error::{ModelError, Result};
use crate::state::KdaState;

/// Widest head the recurrence kernel takes (a thread per value channel, four key parts).
const MAX_HEAD_DIM: usize = 256;
/// KDA per-head shared memory of `kda_recurrent`: the state, q, k, exp(g) and the partial sums of 4 key parts.
fn recurrence_smem_bytes(d: usize) -> usize {
    (d * d + 3 * d + 4 * d) * 4
}

/// Whether a layer with heads of width `d` and a conv of `kern` taps fits the kernels on `gpu`.
pub(crate) fn fits(gpu: &Gpu, d: usize, kern: usize) -> bool {
    (1..=MAX_HEAD_DIM).contains(&d) && kern >= 1 && recurrence_smem_bytes(d) <= gpu.smem_limit()
}

/// A KDA layer's state on the GPU: recurrent matrices `[H, D, D]` and conv windows `[3, K-1, C]` (q, k, v).
/// Immutable once made; clones share the buffers.
#[derive(Clone)]
pub struct DeviceKdaState {
    gpu: Arc<Gpu>,
    s: Arc<CudaSlice<f32>>,
    s_len: usize,
    conv: Arc<CudaSlice<f32>>,
    /// Values of one window (`(K-1) · C`).
    window_len: usize,
}

impl std::fmt::Debug for DeviceKdaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceKdaState({} + 3 x {} values on the GPU)",
            self.s_len, self.window_len
        )
    }
}

impl DeviceKdaState {
    /// The recurrent matrices copied to the host.
    pub(crate) fn download(&self) -> Result<Vec<f32>> {
        let mut v = self.gpu.download(&self.s).map_err(cuda_err)?;
        v.truncate(self.s_len);
        Ok(v)
    }

    /// The q, k and v conv windows copied to the host.
    pub(crate) fn download_conv(&self) -> Result<[Vec<f32>; 3]> {
        let all = self.gpu.download(&self.conv).map_err(cuda_err)?;
        let n = self.window_len;
        let part = |i: usize| all.get(i * n..(i + 1) * n).unwrap_or_default().to_vec();
        Ok([part(0), part(1), part(2)])
    }
}

/// The small per-layer vectors `kda_prepare` and `kda_gated_norm` read, on the device.
pub(crate) struct KdaParams {
    gpu: Arc<Gpu>,
    /// Conv taps `[3, C, K]`.
    taps: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    a_exp: CudaSlice<f32>,
    o_norm: CudaSlice<f32>,
}

impl std::fmt::Debug for KdaParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KdaParams({})", self.gpu.name())
    }
}

impl KdaParams {
    /// Uploads a layer's conv taps (q, k, v, each `[C, K]`), `dt_bias` `[C]`, `exp(A_log)` `[H]` and the output
    /// norm's weight `[D]`.
    pub(crate) fn upload(
        gpu: &Arc<Gpu>,
        taps: &[Vec<f32>; 3],
        dt_bias: &[f32],
        a_exp: &[f32],
        o_norm: &[f32],
    ) -> Result<Self> {
        let up = |v: &[f32]| gpu.upload(v).map_err(cuda_err);
        Ok(Self {
            gpu: gpu.clone(),
            taps: up(&taps.concat())?,
            dt_bias: up(dt_bias)?,
            a_exp: up(a_exp)?,
            o_norm: up(o_norm)?,
        })
    }

    /// The device.
    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

/// The output gate's device matrices.
pub(crate) enum DeviceGate<'a> {
    Full(&'a DeviceMatrix),
    LowRank {
        down: &'a DeviceMatrix,
        up: &'a DeviceMatrix,
    },
}

/// A layer's projections on the device.
pub(crate) struct KdaMatrices<'a> {
    pub q: &'a DeviceMatrix,
    pub k: &'a DeviceMatrix,
    pub v: &'a DeviceMatrix,
    pub f_a: &'a DeviceMatrix,
    pub f_b: &'a DeviceMatrix,
    pub b: &'a DeviceMatrix,
    pub gate: DeviceGate<'a>,
    pub o: &'a DeviceMatrix,
}

/// A layer's sizes and scalars.
pub(crate) struct KdaDims {
    pub heads: usize,
    pub head_dim: usize,
    pub kern: usize,
    /// K3's gate lower bound (`None`: Kimi Linear's softplus gate).
    pub lower_bound: Option<f32>,
    pub eps: f32,
}

/// Runs one KDA layer on the GPU for the rows `x [T, hidden]` from the state `old` (its device buffers when a CUDA
/// pass made them, else its host values uploaded). Returns the new state, left on the device, and the output rows
/// `[T, hidden]`; `None` for no tokens or a head that does not fit the kernels ([`fits`]): the caller runs the
/// layer on the CPU.
pub(crate) fn kda_forward(
    params: &KdaParams,
    m: &KdaMatrices<'_>,
    dims: &KdaDims,
    old: &KdaState,
    x: &[f32],
    t_len: usize,
) -> Result<Option<(DeviceKdaState, Vec<f32>)>> {
    let gpu = &params.gpu;
    let (h, d, kern) = (dims.heads, dims.head_dim, dims.kern);
    if !fits(gpu, d, kern) || t_len == 0 {
        return Ok(None);
    }
    let smem = recurrence_smem_bytes(d);
    let c = h * d;
    let (s_len, window_len) = (h * d * d, (kern - 1) * c);
    let dev_err = |what: &str, e: deltafin_quant::QuantError| {
        ModelError::Device(format!("cuda: KDA {what}: {e}"))
    };
    let zeros = |n: usize| gpu.zeros::<f32>(n).map_err(cuda_err);
    let gemm = |w: &DeviceMatrix, input: &CudaSlice<f32>| -> Result<CudaSlice<f32>> {
        let mut y = zeros(t_len * w.rows())?;
        w.gemm_device(input, t_len, &mut y)
            .map_err(|e| dev_err("projection", e))?;
        Ok(y)
    };

    let xd = gpu.upload(x).map_err(cuda_err)?;
    let (q_raw, k_raw, v_raw) = (gemm(m.q, &xd)?, gemm(m.k, &xd)?, gemm(m.v, &xd)?);
    let f_a = gemm(m.f_a, &xd)?;
    let g_raw = gemm(m.f_b, &f_a)?;
    let b_raw = gemm(m.b, &xd)?;
    let og = match &m.gate {
        DeviceGate::Full(w) => gemm(w, &xd)?,
        DeviceGate::LowRank { down, up } => gemm(up, &gemm(down, &xd)?)?,
    };

    // The old state where it is: on this device, or uploaded from the host. The new matrices start as a copy (the
    // old state may still be used: a snapshot, a rollback).
    let (mut s, win) = match old.device() {
        Some(dev)
            if Arc::ptr_eq(&dev.gpu, gpu) && dev.s_len == s_len && dev.window_len == window_len =>
        {
            let s = gpu
                .stream()
                .clone_dtod(&*dev.s)
                .map_err(|e| ModelError::Device(format!("cuda: copying a KDA state: {e}")))?;
            (s, dev.conv.clone())
        }
        _ => {
            let (host_s, host_conv) = (old.s()?, old.conv()?);
            if host_s.len() != s_len || host_conv.iter().any(|w| w.len() != window_len) {
                return Err(ModelError::Device(format!(
                    "a KDA state of {} values and windows of {}, the layer has {s_len} and {window_len}",
                    host_s.len(),
                    host_conv[0].len()
                )));
            }
            (
                gpu.upload(host_s).map_err(cuda_err)?,
                Arc::new(gpu.upload(&host_conv.concat()).map_err(cuda_err)?),
            )
        }
    };

    let (mut q, mut k, mut v, mut g) = (
        zeros(t_len * c)?,
        zeros(t_len * c)?,
        zeros(t_len * c)?,
        zeros(t_len * c)?,
    );
    let mut beta = zeros(t_len * h)?;
    let mut new_win = zeros(3 * window_len)?;
    let block_x = d.div_ceil(32) as u32 * 32;
    let per_head_token = LaunchConfig {
        grid_dim: (t_len as u32, h as u32, 1),
        block_dim: (block_x, 1, 1),
        shared_mem_bytes: 0,
    };
    let (t_i, h_i, d_i, k_i) = (t_len as i32, h as i32, d as i32, kern as i32);
    let (bounded, lb) = match dims.lower_bound {
        Some(lb) => (1i32, lb),
        None => (0i32, 0.0f32),
    };
    let f = gpu.function("kda_prepare").map_err(cuda_err)?;
    let mut lb_ = gpu.stream().launch_builder(f);
    lb_.arg(&q_raw)
        .arg(&k_raw)
        .arg(&v_raw)
        .arg(&*win)
        .arg(&params.taps)
        .arg(&g_raw)
        .arg(&params.dt_bias)
        .arg(&params.a_exp)
        .arg(&b_raw)
        .arg(&mut q)
        .arg(&mut k)
        .arg(&mut v)
        .arg(&mut g)
        .arg(&mut beta)
        .arg(&mut new_win)
        .arg(&t_i)
        .arg(&h_i)
        .arg(&d_i)
        .arg(&k_i)
        .arg(&bounded)
        .arg(&lb);
    // SAFETY: the raw projections, g_raw, q, k, v and g are [t_len, c]; b_raw and beta [t_len, h]; win and new_win
    // [3, kern-1, c]; taps [3, c, kern]; dt_bias [c]; a_exp [h] (uploaded from the layer's checked shapes); the grid
    // is (t_len, h) with at least d threads a block, and every index the kernel forms stays inside those shapes.
    unsafe { lb_.launch(per_head_token) }
        .map_err(|e| ModelError::Device(format!("cuda: kda_prepare: {e}")))?;

    let mut out = zeros(t_len * c)?;
    let f = gpu.function("kda_recurrent").map_err(cuda_err)?;
    let cfg = LaunchConfig {
        grid_dim: (h as u32, 1, 1),
        block_dim: (d as u32, 4, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&mut s)
        .arg(&q)
        .arg(&k)
        .arg(&v)
        .arg(&g)
        .arg(&beta)
        .arg(&mut out)
        .arg(&t_i)
        .arg(&h_i)
        .arg(&d_i);
    // SAFETY: s is [h, d, d]; q, k, v, g and out are [t_len, c]; beta is [t_len, h]; the block has d*4 threads and
    // `smem` bytes (checked against the device's limit above).
    unsafe { b.launch(cfg) }
        .map_err(|e| ModelError::Device(format!("cuda: kda_recurrent: {e}")))?;

    let f = gpu.function("kda_gated_norm").map_err(cuda_err)?;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&mut out)
        .arg(&og)
        .arg(&params.o_norm)
        .arg(&h_i)
        .arg(&d_i)
        .arg(&dims.eps);
    // SAFETY: out and og are [t_len, c], o_norm is [d]; the grid is (t_len, h) with at least d threads a block.
    unsafe { b.launch(per_head_token) }
        .map_err(|e| ModelError::Device(format!("cuda: kda_gated_norm: {e}")))?;

    let yd = gemm(m.o, &out)?;
    let mut y = gpu.download(&yd).map_err(cuda_err)?;
    y.truncate(t_len * m.o.rows());
    let state = DeviceKdaState {
        gpu: gpu.clone(),
        s: Arc::new(s),
        s_len,
        conv: Arc::new(new_win),
        window_len,
    };
    Ok(Some((state, y)))
}
