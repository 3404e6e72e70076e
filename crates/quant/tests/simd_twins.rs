//! Every fast kernel against its scalar twin, bit for bit, on random and edge inputs.

#[cfg(target_arch = "x86_64")]
use deltafin_quant::bf16_contract::Prefetch;
use deltafin_quant::bf16_contract::{self, dot_bf16, dot_bf16_ref};
use deltafin_quant::dense::{DenseData, DenseMatrix, OutputLayout};
use deltafin_quant::dot::{dot_f32, dot_f32_ref, dot_f32_tiles};
use deltafin_quant::int8_contract::{self, QuantizedInput};
use deltafin_quant::mxfp4::{Mxfp4Input, Mxfp4Matrix, Mxfp4Product, gemm_batch, gemm_batch_with};
use deltafin_quant::simd::{Contract, kernel_set};
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

/// Says which kernels the dispatch calls of `test` run on for each of `contracts` (CI shows it with
/// `--show-output`). On aarch64 a contract that has NEON kernels but would run elsewhere fails the test.
fn exercised(test: &str, contracts: &[Contract]) {
    for &c in contracts {
        let set = kernel_set(c);
        eprintln!("{test}: {c:?} on {set}");
        #[cfg(target_arch = "aarch64")]
        assert!(
            c == Contract::Mxfp4Bf16 || set == "neon",
            "{test}: {c:?} runs on {set}, not NEON"
        );
    }
}

#[test]
fn f32_bf16_i8_dots_are_bit_identical() {
    exercised(
        "f32_bf16_i8_dots_are_bit_identical",
        &[Contract::Dense, Contract::Int8, Contract::Quantise],
    );
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
        let xq = QuantizedInput::new(&x);
        assert_eq!(
            int8_contract::dot(&q, &xq),
            int8_contract::dot_ref(&q, &xq),
            "i8 n={n}"
        );
    }
}

/// The int8 kernels' 32-bit lanes are widened before they can overflow: the largest products (weights -128, inputs
/// at -32767) over rows far longer than one segment, with a partial last block, still sum exactly.
#[test]
fn int8_sums_stay_exact_at_the_extremes() {
    exercised(
        "int8_sums_stay_exact_at_the_extremes",
        &[Contract::Int8, Contract::Quantise],
    );
    for n in [8191, 8192, 8193, 20_000, 65_600] {
        let q = vec![-128i8; n];
        let xq = QuantizedInput::new(&vec![-1.0f32; n]);
        let exact = n as i64 * 128 * 32767;
        assert_eq!(int8_contract::dot_ref(&q, &xq), exact, "reference n={n}");
        assert_eq!(int8_contract::dot(&q, &xq), exact, "fast n={n}");
        assert_eq!(int8_contract::dot_x2(&q, &q, &xq), [exact; 2], "pair n={n}");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 detected; the input is padded past n.
            let avx2 = unsafe { deltafin_quant::simd::avx2::int8_dot(&q, xq.values()) };
            assert_eq!(avx2, exact, "avx2 n={n}");
            // SAFETY: as above, two rows of n.
            let pair = unsafe { deltafin_quant::simd::avx2::int8_dot_x2(&q, &q, xq.values()) };
            assert_eq!(pair, [exact; 2], "avx2 pair n={n}");
            // SAFETY: as above, two rows by four inputs of n.
            let tile = unsafe { deltafin_quant::simd::avx2::int8_tile([&q, &q], [xq.values(); 4]) };
            assert_eq!(tile, [[exact; 4]; 2], "avx2 tile n={n}");
        }
        #[cfg(target_arch = "x86_64")]
        if deltafin_quant::simd::has_avx512_vnni() {
            // SAFETY: AVX-512F/BW and VNNI detected; four rows by four inputs of n, the inputs padded past n.
            let tile =
                unsafe { deltafin_quant::simd::avx512::int8_tile([&q[..]; 4], [xq.values(); 4]) };
            assert_eq!(tile, [[exact; 4]; 4], "avx512 tile n={n}");
        }
        let mut out = [0.0f32; 6];
        int8_contract::dot_tiles(&[&q, &q], &[1.0, 0.5], &[&xq; 3], &mut out);
        let want = [1.0f32, 0.5].map(|s| xq.finish(exact, s));
        assert_eq!(
            out,
            [want[0], want[0], want[0], want[1], want[1], want[1]],
            "tiles n={n}"
        );
    }
}

/// Products of several int8 rows by several inputs (`int8_contract::dot_tiles`: in tiles of four rows by four
/// inputs with AVX-512 VNNI, of two by four on AVX2, with partial tiles at both edges) equal one product at a time of the scalar reference, for every
/// length, including ones that are not a multiple of the 32-column block.
#[test]
fn int8_tiles_match_twin() {
    exercised("int8_tiles_match_twin", &[Contract::Int8]);
    let mut r = rng();
    for &n in LENGTHS {
        for (rows, inputs) in [(1, 1), (2, 4), (3, 5), (5, 7), (4, 9)] {
            let qs: Vec<Vec<i8>> = (0..rows)
                .map(|_| (0..n).map(|_| r.random_range(-128i8..=127)).collect())
                .collect();
            let scales: Vec<f32> = (0..rows).map(|_| r.random_range(0.001f32..0.1)).collect();
            let xs: Vec<QuantizedInput> = (0..inputs)
                .map(|_| QuantizedInput::new(&randn(&mut r, n)))
                .collect();
            let row_refs: Vec<&[i8]> = qs.iter().map(|q| q.as_slice()).collect();
            let x_refs: Vec<&QuantizedInput> = xs.iter().collect();
            let mut out = vec![f32::NAN; rows * inputs];
            int8_contract::dot_tiles(&row_refs, &scales, &x_refs, &mut out);
            for (i, q) in qs.iter().enumerate() {
                for (t, x) in xs.iter().enumerate() {
                    let want = x.finish(int8_contract::dot_ref(q, x), scales[i]);
                    same_bits(
                        out[i * inputs + t],
                        want,
                        &format!("n {n} row {i} of {rows}, input {t} of {inputs}"),
                    );
                }
            }
        }
    }
}

#[test]
fn dots_agree_on_edge_values() {
    exercised("dots_agree_on_edge_values", &[Contract::Dense]);
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

/// The f32 tiles (rows by inputs sharing loads) give each product's reference bits, for every tile remainder of
/// rows (1–5: tiles of three, then two or one) and inputs (1–9) and lengths with and without a tail, within one
/// block of values and across blocks (2,100); edge values (zeros of both signs, tiny and huge) included.
#[test]
fn f32_tiles_match_reference() {
    exercised("f32_tiles_match_reference", &[Contract::Dense]);
    let mut r = rng();
    for &n in &[1usize, 31, 32, 33, 100, 512, 2100] {
        for n_rows in 1..=5 {
            for n_tok in 1..=9 {
                let rows: Vec<Vec<f32>> = (0..n_rows)
                    .map(|i| {
                        if i == 0 {
                            edge_inputs(&mut r, n)
                        } else {
                            randn(&mut r, n)
                        }
                    })
                    .collect();
                let xs: Vec<Vec<f32>> = (0..n_tok).map(|_| randn(&mut r, n)).collect();
                let rr: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
                let xr: Vec<&[f32]> = xs.iter().map(|v| v.as_slice()).collect();
                let mut out = vec![f32::NAN; n_rows * n_tok];
                dot_f32_tiles(&rr, &xr, &mut out);
                for (i, w) in rows.iter().enumerate() {
                    for (t, x) in xs.iter().enumerate() {
                        same_bits(
                            out[i * n_tok + t],
                            dot_f32_ref(w, x),
                            &format!("n {n}, row {i} of {n_rows}, input {t} of {n_tok}"),
                        );
                    }
                }
            }
        }
    }
}

/// The f32 products with the inputs across the lanes (`dot::dot_f32_lanes`), called directly whatever this machine's
/// `f32_lanes_chosen` says, against the contract's reference for every pair: rows that fill six-row tiles and every
/// smaller shape, 16 to 70 inputs (one to five groups, partial ones included), one chunk, a block of chunks and a
/// partial one, K3's width, and rows holding an infinity and the largest finite values, so that a kernel reading
/// past its row or its element would show. Without AVX-512 (or with it turned off) the kernel refuses (NaN).
#[cfg(target_arch = "x86_64")]
#[test]
fn f32_lanes_match_their_twin_for_every_row_and_input() {
    use deltafin_quant::dot::dot_f32_lanes;
    exercised(
        "f32_lanes_match_their_twin_for_every_row_and_input",
        &[Contract::Dense],
    );
    if !deltafin_quant::simd::has_avx512() {
        let mut out = vec![0.0f32; 16];
        dot_f32_lanes(&[&[1.0f32; 32][..]], &[1.0; 512], 16, &mut out);
        assert!(out.iter().all(|v| v.is_nan()), "refused without AVX-512");
        let hardware = std::arch::is_x86_feature_detected!("avx512f");
        if hardware || !cpu_has_or_skip("avx512", false) {
            return;
        }
    }
    let mut r = rng();
    for &(rows, tokens, n) in &[
        (6, 64, 32),
        (13, 16, 2048),
        (7, 70, 1056),
        (1, 17, 64),
        (12, 48, 7168),
        (53, 33, 96),
    ] {
        // Every third row holds an infinity and the largest negative finite value (so its sums are ±inf or NaN);
        // the others are finite, so any weight taken from the wrong element, chunk or row changes their bits.
        let w: Vec<f32> = (0..rows * n)
            .map(|i| match (i / n % 3, i % n) {
                (0, 5) => f32::INFINITY,
                (0, 38) => f32::MIN,
                _ => r.random_range(-4.0f32..4.0),
            })
            .collect();
        let x = randn(&mut r, tokens * n);
        let rows_ref: Vec<&[f32]> = w.chunks_exact(n).collect();
        let xt = deltafin_quant::bf16_lanes::token_lanes(&x, n, tokens);
        let mut out = vec![f32::NAN; rows * tokens];
        dot_f32_lanes(&rows_ref, &xt, tokens, &mut out);
        for (i, row) in rows_ref.iter().enumerate() {
            for t in 0..tokens {
                let want = dot_f32_ref(row, &x[t * n..(t + 1) * n]);
                let got = out[i * tokens + t];
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "rows={rows} tokens={tokens} n={n} ({i}, {t}): {got} vs {want}"
                );
                assert!(
                    i % 3 == 0 || want.is_finite(),
                    "a finite row's sum is finite"
                );
            }
        }
    }
    // A length that is not a multiple of 32 is refused.
    let mut out = vec![0.0f32; 16];
    dot_f32_lanes(&[&[1.0f32; 40][..]], &[1.0; 1024], 16, &mut out);
    assert!(out.iter().all(|v| v.is_nan()));
}

#[test]
fn dense_gemm_is_batch_invariant_and_matches_reference() {
    exercised(
        "dense_gemm_is_batch_invariant_and_matches_reference",
        &[Contract::Dense, Contract::Int8, Contract::Quantise],
    );
    let mut r = rng();
    // 150 inputs: more than one token block (`dense::TOKEN_BLOCK`), the last one partial; 16 and 40 inputs end in
    // partial tiles; 97 columns are one partial chunk, 1100 several blocks of chunks, the last partial. 1088 columns
    // (34 chunks of 32: a block of 32 and a short one) run the bf16 rows with the inputs across the lanes from 16
    // inputs on AVX-512, and the f32 rows too where `dot::f32_lanes_chosen`. Whatever rows a task gets (12, 24 or 48, by the threads), 59 rows end in a task of 11 (tiles
    // of six, four and one rows) and 50 in one of 2.
    const { assert!(150 > deltafin_quant::dense::TOKEN_BLOCK * 2) };
    // 700 rows by 150 inputs: enough outputs that they are copied into `y` in parallel.
    for ((rows, cols), t_rows) in [(300, 97), (50, 1100), (59, 1088)]
        .into_iter()
        .flat_map(|shape| [5, 16, 40, 150].map(|t| (shape, t)))
        .chain([((700, 97), 150)])
    {
        let w = randn(&mut r, rows * cols);
        let wb: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let f32m = DenseMatrix::new(rows, cols, DenseData::F32(w)).expect("shape");
        let x = randn(&mut r, t_rows * cols);
        for m in [
            f32m.clone(),
            DenseMatrix::new(rows, cols, DenseData::Bf16(wb.clone().into())).expect("shape"),
            f32m.to_int8(),
        ] {
            let fast = m.gemm(&x, t_rows).expect("gemm");
            let slow = m.gemm_ref(&x, t_rows).expect("gemm_ref");
            assert_eq!(
                fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{t_rows} inputs"
            );
            // One row at a time gives the same bits as the batch.
            for t in 0..t_rows {
                let one = m.gemm(&x[t * cols..(t + 1) * cols], 1).expect("gemm");
                assert_eq!(one, fast[t * rows..(t + 1) * rows].to_vec(), "row {t}");
            }
        }
    }
}

#[test]
fn gemm_many_equals_each_gemm() {
    exercised(
        "gemm_many_equals_each_gemm",
        &[Contract::Dense, Contract::Int8, Contract::Quantise],
    );
    let mut r = rng();
    let cols = 288;
    // Matrices of every kind (two bf16 ones, which share a permuted input), and row counts that are not multiples
    // of a task (64 rows at one input, 32 at several) or a pair.
    let mats: Vec<DenseMatrix> = [(300, 0), (65, 1), (7, 2), (129, 0), (70, 2)]
        .iter()
        .map(|&(rows, kind)| {
            let w = randn(&mut r, rows * cols);
            let f = DenseMatrix::new(rows, cols, DenseData::F32(w.clone())).expect("shape");
            match kind {
                0 => f,
                1 => f.to_int8(),
                _ => {
                    let wb: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                    DenseMatrix::new(rows, cols, DenseData::Bf16(wb.into())).expect("shape")
                }
            }
        })
        .collect();
    let refs: Vec<&DenseMatrix> = mats.iter().collect();
    // One input, a few, and more than two token blocks (`dense::TOKEN_BLOCK`) with a partial last one.
    const { assert!(150 > deltafin_quant::dense::TOKEN_BLOCK * 2) };
    for t_rows in [1, 3, 150] {
        let x = randn(&mut r, t_rows * cols);
        let many = deltafin_quant::gemm_many(&refs, &x, t_rows).expect("shapes");
        assert_eq!(many.len(), mats.len());
        for (m, y) in mats.iter().zip(&many) {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let want = m.gemm_ref(&x, t_rows).expect("gemm_ref");
            assert_eq!(bits(y), bits(&want), "{t_rows} inputs, {} rows", m.rows());
        }
        // A wrong input length is an error, not a panic.
        assert!(deltafin_quant::gemm_many(&refs, &x[1..], t_rows).is_err());
        // Laid out by heads (of more rows than a task, fewer, a whole matrix) the same values land in their heads.
        let layouts = [
            OutputLayout::Heads(60),
            OutputLayout::Heads(5),
            OutputLayout::ByInput,
            OutputLayout::Heads(129),
            OutputLayout::Heads(35),
        ];
        let laid =
            deltafin_quant::gemm_many_laid_out(&refs, &layouts, &x, t_rows).expect("layouts");
        for ((y, by_input), (m, layout)) in laid.iter().zip(&many).zip(mats.iter().zip(layouts)) {
            let head = match layout {
                OutputLayout::ByInput => m.rows(),
                OutputLayout::Heads(h) => h,
            };
            assert_eq!(y.len(), by_input.len());
            assert_eq!(
                layout.arrange(by_input.clone(), t_rows, m.rows()),
                *y,
                "arranged {layout:?}"
            );
            for (j, v) in y.iter().enumerate() {
                let (h, t, c) = (j / (t_rows * head), j / head % t_rows, j % head);
                let want = by_input[t * m.rows() + h * head + c];
                assert_eq!(
                    v.to_bits(),
                    want.to_bits(),
                    "{layout:?}, {t_rows} inputs, at {j}"
                );
            }
        }
        // Heads that do not divide a matrix's rows, or a layout missing, are errors.
        let mut bad = layouts;
        bad[0] = OutputLayout::Heads(7);
        assert!(deltafin_quant::gemm_many_laid_out(&refs, &bad, &x, t_rows).is_err());
        assert!(deltafin_quant::gemm_many_laid_out(&refs, &layouts[1..], &x, t_rows).is_err());
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
    exercised(
        "mxfp4_dot_matches_twin_including_extreme_scales",
        &[Contract::Mxfp4F32],
    );
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

/// Column counts: whole 128-chunks, a partial last chunk, a single group, and whole four-chunk blocks followed by
/// whole (640: 4 + 1) or whole and partial (864: 4 + 2 + a partial) chunks.
const MXFP4_COLS: &[usize] = &[32, 96, 128, 160, 384, 640, 864, 3072, 3584, 3616];

#[test]
fn mxfp4_gemm_matches_twin_for_every_shape_and_batch() {
    exercised(
        "mxfp4_gemm_matches_twin_for_every_shape_and_batch",
        &[Contract::Mxfp4F32],
    );
    let mut r = rng();
    for &cols in MXFP4_COLS {
        let rows = 37; // odd: the last row of a pair runs alone
        // Extreme scales (where one group's term can swamp the rest) and scales of like size (where every term
        // counts, so a wrong order of additions shows).
        for scales in [
            &[0u8, 1, 126, 127, 128, 140, 254][..],
            &[124, 125, 126, 127, 128, 129],
        ] {
            let (packed, s) = random_mxfp4(&mut r, rows, cols, scales);
            let m = Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid");
            // 2 and 3 run with fixed register accumulators, 4 to 11 in tiles of three inputs on AVX-512
            // (remainders of one and two included), 12 and more with the inputs across the lanes (one group of 16,
            // a partial one, pairs of groups and a pair plus one); on AVX2 from 8 inputs across the lanes, in
            // halves of a group (one to seven of them), with fewer one product at a time.
            for t_rows in [1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 40, 56] {
                let xs = randn(&mut r, t_rows * cols);
                let mut y = vec![0.0; t_rows * rows];
                m.gemm(&xs, t_rows, &mut y).expect("gemm");
                for t in 0..t_rows {
                    let x = &xs[t * cols..(t + 1) * cols];
                    for row in 0..rows {
                        let (a, b) = (y[t * rows + row], m.dot_row_ref(row, x));
                        assert!(
                            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                            "cols {cols} t_rows {t_rows} t {t} row {row}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn mxfp4_batch_matches_twin_for_mixed_shapes() {
    exercised(
        "mxfp4_batch_matches_twin_for_mixed_shapes",
        &[Contract::Mxfp4F32],
    );
    // Products of different shapes and batch sizes in one threaded call (enough rows to take the threaded path),
    // each output against the scalar twin of its own matrix.
    let mut r = rng();
    let shapes = [
        (300, 3584, 1),
        (37, 160, 2),
        (256, 3072, 1),
        (0, 96, 1),
        (129, 384, 5),
        (40, 3584, 9),
        (64, 32, 0),
        // More inputs than a token block (`dense::TOKEN_BLOCK`; 256 for the AVX2 lanes): cut into pieces, the last
        // one partial.
        (48, 160, 150),
        (20, 96, 300),
        // Enough outputs (rows × inputs ≥ 65536) that they are copied into `y` in parallel, over several tasks
        // of rows with the inputs across the lanes.
        (1100, 96, 64),
    ];
    let data: Vec<_> = shapes
        .iter()
        .map(|&(rows, cols, t)| {
            let (packed, s) = random_mxfp4(&mut r, rows, cols, &[0, 126, 127, 131, 254]);
            (packed, s, randn(&mut r, t * cols))
        })
        .collect();
    let mut ys: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(rows, _, t)| vec![f32::NAN; rows * t])
        .collect();
    let mut products: Vec<Mxfp4Product<'_, '_>> = shapes
        .iter()
        .zip(&data)
        .zip(ys.iter_mut())
        .map(
            |((&(rows, cols, t_rows), (packed, s, x)), y)| Mxfp4Product {
                matrix: Mxfp4Matrix::new(packed, s, rows, cols).expect("valid"),
                x,
                t_rows,
                y,
            },
        )
        .collect();
    gemm_batch(&mut products).expect("batch");
    drop(products);
    for ((&(rows, cols, t_rows), (packed, s, xs)), y) in shapes.iter().zip(&data).zip(&ys) {
        let m = Mxfp4Matrix::new(packed, s, rows, cols).expect("valid");
        for t in 0..t_rows {
            for row in 0..rows {
                let (a, b) = (
                    y[t * rows + row],
                    m.dot_row_ref(row, &xs[t * cols..(t + 1) * cols]),
                );
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "shape {rows}x{cols} t_rows {t_rows} t {t} row {row}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn mxfp4_batch_products_sharing_an_input_match_twin() {
    exercised(
        "mxfp4_batch_products_sharing_an_input_match_twin",
        &[Contract::Mxfp4F32],
    );
    // Two matrices over one input (an expert's gate and up) share its permuted copy; then a third input.
    let mut r = rng();
    let (rows, cols) = (200, 3584);
    let mats: Vec<_> = (0..3)
        .map(|_| random_mxfp4(&mut r, rows, cols, &[120, 127, 133]))
        .collect();
    let (x, x2) = (randn(&mut r, 2 * cols), randn(&mut r, 2 * cols));
    let mut ys = vec![vec![0.0f32; 2 * rows]; 3];
    let matrix = |k: usize| Mxfp4Matrix::new(&mats[k].0, &mats[k].1, rows, cols).expect("valid");
    let mut products: Vec<Mxfp4Product<'_, '_>> = ys
        .iter_mut()
        .enumerate()
        .map(|(k, y)| Mxfp4Product {
            matrix: matrix(k),
            x: if k < 2 { &x } else { &x2 },
            t_rows: 2,
            y,
        })
        .collect();
    gemm_batch(&mut products).expect("batch");
    drop(products);
    for (k, y) in ys.iter().enumerate() {
        let xs = if k < 2 { &x } else { &x2 };
        for t in 0..2 {
            for row in 0..rows {
                let want = matrix(k).dot_row_ref(row, &xs[t * cols..(t + 1) * cols]);
                same_bits(
                    y[t * rows + row],
                    want,
                    &format!("matrix {k} t {t} row {row}"),
                );
            }
        }
    }
}

#[test]
fn mxfp4_batch_rejects_a_bad_product() {
    let (packed, s) = random_mxfp4(&mut rng(), 4, 64, &[127]);
    let m = Mxfp4Matrix::new(&packed, &s, 4, 64).expect("valid");
    let (x, mut y_ok, mut y_bad) = (vec![1.0f32; 64], vec![0.0f32; 4], vec![0.0f32; 3]);
    let mut products = [
        Mxfp4Product {
            matrix: m,
            x: &x,
            t_rows: 1,
            y: &mut y_ok,
        },
        Mxfp4Product {
            matrix: m,
            x: &x,
            t_rows: 1,
            y: &mut y_bad,
        },
    ];
    gemm_batch(&mut products).expect_err("a short output is refused");
}

#[test]
fn mxfp4_each_simd_level_matches_twin() {
    use deltafin_quant::mxfp4_contract::{dot_row_ref, permute_input};
    let mut r = rng();
    for &cols in MXFP4_COLS {
        let (packed, s) = random_mxfp4(&mut r, 2, cols, &[0, 3, 127, 131, 254]);
        let mut x = randn(&mut r, cols);
        // Edge inputs: signed zeros, a subnormal, huge values.
        x[0] = -0.0;
        x[cols / 2] = 1e-40;
        x[cols - 1] = 3.0e38;
        let xp = permute_input(&x);
        let row = |i: usize| {
            (
                &packed[i * cols / 2..(i + 1) * cols / 2],
                &s[i * cols / 32..(i + 1) * cols / 32],
            )
        };
        let want = [
            dot_row_ref(row(0).0, row(0).1, &xp),
            dot_row_ref(row(1).0, row(1).1, &xp),
        ];
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                for (i, w) in want.iter().enumerate() {
                    // SAFETY: AVX2 and FMA detected; one row and its permuted input.
                    let got =
                        unsafe { deltafin_quant::simd::avx2::mxfp4_dot(row(i).0, row(i).1, &xp) };
                    assert!(same(got, *w), "avx2 cols {cols} row {i}: {got} vs {w}");
                }
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: AVX-512F/BW, AVX2 and FMA detected; two rows and their permuted input.
                let got = unsafe {
                    deltafin_quant::simd::avx512::mxfp4_dot_rows::<2>([row(0), row(1)], &xp)
                };
                let mut multi = [0.0f32; 2];
                let xps: Vec<f32> = xp.iter().chain(xp.iter()).copied().collect();
                // SAFETY: as above, two copies of the input.
                unsafe {
                    deltafin_quant::simd::avx512::mxfp4_row_multi(
                        row(1).0,
                        row(1).1,
                        &xps,
                        xp.len(),
                        &mut multi,
                    )
                };
                for i in 0..2 {
                    assert!(same(got[i], want[i]), "avx512 x2 cols {cols} row {i}");
                    assert!(
                        same(multi[i], want[1]),
                        "avx512 multi cols {cols} input {i}"
                    );
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use deltafin_quant::simd::neon;
            let got = neon::mxfp4_dot_rows::<2>([row(0), row(1)], &xp);
            // Row 1 against five copies of the input: one group of four decoded together, and one alone.
            let xps: Vec<f32> = std::iter::repeat_n(&xp, 5).flatten().copied().collect();
            let mut multi = [f32::NAN; 5];
            neon::mxfp4_row_multi(row(1).0, row(1).1, &xps, xp.len(), &mut multi);
            for i in 0..2 {
                assert!(same(got[i], want[i]), "neon x2 cols {cols} row {i}");
            }
            for (i, m) in multi.iter().enumerate() {
                assert!(same(*m, want[1]), "neon multi cols {cols} input {i}");
            }
        }
    }
}

/// Random inputs spread over 2^±24 (so that bf16 partial sums round, and the order of additions shows), with edge
/// values: signed zeros, a denormal, values whose bf16 products with small weights are denormal (flushed), huge
/// values, and ties of the bf16 rounding.
fn edge_inputs(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = randn(r, n)
        .into_iter()
        .map(|v| v * 2f32.powi(r.random_range(-24..=24)))
        .collect();
    let edges = [
        -0.0,
        0.0,
        1e-40,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE * 1.5,
        3.0e38,
        -1.0e38,
        1.0 + 1.0 / 256.0,
        -(1.0 + 3.0 / 256.0),
    ];
    for (i, &e) in edges.iter().enumerate() {
        let at = (i * 97 + 5) % n;
        x[at] = e;
    }
    x
}

/// The tile kernel keeps each pair's even and odd accumulators apart by the chunk's parity: blocks of chunks that
/// start on an odd chunk, end on one, or hold one chunk must give the twin's bits too.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_tiles_match_twin_for_any_chunk_blocks() {
    use deltafin_quant::mxfp4_contract::{CHUNK, dot_row_ref, permute_input};
    use deltafin_quant::simd::avx512::{
        Bf16Acc, DECODED_CHUNK, bf16_finish, mxfp4_decode_rows, mxfp4_tile,
    };
    if !avx512_cpu_or_skip() {
        return;
    }
    let mut r = rng();
    let cols: usize = 3616; // 29 chunks, the last one partial
    let n_chunks = cols.div_ceil(CHUNK);
    let (packed, s) = random_mxfp4(&mut r, 2, cols, &[124, 125, 126, 127, 128, 129]);
    let row = |i: usize| {
        (
            &packed[i * cols / 2..(i + 1) * cols / 2],
            &s[i * cols / 32..(i + 1) * cols / 32],
        )
    };
    let xps: Vec<Vec<f32>> = (0..3)
        .map(|_| permute_input(&randn(&mut r, cols)))
        .collect();
    let mut decoded = vec![0.0f32; 2 * n_chunks * DECODED_CHUNK];
    // SAFETY: AVX-512F/BW detected; `decoded` holds both rows' chunks.
    unsafe { mxfp4_decode_rows(&[row(0), row(1)], n_chunks, &mut decoded) };
    let (d0, d1) = decoded.split_at(n_chunks * DECODED_CHUNK);
    for bounds in [
        &[0, 29][..],
        &[0, 5, 29],
        &[0, 1, 2, 3, 16, 28, 29],
        &[0, 4, 7, 12, 29],
    ] {
        // SAFETY: an all-zero bit pattern is a valid vector.
        let mut acc: Vec<Bf16Acc> = vec![unsafe { std::mem::zeroed() }; 2 * 3];
        for span in bounds.windows(2) {
            let xs: [&[f32]; 3] = std::array::from_fn(|t| &xps[t][..]);
            // SAFETY: features detected; decoded rows of 29 chunks, inputs of 29 · 128 values, 6 accumulators.
            unsafe { mxfp4_tile::<2, 3>([d0, d1], xs, (span[0], span[1]), &mut acc, 3) };
        }
        for i in 0..2 {
            for (t, xp) in xps.iter().enumerate() {
                // SAFETY: AVX-512F detected.
                let got = unsafe { bf16_finish(&acc[i * 3 + t]) };
                let want = dot_row_ref(row(i).0, row(i).1, xp);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "blocks {bounds:?} row {i} input {t}"
                );
            }
        }
    }
}

#[test]
fn mxfp4_bf16_input_matches_twin_for_every_shape_and_batch() {
    exercised(
        "mxfp4_bf16_input_matches_twin_for_every_shape_and_batch",
        &[Contract::Mxfp4Bf16],
    );
    dispatch_matches_twin(
        Mxfp4Input::Bf16,
        |_| {},
        |m, row, x| m.dot_row_bf16_ref(row, x),
    );
}

/// Two products over one input (an expert's gate and up) with more inputs than a token block, in every input mode:
/// cut into pieces that still share the permuted input, each output bit-identical to its contract's twin.
#[test]
fn long_products_sharing_an_input_match_twin() {
    let mut r = rng();
    let (rows, cols, t_rows) = (40, 384, 137);
    let (p0, s0) = random_mxfp4(&mut r, rows, cols, &[0, 126, 127, 131, 254]);
    let (p1, s1) = random_mxfp4(&mut r, rows, cols, &[124, 125, 126, 127, 128, 129]);
    let xs = randn(&mut r, t_rows * cols);
    for input in [Mxfp4Input::F32, Mxfp4Input::Bf16, Mxfp4Input::I16] {
        let (mut y0, mut y1) = (vec![f32::NAN; t_rows * rows], vec![f32::NAN; t_rows * rows]);
        let m0 = Mxfp4Matrix::new(&p0, &s0, rows, cols).expect("valid");
        let m1 = Mxfp4Matrix::new(&p1, &s1, rows, cols).expect("valid");
        let mut products = [
            Mxfp4Product {
                matrix: m0,
                x: &xs,
                t_rows,
                y: &mut y0,
            },
            Mxfp4Product {
                matrix: m1,
                x: &xs,
                t_rows,
                y: &mut y1,
            },
        ];
        gemm_batch_with(&mut products, input).expect("gemm");
        for (m, y) in [(m0, &y0), (m1, &y1)] {
            for t in 0..t_rows {
                let x = &xs[t * cols..(t + 1) * cols];
                for row in 0..rows {
                    let b = match input {
                        Mxfp4Input::F32 => m.dot_row_ref(row, x),
                        Mxfp4Input::Bf16 => m.dot_row_bf16_ref(row, x),
                        Mxfp4Input::I16 => m.dot_row_i16_ref(row, x),
                    };
                    let a = y[t * rows + row];
                    assert!(
                        a.to_bits() == b.to_bits(),
                        "{input} t {t} row {row}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Every shape and batch of `gemm_batch_with(.., input)` on edge inputs (after `edit`) against `twin`, bit for bit
/// (or both NaN).
fn dispatch_matches_twin(
    input: Mxfp4Input,
    edit: impl Fn(&mut [f32]),
    twin: impl Fn(&Mxfp4Matrix<'_>, usize, &[f32]) -> f32,
) {
    let mut r = rng();
    for &cols in MXFP4_COLS {
        let rows = 37; // odd: the last row of a pair runs alone
        let (packed, s) = random_mxfp4(&mut r, rows, cols, &[0, 1, 126, 127, 128, 140, 253, 254]);
        for t_rows in [1, 2, 5, 19] {
            let mut xs = edge_inputs(&mut r, t_rows * cols);
            edit(&mut xs[..cols]);
            let mut y = vec![f32::NAN; t_rows * rows];
            let mut products = [Mxfp4Product {
                matrix: Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid"),
                x: &xs,
                t_rows,
                y: &mut y,
            }];
            gemm_batch_with(&mut products, input).expect("gemm");
            let m = products[0].matrix;
            for t in 0..t_rows {
                let x = &xs[t * cols..(t + 1) * cols];
                for row in 0..rows {
                    let (a, b) = (y[t * rows + row], twin(&m, row, x));
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{input} cols {cols} t_rows {t_rows} t {t} row {row}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_bf16_kernels_match_twin_where_the_cpu_has_them() {
    use deltafin_quant::mxfp4_bf16_contract::{dot_row_ref, permute_input};
    use deltafin_quant::simd::avx512::{mxfp4_bf16_dot_rows, mxfp4_bf16_row_multi};
    if !cpu_has_or_skip("avx512-bf16", deltafin_quant::simd::has_avx512_bf16()) {
        return;
    }
    let mut r = rng();
    for &cols in MXFP4_COLS {
        let (packed, s) = random_mxfp4(&mut r, 2, cols, &[0, 3, 127, 131, 254]);
        let xb = permute_input(&edge_inputs(&mut r, cols));
        // Inputs at the bottom of the normal range, against the largest scale: many partial sums are denormal, and
        // whether they are flushed shows in the result.
        let tiny: Vec<f32> = (0..cols)
            .map(|_| f32::MIN_POSITIVE * r.random_range(-2.0f32..2.0))
            .collect();
        let (tiny_packed, tiny_s) = random_mxfp4(&mut r, 2, cols, &[254]);
        let xb_tiny = permute_input(&tiny);
        let tiny_row = |i: usize| {
            (
                &tiny_packed[i * cols / 2..(i + 1) * cols / 2],
                &tiny_s[i * cols / 32..(i + 1) * cols / 32],
            )
        };
        let want_tiny = [0, 1].map(|i| dot_row_ref(tiny_row(i).0, tiny_row(i).1, &xb_tiny));
        // SAFETY: AVX-512F/BW/BF16 with AVX2 and FMA detected; two whole rows and their paired input.
        let got_tiny = unsafe { mxfp4_bf16_dot_rows::<2>([tiny_row(0), tiny_row(1)], &xb_tiny) };
        for i in 0..2 {
            same_bits(
                got_tiny[i],
                want_tiny[i],
                &format!("tiny cols {cols} row {i}"),
            );
        }
        let row = |i: usize| {
            (
                &packed[i * cols / 2..(i + 1) * cols / 2],
                &s[i * cols / 32..(i + 1) * cols / 32],
            )
        };
        let want = [0, 1].map(|i| dot_row_ref(row(i).0, row(i).1, &xb));
        // SAFETY: AVX-512F/BW/BF16 with AVX2 and FMA detected; two whole rows and their paired input.
        let pair = unsafe { mxfp4_bf16_dot_rows::<2>([row(0), row(1)], &xb) };
        // Row 1 against two copies of the input, each decoded chunk used for both.
        let xbs: Vec<u32> = xb.iter().chain(xb.iter()).copied().collect();
        let mut multi = [0.0f32; 2];
        // SAFETY: as above, one row and two inputs of `xb.len()` words.
        unsafe { mxfp4_bf16_row_multi(row(1).0, row(1).1, &xbs, xb.len(), &mut multi) };
        for i in 0..2 {
            same_bits(pair[i], want[i], &format!("x2 cols {cols} row {i}"));
            same_bits(multi[i], want[1], &format!("multi cols {cols} input {i}"));
        }
    }
}

/// The AVX2 bf16-input kernels, with and without the flushes, against the scalar twin: plain inputs (where the
/// flushes cannot matter, so both variants must agree), edge inputs (denormals, huge values) and inputs at the bottom
/// of the normal range against the largest scale (denormal partial sums, flushed), for the pair and multi kernels.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_bf16_avx2_kernels_match_twin() {
    use deltafin_quant::mxfp4_bf16_contract::{dot_row_ref, flush_free, permute_input};
    use deltafin_quant::simd::avx2::{mxfp4_bf16_dot_pair, mxfp4_bf16_row_multi};
    let present =
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    if !cpu_has_or_skip("avx2", present) {
        return;
    }
    let mut r = rng();
    let mut differs = 0;
    for &cols in MXFP4_COLS {
        let (packed, s) = random_mxfp4(&mut r, 2, cols, &[0, 3, 127, 131, 254]);
        let (tiny_packed, tiny_s) = random_mxfp4(&mut r, 2, cols, &[254]);
        let tiny: Vec<f32> = (0..cols)
            .map(|_| f32::MIN_POSITIVE * r.random_range(-2.0f32..2.0))
            .collect();
        let cases = [
            ("plain", &packed, &s, permute_input(&randn(&mut r, cols))),
            (
                "edge",
                &packed,
                &s,
                permute_input(&edge_inputs(&mut r, cols)),
            ),
            ("tiny", &tiny_packed, &tiny_s, permute_input(&tiny)),
        ];
        for (what, packed, s, xb) in cases {
            let row = |i: usize| {
                (
                    &packed[i * cols / 2..(i + 1) * cols / 2],
                    &s[i * cols / 32..(i + 1) * cols / 32],
                )
            };
            let want = [0, 1].map(|i| dot_row_ref(row(i).0, row(i).1, &xb));
            let xbs: Vec<u32> = xb.iter().chain(xb.iter()).copied().collect();
            let free = flush_free(&xb);
            assert_eq!(free, what == "plain", "{what}: flush_free {free}");
            let check = |flush: bool| {
                let mut multi = [0.0f32; 2];
                // SAFETY: AVX2 and FMA detected; two whole rows and their paired input (twice for the multi kernel).
                let pair = unsafe {
                    if flush {
                        mxfp4_bf16_row_multi::<true>(
                            row(1).0,
                            row(1).1,
                            &xbs,
                            xb.len(),
                            &mut multi,
                        );
                        mxfp4_bf16_dot_pair::<true>([row(0), row(1)], &xb)
                    } else {
                        mxfp4_bf16_row_multi::<false>(
                            row(1).0,
                            row(1).1,
                            &xbs,
                            xb.len(),
                            &mut multi,
                        );
                        mxfp4_bf16_dot_pair::<false>([row(0), row(1)], &xb)
                    }
                };
                for i in 0..2 {
                    let tag = format!("{what} flush {flush} cols {cols}");
                    same_bits(pair[i], want[i], &format!("{tag} row {i}"));
                    same_bits(multi[i], want[1], &format!("{tag} multi input {i}"));
                }
            };
            check(true);
            if free {
                check(false);
            } else if what == "tiny" {
                // Without the flushes some result comes out different: the flush path is what makes them equal.
                // SAFETY: as above.
                let unflushed = unsafe { mxfp4_bf16_dot_pair::<false>([row(0), row(1)], &xb) };
                differs += (0..2)
                    .filter(|&i| unflushed[i].to_bits() != want[i].to_bits())
                    .count();
            }
        }
    }
    assert!(differs > 0, "no tiny case reached a denormal partial sum");
}

/// A random `[64, 3584]` MXFP4 matrix and an input (through `round`) multiplied on the f32 and the bf16-input paths:
/// `(Σ|w·x| per row, f32 results, bf16-input results)`.
fn f32_and_bf16_paths(round: impl Fn(f32) -> f32) -> (Vec<f64>, Vec<f32>, Vec<f32>) {
    let (mags, _, exact, bf16) = f32_and_other_path(round, Mxfp4Input::Bf16);
    (mags, exact, bf16)
}

/// A random `[64, 3584]` MXFP4 matrix and an input (through `round`) multiplied on the f32 path and on `other`:
/// `(Σ|w·x| per row, the dequantised weights and the input, f32 results, results of `other`)`.
#[allow(clippy::type_complexity)]
fn f32_and_other_path(
    round: impl Fn(f32) -> f32,
    other: Mxfp4Input,
) -> (Vec<f64>, (Vec<f32>, Vec<f32>), Vec<f32>, Vec<f32>) {
    let mut r = rng();
    let (rows, cols) = (64, 3584);
    let (packed, s) = random_mxfp4(&mut r, rows, cols, &[125, 127, 129]);
    let m = Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid");
    let w = m.dequantize_ref();
    let x: Vec<f32> = randn(&mut r, cols).into_iter().map(round).collect();
    let (mut exact, mut got) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    m.gemm(&x, 1, &mut exact).expect("gemm");
    let mut products = [Mxfp4Product {
        matrix: m,
        x: &x,
        t_rows: 1,
        y: &mut got,
    }];
    gemm_batch_with(&mut products, other).expect("gemm");
    let mags = (0..rows)
        .map(|row| {
            (0..cols)
                .map(|i| (w[row * cols + i] as f64 * x[i] as f64).abs())
                .sum()
        })
        .collect();
    (mags, (w, x), exact, got)
}

#[test]
fn mxfp4_i16_input_matches_twin_for_every_shape_and_batch() {
    exercised(
        "mxfp4_i16_input_matches_twin_for_every_shape_and_batch",
        &[Contract::Mxfp4I16, Contract::Quantise],
    );
    // The first input also has a group with an infinity and one of zeros: NaN and nothing.
    let edit = |x: &mut [f32]| {
        x[3] = f32::INFINITY;
        let n = x.len();
        x[n.min(64)..n.min(96)].fill(0.0);
    };
    dispatch_matches_twin(Mxfp4Input::I16, edit, |m, row, x| m.dot_row_i16_ref(row, x));
}

/// Whether the instruction set `what` (as `DELTAFIN_TEST_SKIP` names it) can be exercised here (`present`). A test
/// that cannot exercise its kernels would check nothing, so it fails unless `DELTAFIN_TEST_SKIP` lists `what`
/// (CI's pass with `DELTAFIN_NO_AVX512=1` does, for the AVX-512 sets); then it says in the log that it skipped.
#[cfg(target_arch = "x86_64")]
fn cpu_has_or_skip(what: &str, present: bool) -> bool {
    if present {
        return true;
    }
    let skips = std::env::var("DELTAFIN_TEST_SKIP").unwrap_or_default();
    assert!(
        skips.split(',').any(|s| s == what),
        "this CPU (or DELTAFIN_NO_AVX512) has no {what}, so this test would check nothing; \
         set DELTAFIN_TEST_SKIP={what} to skip it"
    );
    eprintln!("skipped (DELTAFIN_TEST_SKIP={what}): no {what} kernels can run here");
    false
}

/// [`cpu_has_or_skip`] for the AVX-512 kernels that tests call directly (AVX-512F and BW, AVX2, FMA): what counts is
/// the CPU, not the dispatch, which `DELTAFIN_NO_AVX512` turns off.
#[cfg(target_arch = "x86_64")]
fn avx512_cpu_or_skip() -> bool {
    let present = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma");
    cpu_has_or_skip("avx512", present)
}

/// An int16-input MXFP4 kernel pair: two rows against one input, and one row against several inputs.
#[cfg(target_arch = "x86_64")]
type I16Kernels = (
    &'static str,
    unsafe fn([(&[u8], &[u8]); 2], &[u32]) -> [f32; 2],
    unsafe fn(&[u8], &[u8], &[u32], usize, &mut [f32]),
);

#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_i16_kernels_match_twin_where_the_cpu_has_them() {
    use deltafin_quant::mxfp4_i16_contract::{dot_row_ref, permute_input};
    use deltafin_quant::simd::{avx2, avx512};
    let mut kernels: Vec<I16Kernels> = Vec::new();
    if deltafin_quant::simd::has_avx512_vnni() {
        kernels.push((
            "avx512",
            avx512::mxfp4_i16_dot_rows::<2>,
            avx512::mxfp4_i16_row_multi,
        ));
    }
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        kernels.push((
            "avx2",
            avx2::mxfp4_i16_dot_rows::<2>,
            avx2::mxfp4_i16_row_multi,
        ));
    }
    if !cpu_has_or_skip("avx2", !kernels.is_empty()) {
        return;
    }
    let mut r = rng();
    for &cols in MXFP4_COLS {
        let (packed, s) = random_mxfp4(&mut r, 2, cols, &[0, 3, 127, 131, 254]);
        // Inputs spread over 2^±24: each group's quantisation step differs, and the lanes' multipliers with it.
        let xq = permute_input(&edge_inputs(&mut r, cols));
        let row = |i: usize| {
            (
                &packed[i * cols / 2..(i + 1) * cols / 2],
                &s[i * cols / 32..(i + 1) * cols / 32],
            )
        };
        let want = [0, 1].map(|i| dot_row_ref(row(i).0, row(i).1, &xq));
        // Row 1 against two copies of the input, each decoded chunk used for both.
        let xqs: Vec<u32> = xq.iter().chain(xq.iter()).copied().collect();
        for &(name, pair_kernel, multi_kernel) in &kernels {
            // SAFETY: the kernel's features were detected; two whole rows and their quantised input.
            let pair = unsafe { pair_kernel([row(0), row(1)], &xq) };
            let mut multi = [0.0f32; 2];
            // SAFETY: as above, one row and two inputs of `xq.len()` words.
            unsafe { multi_kernel(row(1).0, row(1).1, &xqs, xq.len(), &mut multi) };
            for i in 0..2 {
                same_bits(pair[i], want[i], &format!("{name} x2 cols {cols} row {i}"));
                same_bits(
                    multi[i],
                    want[1],
                    &format!("{name} multi cols {cols} input {i}"),
                );
            }
        }
    }
}

#[test]
fn mxfp4_i16_input_is_close_to_the_f32_path() {
    // Quantising moves each input by at most s / 2 = max|x of its group| / 65534, so the result moves by at most
    // Σ|w|·s/2 plus the two paths' own f32 rounding (well under 1e-6 · Σ|w·x| for 3584 columns).
    let (mags, (w, x), exact, got) = f32_and_other_path(|v| v, Mxfp4Input::I16);
    let cols = x.len();
    let half_step = |i: usize| {
        let g = i / 32 * 32;
        x[g..g + 32]
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs() as f64))
            / 65534.0
    };
    let mut worst = 0.0f64;
    for (row, mag) in mags.iter().enumerate() {
        let quantisation: f64 = (0..cols)
            .map(|i| (w[row * cols + i] as f64).abs() * half_step(i))
            .sum();
        let err = (got[row] as f64 - exact[row] as f64).abs();
        assert!(
            err <= quantisation + 1e-6 * mag,
            "row {row}: {} vs {} (bound {quantisation})",
            got[row],
            exact[row]
        );
        worst = worst.max(err / mag);
    }
    // The quantisation did change something, and by far less than a bf16 cast (2^-9 of Σ|w·x|) would.
    assert!(worst > 0.0 && worst < 2f64.powi(-12), "worst {worst}");
}

#[test]
fn mxfp4_bf16_input_is_close_to_the_f32_path() {
    // Rounding each input to bf16 moves it by at most 2^-9 of itself, so the result moves by at most
    // 2^-9 · Σ|w·x| plus the f32 path's own rounding.
    let (mags, exact, bf16) = f32_and_bf16_paths(|v| v);
    let mut worst = 0.0f64;
    for (row, mag) in mags.iter().enumerate() {
        let err = (bf16[row] as f64 - exact[row] as f64).abs();
        assert!(
            err <= mag * (2f64.powi(-9) + 1e-6),
            "row {row}: {} vs {} (Σ|w·x| {mag})",
            bf16[row],
            exact[row]
        );
        worst = worst.max(err / mag);
    }
    // And the rounding did change something (the two paths are not the same computation).
    assert!(worst > 0.0);
}

#[test]
fn mxfp4_bf16_input_equals_the_f32_path_on_rounded_inputs() {
    // Rounding is the only thing the bf16 mode changes: on inputs already exact in bf16, both contracts sum the same
    // exact products and differ only in the order and rounding of the additions, bounded by 2·cols·2^-24·Σ|w·x|.
    use deltafin_quant::mxfp4_bf16_contract::bf16_rounded;
    let cols = 3584;
    let (mags, exact, bf16) = f32_and_bf16_paths(bf16_rounded);
    for (row, mag) in mags.iter().enumerate() {
        let err = (bf16[row] as f64 - exact[row] as f64).abs();
        assert!(
            err <= 2.0 * cols as f64 * 2f64.powi(-24) * mag,
            "row {row}: {} vs {} (Σ|w·x| {mag})",
            bf16[row],
            exact[row]
        );
    }
}

#[test]
fn mxfp4_dot_is_close_to_the_exact_sum() {
    let mut r = rng();
    let (rows, cols) = (16, 3584);
    let (packed, s) = random_mxfp4(&mut r, rows, cols, &[125, 127, 129]);
    let m = Mxfp4Matrix::new(&packed, &s, rows, cols).expect("valid");
    let w = m.dequantize_ref();
    let x = randn(&mut r, cols);
    for row in 0..rows {
        let exact: f64 = w[row * cols..(row + 1) * cols]
            .iter()
            .zip(&x)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        let scale: f64 = w[row * cols..(row + 1) * cols]
            .iter()
            .zip(&x)
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum();
        let got = m.dot_row(row, &x) as f64;
        assert!(
            (got - exact).abs() <= 1e-6 * scale,
            "row {row}: {got} vs {exact} (Σ|w·x| {scale})"
        );
    }
}

#[test]
fn dense_row_pairs_match_twins() {
    exercised(
        "dense_row_pairs_match_twins",
        &[Contract::Dense, Contract::Int8, Contract::Quantise],
    );
    use deltafin_quant::dot::dot_f32_x2;
    let mut r = rng();
    for &n in LENGTHS {
        let x = randn(&mut r, n);
        let (w0, w1) = (randn(&mut r, n), randn(&mut r, n));
        let b = |w: &[f32]| -> Vec<u16> { w.iter().map(|v| (v.to_bits() >> 16) as u16).collect() };
        let q = |r: &mut ChaCha8Rng| -> Vec<i8> {
            (0..n).map(|_| r.random_range(-127i8..=127)).collect()
        };
        let (q0, q1) = (q(&mut r), q(&mut r));
        let (b0, b1) = (b(&w0), b(&w1));
        let xp = bf16_contract::permute_input(&x);
        let pairs = [
            (
                dot_f32_x2(&w0, &w1, &x),
                [dot_f32_ref(&w0, &x), dot_f32_ref(&w1, &x)],
                "f32",
            ),
            (
                bf16_contract::dot_x2(&b0, &b1, &xp),
                [dot_bf16_ref(&b0, &x), dot_bf16_ref(&b1, &x)],
                "bf16",
            ),
        ];
        for (got, want, what) in pairs {
            same_bits(got[0], want[0], &format!("{what} x2 row 0 n={n}"));
            same_bits(got[1], want[1], &format!("{what} x2 row 1 n={n}"));
        }
        let xq = QuantizedInput::new(&x);
        assert_eq!(
            int8_contract::dot_x2(&q0, &q1, &xq),
            [
                int8_contract::dot_ref(&q0, &xq),
                int8_contract::dot_ref(&q1, &xq)
            ],
            "i8 x2 n={n}"
        );
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            use deltafin_quant::simd::avx2;
            // SAFETY: AVX2 and FMA detected; equal lengths.
            unsafe {
                same_bits(avx2::dot_f32(&w0, &x), dot_f32_ref(&w0, &x), "avx2 f32");
                same_bits(
                    avx2::bf16_rows::<1>([&b0], &xp, Prefetch::Off)[0],
                    dot_bf16_ref(&b0, &x),
                    "avx2 bf16",
                );
                let pairs = [
                    (
                        avx2::dot_f32_x2(&w0, &w1, &x),
                        [dot_f32_ref(&w0, &x), dot_f32_ref(&w1, &x)],
                    ),
                    (
                        avx2::bf16_rows::<2>([&b0, &b1], &xp, Prefetch::Span(16 << 10)),
                        [dot_bf16_ref(&b0, &x), dot_bf16_ref(&b1, &x)],
                    ),
                ];
                for (got, want) in pairs {
                    same_bits(got[0], want[0], &format!("avx2 x2 row 0 n={n}"));
                    same_bits(got[1], want[1], &format!("avx2 x2 row 1 n={n}"));
                }
                let xq = QuantizedInput::new(&x);
                let want = int8_contract::dot_ref(&q0, &xq);
                assert_eq!(avx2::int8_dot(&q0, xq.values()), want, "avx2 i8 n={n}");
                assert_eq!(
                    avx2::int8_dot_x2(&q0, &q1, xq.values()),
                    [want, int8_contract::dot_ref(&q1, &xq)],
                    "avx2 i8 x2 n={n}"
                );
            }
        }
    }
}

/// bf16 rows on every kernel set this CPU has, against the contract's reference: random rows of every length (partial
/// last chunks included) and rows of edge values (signed zeros, denormal and huge weights, products that overflow to
/// infinity, which then meet their opposite as NaN), so the lane order, the padding and the reduction all show.
#[test]
fn bf16_rows_match_their_twin_on_every_kernel_set() {
    let mut r = rng();
    let edges: [u16; 10] = [
        0x0000, 0x8000, 0x0001, 0x8003, 0x7f7f, 0xff7f, 0x3f80, 0xbf80, 0x4b00, 0x0080,
    ];
    for &n in LENGTHS.iter().chain(&[2, 15, 16, 17, 48, 4097]) {
        let x = randn(&mut r, n);
        let rows: Vec<Vec<u16>> = (0..3)
            .map(|k| {
                (0..n)
                    .map(|i| {
                        if k == 2 {
                            edges[i % edges.len()]
                        } else {
                            (r.random_range(-4.0f32..4.0).to_bits() >> 16) as u16
                        }
                    })
                    .collect()
            })
            .collect();
        let xp = bf16_contract::permute_input(&x);
        for w in &rows {
            let want = bf16_contract::dot_ref(w, &xp);
            let mut got = vec![("dispatch", bf16_contract::dot(w, &xp))];
            got.push(("dispatch pair", bf16_contract::dot_x2(w, w, &xp)[1]));
            #[cfg(target_arch = "x86_64")]
            {
                use deltafin_quant::simd::{avx2, avx512, has_avx2_fma, has_avx512};
                // SAFETY: each kernel runs only where its features are detected; `xp` is the padded input.
                unsafe {
                    if has_avx512() {
                        got.push(("avx512", avx512::bf16_rows::<1>([w], &xp, Prefetch::Off)[0]));
                        got.push((
                            "avx512 pair",
                            avx512::bf16_rows::<2>([w, w], &xp, Prefetch::Off)[0],
                        ));
                        // Prefetching ahead, either form, changes no bit.
                        got.push((
                            "avx512 prefetched",
                            avx512::bf16_rows::<2>([w, w], &xp, Prefetch::Span(16 << 10))[1],
                        ));
                        got.push((
                            "avx512 prefetched by row",
                            avx512::bf16_rows::<2>([w, w], &xp, Prefetch::PerRow(16 << 10))[0],
                        ));
                    }
                    if has_avx2_fma() {
                        got.push(("avx2", avx2::bf16_rows::<1>([w], &xp, Prefetch::Off)[0]));
                        got.push((
                            "avx2 pair",
                            avx2::bf16_rows::<2>([w, w], &xp, Prefetch::Off)[1],
                        ));
                        // Prefetching ahead changes no bit here either.
                        got.push((
                            "avx2 prefetched",
                            avx2::bf16_rows::<1>([w], &xp, Prefetch::Span(16 << 10))[0],
                        ));
                        got.push((
                            "avx2 pair prefetched by row",
                            avx2::bf16_rows::<2>([w, w], &xp, Prefetch::PerRow(16 << 10))[1],
                        ));
                    }
                }
            }
            #[cfg(target_arch = "aarch64")]
            {
                got.push((
                    "neon",
                    deltafin_quant::simd::neon::bf16_rows::<1>([w], &xp)[0],
                ));
                got.push((
                    "neon pair",
                    deltafin_quant::simd::neon::bf16_rows::<2>([w, w], &xp)[1],
                ));
            }
            for (what, v) in got {
                same_bits(v, want, &format!("{what} bf16 n={n}"));
            }
        }
    }
}

/// The multi-token bf16 products (prefill's tiles, blocks of chunks) against the contract's reference for every pair:
/// row counts and input counts that fill no tile evenly, lengths with partial chunks and more than one block.
#[test]
fn bf16_tiles_match_their_twin_for_every_row_and_input() {
    let mut r = rng();
    for &(rows, tokens, n) in &[
        (1, 1, 7),
        (2, 6, 32),
        (3, 7, 100),
        (5, 13, 1000),
        (4, 64, 2080),
        (7, 9, 7168),
    ] {
        let w: Vec<Vec<u16>> = (0..rows)
            .map(|_| {
                (0..n)
                    .map(|_| (r.random_range(-4.0f32..4.0).to_bits() >> 16) as u16)
                    .collect()
            })
            .collect();
        let xs: Vec<_> = (0..tokens)
            .map(|_| bf16_contract::permute_input(&randn(&mut r, n)))
            .collect();
        let rows_ref: Vec<&[u16]> = w.iter().map(|v| v.as_slice()).collect();
        let xs_ref: Vec<&[f32]> = xs.iter().map(|x| &**x).collect();
        let mut out = vec![f32::NAN; rows * tokens];
        bf16_contract::dot_tiles(&rows_ref, &xs_ref, &mut out);
        for (i, row) in rows_ref.iter().enumerate() {
            for (t, x) in xs_ref.iter().enumerate() {
                same_bits(
                    out[i * tokens + t],
                    bf16_contract::dot_ref(row, x),
                    &format!("tile rows={rows} tokens={tokens} n={n} ({i}, {t})"),
                );
            }
        }
    }
}

/// The bf16 products with the inputs across the lanes (`bf16_contract::dot_lanes_by`: AVX-512 with the weights
/// widened in the loop and ahead, or AVX2 where AVX-512 is missing or turned off), called directly whatever this
/// machine's `lanes_chosen` and `lanes_kernel` say, against the contract's reference for every pair: rows that fill
/// six-row tiles and every smaller shape, more rows than one block of the widening ahead, 16 to 70 inputs (one to
/// five groups, partial ones included), one chunk, fewer chunks than a transposed run, a block and a partial one, and
/// rows whose neighbours hold infinities and NaN-free extremes, so that a kernel reading past its row or its element
/// would show.
#[cfg(target_arch = "x86_64")]
#[test]
fn bf16_lanes_match_their_twin_for_every_row_and_input() {
    use deltafin_quant::bf16_contract::LanesKernel;
    eprintln!(
        "bf16 lanes on {}",
        if deltafin_quant::simd::has_avx512() {
            "avx512"
        } else {
            "avx2"
        }
    );
    if !deltafin_quant::simd::has_avx2_fma() {
        let hardware = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        if hardware {
            // Turned off (`DELTAFIN_NO_SIMD`): the kernel refuses rather than run.
            let mut out = vec![0.0f32; 16];
            bf16_contract::dot_lanes(&[&[0x3f80u16; 32][..]], &[1.0; 512], 16, &mut out);
            assert!(out.iter().all(|v| v.is_nan()));
            return;
        }
        if !cpu_has_or_skip("avx2", false) {
            return;
        }
    }
    let mut r = rng();
    for &(rows, tokens, n) in &[
        (6, 64, 32),
        (13, 16, 2048),
        (7, 70, 2080),
        (1, 17, 64),
        (12, 48, 7168),
        (53, 33, 96),
        (100, 64, 1056),
    ] {
        // Every third row holds an infinity and the largest negative finite value (one each, so its sums are ±inf
        // or NaN); the others are finite, so their sums are finite and any weight taken from the wrong element,
        // chunk or row changes their bits.
        let w: Vec<u16> = (0..rows * n)
            .map(|i| match (i / n % 3, i % n) {
                (0, 5) => 0x7f80,  // +inf
                (0, 38) => 0xff7f, // largest negative finite
                _ => (r.random_range(-4.0f32..4.0).to_bits() >> 16) as u16,
            })
            .collect();
        let x = randn(&mut r, tokens * n);
        let rows_ref: Vec<&[u16]> = w.chunks_exact(n).collect();
        let xt = deltafin_quant::bf16_lanes::token_lanes(&x, n, tokens);
        for kernel in [LanesKernel::InLoop, LanesKernel::Ahead] {
            let mut out = vec![f32::NAN; rows * tokens];
            bf16_contract::dot_lanes_by(kernel, &rows_ref, &xt, tokens, &mut out);
            for (i, row) in rows_ref.iter().enumerate() {
                for t in 0..tokens {
                    let xp = bf16_contract::permute_input(&x[t * n..(t + 1) * n]);
                    let want = bf16_contract::dot_ref(row, &xp);
                    let got = out[i * tokens + t];
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "lanes {kernel:?} rows={rows} tokens={tokens} n={n} ({i}, {t}): {got} vs {want}"
                    );
                    assert!(
                        i % 3 == 0 || want.is_finite(),
                        "a finite row's sum is finite"
                    );
                }
            }
        }
    }
    // A length that is not a multiple of 32 is refused (NaN), not read past.
    let w = vec![0x3f80u16; 40];
    let mut out = vec![0.0f32; 16];
    bf16_contract::dot_lanes(&[&w], &vec![1.0; 4096], 16, &mut out);
    assert!(out.iter().all(|v| v.is_nan()));
}

/// The NEON kernels called directly, each against its scalar twin bit for bit (the dispatch tests above run them
/// too, through the library's choice).
#[cfg(target_arch = "aarch64")]
mod neon_kernels {
    use super::*;
    use deltafin_quant::mxfp4_contract::CHUNK;
    use deltafin_quant::simd::neon;
    use deltafin_quant::{mxfp4_contract, mxfp4_i16_contract};

    /// [`edge_inputs`] with the low three significand bits of its moderate values set at random, so that they use
    /// all 24 bits. `randn`'s values are multiples of 2^-20 (at most 22 significant bits): their products with E2M1
    /// weights (at most 2 significant bits) are exact, and a kernel that rounded a product before adding it would
    /// pass on them; on these it does not.
    fn full_inputs(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        let mut x = edge_inputs(r, n);
        for v in &mut x {
            if v.is_normal() && v.abs() < 1e30 {
                *v = f32::from_bits(v.to_bits() | (r.random::<u32>() & 7));
            }
        }
        x
    }

    /// The same bits, or both NaN (inputs near the f32 range overflow some MXFP4 sums to NaN on both paths).
    fn same_or_nan(a: f32, b: f32, what: &str) {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what}: {a} vs {b}"
        );
    }

    #[test]
    fn dense_and_int8_kernels_match_twins() {
        let mut r = rng();
        for &n in LENGTHS.iter().chain(&[4095, 4096, 4097, 8200]) {
            let x = full_inputs(&mut r, n);
            let (w0, w1) = (randn(&mut r, n), randn(&mut r, n));
            let b =
                |w: &[f32]| -> Vec<u16> { w.iter().map(|v| (v.to_bits() >> 16) as u16).collect() };
            let (b0, b1) = (b(&w0), b(&w1));
            same_bits(
                neon::dot_f32(&w0, &x),
                dot_f32_ref(&w0, &x),
                &format!("f32 n={n}"),
            );
            let xp = bf16_contract::permute_input(&x);
            same_bits(
                neon::bf16_rows::<1>([&b0], &xp)[0],
                bf16_contract::dot_ref(&b0, &xp),
                &format!("bf16 n={n}"),
            );
            let f2 = neon::dot_f32_x2(&w0, &w1, &x);
            let b2 = neon::bf16_rows::<2>([&b0, &b1], &xp);
            for (i, (w, bw)) in [(&w0, &b0), (&w1, &b1)].into_iter().enumerate() {
                same_bits(f2[i], dot_f32_ref(w, &x), &format!("f32 x2 row {i} n={n}"));
                same_bits(
                    b2[i],
                    bf16_contract::dot_ref(bw, &xp),
                    &format!("bf16 x2 row {i} n={n}"),
                );
            }
            // int8 at the extremes of both factors as well as at random.
            let q = |r: &mut ChaCha8Rng| -> Vec<i8> { (0..n).map(|_| r.random::<i8>()).collect() };
            let (q0, q1) = (q(&mut r), q(&mut r));
            let xq = QuantizedInput::new(&x);
            let want = [
                int8_contract::dot_ref(&q0, &xq),
                int8_contract::dot_ref(&q1, &xq),
            ];
            assert_eq!(neon::int8_dot(&q0, xq.values()), want[0], "i8 n={n}");
            assert_eq!(
                neon::int8_dot_x2(&q0, &q1, xq.values()),
                want,
                "i8 x2 n={n}"
            );
            // Unpadded input values (as long as the row) give the same sum.
            assert_eq!(
                neon::int8_dot(&q0, &xq.values()[..n]),
                want[0],
                "i8 unpadded n={n}"
            );
            let low = vec![i8::MIN; n];
            let xq_low = QuantizedInput::new(&vec![-1.0f32; n]);
            let exact = n as i64 * 128 * 32767;
            assert_eq!(
                neon::int8_dot(&low, xq_low.values()),
                exact,
                "i8 extremes n={n}"
            );
            assert_eq!(
                neon::int8_dot_x2(&low, &low, xq_low.values()),
                [exact; 2],
                "i8 x2 extremes n={n}"
            );
        }
    }

    /// Two rows against one input, and one row against six (a group of four decoded together, and two alone), on
    /// both MXFP4 contracts with NEON kernels, for every shape. First on moderate inputs and scales, where every
    /// result is finite, so the comparison cannot pass on NaN; then with the edge inputs and the extreme scales,
    /// where sums overflow and both paths must agree on what they give (NaN included).
    #[test]
    fn mxfp4_kernels_match_twins_for_every_shape() {
        let mut r = rng();
        for extreme in [false, true] {
            let scales: &[u8] = if extreme {
                &[0, 3, 127, 131, 253, 254]
            } else {
                &[0, 3, 120, 127, 131]
            };
            for &cols in MXFP4_COLS {
                mxfp4_kernels_match_twins(&mut r, cols, scales, extreme);
            }
        }
    }

    fn mxfp4_kernels_match_twins(r: &mut ChaCha8Rng, cols: usize, scales: &[u8], extreme: bool) {
        let (packed, s) = random_mxfp4(r, 2, cols, scales);
        let row = |i: usize| {
            (
                &packed[i * cols / 2..(i + 1) * cols / 2],
                &s[i * cols / 32..(i + 1) * cols / 32],
            )
        };
        let xs: Vec<Vec<f32>> = (0..6)
            .map(|_| {
                let mut x = full_inputs(r, cols);
                if !extreme {
                    // The edge values near the top of the f32 range, brought down to where no sum overflows.
                    x.iter_mut()
                        .filter(|v| v.abs() > 1e30)
                        .for_each(|v| *v *= 2f32.powi(-100));
                }
                x
            })
            .collect();
        let xp: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| mxfp4_contract::permute_input(x))
            .collect();
        let xq: Vec<Vec<u32>> = xs
            .iter()
            .map(|x| mxfp4_i16_contract::permute_input(x))
            .collect();
        assert_eq!(xp[0].len(), mxfp4_contract::chunks(cols) * CHUNK);
        let f32_want = |i: usize, t: usize| mxfp4_contract::dot_row_ref(row(i).0, row(i).1, &xp[t]);
        let i16_want =
            |i: usize, t: usize| mxfp4_i16_contract::dot_row_ref(row(i).0, row(i).1, &xq[t]);
        let check = |got: f32, want: f32, what: String| {
            if extreme {
                same_or_nan(got, want, &what);
            } else {
                assert!(want.is_finite(), "{what}: the reference gives {want}");
                same_bits(got, want, &what);
            }
        };
        let pair = neon::mxfp4_dot_rows::<2>([row(0), row(1)], &xp[0]);
        let pair_i16 = neon::mxfp4_i16_dot_rows::<2>([row(0), row(1)], &xq[0]);
        for i in 0..2 {
            check(
                pair[i],
                f32_want(i, 0),
                format!("f32 x2 cols {cols} row {i}"),
            );
            check(
                pair_i16[i],
                i16_want(i, 0),
                format!("i16 x2 cols {cols} row {i}"),
            );
        }
        let (mut multi, mut multi_i16) = ([f32::NAN; 6], [f32::NAN; 6]);
        neon::mxfp4_row_multi(row(1).0, row(1).1, &xp.concat(), xp[0].len(), &mut multi);
        neon::mxfp4_i16_row_multi(
            row(1).0,
            row(1).1,
            &xq.concat(),
            xq[0].len(),
            &mut multi_i16,
        );
        for t in 0..6 {
            check(
                multi[t],
                f32_want(1, t),
                format!("f32 multi cols {cols} input {t}"),
            );
            check(
                multi_i16[t],
                i16_want(1, t),
                format!("i16 multi cols {cols} input {t}"),
            );
        }
    }
}

/// `dot_f32_finish16` reduces up to sixteen products' accumulators at once with the bits of `dot_f32_finish` on each.
#[cfg(target_arch = "x86_64")]
#[test]
fn f32_finish16_matches_one_product_at_a_time() {
    use deltafin_quant::simd::avx512::{F32Acc, dot_f32_finish, dot_f32_finish16};
    if !avx512_cpu_or_skip() {
        return;
    }
    let mut r = rng();
    for count in 1..=16 {
        let accs: Vec<F32Acc> = (0..count)
            .map(|_| {
                // Values of very different sizes, so any other pairing of the additions shows in the bits.
                let v: Vec<f32> = (0..32)
                    .map(|i| r.random_range(-4.0f32..4.0) * [1.0, 1e-4, 3e3, 7e-8][i % 4])
                    .collect();
                // SAFETY: AVX-512F is present (checked above); `v` holds 32 f32.
                unsafe {
                    [
                        std::arch::x86_64::_mm512_loadu_ps(v.as_ptr()),
                        std::arch::x86_64::_mm512_loadu_ps(v.as_ptr().add(16)),
                    ]
                }
            })
            .collect();
        // SAFETY: AVX-512F present; at most 16 products; empty rows have no tail.
        let all = unsafe { dot_f32_finish16(&accs) };
        for (p, acc) in accs.iter().enumerate() {
            // SAFETY: as above.
            let one = unsafe { dot_f32_finish(acc, &[], &[]) };
            same_bits(all[p], one, &format!("product {p} of {count}"));
        }
    }
}
