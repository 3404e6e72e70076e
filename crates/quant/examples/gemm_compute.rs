//! Multi-token (prefill) products against the f32 FMA peak measured in the same run.
//!
//! `cargo run --release -p deltafin-quant --example gemm_compute`
//!
//! On one thread and on every thread: the FMA peak (`deltafin_quant::flops`), then bf16 `[3072, 7168]` times 64
//! inputs through `DenseMatrix::gemm` (each weight row once, every token's product in the contract's order), each
//! as GFLOP/s (2 per weight and token) and as a share of the peak; the median of 5 passes after a warm-up.

use std::time::Instant;

use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::flops::fma_peak;

const PASSES: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let (rows, cols, tokens) = (3072usize, 7168usize, 64usize);
    let bits: Vec<u16> = (0..rows * cols)
        .map(|i| 0x3c00 | ((i.wrapping_mul(2_654_435_761) >> 9) as u16 & 0x83ff))
        .collect();
    let m = DenseMatrix::new(rows, cols, DenseData::Bf16(bits.into())).expect("shape");
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.01)
        .collect();
    let flop = 2.0 * (rows * cols * tokens) as f64;
    for threads in [1, rayon::current_num_threads()] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| {
            let peak = median((0..PASSES).map(|_| fma_peak(20_000_000)).collect());
            std::hint::black_box(m.gemm(&x, tokens).expect("gemm"));
            let rate = median(
                (0..PASSES)
                    .map(|_| {
                        let t = Instant::now();
                        std::hint::black_box(m.gemm(&x, tokens).expect("gemm"));
                        flop / t.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            println!(
                "{threads} thread(s): FMA peak {:.1} GFLOP/s; bf16 [{rows}, {cols}] x {tokens} tokens {:.1} GFLOP/s
             ({:.2} of peak)",
                peak / 1e9,
                rate / 1e9,
                rate / peak
            );
        });
    }
}
