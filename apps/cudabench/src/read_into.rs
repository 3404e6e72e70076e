//! `read-into`: direct (O_DIRECT) reads of expert-sized spans into three kinds of host buffer, to learn which kind
//! the read pool should read into on a GPU machine: ordinary pages (huge-page advised, faulted in once), the same
//! pages page-locked in place (`cuMemHostRegister`, what the expert read pool does today), and page-locked memory
//! the driver allocates (`cuMemHostAlloc`, cached). Each thread reads random aligned spans of the file into its own
//! two buffers, alternately; the rate is bytes over wall time, per kind and thread count, in two rounds.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use cudarc::driver::sys;
use deltafin_quant::cuda::Gpu;

/// Kinds of buffer, in the order they are timed.
const KINDS: [&str; 3] = ["pageable", "registered", "hostalloc"];

/// One host buffer of a kind, freed the way it was made.
struct HostBuf {
    ptr: *mut u8,
    len: usize,
    kind: &'static str,
}

// SAFETY: the buffer is owned by one thread at a time (moved into the reading thread).
unsafe impl Send for HostBuf {}

impl HostBuf {
    fn new(kind: &'static str, len: usize) -> anyhow::Result<Self> {
        let ptr = if kind == "hostalloc" {
            let mut p = std::ptr::null_mut();
            // SAFETY: `p` receives a fresh allocation of `len` bytes; freed with cuMemFreeHost in Drop.
            unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .result()
                .map_err(|e| anyhow::anyhow!("cuMemHostAlloc: {e:?}"))?;
            p.cast::<u8>()
        } else {
            // Unmapped in Drop.
            let p = crate::host_map::map_anonymous(len, true)?;
            if kind == "registered" {
                // SAFETY: the range is mapped until Drop, which unregisters it first.
                unsafe { sys::cuMemHostRegister_v2(p, len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
                    .result()
                    .map_err(|e| anyhow::anyhow!("cuMemHostRegister: {e:?}"))?;
            }
            p.cast::<u8>()
        };
        // Every page faulted in before timing.
        // SAFETY: `ptr` is valid for `len` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Self { ptr, len, kind })
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: valid for `len` bytes, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: freed as it was allocated, once.
        unsafe {
            match self.kind {
                "hostalloc" => {
                    let _ = sys::cuMemFreeHost(self.ptr.cast());
                }
                "registered" => {
                    let _ = sys::cuMemHostUnregister(self.ptr.cast());
                    libc::munmap(self.ptr.cast(), self.len);
                }
                _ => {
                    libc::munmap(self.ptr.cast(), self.len);
                }
            }
        }
    }
}

/// Reads `total` bytes of random `span`-byte pieces of `file` with `threads` threads into buffers of `kind`;
/// bytes per second.
fn rate(
    path: &Path,
    kind: &'static str,
    span: usize,
    threads: usize,
    total: u64,
) -> anyhow::Result<f64> {
    let size = std::fs::metadata(path)?.len();
    let span = span.next_multiple_of(4096);
    anyhow::ensure!(size > span as u64 * 4, "{} is too small", path.display());
    let slots = (size - span as u64) / 4096;
    let per_thread = (total / span as u64 / threads as u64).max(1);
    let mut bufs = Vec::with_capacity(threads);
    for _ in 0..threads {
        bufs.push([HostBuf::new(kind, span)?, HostBuf::new(kind, span)?]);
    }
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for (t, mut pair) in bufs.drain(..).enumerate() {
            handles.push(s.spawn(move || -> anyhow::Result<()> {
                let f = File::options()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)?;
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                for i in 0..per_thread {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % slots) * 4096;
                    let buf = pair[(i % 2) as usize].as_mut_slice();
                    let mut done = 0;
                    while done < buf.len() {
                        let n = f.read_at(&mut buf[done..], off + done as u64)?;
                        anyhow::ensure!(n > 0, "short read at {off}");
                        done += n;
                    }
                }
                Ok(())
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
        }
        Ok(())
    })?;
    Ok((per_thread * threads as u64 * span as u64) as f64 / started.elapsed().as_secs_f64())
}

/// Runs `read-into` on `file` and prints one JSON line per round, kind and thread count.
pub fn read_into(
    file: &Path,
    span: usize,
    threads: &[usize],
    gib: f64,
    rounds: usize,
) -> anyhow::Result<()> {
    // The context must exist for the driver's host allocations and registrations.
    let gpu = Gpu::shared()?;
    gpu.bind()?;
    let total = (gib * (1u64 << 30) as f64) as u64;
    for round in 1..=rounds.max(1) {
        for &t in threads {
            for kind in KINDS {
                let r = rate(file, kind, span, t.max(1), total)?;
                println!(
                    "{{\"round\":{round},\"kind\":\"{kind}\",\"threads\":{t},\"gb_s\":{:.2}}}",
                    r / 1e9
                );
            }
        }
    }
    Ok(())
}
