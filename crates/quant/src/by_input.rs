//! Multi-token products' outputs written straight into their `y [inputs, rows]` from the tasks that compute them.
//!
//! The multi-token kernels fill a block of outputs by weight row (`[rows, inputs]`: a task's rows are contiguous
//! and its accumulators copy out in order). Each task now transposes its own block into `y` while the block is
//! still in L1, instead of every product's blocks going to freshly allocated memory first and through a separate
//! transposing pass (a few per cent of a long prompt's time, plus faulting in that memory: docs/performance-log.md).
//! Blocks are built in a per-thread scratch buffer ([`with_block`]) that is reused from task to task. [`fill`] cuts every product into
//! a grid of such blocks and runs them, so the tasks' writes are disjoint by construction.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;

/// A product's output `y` (by input, or by heads of `head` outputs: [`Grid::head`]), shared by the tasks that each
/// write one block of weight rows by inputs into it ([`ByInput::put`]).
struct ByInput<'a> {
    ptr: *mut f32,
    rows: usize,
    t_rows: usize,
    head: usize,
    _y: PhantomData<&'a mut [f32]>,
}

// SAFETY: `ByInput` is a `&mut [f32]` handed to several threads; `put`'s contract (disjoint blocks) keeps their
// writes apart, and nothing reads through it.
unsafe impl Send for ByInput<'_> {}
// SAFETY: as above.
unsafe impl Sync for ByInput<'_> {}

impl<'a> ByInput<'a> {
    /// `y` holds at least `rows * t_rows` values (by input, fewer shrink `t_rows` to the whole inputs it holds; by
    /// heads, whose places depend on `t_rows`, fewer leave nothing to write); `head` as in [`Grid::head`] (one that
    /// does not divide `rows` counts as `rows`: by input).
    fn new(y: &'a mut [f32], rows: usize, t_rows: usize, head: usize) -> ByInput<'a> {
        let head = if head > 0 && rows.is_multiple_of(head) {
            head
        } else {
            rows.max(1)
        };
        let whole = y.len().checked_div(rows).unwrap_or(t_rows);
        let t_rows = if whole >= t_rows {
            t_rows
        } else if head == rows {
            whole
        } else {
            0
        };
        ByInput {
            ptr: y.as_mut_ptr(),
            rows,
            t_rows,
            head,
            _y: PhantomData,
        }
    }

    /// Where output `r` of input `t` lies in `y`: heads of `head` outputs one after another, each `[t_rows, head]`
    /// (with `head == rows`, `t · rows + r`).
    fn at(&self, t: usize, r: usize) -> usize {
        (r / self.head) * self.t_rows * self.head + t * self.head + r % self.head
    }

    /// Writes `block [n, inputs.len()]` (by weight row: rows `r0 .. r0 + n` for the inputs `inputs`) into `y`. A
    /// block reaching past `y` writes nothing (a caller's bug, caught in debug builds).
    ///
    /// # Safety
    /// No other call on this `ByInput` may run at the same time with a block that overlaps this one (same rows and
    /// same inputs).
    unsafe fn put(&self, r0: usize, inputs: Range<usize>, block: &[f32]) {
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
        // The block's rows by the heads they fall in: within a head, an input's outputs are contiguous in `y`.
        let mut r = r0;
        while r < r0 + n {
            let run = (self.head - r % self.head).min(r0 + n - r);
            for (j, t) in inputs.clone().enumerate() {
                // SAFETY: `t < t_rows` and `r + run <= rows` within one head, so the `run` values lie in `y`; the
                // caller keeps other writers off them.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(self.ptr.add(self.at(t, r)), run) };
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = block[(r - r0 + i) * w + j];
                }
            }
            r += run;
        }
    }
}

/// One product's output for [`fill`], computed in blocks of `row_step` weight rows by `input_step` inputs (the last
/// ones shorter; a step of 0 counts as 1).
pub(crate) struct Grid<'a> {
    pub(crate) y: &'a mut [f32],
    pub(crate) rows: usize,
    pub(crate) t_rows: usize,
    pub(crate) row_step: usize,
    pub(crate) input_step: usize,
    /// `y`'s layout: `rows` (or 0, or any count that does not divide `rows`) for `[t_rows, rows]` by input; a
    /// divisor `h` of `rows` for `[rows / h, t_rows, h]`, each head's outputs for every input together
    /// ([`crate::dense::OutputLayout::Heads`]).
    pub(crate) head: usize,
}

/// Fills every grid's `y`: for each block, `compute(k, r0, inputs, out)` fills `out [n, inputs.len()]` (by weight
/// row, zeroed before) with rows `r0 .. r0 + n` of product `k` for `inputs`, and the block goes into `y`. The blocks
/// of every product run as one threaded job (on the calling thread when there is only one).
pub(crate) fn fill(
    grids: Vec<Grid<'_>>,
    compute: impl Fn(usize, usize, Range<usize>, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    // (product, first row, rows, inputs): each (row, input) pair of a product in exactly one block.
    let mut blocks: Vec<(usize, usize, usize, Range<usize>)> = Vec::new();
    for (k, g) in grids.iter().enumerate() {
        let (row_step, input_step) = (g.row_step.max(1), g.input_step.max(1));
        for t0 in (0..g.t_rows).step_by(input_step) {
            let inputs = t0..(t0 + input_step).min(g.t_rows);
            for r0 in (0..g.rows).step_by(row_step) {
                blocks.push((k, r0, row_step.min(g.rows - r0), inputs.clone()));
            }
        }
    }
    let targets: Vec<ByInput<'_>> = grids
        .into_iter()
        .map(|g| ByInput::new(g.y, g.rows, g.t_rows, g.head))
        .collect();
    let run = |(k, r0, n, inputs): (usize, usize, usize, Range<usize>)| {
        with_block(n * inputs.len(), |out| {
            compute(k, r0, inputs.clone(), out);
            // SAFETY: the blocks above partition each product's rows by inputs, so no two overlap.
            unsafe { targets[k].put(r0, inputs, out) };
        });
    };
    if blocks.len() < 2 {
        blocks.into_iter().for_each(run);
    } else {
        blocks.into_par_iter().for_each(run);
    }
}

thread_local! {
    /// This thread's block buffer for [`with_block`].
    static BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a zeroed scratch block of `len` values, this thread's buffer reused from call to call. The buffer is
/// taken out for the call, so a nested call (a task stolen while `f` waits) gets a fresh one instead of a borrow
/// error.
fn with_block<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
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
        let target = ByInput::new(&mut y, rows, t_rows, 0);
        // Rows 1..3 for inputs 1..3: block [2, 2] by row.
        // SAFETY: one call at a time.
        unsafe { target.put(1, 1..3, &[10.0, 11.0, 20.0, 21.0]) };
        if !cfg!(debug_assertions) {
            // SAFETY: as above; rows 4..6 reach past `y`, so nothing is written.
            unsafe { target.put(4, 0..1, &[7.0, 8.0]) };
        }
        if !cfg!(debug_assertions) {
            // By heads a short `y` leaves nothing to write (its places depend on every input being there).
            let mut short = vec![-1.0f32; 2 * 3];
            let by_heads = ByInput::new(&mut short, 2, 4, 1);
            // SAFETY: one call at a time.
            unsafe { by_heads.put(0, 0..1, &[5.0, 6.0]) };
            assert_eq!(short, [-1.0; 6]);
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
    fn fill_covers_every_output_once_whatever_the_steps() {
        let (rows, t_rows) = (7, 5);
        for (row_step, input_step) in [(1, 1), (2, 3), (3, 2), (7, 5), (10, 10), (0, 0)] {
            let mut a = vec![f32::NAN; rows * t_rows];
            let mut b = vec![f32::NAN; 3 * 2];
            let grids = vec![
                Grid {
                    y: &mut a,
                    rows,
                    t_rows,
                    row_step,
                    input_step,
                    head: 0,
                },
                Grid {
                    y: &mut b,
                    rows: 3,
                    t_rows: 2,
                    row_step,
                    input_step,
                    head: 3,
                },
            ];
            fill(grids, |k, r0, inputs, out| {
                let w = inputs.len();
                for (i, row) in out.chunks_exact_mut(w).enumerate() {
                    for (o, t) in row.iter_mut().zip(inputs.clone()) {
                        assert_eq!(*o, 0.0, "blocks start zeroed");
                        *o = (100 * k + 10 * (r0 + i) + t) as f32;
                    }
                }
            });
            for (k, y, rows) in [(0, &a, rows), (1, &b, 3)] {
                for (j, &v) in y.iter().enumerate() {
                    let (t, r) = (j / rows, j % rows);
                    assert_eq!(
                        v,
                        (100 * k + 10 * r + t) as f32,
                        "steps {row_step}/{input_step} product {k}"
                    );
                }
            }
        }
    }

    /// Heads of 4 outputs: every output of every input lands at its head's place, whatever the blocks' steps (a row
    /// step that is not a divisor of the head makes blocks that straddle two heads).
    #[test]
    fn head_layout_puts_each_head_together() {
        let (rows, t_rows, head) = (12, 5, 4);
        for (row_step, input_step) in [(1, 1), (3, 2), (4, 5), (5, 3), (12, 5)] {
            let mut y = vec![f32::NAN; rows * t_rows];
            let grids = vec![Grid {
                y: &mut y,
                rows,
                t_rows,
                row_step,
                input_step,
                head,
            }];
            fill(grids, |_, r0, inputs, out| {
                let w = inputs.len();
                for (i, row) in out.chunks_exact_mut(w).enumerate() {
                    for (o, t) in row.iter_mut().zip(inputs.clone()) {
                        *o = (100 * t + r0 + i) as f32;
                    }
                }
            });
            for (j, &v) in y.iter().enumerate() {
                let (h, t, c) = (j / (t_rows * head), j / head % t_rows, j % head);
                assert_eq!(
                    v,
                    (100 * t + h * head + c) as f32,
                    "steps {row_step}/{input_step} at {j}"
                );
            }
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
