//! Storage for large weight vectors on transparent huge pages.
//!
//! A spine matrix streams through a GEMV kernel once per token. On 4 KiB pages the CPU's hardware prefetcher starts
//! over at every page boundary and every page costs a TLB walk; on 2 MiB pages a row block is one long stream. The
//! system allocator gives no say over page size, so the vectors that hold weights are created here with their
//! storage advised (Linux `MADV_HUGEPAGE`) before anything is written to it: the kernel then backs the advised
//! range with huge pages as it is first touched. Elsewhere, or when the system has no huge pages to give, the
//! vector is an ordinary one.

use std::mem::MaybeUninit;

/// The huge page size advised for (x86-64 and aarch64 Linux).
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// An empty vector with room for `capacity` items, whose storage is advised to use transparent huge pages before
/// its first write. Fill it with `push` or `extend` within that capacity; growing past it moves the items to
/// ordinary memory.
pub fn huge_page_vec<T>(capacity: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(capacity);
    advise_huge_pages(v.spare_capacity_mut());
    v
}

/// The items of `items` collected into a [`huge_page_vec`] of exactly their number.
pub fn collect_on_huge_pages<T>(items: impl ExactSizeIterator<Item = T>) -> Vec<T> {
    let mut v = huge_page_vec(items.len());
    v.extend(items);
    v
}

/// Advises the whole huge pages inside `buf` to be backed by transparent huge pages (a hint; no effect off Linux).
fn advise_huge_pages<T>(buf: &mut [MaybeUninit<T>]) {
    #[cfg(target_os = "linux")]
    {
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let (first, last) = (
            start.next_multiple_of(HUGE_PAGE),
            end / HUGE_PAGE * HUGE_PAGE,
        );
        if last > first {
            // SAFETY: [first, last) lies inside `buf`, memory this process owns and has not yet written; the
            // advice only changes how the kernel backs it, never its contents or validity. Its result does not
            // matter: without huge pages the memory works the same.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_every_item_in_order() {
        let v = collect_on_huge_pages((0..5_000_000u32).map(|i| i ^ 0x5a5a));
        assert_eq!(v.len(), 5_000_000);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32 ^ 0x5a5a));
        assert!(collect_on_huge_pages(std::iter::empty::<u8>()).is_empty());
    }

    #[test]
    fn has_the_capacity_asked_for() {
        let v: Vec<i8> = huge_page_vec(3 << 21);
        assert!(v.is_empty() && v.capacity() >= 3 << 21);
    }

    /// The advised range of a large vector is backed by huge pages where the system allows them (`madvise` mode or
    /// `always`), as `/proc/self/smaps` shows for the mapping that holds its middle.
    ///
    /// This needs the kernel to see the process's `madvise`. Under user-mode emulation (`qemu-aarch64`, as CI runs
    /// the aarch64 tests) the emulator takes the call and the kernel never sees it: there the test fails with what
    /// it needs unless `DELTAFIN_TEST_SKIP` names `huge-pages`, and then says in the log that it did not check.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_vectors_land_on_huge_pages_when_the_system_allows() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        let allowed = mode.contains("[madvise]") || mode.contains("[always]");
        let v = collect_on_huge_pages((0..(64usize << 20)).map(|i| i as u8));
        // The middle: the advice splits the allocation's mapping, and its unadvised head holds the first bytes.
        let addr = v.as_ptr() as usize + v.len() / 2;
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let huge_kb = mapping_field(&smaps, addr, "AnonHugePages:").expect("the vector's mapping");
        // At most two partial huge pages at the ends are not covered; the kernel may still fall back to small pages
        // when it has no free huge page, so require most, not all.
        if allowed && huge_kb < 32 << 10 {
            let why = format!(
                "{huge_kb} KiB of 64 MiB on huge pages though transparent huge pages are `{}`: this test needs a \
                 kernel that sees the process's madvise (user-mode emulation such as qemu-aarch64 keeps it)",
                mode.trim()
            );
            let skips = std::env::var("DELTAFIN_TEST_SKIP").unwrap_or_default();
            assert!(
                skips.split(',').any(|s| s == "huge-pages"),
                "{why}; set DELTAFIN_TEST_SKIP=huge-pages to skip this check"
            );
            eprintln!("not checked (DELTAFIN_TEST_SKIP=huge-pages): {why}");
        }
        assert_eq!(v[12345], (12345 % 256) as u8);
    }

    /// The value of `field` (kB) in the `smaps` entry of the mapping that contains `addr`.
    #[cfg(target_os = "linux")]
    fn mapping_field(smaps: &str, addr: usize, field: &str) -> Option<usize> {
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
            } else if inside && let Some(rest) = line.strip_prefix(field) {
                return rest.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
        None
    }
}
