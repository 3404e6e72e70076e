//! Every fast kernel against its scalar twin, bit for bit, on random and edge inputs.

use deltafin_quant::dense::{DenseData, DenseMatrix};
use deltafin_quant::dot::{dot_bf16, dot_bf16_ref, dot_f32, dot_f32_ref, dot_i8, dot_i8_ref};
use deltafin_quant::mxfp4::Mxfp4Matrix;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const LENGTHS: &[usize] = &[
    1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 96, 100, 1000, 3584, 7168,
];

fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

fn randn(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-4.0f32..4.0)).collect()
}

fn same_bits(a: f32, b: f32, what: &str) {
    assert_eq!(a.to_bits(), b.to_bits(), "{what}: {a} vs {b}");
}

#[test]
fn f32_bf16_i8_dots_are_bit_identical() {
    let mut r = rng();
    for &n in LENGTHS {
        let x = randn(&mut r, n);
        let w = randn(&mut r, n);
        same_bits(dot_f32(&w, &x), dot_f32_ref(&w, &x), &format!("f32 n={n}"));
        let wb: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        same_bits(
            dot_bf16(&wb, &x),
            dot_bf16_ref(&wb, &x),
            &format!("bf16 n={n}"),
        );
        let q: Vec<i8> = (0..n).map(|_| r.random_range(-127i8..=127)).collect();
        same_bits(dot_i8(&q, &x), dot_i8_ref(&q, &x), &format!("i8 n={n}"));
    }
}

#[test]
fn dots_agree_on_edge_values() {
    let n = 70;
    for special in [
        0.0f32,
        -0.0,
        1e-40,
        -1e-40,
        3.0e38,
        f32::INFINITY,
        f32::MIN_POSITIVE,
    ] {
        let w = vec![special; n];
        let x: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -1.5 } else { 0.25 })
            .collect();
        let (a, b) = (dot_f32(&w, &x), dot_f32_ref(&w, &x));
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{special}: {a} vs {b}"
        );
    }
}

#[test]
fn dense_gemm_is_batch_invariant_and_matches_reference() {
    let mut r = rng();
    let (rows, cols) = (300, 97);
    let w = randn(&mut r, rows * cols);
    let wb: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let x = randn(&mut r, 5 * cols);
    let f32m = DenseMatrix::new(rows, cols, DenseData::F32(w)).expect("shape");
    for m in [
        f32m.clone(),
        DenseMatrix::new(rows, cols, DenseData::Bf16(wb)).expect("shape"),
        f32m.to_int8(),
    ] {
        let fast = m.gemm(&x, 5).expect("gemm");
        let slow = m.gemm_ref(&x, 5).expect("gemm_ref");
        assert_eq!(
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        // One row at a time gives the same bits as the batch.
        for t in 0..5 {
            let one = m.gemm(&x[t * cols..(t + 1) * cols], 1).expect("gemm");
            assert_eq!(one, fast[t * rows..(t + 1) * rows].to_vec(), "row {t}");
        }
    }
}

#[test]
fn int8_quantisation_is_close() {
    let mut r = rng();
    let (rows, cols) = (8, 256);
    let w = randn(&mut r, rows * cols);
    let m = DenseMatrix::new(rows, cols, DenseData::F32(w.clone())).expect("shape");
    let q = m.to_int8();
    for row in 0..rows {
        let amax = w[row * cols..(row + 1) * cols]
            .iter()
            .fold(0.0f32, |a, v| a.max(v.abs()));
        for (a, b) in q.row_f32(row).iter().zip(&w[row * cols..(row + 1) * cols]) {
            assert!((a - b).abs() <= amax / 127.0 * 0.5 + 1e-6);
        }
    }
}

fn random_mxfp4(r: &mut ChaCha8Rng, rows: usize, cols: usize, scales: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.random::<u8>()).collect();
    let s: Vec<u8> = (0..rows * cols / 32)
        .map(|i| scales[i % scales.len()])
        .collect();
    (packed, s)
}

#[test]
fn mxfp4_dot_matches_twin_including_extreme_scales() {
    let mut r = rng();
    let (rows, cols) = (64, 3584);
    for scales in [
        &[127u8, 120, 130][..],
        &[0, 1, 2],
        &[253, 254],
        &[0, 254, 127, 1],
    ] {
        let (packed, s) = random_mxfp4(&mut r, rows, cols, scales);
        let m = Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid");
        let x = randn(&mut r, cols);
        for row in 0..rows {
            let (a, b) = (m.dot_row(row, &x), m.dot_row_ref(row, &x));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "scales {scales:?} row {row}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn mxfp4_fused_dot_equals_dequantise_then_dot() {
    let mut r = rng();
    let (rows, cols) = (16, 256);
    let (packed, s) = random_mxfp4(&mut r, rows, cols, &[125, 127, 129]);
    let m = Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid");
    let w = m.dequantize_ref();
    let x = randn(&mut r, cols);
    for row in 0..rows {
        same_bits(
            m.dot_row(row, &x),
            dot_f32_ref(&w[row * cols..(row + 1) * cols], &x),
            "fused vs dequantised",
        );
    }
    let mut y = vec![0.0; 3 * rows];
    let xs = randn(&mut r, 3 * cols);
    m.gemm(&xs, 3, &mut y).expect("gemm");
    for t in 0..3 {
        for row in 0..rows {
            same_bits(
                y[t * rows + row],
                m.dot_row_ref(row, &xs[t * cols..(t + 1) * cols]),
                "gemm",
            );
        }
    }
}
