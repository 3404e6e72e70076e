//! The CUDA kernels against the scalar references (feature `cuda`; needs a GPU: run on the device machine, see
//! docs/PLATFORMS.md). Fresh random data for every check, extreme E8M0 scales included.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use deltafin_quant::cuda::moe::{self, ExpertPtrs, Glu, MoeKernel, MoeShape, SlotRef};
use deltafin_quant::cuda::{Gpu, device_address};
use deltafin_quant::{DenseData, DenseMatrix, Mxfp4Matrix, QuantError};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Allowed relative error against the f64 reference.
const REL_TOL: f64 = 1e-5;

/// Every kernel family is checked on the same data.
const KERNELS: [MoeKernel; 13] = [
    MoeKernel::Tensor,
    MoeKernel::GEMM,
    MoeKernel::FOLD,
    MoeKernel::Fold { tiles: 4 },
    MoeKernel::Wg {
        pairs: true,
        wide: false,
    },
    MoeKernel::Wg {
        pairs: false,
        wide: false,
    },
    MoeKernel::Wg {
        pairs: true,
        wide: true,
    },
    MoeKernel::Gemm {
        smem: false,
        tiles: 8,
    },
    MoeKernel::Gemm {
        smem: true,
        tiles: 8,
    },
    MoeKernel::Tiles,
    MoeKernel::TensorS4,
    MoeKernel::TensorNoHint,
    MoeKernel::Simt,
];

fn gpu() -> Arc<Gpu> {
    Gpu::shared().expect("a CUDA GPU (these tests run on the device machine)")
}

/// One expert's six tensors on the host (w1, w2, w3 packed and scales).
struct HostExpert {
    parts: [Vec<u8>; 6],
}

/// How an expert's E8M0 scale bytes are drawn.
#[derive(Clone, Copy, Debug)]
enum Scales {
    /// Around 2^0, some groups above the folded kernels' window (129, 130): their per-group fallbacks run.
    Normal,
    /// All within the folded kernels' window (104..=128, as trained weights are): their folded paths run.
    Folding,
    /// Spread over the whole E8M0 range without overflowing f32 products.
    Extreme,
}

fn scale(rng: &mut ChaCha8Rng, scales: Scales) -> u8 {
    match scales {
        Scales::Normal => rng.random_range(118u8..=130),
        Scales::Folding => rng.random_range(104u8..=128),
        Scales::Extreme => match rng.random_range(0u8..4) {
            0 => rng.random_range(0u8..=4),
            1 => rng.random_range(100u8..=150),
            2 => rng.random_range(200u8..=225),
            _ => 127,
        },
    }
}

fn host_expert(rng: &mut ChaCha8Rng, width: usize, inter: usize, scales: Scales) -> HostExpert {
    let mut packed = |n: usize| (0..n).map(|_| rng.random::<u8>()).collect::<Vec<u8>>();
    let (p1, p2, p3) = (
        packed(inter * width / 2),
        packed(width * inter / 2),
        packed(inter * width / 2),
    );
    let mut draw = |n: usize| (0..n).map(|_| scale(rng, scales)).collect::<Vec<u8>>();
    let (s1, s2, s3) = (
        draw(inter * width / 32),
        draw(width * inter / 32),
        draw(inter * width / 32),
    );
    HostExpert {
        parts: [p1, s1, p2, s2, p3, s3],
    }
}

struct DevExpert {
    bufs: Vec<cudarc::driver::CudaSlice<u8>>,
}

fn upload(gpu: &Gpu, e: &HostExpert) -> DevExpert {
    DevExpert {
        bufs: e
            .parts
            .iter()
            .map(|p| gpu.upload(p).expect("upload"))
            .collect(),
    }
}

fn ptrs(gpu: &Gpu, d: &DevExpert) -> ExpertPtrs {
    let a = |i: usize| device_address(gpu.stream(), &d.bufs[i]);
    ExpertPtrs {
        w1: a(0),
        s1: a(1),
        w2: a(2),
        s2: a(3),
        w3: a(4),
        s3: a(5),
    }
}

/// f64 reference of one MXFP4 row product: (value, Σ|w·x|).
fn row_ref(m: &Mxfp4Matrix<'_>, row: usize, x: &[f64], buf: &mut [f32]) -> (f64, f64) {
    m.dequantize_row_ref(row, buf);
    let mut s = 0.0;
    let mut a = 0.0;
    for (&w, &xv) in buf.iter().zip(x) {
        s += w as f64 * xv;
        a += (w as f64 * xv).abs();
    }
    (s, a)
}

fn situ(g: f64, u: f64) -> f64 {
    let a = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp());
    a * 25.0 * (u / 25.0).tanh()
}

/// Routing: every expert gets a random subset of the tokens (at least one).
fn routing(rng: &mut ChaCha8Rng, n_experts: usize, t_len: usize) -> Vec<Vec<usize>> {
    (0..n_experts)
        .map(|_| {
            let mut rows: Vec<usize> = (0..t_len).filter(|_| rng.random_bool(0.6)).collect();
            if rows.is_empty() {
                rows.push(rng.random_range(0..t_len));
            }
            rows
        })
        .collect()
}

/// Runs the kernels on `experts` with `routes` and returns (act, y) per pair, pairs in expert order.
fn run(
    gpu: &Gpu,
    shape: &MoeShape,
    experts: &[DevExpert],
    routes: &[Vec<usize>],
    x: &[f32],
    kernel: MoeKernel,
) -> (Vec<f32>, Vec<f32>) {
    let mut pair_row = Vec::new();
    let mut slots = Vec::new();
    for (e, rows) in experts.iter().zip(routes) {
        slots.push(SlotRef {
            ptrs: ptrs(gpu, e),
            pair0: pair_row.len(),
            n_rows: rows.len(),
        });
        pair_row.extend(rows.iter().map(|&r| r as i32));
    }
    let n = pair_row.len();
    let rows = gpu.upload(&pair_row).expect("upload");
    let xd = gpu.upload(x).expect("upload");
    // Poisoned outputs: every element must be written.
    let mut act = gpu
        .upload(&vec![f32::NAN; n * shape.inter])
        .expect("upload");
    let mut y = gpu
        .upload(&vec![f32::NAN; n * shape.width])
        .expect("upload");
    moe::run_experts_with(gpu, shape, &slots, &rows, &xd, &mut act, &mut y, kernel)
        .expect("kernels");
    (
        gpu.download(&act).expect("download"),
        gpu.download(&y).expect("download"),
    )
}

fn check_situ_experts(
    width: usize,
    inter: usize,
    n_experts: usize,
    t_len: usize,
    seed: u64,
    scales: Scales,
) {
    check_situ_routes(width, inter, n_experts, t_len, seed, scales, None);
}

/// As [`check_situ_experts`], with the tokens of each expert given (`routes`, one list an expert) instead of drawn.
fn check_situ_routes(
    width: usize,
    inter: usize,
    n_experts: usize,
    t_len: usize,
    seed: u64,
    scales: Scales,
    routes: Option<Vec<Vec<usize>>>,
) {
    let gpu = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let host: Vec<HostExpert> = (0..n_experts)
        .map(|_| host_expert(&mut rng, width, inter, scales))
        .collect();
    let dev: Vec<DevExpert> = host.iter().map(|h| upload(&gpu, h)).collect();
    let routes = routes.unwrap_or_else(|| routing(&mut rng, n_experts, t_len));
    let x: Vec<f32> = (0..t_len * width)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let shape = MoeShape {
        width,
        inter,
        glu: Glu::Situ {
            beta: 4.0,
            linear_beta: 25.0,
        },
    };
    let ys: Vec<Vec<f32>> = KERNELS
        .iter()
        .map(|&k| run(&gpu, &shape, &dev, &routes, &x, k).1)
        .collect();
    let mut pair = 0;
    let mut worst = [0.0f64; KERNELS.len()];
    let mut wbuf = vec![0.0f32; width.max(inter)];
    for (h, rows) in host.iter().zip(&routes) {
        let w1 = Mxfp4Matrix::new(&h.parts[0], &h.parts[1], inter, width).expect("w1");
        let w2 = Mxfp4Matrix::new(&h.parts[2], &h.parts[3], width, inter).expect("w2");
        let w3 = Mxfp4Matrix::new(&h.parts[4], &h.parts[5], inter, width).expect("w3");
        for &t in rows {
            let xt: Vec<f64> = x[t * width..(t + 1) * width]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let a: Vec<f64> = (0..inter)
                .map(|r| {
                    situ(
                        row_ref(&w1, r, &xt, &mut wbuf[..width]).0,
                        row_ref(&w3, r, &xt, &mut wbuf[..width]).0,
                    )
                })
                .collect();
            let reference: Vec<f64> = (0..width)
                .map(|r| row_ref(&w2, r, &a, &mut wbuf[..inter]).0)
                .collect();
            for (k, y) in ys.iter().enumerate() {
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for (r, &want) in reference.iter().enumerate() {
                    let got = y[pair * width + r] as f64;
                    assert!(
                        got.is_finite(),
                        "{:?}: pair {pair} row {r} not written",
                        KERNELS[k]
                    );
                    num += (got - want).powi(2);
                    den += want.powi(2);
                }
                worst[k] = worst[k].max((num / den.max(1e-300)).sqrt());
            }
            pair += 1;
        }
    }
    for (k, w) in KERNELS.iter().zip(worst) {
        eprintln!(
            "situ experts {n_experts}x[{inter}x{width}], T={t_len}, {scales:?} scales, {k:?}: worst ||y - ref|| / \
             ||ref|| = {w:.3e}"
        );
        assert!(w <= REL_TOL, "{k:?}: relative error {w}");
    }
}

#[test]
fn moe_matches_scalar_reference_small_shapes() {
    for (t_len, seed) in [(1, 1), (3, 2), (9, 3), (64, 4)] {
        check_situ_experts(96, 64, 5, t_len, seed, Scales::Normal);
    }
    // Widths the GEMM kernels take (multiples of 128): partial n-tiles, several 64-token tiles per expert.
    for (t_len, seed) in [(1, 5), (5, 6), (13, 7), (37, 8), (150, 9)] {
        check_situ_experts(256, 384, 4, t_len, seed, Scales::Normal);
    }
}

#[test]
fn moe_matches_scalar_reference_k3_shape() {
    check_situ_experts(3584, 3072, 3, 1, 11, Scales::Normal);
    check_situ_experts(3584, 3072, 2, 2, 13, Scales::Normal);
    check_situ_experts(3584, 3072, 2, 5, 12, Scales::Normal);
    check_situ_experts(3584, 3072, 2, 40, 14, Scales::Normal);
}

/// Scales a trained model has (all in the folding window), so the folded kernels' main paths run, the warpgroup
/// GEMM's included: partial token tiles, several per expert, rows past a block's end.
#[test]
fn moe_matches_scalar_reference_folding_scales() {
    for (t_len, seed) in [(37, 15), (150, 16)] {
        check_situ_experts(256, 384, 4, t_len, seed, Scales::Folding);
    }
    check_situ_experts(384, 640, 3, 70, 17, Scales::Folding);
    check_situ_experts(3584, 3072, 2, 40, 18, Scales::Folding);
    check_situ_experts(3584, 3072, 2, 64, 19, Scales::Folding);
}

/// Launches whose largest expert has 32 tokens (the wide warpgroup GEMM's 32-token tiles) and 33 (its 64-token
/// tiles), at scales in the folding window so that its main path runs: full and partial tiles, one-token experts.
#[test]
fn moe_matches_scalar_reference_at_the_wide_tile_boundary() {
    for (counts, seed) in [([32, 17, 1], 21), ([33, 32, 9], 22)] {
        check_situ_counts(&counts, 40, 3, seed);
    }
}

/// One launch whose experts fall on both sides of `moe::WG_MIN_ROWS`: on Hopper the default runs the larger ones on
/// the warpgroup GEMM and the others on the kernels their counts choose, in separate launches into one output.
#[test]
fn moe_matches_scalar_reference_with_experts_on_both_sides_of_the_warpgroup_threshold() {
    let counts = [80, 3, moe::WG_MIN_ROWS + 1, moe::WG_MIN_ROWS, 20, 1];
    check_situ_counts(&counts, 80, 7, 20);
}

/// [`check_situ_routes`] on 256×384 experts at folding scales, expert `e` taking `counts[e]` of `t_len` tokens: its
/// `i`-th is token `(i · stride + e) % t_len` (distinct while `stride` is coprime to `t_len` and a count at most it).
fn check_situ_counts(counts: &[usize], t_len: usize, stride: usize, seed: u64) {
    let routes: Vec<Vec<usize>> = counts
        .iter()
        .enumerate()
        .map(|(e, &n)| (0..n).map(|i| (i * stride + e) % t_len).collect())
        .collect();
    check_situ_routes(
        256,
        384,
        counts.len(),
        t_len,
        seed,
        Scales::Folding,
        Some(routes),
    );
}

/// Each MXFP4 product on its own (gate and up through the production kernel with the identity activation),
/// scales spread over the whole E8M0 range: every output within 1e-5 of Σ|w·x| of the f64 reference.
#[test]
fn mxfp4_products_match_reference_with_extreme_scales() {
    let gpu = gpu();
    for (width, inter, t_len, seed) in [
        (96, 64, 7, 21),
        (160, 96, 1, 24),
        (3584, 3072, 1, 23),
        (3584, 3072, 2, 22),
        (256, 128, 37, 25),
        (3584, 3072, 11, 26),
    ] {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n_experts = 2;
        let host: Vec<HostExpert> = (0..n_experts)
            .map(|_| host_expert(&mut rng, width, inter, Scales::Extreme))
            .collect();
        let dev: Vec<DevExpert> = host.iter().map(|h| upload(&gpu, h)).collect();
        let routes = routing(&mut rng, n_experts, t_len);
        // Each token at its own magnitude, 1e-6 .. 1e3 (the tensor-core kernels scale every token by a power
        // of two before splitting it into fp16 halves).
        let x: Vec<f32> = (0..t_len * width)
            .map(|i| {
                let t = (i / width) as u64;
                let mag = 10f32.powi(((t * 7 + seed) % 10) as i32 - 6);
                rng.random_range(-1.0f32..1.0) * mag
            })
            .collect();
        let mut wbuf = vec![0.0f32; width];
        for (kernel, glu, part) in KERNELS
            .iter()
            .flat_map(|&k| [(Glu::GateOnly, 0usize), (Glu::UpOnly, 4)].map(|(g, p)| (k, g, p)))
        {
            let shape = MoeShape { width, inter, glu };
            let (act, _) = run(&gpu, &shape, &dev, &routes, &x, kernel);
            let mut pair = 0;
            let mut worst = 0.0f64;
            let mut tiny = 0usize;
            for (h, rows) in host.iter().zip(&routes) {
                let m = Mxfp4Matrix::new(&h.parts[part], &h.parts[part + 1], inter, width)
                    .expect("matrix");
                for &t in rows {
                    let xt: Vec<f64> = x[t * width..(t + 1) * width]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    for r in 0..inter {
                        let (reference, mag) = row_ref(&m, r, &xt, &mut wbuf);
                        let got = act[pair * inter + r] as f64;
                        let err = (got - reference).abs() / mag.max(1e-300);
                        assert!(
                            err <= REL_TOL || (got - reference).abs() < 1e-37,
                            "{kernel:?} {glu:?} {width}: pair {pair} row {r}: {got} vs {reference} (|w·x| {mag})"
                        );
                        // Rows whose whole product is subnormal pass on the absolute bound; the worst relative
                        // error is reported over the others.
                        if (got - reference).abs() >= 1e-37 {
                            worst = worst.max(err);
                        } else {
                            tiny += 1;
                        }
                    }
                    pair += 1;
                }
            }
            eprintln!(
                "{kernel:?} {glu:?} [{inter}x{width}] T={t_len} extreme scales: worst |Δ| / Σ|w·x| = {worst:.3e} \
                 ({tiny} outputs within 1e-37 absolute)"
            );
        }
    }
}

/// Every column split (`DeviceMatrix::set_split`) against the CPU's reference, for rows that do not fill a block,
/// columns that do not fill a part and token counts around the kernel's tile.
#[test]
fn dense_gemm_matches_cpu() {
    use deltafin_quant::cuda::dense::{DeviceMatrix, SPLITS};
    let gpu = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for (rows, cols, t_len) in [(100, 64, 1), (257, 1024, 9), (3, 96, 64), (40, 2056, 3)] {
        let f32s: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let bf16s: Vec<u16> = f32s.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        for data in [DenseData::F32(f32s.clone()), DenseData::Bf16(bf16s.into())] {
            let m = DenseMatrix::new(rows, cols, data).expect("matrix");
            let mut dev = DeviceMatrix::upload(&gpu, &m)
                .expect("upload")
                .expect("a shape the kernel takes");
            let x: Vec<f32> = (0..t_len * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let reference = m.gemm_ref(&x, t_len).expect("cpu");
            for split in SPLITS {
                dev.set_split(Some(split)).expect("split");
                let got = dev.gemm(&x, t_len).expect("gpu");
                assert_eq!(got.len(), reference.len());
                for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                    let row = i % rows;
                    let mag: f32 = (0..cols)
                        .map(|c| (m.row_f32(row)[c] * x[(i / rows) * cols + c]).abs())
                        .sum();
                    assert!(
                        (g - r).abs() <= 1e-5 * mag,
                        "{rows}x{cols} T={t_len} split {split} out {i}: {g} vs {r}"
                    );
                }
            }
        }
    }
    assert!(
        DeviceMatrix::upload(
            &gpu,
            &DenseMatrix::new(2, 8, DenseData::F32(vec![0.0; 16])).expect("m")
        )
        .expect("upload")
        .expect("shape")
        .set_split(Some(3))
        .is_err()
    );
}

/// Row-wise int8 matrices stay int8 on the device and give the CPU's int8 contract bits (`gemm_ref`: inputs
/// quantised to int16, exact integer sums, scales in f64) at every column split: rows that do not fill a block, rows
/// of part-filled warps, rows long enough for the kernel's 32-bit sums to be flushed (and, with every weight -128
/// against inputs at the int16 limit, as large as those sums can get between flushes), token counts around the
/// kernel's tile, K3's widest shape, and input rows that are zero or hold a NaN. An int8 matrix whose rows are not
/// whole 16-byte words goes up as f32.
#[test]
fn dense_int8_gemm_is_the_cpu_contract() {
    use deltafin_quant::cuda::dense::{DeviceMatrix, SPLITS};
    let gpu = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let shapes = [
        (100, 64, 1),
        (257, 1024, 9),
        (3, 96, 64),
        (40, 2064, 3),
        (7, 33792, 5),
        (12288, 7168, 2),
    ];
    for (case, &(rows, cols, t_len)) in shapes.iter().enumerate() {
        // The long rows' first case takes the largest sums; the others random weights and scales.
        let extreme = cols == 33792;
        let q: Vec<i8> = (0..rows * cols)
            .map(|_| {
                if extreme {
                    -128
                } else {
                    rng.random_range(-128i32..=127) as i8
                }
            })
            .collect();
        let scales: Vec<f32> = (0..rows).map(|_| rng.random_range(1e-4f32..1e-1)).collect();
        let m = DenseMatrix::new(
            rows,
            cols,
            DenseData::Int8 {
                q: q.into(),
                scales,
            },
        )
        .expect("matrix");
        let mut dev = DeviceMatrix::upload(&gpu, &m)
            .expect("upload")
            .expect("a shape the kernel takes");
        assert!(dev.is_int8(), "{rows}x{cols} stays int8");
        assert!(
            dev.values_for_kernel().is_err(),
            "no float view of int8 values"
        );
        let mut x: Vec<f32> = (0..t_len * cols)
            .map(|i| match extreme {
                true => 1.0 + (i % 3) as f32 * 1e-3,
                false => rng.random_range(-1.0f32..1.0) * if i % 97 == 0 { 1e3 } else { 1.0 },
            })
            .collect();
        if t_len >= 3 && !extreme {
            // A zero row and a row with a NaN.
            x[..cols].fill(0.0);
            x[2 * cols + case] = f32::NAN;
        }
        let reference = m.gemm_ref(&x, t_len).expect("cpu");
        // Bits, with every NaN as one value (the GPU's NaN payloads are its own).
        let bits = |v: &[f32]| {
            v.iter()
                .map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() })
                .collect::<Vec<_>>()
        };
        for split in SPLITS {
            dev.set_split(Some(split)).expect("split");
            let got = dev.gemm(&x, t_len).expect("gpu");
            assert_eq!(
                bits(&got),
                bits(&reference),
                "{rows}x{cols} T={t_len} split {split}: not the CPU's bits"
            );
        }
        if t_len >= 3 && !extreme {
            assert!(reference[..rows].iter().all(|&v| v == 0.0));
            assert!(reference[2 * rows..3 * rows].iter().all(|v| v.is_nan()));
        }
    }
    let m = DenseMatrix::new(2, 40, DenseData::F32(vec![0.5; 80]))
        .expect("m")
        .to_int8();
    let dev = DeviceMatrix::upload(&gpu, &m)
        .expect("upload")
        .expect("shape");
    assert!(!dev.is_int8(), "40 columns are not whole words of int8");
    let got = dev.gemm(&[1.0; 40], 1).expect("gpu");
    assert!(got.iter().all(|&v| (v - 20.0).abs() < 1e-4), "{got:?}");
}

/// A launch splits its columns only while it makes fewer than two waves of blocks (at one token, only past one
/// wave), and no part gets fewer than two warp steps of a row.
#[test]
fn dense_launch_split_by_size() {
    use deltafin_quant::cuda::dense::launch_split;
    // An H200 holds 132 SMs x 2 blocks; K3's rows are 896 words (7168 bf16) or 1536 (12288).
    assert_eq!(launch_split(384, 896, 1, 264), 2);
    assert_eq!(launch_split(384, 896, 3, 264), 2);
    assert_eq!(launch_split(224, 1536, 1, 264), 1);
    assert_eq!(launch_split(224, 1536, 3, 264), 4);
    assert_eq!(launch_split(1536, 896, 3, 264), 1);
    assert_eq!(launch_split(576, 192, 3, 264), 1);
    assert_eq!(launch_split(2, 256, 2, 264), 2);
    assert_eq!(launch_split(2, 100, 2, 264), 1);
}

/// Several matrices in one launch (`gemm_many_device`; f32, bf16 or int8) give the one-matrix kernel's bits, for
/// row counts that do not fill a block, token counts below, at and above the kernel's token tile and matrices of
/// different column splits; a mix of kinds falls back to one launch each.
#[test]
fn dense_gemm_many_matches_one_at_a_time() {
    use deltafin_quant::cuda::dense::{DeviceMatrix, SPLITS};
    let gpu = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let cols = 512;
    for t_len in [1, 3, 8, 11] {
        for kind in ["f32", "bf16", "int8"] {
            let devs: Vec<DeviceMatrix> = [100usize, 33, 257, 1, 64]
                .iter()
                .enumerate()
                .map(|(j, &rows)| {
                    let vals: Vec<f32> = (0..rows * cols)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect();
                    let f32s = DenseMatrix::new(rows, cols, DenseData::F32(vals.clone()));
                    // The last matrix is f32 in the mixed cases, so that the call must fall back.
                    let m = match kind {
                        "bf16" if j < 4 => DenseMatrix::new(
                            rows,
                            cols,
                            DenseData::Bf16(
                                vals.iter()
                                    .map(|v| (v.to_bits() >> 16) as u16)
                                    .collect::<Vec<_>>()
                                    .into(),
                            ),
                        ),
                        "int8" if j < 4 => f32s.map(|m| m.to_int8()),
                        _ => f32s,
                    }
                    .expect("matrix");
                    let mut d = DeviceMatrix::upload(&gpu, &m)
                        .expect("upload")
                        .expect("shape");
                    d.set_split(Some(SPLITS[j % SPLITS.len()])).expect("split");
                    d
                })
                .collect();
            let devs: Vec<&DeviceMatrix> = devs.iter().collect();
            let x: Vec<f32> = (0..t_len * cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let xd = gpu.upload(&x).expect("x");
            for group in [&devs[..4], &devs[..]] {
                let mut ys: Vec<_> = group
                    .iter()
                    .map(|m| gpu.zeros::<f32>(t_len * m.rows()).expect("y"))
                    .collect();
                let mut refs: Vec<&mut _> = ys.iter_mut().collect();
                DeviceMatrix::gemm_many_device(group, &xd, t_len, &mut refs).expect("many");
                for (m, y) in group.iter().zip(&ys) {
                    let mut one = gpu.zeros::<f32>(t_len * m.rows()).expect("y");
                    m.gemm_device(&xd, t_len, &mut one).expect("one");
                    let (a, b) = (gpu.download(y).expect("a"), gpu.download(&one).expect("b"));
                    assert!(
                        a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{}x{cols} T={t_len} {kind} split {}: one launch differs from one a matrix",
                        m.rows(),
                        m.split(t_len)
                    );
                }
            }
        }
    }
}

/// Row copies through the pinned buffers: several uploads and downloads queued before one wait, the buffers
/// grown past their first size in the middle, every value back where it belongs; reading before the wait fails.
#[test]
fn row_copies_round_trip() {
    let gpu = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let sizes = [7usize, 1000, 70_000, 3, 200_000];
    let srcs: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect();
    let mut devs: Vec<_> = sizes
        .iter()
        .map(|&n| gpu.zeros::<f32>(n + 5).expect("buffer"))
        .collect();
    let mut rows = gpu.row_copies();
    let mut ranges = Vec::new();
    for (src, dev) in srcs.iter().zip(devs.iter_mut()) {
        rows.upload(src, dev).expect("upload");
        ranges.push(rows.download(&dev.slice(0..src.len())).expect("download"));
    }
    assert!(
        rows.downloaded(ranges[0].clone()).is_err(),
        "read before the wait"
    );
    rows.synchronize().expect("wait");
    for (src, r) in srcs.iter().zip(ranges) {
        assert_eq!(rows.downloaded(r).expect("values"), src.as_slice());
    }
}

/// The feature build reports a missing GPU clearly instead of failing obscurely; here a GPU must be usable.
#[test]
fn device_is_usable_or_clearly_unavailable() {
    match Gpu::shared() {
        Ok(g) => assert!(!g.name().is_empty()),
        Err(QuantError::CudaUnavailable(msg)) => panic!("CUDA is unavailable: {msg}"),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// The compiled kernels are kept per architecture: the first open compiles and stores them, the next loads them
/// (and they run), and a damaged entry is compiled again and replaced rather than loaded.
#[test]
fn kernels_are_compiled_once_and_cached() {
    use deltafin_quant::cuda::copy_rate::copy_times;
    let dir = std::env::temp_dir().join(format!("deltafin-kernels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let entries = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&dir)
            .expect("the cache directory")
            .map(|e| e.expect("entry").path())
            .collect()
    };
    let first = Gpu::open(0, Some(&dir)).expect("open, compiling");
    let k = first.kernel_init();
    assert!(!k.from_cache && k.compile_secs > 0.0, "{k:?}");
    let files = entries();
    assert_eq!(files.len(), 1, "one entry: {files:?}");
    assert!(files[0].extension().is_some_and(|e| e == "cubin"));
    let second = Gpu::open(0, Some(&dir)).expect("open from the cache");
    let k2 = second.kernel_init();
    assert!(k2.from_cache && k2.compile_secs == 0.0, "{k2:?}");
    eprintln!(
        "kernels: compile {:.2} s + load {:.3} s; from the cache: load {:.3} s",
        k.compile_secs, k.load_secs, k2.load_secs
    );
    assert!(
        copy_times(&second, 1 << 20, 2)
            .expect("a cached kernel runs")
            .kernel_us
            > 0.0
    );
    let mut bytes = std::fs::read(&files[0]).expect("read the entry");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&files[0], &bytes).expect("damage the entry");
    let third = Gpu::open(0, Some(&dir)).expect("open past a damaged entry");
    assert!(
        !third.kernel_init().from_cache,
        "a damaged entry is not loaded"
    );
    assert_ne!(
        std::fs::read(&files[0]).expect("reread"),
        bytes,
        "and it is replaced"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// The copy-rate probes benchmarks are held against: the size is rounded down to whole 16-byte words, both copies are
/// timed, the rates are plausible memory and link rates, and a copy under one word (or of no bytes) is refused.
#[test]
fn copy_rate_probe_copies_and_refuses_empty_copies() {
    use deltafin_quant::cuda::copy_rate::{copy_rate, copy_times, pinned_upload_rate};
    let gpu = gpu();
    let t = copy_times(&gpu, (64 << 20) + 7, 5).expect("copy times");
    assert_eq!(t.bytes, 64 << 20, "rounded down to whole 16-byte words");
    assert!(t.kernel_us > 0.0 && t.memcpy_us > 0.0, "{t:?}");
    let rate = t.rate();
    // Between 10 GB/s and 100 TB/s: a timer in the wrong unit or an empty copy would land outside.
    assert!((1e10..1e14).contains(&rate), "copy rate {rate} B/s");
    assert!(copy_rate(1 << 20, 3).expect("copy rate") > 1e10);
    assert!(matches!(copy_times(&gpu, 15, 1), Err(QuantError::Cuda(_))));
    // The link: between 1 GB/s and 1 TB/s (PCIe and NVLink-C2C hosts alike); nothing to copy is refused.
    let link = pinned_upload_rate(&gpu, 16 << 20, 3).expect("upload rate");
    assert!((1e9..1e12).contains(&link), "upload rate {link} B/s");
    assert!(matches!(
        pinned_upload_rate(&gpu, 0, 1),
        Err(QuantError::Cuda(_))
    ));
}

/// A host range page-locked in place: `is_pinned` answers for ranges inside it only, a copy out of it lands intact
/// on the device, and after `unpin_host` it is ordinary memory again.
#[test]
fn pinned_host_ranges_upload_in_place() {
    let gpu = gpu();
    let len = 4 << 20;
    // SAFETY: a fresh private anonymous mapping, unmapped at the end of the test and used only here.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the mapping is `len` bytes, readable and writable, and nothing else refers to it.
    let bytes = unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i * 7 + i / 4099) as u8;
    }
    let before = gpu.pinned_bytes();
    // SAFETY: the mapping stays until after `unpin_host` below, and overlaps nothing registered.
    unsafe { gpu.pin_host(base as usize, len) }.expect("pin");
    assert_eq!(gpu.pinned_bytes() - before, len as u64);
    assert!(gpu.is_pinned(&bytes[..]) && gpu.is_pinned(&bytes[12_345..3 << 20]));
    let outside = vec![0u8; 64];
    assert!(!gpu.is_pinned(&outside));
    let src = &bytes[4097..4097 + (3 << 20)];
    let mut dev = gpu.zeros::<u8>(src.len()).expect("device buffer");
    gpu.copy_stream().memcpy_htod(src, &mut dev).expect("copy");
    gpu.copy_stream().synchronize().expect("wait");
    assert!(gpu.download(&dev).expect("download") == src, "bytes differ");
    gpu.unpin_host(base as usize).expect("unpin");
    assert!(!gpu.is_pinned(&bytes[..]));
    gpu.unpin_host(base as usize)
        .expect("unpinning twice does nothing");
    // SAFETY: pinning nothing is refused before any memory is touched.
    assert!(unsafe { gpu.pin_host(base as usize, 0) }.is_err());
    // SAFETY: the mapping made above, no longer registered or referred to.
    unsafe { libc::munmap(base, len) };
}
