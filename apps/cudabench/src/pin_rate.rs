//! `pin-rate`: how fast fresh host buffers can be page-locked (`cuMemHostRegister`), as the read pools' GPU hook
//! does for every buffer it maps. A host tier of tens of gigabytes is thousands of such buffers at an open, so this
//! rate bounds the open. Modes: `fresh` registers untouched pages (the driver faults them in, zero-filling them,
//! inside the call); `prefault` first faults them in on the registering thread (`MADV_POPULATE_WRITE`, or a write
//! to every page where the kernel lacks it) and then registers; `touch` only faults them in (the zero-filling alone).
//! Each thread maps and processes its share of the buffers; the rate is bytes over wall time.
//!
//! `upload-from`: what the link gives once the buffers are page-locked, by kind of source (driver-allocated, or
//! registered mappings on huge or 4 KiB pages) and by how many streams copy at once (a streamed layer's weights and
//! the experts go up on two).

use std::time::Instant;

use cudarc::driver::sys;
use deltafin_quant::cuda::Gpu;

use crate::host_map::map_anonymous;

/// One host buffer: a mapping, unregistered (when registered) and unmapped on drop, or driver-allocated pinned
/// memory, freed by the driver.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
    registered: bool,
    hostalloc: bool,
}

// SAFETY: a mapping is owned by one thread at a time.
unsafe impl Send for Mapping {}

impl Mapping {
    /// A fresh anonymous mapping of `len` bytes ([`map_anonymous`]), not registered.
    fn mapped(len: usize, huge: bool) -> anyhow::Result<Self> {
        Ok(Self {
            ptr: map_anonymous(len, huge)?,
            len,
            registered: false,
            hostalloc: false,
        })
    }

    /// Page-locks the mapping in place (`cuMemHostRegister`); dropping it unregisters it.
    fn register(&mut self) -> anyhow::Result<()> {
        // SAFETY: the range stays mapped until `self` drops, which unregisters it first.
        unsafe { sys::cuMemHostRegister_v2(self.ptr, self.len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| anyhow::anyhow!("cuMemHostRegister: {e:?}"))?;
        self.registered = true;
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: freed once, as it was made.
        unsafe {
            if self.hostalloc {
                let _ = sys::cuMemFreeHost(self.ptr);
                return;
            }
            if self.registered {
                let _ = sys::cuMemHostUnregister(self.ptr);
            }
            libc::munmap(self.ptr, self.len);
        }
    }
}

/// Faults `len` bytes at `p` in, writable: `MADV_POPULATE_WRITE`, or one write per 4 KiB page where the kernel
/// refuses it.
fn prefault(p: *mut libc::c_void, len: usize) {
    // SAFETY: the range is a fresh private anonymous mapping of `len` bytes.
    if unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) } != 0 {
        for off in (0..len).step_by(4096) {
            // SAFETY: within the mapping; a volatile write so the touch is not optimised away.
            unsafe { std::ptr::write_volatile(p.cast::<u8>().add(off), 0) };
        }
    }
}

/// Maps (huge-page advised), optionally faults in and registers one buffer; seconds spent faulting and
/// registering.
fn one(len: usize, mode: &str) -> anyhow::Result<(Mapping, f64, f64)> {
    let mut m = Mapping::mapped(len, true)?;
    let t = Instant::now();
    if mode != "fresh" {
        prefault(m.ptr, len);
    }
    let faulted = t.elapsed().as_secs_f64();
    let t = Instant::now();
    if mode != "touch" {
        m.register()?;
    }
    Ok((m, faulted, t.elapsed().as_secs_f64()))
}

/// For each mode and thread count: `gib` GiB of `mib`-MiB buffers mapped and processed by the threads, then freed
/// (not timed). Prints one JSON line each, in `rounds` rounds.
pub fn pin_rate(
    mib: usize,
    gib: f64,
    threads: &[usize],
    modes: &[String],
    rounds: usize,
) -> anyhow::Result<()> {
    let gpu = Gpu::shared()?;
    let len = mib.max(2) << 20;
    let count = ((gib * (1u64 << 30) as f64) / len as f64).ceil().max(1.0) as usize;
    for round in 0..rounds.max(1) {
        for mode in modes {
            anyhow::ensure!(
                ["fresh", "prefault", "touch"].contains(&mode.as_str()),
                "unknown mode {mode} (fresh, prefault, touch)"
            );
            for &n in threads {
                let n = n.max(1);
                let started = Instant::now();
                let results = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..n)
                        .map(|t| {
                            let gpu = &gpu;
                            s.spawn(move || -> anyhow::Result<(Vec<Mapping>, f64, f64)> {
                                gpu.bind()?;
                                let mut kept = Vec::new();
                                let (mut faulting, mut registering) = (0.0, 0.0);
                                for _ in (t..count).step_by(n) {
                                    let (m, f, r) = one(len, mode)?;
                                    faulting += f;
                                    registering += r;
                                    kept.push(m);
                                }
                                Ok((kept, faulting, registering))
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().map_err(|_| anyhow::anyhow!("a thread panicked"))?)
                        .collect::<anyhow::Result<Vec<_>>>()
                })?;
                let wall = started.elapsed().as_secs_f64();
                let faulting: f64 = results.iter().map(|r| r.1).sum();
                let registering: f64 = results.iter().map(|r| r.2).sum();
                let bytes = (count * len) as f64;
                println!(
                    "{{\"round\":{round},\"mode\":\"{mode}\",\"threads\":{n},\"buffer_mib\":{mib},\"gib\":{:.2},\
                     \"gb_s\":{:.2},\"wall_s\":{wall:.3},\"fault_thread_s\":{faulting:.3},\
                     \"register_thread_s\":{registering:.3}}}",
                    bytes / (1u64 << 30) as f64,
                    bytes / wall / 1e9,
                );
                drop(results);
            }
        }
    }
    Ok(())
}

/// A device buffer and a stream of its own, freed on drop.
struct Lane {
    dev: sys::CUdeviceptr,
    stream: sys::CUstream,
}

impl Lane {
    fn new(len: usize) -> anyhow::Result<Self> {
        let mut dev = 0;
        // SAFETY: `dev` receives a fresh allocation, freed in Drop.
        unsafe { sys::cuMemAlloc_v2(&mut dev, len) }
            .result()
            .map_err(|e| anyhow::anyhow!("cuMemAlloc: {e:?}"))?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: `stream` receives a fresh stream, destroyed in Drop.
        unsafe { sys::cuStreamCreate(&mut stream, 1) }
            .result()
            .map_err(|e| anyhow::anyhow!("cuStreamCreate: {e:?}"))?;
        Ok(Self { dev, stream })
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // SAFETY: made in `new`, freed once; nothing is queued on the stream any more.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.stream);
            let _ = sys::cuStreamDestroy_v2(self.stream);
            let _ = sys::cuMemFree_v2(self.dev);
        }
    }
}

/// A host source of `len` bytes: driver-allocated pinned memory (`hostalloc`), or a mapping (huge-page advised or
/// not) faulted in and registered.
fn source(kind: &str, len: usize) -> anyhow::Result<Mapping> {
    if kind == "hostalloc" {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` receives a fresh allocation, freed by the driver when the `Mapping` drops.
        unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .result()
            .map_err(|e| anyhow::anyhow!("cuMemHostAlloc: {e:?}"))?;
        // SAFETY: `p` is valid for `len` writable bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 1, len) };
        return Ok(Mapping {
            ptr: p,
            len,
            registered: false,
            hostalloc: true,
        });
    }
    let mut m = Mapping::mapped(len, kind != "registered-4k")?;
    // SAFETY: the mapping is valid for `len` writable bytes.
    unsafe { std::ptr::write_bytes(m.ptr.cast::<u8>(), 1, len) };
    m.register()?;
    Ok(m)
}

/// Host-to-device rates from each kind of page-locked source: `mib` MiB a copy, medians of `reps` wall-timed
/// copies (after one warm-up), on one stream, and on `lanes` streams at once (each its own source and device
/// buffer; the rate is all their bytes over the wall time). Prints one JSON line per kind and lane count.
pub fn upload_from(
    mib: usize,
    reps: usize,
    kinds: &[String],
    lanes: &[usize],
) -> anyhow::Result<()> {
    let gpu = Gpu::shared()?;
    gpu.bind()?;
    let len = mib.max(2) << 20;
    for kind in kinds {
        anyhow::ensure!(
            ["hostalloc", "registered", "registered-4k"].contains(&kind.as_str()),
            "unknown source {kind} (hostalloc, registered, registered-4k)"
        );
        for &n in lanes {
            let n = n.max(1);
            let mut sources = Vec::with_capacity(n);
            for _ in 0..n {
                sources.push(source(kind, len)?);
            }
            let lanes_made = (0..n)
                .map(|_| Lane::new(len))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let mut rates = Vec::with_capacity(reps);
            for rep in 0..=reps.max(1) {
                let t = Instant::now();
                for (src, lane) in sources.iter().zip(&lanes_made) {
                    // SAFETY: both ranges hold `len` bytes and outlive the copy (synchronised below).
                    unsafe { sys::cuMemcpyHtoDAsync_v2(lane.dev, src.ptr, len, lane.stream) }
                        .result()
                        .map_err(|e| anyhow::anyhow!("cuMemcpyHtoDAsync: {e:?}"))?;
                }
                for lane in &lanes_made {
                    // SAFETY: a live stream of ours.
                    unsafe { sys::cuStreamSynchronize(lane.stream) }
                        .result()
                        .map_err(|e| anyhow::anyhow!("cuStreamSynchronize: {e:?}"))?;
                }
                if rep > 0 {
                    rates.push((n * len) as f64 / t.elapsed().as_secs_f64());
                }
            }
            rates.sort_by(f64::total_cmp);
            println!(
                "{{\"source\":\"{kind}\",\"streams\":{n},\"mib\":{mib},\"gb_s\":{:.2},\"min_gb_s\":{:.2},\
                 \"max_gb_s\":{:.2}}}",
                rates[rates.len() / 2] / 1e9,
                rates[0] / 1e9,
                rates[rates.len() - 1] / 1e9
            );
            // The copies are done (synchronised), so the sources can go.
            drop(lanes_made);
            drop(sources);
        }
    }
    Ok(())
}
