//! The C allocator's settings for the engine's large, short-lived buffers (glibc on Linux; nothing elsewhere).
//!
//! A prompt's pass allocates and frees buffers of megabytes at every layer (projections, per-head inputs, expert
//! rows). By default glibc serves each with a fresh mapping until its adaptive threshold has grown, and gives the
//! free memory at the top of every heap back to the kernel as soon as it passes a small trim threshold. Each layer
//! then faults in freshly zeroed pages and unmaps them again, and in a process with many threads every unmapping
//! interrupts each core that runs one of them to flush its TLB. [`keep_freed_memory`] keeps buffers up to 32 MiB
//! (the largest threshold glibc accepts) in its heaps and stops the trimming, so a layer reuses what the last one
//! freed. The freed bytes stay in the process, within what the runtime's memory plan charges as scratch: they are
//! the same buffers, allocated again. It lives here, beside the kernels, so that their benchmarks (the `examples/`
//! of this crate and the model's) allocate as the engine does.

/// Largest allocation glibc serves from its heaps after [`keep_freed_memory`]; larger ones are mapped as before.
pub const HEAP_ALLOCATION_MAX: usize = 32 << 20;

/// Sets the allocator for the engine's pattern of allocation (see the module header). Call it once, early, from
/// the program's `main` (the command-line tool and the server do, and the kernels' benchmarks); it only changes how
/// freed memory is kept. Returns whether the allocator took both settings (false off glibc).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes glibc's tuning parameters; it is safe to call at any time, and these values
        // are within the ranges glibc documents.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_ALLOCATION_MAX as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_takes_the_settings_and_buffers_still_work() {
        let took = keep_freed_memory();
        assert_eq!(took, cfg!(all(target_os = "linux", target_env = "gnu")));
        // Buffers on both sides of the threshold, freed and allocated again, still hold what is written.
        for round in 0..3u8 {
            for len in [HEAP_ALLOCATION_MAX / 2, HEAP_ALLOCATION_MAX + 4096] {
                let v = vec![round; len];
                assert!(v.iter().step_by(4093).all(|&b| b == round));
            }
        }
    }
}
