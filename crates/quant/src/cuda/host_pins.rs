//! Host memory page-locked in place (`cuMemHostRegister`), so a copy out of it runs as the upload stream's DMA
//! straight from where the bytes were read, without a pinned staging copy.
//!
//! The read pool's I/O buffers are long-lived and reused, so each is registered once, when it is mapped, and
//! unregistered before it is unmapped (the runtime's read-pool hook calls [`Gpu::pin_host`] and
//! [`Gpu::unpin_host`]). [`Gpu::is_pinned`] tells an upload whether its source lies inside one registered range; a
//! copy from such a range returns before the DMA has read it, so the uploader keeps the bytes alive until the copy's
//! event has completed.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::{Gpu, driver_err};
use crate::error::{QuantError, Result};

/// Registered ranges of one device: start address → length.
#[derive(Debug, Default)]
pub(crate) struct HostPins {
    ranges: Mutex<BTreeMap<usize, usize>>,
}

impl HostPins {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        // The map stays consistent between statements; a panic elsewhere does not poison it.
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Gpu {
    /// Page-locks `addr..addr + len` for this device's copies (`cuMemHostRegister`, portable to every context).
    ///
    /// # Safety
    /// The range must be one mapping of the caller's, mapped and page-aligned, and stay mapped until
    /// [`Self::unpin_host`] is called with `addr`; it must not overlap a range already registered.
    pub unsafe fn pin_host(&self, addr: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Err(QuantError::Cuda("pinning an empty host range".to_string()));
        }
        self.bind()?;
        // SAFETY: the caller guarantees the range is mapped and stays so until it is unregistered.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(
                addr as *mut std::ffi::c_void,
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        rc.result()
            .map_err(|e| driver_err("page-locking a read buffer", e))?;
        self.host_pins.lock().insert(addr, len);
        Ok(())
    }

    /// Unregisters the range [`Self::pin_host`] registered at `addr` (nothing when none was). Every copy out of it
    /// must have completed.
    pub fn unpin_host(&self, addr: usize) -> Result<()> {
        if self.host_pins.lock().remove(&addr).is_none() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `addr` was registered by `pin_host` and is still mapped (the caller unpins before unmapping).
        let rc = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
        rc.result()
            .map_err(|e| driver_err("unlocking a read buffer", e))
    }

    /// Whether all of `bytes` lie inside one range registered by [`Self::pin_host`].
    pub fn is_pinned(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as usize;
        let pins = self.host_pins.lock();
        pins.range(..=start)
            .next_back()
            .is_some_and(|(&a, &l)| start + bytes.len() <= a + l)
    }

    /// Bytes registered now.
    pub fn pinned_bytes(&self) -> u64 {
        self.host_pins.lock().values().map(|&l| l as u64).sum()
    }
}
