//! The launch of a KDA layer's heads on the GPU (`kda_layer` in `kernels/attention.cu`: everything between the
//! layer's input products and its output projection), a block per head. A token's arithmetic does not depend on
//! the pass or launch it falls in, so decode, prefill and speculative verification agree bit for bit (tested below
//! against an f64 form of the layer and across cuts).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_quant::cuda::{Gpu, device_address};

use super::cuda_err;
use crate::error::{ModelError, Result};

/// Widest head the kernel takes (a thread per value channel, `PARTS` key parts, at most 1,024 threads a block).
pub(crate) const MAX_HEAD_DIM: usize = 256;
/// Key parts (`KDA_PARTS` in `kernels/attention.cu`).
const PARTS: usize = 4;

/// Shared memory of `kda_layer` for heads of width `d`: the state, q, k, exp(g), the partial sums of the key parts
/// and a warp's worth of reduction scratch per part.
fn smem_bytes(d: usize) -> usize {
    (d * d + 3 * d + PARTS * d + PARTS * 32) * 4
}

/// Whether a layer with heads of width `d` and a conv of `kern` taps fits the kernel on `gpu`.
pub(crate) fn fits(gpu: &Gpu, d: usize, kern: usize) -> bool {
    (1..=MAX_HEAD_DIM).contains(&d) && kern >= 1 && smem_bytes(d) <= gpu.smem_limit()
}

/// A call's sizes and scalars.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadsShape {
    pub t_len: usize,
    pub heads: usize,
    pub d: usize,
    pub kern: usize,
    /// The decay gate's low rank (`f_a`'s rows).
    pub rank: usize,
    /// K3's gate lower bound (`None`: Kimi Linear's softplus gate).
    pub lower_bound: Option<f32>,
    pub eps: f32,
}

/// The device buffers a call reads and writes, as the kernel documents them: the raw q, k, v rows and the output
/// gate `[T, C]`, the old windows `[3, K-1, C]`, taps `[3, C, K]`, `f_a` `[T, R]`, `f_b` `[C, R]` (address, bf16
/// bits or f32), `dt_bias` `[C]`, `exp(A_log)` `[H]`, `b` `[T, H]`, the norm's weight `[D]`, the old state
/// `[H, D, D]` (address: it may be `state_out` itself), and the new state, windows and output rows.
pub(crate) struct HeadsIo<'a> {
    pub raw: [&'a CudaSlice<f32>; 3],
    pub win: &'a CudaSlice<f32>,
    pub taps: &'a CudaSlice<f32>,
    pub f_a: &'a CudaSlice<f32>,
    pub f_b: (u64, bool),
    pub dt_bias: &'a CudaSlice<f32>,
    pub a_exp: &'a CudaSlice<f32>,
    pub b_raw: &'a CudaSlice<f32>,
    pub gate: &'a CudaSlice<f32>,
    pub norm_w: &'a CudaSlice<f32>,
    pub state_in: u64,
    pub state_out: &'a mut CudaSlice<f32>,
    pub new_win: &'a mut CudaSlice<f32>,
    pub out: &'a mut CudaSlice<f32>,
}

/// The kernel's scratch, kept from call to call: q, k, v, g `[T, C]` and beta `[T, H]`.
#[derive(Default)]
pub(crate) struct HeadsScratch {
    bufs: [Option<CudaSlice<f32>>; 5],
}

/// Runs `kda_layer` on the compute stream of `gpu` for one call (checked: the head fits the kernel, every buffer of
/// `io` holds at least its documented size).
pub(crate) fn launch(
    gpu: &Gpu,
    io: HeadsIo<'_>,
    shape: &HeadsShape,
    scratch: &mut HeadsScratch,
) -> Result<()> {
    let HeadsShape {
        t_len,
        heads: h,
        d,
        kern,
        rank,
        lower_bound,
        eps,
    } = *shape;
    if !fits(gpu, d, kern) {
        return Err(ModelError::Device(format!(
            "cuda: KDA heads of width {d} with {kern} taps do not fit the kernel"
        )));
    }
    let c = h * d;
    let needs = [
        (io.raw[0].len(), t_len * c),
        (io.raw[1].len(), t_len * c),
        (io.raw[2].len(), t_len * c),
        (io.gate.len(), t_len * c),
        (io.out.len(), t_len * c),
        (io.win.len(), 3 * (kern - 1) * c),
        (io.new_win.len(), 3 * (kern - 1) * c),
        (io.taps.len(), 3 * c * kern),
        (io.f_a.len(), t_len * rank),
        (io.dt_bias.len(), c),
        (io.a_exp.len(), h),
        (io.b_raw.len(), t_len * h),
        (io.norm_w.len(), d),
        (io.state_out.len(), h * d * d),
    ];
    if needs.iter().any(|&(have, need)| have < need) {
        return Err(ModelError::Device(
            "cuda: a KDA buffer is smaller than its call".to_string(),
        ));
    }
    let [q, k, v, g, beta] = &mut scratch.bufs;
    let q = super::sized(gpu, q, t_len * c)?;
    let k = super::sized(gpu, k, t_len * c)?;
    let v = super::sized(gpu, v, t_len * c)?;
    let g = super::sized(gpu, g, t_len * c)?;
    let beta = super::sized(gpu, beta, t_len * h)?;
    let (t_i, h_i, d_i, k_i, r_i) = (t_len as i32, h as i32, d as i32, kern as i32, rank as i32);
    let f_b_bf16 = i32::from(io.f_b.1);
    let (bounded, lb) = match lower_bound {
        Some(lb) => (1i32, lb),
        None => (0i32, 0.0f32),
    };
    let f = gpu.function("kda_layer").map_err(cuda_err)?;
    let cfg = LaunchConfig {
        grid_dim: (h as u32, 1, 1),
        block_dim: (d.div_ceil(32) as u32 * 32, PARTS as u32, 1),
        shared_mem_bytes: smem_bytes(d) as u32,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(io.raw[0])
        .arg(io.raw[1])
        .arg(io.raw[2])
        .arg(io.win)
        .arg(io.taps)
        .arg(io.f_a)
        .arg(&io.f_b.0)
        .arg(&f_b_bf16)
        .arg(&r_i)
        .arg(io.dt_bias)
        .arg(io.a_exp)
        .arg(io.b_raw)
        .arg(io.gate)
        .arg(io.norm_w)
        .arg(&io.state_in)
        .arg(&mut *io.state_out)
        .arg(&mut *q)
        .arg(&mut *k)
        .arg(&mut *v)
        .arg(&mut *g)
        .arg(&mut *beta)
        .arg(&mut *io.new_win)
        .arg(&mut *io.out)
        .arg(&t_i)
        .arg(&h_i)
        .arg(&d_i)
        .arg(&k_i)
        .arg(&bounded)
        .arg(&lb)
        .arg(&eps);
    // SAFETY: every buffer holds at least what the kernel reads or writes for this shape (checked above; q, k, v, g
    // and beta sized here; f_b is [C, R] of its kind with whole 16-byte words a row, the caller's contract). The
    // kernel reads a head's old block whole before it writes the new one, so the old state may be `state_out`. The
    // grid is a block per head of (D rounded up to a warp) × PARTS threads with the shared memory of `smem_bytes`
    // (within the device's limit: `fits`).
    unsafe { b.launch(cfg) }.map_err(|e| ModelError::Device(format!("cuda: kda_layer: {e}")))?;
    Ok(())
}

/// The device's address of a buffer, for the old state (which may be the new state's own buffer).
pub(crate) fn address(gpu: &Gpu, buf: &CudaSlice<f32>) -> u64 {
    device_address(gpu.stream(), buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` values in `[lo, hi)` from a small LCG (the tests need varied values, not a distribution).
    fn values(seed: &mut u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                lo + (hi - lo) * ((*seed >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// A layer call's inputs on the host; `f_b` holds the values the kernel reads (bf16-rounded when `f_b_bf16`).
    struct Inputs {
        raw: [Vec<f32>; 3],
        win: Vec<f32>,
        taps: Vec<f32>,
        f_a: Vec<f32>,
        f_b: Vec<f32>,
        f_b_bf16: bool,
        dt_bias: Vec<f32>,
        a_exp: Vec<f32>,
        b_raw: Vec<f32>,
        gate: Vec<f32>,
        norm_w: Vec<f32>,
        state: Vec<f32>,
    }

    fn inputs(shape: &HeadsShape, seed: u64, f_b_bf16: bool) -> Inputs {
        let HeadsShape {
            t_len: t,
            heads: h,
            d,
            kern,
            rank,
            ..
        } = *shape;
        let c = h * d;
        let mut seed = seed;
        let mut v = |n: usize, lo: f32, hi: f32| values(&mut seed, n, lo, hi);
        let mut f_b = v(c * rank, -0.1, 0.1);
        if f_b_bf16 {
            f_b.iter_mut()
                .for_each(|x| *x = f32::from_bits(x.to_bits() & 0xffff_0000));
        }
        Inputs {
            raw: [
                v(t * c, -1.0, 1.0),
                v(t * c, -1.0, 1.0),
                v(t * c, -1.0, 1.0),
            ],
            win: v(3 * (kern - 1) * c, -1.0, 1.0),
            taps: v(3 * c * kern, -0.5, 0.5),
            f_a: v(t * rank, -1.0, 1.0),
            f_b,
            f_b_bf16,
            dt_bias: v(c, -1.0, 1.0),
            a_exp: v(h, 0.5, 2.0),
            b_raw: v(t * h, -2.0, 2.0),
            gate: v(t * c, -2.0, 2.0),
            norm_w: v(d, 0.5, 1.5),
            state: v(h * d * d, -0.1, 0.1),
        }
    }

    /// Runs the layer on the GPU as calls of `calls` tokens in turn (each call's state and windows the next one's
    /// old ones; after the first call the state is updated in place) and returns the output rows of every token,
    /// the last state and the last windows.
    fn run_gpu(
        gpu: &Gpu,
        shape: &HeadsShape,
        inp: &Inputs,
        calls: &[usize],
    ) -> Result<[Vec<f32>; 3]> {
        let HeadsShape {
            heads: h,
            d,
            kern,
            rank,
            ..
        } = *shape;
        let c = h * d;
        let up = |v: &[f32]| gpu.upload(v).map_err(cuda_err);
        let f_b_bits: Vec<u16> = inp.f_b.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let (f_b32, f_b16) = (up(&inp.f_b)?, gpu.upload(&f_b_bits).map_err(cuda_err)?);
        let f_b = if inp.f_b_bf16 {
            device_address(gpu.stream(), &f_b16)
        } else {
            device_address(gpu.stream(), &f_b32)
        };
        let (taps, dt_bias, a_exp, norm_w) = (
            up(&inp.taps)?,
            up(&inp.dt_bias)?,
            up(&inp.a_exp)?,
            up(&inp.norm_w)?,
        );
        let old = up(&inp.state)?;
        let mut state = up(&vec![f32::NAN; h * d * d])?;
        let mut win = up(&inp.win)?;
        let mut rows = Vec::new();
        let mut scratch = HeadsScratch::default();
        let mut t0 = 0;
        for (i, &n) in calls.iter().enumerate() {
            let part = |v: &[f32], w: usize| up(&v[t0 * w..(t0 + n) * w]);
            let raw = [
                part(&inp.raw[0], c)?,
                part(&inp.raw[1], c)?,
                part(&inp.raw[2], c)?,
            ];
            let (f_a, b_raw, gate) = (
                part(&inp.f_a, rank)?,
                part(&inp.b_raw, h)?,
                part(&inp.gate, c)?,
            );
            let mut new_win = up(&vec![f32::NAN; 3 * (kern - 1) * c])?;
            let mut out = up(&vec![f32::NAN; n * c])?;
            let state_in = if i == 0 {
                address(gpu, &old)
            } else {
                address(gpu, &state)
            };
            let io = HeadsIo {
                raw: [&raw[0], &raw[1], &raw[2]],
                win: &win,
                taps: &taps,
                f_a: &f_a,
                f_b: (f_b, inp.f_b_bf16),
                dt_bias: &dt_bias,
                a_exp: &a_exp,
                b_raw: &b_raw,
                gate: &gate,
                norm_w: &norm_w,
                state_in,
                state_out: &mut state,
                new_win: &mut new_win,
                out: &mut out,
            };
            launch(gpu, io, &HeadsShape { t_len: n, ..*shape }, &mut scratch)?;
            rows.extend(gpu.download(&out).map_err(cuda_err)?);
            win = new_win;
            t0 += n;
        }
        Ok([
            rows,
            gpu.download(&state).map_err(cuda_err)?,
            gpu.download(&win).map_err(cuda_err)?,
        ])
    }

    fn sigmoid(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    /// The layer's heads in f64, written plainly from the same inputs: output rows, new state, new windows.
    fn reference(shape: &HeadsShape, inp: &Inputs) -> [Vec<f64>; 3] {
        let HeadsShape {
            t_len,
            heads: h,
            d,
            kern,
            rank,
            lower_bound,
            eps,
        } = *shape;
        let (c, hist) = (h * d, kern - 1);
        let ext = |i: usize, r: usize, ch: usize| -> f64 {
            if r < hist {
                inp.win[(i * hist + r) * c + ch] as f64
            } else {
                inp.raw[i][(r - hist) * c + ch] as f64
            }
        };
        let mut state: Vec<f64> = inp.state.iter().map(|&x| x as f64).collect();
        let mut rows = vec![0.0f64; t_len * c];
        for head in 0..h {
            let s = &mut state[head * d * d..(head + 1) * d * d];
            let a = inp.a_exp[head] as f64;
            for t in 0..t_len {
                let mut qkv = [vec![0.0f64; d], vec![0.0f64; d], vec![0.0f64; d]];
                let mut g = vec![0.0f64; d];
                for j in 0..d {
                    let ch = head * d + j;
                    for (i, x) in qkv.iter_mut().enumerate() {
                        let conv: f64 = (0..kern)
                            .map(|kk| {
                                inp.taps[(i * c + ch) * kern + kk] as f64 * ext(i, t + kk, ch)
                            })
                            .sum();
                        x[j] = conv * sigmoid(conv);
                    }
                    let z: f64 = (0..rank)
                        .map(|r| inp.f_b[ch * rank + r] as f64 * inp.f_a[t * rank + r] as f64)
                        .sum::<f64>()
                        + inp.dt_bias[ch] as f64;
                    g[j] = match lower_bound {
                        Some(lb) => lb as f64 * sigmoid(a * z),
                        None => -a * (1.0 + z.exp()).ln(),
                    };
                }
                let [q, k, v] = &mut qkv;
                for (x, scale) in [(&mut *q, (d as f64).powf(-0.5)), (&mut *k, 1.0)] {
                    let n = (x.iter().map(|y| y * y).sum::<f64>() + 1e-6).sqrt();
                    x.iter_mut().for_each(|y| *y = *y / n * scale);
                }
                let beta = sigmoid(inp.b_raw[t * h + head] as f64);
                for i in 0..d {
                    let e = g[i].exp();
                    s[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= e);
                }
                let mut o = vec![0.0f64; d];
                for j in 0..d {
                    let u: f64 = (0..d).map(|i| s[i * d + j] * k[i]).sum();
                    let delta = beta * (v[j] - u);
                    for i in 0..d {
                        s[i * d + j] += k[i] * delta;
                    }
                    o[j] = (0..d).map(|i| s[i * d + j] * q[i]).sum();
                }
                let inv =
                    1.0 / (o.iter().map(|x| x * x).sum::<f64>() / d as f64 + eps as f64).sqrt();
                for (j, (&oj, &w)) in o.iter().zip(&inp.norm_w).enumerate() {
                    let off = t * c + head * d + j;
                    rows[off] = oj * inv * w as f64 * sigmoid(inp.gate[off] as f64);
                }
            }
        }
        let mut win = vec![0.0f64; 3 * hist * c];
        for i in 0..3 {
            for r in 0..hist {
                for ch in 0..c {
                    win[(i * hist + r) * c + ch] = ext(i, r + t_len, ch);
                }
            }
        }
        [rows, state, win]
    }

    fn shape(t_len: usize, d: usize, rank: usize, lower_bound: Option<f32>) -> HeadsShape {
        HeadsShape {
            t_len,
            heads: 3,
            d,
            kern: 4,
            rank,
            lower_bound,
            eps: 1e-5,
        }
    }

    /// The kernel against the f64 reference: K3's head width and two narrower ones (one not a whole number of
    /// warps); one token, a few, and a longer pass; both gate forms and kinds of f_b.
    /// Rows and state within 1e-5 of the reference's norm, windows exact.
    #[test]
    fn kernel_matches_the_f64_reference() {
        let gpu = Gpu::shared().expect("a CUDA GPU (these tests run on the device machine)");
        for (d, rank) in [(128, 16), (40, 8), (16, 8)] {
            for t_len in [1, 5, 37] {
                for (case, lower_bound) in [Some(-5.0f32), None].into_iter().enumerate() {
                    let sh = shape(t_len, d, rank, lower_bound);
                    let inp = inputs(&sh, (d * 31 + t_len * 7 + case) as u64, case == 0);
                    let got = run_gpu(&gpu, &sh, &inp, &[t_len]).expect("the kernel runs");
                    let want = reference(&sh, &inp);
                    for (what, (g, w)) in ["rows", "state", "windows"]
                        .iter()
                        .zip(got.iter().zip(&want))
                    {
                        assert!(g.iter().all(|x| x.is_finite()), "{what}: D {d}, T {t_len}");
                        let err = g
                            .iter()
                            .zip(w)
                            .map(|(&a, &b)| (a as f64 - b).powi(2))
                            .sum::<f64>()
                            .sqrt();
                        let norm = w.iter().map(|b| b * b).sum::<f64>().sqrt();
                        assert!(
                            norm > 0.0 && err <= 1e-5 * norm,
                            "{what}: D {d}, T {t_len}: {err} of {norm}"
                        );
                    }
                }
            }
        }
    }

    /// A pass cut into calls anywhere (decode, chunked prefill, speculative verification) gives the bits of the
    /// whole pass: rows, state and windows.
    #[test]
    fn a_pass_cut_anywhere_gives_the_same_bits() {
        let gpu = Gpu::shared().expect("a CUDA GPU (these tests run on the device machine)");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        for d in [128, 40] {
            let t_len = 72;
            let sh = shape(t_len, d, 16, Some(-5.0));
            let inp = inputs(&sh, d as u64, true);
            let whole = run_gpu(&gpu, &sh, &inp, &[t_len]).expect("the kernel runs");
            for calls in [vec![1, 33, 38], vec![3; t_len / 3]] {
                let cut = run_gpu(&gpu, &sh, &inp, &calls).expect("the kernel runs");
                for (what, (a, b)) in ["rows", "state", "windows"]
                    .iter()
                    .zip(whole.iter().zip(&cut))
                {
                    assert_eq!(bits(a), bits(b), "{what}: D {d}, calls {calls:?}");
                }
            }
        }
    }
}
