//! The GPU memory plan at open: which spine layers stay on the device, and what is left for the expert cache.
//!
//! Layers are uploaded in order while they fit: after each one, the device memory in use (measured with
//! `cuMemGetInfo` against the start) plus room for two streamed layers (the one computing and the one being
//! uploaded, each as large as the largest layer seen) plus a reserve (activations, KDA states) and a minimal expert
//! cache must stay within the budget. The first layer that does not fit is freed again and it and every later layer
//! are streamed: uploaded at every forward pass by the spine reader, one layer ahead of the compute. If the layer
//! that did not fit is the largest, resident layers are given back, last first, until two of it fit.

use std::sync::Arc;

use deltafin_quant::cuda::Gpu;

use super::cuda_err;
use crate::error::{ModelError, Result};

/// Device memory kept free for activations, kernel buffers, KDA states (a session's are 434 MB at K3's size, two
/// or three alive during a pass or with a checkpoint) and the allocator (bytes).
const RESERVE: usize = 2 << 30;
/// Margin below the free memory when no budget is given (bytes).
const DEFAULT_MARGIN: usize = 1 << 30;

/// The running plan while a model opens on the GPU.
pub(crate) struct VramPlan {
    gpu: Arc<Gpu>,
    /// Free device memory when the plan started.
    free0: usize,
    /// Bytes the model may use.
    budget: usize,
    /// Bytes an expert cache needs at least (one layer's selection).
    min_cache: usize,
    /// The largest layer uploaded so far.
    max_layer: usize,
    /// A layer did not fit: every later one is streamed.
    full: bool,
    /// Whether the budget was given (else the expert cache keeps its own default).
    explicit: bool,
    /// Layers kept so far, and the most that may stay.
    kept: usize,
    max_layers: Option<usize>,
}

/// The GPU memory a model may use out of `free` bytes free on the device: `requested` (`--vram-gb`), at most the free
/// memory less a margin, which is also the default. Returns the budget and whether `requested` was clamped.
fn effective_budget(free: usize, requested: Option<u64>) -> (usize, bool) {
    let avail = free.saturating_sub(DEFAULT_MARGIN);
    match requested {
        Some(b) if b as usize > avail => (avail, true),
        Some(b) => (b as usize, false),
        None => (avail, false),
    }
}

/// The GPU memory budget a model opened now on `gpu` gets for `requested` (`--vram-gb`; `None`: the default), as
/// the memory plan at open will take it: for choices made before the plan starts (the spine's precision under
/// `K3_SPINE=auto`).
pub fn vram_budget(gpu: &Gpu, requested: Option<u64>) -> Result<u64> {
    let (free, _) = gpu.memory().map_err(cuda_err)?;
    Ok(effective_budget(free, requested).0 as u64)
}

impl VramPlan {
    /// Starts a plan for `budget` bytes (default: the free memory less a margin), with `min_cache` bytes kept for
    /// the expert cache. A budget above the free memory is clamped to it with a warning.
    /// At most `max_layers` layers stay (`None`: as many as fit).
    pub fn new(
        gpu: &Arc<Gpu>,
        budget: Option<u64>,
        max_layers: Option<usize>,
        min_cache: usize,
    ) -> Result<Self> {
        let (free0, total) = gpu.memory().map_err(cuda_err)?;
        let (requested, explicit) = (budget, budget.is_some());
        let (budget, clamped) = effective_budget(free0, requested);
        if clamped {
            tracing::warn!(
                "the GPU memory budget of {:.1} GiB is more than the {:.1} GiB free on {} ({:.1} GiB in all); \
                 using {:.1} GiB",
                requested.unwrap_or_default() as f64 / GIB,
                free0 as f64 / GIB,
                gpu.name(),
                total as f64 / GIB,
                budget as f64 / GIB
            );
        }
        Ok(Self {
            gpu: gpu.clone(),
            free0,
            budget,
            min_cache,
            max_layer: 0,
            full: false,
            explicit,
            kept: 0,
            max_layers,
        })
    }

    /// Device bytes in use since the plan started (after the queued work, frees included, is done: freed
    /// memory goes back to the device at a synchronisation).
    pub fn used(&self) -> Result<usize> {
        self.gpu.synchronize().map_err(cuda_err)?;
        // Weights are allocated, uploaded and freed on the weights' upload stream.
        self.gpu
            .weights_stream()
            .synchronize()
            .map_err(|e| ModelError::Device(format!("cuda: upload stream synchronize: {e}")))?;
        let (free, _) = self.gpu.memory().map_err(cuda_err)?;
        Ok(self.free0.saturating_sub(free))
    }

    /// Whether every later layer is streamed.
    pub fn full(&self) -> bool {
        self.full || self.max_layers.is_some_and(|m| self.kept >= m)
    }

    /// After a layer was uploaded (`used_before`: [`Self::used`] before it): whether it may stay, leaving room
    /// for two streamed layers, the reserve and the minimal expert cache. `false` marks the plan full.
    pub fn keep(&mut self, used_before: usize) -> Result<bool> {
        let used = self.used()?;
        self.max_layer = self.max_layer.max(used.saturating_sub(used_before));
        if used + 2 * self.max_layer + RESERVE + self.min_cache <= self.budget {
            self.kept += 1;
            return Ok(true);
        }
        self.full = true;
        Ok(false)
    }

    /// Whether streaming fits with the layers now on the device: two streamed layers (as large as the largest
    /// layer seen, the one that did not fit included), the reserve and the minimal expert cache.
    pub fn streaming_fits(&self) -> Result<bool> {
        Ok(self.used()? + 2 * self.max_layer + RESERVE + self.min_cache <= self.budget)
    }

    /// The error for a budget too small to stream at all (nothing but the head on the device).
    pub fn too_small(&self) -> Result<ModelError> {
        let used = self.used()?;
        let need = used + 2 * self.max_layer + RESERVE + self.min_cache;
        Ok(ModelError::Device(format!(
            "the GPU memory budget of {:.2} GiB is too small: the head and resident layers take {:.2} GiB, two \
                 streamed layers {:.2} GiB and the minimal expert cache and scratch {:.2} GiB (give at least \
                 {:.2} GiB with --vram-gb / K3_VRAM_GB, or run on the CPU)",
            self.budget as f64 / GIB,
            used as f64 / GIB,
            2.0 * self.max_layer as f64 / GIB,
            (RESERVE + self.min_cache) as f64 / GIB,
            need as f64 / GIB
        )))
    }

    /// Device bytes for the expert cache once the spine is placed (`streaming`: room kept for two streamed
    /// layers), or `None` when no budget was given (the cache then takes its default share of free memory).
    pub fn expert_budget(&self, streaming: bool) -> Result<Option<u64>> {
        let used = self.used()?;
        let stream_room = if streaming { 2 * self.max_layer } else { 0 };
        let room = self
            .budget
            .saturating_sub(used + stream_room + RESERVE)
            .max(self.min_cache);
        Ok((self.explicit || streaming).then_some(room as u64))
    }

    /// The budget in bytes.
    pub fn budget(&self) -> usize {
        self.budget
    }
}

const GIB: f64 = (1u64 << 30) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget is what was asked, at most the free memory less the margin, and that by default; asking for more
    /// is reported as clamped. (No GPU needed: `K3_SPINE=auto` and the plan both take it from here.)
    #[test]
    fn budget_is_asked_for_or_free_less_margin() {
        let free = 24usize << 30;
        let avail = free - DEFAULT_MARGIN;
        assert_eq!(effective_budget(free, None), (avail, false));
        assert_eq!(effective_budget(free, Some(8 << 30)), (8 << 30, false));
        assert_eq!(effective_budget(free, Some(avail as u64)), (avail, false));
        assert_eq!(
            effective_budget(free, Some(avail as u64 + 1)),
            (avail, true)
        );
        assert_eq!(effective_budget(DEFAULT_MARGIN / 2, None), (0, false));
        assert_eq!(effective_budget(DEFAULT_MARGIN / 2, Some(1)), (0, true));
    }
}
