//! The gated MLP (dense layer 0 and the fused shared experts): `down · act(gate·x, up·x)`.

use candle_core::Tensor;
use deltafin_quant::DenseMatrix;

use crate::config::Activation;
use crate::error::Result;
use crate::ops::{glu_in_place, linear, linear_many_values, tensor};
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
        let [mut gate, up]: [Vec<f32>; 2] = linear_many_values(x, &[&self.gate, &self.up])?
            .try_into()
            .map_err(|_| {
                crate::error::ModelError::Device("two linears gave another count".into())
            })?;
        glu_in_place(
            self.act,
            std::iter::once((gate.as_mut_slice(), up.as_slice())),
        );
        linear(&tensor(gate, x.dim(0)?, self.gate.rows())?, &self.down)
    }
}
