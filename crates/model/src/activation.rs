//! The gated activations over many values at once. `exp`, `σ` and `tanh` are written branch-free in f32 (a range
//! reduction and a polynomial, selects instead of branches), so the compiler turns a slice's loop into vector code;
//! an AVX-512 or AVX2 build of the same loop is picked at run time. They use only IEEE additions, multiplications,
//! fused multiply-adds (one rounding: the polynomials and the range reduction in half the instructions of a multiply
//! and an add) and divisions, so the result is the same bits on every machine and vector width (an x86-64 CPU without
//! FMA computes `mul_add` with libm's exactly rounded `fmaf`, slowly). The plain twin is
//! [`crate::ops::glu`] with libm's `exp` and `tanh`; this path stays within 1e-6 relative of it (tests below),
//! where libm's scalar calls cost about 50 ns a value: a second or more of CPU time per layer of a long prompt.
//! KDA's short-conv SiLU uses [`silu_in_place`] the same way (twin: [`crate::ops::silu`]).

use crate::config::Activation;

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split into a part with trailing zero bits (so `n · LN2_HI` is exact for the `n` that occur) and the rest.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Added and subtracted to round to the nearest integer (1.5 · 2²³); the low bits of the sum hold that integer.
const ROUNDER: f32 = 12_582_912.0;
/// `exp(r)` on `[-ln2/2, ln2/2]`, highest degree first: a Chebyshev fit, absolute error 2e-9 (the literals are the
/// nearest f32 values).
const EXP_POLY: [f32; 7] = [
    0.001_394_110_8,
    0.008_375_126,
    0.041_666_35,
    0.166_664_15,
    0.5,
    1.000_000_037_72,
    1.0,
];
/// `tanh(y) / y` as a polynomial in `y²` for `|y| ≤ TANH_POLY_MAX`, highest degree first: a Chebyshev fit,
/// absolute error 4e-9.
const TANH_POLY: [f32; 6] = [
    -0.005_657_135,
    0.020_588_191,
    -0.053_720_11,
    0.133_311_14,
    -0.333_332_6,
    0.999_999_996_022_721_7,
];
/// Where `tanh` switches from its polynomial to `1 - 2 / (e^{2|y|} + 1)`, which loses no accuracy above it.
const TANH_POLY_MAX: f32 = 0.625;
/// The range `exp` is clamped to: every result a normal float (no slow subnormal arithmetic), and 2ⁿ built from
/// bits for `n` in `-126 ..= 127`. `clamp` leaves NaN as it is.
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;

/// `c[0]·xⁿ + … + c[n]` by Horner's rule, a fused multiply-add a step.
#[inline(always)]
fn horner<const N: usize>(c: &[f32; N], x: f32) -> f32 {
    let mut p = c[0];
    for &k in &c[1..] {
        p = p.mul_add(x, k);
    }
    p
}

/// `eˣ` within a few units in the last place for `x` in `[EXP_MIN, EXP_MAX]`, clamped outside; NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let t = x.mul_add(LOG2E, ROUNDER);
    let n = t - ROUNDER;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let k = (t.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    horner(&EXP_POLY, r) * f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

/// `1 / (1 + e⁻ˣ)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `tanh(y)`: an odd polynomial near 0, `1 - 2 / (e^{2|y|} + 1)` with `y`'s sign elsewhere.
#[inline(always)]
pub fn tanh(y: f32) -> f32 {
    let a = y.abs();
    let near = y * horner(&TANH_POLY, y * y);
    let far = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(y);
    if a <= TANH_POLY_MAX { near } else { far }
}

/// `fn $name(args) { $body(args) }` on the widest vectors the CPU has: an AVX-512 or an AVX2 build of `$body` (an
/// `#[inline(always)]` loop, so each build compiles it for its own vectors; AVX2's eight lanes instead of the
/// baseline's four), chosen at run time by `deltafin_quant::simd`, else the baseline build.
macro_rules! on_widest_vectors {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) => $body:ident) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) {
            /// The body built for AVX-512.
            ///
            /// # Safety
            /// The CPU must support AVX-512F.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) {
                $body($($arg),*)
            }
            /// The body built for AVX2 and FMA.
            ///
            /// # Safety
            /// The CPU must support AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if deltafin_quant::simd::has_avx512() {
                // SAFETY: AVX-512F is present.
                return unsafe { avx512($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if deltafin_quant::simd::has_avx2_fma() {
                // SAFETY: AVX2 and FMA are present.
                return unsafe { avx2($($arg),*) };
            }
            $body($($arg),*)
        }
    };
}

/// `act(gate, up)` as [`crate::ops::glu`] defines it, with the functions above.
#[inline(always)]
fn glu_one(act: Activation, gate: f32, up: f32) -> f32 {
    match act {
        Activation::Situ { beta, linear_beta } => {
            let a = beta * tanh(gate / beta) * sigmoid(gate);
            let b = linear_beta * tanh(up / linear_beta);
            a * b
        }
        Activation::Silu => gate * sigmoid(gate) * up,
    }
}

/// `gate[i] ← act(gate[i], up[i])` for every `i` (the shorter length).
#[inline(always)]
fn glu_loop(act: Activation, gate: &mut [f32], up: &[f32]) {
    // The match outside the loop, so each loop body is one straight line of arithmetic.
    match act {
        Activation::Situ { .. } => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = glu_one(act, *g, u);
            }
        }
        Activation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = glu_one(Activation::Silu, *g, u);
            }
        }
    }
}

on_widest_vectors! {
    /// `gate[i] ← act(gate[i], up[i])` on this thread, vectorised.
    pub fn glu_in_place(act: Activation, gate: &mut [f32], up: &[f32]) => glu_loop
}

/// `x[i] ← x[i] σ(x[i])` (SiLU) for every `i`.
#[inline(always)]
fn silu_loop(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v *= sigmoid(*v);
    }
}

on_widest_vectors! {
    /// `x[i] ← SiLU(x[i])` on this thread, vectorised (the plain twin: [`crate::ops::silu`]).
    pub fn silu_in_place(x: &mut [f32]) => silu_loop
}

/// `x[i] ← x[i] σ(g[i])` for every `i` (the shorter length).
#[inline(always)]
fn gate_loop(x: &mut [f32], g: &[f32]) {
    for (v, &g) in x.iter_mut().zip(g) {
        *v *= sigmoid(g);
    }
}

on_widest_vectors! {
    /// `x[i] ← x[i] σ(g[i])` (an output gate) on this thread, vectorised, with this module's [`sigmoid`].
    pub fn gate_in_place(x: &mut [f32], g: &[f32]) => gate_loop
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops;

    /// Values across the range that matters and beyond, with the switch points and specials.
    fn sweep() -> Vec<f32> {
        let mut v: Vec<f32> = (-400_000..=400_000).map(|i| i as f32 * 2.5e-4).collect();
        v.extend((-300..=300).map(|i| i as f32 * 0.37));
        v.extend([
            0.0, -0.0, 2.5, -2.5, 1e-30, -1e-30, 1e-8, 87.0, -87.0, 88.0, -88.0, 200.0, -200.0,
        ]);
        v
    }

    /// `|a - b| ≤ rel · |b|` (or both tiny), failing on NaN.
    fn close(a: f32, b: f32, rel: f32) -> bool {
        (a - b).abs() <= rel * b.abs() || (a.abs() < 1e-30 && b.abs() < 1e-30)
    }

    #[test]
    fn functions_match_libm() {
        for &x in &sweep() {
            let want = x.exp();
            if (-87.0..=88.0).contains(&x) {
                assert!(close(exp(x), want, 5e-7), "exp({x}) = {} vs {want}", exp(x));
            }
            assert!(close(sigmoid(x), ops::sigmoid(x), 5e-7), "sigmoid({x})");
            assert!(
                close(tanh(x), x.tanh(), 5e-7),
                "tanh({x}) = {} vs {}",
                tanh(x),
                x.tanh()
            );
        }
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
        assert_eq!(
            (sigmoid(f32::INFINITY), sigmoid(-200.0) < 1e-37),
            (1.0, true)
        );
        assert!(exp(f32::NAN).is_nan() && sigmoid(f32::NAN).is_nan() && tanh(f32::NAN).is_nan());
    }

    #[test]
    fn glu_matches_its_plain_twin() {
        let xs = sweep();
        for act in [
            Activation::Situ {
                beta: 4.0,
                linear_beta: 25.0,
            },
            Activation::Silu,
        ] {
            // Every gate against a few ups, and every up against a few gates.
            let pairs: Vec<(f32, f32)> = xs
                .iter()
                .enumerate()
                .flat_map(|(i, &x)| {
                    [
                        (x, xs[(i * 7919) % xs.len()]),
                        (xs[(i * 104_729) % xs.len()], x),
                    ]
                })
                .collect();
            let (mut gate, up): (Vec<f32>, Vec<f32>) = pairs.iter().copied().unzip();
            let mut portable = gate.clone();
            glu_in_place(act, &mut gate, &up);
            glu_loop(act, &mut portable, &up);
            for (i, &(g, u)) in pairs.iter().enumerate() {
                let want = ops::glu(act, g, u);
                assert!(
                    close(gate[i], want, 1e-6),
                    "{act:?} ({g}, {u}): {} vs {want}",
                    gate[i]
                );
                // The vector build and the portable one give the same bits.
                assert_eq!(gate[i].to_bits(), portable[i].to_bits(), "({g}, {u})");
            }
            let mut nan = [f32::NAN, 1.0];
            glu_in_place(act, &mut nan, &[1.0, f32::NAN]);
            assert!(nan[0].is_nan() && nan[1].is_nan());
        }
    }

    #[test]
    fn silu_matches_its_plain_twin() {
        let xs = sweep();
        let mut fast = xs.clone();
        let mut portable = xs.clone();
        silu_in_place(&mut fast);
        silu_loop(&mut portable);
        for (i, &x) in xs.iter().enumerate() {
            let want = ops::silu(x);
            assert!(
                close(fast[i], want, 1e-6),
                "silu({x}) = {} vs {want}",
                fast[i]
            );
            assert_eq!(fast[i].to_bits(), portable[i].to_bits(), "silu({x})");
        }
        let mut nan = [f32::NAN];
        silu_in_place(&mut nan);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn gate_matches_its_plain_twin() {
        let gs = sweep();
        let xs: Vec<f32> = (0..gs.len())
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        let mut fast = xs.clone();
        let mut portable = xs.clone();
        gate_in_place(&mut fast, &gs);
        gate_loop(&mut portable, &gs);
        for (i, (&x, &g)) in xs.iter().zip(&gs).enumerate() {
            let want = x * ops::sigmoid(g);
            assert!(
                close(fast[i], want, 1e-6),
                "{x} σ({g}) = {} vs {want}",
                fast[i]
            );
            assert_eq!(fast[i].to_bits(), portable[i].to_bits(), "{x} σ({g})");
        }
        let mut nan = [1.0];
        gate_in_place(&mut nan, &[f32::NAN]);
        assert!(nan[0].is_nan());
    }
}
