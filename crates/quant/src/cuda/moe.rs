//! The MXFP4 routed-expert kernels (`kernels/moe_mxfp4.cu`): gate and up fused with the activation, then down,
//! each one launch for all experts of a layer, then the weighted combine in the router's order.
//!
//! Tokens are grouped into (expert, token) *pairs*: expert `i` owns pairs `pair0 .. pair0 + n_rows`, and
//! `pair_row[p]` is the activation row pair `p` reads. `act [pairs, inter]` and `y [pairs, width]` are indexed by
//! pair, so a call may launch its experts in several chunks (when the device cache holds fewer experts than the
//! call needs) and combine once.
//!
//! Three kernel families compute the same products. The tensor-core kernels (`mma.sync` with fp16 weights decoded
//! exactly from E2M1 and the activations split into fp16 hi/lo halves, f32 accumulation) come in three shapes: the
//! token tiles (one to four tokens, each its own product; the fastest at one token), the GEMM (tokens along the
//! mma's n dimension, each group's E8M0 scale applied after its mmas) and the folded-scale GEMM (the scale folded
//! into the fp16 weights where fp16 holds the product exactly, a weight read once per 64 tokens; for more than
//! [`FOLD_MIN_ROWS`] tokens per expert). [`MoeKernel::Tensor`], the default, picks between them by the largest
//! expert's token count ([`GEMM_MIN_ROWS`], [`FOLD_MIN_ROWS`]). On Hopper the folded GEMM also comes in a
//! warpgroup form ([`MoeKernel::Wg`]: `wgmma` with a pipelined ring of weights and tokens), which the default runs
//! (as `wgw`, a k-tile's hi and lo halves in one wgmma) for the experts of more than [`WG_MIN_ROWS`] tokens, in a
//! launch of their own. The CUDA-core kernels
//! ([`MoeKernel::Simt`]: one f32 FMA per weight and token) are kept as a reference and fallback.
//! `DELTAFIN_MOE_KERNEL=tensor|gemm|simt` (or a measurement variant of `tensor`, see [`MoeKernel`]) picks one for
//! a whole process.

use std::str::FromStr;
use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

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
/// Experts per launch of the tensor-core kernels (their table is a kernel parameter: 64 × 56 bytes).
const MAX_SLOTS: usize = 64;
/// Ring stages of the tensor-core kernels' asynchronous weight copies (`MMA_STAGES`).
const MMA_STAGES: usize = 3;
/// [`MoeKernel::Tensor`] runs the GEMM kernels when an expert of the launch has more tokens than this, with the B
/// fragments through shared memory above [`GEMM_SMEM_ROWS`] (measured on the H200: docs/PERFORMANCE.md, "CUDA at
/// real size").
pub const GEMM_MIN_ROWS: usize = 2;
/// See [`GEMM_MIN_ROWS`].
pub const GEMM_SMEM_ROWS: usize = 8;
/// The GEMM above [`GEMM_SMEM_ROWS`]: B through shared memory, 4 n-tiles ([`MoeKernel::GEMM`]).
const GEMM_DEFAULT: (bool, usize) = (true, 4);
/// Threads per block of the GEMM kernels (`GEMM_WARPS` warps).
const GEMM_THREADS: u32 = 128;
/// Output rows per block of the GEMM kernels: gate/up (16 rows of gate and of up per warp) and down (32 per warp).
const GEMM_ROWS_GATE_UP: usize = 4 * 16;
const GEMM_ROWS_DOWN: usize = 4 * 32;
/// Columns of the GEMM kernels' inputs must be a multiple of this (four groups a batch).
const GEMM_COLS: usize = 4 * MXFP4_GROUP;
/// n-tiles (of 8 tokens) the GEMM kernels are instantiated for.
const GEMM_TILES: [usize; 4] = [1, 2, 4, 8];
/// n-tiles the folded-scale GEMM kernels are instantiated for.
const FOLD_TILES: [usize; 2] = [4, 8];
/// [`MoeKernel::Tensor`] runs the folded-scale GEMM when an expert of the launch has more tokens than this
/// (measured on the H200: docs/PERFORMANCE.md, "CUDA at real size").
pub const FOLD_MIN_ROWS: usize = 16;
/// On Hopper [`MoeKernel::Tensor`] runs the experts with more tokens than this on the warpgroup GEMM with hi and lo
/// in one wgmma (`wgw`, [`MoeKernel::Wg`]): above 32 tokens both it and the folded GEMM run 64-token tiles, each tile
/// costing the same at any count, and `wgw`'s is the faster (measured on an H100 at 48, 49, 64 and 128 tokens; at 32
/// the two tie: docs/PERFORMANCE.md, "CUDA at real size").
pub const WG_MIN_ROWS: usize = 32;
/// Bytes a ring stage of the warpgroup GEMM at `nt` n-tiles: the B tiles (`wg_b_bytes`: 8 nt tokens' 128 k, hi and
/// lo, 4 KiB an n-tile) and the weight chunks (17 KiB).
fn wg_stage_bytes(nt: usize) -> usize {
    nt * 4096 + 8 * 8 * 272
}
/// Ring stages of the warpgroup GEMM (`WG_STAGES`).
const WG_STAGES: usize = 4;
/// Room to align the warpgroup GEMM's ring to 1 KiB (its B tiles' swizzle atoms).
const WG_ALIGN: usize = 1024;

/// Which kernels multiply the MXFP4 experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKernel {
    /// Tensor cores (`mma.sync`, exact fp16 weights, fp16 hi/lo activations, f32 accumulation): the token tiles
    /// (weights streamed through a 3-stage `cp.async` ring per warp) up to [`GEMM_MIN_ROWS`] tokens per expert,
    /// the GEMM up to [`FOLD_MIN_ROWS`], the folded-scale GEMM beyond.
    Tensor,
    /// The tensor-core GEMM at any token count (where the widths are multiples of 128; the token tiles
    /// otherwise): B fragments through shared memory (`smem`) or loaded by each warp, at most `tiles` n-tiles of 8
    /// tokens per block (more tokens take more blocks, each reading the weights again).
    Gemm {
        /// B fragments staged in shared memory, shared by the block's warps.
        smem: bool,
        /// n-tiles per block: 1, 2, 4 or 8.
        tiles: usize,
    },
    /// The tensor-core GEMM with the E8M0 scales folded into the fp16 weights (`moe_fold_*`: 8-warp blocks, up to
    /// 64 tokens a block), at any token count where the widths are multiples of 128 (the token tiles otherwise), at
    /// most `tiles` n-tiles of 8 tokens a block.
    Fold {
        /// n-tiles per block: 4 or 8.
        tiles: usize,
    },
    /// The folded-scale GEMM on Hopper's warpgroup mmas (`moe_wg_*`: `wgmma` with the weights from registers, a
    /// four-stage ring of weights and token tiles in shared memory; the `moe_fold_*` blocks, 64 tokens a block),
    /// where the widths are multiples of 128 (the token tiles otherwise). Needs sm_90; elsewhere, and in a block
    /// with a scale outside the folding window, the block runs the mma.sync GEMM with per-group scales.
    Wg {
        /// Chain the sums of two batches of four groups before adding them into the running sums, where an
        /// input's batches pair up (`wg`); `false`: every batch (`wg1`, a measurement variant).
        pairs: bool,
        /// One wgmma takes a k-tile's hi and lo token halves (`wgw`, `moe_wgw_*`: m64n128 for 64 tokens, m64n64 for
        /// launches whose experts have at most 32) instead of two m64n64.
        wide: bool,
    },
    /// The tensor-core token tiles at any token count (a measurement variant).
    Tiles,
    /// As [`MoeKernel::Tensor`] with 4 ring stages at one token (a measurement variant).
    TensorS4,
    /// As [`MoeKernel::Tensor`] without the 256-byte L2 prefetch hint at one token (a measurement variant).
    TensorNoHint,
    /// CUDA cores: one f32 FMA per weight and token.
    Simt,
}

/// Warps per block of the tensor-core kernels (`MMA_WARPS` in `kernels/moe_mxfp4.cu`).
const MMA_WARPS: usize = 4;
/// Row streams per warp of the tensor-core kernels: a gate/up warp owns 16 rows of gate and 16 of up, a down
/// warp 32 rows.
const MMA_STREAMS: usize = 2;

impl MoeKernel {
    /// The GEMM kernels [`MoeKernel::Tensor`] uses above [`GEMM_SMEM_ROWS`] tokens (`gemm`).
    pub const GEMM: MoeKernel = MoeKernel::Gemm {
        smem: GEMM_DEFAULT.0,
        tiles: GEMM_DEFAULT.1,
    };
    /// The folded-scale GEMM [`MoeKernel::Tensor`] uses above [`FOLD_MIN_ROWS`] tokens (`fold`).
    pub const FOLD: MoeKernel = MoeKernel::Fold { tiles: 8 };

    /// Ring stages and kernel-name suffix of the tensor-core kernels for token tile `tt`.
    fn tensor_variant(self, tt: usize) -> (usize, &'static str) {
        match (self, tt) {
            (MoeKernel::TensorS4, 1) => (4, "_s4"),
            (MoeKernel::TensorNoHint, 1) => (MMA_STAGES, "_nohint"),
            _ => (MMA_STAGES, ""),
        }
    }
}

impl FromStr for MoeKernel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "tensor" => Ok(MoeKernel::Tensor),
            "gemm" => Ok(MoeKernel::GEMM),
            "gemm8" => Ok(MoeKernel::Gemm {
                smem: true,
                tiles: 8,
            }),
            "gemm8-ldg" => Ok(MoeKernel::Gemm {
                smem: false,
                tiles: 8,
            }),
            "gemm4-ldg" => Ok(MoeKernel::Gemm {
                smem: false,
                tiles: 4,
            }),
            "fold" => Ok(MoeKernel::FOLD),
            "fold4" => Ok(MoeKernel::Fold { tiles: 4 }),
            "wg" => Ok(MoeKernel::Wg {
                pairs: true,
                wide: false,
            }),
            "wg1" => Ok(MoeKernel::Wg {
                pairs: false,
                wide: false,
            }),
            "wgw" => Ok(MoeKernel::Wg {
                pairs: true,
                wide: true,
            }),
            "tiles" => Ok(MoeKernel::Tiles),
            "tensor-s4" => Ok(MoeKernel::TensorS4),
            "tensor-nohint" => Ok(MoeKernel::TensorNoHint),
            "simt" => Ok(MoeKernel::Simt),
            other => Err(format!(
                "unknown MoE kernel {other:?} (expected tensor, gemm, gemm8, gemm8-ldg, gemm4-ldg, fold, fold4, wg, \
                 wg1, wgw, tiles, tensor-s4, tensor-nohint or simt)"
            )),
        }
    }
}

impl MoeKernel {
    /// The process default: `DELTAFIN_MOE_KERNEL` if set (and valid), else [`MoeKernel::Tensor`].
    pub fn from_env() -> MoeKernel {
        static K: OnceLock<MoeKernel> = OnceLock::new();
        *K.get_or_init(|| {
            std::env::var("DELTAFIN_MOE_KERNEL")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(MoeKernel::Tensor)
        })
    }
}

/// The tensor-core kernels' expert table, passed by value (`SlotTable` in `kernels/moe_mxfp4.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
struct SlotTable {
    words: [u64; SLOT_WORDS * MAX_SLOTS],
}

// SAFETY: plain old data with the C layout of the kernel's `SlotTable` (u64 words; the trailing `int n_rows,
// pair0` pair of each record is one little-endian u64).
unsafe impl DeviceRepr for SlotTable {}

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

/// The tensor-core kernels' by-value table for up to [`MAX_SLOTS`] experts (the rest zero, never read).
fn launch_table(slots: &[SlotRef]) -> SlotTable {
    let mut table = SlotTable {
        words: [0; SLOT_WORDS * MAX_SLOTS],
    };
    let words = slot_table(slots);
    table.words[..words.len()].copy_from_slice(&words);
    table
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
/// The kernels are [`MoeKernel::from_env`].
pub fn run_experts(
    gpu: &Gpu,
    shape: &MoeShape,
    slots: &[SlotRef],
    pair_row: &CudaSlice<i32>,
    x: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    run_experts_with(
        gpu,
        shape,
        slots,
        pair_row,
        x,
        act,
        y,
        MoeKernel::from_env(),
    )
}

/// [`run_experts`] with the given kernels.
#[allow(clippy::too_many_arguments)]
pub fn run_experts_with(
    gpu: &Gpu,
    shape: &MoeShape,
    slots: &[SlotRef],
    pair_row: &CudaSlice<i32>,
    x: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    kernel: MoeKernel,
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
            .all(|p| p.is_multiple_of(16))
            && [s.ptrs.s1, s.ptrs.s2, s.ptrs.s3]
                .iter()
                .all(|p| p.is_multiple_of(4));
        if !aligned {
            return Err(QuantError::Cuda(
                "expert packed weights must be 16-byte and scales 4-byte aligned on the device"
                    .to_string(),
            ));
        }
    }
    let gemm_fits = width.is_multiple_of(GEMM_COLS) && inter.is_multiple_of(GEMM_COLS);
    // On Hopper the default sends the experts with more than WG_MIN_ROWS tokens to the warpgroup GEMM (`wgw`), in a
    // launch of their own (their pairs are disjoint from the others'), and the rest on by the rules below.
    let wg = GemmFamily::wg(true, true);
    let slots = if kernel == MoeKernel::Tensor
        && gemm_fits
        && gpu.arch() == (9, 0)
        && wg.smem_bytes(8) <= gpu.smem_limit()
    {
        let (big, small): (Vec<SlotRef>, Vec<SlotRef>) =
            slots.into_iter().partition(|s| s.n_rows > WG_MIN_ROWS);
        if !big.is_empty() {
            run_gemm(gpu, shape, &big, pair_row, x, act, y, &wg)?;
        }
        if small.is_empty() {
            return Ok(());
        }
        small
    } else {
        slots
    };
    let max_rows = slots.iter().map(|s| s.n_rows).max().unwrap_or(1);
    let gemm = match kernel {
        MoeKernel::Gemm { smem, tiles } if gemm_fits => Some(GemmFamily::plain(smem, tiles)),
        MoeKernel::Fold { tiles } if gemm_fits => Some(GemmFamily::fold(tiles)),
        MoeKernel::Wg { pairs, wide } if gemm_fits => Some(GemmFamily::wg(pairs, wide)),
        MoeKernel::Tensor if gemm_fits && max_rows > FOLD_MIN_ROWS => Some(GemmFamily::fold(8)),
        MoeKernel::Tensor if gemm_fits && max_rows > GEMM_SMEM_ROWS => {
            Some(GemmFamily::plain(GEMM_DEFAULT.0, GEMM_DEFAULT.1))
        }
        MoeKernel::Tensor if gemm_fits && max_rows > GEMM_MIN_ROWS => {
            Some(GemmFamily::plain(false, 1))
        }
        _ => None,
    };
    if let Some(family) = gemm {
        return run_gemm(gpu, shape, &slots, pair_row, x, act, y, &family);
    }
    if kernel != MoeKernel::Simt {
        for chunk in slots.chunks(MAX_SLOTS) {
            run_tensor(gpu, shape, chunk, max_rows, pair_row, x, act, y, kernel)?;
        }
        return Ok(());
    }
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

/// Token tile of the tensor-core kernels for a launch whose largest expert has `max_rows` tokens (larger counts
/// loop over tiles of 4 inside the kernel).
fn tensor_tile(max_rows: usize) -> usize {
    match max_rows {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    }
}

/// Dynamic shared memory of a tensor-core kernel: `tt` tokens of fp16 hi/lo fragments (128 bytes per group,
/// groups rounded up to 4) and a 64-byte zero block, then each warp's ring of `stages` batches of its row
/// streams (two rows, 32 lanes, 16 bytes of weights and a 4-byte scale word each).
fn tensor_smem(tt: usize, cols: usize, stages: usize) -> usize {
    let gp = (cols / MXFP4_GROUP).div_ceil(4) * 4;
    (tt * gp * 8 + 4) * 16 + MMA_WARPS * stages * MMA_STREAMS * 2 * 32 * (16 + 4)
}

/// The tensor-core kernels (gate/up, down) for token tile `tt`, and their ring stages.
fn tensor_kernels(kernel: MoeKernel, tt: usize) -> (String, String, usize) {
    let (stages, suffix) = kernel.tensor_variant(tt);
    (
        format!("moe_mma_gate_up_t{tt}_m{MMA_STREAMS}{suffix}"),
        format!("moe_mma_down_t{tt}_m{MMA_STREAMS}{suffix}"),
        stages,
    )
}

/// Gate/up then down for up to [`MAX_SLOTS`] experts on the tensor-core kernels.
#[allow(clippy::too_many_arguments)]
fn run_tensor(
    gpu: &Gpu,
    shape: &MoeShape,
    slots: &[SlotRef],
    max_rows: usize,
    pair_row: &CudaSlice<i32>,
    x: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    kernel: MoeKernel,
) -> Result<()> {
    let (width, inter) = (shape.width, shape.inter);
    let table = launch_table(slots);
    let n_slots = slots.len() as u32;
    let need = |tt: usize| {
        let stages = kernel.tensor_variant(tt).0;
        tensor_smem(tt, width, stages).max(tensor_smem(tt, inter, stages))
    };
    let mut tt = tensor_tile(max_rows);
    while tt > 1 && need(tt) > gpu.smem_limit() {
        tt /= 2;
    }
    if need(tt) > gpu.smem_limit() {
        return Err(QuantError::Cuda(format!(
            "expert widths {width}/{inter} need more shared memory than the device has"
        )));
    }
    let (gate_up_name, down_name, stages) = tensor_kernels(kernel, tt);
    let (kind, beta, lin) = shape.glu.code();
    let (w_i, i_i) = (width as i32, inter as i32);

    let name = gate_up_name;
    let f = gpu.function(&name)?;
    let cfg = LaunchConfig {
        grid_dim: (
            div_ceil(inter, MMA_WARPS * 16 * MMA_STREAMS / 2),
            n_slots,
            1,
        ),
        block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: tensor_smem(tt, width, stages) as u32,
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
    // SAFETY: the table holds n_slots ExpertSlot records (the rest zero, never read: grid.y = n_slots) whose
    // addresses point at the experts' packed/scale tensors of the given shapes (the caller's contract, 16-byte
    // alignment checked by `run_experts`); pairs stay below the end that `pair_row`, `act` and `y` cover
    // (checked by `run_experts`); x rows come from `pair_row`.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;

    let name = down_name;
    let f = gpu.function(&name)?;
    let cfg = LaunchConfig {
        grid_dim: (div_ceil(width, MMA_WARPS * 16 * MMA_STREAMS), n_slots, 1),
        block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: tensor_smem(tt, inter, stages) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&table).arg(&*act).arg(&mut *y).arg(&w_i).arg(&i_i);
    // SAFETY: as above; act was written for every pair of these slots by the previous launch on this stream.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;
    Ok(())
}

/// Splits every row of `src` (`[rows, cols]`) into the GEMM kernels' fp16 hi/lo fragments and row factors, with
/// `kernel` (`moe_split_hilo` or `moe_split_hilo_k`: the same 128 bytes a group, in the layout of its family).
fn split_hilo(
    gpu: &Gpu,
    kernel: &str,
    src: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<(CudaSlice<u8>, CudaSlice<f32>)> {
    // 8 uint4 (128 bytes) per group of 32 columns.
    let mut frag = gpu.zeros::<u8>((rows * cols / MXFP4_GROUP * 128).max(16))?;
    let mut sdown = gpu.zeros::<f32>(rows.max(1))?;
    if rows == 0 {
        return Ok((frag, sdown));
    }
    let f = gpu.function(kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let c_i = cols as i32;
    let mut b = gpu.stream().launch_builder(f);
    b.arg(src).arg(&c_i).arg(&mut sdown).arg(&mut frag);
    // SAFETY: src holds `rows` rows of `cols` floats (the callers size it so), cols is a multiple of 128; frag has
    // 128 bytes per group of every row and sdown one float per row.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(kernel, e))?;
    Ok((frag, sdown))
}

/// One family of GEMM kernels (`moe_gemm_*` or `moe_fold_*`): names, block shape and shared memory.
struct GemmFamily {
    /// Name prefix: `{prefix}_gate_up_n{nt}{suffix}` and `{prefix}_down_n{nt}{suffix}`.
    prefix: &'static str,
    /// Name suffix (`_s`: B fragments through shared memory).
    suffix: &'static str,
    /// Whether an input whose batches of four groups pair up takes the `_f2` kernels (two batches a chain).
    pairs: bool,
    /// n-tiles the family is instantiated for, ascending.
    tiles: &'static [usize],
    /// At most this many n-tiles a block.
    cap: usize,
    /// Threads a block.
    threads: u32,
    /// Output rows a block: gate/up (of gate and of up each), down.
    rows: (usize, usize),
    /// Dynamic shared memory a block at `nt` n-tiles.
    smem: fn(usize) -> usize,
    /// The kernel that splits the inputs into fp16 hi/lo halves for this family.
    split: &'static str,
}

/// Two buffers of four groups' B fragments (128 bytes a token and group) in shared memory.
fn two_b_buffers(nt: usize) -> usize {
    2 * nt * 8 * 4 * 128
}

impl GemmFamily {
    /// The folded-scale GEMM ([`MoeKernel::Fold`]), at most `cap` n-tiles: blocks of 8 warps, 128 gate/up rows or
    /// 256 down rows.
    fn fold(cap: usize) -> GemmFamily {
        GemmFamily {
            prefix: "moe_fold",
            suffix: "",
            pairs: false,
            tiles: &FOLD_TILES,
            cap,
            threads: 256,
            rows: (2 * GEMM_ROWS_GATE_UP, 2 * GEMM_ROWS_DOWN),
            smem: two_b_buffers,
            split: "moe_split_hilo",
        }
    }

    /// The warpgroup form of the folded GEMM ([`MoeKernel::Wg`]): the blocks of [`GemmFamily::fold`], 64 tokens; the
    /// wide form (`moe_wgw`) also 32, for launches whose experts have at most 32 tokens.
    fn wg(pairs: bool, wide: bool) -> GemmFamily {
        GemmFamily {
            prefix: if wide { "moe_wgw" } else { "moe_wg" },
            suffix: "",
            pairs,
            tiles: if wide { &FOLD_TILES } else { &[8] },
            cap: 8,
            smem: |nt| WG_STAGES * wg_stage_bytes(nt) + WG_ALIGN,
            split: "moe_split_hilo_k",
            ..GemmFamily::fold(8)
        }
    }

    /// The per-group-scaled GEMM ([`MoeKernel::Gemm`]), B through shared memory or not, at most `cap` n-tiles.
    fn plain(smem: bool, cap: usize) -> GemmFamily {
        GemmFamily {
            prefix: "moe_gemm",
            suffix: if smem { "_s" } else { "" },
            pairs: false,
            tiles: &GEMM_TILES,
            cap,
            threads: GEMM_THREADS,
            rows: (GEMM_ROWS_GATE_UP, GEMM_ROWS_DOWN),
            smem: if smem { two_b_buffers } else { |_| 0 },
            split: "moe_split_hilo",
        }
    }

    /// The entry point of `part` (`gate_up` or `down`) at `nt` n-tiles.
    fn kernel(&self, part: &str, nt: usize, cols: usize) -> String {
        let f2 = if self.pairs && (cols / GEMM_COLS).is_multiple_of(2) {
            "_f2"
        } else {
            ""
        };
        format!("{}_{part}_n{nt}{}{f2}", self.prefix, self.suffix)
    }

    /// Dynamic shared memory at `nt` n-tiles.
    fn smem_bytes(&self, nt: usize) -> usize {
        (self.smem)(nt)
    }

    /// n-tiles for a launch whose largest expert has `max_rows` tokens.
    fn tiles_for(&self, max_rows: usize) -> usize {
        let want = max_rows.div_ceil(8).min(self.cap);
        let last = self.tiles.last().copied().unwrap_or(1);
        self.tiles
            .iter()
            .copied()
            .find(|&n| n >= want)
            .unwrap_or(last)
    }

    /// The launch over `nrows` output rows (`rows_per_block` a block) of `n_slots` experts whose largest has
    /// `max_rows` tokens, `nt` n-tiles a block.
    fn launch(
        &self,
        (nrows, rows_per_block): (usize, usize),
        n_slots: u32,
        max_rows: usize,
        nt: usize,
    ) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                div_ceil(nrows, rows_per_block),
                n_slots,
                div_ceil(max_rows, nt * 8),
            ),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: self.smem_bytes(nt) as u32,
        }
    }
}

/// Gate/up then down for every expert of `slots` on one family of GEMM kernels (widths multiples of
/// [`GEMM_COLS`]).
#[allow(clippy::too_many_arguments)]
fn run_gemm(
    gpu: &Gpu,
    shape: &MoeShape,
    slots: &[SlotRef],
    pair_row: &CudaSlice<i32>,
    x: &CudaSlice<f32>,
    act: &mut CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    family: &GemmFamily,
) -> Result<()> {
    let (width, inter) = (shape.width, shape.inter);
    let (kind, beta, lin) = shape.glu.code();
    let (w_i, i_i) = (width as i32, inter as i32);
    let end = slots.iter().map(|s| s.pair0 + s.n_rows).max().unwrap_or(0);
    let (xfrag, xdown) = split_hilo(gpu, family.split, x, x.len() / width, width)?;
    let tables: Vec<(SlotTable, u32, usize)> = slots
        .chunks(MAX_SLOTS)
        .map(|chunk| {
            let max_rows = chunk.iter().map(|s| s.n_rows).max().unwrap_or(1);
            (launch_table(chunk), chunk.len() as u32, max_rows)
        })
        .collect();
    for (table, n_slots, max_rows) in &tables {
        let nt = family.tiles_for(*max_rows);
        let name = family.kernel("gate_up", nt, width);
        let f = gpu.function(&name)?;
        let cfg = family.launch((inter, family.rows.0), *n_slots, *max_rows, nt);
        let mut b = gpu.stream().launch_builder(f);
        b.arg(table)
            .arg(pair_row)
            .arg(&xfrag)
            .arg(&xdown)
            .arg(&mut *act)
            .arg(&w_i)
            .arg(&i_i)
            .arg(&kind)
            .arg(&beta)
            .arg(&lin);
        // SAFETY: the table holds n_slots ExpertSlot records (checked by `run_experts`: 16-byte aligned packed
        // tensors, 4-byte aligned scales, pairs below `end` which pair_row and act cover); every x row that
        // pair_row names was split into xfrag/xdown above; widths are multiples of 128.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;
    }
    let (afrag, adown) = split_hilo(gpu, family.split, act, end, inter)?;
    for (table, n_slots, max_rows) in &tables {
        let nt = family.tiles_for(*max_rows);
        let name = family.kernel("down", nt, inter);
        let f = gpu.function(&name)?;
        let cfg = family.launch((width, family.rows.1), *n_slots, *max_rows, nt);
        let mut b = gpu.stream().launch_builder(f);
        b.arg(table)
            .arg(&afrag)
            .arg(&adown)
            .arg(&mut *y)
            .arg(&w_i)
            .arg(&i_i);
        // SAFETY: as above; act rows 0..end were written by the gate/up launches and split into afrag/adown.
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(&name, e))?;
    }
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
    fn tensor_tiles_and_shared_memory() {
        assert_eq!(tensor_tile(1), 1);
        assert_eq!(tensor_tile(2), 2);
        assert_eq!(tensor_tile(3), 4);
        assert_eq!(tensor_tile(64), 4);
        // K3: 112 groups of 32 columns, 128 bytes of hi/lo fp16 each, plus the zero block; then the rings.
        let ring = |stages: usize| 4 * stages * 2 * 2 * 32 * 20;
        assert_eq!(tensor_smem(1, 3584, 3), 112 * 128 + 64 + ring(3));
        // Four blocks of the one-token kernels fit one multiprocessor (228 KiB, 1 KiB reserved per block).
        assert!(4 * (tensor_smem(1, 3584, 3) + 1024 + 64) <= 228 * 1024);
        assert!(4 * (tensor_smem(1, 3584, 4) + 1024 + 64) <= 228 * 1024);
        // 3 groups round up to 4.
        assert_eq!(tensor_smem(2, 96, 3), 2 * 4 * 128 + 64 + ring(3));
        assert_eq!(std::mem::size_of::<SlotTable>(), 64 * 56);
    }

    #[test]
    fn gemm_tiles_cover_the_largest_expert() {
        let plain = GemmFamily::plain(true, 8);
        assert_eq!(plain.tiles_for(1), 1);
        assert_eq!(plain.tiles_for(8), 1);
        assert_eq!(plain.tiles_for(9), 2);
        assert_eq!(plain.tiles_for(17), 4);
        assert_eq!(plain.tiles_for(64), 8);
        assert_eq!(GemmFamily::plain(true, 4).tiles_for(64), 4);
        // More than 64 tokens: several token tiles of 64 (grid.z).
        assert_eq!(plain.tiles_for(200), 8);
        // The folded family starts at four n-tiles.
        assert_eq!(GemmFamily::fold(8).tiles_for(3), 4);
        assert_eq!(GemmFamily::fold(8).tiles_for(33), 8);
        // Two 32 KiB buffers at eight n-tiles.
        assert_eq!(
            plain.launch((3072, 64), 16, 64, 8).shared_mem_bytes,
            64 * 1024
        );
        assert_eq!(
            GemmFamily::plain(false, 8)
                .launch((3072, 64), 16, 64, 8)
                .shared_mem_bytes,
            0
        );
        // K3, 64 tokens per expert, 16 experts, 4 n-tiles: 48 blocks of gate/up rows (28 of down), two token tiles.
        let four = GemmFamily::plain(true, 4);
        let g = four.launch((3072, four.rows.0), 16, 64, 4);
        assert_eq!(
            (g.grid_dim, g.block_dim.0, g.shared_mem_bytes),
            ((48, 16, 2), 128, 32 * 1024)
        );
        let d = four.launch((3584, four.rows.1), 16, 64, 4);
        assert_eq!(d.grid_dim, (28, 16, 2));
        // Folded: 8-warp blocks of 128 gate/up rows (256 down), one token tile of 64.
        let fold = GemmFamily::fold(8);
        let g = fold.launch((3072, fold.rows.0), 16, 64, 8);
        assert_eq!((g.grid_dim, g.block_dim.0), ((24, 16, 1), 256));
        assert_eq!(
            fold.launch((3584, fold.rows.1), 16, 64, 8).grid_dim,
            (14, 16, 1)
        );
        // The warpgroup form: the same blocks, 64 tokens a token tile, a four-stage ring within the H200's limit.
        let wg = GemmFamily::wg(true, false);
        assert_eq!(wg.tiles_for(17), 8);
        let g = wg.launch((3072, wg.rows.0), 16, 100, 8);
        assert_eq!((g.grid_dim, g.block_dim.0), ((24, 16, 2), 256));
        assert_eq!(g.shared_mem_bytes as usize, 4 * (32 * 1024 + 17408) + 1024);
        assert!(g.shared_mem_bytes as usize + 1024 <= 227 * 1024);
        // The wide form also takes 32-token tiles, where a launch's experts have at most 32 tokens.
        let wgw = GemmFamily::wg(true, true);
        assert_eq!((wgw.tiles_for(32), wgw.tiles_for(33)), (4, 8));
        let g = wgw.launch((3072, wgw.rows.0), 16, 20, 4);
        assert_eq!(g.grid_dim, (24, 16, 1));
        assert_eq!(g.shared_mem_bytes as usize, 4 * (16 * 1024 + 17408) + 1024);
        assert_eq!(wgw.kernel("down", 4, 3072), "moe_wgw_down_n4_f2");
        // K3's widths take the GEMM; a Kimi-Linear-sized test shape does not.
        assert!(3584usize.is_multiple_of(GEMM_COLS) && 3072usize.is_multiple_of(GEMM_COLS));
        assert!(!96usize.is_multiple_of(GEMM_COLS));
        for family in [
            GemmFamily::plain(false, 8),
            GemmFamily::plain(true, 8),
            GemmFamily::fold(8),
            GemmFamily::wg(true, false),
            GemmFamily::wg(false, false),
            GemmFamily::wg(true, true),
        ] {
            for &nt in family.tiles {
                let names = [128, 256].map(|cols| {
                    [
                        family.kernel("gate_up", nt, cols),
                        family.kernel("down", nt, cols),
                    ]
                });
                for name in names.concat() {
                    // Dynamic shared memory above 48 KiB needs the raised limit.
                    let big = family.smem_bytes(nt) > 48 * 1024;
                    assert!(
                        super::super::KERNELS
                            .iter()
                            .any(|&(n, b)| n == name && (b || !big)),
                        "{name} is not in KERNELS (or lacks the shared-memory limit)"
                    );
                }
            }
        }
    }

    #[test]
    fn kernel_names_parse() {
        for (name, k) in [
            ("tensor", MoeKernel::Tensor),
            ("gemm", MoeKernel::GEMM),
            (
                "gemm4-ldg",
                MoeKernel::Gemm {
                    smem: false,
                    tiles: 4,
                },
            ),
            ("tiles", MoeKernel::Tiles),
            ("fold", MoeKernel::FOLD),
            ("fold4", MoeKernel::Fold { tiles: 4 }),
            (
                "wg",
                MoeKernel::Wg {
                    pairs: true,
                    wide: false,
                },
            ),
            (
                "wg1",
                MoeKernel::Wg {
                    pairs: false,
                    wide: false,
                },
            ),
            (
                "wgw",
                MoeKernel::Wg {
                    pairs: true,
                    wide: true,
                },
            ),
            ("tensor-s4", MoeKernel::TensorS4),
            ("tensor-nohint", MoeKernel::TensorNoHint),
            ("simt", MoeKernel::Simt),
        ] {
            assert_eq!(name.parse::<MoeKernel>(), Ok(k));
        }
        assert!("fast".parse::<MoeKernel>().is_err());
    }

    /// Every tensor-core kernel a launch can ask for is compiled and loaded with the large shared-memory limit.
    #[test]
    fn tensor_kernel_names_exist() {
        for kernel in [
            MoeKernel::Tensor,
            MoeKernel::TensorS4,
            MoeKernel::TensorNoHint,
        ] {
            for tt in [1, 2, 4] {
                assert_eq!(tensor_tile(tt), tt);
                let (gate_up, down, _) = tensor_kernels(kernel, tt);
                for name in [gate_up, down] {
                    assert!(
                        super::super::is_big_smem_kernel(&name),
                        "{name} is not in KERNELS as a big shared-memory kernel"
                    );
                }
            }
        }
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
