//! The CUDA measurements of `deltafin-cudabench`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use deltafin_quant::cuda::copy_rate::{CopyTimes, copy_times, median_event_ms, mma_sync_rate};
use deltafin_quant::cuda::moe::{self, ExpertPtrs, Glu, MoeKernel, MoeShape, SlotRef};
use deltafin_quant::cuda::{Gpu, device_address};
use deltafin_runtime::{DevicePref, Engine, EngineOptions, argmax};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// K3's routed expert: latent width and inner width.
const WIDTH: usize = 3584;
const INTER: usize = 3072;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// [`median_event_ms`] for closures that answer `anyhow` errors.
pub(crate) fn time_ms(
    gpu: &Gpu,
    reps: usize,
    f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    median_event_ms(gpu, reps, f)
}

struct DeviceExpert {
    bufs: Vec<CudaSlice<u8>>,
}

fn random_expert(gpu: &Gpu, rng: &mut ChaCha8Rng) -> anyhow::Result<DeviceExpert> {
    let lens = [
        INTER * WIDTH / 2,
        INTER * WIDTH / 32,
        WIDTH * INTER / 2,
        WIDTH * INTER / 32,
        INTER * WIDTH / 2,
        INTER * WIDTH / 32,
    ];
    let mut bufs = Vec::new();
    for (i, len) in lens.into_iter().enumerate() {
        let bytes: Vec<u8> = if i % 2 == 0 {
            (0..len).map(|_| rng.random::<u8>()).collect()
        } else {
            (0..len).map(|_| rng.random_range(118u8..=126)).collect()
        };
        bufs.push(gpu.upload(&bytes)?);
    }
    Ok(DeviceExpert { bufs })
}

impl DeviceExpert {
    fn ptrs(&self, gpu: &Gpu) -> ExpertPtrs {
        let a = |i: usize| device_address(gpu.stream(), &self.bufs[i]);
        ExpertPtrs {
            w1: a(0),
            s1: a(1),
            w2: a(2),
            s2: a(3),
            w3: a(4),
            s3: a(5),
        }
    }
}

/// MoE kernels on `n_experts` experts of K3's shape, each multiplying `t` tokens, against a device copy of the
/// same bytes (timed before and after the kernels). Each kernel family's output is compared with the first
/// family's (relative L2 difference of y).
pub fn moe_bw(
    n_experts: usize,
    tokens: &[usize],
    reps: usize,
    kernels: &[String],
) -> anyhow::Result<()> {
    let kernels = kernels
        .iter()
        .map(|k| k.parse::<MoeKernel>().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let gpu = Gpu::shared()?;
    println!("device: {}", gpu.name());
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let experts = (0..n_experts)
        .map(|_| random_expert(&gpu, &mut rng))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let weight_bytes: usize = experts
        .iter()
        .map(|e| e.bufs.iter().map(|b| b.len()).sum::<usize>())
        .sum();

    let report_copy = |when: &str| -> anyhow::Result<f64> {
        let CopyTimes {
            kernel_us: k_us,
            memcpy_us: m_us,
            ..
        } = copy_times(&gpu, weight_bytes, reps)?;
        let (k_bw, m_bw) = (
            2.0 * weight_bytes as f64 / (k_us * 1e-6),
            2.0 * weight_bytes as f64 / (m_us * 1e-6),
        );
        println!(
            "device-to-device copy of {:.1} MB ({when}): kernel {k_us:.1} us = {:.0} GB/s, cuMemcpyDtoD {m_us:.1} us = \
             {:.0} GB/s (read + write)",
            weight_bytes as f64 / 1e6,
            k_bw / 1e9,
            m_bw / 1e9
        );
        Ok(k_bw.max(m_bw))
    };
    let ref_bw = report_copy("before")?;
    let shape = MoeShape {
        width: WIDTH,
        inter: INTER,
        glu: Glu::Situ {
            beta: 4.0,
            linear_beta: 25.0,
        },
    };
    let mut rows_out = Vec::new();
    for &t in tokens {
        let x: Vec<f32> = (0..t * WIDTH)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let xd = gpu.upload(&x)?;
        let pair_row: Vec<i32> = (0..n_experts)
            .flat_map(|_| (0..t as i32).collect::<Vec<_>>())
            .collect();
        let rows = gpu.upload(&pair_row)?;
        let slots: Vec<SlotRef> = experts
            .iter()
            .enumerate()
            .map(|(i, e)| SlotRef {
                ptrs: e.ptrs(&gpu),
                pair0: i * t,
                n_rows: t,
            })
            .collect();
        let mut first: Option<Vec<f32>> = None;
        for &kernel in &kernels {
            let mut act = gpu.zeros::<f32>(n_experts * t * INTER)?;
            let mut y = gpu.zeros::<f32>(n_experts * t * WIDTH)?;
            let ms = time_ms(&gpu, reps, || {
                moe::run_experts_with(&gpu, &shape, &slots, &rows, &xd, &mut act, &mut y, kernel)?;
                Ok(())
            })?;
            // Ten calls back to back between two events: the launch latency of one call is hidden.
            let a = gpu
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let b = gpu
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            a.record(gpu.stream())?;
            for _ in 0..10 {
                moe::run_experts_with(&gpu, &shape, &slots, &rows, &xd, &mut act, &mut y, kernel)?;
            }
            b.record(gpu.stream())?;
            let b2b_ms = a.elapsed_ms(&b)? as f64 / 10.0;
            let out = gpu.download(&y)?;
            if out.iter().any(|v| !v.is_finite()) {
                bail!("non-finite MoE output at {t} tokens ({kernel:?})");
            }
            let diff = match &first {
                None => {
                    first = Some(out);
                    0.0
                }
                Some(f) => {
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for (a, b) in f.iter().zip(&out) {
                        num += (*a as f64 - *b as f64).powi(2);
                        den += (*a as f64).powi(2);
                    }
                    (num / den.max(1e-300)).sqrt()
                }
            };
            rows_out.push((t, kernel, ms, b2b_ms, diff));
        }
    }
    let ref_after = report_copy("after")?;
    let ref_bw = ref_bw.max(ref_after);
    // The many-token kernels' floor on the tensor cores: fp16 hi and lo halves of every input, so each weight meets
    // each token (padded to the mma's 8) twice, at the mma.sync rate measured now.
    let mma = mma_sync_rate(&gpu, reps)?;
    let params = n_experts * 3 * INTER * WIDTH;
    println!(
        "mma.sync m16n8k16 (fp16 in, f32 sums): {:.0} TFLOP/s; hi/lo GEMM floor at that rate: {}",
        mma / 1e12,
        tokens
            .iter()
            .map(|&t| {
                let flop = 2.0 * 2.0 * params as f64 * t.div_ceil(8) as f64 * 8.0;
                format!("T = {t}: {:.1} us", flop / mma * 1e6)
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "| tokens | kernel | experts | weight MB | time us | weight GB/s | % of copy | back-to-back us | % of copy | \
         rel. diff vs {:?} |",
        kernels[0]
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    // Issue 20 item 4: each kernel's time at 64 tokens against the first kernel's (the default's) at one.
    let time_at =
        |t: usize, k: MoeKernel| rows_out.iter().find(|r| r.0 == t && r.1 == k).map(|r| r.2);
    let item4: Vec<String> = time_at(1, kernels[0])
        .map(|one| {
            kernels
                .iter()
                .filter_map(|&k| Some(format!("{k:?} {:.2}x", time_at(64, k)? / one)))
                .collect()
        })
        .unwrap_or_default();
    for (t, kernel, ms, b2b_ms, diff) in rows_out {
        let bw = weight_bytes as f64 / (ms * 1e-3);
        let bw2 = weight_bytes as f64 / (b2b_ms * 1e-3);
        println!(
            "| {t} | {kernel:?} | {n_experts} | {:.1} | {:.1} | {:.0} | {:.1}% | {:.1} | {:.1}% | {diff:.2e} |",
            weight_bytes as f64 / 1e6,
            ms * 1e3,
            bw / 1e9,
            100.0 * bw / ref_bw,
            b2b_ms * 1e3,
            100.0 * bw2 / ref_bw,
        );
    }
    if !item4.is_empty() {
        println!(
            "T = 64 against {:?} at T = 1 (issue 20 item 4 asks at most 3x): {}",
            kernels[0],
            item4.join(", ")
        );
    }
    Ok(())
}

/// Seconds per decoded token on each device of `devs`, alternating devices, with identical greedy tokens.
pub fn decode(
    model: &Path,
    devs: &[String],
    prompt_len: usize,
    tokens: usize,
    runs: usize,
    gpu_cache_gb: Option<f64>,
) -> anyhow::Result<()> {
    let prompt: Vec<u32> = (1..=prompt_len as u32).collect();
    let mut engines = Vec::new();
    for d in devs {
        let pref: DevicePref = d.parse().map_err(anyhow::Error::msg)?;
        let mut opts = EngineOptions::default().with_device(pref);
        opts.device.gpu_cache_bytes = gpu_cache_gb.map(|gb| (gb * (1u64 << 30) as f64) as u64);
        let t = Instant::now();
        let engine = Engine::open(model, opts).with_context(|| format!("opening on {d}"))?;
        println!(
            "{d}: opened on {} in {:.1} s",
            engine.device_name(),
            t.elapsed().as_secs_f64()
        );
        engines.push((d.clone(), Arc::new(engine)));
    }
    let run_once = |engine: &Engine| -> anyhow::Result<(Vec<u32>, Vec<f64>, f64)> {
        let mut s = engine.session();
        let t = Instant::now();
        let logits = s.prefill(&prompt)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut next = argmax(logits.row(prompt.len() - 1));
        let mut out = vec![next];
        let mut steps = Vec::new();
        for _ in 0..tokens {
            let t = Instant::now();
            let row = s.step(next)?;
            steps.push(t.elapsed().as_secs_f64());
            next = argmax(&row);
            out.push(next);
        }
        Ok((out, steps, prefill_s))
    };
    // Warm-up: fills page cache and the GPU expert cache as a long session would.
    for (d, e) in &engines {
        let (toks, steps, _) = run_once(e)?;
        println!(
            "{d}: warm-up {} steps, first step {:.3} s, tokens {toks:?}",
            steps.len(),
            steps.first().copied().unwrap_or(0.0)
        );
    }
    let mut per_dev: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    let mut prefill: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
    let mut reference: Option<Vec<u32>> = None;
    for r in 0..runs {
        let order: Vec<usize> = if r % 2 == 0 {
            (0..engines.len()).collect()
        } else {
            (0..engines.len()).rev().collect()
        };
        for i in order {
            let (d, e) = &engines[i];
            let (toks, steps, pf) = run_once(e)?;
            match &reference {
                None => reference = Some(toks.clone()),
                Some(t) if *t != toks => {
                    bail!("{d}: greedy tokens {toks:?} differ from {t:?}")
                }
                Some(_) => {}
            }
            let mut s = steps.clone();
            println!(
                "run {r} {d}: median step {:.4} s (min {:.4}, max {:.4}), prefill {:.3} s",
                median(&mut s),
                s[0],
                s[s.len() - 1],
                pf
            );
            per_dev[i].extend(steps);
            prefill[i].push(pf);
        }
    }
    println!("| device | s/token (median) | min | max | prefill {prompt_len} tokens (median) |");
    println!("|---|---|---|---|---|");
    for (i, (d, e)) in engines.iter().enumerate() {
        let v = &mut per_dev[i];
        let m = median(v);
        println!(
            "| {d}: {} | {m:.4} | {:.4} | {:.4} | {:.3} s |",
            e.device_name(),
            v[0],
            v[v.len() - 1],
            median(&mut prefill[i])
        );
        if let Some(st) = e.expert_cache_stats() {
            println!(
                "  gpu expert cache: {} slots, {} hits, {} misses ({:.1}% hits), {} evictions, {:.2} GB uploaded \
                 in {:.2} s of helper time",
                st.capacity,
                st.hits,
                st.misses,
                100.0 * st.hit_rate(),
                st.evictions,
                st.uploaded_bytes as f64 / 1e9,
                st.upload_secs
            );
        }
    }
    println!(
        "greedy tokens identical on every device: {:?}",
        reference.unwrap_or_default()
    );
    Ok(())
}

/// Host-to-device rates of `mib`-MiB uploads, medians of `reps` after one warm-up each: copies from a pinned buffer
/// (the link's rate, the bound issue 20 holds uploads to; event-timed by `copy_rate::pinned_upload_rate`), the engine's staged uploads from pageable memory
/// (`Gpu::upload_large`: CPU copies into two pinned buffers overlapped with their DMA) and plain pageable uploads
/// (`Gpu::upload`). Prints one JSON line.
pub fn upload_bw(mib: usize, reps: usize) -> anyhow::Result<()> {
    let gpu = Gpu::shared()?;
    let bytes = mib.max(1) << 20;
    let reps = reps.max(1);
    let host: Vec<u8> = (0..bytes)
        .map(|i| (i.wrapping_mul(31) >> 3) as u8)
        .collect();
    let timed = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        f()?;
        let mut rates = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            f()?;
            rates.push(bytes as f64 / t.elapsed().as_secs_f64());
        }
        Ok(median(&mut rates))
    };
    let pinned_rate = deltafin_quant::cuda::copy_rate::pinned_upload_rate(&gpu, bytes, reps)?;
    let staged_rate = timed(&mut || {
        let (buf, done) = gpu.upload_large(&host)?;
        match done {
            Some(ev) => ev.synchronize()?,
            None => gpu.synchronize()?,
        }
        drop(buf);
        Ok(())
    })?;
    let pageable_rate = timed(&mut || {
        let buf = gpu.upload(&host)?;
        gpu.synchronize()?;
        drop(buf);
        Ok(())
    })?;
    println!(
        "{{\"device\":{:?},\"bytes\":{bytes},\"pinned_gb_s\":{:.2},\"staged_gb_s\":{:.2},\"pageable_gb_s\":{:.2},\
         \"staged_over_pinned\":{:.3}}}",
        gpu.name(),
        pinned_rate / 1e9,
        staged_rate / 1e9,
        pageable_rate / 1e9,
        staged_rate / pinned_rate,
    );
    Ok(())
}

/// The dense (spine) GEMM of `DeviceMatrix::gemm_many_device` on matrices of K3's attention shapes (bf16, or the
/// same values as the int8 spine's rows: each of `kinds`), for each token count, against a device copy of the same
/// bytes in the same process (read + write counted, as for the MoE kernels). Prints one JSON line per kind, shape
/// and token count.
pub fn dense_bw(
    tokens: &[usize],
    reps: usize,
    splits: &[usize],
    kinds: &[String],
) -> anyhow::Result<()> {
    use deltafin_quant::cuda::dense::DeviceMatrix;
    use deltafin_quant::{DenseData, DenseMatrix};
    let gpu = Gpu::shared()?;
    println!(
        "device: {} ({} dense GEMM blocks at once)",
        gpu.name(),
        gpu.dense_slots()
    );
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // KDA's q, k, v and output gate (also the four in one launch, as a layer runs them); the output projection of
    // KDA and MLA; MLA's q_b.
    let shapes = [
        ("kda_qkvg", 12288usize, 7168usize, 1usize),
        ("kda_qkvg_x4", 12288, 7168, 4),
        ("attn_o", 7168, 12288, 1),
        ("mla_q_b", 18432, 1536, 1),
    ];
    for kind in kinds {
        let int8 = match kind.as_str() {
            "bf16" => false,
            "int8" => true,
            other => anyhow::bail!("--kinds takes bf16 and int8, not `{other}`"),
        };
        for (name, rows, cols, count) in shapes {
            let mut mats = Vec::with_capacity(count);
            for _ in 0..count {
                let bits: Vec<u16> = (0..rows * cols)
                    .map(|_| 0x3c00 | (rng.random::<u16>() & 0x80ff))
                    .collect();
                let m = DenseMatrix::new(rows, cols, DenseData::Bf16(bits.into()))?;
                let m = if int8 { m.to_int8() } else { m };
                let d = DeviceMatrix::upload(&gpu, &m)?
                    .with_context(|| format!("{name}: the matrix did not go to the GPU"))?;
                anyhow::ensure!(d.is_int8() == int8, "{name}: {kind} did not stay {kind}");
                mats.push(d);
            }
            // Weight bytes (an int8 row's scale is four more bytes).
            let bytes = count * rows * if int8 { cols + 4 } else { cols * 2 };
            dense_bw_shape(
                &gpu,
                (name, kind),
                (rows, cols),
                (&mut mats, bytes),
                (tokens, reps, splits),
                &mut rng,
            )?;
        }
    }
    Ok(())
}

/// One shape of [`dense_bw`]: `mats` (`bytes` of weights) at every split and token count.
fn dense_bw_shape(
    gpu: &Arc<Gpu>,
    (name, kind): (&str, &str),
    (rows, cols): (usize, usize),
    (mats, bytes): (&mut [deltafin_quant::cuda::dense::DeviceMatrix], usize),
    (tokens, reps, splits): (&[usize], usize, &[usize]),
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<()> {
    use deltafin_quant::cuda::dense::DeviceMatrix;
    let count = mats.len();
    let copy_bw = copy_times(gpu, bytes, reps)?.rate();
    for &split in splits {
        let fixed = (split != 0).then_some(split);
        for m in mats.iter_mut() {
            m.set_split(fixed)?;
        }
        let dms: Vec<&DeviceMatrix> = mats.iter().collect();
        for &t in tokens {
            let x: Vec<f32> = (0..t * cols).map(|_| rng.random::<f32>() - 0.5).collect();
            let xd = gpu.upload(&x)?;
            let mut ys = (0..count)
                .map(|_| gpu.zeros::<f32>(t * rows))
                .collect::<Result<Vec<_>, _>>()?;
            let ms = time_ms(gpu, reps, || {
                let mut refs: Vec<&mut _> = ys.iter_mut().collect();
                DeviceMatrix::gemm_many_device(&dms, &xd, t, &mut refs)?;
                Ok(())
            })?;
            let bw = bytes as f64 / (ms * 1e-3);
            println!(
                "{{\"shape\":\"{name}\",\"kind\":\"{kind}\",\"rows\":{rows},\"cols\":{cols},\
                     \"matrices\":{count},\"split\":\"{}\",\"tokens\":{t},\"us\":{:.1},\"weight_gb_s\":{:.0},\
                     \"copy_gb_s\":{:.0},\"of_copy\":{:.3}}}",
                fixed.map_or("launch's".to_string(), |s| s.to_string()),
                ms * 1e3,
                bw / 1e9,
                copy_bw / 1e9,
                bw / copy_bw
            );
        }
    }
    Ok(())
}
