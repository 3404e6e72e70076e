//! The model's weight and expert traits implemented over the checkpoint files.

use std::sync::Arc;

use deltafin_model::{ExpertSource, ExpertWeights, ModelError, PackedExpert};
use deltafin_storage::{ExpertFormat, ExpertMap, ModelFiles};

use crate::convert::to_f32;
use crate::error::RuntimeError;

/// Routed experts read from the shards: one positional read per expert span.
pub struct ExpertsFromFiles {
    /// The opened checkpoint.
    pub files: Arc<ModelFiles>,
    /// Where each expert lies.
    pub map: Arc<ExpertMap>,
}

impl ExpertsFromFiles {
    fn load_one(&self, layer: usize, expert: usize) -> Result<ExpertWeights, RuntimeError> {
        let span = self.map.span(layer, expert)?;
        let mut bytes = vec![0u8; span.len as usize];
        self.files
            .read_span(span.shard, span.offset, span.len, &mut bytes)?;
        let range = |i: usize| {
            let p = &span.parts[i];
            p.rel_offset as usize..(p.rel_offset + p.len) as usize
        };
        match span.format {
            ExpertFormat::Mxfp4 => Ok(ExpertWeights::Mxfp4(PackedExpert {
                parts: [range(0), range(1), range(2), range(3), range(4), range(5)],
                bytes,
            })),
            ExpertFormat::Dense(dtype) => {
                let conv = |i: usize| {
                    to_f32(&bytes[range(i)], dtype).ok_or_else(|| RuntimeError::UnsupportedDtype {
                        name: format!("layer {layer} expert {expert}"),
                        dtype: format!("{dtype:?}"),
                    })
                };
                Ok(ExpertWeights::Dense {
                    w1: conv(0)?,
                    w2: conv(1)?,
                    w3: conv(2)?,
                })
            }
        }
    }
}

impl ExpertSource for ExpertsFromFiles {
    fn load_experts(
        &self,
        layer: usize,
        experts: &[usize],
    ) -> deltafin_model::Result<Vec<Arc<ExpertWeights>>> {
        experts
            .iter()
            .map(|&e| {
                self.load_one(layer, e)
                    .map(Arc::new)
                    .map_err(|err| ModelError::Source(Box::new(err)))
            })
            .collect()
    }
}
