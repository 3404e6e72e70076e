//! The streamed spine: layers that are not kept in memory are read again at every forward call, one layer ahead
//! of the compute, by a background thread.
//!
//! Double buffering: the reader hands layers over a rendezvous channel (capacity 0), so while layer L computes the
//! reader holds at most layer L+1 (read, or being read) and blocks until L is finished and dropped. At most two
//! streamed layers are in memory at once. Each streamed layer is built fresh by `Layer::load` (the same code the
//! resident layers went through at open, so results are bit-identical); its buffers are freed when it is dropped
//! rather than refilled in place.

use std::sync::mpsc::{Receiver, sync_channel};
use std::time::Instant;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layer::Layer;
use crate::profile::{Phase, Profile};
use crate::weights::{Loader, WeightSource};

/// The GPU handles a streamed layer is uploaded with (a stand-in without the `cuda` feature).
#[cfg(feature = "cuda")]
pub(crate) type GpuHandles = crate::gpu::GpuHandles;
/// The GPU handles a streamed layer is uploaded with (a stand-in without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub(crate) type GpuHandles = ();

/// Hands the streamed layers to the forward pass in order, as the background reader delivers them.
pub(crate) struct StreamedLayers {
    rx: Option<Receiver<Result<Layer>>>,
}

impl StreamedLayers {
    /// Layer `index`, which must be the next streamed layer; the time spent waiting for it is charged to
    /// [`Phase::SpineWait`].
    pub fn take(&mut self, index: usize, profile: &Profile) -> Result<Layer> {
        let stopped = || ModelError::SpineStream {
            layer: index,
            msg: "the spine reader stopped early".to_string(),
        };
        let rx = self.rx.as_ref().ok_or_else(stopped)?;
        let waited_from = Instant::now();
        let layer = rx.recv().map_err(|_| stopped())??;
        profile.add(Phase::SpineWait, waited_from.elapsed());
        if layer.index() != index {
            return Err(ModelError::SpineStream {
                layer: index,
                msg: format!("the spine reader delivered layer {}", layer.index()),
            });
        }
        Ok(layer)
    }
}

/// Runs `body` while a background thread reads `layers` (ascending indices) from `src`, one ahead of the
/// compute. With no streamed layers no thread is started. When `body` returns early (an error), the reader stops
/// after the layer it is reading.
/// `gpu`: the model's GPU handles when it runs on CUDA (the reader then uploads each layer as it builds it).
pub(crate) fn with_streamed_layers<R>(
    src: Option<&(dyn WeightSource + Send + Sync)>,
    cfg: &ModelConfig,
    layers: &[usize],
    gpu: Option<GpuHandles>,
    body: impl FnOnce(&mut StreamedLayers) -> Result<R>,
) -> Result<R> {
    let Some(src) = src.filter(|_| !layers.is_empty()) else {
        return body(&mut StreamedLayers { rx: None });
    };
    std::thread::scope(|s| {
        // Capacity 0: a finished read waits for the forward pass to ask for it (double buffering, not more).
        let (tx, rx) = sync_channel::<Result<Layer>>(0);
        s.spawn(move || {
            #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
            let mut ld = Loader::new(src);
            #[cfg(feature = "cuda")]
            if let Some(g) = gpu {
                if let Err(e) = g.gpu.bind() {
                    let _ = tx.send(Err(crate::gpu::cuda_err(e)));
                    return;
                }
                ld.gpu = Some(g);
            }
            #[cfg(not(feature = "cuda"))]
            let _ = gpu;
            for &index in layers {
                let layer = Layer::load(&ld, cfg, index);
                let failed = layer.is_err();
                // A send fails once the forward pass has returned (it dropped the receiver): stop reading.
                if tx.send(layer).is_err() || failed {
                    break;
                }
            }
        });
        let mut streamed = StreamedLayers { rx: Some(rx) };
        let out = body(&mut streamed);
        // Dropping the receiver unblocks a reader waiting to hand over a layer nobody will take.
        drop(streamed);
        out
    })
}
