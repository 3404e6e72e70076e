//! Multi-token (prefill) products against the f32 FMA peak measured in the same run.
//!
//! `cargo run --release -p deltafin-quant --example gemm_compute [-- --tokens 64,1024]`
//!
//! For each token count (default 64 and 1024), on one thread and on every thread: the FMA peak
//! (`deltafin_quant::flops`), then bf16 and f32 `[3072, 7168]` times that many inputs through `DenseMatrix::gemm`
//! (each weight row once, every token's product in the contract's order; f32 also one `dot_f32` at a time, as the
//! products ran before the multi-token f32 kernels), row-wise int8 (the int8 spine's form, inputs quantised to int16) and eight
//! MXFP4 experts' `[3072, 3584]` gate matrices times that many inputs
//! each in one `gemm_batch` (exact f32 inputs),
//! each as GFLOP/s (2 per weight and token) and as a share of the peak measured right before it; the medians of 5
//! passes after a warm-up. First, which bf16 and f32 kernels this machine runs (`bf16_contract::lanes_chosen`,
//! `lanes_kernel`, `dot::f32_lanes_chosen`).

use std::time::Instant;

use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::dot::dot_f32;
use deltafin_quant::flops::fma_peak;
use deltafin_quant::mxfp4::{Mxfp4Matrix, Mxfp4Product, gemm_batch};

const PASSES: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `f` once right after an FMA peak reading (kept in `peaks`): its GFLOP rate for `flop` and that rate's share
/// of the peak.
fn timed(peaks: &mut Vec<f64>, flop: f64, f: impl FnOnce()) -> (f64, f64) {
    let peak = fma_peak(5_000_000);
    peaks.push(peak);
    let t = Instant::now();
    f();
    let rate = flop / t.elapsed().as_secs_f64();
    (rate, rate / peak)
}

fn main() {
    // The engine's allocator settings (its buffers reused, not mapped afresh each call).
    deltafin_quant::allocator::keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let counts: Vec<usize> = match args.iter().position(|a| a == "--tokens") {
        Some(i) => args
            .get(i + 1)
            .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_default(),
        None => vec![64, 1024],
    };
    if counts.is_empty() {
        eprintln!("--tokens takes a comma-separated list of counts, e.g. 64,1024");
        std::process::exit(2);
    }
    for tokens in counts {
        run(tokens);
    }
}

fn run(tokens: usize) {
    let (rows, cols) = (3072usize, 7168usize);
    let bits: Vec<u16> = (0..rows * cols)
        .map(|i| 0x3c00 | ((i.wrapping_mul(2_654_435_761) >> 9) as u16 & 0x83ff))
        .collect();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.01)
        .collect();
    let f32s: Vec<f32> = bits
        .iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect();
    // Row-wise int8 (the spine `cargo xtask convert-spine-int8` writes): the bf16 bits' top byte as the value.
    let q: Vec<i8> = bits.iter().map(|&b| (b >> 8) as i8).collect();
    let m8 = DenseMatrix::new(
        rows,
        cols,
        DenseData::Int8 {
            q: q.into(),
            scales: vec![0.01; rows],
        },
    )
    .expect("shape");
    let m = DenseMatrix::new(rows, cols, DenseData::Bf16(bits.into())).expect("shape");
    let mf = DenseMatrix::new(rows, cols, DenseData::F32(f32s.clone())).expect("shape");
    let one_at_a_time = || {
        use rayon::prelude::*;
        let y: Vec<f32> = (0..rows * tokens)
            .into_par_iter()
            .with_min_len(64)
            .map(|i| {
                let (r, t) = (i / tokens, i % tokens);
                dot_f32(
                    &f32s[r * cols..(r + 1) * cols],
                    &x[t * cols..(t + 1) * cols],
                )
            })
            .collect();
        y
    };
    let flop = 2.0 * (rows * cols * tokens) as f64;
    let (er, ec, experts) = (3072usize, 3584usize, 8usize);
    let codes: Vec<Vec<u8>> = (0..experts)
        .map(|e| {
            (0..er * ec / 2)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> (9 + e % 3)) as u8)
                .collect()
        })
        .collect();
    let scales = vec![124u8; er * ec / 32];
    let ex: Vec<f32> = (0..tokens * ec)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.01)
        .collect();
    let mut ys = vec![vec![0.0f32; tokens * er]; experts];
    let mx_flop = 2.0 * (experts * er * ec * tokens) as f64;
    let mut run_mx = || {
        let mut products: Vec<Mxfp4Product<'_, '_>> = codes
            .iter()
            .zip(ys.iter_mut())
            .map(|(c, y)| Mxfp4Product {
                matrix: Mxfp4Matrix::new(c, &scales, er, ec).expect("valid"),
                x: &ex,
                t_rows: tokens,
                y,
            })
            .collect();
        gemm_batch(&mut products).expect("batch");
    };
    #[cfg(target_arch = "x86_64")]
    println!(
        "bf16 products of many inputs: {} (DELTAFIN_BF16_LANES=on|off and DELTAFIN_BF16_WIDEN=ahead|in-loop choose)",
        if deltafin_quant::bf16_contract::lanes_chosen() {
            match deltafin_quant::bf16_contract::lanes_kernel() {
                deltafin_quant::bf16_contract::LanesKernel::Ahead => {
                    "inputs across the lanes, weights widened ahead"
                }
                deltafin_quant::bf16_contract::LanesKernel::InLoop => {
                    "inputs across the lanes, weights widened in the loop"
                }
            }
        } else {
            "tiles of rows by inputs"
        }
    );
    #[cfg(target_arch = "x86_64")]
    let f32_lanes = deltafin_quant::dot::f32_lanes_chosen();
    #[cfg(not(target_arch = "x86_64"))]
    let f32_lanes = false;
    println!(
        "f32 products of many inputs: {} (DELTAFIN_F32_LANES=on|off chooses)",
        if f32_lanes {
            "inputs across the lanes"
        } else {
            "tiles of rows by inputs"
        }
    );
    for threads in [1, rayon::current_num_threads()] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| {
            std::hint::black_box(m.gemm(&x, tokens).expect("gemm"));
            run_mx();
            // Each pass: the peak right before each kernel, so that a change of machine speed between them (this
            // project's machines are shared) shows in both.
            let mut bf16 = Vec::new();
            let mut f32t = Vec::new();
            let mut f32o = Vec::new();
            let mut i8s = Vec::new();
            let mut mx = Vec::new();
            let mut peaks = Vec::new();
            for _ in 0..PASSES {
                bf16.push(timed(&mut peaks, flop, || {
                    std::hint::black_box(m.gemm(&x, tokens).expect("gemm"));
                }));
                f32t.push(timed(&mut peaks, flop, || {
                    std::hint::black_box(mf.gemm(&x, tokens).expect("gemm"));
                }));
                f32o.push(timed(&mut peaks, flop, || {
                    std::hint::black_box(one_at_a_time());
                }));
                i8s.push(timed(&mut peaks, flop, || {
                    std::hint::black_box(m8.gemm(&x, tokens).expect("gemm"));
                }));
                mx.push(timed(&mut peaks, mx_flop, &mut run_mx));
            }
            let med = |v: &[(f64, f64)]| {
                (
                    median(v.iter().map(|p| p.0).collect()),
                    median(v.iter().map(|p| p.1).collect()),
                )
            };
            let ((bf16_rate, bf16_share), (mx_rate, mx_share)) = (med(&bf16), med(&mx));
            let ((ft_rate, ft_share), (fo_rate, fo_share)) = (med(&f32t), med(&f32o));
            let (i8_rate, i8_share) = med(&i8s);
            println!(
                "{threads} thread(s): bf16 [{rows}, {cols}] x {tokens} tokens {:.1} GFLOP/s ({bf16_share:.2} of the FMA \
                 peak); f32 {:.1} ({ft_share:.2}), f32 one product at a time {:.1} ({fo_share:.2}); int8 {:.1} \
                 ({i8_share:.2}); MXFP4 \
                 {experts} x [{er}, {ec}] x {tokens} tokens {:.1} GFLOP/s ({mx_share:.2}); FMA peak {:.0} GFLOP/s \
                 (median)",
                bf16_rate / 1e9,
                ft_rate / 1e9,
                fo_rate / 1e9,
                i8_rate / 1e9,
                mx_rate / 1e9,
                median(peaks) / 1e9,
            );
        });
    }
}
