//! `kda-bw`: one launch of a KDA layer's heads (everything of the layer between its input and output products) at
//! K3's shape on random inputs, timed by device events, against a device copy of the bytes it must move (the old
//! state read, the new one written, `f_b` read) in the same process, with a hash of its outputs' bits. `kda_layer` is
//! timed twice: launched again and again (its state and `f_b` then sit in L2), and with L2 cleared before each launch
//! (a 256 MiB buffer written), as in a decode step, where the other layers' weights have passed through L2 since the
//! layer last ran.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use deltafin_quant::cuda::copy_rate::copy_times;
use deltafin_quant::cuda::{Gpu, StreamTimer};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::bench::time_ms;

/// K3's KDA: heads, head width, conv taps, rank of the decay gate's low-rank product.
const HEADS: usize = 96;
const D: usize = 128;
const KERN: usize = 4;
const RANK: usize = 128;
/// Key parts of `kda_layer` (`KDA_PARTS` in `kernels/attention.cu`).
const PARTS: usize = 4;
/// Bytes written to clear L2 before a cold launch (H100 and H200 have 50 and 60 MiB of L2).
const FLUSH_BYTES: usize = 256 << 20;

/// Times `kda_layer` for each token count; prints one JSON line per count.
pub fn kda_bw(tokens: &[usize], reps: usize) -> anyhow::Result<()> {
    let gpu = Gpu::shared()?;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let c = HEADS * D;
    let state_bytes = HEADS * D * D * 4;
    let copy = copy_times(&gpu, state_bytes, reps)?;
    let mut rand = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    };
    let taps = gpu.upload(&rand(3 * c * KERN, -0.5, 0.5))?;
    let win = gpu.upload(&rand(3 * (KERN - 1) * c, -1.0, 1.0))?;
    let f_b: Vec<u16> = rand(c * RANK, -0.1, 0.1)
        .into_iter()
        .map(|x| (x.to_bits() >> 16) as u16)
        .collect();
    let f_b = gpu.upload(&f_b)?;
    let dt_bias = gpu.upload(&rand(c, -1.0, 1.0))?;
    let a_exp = gpu.upload(&rand(HEADS, 0.5, 2.0))?;
    let norm_w = gpu.upload(&rand(D, 0.5, 1.5))?;
    let state_in = gpu.upload(&rand(HEADS * D * D, -0.1, 0.1))?;
    let mut state_out = gpu.zeros::<f32>(HEADS * D * D)?;
    let mut new_win = gpu.zeros::<f32>(3 * (KERN - 1) * c)?;
    let mut flush = gpu.zeros::<u8>(FLUSH_BYTES)?;
    let (lb, eps) = (-5.0f32, 1e-5f32);
    for &t in tokens {
        let raw_q = gpu.upload(&rand(t * c, -1.0, 1.0))?;
        let raw_k = gpu.upload(&rand(t * c, -1.0, 1.0))?;
        let raw_v = gpu.upload(&rand(t * c, -1.0, 1.0))?;
        let f_a = gpu.upload(&rand(t * RANK, -1.0, 1.0))?;
        let b_raw = gpu.upload(&rand(t * HEADS, -2.0, 2.0))?;
        let gate = gpu.upload(&rand(t * c, -2.0, 2.0))?;
        let mut q = gpu.zeros::<f32>(t * c)?;
        let mut k = gpu.zeros::<f32>(t * c)?;
        let mut v = gpu.zeros::<f32>(t * c)?;
        let mut g = gpu.zeros::<f32>(t * c)?;
        let mut beta = gpu.zeros::<f32>(t * HEADS)?;
        let mut out = gpu.zeros::<f32>(t * c)?;
        let (one, rank, t_i, h_i, d_i, k_i) = (
            1i32,
            RANK as i32,
            t as i32,
            HEADS as i32,
            D as i32,
            KERN as i32,
        );
        let f = gpu.function("kda_layer")?;
        let cfg = LaunchConfig {
            grid_dim: (HEADS as u32, 1, 1),
            block_dim: (D as u32, PARTS as u32, 1),
            shared_mem_bytes: ((D * D + 3 * D + PARTS * D + PARTS * 32) * 4) as u32,
        };
        {
            let mut launch = || -> anyhow::Result<()> {
                let mut b = gpu.stream().launch_builder(f);
                b.arg(&raw_q)
                    .arg(&raw_k)
                    .arg(&raw_v)
                    .arg(&win)
                    .arg(&taps)
                    .arg(&f_a)
                    .arg(&f_b)
                    .arg(&one)
                    .arg(&rank)
                    .arg(&dt_bias)
                    .arg(&a_exp)
                    .arg(&b_raw)
                    .arg(&gate)
                    .arg(&norm_w)
                    .arg(&state_in)
                    .arg(&mut state_out)
                    .arg(&mut q)
                    .arg(&mut k)
                    .arg(&mut v)
                    .arg(&mut g)
                    .arg(&mut beta)
                    .arg(&mut new_win)
                    .arg(&mut out)
                    .arg(&t_i)
                    .arg(&h_i)
                    .arg(&d_i)
                    .arg(&k_i)
                    .arg(&one)
                    .arg(&lb)
                    .arg(&eps);
                // SAFETY: every buffer has the shape the kernel documents for T = t, H = 96, D = 128, K = 4, R = 128
                // (f_b as bf16 bits), and the grid, block and shared memory are the engine's
                // (`model/src/gpu/kda_heads.rs`).
                unsafe { b.launch(cfg) }?;
                Ok(())
            };
            let hot_us = 1e3 * time_ms(&gpu, reps, &mut launch)?;
            let cold_us = 1e3 * cold_ms(&gpu, reps, &mut flush, &mut launch)?;
            let moved = 2 * state_bytes + c * RANK * 2;
            let bound_us = moved as f64 / copy.rate() * 1e6;
            // FNV-1a over the bits of every output, so two kernels or builds can be compared bit for bit.
            let mut hash = 0xcbf2_9ce4_8422_2325u64;
            for x in [
                gpu.download(&out)?,
                gpu.download(&state_out)?,
                gpu.download(&new_win)?,
            ]
            .concat()
            {
                hash = (hash ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3);
            }
            println!(
                "{{\"kernel\":\"kda_layer\",\"tokens\":{t},\"us\":{hot_us:.2},\"cold_us\":{cold_us:.2},\
                 \"copy_bound_us\":{bound_us:.2},\"bits\":\"{hash:016x}\"}}"
            );
        }
    }
    Ok(())
}

/// The median device time of `launch` with L2 cleared before each run (`flush` written on the same stream first).
fn cold_ms(
    gpu: &Gpu,
    reps: usize,
    flush: &mut CudaSlice<u8>,
    launch: &mut impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let mut times = Vec::with_capacity(reps.max(1));
    let timer = StreamTimer::new(gpu)?;
    for _ in 0..reps.max(1) {
        gpu.stream().memset_zeros(flush)?;
        timer.start_on(gpu.stream())?;
        launch()?;
        timer.stop_on(gpu.stream())?;
        times.push(timer.elapsed()?.as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
