//! One core's compute rate of the two-row kernels with their data in L2, where memory bandwidth plays no part.
//!
//! `cargo run --release -p deltafin-quant --example kernel_compute`
//!
//! Loops the AVX-512 two-row kernels over a matrix small enough for L2 (MXFP4 `[128, 3584]`: 229 KB of codes;
//! int8 `[48, 7168]`: 344 KB; bf16 `[48, 7168]`: 688 KB) on the calling thread, and reports weight bytes per second,
//! the median of 5 timed passes after a warm-up. On a CPU without AVX-512 (or without AVX-512 BF16 or VNNI, for
//! the kernels that need them) it says so and skips the kernel. Last, the time to quantise one 7168-wide input to
//! int16 (as an int8 product does on one thread before its rows start) with the scalar reference, AVX2 and AVX-512.
//! On a CPU with AVX2 but no AVX-512 it measures the AVX2 MXFP4 kernels (exact f32 and bf16 inputs one row at a time,
//! the latter also with its flushes forced on, int16 inputs two rows at a time) on the same matrix instead.

// The measured kernels are x86-64 only: elsewhere this only type-checks, and its helpers go unused.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_variables))]

use std::time::Instant;

/// One MXFP4 row's codes and scales.
type RowBytes<'a> = (&'a [u8], &'a [u8]);

/// Timed passes (after one warm-up).
const PASSES: usize = 5;
/// Sweeps over the matrix per pass.
const SWEEPS: usize = 300;

fn pseudo_random(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 9) as u8
}

/// Median weight GB/s of `sweep` (one pass over `bytes` of weights), over [`PASSES`] passes of [`SWEEPS`] sweeps.
fn rate(bytes: usize, mut sweep: impl FnMut() -> f32) -> f64 {
    let mut sink = 0.0f32;
    let mut pass = || {
        let t = Instant::now();
        for _ in 0..SWEEPS {
            sink += sweep();
        }
        (bytes * SWEEPS) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    pass();
    let mut v: Vec<f64> = (0..PASSES).map(|_| pass()).collect();
    std::hint::black_box(sink);
    v.sort_by(f64::total_cmp);
    v[PASSES / 2]
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use deltafin_quant::int8_contract::QuantizedInput;
    use deltafin_quant::simd::avx512::{
        bf16_rows, int8_dot_x2, mxfp4_bf16_dot_rows, mxfp4_dot_rows, mxfp4_i16_dot_rows,
    };
    use deltafin_quant::simd::{has_avx512, has_avx512_bf16, has_avx512_vnni};
    use deltafin_quant::{mxfp4_bf16_contract, mxfp4_contract, mxfp4_i16_contract, quantise};

    let mx = Mxfp4Case::new();
    let (rows, row, mx_bytes) = (mx.rows, |r| mx.row(r), mx.bytes());
    if !has_avx512() {
        if deltafin_quant::simd::has_avx2_fma() {
            avx2_mxfp4(&mx);
        } else {
            println!("neither AVX-512 nor AVX2 on this CPU: nothing to measure");
        }
        return;
    }
    let x = &mx.x;
    let xp = mxfp4_contract::permute_input(x);
    let sweep_pairs = |f: &dyn Fn([RowBytes<'_>; 2]) -> [f32; 2]| {
        (0..rows)
            .step_by(2)
            .map(|r| f([row(r), row(r + 1)]).iter().sum::<f32>())
            .sum::<f32>()
    };
    // SAFETY: AVX-512F/BW, AVX2 and FMA present (checked above); whole rows and one permuted input.
    let f32_rate = rate(mx_bytes, || {
        sweep_pairs(&|rs| unsafe { mxfp4_dot_rows::<2>(rs, &xp) })
    });
    println!("mxfp4, f32 inputs   {f32_rate:6.1} GB/s");
    if has_avx512_bf16() {
        let xb = mxfp4_bf16_contract::permute_input(x);
        // SAFETY: AVX-512 BF16 present as well (checked); whole rows and one paired input.
        let bf16_rate = rate(mx_bytes, || {
            sweep_pairs(&|rs| unsafe { mxfp4_bf16_dot_rows::<2>(rs, &xb) })
        });
        println!("mxfp4, bf16 inputs  {bf16_rate:6.1} GB/s");
    } else {
        println!("mxfp4, bf16 inputs  (no AVX-512 BF16 on this CPU)");
    }
    if has_avx512_vnni() {
        let xq = mxfp4_i16_contract::permute_input(x);
        // SAFETY: AVX-512 VNNI present as well (checked); whole rows and one quantised input.
        let i16_rate = rate(mx_bytes, || {
            sweep_pairs(&|rs| unsafe { mxfp4_i16_dot_rows::<2>(rs, &xq) })
        });
        println!("mxfp4, int16 inputs {i16_rate:6.1} GB/s");
    } else {
        println!("mxfp4, int16 inputs (no AVX-512 VNNI on this CPU)");
    }

    let (rows, cols) = (48usize, 7168usize);
    let q: Vec<i8> = (0..rows * cols).map(|i| pseudo_random(i) as i8).collect();
    // Normal bf16 values of a trained weight's size (2^-7 to 1, either sign): tiny or denormal ones cost the FMAs
    // microcode assists that no real checkpoint pays.
    let b: Vec<u16> = (0..rows * cols)
        .map(|i| u16::from_le_bytes([pseudo_random(i), pseudo_random(i + 7) & 0x83 | 0x3c]))
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let span = |r: usize| r * cols..(r + 1) * cols;
    let xq = QuantizedInput::new(&x);
    // SAFETY: AVX-512 VNNI present (checked); rows as long as the input, which is padded.
    let i8_rate = has_avx512_vnni().then(|| {
        rate(q.len(), || {
            (0..rows)
                .step_by(2)
                .map(
                    |r| unsafe { int8_dot_x2(&q[span(r)], &q[span(r + 1)], xq.values()) }[0] as f32,
                )
                .sum()
        })
    });
    let xp = deltafin_quant::bf16_contract::permute_input(&x);
    // SAFETY: AVX-512F/BW, AVX2 and FMA present (checked); rows as long as `x`, whose permuted copy covers them.
    let bf_rate = rate(b.len() * 2, || {
        (0..rows)
            .step_by(2)
            .map(|r| unsafe { bf16_rows::<2>([&b[span(r)], &b[span(r + 1)]], &xp, deltafin_quant::bf16_contract::Prefetch::Off) }[0])
            .sum()
    });
    match i8_rate {
        Some(rate) => println!("int8                {rate:6.1} GB/s"),
        None => println!("int8                (no AVX-512 VNNI)"),
    }
    println!("bf16                {bf_rate:6.1} GB/s");

    let mut q16 = vec![0i16; cols];
    let scalar = micros(|| {
        let step = quantise::abs_max_ref(&x).unwrap_or(1.0) / quantise::Q_MAX;
        quantise::quantise_ref(&x, step, &mut q16);
        q16[0]
    });
    // SAFETY: AVX-512F present (checked above), so AVX2 too.
    let avx2 = micros(|| unsafe {
        let step = deltafin_quant::simd::avx2::abs_max(&x).unwrap_or(1.0) / quantise::Q_MAX;
        deltafin_quant::simd::avx2::quantise(&x, step, &mut q16);
        q16[0]
    });
    // SAFETY: AVX-512F present (checked above).
    let avx512 = micros(|| unsafe {
        let step = deltafin_quant::simd::avx512::abs_max(&x).unwrap_or(1.0) / quantise::Q_MAX;
        deltafin_quant::simd::avx512::quantise(&x, step, &mut q16);
        q16[0]
    });
    println!(
        "int16 quantisation of a {cols}-wide input: scalar {scalar:.2} us, AVX2 {avx2:.2} us, AVX-512 {avx512:.2} us"
    );
}

/// The MXFP4 matrix every kernel is measured on: `[128, 3584]` (229 KB of codes, within L2) and one input.
struct Mxfp4Case {
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    x: Vec<f32>,
}

impl Mxfp4Case {
    fn new() -> Self {
        let (rows, cols) = (128usize, 3584usize);
        Self {
            rows,
            cols,
            packed: (0..rows * cols / 2).map(pseudo_random).collect(),
            scales: vec![120u8; rows * cols / 32],
            x: (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect(),
        }
    }

    fn row(&self, r: usize) -> RowBytes<'_> {
        let (c, g) = (self.cols / 2, self.cols / 32);
        (
            &self.packed[r * c..(r + 1) * c],
            &self.scales[r * g..(r + 1) * g],
        )
    }

    /// Weight bytes of the matrix (codes and scales).
    fn bytes(&self) -> usize {
        self.packed.len() + self.scales.len()
    }
}

/// The AVX2 MXFP4 kernels on one core (a CPU without AVX-512).
#[cfg(target_arch = "x86_64")]
fn avx2_mxfp4(mx: &Mxfp4Case) {
    use deltafin_quant::simd::avx2::{mxfp4_bf16_dot, mxfp4_dot, mxfp4_i16_dot_rows};
    use deltafin_quant::{mxfp4_contract, mxfp4_i16_contract};
    let xp = mxfp4_contract::permute_input(&mx.x);
    // SAFETY: AVX2 and FMA present (checked by the caller); whole rows and one permuted input.
    let f32_rate = rate(mx.bytes(), || {
        (0..mx.rows)
            .map(|r| unsafe { mxfp4_dot(mx.row(r).0, mx.row(r).1, &xp) })
            .sum()
    });
    println!("AVX2 mxfp4, f32 inputs   {f32_rate:6.1} GB/s");
    let xb = deltafin_quant::mxfp4_bf16_contract::permute_input(&mx.x);
    // SAFETY: as above; whole rows and one paired input (flush-free: plain inputs).
    let bf16_rate = rate(mx.bytes(), || {
        (0..mx.rows)
            .map(|r| unsafe { mxfp4_bf16_dot::<false>(mx.row(r).0, mx.row(r).1, &xb) })
            .sum()
    });
    // SAFETY: as above.
    let flushed_rate = rate(mx.bytes(), || {
        (0..mx.rows)
            .map(|r| unsafe { mxfp4_bf16_dot::<true>(mx.row(r).0, mx.row(r).1, &xb) })
            .sum()
    });
    println!("AVX2 mxfp4, bf16 inputs  {bf16_rate:6.1} GB/s ({flushed_rate:.1} with every flush)");
    let xq = mxfp4_i16_contract::permute_input(&mx.x);
    // SAFETY: as above; whole rows and one quantised input.
    let i16_rate = rate(mx.bytes(), || {
        (0..mx.rows)
            .step_by(2)
            .map(|r| unsafe { mxfp4_i16_dot_rows::<2>([mx.row(r), mx.row(r + 1)], &xq) }[0])
            .sum()
    });
    println!("AVX2 mxfp4, int16 inputs {i16_rate:6.1} GB/s");
}

/// Median microseconds of one call of `f`, over [`PASSES`] passes of [`SWEEPS`] calls after a warm-up pass.
#[cfg(target_arch = "x86_64")]
fn micros(mut f: impl FnMut() -> i16) -> f64 {
    let mut sink = 0i16;
    let mut pass = || {
        let t = Instant::now();
        for _ in 0..SWEEPS {
            sink = sink.wrapping_add(f());
        }
        t.elapsed().as_secs_f64() / SWEEPS as f64 * 1e6
    };
    pass();
    let mut v: Vec<f64> = (0..PASSES).map(|_| pass()).collect();
    std::hint::black_box(sink);
    v.sort_by(f64::total_cmp);
    v[PASSES / 2]
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("the measured kernels are x86-64 (AVX-512) only");
}
