//! Symmetric int16 quantisation of an input vector, shared by the int8 contract ([`crate::int8_contract`], a whole
//! row at once) and the int16-input MXFP4 contract ([`crate::mxfp4_i16_contract`], a group of 32 at a time).
//!
//! For a step `s` (the largest magnitude over [`Q_MAX`]): `q[i] = round(x[i] / s)`, nearest with ties away from
//! zero, clamped to ±[`Q_MAX`]. The division is IEEE f32 and the rounding exact, so the AVX-512 and AVX2 paths give
//! the same bits as the scalar reference: the tests compare each with it on random inputs, ties and extremes.
//!
//! An int8 product quantises its input once for all rows of a matrix, on one thread, while the other threads wait:
//! in the scalar loop (a division and a library call to `roundf` per value) that took about 15 µs for one of K3's
//! 7168-wide inputs, 2% of the time the int8 kernels take to stream a `[7168, 7168]` matrix from memory; AVX2 takes
//! 1.7 µs and AVX-512 0.9 (`examples/kernel_compute.rs`).

/// Largest magnitude of a quantised value.
pub const Q_MAX: f32 = 32767.0;

/// Quantises `x` into `q` (as long as `x`) with the step `s = max|x| / Q_MAX`, and returns `s` (`x ≈ s · q`). An
/// input with a NaN or an infinity gives NaN and an all-zero one 0; `q` is then all zero.
pub fn symmetric(x: &[f32], q: &mut [i16]) -> f32 {
    match abs_max(x) {
        Some(amax) if amax > 0.0 => {
            let step = amax / Q_MAX;
            quantise(x, step, q);
            step
        }
        other => {
            q.fill(0);
            other.map_or(f32::NAN, |_| 0.0)
        }
    }
}

/// The largest magnitude of `x` (0 for an empty or all-zero input), or `None` when a value is NaN or infinite.
pub fn abs_max(x: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F present.
        return unsafe { crate::simd::avx512::abs_max(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 present.
        return unsafe { crate::simd::avx2::abs_max(x) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::abs_max(x);
    }
    abs_max_ref(x)
}

/// Scalar reference of [`abs_max`].
pub fn abs_max_ref(x: &[f32]) -> Option<f32> {
    if x.iter().any(|v| !v.is_finite()) {
        return None;
    }
    Some(x.iter().fold(0.0f32, |m, v| m.max(v.abs())))
}

/// `q[i] = round(x[i] / step)`, ties away from zero, clamped to ±[`Q_MAX`], for `i < x.len()` (`q` is as long as
/// `x`). `step` is positive and finite, and so is every value of `x`.
pub fn quantise(x: &[f32], step: f32, q: &mut [i16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F present.
        return unsafe { crate::simd::avx512::quantise(x, step, q) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 present.
        return unsafe { crate::simd::avx2::quantise(x, step, q) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return crate::simd::neon::quantise(x, step, q);
    }
    quantise_ref(x, step, q);
}

/// Scalar reference of [`quantise`].
pub fn quantise_ref(x: &[f32], step: f32, q: &mut [i16]) {
    for (o, &v) in q.iter_mut().zip(x) {
        *o = quantise_one(v, step);
    }
}

/// One value of [`quantise_ref`].
#[inline]
pub fn quantise_one(v: f32, step: f32) -> i16 {
    (v / step).round().clamp(-Q_MAX, Q_MAX) as i16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values whose quotient by `step` is a tie, one ulp either side of one, or beyond the clamp.
    fn hard_values(step: f32) -> Vec<f32> {
        let mut v = Vec::new();
        for k in [
            0.5f32, 1.5, 2.5, 3.5, 100.5, 32766.5, 32767.0, 32767.5, 40000.0,
        ] {
            for sign in [1.0f32, -1.0] {
                let t = sign * k * step;
                v.extend([
                    t,
                    f32::from_bits(t.to_bits() + 1),
                    f32::from_bits(t.to_bits() - 1),
                ]);
            }
        }
        v.extend([0.0, -0.0, f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-45]);
        v
    }

    /// One way to find the largest magnitude and one to quantise.
    type Path = (
        &'static str,
        fn(&[f32]) -> Option<f32>,
        fn(&[f32], f32, &mut [i16]),
    );

    /// The dispatching functions and every SIMD twin this CPU can run, each on its own.
    fn paths() -> Vec<Path> {
        let mut paths: Vec<Path> = vec![("dispatch", abs_max, quantise)];
        #[cfg(target_arch = "x86_64")]
        {
            use crate::simd::{avx2, avx512};
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F detected.
                paths.push((
                    "avx512",
                    |x| unsafe { avx512::abs_max(x) },
                    |x, s, q| unsafe { avx512::quantise(x, s, q) },
                ));
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 detected.
                paths.push((
                    "avx2",
                    |x| unsafe { avx2::abs_max(x) },
                    |x, s, q| unsafe { avx2::quantise(x, s, q) },
                ));
            }
        }
        #[cfg(target_arch = "aarch64")]
        paths.push((
            "neon",
            crate::simd::neon::abs_max,
            crate::simd::neon::quantise,
        ));
        paths
    }

    #[test]
    fn simd_paths_give_the_reference_bits() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 7168] {
            let mut x: Vec<f32> = (0..len).map(|_| next() * 3.0).collect();
            let amax = abs_max_ref(&x).expect("finite");
            let step = if amax > 0.0 { amax / Q_MAX } else { 1.0 };
            let hard = hard_values(step);
            for (i, v) in x.iter_mut().enumerate().step_by(3) {
                *v = hard[i % hard.len()];
            }
            let mut want = vec![-7i16; len];
            quantise_ref(&x, step, &mut want);
            for (name, abs_max, quantise) in paths() {
                assert_eq!(abs_max(&x), abs_max_ref(&x), "{name}, len {len}");
                let mut got = vec![7i16; len];
                quantise(&x, step, &mut got);
                assert_eq!(got, want, "{name}, len {len}");
            }
        }
    }

    #[test]
    fn ties_go_away_from_zero_and_the_ends_clamp() {
        let x = [
            0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 32767.6, -40000.0, -0.0,
        ];
        for (name, _, quantise) in paths() {
            let mut q = [0i16; 9];
            quantise(&x, 1.0, &mut q);
            assert_eq!(q, [1, 2, 3, -1, -3, 0, 32767, -32767, 0], "{name}");
        }
    }

    #[test]
    fn symmetric_steps_and_clears_what_it_cannot_quantise() {
        let mut q = [5i16; 3];
        assert_eq!(symmetric(&[0.5, -2.0, 1.0], &mut q), 2.0 / Q_MAX);
        assert_eq!(q, [8192, -32767, 16384]);
        let mut q = [5i16; 2];
        assert_eq!(symmetric(&[0.0, -0.0], &mut q), 0.0);
        assert_eq!(q, [0, 0]);
        let mut q = [5i16; 2];
        assert!(symmetric(&[1.0, f32::NAN], &mut q).is_nan());
        assert_eq!(q, [0, 0]);
    }

    #[test]
    fn abs_max_refuses_non_finite_values_anywhere() {
        for (name, abs_max, _) in paths() {
            for len in [1usize, 8, 9, 16, 17, 40] {
                for at in [0, len / 2, len - 1] {
                    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                        let mut x = vec![0.25f32; len];
                        x[at] = bad;
                        assert_eq!(abs_max(&x), None, "{name}, len {len} at {at}");
                    }
                }
            }
            assert_eq!(abs_max(&[]), Some(0.0), "{name}");
            assert_eq!(abs_max(&[-3.0, 2.0, -0.0]), Some(3.0), "{name}");
        }
    }
}
