//! The f32 FMA peak that compute-bound kernels (prefill's multi-token products) are held against: a register-only
//! loop of independent fused multiply-adds on every thread, in the same process and minute as the measurement it
//! bounds.

use std::time::Instant;

use rayon::prelude::*;

/// Independent accumulators per thread: enough to cover the FMA latency on two FMA pipes.
const CHAINS: usize = 12;

/// f32 FLOP per second (an FMA counts two) that every thread of rayon's pool reaches together in a register-only FMA
/// loop of `iterations` steps (each step one FMA per chain, on the widest vectors the CPU has).
pub fn fma_peak(iterations: usize) -> f64 {
    let threads = rayon::current_num_threads().max(1);
    let started = Instant::now();
    let flops: f64 = (0..threads)
        .into_par_iter()
        .map(|t| fma_loop(iterations, t as f32))
        .sum();
    flops / started.elapsed().as_secs_f64()
}

/// The best of `probes` readings of [`fma_peak`]: on a shared machine one probe can read a third low while the work it
/// bounds runs at full speed, which would make a compute bound look easier to meet than it is.
pub fn best_fma_peak(probes: usize, iterations: usize) -> f64 {
    (0..probes.max(1))
        .map(|_| fma_peak(iterations))
        .fold(0.0, f64::max)
}

/// One thread's loop; returns the FLOP it did.
fn fma_loop(iterations: usize, seed: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F present.
        return unsafe { fma_loop_avx512(iterations, seed) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2 and FMA present.
        return unsafe { fma_loop_avx2(iterations, seed) };
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        return fma_loop_neon(iterations, seed);
    }
    let mut acc = [seed; CHAINS];
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    (iterations * CHAINS * 2) as f64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_loop_avx512(iterations: usize, seed: f32) -> f64 {
    use std::arch::x86_64::*;
    let (m, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(seed); CHAINS];
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, m, b);
        }
    }
    std::hint::black_box(acc);
    (iterations * CHAINS * 16 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop_avx2(iterations: usize, seed: f32) -> f64 {
    use std::arch::x86_64::*;
    let (m, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, m, b);
        }
    }
    std::hint::black_box(acc);
    (iterations * CHAINS * 8 * 2) as f64
}

#[cfg(target_arch = "aarch64")]
fn fma_loop_neon(iterations: usize, seed: f32) -> f64 {
    use std::arch::aarch64::*;
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        let (m, b) = (vdupq_n_f32(0.999_999), vdupq_n_f32(1e-7));
        let mut acc = [vdupq_n_f32(seed); CHAINS];
        for _ in 0..iterations {
            for a in acc.iter_mut() {
                *a = vfmaq_f32(b, *a, m);
            }
        }
        std::hint::black_box(acc);
    }
    (iterations * CHAINS * 4 * 2) as f64
}

#[cfg(test)]
mod tests {
    /// The rate depends on the machine (under qemu user-mode emulation, in a debug build beside other tests, it is
    /// tens of MFLOP/s), so the test holds what does not: a finite positive rate, and a FLOP count that grows with
    /// the iterations as the loop's width says.
    #[test]
    fn a_peak_is_measured() {
        let peak = super::fma_peak(20_000);
        eprintln!("peak {peak:.3e}");
        assert!(peak.is_finite() && peak > 0.0, "peak {peak}");
        // Zero probes still take one reading.
        for probes in [0, 3] {
            let best = super::best_fma_peak(probes, 20_000);
            assert!(best.is_finite() && best > 0.0, "best of {probes}: {best}");
        }
        let (one, two) = (super::fma_loop(1_000, 1.0), super::fma_loop(2_000, 1.0));
        assert_eq!(two, 2.0 * one);
        let lanes = one / (1_000 * super::CHAINS * 2) as f64;
        assert!([1.0, 4.0, 8.0, 16.0].contains(&lanes), "{lanes} lanes");
    }
}
