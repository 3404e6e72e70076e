//! Anonymous host mappings for the benchmarks that page-lock or read into host memory (`read-into`, `pin-rate`,
//! `upload-from`): one place for the mapping and its huge-page advice.

/// A fresh private anonymous read-write mapping of `len` bytes, advised to use transparent huge pages (`huge`) or
/// not to. The caller unmaps it (`libc::munmap`) when done.
pub fn map_anonymous(len: usize, huge: bool) -> anyhow::Result<*mut libc::c_void> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    anyhow::ensure!(p != libc::MAP_FAILED, "mmap of {len} bytes failed");
    let advice = if huge {
        libc::MADV_HUGEPAGE
    } else {
        libc::MADV_NOHUGEPAGE
    };
    // SAFETY: the range is the mapping above; the advice is a hint whose failure changes nothing else.
    unsafe { libc::madvise(p, len, advice) };
    Ok(p)
}
