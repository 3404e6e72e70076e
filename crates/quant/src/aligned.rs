//! f32 vectors on whole cache lines: 64-byte aligned storage, so that a kernel's full-width loads of a multiple of 16
//! values never straddle two lines (a load that does costs two).

/// One 64-byte cache line of f32.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct Line([f32; LINE]);

/// f32 values per cache line.
const LINE: usize = 16;

/// A zero-initialised f32 vector whose first value starts a cache line; its length is a whole number of lines.
#[derive(Clone, Debug, PartialEq)]
pub struct Lines {
    lines: Vec<Line>,
}

impl Lines {
    /// `len` zeros, rounded up to whole lines. The memory comes zeroed from the allocator (for large sizes, fresh
    /// pages that are zero-filled when first written), so a buffer filled in parallel takes its page faults on the
    /// threads that fill it instead of all on the allocating one (`vec!` of a non-primitive element writes every
    /// zero on the calling thread).
    pub fn zeroed(len: usize) -> Self {
        let n = len.div_ceil(LINE);
        let Ok(layout) = std::alloc::Layout::array::<Line>(n) else {
            // An impossible size: let `vec!` report it as it always did.
            return Self {
                lines: vec![Line([0.0; LINE]); n],
            };
        };
        if layout.size() == 0 {
            return Self { lines: Vec::new() };
        }
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Line>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` lines (so capacity `n`), and
        // all-zero bytes are `n` valid lines of 0.0.
        let lines = unsafe { Vec::from_raw_parts(ptr, n, n) };
        Self { lines }
    }

    /// A copy of `x`, zero-padded to whole lines.
    pub fn copy_of(x: &[f32]) -> Self {
        let mut v = Self::zeroed(x.len());
        v[..x.len()].copy_from_slice(x);
        v
    }
}

impl std::ops::Deref for Lines {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` of 16 f32 with no padding (64 bytes at 64-byte alignment), so the lines are
        // `16 · len` contiguous, initialised f32.
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.lines.len() * LINE)
        }
    }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.lines.as_mut_ptr().cast::<f32>(),
                self.lines.len() * LINE,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_line_aligned_and_padded() {
        let v = Lines::copy_of(&[1.0, 2.0, 3.0]);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(v.len(), 16);
        assert_eq!(&v[..4], &[1.0, 2.0, 3.0, 0.0]);
    }

    #[test]
    fn zeroed_is_zero_aligned_and_whole_lines_at_every_size() {
        for len in [0, 1, 16, 17, 1 << 20] {
            let mut v = Lines::zeroed(len);
            assert_eq!(v.len(), len.div_ceil(16) * 16, "len {len}");
            assert!(v.iter().all(|&x| x.to_bits() == 0), "len {len}");
            assert_eq!(v.as_ptr() as usize % 64, 0, "len {len}");
            // Writable, and a clone is a separate copy.
            if let Some(x) = v.last_mut() {
                *x = 5.0;
            }
            let w = v.clone();
            assert_eq!(w, v);
        }
    }
}
