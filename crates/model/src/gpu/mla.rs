//! MLA on the GPU: a whole layer per call with the activations on the device from the input row to the output row,
//! over a device mirror of the latent cache.
//!
//! One upload (the normed input `[T, hidden]`) and two downloads (the output `[T, hidden]` and the new compressed
//! KV rows for the host cache) per layer: the query's projections and their RMSNorm, the compressed KV and its norm
//! (written straight into the mirror, `mla_norm_rows`), the output gate, the absorbed attention with the gate
//! applied (`mla_attend`) and the output projection all queue on the compute stream and are waited for once.
//!
//! The mirror holds the cache's rows on the device and the host blocks they came from; blocks are immutable, so
//! pointer identity means equal contents and only rows the mirror has not seen are uploaded (a new conversation,
//! a rollback, another session's cache). Rows this layer computes on the device go into the mirror and down to the
//! host cache: both hold the same values.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_quant::cuda::dense::DeviceMatrix;
use deltafin_quant::cuda::{Gpu, StreamTimer};

use super::{cuda_err, sized, started_timer};
use crate::config::MLA_LORA_NORM_EPS;
use crate::error::{ModelError, Result};
use crate::profile::{Phase, Profile};
use crate::state::{CacheBlock, MlaCache};

/// Threads per block of `mla_attend` (as `MLA_THREADS` in `kernels/attention.cu`).
const MLA_THREADS: usize = 512;
/// Threads per block of `mla_norm_rows`.
const NORM_THREADS: u32 = 256;

/// The rows of the latent cache already on the device, and the host blocks they came from.
#[derive(Default)]
struct Mirror {
    blocks: Vec<Arc<CacheBlock>>,
    buf: Option<CudaSlice<f32>>,
    cap_rows: usize,
}

/// The intermediates of an MLA call on the device, grown to the largest call so far.
#[derive(Default)]
struct Buffers {
    x: Option<CudaSlice<f32>>,
    q_first: Option<CudaSlice<f32>>,
    q: Option<CudaSlice<f32>>,
    kv: Option<CudaSlice<f32>>,
    gate: Option<CudaSlice<f32>>,
    scores: Option<CudaSlice<f32>>,
    out: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    timer: Option<StreamTimer>,
}

/// Device memory shared by a model's MLA layers (layers run one at a time on the compute stream, so one set serves
/// them all; the lock also orders two sessions' calls).
#[derive(Default)]
pub struct MlaScratch {
    bufs: Mutex<Buffers>,
}

impl std::fmt::Debug for MlaScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MlaScratch")
    }
}

/// A layer's projections on the device.
pub(crate) struct MlaMatrices<'a> {
    /// The query's first projection: `q_a` (low rank) or `q_proj`.
    pub q_in: &'a DeviceMatrix,
    /// `q_b` for a low-rank query.
    pub q_b: Option<&'a DeviceMatrix>,
    pub kv_a: &'a DeviceMatrix,
    pub gate: Option<&'a DeviceMatrix>,
    pub o: &'a DeviceMatrix,
}

/// One MLA layer's absorbed-attention weights and norms on the GPU and its device mirror of the latent cache.
pub(crate) struct MlaGpu {
    gpu: Arc<Gpu>,
    scratch: Arc<MlaScratch>,
    /// `[heads, kv_lora, nope]`.
    w_uk_t: CudaSlice<f32>,
    /// `[heads, v, kv_lora]`.
    w_uv: CudaSlice<f32>,
    /// The compressed KV's norm `[kv_lora]`.
    kv_norm: CudaSlice<f32>,
    /// The low-rank query's norm `[q_lora]`.
    q_norm: Option<CudaSlice<f32>>,
    /// Complete once the buffers above have landed (they go up on the weights' upload stream).
    ready: CudaEvent,
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

/// Where an MLA layer's absorbed matrices come from.
pub(crate) enum Absorbed<'a> {
    /// Laid out on the host: every head's `W_UK,hᵀ` `[kv_lora, nope]`, then every head's `W_UV,h` `[v, kv_lora]`.
    Host(&'a [f32], &'a [f32]),
    /// `kv_b` `[heads * (nope + v), kv_lora]` as uploaded on the weights' stream (bf16 bits when the flag is set,
    /// else f32; `DeviceMatrix::float_values`).
    Device(&'a CudaSlice<u8>, bool),
}

/// Threads per block of `mla_absorb`.
const ABSORB_THREADS: u32 = 256;

/// The absorbed matrices `(uk_t, uv)` laid out from `kv_b` on the device by `mla_absorb`, on the weights' upload
/// stream (after `kv_b`'s upload, which that stream already holds or waits for).
fn absorb_on_device(
    gpu: &Arc<Gpu>,
    (kv_b, bf16): (&CudaSlice<u8>, bool),
    heads: usize,
    (nope, vd, kvl): (usize, usize, usize),
) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    let values = heads * (nope + vd) * kvl;
    let bytes = values * if bf16 { 2 } else { 4 };
    if kv_b.len() < bytes || values == 0 {
        return Err(ModelError::Device(format!(
            "MLA's kv_b on the device holds {} bytes, {heads} heads of ({nope} + {vd}) x {kvl} need {bytes}",
            kv_b.len()
        )));
    }
    let stream = gpu.weights_stream();
    let alloc = |n: usize| {
        // SAFETY: `mla_absorb` writes every element below (each of kv_b's values lands in exactly one of them).
        unsafe { stream.alloc::<f32>(n) }
            .map_err(|e| ModelError::Device(format!("cuda: MLA's absorbed matrices: {e}")))
    };
    let (mut uk_t, mut uv) = (alloc(heads * kvl * nope)?, alloc(heads * vd * kvl)?);
    let f = gpu.function("mla_absorb").map_err(cuda_err)?;
    let cfg = LaunchConfig {
        grid_dim: (
            values.div_ceil(ABSORB_THREADS as usize).min(1 << 16) as u32,
            1,
            1,
        ),
        block_dim: (ABSORB_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let dims = [
        bf16 as i32,
        heads as i32,
        nope as i32,
        vd as i32,
        kvl as i32,
    ];
    let mut b = stream.launch_builder(f);
    b.arg(kv_b);
    for d in &dims {
        b.arg(d);
    }
    b.arg(&mut uk_t).arg(&mut uv);
    // SAFETY: the arguments match `mla_absorb`'s signature; kv_b holds `values` elements of its kind (checked above)
    // and the outputs `heads * kvl * nope` and `heads * vd * kvl` floats.
    unsafe { b.launch(cfg) }.map_err(|e| ModelError::Device(format!("cuda: mla_absorb: {e}")))?;
    Ok((uk_t, uv))
}

/// The sizes of an MLA layer: `(nope, rope, kv_lora, v)`.
pub(crate) type MlaDims = (usize, usize, usize, usize);

impl MlaGpu {
    /// Uploads the absorbed per-head matrices (`heads` of each: `[kv_lora, nope]` and `[v, kv_lora]`) with the
    /// norms' weights, on the weights' stream ([`Gpu::upload_ahead`]: a streamed layer is built while the layer
    /// before it computes, and must not wait for it). From [`Absorbed::Device`] they are laid out on the device
    /// (`mla_absorb`, on the weights' stream after `kv_b`'s upload), so the host converts and copies nothing.
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        scratch: &Arc<MlaScratch>,
        (heads, absorbed): (usize, Absorbed<'_>),
        (kv_norm, q_norm): (&[f32], Option<&[f32]>),
        (nope, rope, kvl, vd): MlaDims,
    ) -> Result<Self> {
        let up = |v: &[f32]| gpu.upload_ahead(v).map_err(cuda_err);
        let (w_uk_t, w_uv) = match absorbed {
            Absorbed::Host(w_uk_t, w_uv) => {
                if w_uk_t.len() != heads * kvl * nope || w_uv.len() != heads * vd * kvl {
                    return Err(ModelError::Device(format!(
                        "MLA's absorbed matrices hold {} and {} values, {heads} heads need {} and {}",
                        w_uk_t.len(),
                        w_uv.len(),
                        heads * kvl * nope,
                        heads * vd * kvl
                    )));
                }
                (up(w_uk_t)?, up(w_uv)?)
            }
            Absorbed::Device(kv_b, bf16) => {
                absorb_on_device(gpu, (kv_b, bf16), heads, (nope, vd, kvl))?
            }
        };
        let kv_norm = up(kv_norm)?;
        let q_norm = q_norm.map(up).transpose()?;
        Ok(Self {
            gpu: gpu.clone(),
            scratch: scratch.clone(),
            w_uk_t,
            w_uv,
            kv_norm,
            q_norm,
            ready: gpu.uploads_done().map_err(cuda_err)?,
            heads,
            nope,
            rope,
            kvl,
            vd,
            mirror: Mutex::new(Mirror::default()),
        })
    }

    /// The device.
    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The whole layer for the rows `x [T, hidden]` (already normed): appends their compressed KV to `cache` and
    /// returns the output rows `[T, hidden]`. The device's time for the layer goes to `profile`
    /// ([`Phase::AttnDevice`]).
    pub(crate) fn forward(
        &self,
        m: &MlaMatrices<'_>,
        (x, t_len): (&[f32], usize),
        cache: &mut MlaCache,
        scale: f32,
        profile: &Profile,
    ) -> Result<Vec<f32>> {
        let gpu = &self.gpu;
        let stream = gpu.stream();
        gpu.wait_uploaded(&self.ready).map_err(cuda_err)?;
        let row = self.kvl + self.rope;
        let width = self.heads * self.vd;
        let gemm = |w: &DeviceMatrix, input: &CudaSlice<f32>, dst: &mut CudaSlice<f32>| {
            w.gemm_device(input, t_len, dst)
                .map_err(|e| ModelError::Device(format!("cuda: MLA projection: {e}")))
        };
        if m.kv_a.rows() != row || m.q_b.is_some() != self.q_norm.is_some() {
            return Err(ModelError::Device(format!(
                "MLA on the GPU: kv_a has {} rows for a cache row of {row}, or the query's norm does not match \
                 its projections",
                m.kv_a.rows()
            )));
        }
        let mut guard = self.scratch.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let Buffers {
            x: x_buf,
            q_first,
            q,
            kv,
            gate,
            scores,
            out,
            y,
            timer,
        } = &mut *guard;
        // The row goes into pinned memory before the device's time starts, as in KDA.
        let mut rows = gpu.row_copies();
        let xd = sized(gpu, x_buf, x.len())?;
        let staged = rows.stage(x).map_err(cuda_err)?;
        let timer = started_timer(gpu, timer)?;
        rows.send(staged, xd).map_err(cuda_err)?;
        let xd: &CudaSlice<f32> = xd;
        // The products of the input row in one launch: the query's first projection, the compressed KV and the
        // output gate.
        let q_first = sized(gpu, q_first, t_len * m.q_in.rows())?;
        let kv = sized(gpu, kv, t_len * row)?;
        let gate = match m.gate {
            Some(w) => {
                let g = sized(gpu, gate, t_len * width)?;
                DeviceMatrix::gemm_many_device(
                    &[m.q_in, m.kv_a, w],
                    xd,
                    t_len,
                    &mut [&mut *q_first, &mut *kv, &mut *g],
                )
                .map_err(|e| ModelError::Device(format!("cuda: MLA projections: {e}")))?;
                Some(&*g)
            }
            None => {
                DeviceMatrix::gemm_many_device(
                    &[m.q_in, m.kv_a],
                    xd,
                    t_len,
                    &mut [&mut *q_first, &mut *kv],
                )
                .map_err(|e| ModelError::Device(format!("cuda: MLA projections: {e}")))?;
                None
            }
        };
        let q: &CudaSlice<f32> = match (m.q_b, &self.q_norm) {
            (Some(q_b), Some(norm)) => {
                let r = m.q_in.rows();
                self.norm_in_place(q_first, r, norm, t_len)?;
                let qd = sized(gpu, q, t_len * q_b.rows())?;
                gemm(q_b, q_first, qd)?;
                qd
            }
            _ => q_first,
        };

        let mut mirror = self
            .mirror
            .lock()
            .map_err(|_| ModelError::Device("mla cache mirror lock poisoned".to_string()))?;
        let past = cache.len();
        sync_mirror(gpu, &mut mirror, cache, row, t_len)?;
        let Some(cache_dev) = mirror.buf.as_mut() else {
            return Err(ModelError::Device("mla cache mirror is empty".to_string()));
        };
        // The new rows' compressed KV, normalised into the mirror after the `past` rows it holds.
        {
            let mut dst = cache_dev.slice_mut(past * row..(past + t_len) * row);
            let f = gpu.function("mla_norm_rows").map_err(cuda_err)?;
            let (src_stride, dst_stride, normed, copied) =
                (row as i32, row as i32, self.kvl as i32, self.rope as i32);
            let mut b = stream.launch_builder(f);
            b.arg(&*kv)
                .arg(&src_stride)
                .arg(&mut dst)
                .arg(&dst_stride)
                .arg(&self.kv_norm)
                .arg(&normed)
                .arg(&copied)
                .arg(&MLA_LORA_NORM_EPS);
            // SAFETY: kv holds t_len rows of `row` floats; dst is the mirror's rows past..past + t_len (its capacity
            // was made at least past + t_len rows above); kv_norm has kvl values; one block per row.
            unsafe { b.launch(rows_launch(t_len)) }
                .map_err(|e| ModelError::Device(format!("cuda: mla_norm_rows: {e}")))?;
        }
        let n_cache = past + t_len;
        let cache_dev: &CudaSlice<f32> = cache_dev;
        let out = sized(gpu, out, t_len * width)?;
        let scores = sized(gpu, scores, self.heads * t_len * n_cache)?;
        self.launch_attend(q, cache_dev, scores, gate, out, (t_len, past), scale)?;
        let yd = sized(gpu, y, t_len * m.o.rows())?;
        gemm(m.o, out, yd)?;

        let y_range = rows
            .download(&yd.slice(0..t_len * m.o.rows()))
            .map_err(cuda_err)?;
        let new_range = rows
            .download(&cache_dev.slice(past * row..n_cache * row))
            .map_err(cuda_err)?;
        timer.stop(gpu).map_err(cuda_err)?;
        rows.synchronize()
            .map_err(|e| ModelError::Device(format!("cuda: MLA: {e}")))?;
        let y_host = rows.downloaded(y_range).map_err(cuda_err)?.to_vec();
        let new_rows = rows.downloaded(new_range).map_err(cuda_err)?.to_vec();
        drop(rows);
        profile.add(Phase::AttnDevice, timer.elapsed().map_err(cuda_err)?);
        cache.push_block(&new_rows, row);
        mirror.blocks = cache.blocks().to_vec();
        Ok(y_host)
    }

    /// Attention of the `t_len` query rows `q [T, heads, nope + rope]` over `cache` (which already holds these
    /// rows after its first `past`), returning `[T, heads · v]` (the projections ran on the host).
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
        let mut guard = self.scratch.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let Buffers {
            q: q_buf,
            scores,
            out,
            ..
        } = &mut *guard;
        let mut rows = gpu.row_copies();
        let mut mirror = self
            .mirror
            .lock()
            .map_err(|_| ModelError::Device("mla cache mirror lock poisoned".to_string()))?;
        sync_mirror(gpu, &mut mirror, cache, row, 0)?;
        let Some(cache_dev) = mirror.buf.as_ref() else {
            return Err(ModelError::Device("mla cache mirror is empty".to_string()));
        };
        let qd = sized(gpu, q_buf, q.len())?;
        rows.upload(q, qd).map_err(cuda_err)?;
        let n_out = t_len * self.heads * self.vd;
        let out = sized(gpu, out, n_out)?;
        let scores = sized(gpu, scores, self.heads * t_len * n_cache)?;
        self.launch_attend(qd, cache_dev, scores, None, out, (t_len, past), scale)?;
        let r = rows.download(&out.slice(0..n_out)).map_err(cuda_err)?;
        rows.synchronize().map_err(cuda_err)?;
        Ok(rows.downloaded(r).map_err(cuda_err)?.to_vec())
    }

    /// `mla_norm_rows` in place on the `t_len` rows of `width` values in `buf`, scaled by `w`.
    fn norm_in_place(
        &self,
        buf: &CudaSlice<f32>,
        width: usize,
        w: &CudaSlice<f32>,
        t_len: usize,
    ) -> Result<()> {
        let f = self.gpu.function("mla_norm_rows").map_err(cuda_err)?;
        let (stride, normed, copied) = (width as i32, width as i32, 0i32);
        // The kernel writes through the same address it reads (in place).
        let addr = deltafin_quant::cuda::device_address(self.gpu.stream(), buf);
        let mut b = self.gpu.stream().launch_builder(f);
        b.arg(buf)
            .arg(&stride)
            .arg(&addr)
            .arg(&stride)
            .arg(w)
            .arg(&normed)
            .arg(&copied)
            .arg(&MLA_LORA_NORM_EPS);
        // SAFETY: buf holds t_len rows of `width` floats and w `width` values; each thread reads a value before
        // the block's reduction and writes that value after it, so reading and writing one buffer is sound.
        unsafe { b.launch(rows_launch(t_len)) }
            .map_err(|e| ModelError::Device(format!("cuda: mla_norm_rows: {e}")))?;
        Ok(())
    }

    /// Queues `mla_attend` over the mirror's first `past + t_len` rows.
    #[allow(clippy::too_many_arguments)]
    fn launch_attend(
        &self,
        q: &CudaSlice<f32>,
        cache_dev: &CudaSlice<f32>,
        scores: &mut CudaSlice<f32>,
        gate: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        (t_len, past): (usize, usize),
        scale: f32,
    ) -> Result<()> {
        let gpu = &self.gpu;
        let n_cache = past + t_len;
        let f = gpu.function("mla_attend").map_err(cuda_err)?;
        let smem = (2 * self.kvl + self.nope + self.rope + MLA_THREADS / 32) * 4;
        let cfg = LaunchConfig {
            grid_dim: (self.heads as u32, t_len as u32, 1),
            block_dim: (MLA_THREADS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let gated = i32::from(gate.is_some());
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
        b.arg(q)
            .arg(cache_dev)
            .arg(&self.w_uk_t)
            .arg(&self.w_uv)
            .arg(&mut *scores)
            // Without a gate the kernel never reads this argument; `q` stands in as a valid address.
            .arg(gate.unwrap_or(q))
            .arg(&gated)
            .arg(&mut *out);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        // SAFETY: q is [t_len, heads, nope+rope]; the mirror holds n_cache rows of kvl+rope floats (synced, the new
        // rows written before this launch on the same stream); the weights are [heads, kvl, nope] and
        // [heads, vd, kvl]; scores holds heads*t_len*n_cache floats and out (and the gate when there is one)
        // t_len*heads*vd, as their callers sized them.
        unsafe { b.launch(cfg) }
            .map_err(|e| ModelError::Device(format!("cuda: mla_attend: {e}")))?;
        Ok(())
    }
}

/// One block of [`NORM_THREADS`] per row.
fn rows_launch(t_len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (t_len as u32, 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Makes the device mirror hold exactly `cache`'s rows with room for `extra` more after them, uploading only blocks
/// it does not share with the host cache (the mirror keeps them alive, so pointer identity means equal contents).
fn sync_mirror(
    gpu: &Gpu,
    m: &mut Mirror,
    cache: &MlaCache,
    row: usize,
    extra: usize,
) -> Result<()> {
    let blocks = cache.blocks();
    let need = cache.len() + extra;
    let mut common = m
        .blocks
        .iter()
        .zip(blocks)
        .take_while(|(a, b)| Arc::ptr_eq(a, b))
        .count();
    if need > m.cap_rows || m.buf.is_none() {
        let cap = need.max(2 * m.cap_rows).max(256);
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
            .memcpy_htod(&b[..], &mut dst)
            .map_err(|e| ModelError::Device(format!("cuda: latent cache upload: {e}")))?;
        offset += b.len();
    }
    m.blocks = blocks.to_vec();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_quant::cuda::dense::DeviceMatrix;
    use deltafin_quant::{DenseData, DenseMatrix};

    /// `mla_absorb` lays out every head's matrices from `kv_b` as uploaded, bf16 or f32, bit for bit as the host's
    /// `gpu_absorbed` does from the same values widened to f32 (heads, widths and `kv_lora` all different; values
    /// of both signs, tiny and large).
    #[test]
    fn device_absorption_matches_the_host_layout_bit_for_bit() {
        let gpu = Gpu::shared().expect("a CUDA GPU (these tests run on the device machine)");
        let (heads, nope, vd, kvl) = (3, 8, 16, 24);
        let n = heads * (nope + vd) * kvl;
        let bits: Vec<u16> = (0..n)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761) >> 16)
            .map(|b| (b as u16 & 0x7fff).min(0x7f00) | (b as u16 & 0x8000))
            .collect();
        let widened: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        let host = crate::mla::gpu_absorbed(&widened, heads, (nope, vd, kvl));
        let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for data in [
            DenseData::Bf16(bits.clone().into()),
            DenseData::F32(widened.clone()),
        ] {
            let bf16 = matches!(data, DenseData::Bf16(_));
            let m = DenseMatrix::new(heads * (nope + vd), kvl, data).expect("matrix");
            let dev = DeviceMatrix::upload(&gpu, &m)
                .expect("upload")
                .expect("a shape the device takes");
            let (buf, is_bf16) = dev
                .float_values()
                .expect("bf16 or f32, staged on the weights' stream");
            assert_eq!(is_bf16, bf16);
            let (uk_t, uv) = absorb_on_device(&gpu, (buf, is_bf16), heads, (nope, vd, kvl))
                .expect("mla_absorb runs");
            gpu.wait_uploaded(&gpu.uploads_done().expect("event"))
                .expect("wait");
            let (uk_t, uv) = (
                gpu.download(&uk_t).expect("download"),
                gpu.download(&uv).expect("download"),
            );
            assert_eq!(as_bits(&uk_t), as_bits(&host.0), "W_UKᵀ, bf16 {bf16}");
            assert_eq!(as_bits(&uv), as_bits(&host.1), "W_UV, bf16 {bf16}");
        }
    }
}
