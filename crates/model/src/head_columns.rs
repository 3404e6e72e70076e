//! Attention output rows `[T, H · D]` written head by head: each head's task puts its own `D` columns of every row
//! straight into the shared rows while its `[T, D]` result is still in cache, instead of every head's result going
//! to memory first and through a separate transposing pass.

use std::marker::PhantomData;

/// Rows `[t_len, heads · d]` shared by parallel head tasks ([`HeadColumns::put`]).
pub(crate) struct HeadColumns<'a> {
    ptr: *mut f32,
    t_len: usize,
    heads: usize,
    d: usize,
    _rows: PhantomData<&'a mut [f32]>,
}

// SAFETY: `HeadColumns` is a `&mut [f32]` handed to several threads; `put`'s contract (one writer per head) keeps
// their writes apart, and nothing reads through it.
unsafe impl Send for HeadColumns<'_> {}
// SAFETY: as above.
unsafe impl Sync for HeadColumns<'_> {}

impl<'a> HeadColumns<'a> {
    /// The whole rows of `heads · d` values that `rows` holds.
    pub(crate) fn new(rows: &'a mut [f32], heads: usize, d: usize) -> HeadColumns<'a> {
        HeadColumns {
            ptr: rows.as_mut_ptr(),
            t_len: rows.len().checked_div(heads * d).unwrap_or(0),
            heads,
            d,
            _rows: PhantomData,
        }
    }

    /// Writes `src` (`d` values) as head `head`'s columns of row `t`. A slot outside the rows, or a `src` of another
    /// length, writes nothing (a caller's bug, caught in debug builds).
    ///
    /// # Safety
    /// No other call on this `HeadColumns` may write the same head at the same time.
    pub(crate) unsafe fn put(&self, head: usize, t: usize, src: &[f32]) {
        let fits = head < self.heads && t < self.t_len && src.len() == self.d;
        debug_assert!(fits, "head {head}, row {t} outside the rows");
        if !fits {
            return;
        }
        // SAFETY: `t < t_len` and `head < heads`, so the `d` values lie in the rows; the caller keeps other writers
        // off this head's columns.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add((t * self.heads + head) * self.d), self.d)
        };
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn heads_in_parallel_fill_their_own_columns() {
        let (t_len, heads, d) = (5, 7, 3);
        let mut rows = vec![f32::NAN; t_len * heads * d];
        {
            let cols = HeadColumns::new(&mut rows, heads, d);
            (0..heads).into_par_iter().for_each(|h| {
                for t in 0..t_len {
                    let src: Vec<f32> = (0..d).map(|i| (h * 100 + t * 10 + i) as f32).collect();
                    // SAFETY: one task per head.
                    unsafe { cols.put(h, t, &src) };
                }
            });
        }
        for t in 0..t_len {
            for h in 0..heads {
                for i in 0..d {
                    assert_eq!(rows[(t * heads + h) * d + i], (h * 100 + t * 10 + i) as f32);
                }
            }
        }
    }
}
