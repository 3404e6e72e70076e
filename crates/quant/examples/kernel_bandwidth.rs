//! Kernel throughput against memory read bandwidth, measured in the same process, interleaved.
//!
//! `cargo run --release -p deltafin-quant --example kernel_bandwidth [-- --json]`
//!
//! Memory bound: a multi-threaded sum over a buffer larger than the caches. Kernels: MXFP4 GEMV over 16 experts of
//! K3's real shape (w1 `[3072, 3584]`, the largest of an expert's three matrices, for each expert), all sixteen in
//! one threaded call as the engine runs experts that are ready together, and again one call per matrix; row-wise int8
//! GEMV and bf16 GEMV over `[7168, 7168]` (a K3 spine matrix). Throughput counts weight bytes read. Every buffer is
//! advised to use transparent huge pages, as the engine's read buffers and spine weights are. This machine's
//! memory bandwidth moves by tens of per cent from minute to minute, so each round measures the memory bound and
//! then each kernel once, and the ratios are taken within a round; the report gives the medians over the rounds.

use std::time::Instant;

use deltafin_quant::collect_on_huge_pages;
use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::mxfp4::{Mxfp4Input, Mxfp4Matrix, Mxfp4Product, gemm_batch_with};
use memmap2::{Advice, MmapMut};
use rayon::prelude::*;

/// Counted rounds (after one warm-up round).
const ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds<F: FnMut()>(mut f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// `n` bytes of anonymous memory, advised to use huge pages, filled by `fill`.
fn huge_buffer(n: usize, fill: impl Fn(usize) -> u8) -> MmapMut {
    let mut m = MmapMut::map_anon(n).expect("anonymous mapping");
    // A hint: without huge pages the buffer works the same.
    let _ = m.advise(Advice::HugePage);
    for (i, b) in m.iter_mut().enumerate() {
        *b = fill(i);
    }
    m
}

fn pseudo_random(seed: u64) -> impl Fn(usize) -> u8 {
    move |i| {
        let mut x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed;
        x ^= x >> 29;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        (x >> 32) as u8
    }
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let threads = rayon::current_num_threads();

    // Memory read: sum of a 1 GiB buffer of u64, split across threads.
    let mem = huge_buffer(1 << 30, |i| i as u8);
    let (head, words, tail) = unsafe {
        // SAFETY: any bytes are valid u64 values; align_to only reinterprets the aligned middle.
        mem.align_to::<u64>()
    };
    assert!(head.is_empty() && tail.is_empty(), "page-aligned mapping");
    let mem_bytes = (words.len() * 8) as f64;
    let mut read_memory = || {
        let s: u64 = words
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
    };

    // MXFP4: 16 experts' w1 [3072, 3584], one activation row each (decode).
    let (rows, cols) = (3072usize, 3584usize);
    let experts: Vec<(MmapMut, MmapMut)> = (0..16)
        .map(|e| {
            (
                huge_buffer(rows * cols / 2, pseudo_random(11 + e)),
                huge_buffer(rows * cols / 32, |_| 120),
            )
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mats: Vec<Mxfp4Matrix<'_>> = experts
        .iter()
        .map(|(p, s)| Mxfp4Matrix::new(p, s, rows, cols).expect("valid"))
        .collect();
    let mx_bytes: usize = experts.iter().map(|(p, s)| p.len() + s.len()).sum();
    let mut y = vec![0.0f32; rows];
    // As the engine multiplies experts that are ready together: all sixteen in one threaded call.
    let mut ys = vec![vec![0.0f32; rows]; mats.len()];
    let mut run_mxfp4 = |input: Mxfp4Input| {
        let mut products: Vec<Mxfp4Product<'_, '_>> = mats
            .iter()
            .zip(ys.iter_mut())
            .map(|(m, y)| Mxfp4Product {
                matrix: *m,
                x: &x,
                t_rows: 1,
                y,
            })
            .collect();
        gemm_batch_with(&mut products, input).expect("gemm_batch");
        std::hint::black_box(&products);
    };
    // One threaded call per matrix, as an expert read from disk is multiplied when it lands.
    let mut run_mxfp4_each = || {
        for m in &mats {
            m.gemm(&x, 1, &mut y).expect("gemm");
        }
        std::hint::black_box(&y);
    };

    // Dense spine matrix [7168, 7168] as bf16 and int8.
    let (r, c) = (7168usize, 7168usize);
    let raw = huge_buffer(r * c * 2, pseudo_random(5));
    // As the engine holds spine weights (`deltafin_quant::pages`); `to_int8` allocates the same way.
    let bf: Vec<u16> = collect_on_huge_pages(
        raw.chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1] & 0x3f])),
    );
    drop(raw);
    let bf16 = DenseMatrix::new(r, c, DenseData::Bf16(bf)).expect("shape");
    let int8 = bf16.to_int8();
    let xs: Vec<f32> = (0..c).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let run_bf16 = || {
        std::hint::black_box(bf16.gemm(&xs, 1).expect("gemm"));
    };
    let run_int8 = || {
        std::hint::black_box(int8.gemm(&xs, 1).expect("gemm"));
    };

    // Rounds: memory, then each kernel, back to back.
    let mut rounds: Vec<[f64; 6]> = Vec::new();
    for round in 0..=ROUNDS {
        let mem_gbs = mem_bytes / seconds(&mut read_memory) / 1e9;
        let mx = mx_bytes as f64 / seconds(|| run_mxfp4(Mxfp4Input::F32)) / 1e9;
        let mx_bf16 = mx_bytes as f64 / seconds(|| run_mxfp4(Mxfp4Input::Bf16)) / 1e9;
        let i8g = int8.nbytes() as f64 / seconds(run_int8) / 1e9;
        let bfg = bf16.nbytes() as f64 / seconds(run_bf16) / 1e9;
        let mx_each = mx_bytes as f64 / seconds(&mut run_mxfp4_each) / 1e9;
        if round > 0 {
            rounds.push([mem_gbs, mx, i8g, bfg, mx_each, mx_bf16]);
        }
    }
    let col = |k: usize| median(rounds.iter().map(|r| r[k]).collect());
    let ratio = |k: usize| median(rounds.iter().map(|r| r[k] / r[0]).collect());
    let path = deltafin_quant::simd::path_name();
    if json {
        println!(
            "{{\"threads\":{threads},\"simd\":\"{path}\",\"rounds\":{ROUNDS},\"memory_read_gbs\":{:.3},\
             \"mxfp4_gemv_gbs\":{:.3},\"int8_gemv_gbs\":{:.3},\"bf16_gemv_gbs\":{:.3},\
             \"mxfp4_ratio\":{:.3},\"int8_ratio\":{:.3},\"bf16_ratio\":{:.3},\
             \"mxfp4_each_gbs\":{:.3},\"mxfp4_each_ratio\":{:.3},\
             \"mxfp4_bf16_gbs\":{:.3},\"mxfp4_bf16_ratio\":{:.3}}}",
            col(0),
            col(1),
            col(2),
            col(3),
            ratio(1),
            ratio(2),
            ratio(3),
            col(4),
            ratio(4),
            col(5),
            ratio(5)
        );
    } else {
        println!(
            "threads {threads}, kernels {path}, median of {ROUNDS} rounds (ratios taken within each round)"
        );
        println!("memory read       {:8.2} GB/s", col(0));
        for (k, name) in [
            (1, "mxfp4 gemv"),
            (4, "mxfp4, per call"),
            (5, "mxfp4, bf16 input"),
            (2, "int8 gemv"),
            (3, "bf16 gemv"),
        ] {
            println!(
                "{name:<17} {:8.2} GB/s  ({:.2} of memory bandwidth)",
                col(k),
                ratio(k)
            );
        }
    }
}
