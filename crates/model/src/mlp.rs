//! The gated MLP (dense layer 0 and the fused shared experts): `down · act(gate·x, up·x)`.

use candle_core::Tensor;
use deltafin_quant::DenseMatrix;

use crate::config::Activation;
use crate::error::Result;
use crate::ops::{glu_tensor, linear, linear_many};
use crate::weights::Loader;

/// A dense gated MLP.
#[derive(Debug)]
pub struct Mlp {
    gate: DenseMatrix,
    up: DenseMatrix,
    down: DenseMatrix,
    act: Activation,
}

impl Mlp {
    /// Loads `{prefix}{gate,up,down}_proj.weight` with inner width `inter`.
    pub(crate) fn load(
        ld: &Loader<'_>,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate: ld.matrix(&format!("{prefix}gate_proj.weight"), inter, hidden)?,
            up: ld.matrix(&format!("{prefix}up_proj.weight"), inter, hidden)?,
            down: ld.matrix(&format!("{prefix}down_proj.weight"), hidden, inter)?,
            act,
        })
    }

    /// `[T, hidden] -> [T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = linear_many(x, &[&self.gate, &self.up])?
            .try_into()
            .map_err(|_| {
                crate::error::ModelError::Device("two linears gave another count".into())
            })?;
        let a = glu_tensor(self.act, &gate, &up)?;
        linear(&a, &self.down)
    }
}
