//! Where a bf16 GEMV at K3's width loses to the memory read bound on a many-core machine: the library kernel,
//! simple variants of it (software prefetch distance, rows per call, rows per task) and a plain read of the same
//! bytes, each timed on the same matrices in the same rounds, plus the cost of a rayon fork-join after an idle gap.
//!
//! `cargo run --release -p deltafin-quant --example gemv_sweep` (x86-64 with AVX-512; prints one JSON object).

// The measured kernels are x86-64 only: elsewhere this only type-checks, and its helpers go unused.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_variables))]

use std::time::{Duration, Instant};

use deltafin_quant::collect_on_huge_pages;
use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::membw::{ReadBuffer, sum_vector};
use rayon::prelude::*;

const ROWS: usize = 12288;
const COLS: usize = 7168;
const MATRICES: usize = 4;
const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dot_rows<const R: usize>(
    w: &[u16],
    cols: usize,
    x: &[f32],
    dist: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let p = w.as_ptr();
    let mut acc = [_mm512_setzero_ps(); 8];
    let mut b = 0;
    while b + 16 <= cols {
        if dist > 0 {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(
                    (p.wrapping_add(r * cols + b) as *const i8).wrapping_add(dist),
                );
            }
        }
        // SAFETY: b + 16 <= cols, and w holds R rows of cols values.
        unsafe {
            let xv = _mm512_loadu_ps(x.as_ptr().add(b));
            for (r, a) in acc.iter_mut().take(R).enumerate() {
                let h = _mm256_loadu_si256(p.add(r * cols + b) as *const __m256i);
                let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
        }
        b += 16;
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = _mm512_reduce_add_ps(*a);
    }
}

fn gemv(w: &[u16], x: &[f32], rows_per_task: usize, rows_per_call: usize, dist: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; ROWS];
    y.par_chunks_mut(rows_per_task)
        .enumerate()
        .for_each(|(t, out)| {
            let r0 = t * rows_per_task;
            for (i, o) in out.chunks_mut(rows_per_call).enumerate() {
                let r = r0 + i * rows_per_call;
                let rows = &w[r * COLS..(r + o.len()) * COLS];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the example runs only where AVX-512F is detected (checked in main).
                unsafe {
                    match o.len() {
                        4 => dot_rows::<4>(rows, COLS, x, dist, o),
                        2 => dot_rows::<2>(rows, COLS, x, dist, o),
                        _ => dot_rows::<1>(rows, COLS, x, dist, o),
                    }
                }
            }
        });
    y
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    assert!(
        std::arch::is_x86_feature_detected!("avx512f"),
        "needs AVX-512F"
    );
    let threads = rayon::current_num_threads();
    let mats: Vec<Vec<u16>> = (0..MATRICES)
        .map(|m| {
            collect_on_huge_pages(
                (0..ROWS * COLS).map(|i| ((i * 2654435761 + m) >> 7) as u16 & 0x3fff | 0x3c00),
            )
        })
        .collect();
    let dense: Vec<DenseMatrix> = mats
        .iter()
        .map(|w| DenseMatrix::new(ROWS, COLS, DenseData::Bf16(w.clone().into())).expect("shape"))
        .collect();
    let x: Vec<f32> = (0..COLS).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
    let mem = ReadBuffer::new(2 << 30);
    let bytes = (MATRICES * ROWS * COLS * 2) as f64;
    type Variant<'a> = (String, Box<dyn Fn() + Sync + 'a>);
    let mut variants: Vec<Variant<'_>> = vec![(
        "library".into(),
        Box::new(|| {
            for m in &dense {
                std::hint::black_box(m.gemm(&x, 1).expect("gemm"));
            }
        }),
    )];
    for (rpt, rpc, dist) in [
        (64, 2, 0),
        (64, 2, 16 << 10),
        (64, 2, 64 << 10),
        (64, 4, 0),
        (64, 1, 0),
        (256, 2, 0),
        (16, 2, 0),
    ] {
        let (mats, x) = (&mats, &x);
        variants.push((
            format!(
                "rows_per_task={rpt} rows_per_call={rpc} prefetch={}K",
                dist >> 10
            ),
            Box::new(move || {
                for w in mats {
                    std::hint::black_box(gemv(w, x, rpt, rpc, dist));
                }
            }),
        ));
    }
    let mats_ref = &mats;
    variants.push((
        "read the matrices".into(),
        Box::new(move || {
            for w in mats_ref {
                // SAFETY: u16 values viewed as u64 words: any bit pattern is valid; length rounded down.
                let words =
                    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u64>(), w.len() / 4) };
                let per = words.len().div_ceil(rayon::current_num_threads() * 8);
                std::hint::black_box(
                    words
                        .par_chunks(per)
                        .map(sum_vector)
                        .reduce(|| 0, u64::wrapping_add),
                );
            }
        }),
    ));
    let mut bound = Vec::new();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..=ROUNDS {
        let b = mem.read_rate();
        for (i, (_, f)) in variants.iter().enumerate() {
            let t = Instant::now();
            f();
            if round > 0 {
                rates[i].push(bytes / t.elapsed().as_secs_f64());
            }
        }
        if round > 0 {
            bound.push(b);
        }
    }
    // A fork-join of one tiny task per thread, right after another and after an idle gap.
    let join = |gap: Duration| {
        let mut v = Vec::new();
        for _ in 0..200 {
            std::thread::sleep(gap);
            let t = Instant::now();
            (0..threads).into_par_iter().for_each(|i| {
                std::hint::black_box(i);
            });
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        median(v)
    };
    let join_hot = join(Duration::ZERO);
    let join_50us = join(Duration::from_micros(50));
    let join_1ms = join(Duration::from_millis(1));
    let bound = median(bound);
    print!(
        "{{\"threads\":{threads},\"memory_read_gbs\":{:.1},\"variants\":[",
        bound / 1e9
    );
    for (i, (name, _)) in variants.iter().enumerate() {
        let r = median(rates[i].clone());
        print!(
            "{}{{\"name\":\"{name}\",\"gbs\":{:.1},\"ratio\":{:.3}}}",
            if i > 0 { "," } else { "" },
            r / 1e9,
            r / bound
        );
    }
    println!(
        "],\"fork_join_us\":{{\"back_to_back\":{join_hot:.1},\"after_50us\":{join_50us:.1},\"after_1ms\":{join_1ms:.1}}}}}"
    );
}
