//! Multi-token products' outputs written straight into their `y [inputs, rows]` from the tasks that compute them.
//!
//! The multi-token kernels fill a block of outputs by weight row (`[rows, inputs]`: a task's rows are contiguous
//! and its accumulators copy out in order). Each task now transposes its own block into `y` while the block is
//! still in L1, instead of every product's blocks going to freshly allocated memory first and through a separate
//! transposing pass (4% of a long prompt's time on two cores, plus faulting in that memory). Blocks are built in a
//! per-thread scratch buffer ([`with_block`]) that is reused from task to task.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;

/// A product's output `y [t_rows, rows]` (by input), shared by the tasks that each write one block of weight rows
/// by inputs into it ([`ByInput::put`]).
pub(crate) struct ByInput<'a> {
    ptr: *mut f32,
    rows: usize,
    t_rows: usize,
    _y: PhantomData<&'a mut [f32]>,
}

// SAFETY: `ByInput` is a `&mut [f32]` handed to several threads; `put`'s contract (disjoint blocks) keeps their
// writes apart, and nothing reads through it.
unsafe impl Send for ByInput<'_> {}
// SAFETY: as above.
unsafe impl Sync for ByInput<'_> {}

impl<'a> ByInput<'a> {
    /// `y` holds at least `rows * t_rows` values (fewer shrink `t_rows` to the whole inputs it holds).
    pub(crate) fn new(y: &'a mut [f32], rows: usize, t_rows: usize) -> ByInput<'a> {
        let t_rows = y
            .len()
            .checked_div(rows)
            .map_or(t_rows, |whole| t_rows.min(whole));
        ByInput {
            ptr: y.as_mut_ptr(),
            rows,
            t_rows,
            _y: PhantomData,
        }
    }

    /// Writes `block [n, inputs.len()]` (by weight row: rows `r0 .. r0 + n` for the inputs `inputs`) into `y`. A
    /// block reaching past `y` writes nothing (a caller's bug, caught in debug builds).
    ///
    /// # Safety
    /// No other call on this `ByInput` may run at the same time with a block that overlaps this one (same rows and
    /// same inputs).
    pub(crate) unsafe fn put(&self, r0: usize, inputs: Range<usize>, block: &[f32]) {
        let w = inputs.len();
        if w == 0 {
            return;
        }
        let n = block.len() / w;
        let fits = r0 + n <= self.rows && inputs.end <= self.t_rows && block.len() == n * w;
        debug_assert!(
            fits,
            "a block of rows {r0}..+{n}, inputs {inputs:?} outside y"
        );
        if !fits {
            return;
        }
        for (j, t) in inputs.enumerate() {
            // SAFETY: `t < t_rows` and `r0 + n <= rows`, so the n values lie in `y`; the caller keeps other writers
            // off them.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(self.ptr.add(t * self.rows + r0), n) };
            for (i, d) in dst.iter_mut().enumerate() {
                *d = block[i * w + j];
            }
        }
    }
}

thread_local! {
    /// This thread's block buffer for [`with_block`].
    static BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a zeroed scratch block of `len` values, this thread's buffer reused from call to call. The buffer is
/// taken out for the call, so a nested call (a task stolen while `f` waits) gets a fresh one instead of a borrow
/// error.
pub(crate) fn with_block<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = BLOCK.with_borrow_mut(std::mem::take);
    buf.clear();
    buf.resize(len, 0.0);
    let r = f(&mut buf);
    BLOCK.with_borrow_mut(|b| {
        if b.capacity() < buf.capacity() {
            *b = buf;
        }
    });
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_land_transposed_and_out_of_range_ones_are_dropped() {
        let (rows, t_rows) = (5, 3);
        let mut y = vec![-1.0f32; rows * t_rows];
        let target = ByInput::new(&mut y, rows, t_rows);
        // Rows 1..3 for inputs 1..3: block [2, 2] by row.
        // SAFETY: one call at a time.
        unsafe { target.put(1, 1..3, &[10.0, 11.0, 20.0, 21.0]) };
        if !cfg!(debug_assertions) {
            // SAFETY: as above; rows 4..6 reach past `y`, so nothing is written.
            unsafe { target.put(4, 0..1, &[7.0, 8.0]) };
        }
        let expect = [
            [-1.0, -1.0, -1.0, -1.0, -1.0],
            [-1.0, 10.0, 20.0, -1.0, -1.0],
            [-1.0, 11.0, 21.0, -1.0, -1.0],
        ];
        for (t, row) in expect.iter().enumerate() {
            assert_eq!(&y[t * rows..(t + 1) * rows], row, "input {t}");
        }
    }

    #[test]
    fn scratch_blocks_start_zeroed_and_nest() {
        let outer = with_block(4, |b| {
            b.fill(3.0);
            let inner = with_block(2, |c| c.to_vec());
            (b.to_vec(), inner)
        });
        assert_eq!(outer, (vec![3.0; 4], vec![0.0; 2]));
        assert_eq!(with_block(6, |b| b.to_vec()), vec![0.0; 6]);
    }
}
