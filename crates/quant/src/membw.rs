//! The memory read bound kernels are held against: an all-core read of a buffer far larger than the caches, in the
//! same process and minute as the measurement it bounds (this project's machines change speed from minute to
//! minute).

use std::time::Instant;

use rayon::prelude::*;

use crate::pages::huge_page_vec;

/// The wrapping sum of `words`, plain Rust (the compiler's baseline vectorisation).
pub fn sum_portable(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// The wrapping sum of `words` with 64-byte loads into four accumulators and a prefetch 24 KiB ahead, where the
/// CPU has AVX-512; the portable sum elsewhere. Each load covers a whole cache line, so a core keeps more lines in
/// flight than the portable loop does.
pub fn sum_vector(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected.
        return unsafe { sum_avx512(words) };
    }
    sum_portable(words)
}

/// The wrapping sum of `words` with 32-byte loads into four accumulators and no software prefetch, where the CPU has
/// AVX2; the portable sum elsewhere. On an AVX-512 machine of this project this loop read memory 5–25% faster than
/// both the 64-byte one and the portable one, so the read bound takes the fastest of the three.
pub fn sum_avx2(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 detected.
        return unsafe { sum_256(words) };
    }
    sum_portable(words)
}

/// [`sum_avx2`] on AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_256(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let lines = words.chunks_exact(16);
    let rest = sum_portable(lines.remainder());
    let mut acc = [_mm256_setzero_si256(); 4];
    for four in lines {
        let p = four.as_ptr();
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `four` holds 16 words, so words 4k .. 4k + 4 are in it.
            *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(p.add(4 * k) as *const _) });
        }
    }
    let t = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` holds four u64.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, t) };
    lanes.iter().fold(rest, |a, &b| a.wrapping_add(b))
}

/// How far ahead [`sum_avx512`] prefetches: 24 KiB of words.
#[cfg(target_arch = "x86_64")]
const READ_AHEAD_WORDS: usize = (24 << 10) / 8;

/// [`sum_vector`] on AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sum_avx512(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let lines = words.chunks_exact(32);
    let rest = sum_portable(lines.remainder());
    let mut acc = [_mm512_setzero_si512(); 4];
    for four in lines {
        let p = four.as_ptr();
        for (k, a) in acc.iter_mut().enumerate() {
            // A hint: it never faults, even past the buffer.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(READ_AHEAD_WORDS + 8 * k) as *const i8);
            // SAFETY: `four` holds 32 words, so words 8k .. 8k + 8 are in it.
            *a = _mm512_add_epi64(*a, unsafe { _mm512_loadu_si512(p.add(8 * k) as *const _) });
        }
    }
    let total = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    (_mm512_reduce_add_epi64(total) as u64).wrapping_add(rest)
}

/// A buffer to measure reads over, on huge pages, every word written (so every page is resident).
pub struct ReadBuffer {
    words: Vec<u64>,
}

impl ReadBuffer {
    /// `bytes` bytes (rounded down to whole words) of distinct values.
    pub fn new(bytes: usize) -> Self {
        let n = bytes / 8;
        let mut words = huge_page_vec(n);
        words.extend((0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        Self { words }
    }

    /// The buffer's size in bytes.
    pub fn len(&self) -> usize {
        self.words.len() * 8
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Reads the whole buffer on every thread of rayon's pool, once with each loop ([`sum_portable`],
    /// [`sum_vector`], [`sum_avx2`]), and returns the fastest rate in bytes per second.
    pub fn read_rate(&self) -> f64 {
        let threads = rayon::current_num_threads().max(1);
        let per = self.words.len().div_ceil(threads * 8).max(1);
        let mut best = 0.0f64;
        for sum in [sum_portable as fn(&[u64]) -> u64, sum_vector, sum_avx2] {
            let t = Instant::now();
            let total = self
                .words
                .par_chunks(per)
                .map(sum)
                .reduce(|| 0, u64::wrapping_add);
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(total);
            best = best.max((self.words.len() * 8) as f64 / secs);
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_loops_sum_alike_and_a_rate_is_measured() {
        let words: Vec<u64> = (0..1000u64).map(|i| i * 0x1234_5678_9abc).collect();
        assert_eq!(sum_portable(&words), sum_vector(&words));
        assert_eq!(sum_portable(&words), sum_avx2(&words));
        let b = ReadBuffer::new(8 << 20);
        // The rate is the machine's (emulated runs are slow), so only its being a rate is held.
        let rate = b.read_rate();
        assert!(rate.is_finite() && rate > 0.0, "rate {rate}");
    }
}
