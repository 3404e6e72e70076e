//! Kernel throughput against memory read bandwidth, measured in the same process.
//!
//! `cargo run --release -p deltafin-quant --example kernel_bandwidth [-- --json]`
//!
//! Memory bound: a multi-threaded sum over a buffer larger than the caches. Kernels: MXFP4 GEMV over 16 experts of
//! K3's real shape (w1 `[3072, 3584]`, the largest of an expert's three matrices, for each expert), row-wise int8
//! GEMV and bf16 GEMV over `[7168, 7168]` (a K3 spine matrix). Throughput counts weight bytes read. Each number is
//! the median of 7 runs after a warm-up.

use std::time::Instant;

use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::mxfp4::Mxfp4Matrix;
use rayon::prelude::*;

const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    median(
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let threads = rayon::current_num_threads();

    // Memory read bandwidth: sum of a 1 GiB buffer of u64, split across threads.
    let buf: Vec<u64> = (0..(1usize << 27)).map(|i| i as u64).collect();
    let mem_s = time(|| {
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
    });
    let mem_gbs = (buf.len() * 8) as f64 / mem_s / 1e9;
    drop(buf);

    // MXFP4: 16 experts' w1 [3072, 3584], one activation row each (decode).
    let (rows, cols) = (3072usize, 3584usize);
    let experts: Vec<(Vec<u8>, Vec<u8>)> = (0..16)
        .map(|e| {
            let packed = pseudo_random(rows * cols / 2, 11 + e);
            let scales = vec![120u8; rows * cols / 32];
            (packed, scales)
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mats: Vec<Mxfp4Matrix<'_>> = experts
        .iter()
        .map(|(p, s)| Mxfp4Matrix::new(p, s, rows, cols).expect("valid"))
        .collect();
    let mut y = vec![0.0f32; rows];
    let mx_s = time(|| {
        for m in &mats {
            m.gemm(&x, 1, &mut y).expect("gemm");
        }
        std::hint::black_box(&y);
    });
    let mx_bytes: usize = experts.iter().map(|(p, s)| p.len() + s.len()).sum();
    let mx_gbs = mx_bytes as f64 / mx_s / 1e9;

    // Dense spine matrix [7168, 7168] as bf16 and int8.
    let (r, c) = (7168usize, 7168usize);
    let raw = pseudo_random(r * c * 2, 5);
    let bf: Vec<u16> = raw
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1] & 0x3f]))
        .collect();
    let bf16 = DenseMatrix::new(r, c, DenseData::Bf16(bf)).expect("shape");
    let int8 = bf16.to_int8();
    let xs: Vec<f32> = (0..c).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let bf_s = time(|| {
        std::hint::black_box(bf16.gemm(&xs, 1).expect("gemm"));
    });
    let i8_s = time(|| {
        std::hint::black_box(int8.gemm(&xs, 1).expect("gemm"));
    });
    let bf_gbs = bf16.nbytes() as f64 / bf_s / 1e9;
    let i8_gbs = int8.nbytes() as f64 / i8_s / 1e9;

    let path = deltafin_quant::simd::path_name();
    if json {
        println!(
            "{{\"threads\":{threads},\"simd\":\"{path}\",\"memory_read_gbs\":{mem_gbs:.3},\"mxfp4_gemv_gbs\":{mx_gbs:.3},\"int8_gemv_gbs\":{i8_gbs:.3},\"bf16_gemv_gbs\":{bf_gbs:.3}}}"
        );
    } else {
        println!("threads {threads}, kernels {path}, median of {RUNS}");
        println!("memory read       {mem_gbs:8.2} GB/s");
        for (name, gbs) in [
            ("mxfp4 gemv", mx_gbs),
            ("int8 gemv", i8_gbs),
            ("bf16 gemv", bf_gbs),
        ] {
            println!(
                "{name:<17} {gbs:8.2} GB/s  ({:.2} of memory bandwidth)",
                gbs / mem_gbs
            );
        }
    }
}
