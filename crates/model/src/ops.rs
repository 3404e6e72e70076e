//! Small numeric building blocks shared by the blocks: linear layers, norms and activations, all in f32.

use candle_core::Tensor;
use deltafin_quant::dot::dot_f32;
use deltafin_quant::{DenseMatrix, OutputLayout};
use rayon::prelude::*;

use crate::config::Activation;
use crate::error::{ModelError, Result};

/// The values of a `[T, n]` tensor, row-major.
pub fn values(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
}

/// A contiguous f32 CPU tensor's values, borrowed from its storage (`None` for any other tensor).
fn borrowed<'g>(
    storage: &'g candle_core::Storage,
    layout: &candle_core::Layout,
) -> Option<&'g [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => cpu
            .as_slice::<f32>()
            .ok()
            .and_then(|all| all.get(start..end)),
        _ => None,
    }
}

/// `f` of the values of a `[T, n]` tensor, row-major: borrowed from the tensor's storage where it is a contiguous f32
/// tensor on the CPU (every tensor the blocks make), else copied as [`values`] does. A long prompt's activations are
/// tens of megabytes, and a copy is one thread's memory traffic while every other core waits for it.
pub fn with_values<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = x.storage_and_layout();
    if let Some(v) = borrowed(&storage, layout) {
        return Ok(f(v));
    }
    drop(storage);
    Ok(f(&values(x)?))
}

/// `f` of the values of several tensors at once, each as [`with_values`] gives them (borrowed where it can be, else
/// copied first; no storage is read while a copy is made).
pub fn with_values_of<R>(xs: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> R) -> Result<R> {
    let in_place = |x: &Tensor| {
        let (storage, layout) = x.storage_and_layout();
        borrowed(&storage, layout).is_some()
    };
    let copies: Vec<Option<Vec<f32>>> = xs
        .iter()
        .map(|x| {
            if in_place(x) {
                Ok(None)
            } else {
                values(x).map(Some)
            }
        })
        .collect::<Result<_>>()?;
    let guards: Vec<_> = xs.iter().map(|x| x.storage_and_layout()).collect();
    let mut slices: Vec<&[f32]> = Vec::with_capacity(xs.len());
    for ((storage, layout), copy) in guards.iter().zip(&copies) {
        match copy.as_deref().or_else(|| borrowed(storage, layout)) {
            Some(v) => slices.push(v),
            None => {
                return Err(ModelError::Device(
                    "a tensor's storage changed while its values were read".to_string(),
                ));
            }
        }
    }
    Ok(f(&slices))
}

/// A `[rows, cols]` tensor from row-major values.
pub fn tensor(data: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(
        data,
        (rows, cols),
        &candle_core::Device::Cpu,
    )?)
}

/// `x · wᵀ` for `x [T, in]` and a checkpoint weight `w [out, in]`, giving `[T, out]`. Each output is one dot
/// product in the fixed order of `deltafin_quant::dot`, so rows do not depend on T.
pub fn linear(x: &Tensor, w: &DenseMatrix) -> Result<Tensor> {
    let t = x.dim(0)?;
    with_values(x, |v| linear_values(v, t, w))?
}

/// [`linear`] of the `t` rows `x` (`[t, in]` row-major), for callers that hold the values rather than a tensor.
pub fn linear_values(x: &[f32], t: usize, w: &DenseMatrix) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(dm) = w.cuda() {
        let y = dm
            .gemm(x, t)
            .map_err(|e| ModelError::Device(format!("linear {}x{}: {e}", w.rows(), w.cols())))?;
        return tensor(y, t, w.rows());
    }
    let y = w.gemm(x, t).map_err(|e| ModelError::BadWeight {
        name: format!("linear {}x{}", w.rows(), w.cols()),
        msg: e.to_string(),
    })?;
    tensor(y, t, w.rows())
}

/// [`linear`] of one input `x [T, in]` through several weights, as one threaded job on the CPU
/// (`deltafin_quant::gemm_many`: the threads fork and join once for all of them). Each output is bit-identical to
/// that weight's [`linear`].
pub fn linear_many(x: &Tensor, ws: &[&DenseMatrix]) -> Result<Vec<Tensor>> {
    let t = x.dim(0)?;
    linear_many_values(x, ws)?
        .into_iter()
        .zip(ws)
        .map(|(y, w)| tensor(y, t, w.rows()))
        .collect()
}

/// [`linear_many`] giving each output's values (`[T, out]` row-major) as they come from the kernels, for callers
/// that work on the values: a long prompt's projections are tens of megabytes each, and a tensor made only to be
/// read back out is two copies on one thread.
pub fn linear_many_values(x: &Tensor, ws: &[&DenseMatrix]) -> Result<Vec<Vec<f32>>> {
    linear_many_laid_out(x, ws, &vec![OutputLayout::ByInput; ws.len()])
}

/// [`linear_many_values`] with each output in its layout (`layouts[i]` for `ws[i]`, as
/// `deltafin_quant::gemm_many_laid_out` places it): the same values.
pub fn linear_many_laid_out(
    x: &Tensor,
    ws: &[&DenseMatrix],
    layouts: &[OutputLayout],
) -> Result<Vec<Vec<f32>>> {
    let t = x.dim(0)?;
    #[cfg(feature = "cuda")]
    if ws.iter().any(|w| w.cuda().is_some()) {
        if layouts.len() != ws.len() {
            return Err(ModelError::Device(format!(
                "{} layouts for {} linears",
                layouts.len(),
                ws.len()
            )));
        }
        return ws
            .iter()
            .zip(layouts)
            .map(|(w, layout)| Ok(layout.arrange(values(&linear(x, w)?)?, t, w.rows())))
            .collect();
    }
    with_values(x, |v| deltafin_quant::gemm_many_laid_out(ws, layouts, v, t))?.map_err(|e| {
        ModelError::BadWeight {
            name: format!("{} linears of one input", ws.len()),
            msg: e.to_string(),
        }
    })
}

/// RMSNorm over the last axis, row by row: `w ⊙ x / sqrt(mean(x²) + eps)`, into a new tensor (the input's values
/// read where they lie, each output value written once).
pub fn rms_norm(x: &Tensor, w: &[f32], eps: f32) -> Result<Tensor> {
    let (t, n) = x.dims2()?;
    if w.len() != n {
        return Err(ModelError::BadWeight {
            name: "RMSNorm weight".to_string(),
            msg: format!("{} values for rows of {n}", w.len()),
        });
    }
    let n = n.max(1);
    let out = with_values(x, |v| {
        // On huge pages, as the residual mix's rows (`crate::attn_res`).
        let mut out: Vec<f32> = deltafin_quant::huge_page_vec(v.len());
        let dst = &mut out.spare_capacity_mut()[..v.len()];
        // Rows apart on every thread for a long prompt (each row's arithmetic is the same either way).
        if t > 1 {
            dst.par_chunks_exact_mut(n)
                .zip(v.par_chunks_exact(n))
                .for_each(|(o, row)| rms_norm_into(row, w, eps, o));
        } else {
            for (o, row) in dst.chunks_exact_mut(n).zip(v.chunks_exact(n)) {
                rms_norm_into(row, w, eps, o);
            }
        }
        // SAFETY: `[T, n]` holds whole rows, so the loops above wrote each of the `v.len()` values.
        unsafe { out.set_len(v.len()) };
        out
    })?;
    tensor(out, t, n)
}

/// RMSNorm of the row `x` with weight `w` into `dst` (the bits of [`rms_norm_row`]).
fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, dst: &mut [std::mem::MaybeUninit<f32>]) {
    let inv = inv_rms(x, eps);
    for ((o, &v), &g) in dst.iter_mut().zip(x).zip(w) {
        o.write(v * inv * g);
    }
}

/// RMSNorm of one row in place, with weight `w`.
pub fn rms_norm_row(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * inv * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the squares summed in the order of `deltafin_quant::dot` (SIMD where the CPU has
/// it, the same bits everywhere): a left-to-right sum is one dependent add a value, about 7 µs at K3's width, and
/// the host runs several per layer while the cores (or the GPU) wait.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss = dot_f32(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// The logistic sigmoid.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x σ(x)`.
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + eˣ)`, linear above 20 as in PyTorch.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The gated activation `act(gate, up)` of every MLP in the family, with libm's `tanh` and `exp`: the plain twin of
/// the vectorised [`crate::activation`] that [`glu_values`] and [`glu_in_place`] run.
pub fn glu(act: Activation, gate: f32, up: f32) -> f32 {
    match act {
        Activation::Situ { beta, linear_beta } => {
            let a = beta * (gate / beta).tanh() * sigmoid(gate);
            let b = linear_beta * (up / linear_beta).tanh();
            a * b
        }
        Activation::Silu => silu(gate) * up,
    }
}

/// Values per task of an elementwise job spread over the threads: the vectorised SiTU costs about 6 ns a value on
/// one core, so a task is some 50 µs, and a decode step's 16 experts (49,152 values) still spread over 6 threads.
pub const ELEMENTWISE_CHUNK: usize = 8192;

/// The activation of `gate` and `up` ([`crate::activation`], within 1e-6 of [`glu`]), element by element, on every
/// thread (each value is computed alone, so the result does not depend on the split).
pub fn glu_values(act: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
    let n = gate.len().min(up.len());
    let mut out = gate[..n].to_vec();
    glu_in_place(act, std::iter::once((out.as_mut_slice(), &up[..n])));
    out
}

/// The activation of each `(gate, up)` pair ([`crate::activation`]), written over `gate`, on every thread: the pairs' values are cut into pieces of
/// [`ELEMENTWISE_CHUNK`] and all pieces of all pairs share one threaded job. Each value is computed alone, as in
/// [`glu_values`].
pub fn glu_in_place<'a>(act: Activation, pairs: impl Iterator<Item = (&'a mut [f32], &'a [f32])>) {
    let pieces: Vec<(&mut [f32], &[f32])> = pairs
        .flat_map(|(g, u)| {
            g.chunks_mut(ELEMENTWISE_CHUNK)
                .zip(u.chunks(ELEMENTWISE_CHUNK))
        })
        .collect();
    pieces
        .into_par_iter()
        .for_each(|(g, u)| crate::activation::glu_in_place(act, g, u));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn situ_matches_formula() {
        let act = Activation::Situ {
            beta: 4.0,
            linear_beta: 25.0,
        };
        let (g, u) = (1.5f32, -3.0f32);
        let expect = 4.0 * (g / 4.0).tanh() * sigmoid(g) * 25.0 * (u / 25.0).tanh();
        assert!((glu(act, g, u) - expect).abs() <= 1e-6 * expect.abs());
        assert!((glu(Activation::Silu, 2.0, 3.0) - 2.0 * sigmoid(2.0) * 3.0).abs() < 1e-7);
    }

    #[test]
    fn glu_in_place_equals_glu_values() {
        let act = Activation::Situ {
            beta: 4.0,
            linear_beta: 25.0,
        };
        // Pairs longer and shorter than a piece (`ELEMENTWISE_CHUNK`).
        let lens = [3 * ELEMENTWISE_CHUNK + 5, 7, ELEMENTWISE_CHUNK];
        let make =
            |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin() * 9.0).collect() };
        let gates: Vec<Vec<f32>> = lens.iter().map(|&n| make(n, 0.37)).collect();
        let ups: Vec<Vec<f32>> = lens.iter().map(|&n| make(n, 0.11)).collect();
        let mut out = gates.clone();
        glu_in_place(
            act,
            out.iter_mut()
                .map(Vec::as_mut_slice)
                .zip(ups.iter().map(Vec::as_slice)),
        );
        for ((o, g), u) in out.iter().zip(&gates).zip(&ups) {
            let want = glu_values(act, g, u);
            assert_eq!(
                o.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    /// `with_values` gives a tensor's row-major values whether it borrows them (a contiguous tensor) or copies them
    /// (a transposed view).
    #[test]
    fn with_values_borrows_or_copies_the_row_major_values() -> Result<()> {
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        let x = tensor(data.clone(), 3, 4)?;
        assert_eq!(with_values(&x, |v| v.to_vec())?, data);
        // A row-range view starts past the storage's first value.
        let rows = x.narrow(0, 1, 2)?;
        assert_eq!(with_values(&rows, |v| v.to_vec())?, data[4..]);
        let xt = x.t()?;
        let want: Vec<f32> = (0..4)
            .flat_map(|c| (0..3).map(move |r| r * 4 + c))
            .map(|i| data[i])
            .collect();
        assert_eq!(with_values(&xt, |v| v.to_vec())?, want);
        Ok(())
    }

    /// `rms_norm` of a prompt's rows and of one row give [`rms_norm_row`]'s bits; a weight of another width is an
    /// error.
    #[test]
    fn rms_norm_rows_give_the_row_bits() -> Result<()> {
        let n = 40;
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i as f32 * 0.3).cos()).collect();
        for t in [1, 5] {
            let data: Vec<f32> = (0..t * n).map(|i| (i as f32 * 0.17).sin() * 3.0).collect();
            let got = values(&rms_norm(&tensor(data.clone(), t, n)?, &w, 1e-6)?)?;
            let mut want = data;
            want.chunks_exact_mut(n)
                .for_each(|row| rms_norm_row(row, &w, 1e-6));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{t} rows");
        }
        assert!(rms_norm(&tensor(vec![1.0; 8], 2, 4)?, &w, 1e-6).is_err());
        Ok(())
    }

    #[test]
    fn softplus_is_stable() {
        assert_eq!(softplus(50.0), 50.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
