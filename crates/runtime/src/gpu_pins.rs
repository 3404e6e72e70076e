//! The read pools' hook on a GPU: every I/O buffer is page-locked when it is mapped and unlocked before it is
//! unmapped, so the GPU expert cache uploads an expert, and the model a spine tensor, straight out of the buffer it
//! was read into (the DMA engine reads it; no staging copy through the CPU). See `deltafin_model::gpu` (experts)
//! and `deltafin_quant::cuda` (`host_pins`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use deltafin_quant::cuda::Gpu;
use deltafin_storage::BufferHook;

/// Page-locks read buffers for one GPU. A buffer the driver refuses stays pageable and its experts go up through
/// staging as before (said once).
#[derive(Debug)]
pub(crate) struct GpuPins {
    gpu: Arc<Gpu>,
    warned: AtomicBool,
}

impl GpuPins {
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Self {
        Self {
            gpu: Arc::clone(gpu),
            warned: AtomicBool::new(false),
        }
    }

    fn warn_once(&self, what: &str, e: &dyn std::fmt::Display) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("{what}: {e}; uploads from such buffers go through a staging copy");
        }
    }
}

impl BufferHook for GpuPins {
    fn mapped(&self, addr: usize, len: usize) {
        // SAFETY: the read pool calls this for a fresh, page-aligned mapping of its own, and calls `unmapping`
        // before it unmaps it.
        if let Err(e) = unsafe { self.gpu.pin_host(addr, len) } {
            self.warn_once("page-locking a read buffer", &e);
        }
    }

    fn unmapping(&self, addr: usize, _len: usize) {
        if let Err(e) = self.gpu.unpin_host(addr) {
            self.warn_once("unlocking a read buffer", &e);
        }
    }
}
