//! Kernel throughput against memory read bandwidth, measured in the same process, interleaved.
//!
//! `cargo run --release -p deltafin-quant --example kernel_bandwidth [-- --json]`
//!
//! Memory bound: a multi-threaded sum over a 1 GiB buffer, the faster of a portable loop and (on AVX-512) a loop of
//! 64-byte loads with a software prefetch; the portable loop alone, the bound of earlier reports, is given too.
//! Kernels, each streaming hundreds of megabytes of distinct weights per measurement, as decode streams through its
//! layers (and so that no pass finds an earlier one's bytes in the 32 MB L3):
//! - MXFP4 GEMV over [`LAYERS`] layers of 16 experts of K3's real shape (w1 `[3072, 3584]`, the largest of an
//!   expert's three matrices), one threaded call per layer for its sixteen experts as the engine runs experts that
//!   are ready together, with f32, bf16 and int16 inputs (`K3_EXPERT_INPUT`), and again one call per matrix with
//!   f32 inputs (as an expert read from disk is multiplied when it lands);
//! - row-wise int8 and bf16 GEMV over K3 spine matrices `[7168, 7168]` (eight int8 ones, four bf16 ones: 411 MB
//!   each), one call per matrix.
//!
//! Throughput counts weight bytes read (codes and scales for MXFP4). Every buffer is advised to use transparent huge
//! pages, as the engine's read buffers and spine weights are; each expert matrix lies in one buffer that starts on a
//! huge page boundary, codes then scales, as an expert's span lies in a read buffer. This machine's memory bandwidth
//! moves by tens of per cent from minute to minute, so each round measures the memory bound and then each kernel
//! once, and the ratios are taken within a round; the report gives the medians over the rounds.

use std::time::Instant;

use deltafin_quant::collect_on_huge_pages;
use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::membw::{sum_portable, sum_vector};
use deltafin_quant::mxfp4::{Mxfp4Input, Mxfp4Matrix, Mxfp4Product, gemm_batch_with};
use memmap2::MmapMut;
use rayon::prelude::*;

/// Counted rounds (after one warm-up round).
const ROUNDS: usize = 9;
/// Layers of sixteen MXFP4 experts.
const LAYERS: usize = 4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds<F: FnMut()>(mut f: F) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The huge page size this machine's transparent huge pages use (x86-64 and aarch64 Linux).
const HUGE_PAGE: usize = 2 << 20;

/// `n` bytes of anonymous memory starting on a huge page boundary, advised to use huge pages, filled by `fill`.
///
/// The engine's read buffers, which hold the experts it multiplies, are whole huge pages
/// (`deltafin_storage::ReadPool`); a mapping that starts elsewhere has its first and last partial huge pages on
/// 4 KiB pages, and a 5.5 MB buffer read 5–10% slower that way.
struct HugeBuffer {
    map: MmapMut,
    start: usize,
    len: usize,
}

impl HugeBuffer {
    fn new(n: usize, fill: impl Fn(usize) -> u8) -> Self {
        let mut map = MmapMut::map_anon(n + HUGE_PAGE).expect("anonymous mapping");
        // A hint: without huge pages the buffer works the same. Linux only (macOS has no such advice).
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
        for (i, b) in map[start..start + n].iter_mut().enumerate() {
            *b = fill(i);
        }
        Self { map, start, len: n }
    }
}

impl std::ops::Deref for HugeBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
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

    // Memory read: sums of a 1 GiB buffer of u64, split across threads, with the portable loop and (where the CPU
    // has AVX-512) the vector loop; the bound of a round is the faster of the two.
    let mem = HugeBuffer::new(1 << 30, |i| i as u8);
    let (head, words, tail) = unsafe {
        // SAFETY: any bytes are valid u64 values; align_to only reinterprets the aligned middle.
        mem.align_to::<u64>()
    };
    assert!(head.is_empty() && tail.is_empty(), "page-aligned mapping");
    let mem_bytes = (words.len() * 8) as f64;
    let read_memory = |vector: bool| {
        let s: u64 = words
            .par_chunks(1 << 16)
            .map(|c| {
                if vector {
                    sum_vector(c)
                } else {
                    sum_portable(c)
                }
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
    };

    // MXFP4: LAYERS × 16 experts' w1 [3072, 3584], one activation row each (decode).
    let (rows, cols) = (3072usize, 3584usize);
    // One buffer per expert, codes then scales, as an expert's span lands in a read buffer.
    let (code_bytes, scale_bytes) = (rows * cols / 2, rows * cols / 32);
    let experts: Vec<HugeBuffer> = (0..16 * LAYERS as u64)
        .map(|e| {
            let codes = pseudo_random(11 + e);
            HugeBuffer::new(code_bytes + scale_bytes, move |i| {
                if i < code_bytes { codes(i) } else { 120 }
            })
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mats: Vec<Mxfp4Matrix<'_>> = experts
        .iter()
        .map(|b| {
            let (codes, scales) = b.split_at(code_bytes);
            Mxfp4Matrix::new(codes, scales, rows, cols).expect("valid")
        })
        .collect();
    let mx_bytes: usize = experts.iter().map(|b| b.len()).sum();
    let mut y = vec![0.0f32; rows];
    // As the engine multiplies experts that are ready together: a layer's sixteen in one threaded call.
    let mut ys = vec![vec![0.0f32; rows]; 16];
    let mut run_mxfp4 = |input: Mxfp4Input| {
        for layer in mats.chunks(16) {
            let mut products: Vec<Mxfp4Product<'_, '_>> = layer
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
        }
    };
    // One threaded call per matrix, as an expert read from disk is multiplied when it lands.
    let mut run_mxfp4_each = || {
        for m in &mats {
            m.gemm(&x, 1, &mut y).expect("gemm");
        }
        std::hint::black_box(&y);
    };

    // Dense spine matrices [7168, 7168]: eight as int8, four as bf16 (411 MB of each kind).
    let (r, c) = (7168usize, 7168usize);
    let bf16: Vec<DenseMatrix> = (0..4)
        .map(|m| {
            let raw = pseudo_random(5 + m);
            // As the engine holds spine weights (`deltafin_quant::pages`): normal numbers of a trained weight's
            // size (2^-7 to 1, either sign). Tiny or denormal values cost the FMAs microcode assists that no real
            // checkpoint pays, which made this kernel look several times slower than it is.
            let bits = collect_on_huge_pages(
                (0..r * c).map(|i| u16::from_le_bytes([raw(2 * i), raw(2 * i + 1) & 0x83 | 0x3c])),
            );
            DenseMatrix::new(r, c, DenseData::Bf16(bits.into())).expect("shape")
        })
        .collect();
    let int8: Vec<DenseMatrix> = (0..8)
        .map(|m| {
            let raw = pseudo_random(50 + m);
            let q = collect_on_huge_pages((0..r * c).map(|i| (raw(i) as i8).max(-127)));
            let scales = (0..r).map(|i| 1e-3 * (1 + i % 7) as f32).collect();
            DenseMatrix::new(
                r,
                c,
                DenseData::Int8 {
                    q: q.into(),
                    scales,
                },
            )
            .expect("shape")
        })
        .collect();
    let xs: Vec<f32> = (0..c).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let bytes_of = |ms: &[DenseMatrix]| ms.iter().map(DenseMatrix::nbytes).sum::<usize>() as f64;
    let (bf16_bytes, int8_bytes) = (bytes_of(&bf16), bytes_of(&int8));
    let run_dense = |ms: &[DenseMatrix]| {
        for m in ms {
            std::hint::black_box(m.gemm(&xs, 1).expect("gemm"));
        }
    };

    // Rounds: memory, then each kernel, back to back.
    let mut rounds: Vec<[f64; 8]> = Vec::new();
    for round in 0..=ROUNDS {
        let portable_gbs = mem_bytes / seconds(|| read_memory(false)) / 1e9;
        let mem_gbs = (mem_bytes / seconds(|| read_memory(true)) / 1e9).max(portable_gbs);
        let mx = mx_bytes as f64 / seconds(|| run_mxfp4(Mxfp4Input::F32)) / 1e9;
        let mx_bf16 = mx_bytes as f64 / seconds(|| run_mxfp4(Mxfp4Input::Bf16)) / 1e9;
        let i8g = int8_bytes / seconds(|| run_dense(&int8)) / 1e9;
        let bfg = bf16_bytes / seconds(|| run_dense(&bf16)) / 1e9;
        let mx_each = mx_bytes as f64 / seconds(&mut run_mxfp4_each) / 1e9;
        let mx_i16 = mx_bytes as f64 / seconds(|| run_mxfp4(Mxfp4Input::I16)) / 1e9;
        if round > 0 {
            rounds.push([
                mem_gbs,
                mx,
                i8g,
                bfg,
                mx_each,
                mx_bf16,
                portable_gbs,
                mx_i16,
            ]);
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
             \"mxfp4_bf16_gbs\":{:.3},\"mxfp4_bf16_ratio\":{:.3},\"mxfp4_i16_gbs\":{:.3},\"mxfp4_i16_ratio\":{:.3},\
             \"memory_read_portable_gbs\":{:.3}}}",
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
            ratio(5),
            col(7),
            ratio(7),
            col(6)
        );
    } else {
        println!(
            "threads {threads}, kernels {path}, median of {ROUNDS} rounds (ratios taken within each round)"
        );
        println!(
            "memory read       {:8.2} GB/s  (portable loop {:.2} GB/s)",
            col(0),
            col(6)
        );
        for (k, name) in [
            (1, "mxfp4 gemv"),
            (4, "mxfp4, per call"),
            (5, "mxfp4, bf16 input"),
            (7, "mxfp4, i16 input"),
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
