//! KDA on the GPU: a whole layer per call with the activations on the device from the input row to the output row.
//!
//! One upload (the normed input `[T, hidden]`) and one download (the output `[T, hidden]`) per layer: the six input
//! projections in one launch, then one launch for the rest of the layer up to its output projection (the decay
//! gate's second low-rank product `f_b`, the short conv with its windows, the L2 norms and gates, the delta-rule
//! recurrence and the gated RMSNorm: [`super::kda_heads`]), then the output projection, all on the compute stream. The recurrent matrices and the conv windows of the new state stay on the device ([`DeviceKdaState`]);
//! the host copies them only when something reads them there.
//!
//! Device allocations cost 5–20 µs each on the H200 (more than a layer's small kernels), so the intermediates live
//! in one model-wide [`KdaScratch`] reused by every layer and call, and the buffers of dropped states go back to
//! its idle list for the next new state.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice};
use deltafin_quant::cuda::dense::DeviceMatrix;
use deltafin_quant::cuda::{Gpu, StreamTimer};

pub(crate) use super::kda_heads::fits;
use super::kda_heads::{HeadsIo, HeadsScratch, HeadsShape, address, launch};
use super::{cuda_err, sized, started_timer};
use crate::error::{ModelError, Result};
use crate::profile::{Phase, Profile};
use crate::state::KdaState;

/// A KDA layer's state on the GPU: recurrent matrices `[H, D, D]` and conv windows `[3, K-1, C]` (q, k, v).
/// Immutable once made; clones share the buffers.
#[derive(Clone)]
pub struct DeviceKdaState {
    gpu: Arc<Gpu>,
    s: Arc<Pooled>,
    s_len: usize,
    conv: Arc<Pooled>,
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
        let mut v = self.gpu.download(self.s.buf()?).map_err(cuda_err)?;
        v.truncate(self.s_len);
        Ok(v)
    }

    /// The q, k and v conv windows copied to the host.
    pub(crate) fn download_conv(&self) -> Result<[Vec<f32>; 3]> {
        let all = self.gpu.download(self.conv.buf()?).map_err(cuda_err)?;
        let n = self.window_len;
        let part = |i: usize| all.get(i * n..(i + 1) * n).unwrap_or_default().to_vec();
        Ok([part(0), part(1), part(2)])
    }
}

/// Idle state buffers kept for reuse, at most this many (two per KDA layer of K3, with room for a snapshot).
const MAX_IDLE_BUFFERS: usize = 160;

/// A device buffer of a state that goes back to its scratch's idle list when the last state holding it drops.
struct Pooled {
    buf: Option<CudaSlice<f32>>,
    scratch: Arc<KdaScratch>,
}

impl Pooled {
    fn buf(&self) -> Result<&CudaSlice<f32>> {
        self.buf
            .as_ref()
            .ok_or_else(|| ModelError::Device("a KDA state buffer already released".to_string()))
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut idle = self.scratch.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < MAX_IDLE_BUFFERS {
                idle.push(b);
            }
        }
    }
}

/// The intermediates of a KDA call on the device, grown to the largest call so far.
#[derive(Default)]
struct Buffers {
    x: Option<CudaSlice<f32>>,
    q_raw: Option<CudaSlice<f32>>,
    k_raw: Option<CudaSlice<f32>>,
    v_raw: Option<CudaSlice<f32>>,
    f_a: Option<CudaSlice<f32>>,
    b_raw: Option<CudaSlice<f32>>,
    og: Option<CudaSlice<f32>>,
    og_low: Option<CudaSlice<f32>>,
    heads: HeadsScratch,
    out: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    timer: Option<StreamTimer>,
}

/// Device memory shared by a model's KDA layers: the intermediates of one call (layers run one at a time on the
/// compute stream, so one set serves them all; the lock also orders two sessions' calls) and idle state buffers.
#[derive(Default)]
pub struct KdaScratch {
    bufs: Mutex<Buffers>,
    idle: Mutex<Vec<CudaSlice<f32>>>,
}

impl std::fmt::Debug for KdaScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KdaScratch")
    }
}

impl KdaScratch {
    /// A state buffer of exactly `len` values: an idle one, or a new one (contents unspecified).
    fn take(self: &Arc<Self>, gpu: &Gpu, len: usize) -> Result<CudaSlice<f32>> {
        let reused = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.iter()
                .position(|b| b.len() == len.max(1))
                .map(|i| idle.swap_remove(i))
        };
        match reused {
            Some(b) => Ok(b),
            None => gpu.zeros::<f32>(len).map_err(cuda_err),
        }
    }

    fn pooled(self: &Arc<Self>, buf: CudaSlice<f32>) -> Arc<Pooled> {
        Arc::new(Pooled {
            buf: Some(buf),
            scratch: self.clone(),
        })
    }
}

/// The small per-layer vectors the heads' kernels read, on the device.
pub(crate) struct KdaParams {
    gpu: Arc<Gpu>,
    scratch: Arc<KdaScratch>,
    /// Conv taps `[3, C, K]`.
    taps: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    a_exp: CudaSlice<f32>,
    o_norm: CudaSlice<f32>,
    /// Complete once the vectors above have landed (they go up on the weights' upload stream).
    ready: CudaEvent,
}

impl std::fmt::Debug for KdaParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KdaParams({})", self.gpu.name())
    }
}

impl KdaParams {
    /// Uploads a layer's conv taps (q, k, v, each `[C, K]`), `dt_bias` `[C]`, `exp(A_log)` `[H]` and the output
    /// norm's weight `[D]` on the weights' stream ([`Gpu::upload_ahead`]: a streamed layer is built while the layer
    /// before it computes, and must not wait for it).
    pub(crate) fn upload(
        gpu: &Arc<Gpu>,
        scratch: &Arc<KdaScratch>,
        taps: &[Vec<f32>; 3],
        dt_bias: &[f32],
        a_exp: &[f32],
        o_norm: &[f32],
    ) -> Result<Self> {
        let up = |v: &[f32]| gpu.upload_ahead(v).map_err(cuda_err);
        let (taps, dt_bias, a_exp, o_norm) =
            (up(&taps.concat())?, up(dt_bias)?, up(a_exp)?, up(o_norm)?);
        Ok(Self {
            gpu: gpu.clone(),
            scratch: scratch.clone(),
            taps,
            dt_bias,
            a_exp,
            o_norm,
            ready: gpu.uploads_done().map_err(cuda_err)?,
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
/// layer on the CPU. The device's time for the layer goes to `profile` ([`Phase::AttnDevice`]).
pub(crate) fn kda_forward(
    params: &KdaParams,
    m: &KdaMatrices<'_>,
    dims: &KdaDims,
    old: &KdaState,
    (x, t_len): (&[f32], usize),
    profile: &Profile,
) -> Result<Option<(DeviceKdaState, Vec<f32>)>> {
    let gpu = &params.gpu;
    let (h, d, kern) = (dims.heads, dims.head_dim, dims.kern);
    if !fits(gpu, d, kern) || t_len == 0 {
        return Ok(None);
    }
    let c = h * d;
    let (s_len, window_len) = (h * d * d, (kern - 1) * c);
    let n_out = t_len * m.o.rows();
    let scratch = &params.scratch;
    let mut guard = scratch.bufs.lock().unwrap_or_else(|e| e.into_inner());
    let Buffers {
        x: x_buf,
        q_raw,
        k_raw,
        v_raw,
        f_a,
        b_raw,
        og,
        og_low,
        heads,
        out,
        y,
        timer,
    } = &mut *guard;
    let gemm = |w: &DeviceMatrix, input: &CudaSlice<f32>, dst: &mut CudaSlice<f32>| -> Result<()> {
        w.gemm_device(input, t_len, dst)
            .map_err(|e| ModelError::Device(format!("cuda: KDA projection: {e}")))
    };
    let stream = gpu.stream();
    let copy_err =
        |e: cudarc::driver::DriverError| ModelError::Device(format!("cuda: KDA copy: {e}"));
    gpu.wait_uploaded(&params.ready).map_err(cuda_err)?;

    // The row goes into pinned memory before the device's time starts (the stream would sit idle while the host
    // copies it); the device's time runs from its copy up to the output's copy down.
    let mut rows = gpu.row_copies();
    let xd = sized(gpu, x_buf, x.len())?;
    let staged = rows.stage(x).map_err(cuda_err)?;
    let timer = started_timer(gpu, timer)?;
    rows.send(staged, xd).map_err(cuda_err)?;
    let xd: &CudaSlice<f32> = xd;
    // Every product of the input row in one launch: q, k, v, f_a, b and the gate (or its low-rank down).
    let q_raw = sized(gpu, q_raw, t_len * c)?;
    let k_raw = sized(gpu, k_raw, t_len * c)?;
    let v_raw = sized(gpu, v_raw, t_len * c)?;
    let f_a = sized(gpu, f_a, t_len * m.f_a.rows())?;
    let b_raw = sized(gpu, b_raw, t_len * h)?;
    let og = sized(gpu, og, t_len * c)?;
    let gate_in = match &m.gate {
        DeviceGate::Full(w) => w,
        DeviceGate::LowRank { down, .. } => down,
    };
    let mut low = match &m.gate {
        DeviceGate::Full(_) => None,
        DeviceGate::LowRank { down, .. } => Some(sized(gpu, og_low, t_len * down.rows())?),
    };
    {
        let gate_out: &mut CudaSlice<f32> = match low.as_deref_mut() {
            Some(l) => l,
            None => &mut *og,
        };
        DeviceMatrix::gemm_many_device(
            &[m.q, m.k, m.v, m.f_a, m.b, gate_in],
            xd,
            t_len,
            &mut [q_raw, k_raw, v_raw, f_a, b_raw, gate_out],
        )
        .map_err(|e| ModelError::Device(format!("cuda: KDA projections: {e}")))?;
    }
    if let (DeviceGate::LowRank { up, .. }, Some(low)) = (&m.gate, low) {
        gemm(up, low, og)?;
    }

    // The old state where it is: on this device (the recurrence reads its matrices through `s_old` and writes the
    // new ones to `s`; the old state is never written, it may still be used by a snapshot or a rollback), or
    // uploaded from the host into `s`, or cleared there when it is known to be zeros.
    let mut s = scratch.take(gpu, s_len)?;
    let mut s_old: Option<Arc<Pooled>> = None;
    let win = match old.device() {
        Some(dev)
            if Arc::ptr_eq(&dev.gpu, gpu) && dev.s_len == s_len && dev.window_len == window_len =>
        {
            s_old = Some(dev.s.clone());
            dev.conv.clone()
        }
        _ if old.is_zero() => {
            stream.memset_zeros(&mut s).map_err(copy_err)?;
            let mut w = scratch.take(gpu, 3 * window_len)?;
            stream.memset_zeros(&mut w).map_err(copy_err)?;
            scratch.pooled(w)
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
            stream.memcpy_htod(host_s, &mut s).map_err(copy_err)?;
            let mut w = scratch.take(gpu, 3 * window_len)?;
            stream
                .memcpy_htod(&host_conv.concat(), &mut w)
                .map_err(copy_err)?;
            scratch.pooled(w)
        }
    };

    let mut new_win = scratch.take(gpu, 3 * window_len)?;
    let out = sized(gpu, out, t_len * c)?;
    // The decay gate's second low-rank product runs inside the heads' kernel, a row of f_b per channel.
    if m.f_b.rows() != c || m.f_b.cols() != m.f_a.rows() {
        return Err(ModelError::Device(format!(
            "KDA f_b is [{}, {}], the layer needs [{c}, {}]",
            m.f_b.rows(),
            m.f_b.cols(),
            m.f_a.rows()
        )));
    }
    let f_b = m
        .f_b
        .values_for_kernel()
        .map_err(|e| ModelError::Device(format!("cuda: KDA f_b: {e}")))?;
    let state_in = match &s_old {
        Some(p) => address(gpu, p.buf()?),
        None => address(gpu, &s),
    };
    let shape = HeadsShape {
        t_len,
        heads: h,
        d,
        kern,
        rank: m.f_b.cols(),
        lower_bound: dims.lower_bound,
        eps: dims.eps,
    };
    let io = HeadsIo {
        raw: [&*q_raw, &*k_raw, &*v_raw],
        win: win.buf()?,
        taps: &params.taps,
        f_a: &*f_a,
        f_b,
        dt_bias: &params.dt_bias,
        a_exp: &params.a_exp,
        b_raw: &*b_raw,
        gate: &*og,
        norm_w: &params.o_norm,
        state_in,
        state_out: &mut s,
        new_win: &mut new_win,
        out: &mut *out,
    };
    launch(gpu, io, &shape, heads)?;

    let yd = sized(gpu, y, n_out)?;
    gemm(m.o, out, yd)?;
    let y_range = rows.download(&yd.slice(0..n_out)).map_err(cuda_err)?;
    timer.stop(gpu).map_err(cuda_err)?;
    rows.synchronize()
        .map_err(|e| ModelError::Device(format!("cuda: KDA: {e}")))?;
    let y_host = rows.downloaded(y_range).map_err(cuda_err)?.to_vec();
    drop(rows);
    profile.add(Phase::AttnDevice, timer.elapsed().map_err(cuda_err)?);
    drop(guard);
    let state = DeviceKdaState {
        gpu: gpu.clone(),
        s: scratch.pooled(s),
        s_len,
        conv: scratch.pooled(new_win),
        window_len,
    };
    Ok(Some((state, y_host)))
}
