//! Large zeroed f32 buffers filled on every thread.
//!
//! `vec![0.0; n]` asks the allocator for zeroed memory; where the block is reused from the heap (every buffer under
//! glibc's mmap threshold, such as a long prompt's projection outputs of tens of megabytes) the allocator writes the
//! zeros on the calling thread, a few milliseconds a buffer while every other core waits for the product that will
//! overwrite them. Large buffers are also advised onto transparent huge pages ([`crate::pages`]): faulted in 4 KiB
//! at a time by every thread at once, a 100 MB buffer is 25,000 faults, each under the lock of its page table.

use rayon::prelude::*;

/// Values from which [`zeroed`] fills in parallel (4 MiB): below it one thread's memset is shorter than a fork-join.
const PARALLEL_FROM: usize = 1 << 20;

/// `len` zeros, written by every thread of rayon's pool when `len` is large.
pub fn zeroed(len: usize) -> Vec<f32> {
    if len < PARALLEL_FROM {
        return vec![0.0; len];
    }
    let mut v = crate::pages::huge_page_vec(len);
    v.par_extend(rayon::iter::repeat_n(0.0f32, len));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_buffers_are_all_zeros() {
        for len in [
            0,
            5,
            PARALLEL_FROM - 1,
            PARALLEL_FROM,
            3 * PARALLEL_FROM + 17,
        ] {
            let v = zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x.to_bits() == 0), "{len}");
        }
    }
}
