//! Small numeric building blocks shared by the blocks: linear layers, norms and activations, all in f32.

use candle_core::Tensor;
use deltafin_quant::DenseMatrix;

use crate::config::Activation;
use crate::error::{ModelError, Result};

/// The values of a `[T, n]` tensor, row-major.
pub fn values(x: &Tensor) -> Result<Vec<f32>> {
    Ok(x.flatten_all()?.to_vec1::<f32>()?)
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
    #[cfg(feature = "cuda")]
    if let Some(dm) = w.cuda() {
        let y = dm
            .gemm(&values(x)?, t)
            .map_err(|e| ModelError::Device(format!("linear {}x{}: {e}", w.rows(), w.cols())))?;
        return tensor(y, t, w.rows());
    }
    let y = w.gemm(&values(x)?, t).map_err(|e| ModelError::BadWeight {
        name: format!("linear {}x{}", w.rows(), w.cols()),
        msg: e.to_string(),
    })?;
    tensor(y, t, w.rows())
}

/// RMSNorm over the last axis, row by row: `w ⊙ x / sqrt(mean(x²) + eps)`.
pub fn rms_norm(x: &Tensor, w: &[f32], eps: f32) -> Result<Tensor> {
    let (t, n) = x.dims2()?;
    let mut v = values(x)?;
    for row in v.chunks_exact_mut(n) {
        rms_norm_row(row, w, eps);
    }
    tensor(v, t, n)
}

/// RMSNorm of one row in place, with weight `w`.
pub fn rms_norm_row(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * inv * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
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

/// The gated activation `act(gate, up)` of every MLP in the family.
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

/// Applies [`glu`] elementwise to two equal-shape tensors.
pub fn glu_tensor(act: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let g = gate.flatten_all()?.to_vec1::<f32>()?;
    let u = up.flatten_all()?.to_vec1::<f32>()?;
    let out: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| glu(act, g, u)).collect();
    Ok(Tensor::from_vec(out, gate.shape(), gate.device())?)
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
    fn softplus_is_stable() {
        assert_eq!(softplus(50.0), 50.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
