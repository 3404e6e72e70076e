//! The MXFP4 routed-expert kernels (`kernels/moe_mxfp4.cu`): gate and up fused with the activation, then down,
//! each one launch for all experts of a layer, then the weighted combine in the router's order.
//!
//! Tokens are grouped into (expert, token) *pairs*: expert `i` owns pairs `pair0 .. pair0 + n_rows`, and
//! `pair_row[p]` is the activation row pair `p` reads. `act [pairs, inter]` and `y [pairs, width]` are indexed by
//! pair, so a call may launch its experts in several chunks (when the device cache holds fewer experts than the
//! call needs) and combine once.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Gpu, div_ceil, driver_err};
use crate::error::{QuantError, Result};
use crate::mxfp4::MXFP4_GROUP;

/// Output rows per block of the MoE kernels (8 warps × 4 rows, as in `kernels/moe_mxfp4.cu`).
const MOE_ROWS_PER_BLOCK: usize = 32;
/// Threads per block of the MoE kernels.
const MOE_THREADS: u32 = 256;
/// Token tiles the kernels are instantiated for.
const TILES: [usize; 4] = [1, 2, 4, 8];
/// `u64` words per `ExpertSlot` (six addresses, then `n_rows` and `pair0` as two `i32`).
const SLOT_WORDS: usize = 7;

/// Device addresses of one expert's six tensors (packed nibbles and E8M0 scales of gate, down and up). Each
/// packed tensor must be 16-byte aligned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertPtrs {
    /// Gate (`w1`) packed `[inter, width / 2]`.
    pub w1: u64,
    /// Gate scales `[inter, width / 32]`.
    pub s1: u64,
    /// Down (`w2`) packed `[width, inter / 2]`.
    pub w2: u64,
    /// Down scales `[width, inter / 32]`.
    pub s2: u64,
    /// Up (`w3`) packed `[inter, width / 2]`.
    pub w3: u64,
    /// Up scales `[inter, width / 32]`.
    pub s3: u64,
}

/// The gated activation between gate/up and down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// K3's SiTU: `(β tanh(g/β) σ(g)) · (β_lin tanh(u/β_lin))`.
    Situ {
        /// β (4 in K3).
        beta: f32,
        /// β_lin (25 in K3).
        linear_beta: f32,
    },
    /// `SiLU(g) · u` (Kimi Linear).
    Silu,
    /// `g` alone: exposes the gate product (tests).
    GateOnly,
    /// `u` alone: exposes the up product (tests).
    UpOnly,
}

impl Glu {
    fn code(self) -> (i32, f32, f32) {
        match self {
            Glu::Situ { beta, linear_beta } => (0, beta, linear_beta),
            Glu::Silu => (1, 1.0, 1.0),
            Glu::GateOnly => (2, 1.0, 1.0),
            Glu::UpOnly => (3, 1.0, 1.0),
        }
    }
}

/// Shapes of one layer's experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeShape {
    /// Input and output width of an expert (the latent width in K3).
    pub width: usize,
    /// Inner width.
    pub inter: usize,
    /// Activation.
    pub glu: Glu,
}

/// One expert of a launch: its weights and its pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRef {
    /// Device addresses of the weights.
    pub ptrs: ExpertPtrs,
    /// First pair.
    pub pair0: usize,
    /// Tokens routed to this expert.
    pub n_rows: usize,
}

/// The token tile for a launch whose largest expert has `max_rows` tokens, within the shared-memory limit.
fn tile_for(max_rows: usize, cols: usize, smem_limit: usize) -> Option<usize> {
    let want = TILES
        .iter()
        .copied()
        .find(|&t| t >= max_rows)
        .unwrap_or(TILES[TILES.len() - 1]);
    TILES
        .iter()
        .rev()
        .copied()
        .find(|&t| t <= want && t * cols * 4 <= smem_limit)
}

fn slot_table(slots: &[SlotRef]) -> Vec<u64> {
    let mut table = Vec::with_capacity(slots.len() * SLOT_WORDS);
    for s in slots {
        let p = s.ptrs;
        table.extend([p.w1, p.s1, p.w2, p.s2, p.w3, p.s3]);
        // struct { int n_rows; int pair0; } on a little-endian device.
        table.push((s.n_rows as u32 as u64) | ((s.pair0 as u32 as u64) << 32));
    }
    table
}

/// Runs gate/up (+ activation) and down for every expert of `slots` in two launches on the compute stream:
/// `act[p] = glu(W1 x[pair_row[p]], W3 x[pair_row[p]])`, `y[p] = W2 act[p]`.
///
/// `x` is `[*, width]`; `act` must hold `[pairs, inter]` and `y` `[pairs, width]` for every pair of `slots`.
pub fn run_experts(
    gpu: &Gpu,
    shape: &MoeShape,
    slots: &[SlotRef],
    pair_row: &CudaSlice<i32>,
    x: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let (width, inter) = (shape.width, shape.inter);
    if !width.is_multiple_of(MXFP4_GROUP) || !inter.is_multiple_of(MXFP4_GROUP) {
        return Err(QuantError::BadColumns {
            cols: if width.is_multiple_of(MXFP4_GROUP) {
                inter
            } else {
                width
            },
            group: MXFP4_GROUP,
        });
    }
    let slots: Vec<SlotRef> = slots.iter().copied().filter(|s| s.n_rows > 0).collect();
    if slots.is_empty() {
        return Ok(());
    }
    let end = slots.iter().map(|s| s.pair0 + s.n_rows).max().unwrap_or(0);
    if pair_row.len() < end || act.len() < end * inter || y.len() < end * width {
        return Err(QuantError::Cuda(format!(
            "moe buffers too small for {end} pairs (pair_row {}, act {}, y {})",
            pair_row.len(),
            act.len(),
            y.len()
        )));
    }
    for s in &slots {
        let aligned = [s.ptrs.w1, s.ptrs.w2, s.ptrs.w3]
            .iter()
            .all(|p| p.is_multiple_of(16));
        if !aligned {
            return Err(QuantError::Cuda(
                "expert packed weights must be 16-byte aligned on the device".to_string(),
            ));
        }
    }
    let max_rows = slots.iter().map(|s| s.n_rows).max().unwrap_or(1);
    let table = gpu.upload(&slot_table(&slots))?;
    let n_slots = slots.len() as u32;
    let (kind, beta, lin) = shape.glu.code();
    let (w_i, i_i) = (width as i32, inter as i32);

    let tt = tile_for(max_rows, width, gpu.smem_limit()).ok_or_else(|| {
        QuantError::Cuda(format!(
            "expert width {width} needs more shared memory than the device has"
        ))
    })?;
    let name = format!("moe_gate_up_t{tt}");
    let f = gpu.function(&name)?;
    let cfg = LaunchConfig {
        grid_dim: (div_ceil(inter, MOE_ROWS_PER_BLOCK), n_slots, 1),
        block_dim: (MOE_THREADS, 1, 1),
        shared_mem_bytes: (tt * width * 4) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&table)
        .arg(pair_row)
        .arg(x)
        .arg(&mut *act)
        .arg(&w_i)
        .arg(&i_i)
        .arg(&kind)
        .arg(&beta)
        .arg(&lin);
    // SAFETY: the table holds n_slots ExpertSlot records whose addresses point at the experts' packed/scale
    // tensors of the given shapes (the caller's contract, alignment checked above); pairs stay below `end`,
    // which `pair_row`, `act` and `y` cover (checked above); x rows come from `pair_row`.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;

    let tt = tile_for(max_rows, inter, gpu.smem_limit()).ok_or_else(|| {
        QuantError::Cuda(format!(
            "expert inner width {inter} needs more shared memory than the device has"
        ))
    })?;
    let name = format!("moe_down_t{tt}");
    let f = gpu.function(&name)?;
    let cfg = LaunchConfig {
        grid_dim: (div_ceil(width, MOE_ROWS_PER_BLOCK), n_slots, 1),
        block_dim: (MOE_THREADS, 1, 1),
        shared_mem_bytes: (tt * inter * 4) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&table).arg(&*act).arg(&mut *y).arg(&w_i).arg(&i_i);
    // SAFETY: as above; act was written for every pair of these slots by the previous launch on this stream.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;
    Ok(())
}

/// `out[t] = Σ_j tok_w[t, j] · y[tok_pair[t, j]]` for `t < t_len`, `j < k` (a negative pair is skipped), summed
/// in `j` order. Returns `[t_len, width]` on the device.
pub fn combine(
    gpu: &Gpu,
    y: &CudaSlice<f32>,
    tok_pair: &[i32],
    tok_w: &[f32],
    t_len: usize,
    k: usize,
    width: usize,
) -> Result<CudaSlice<f32>> {
    if tok_pair.len() != t_len * k || tok_w.len() != t_len * k {
        return Err(QuantError::BadInput {
            expected: t_len * k,
            actual: tok_pair.len(),
        });
    }
    let n_pairs = y.len() / width.max(1);
    if tok_pair.iter().any(|&p| p >= n_pairs as i32) {
        return Err(QuantError::Cuda("combine: pair out of range".to_string()));
    }
    let pairs = gpu.upload(tok_pair)?;
    let weights = gpu.upload(tok_w)?;
    let mut out = gpu.zeros::<f32>(t_len * width)?;
    let f = gpu.function("moe_combine")?;
    let cfg = LaunchConfig {
        grid_dim: (div_ceil(width, 256), t_len as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (k_i, w_i) = (k as i32, width as i32);
    let mut b = gpu.stream().launch_builder(f);
    b.arg(y)
        .arg(&pairs)
        .arg(&weights)
        .arg(&k_i)
        .arg(&w_i)
        .arg(&mut out);
    // SAFETY: every pair index is below the number of rows of y (checked above); out holds t_len*width floats.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err("moe_combine", e))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_rows_and_memory() {
        assert_eq!(tile_for(1, 3584, 227 * 1024), Some(1));
        assert_eq!(tile_for(3, 3584, 227 * 1024), Some(4));
        assert_eq!(tile_for(64, 3584, 227 * 1024), Some(8));
        assert_eq!(tile_for(64, 3584, 48 * 1024), Some(2));
        assert_eq!(tile_for(1, 1 << 20, 48 * 1024), None);
    }

    #[test]
    fn slot_records_pack_rows_then_first_pair() {
        let t = slot_table(&[SlotRef {
            ptrs: ExpertPtrs {
                w1: 1,
                s1: 2,
                w2: 3,
                s2: 4,
                w3: 5,
                s3: 6,
            },
            pair0: 9,
            n_rows: 3,
        }]);
        assert_eq!(t, vec![1, 2, 3, 4, 5, 6, 3 | (9 << 32)]);
    }
}
