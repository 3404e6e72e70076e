//! The kernels compiled once per GPU architecture and kept on disk.
//!
//! NVRTC compiles `kernels/*.cu` straight to the device's machine code (a cubin for `sm_XY`), so the driver has no
//! PTX to translate at load. The cubin is stored in a cache directory under a name made of the architecture, the
//! NVRTC version and a checksum of the source text and options; a later open of the same build on the same kind of
//! GPU loads it instead of compiling (seconds saved at every open, more on a machine whose driver cache is cold).
//!
//! An entry is a fixed header (magic, payload length, CRC-32 of the payload) and the cubin. It is written to a
//! temporary file and renamed into place, so readers see a whole entry or none; an entry whose header or checksum
//! does not hold is ignored and rewritten. The cache is an optimisation only: when the directory cannot be read or
//! written, the kernels are compiled and the reason is logged.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{QuantError, Result};

/// The first bytes of an entry (format version in the last byte).
const MAGIC: &[u8; 8] = b"DFCUBIN1";
/// Magic, payload length (u64 LE), CRC-32 of the payload (u32 LE).
const HEADER: usize = 8 + 8 + 4;

/// The compiled kernels and how they were obtained.
pub(crate) struct CompiledKernels {
    /// The cubin for the device's architecture.
    pub cubin: Vec<u8>,
    /// Seconds spent compiling (0 when the cache held the cubin).
    pub compile_secs: f64,
    /// Whether the cubin came from the cache.
    pub from_cache: bool,
}

/// The NVRTC options for architecture `sm_{major}{minor}`: on Hopper its arch-specific target `sm_90a`, whose
/// warpgroup mmas the `moe_wg_*` kernels use (`__CUDA_ARCH_FEAT_SM90_ALL`).
fn options(major: i32, minor: i32) -> Vec<String> {
    let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
    vec![
        format!("--gpu-architecture=sm_{major}{minor}{suffix}"),
        "--std=c++17".to_string(),
    ]
}

/// The NVRTC library's version, part of every entry's name (a different compiler may produce different code).
fn nvrtc_version() -> Result<(c_int, c_int)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are valid for the call; the library was found by `probe_libraries`.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| QuantError::Cuda(format!("reading the NVRTC version: {e:?}")))?;
    Ok((major, minor))
}

/// The cache file of `source` compiled with `opts` for `sm_{major}{minor}` by NVRTC `nvrtc`.
fn entry_name(
    source: &str,
    opts: &[String],
    (major, minor): (i32, i32),
    nvrtc: (i32, i32),
) -> String {
    let mut h = crc32fast::Hasher::new();
    h.update(source.as_bytes());
    for o in opts {
        h.update(&[0]);
        h.update(o.as_bytes());
    }
    format!(
        "kernels-sm{major}{minor}-nvrtc{}.{}-{:08x}-{}.cubin",
        nvrtc.0,
        nvrtc.1,
        h.finalize(),
        source.len()
    )
}

/// `cubin` as a cache entry (header and payload).
fn encode(cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + cubin.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(cubin).to_le_bytes());
    out.extend_from_slice(cubin);
    out
}

/// The payload of a cache entry, or why it is not a whole, intact entry.
fn decode(bytes: &[u8]) -> std::result::Result<&[u8], String> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err("not a kernel cache entry".to_string());
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().map_err(|_| "short header")?);
    let crc = u32::from_le_bytes(bytes[16..20].try_into().map_err(|_| "short header")?);
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return Err(format!(
            "{} payload bytes, the header says {len}",
            payload.len()
        ));
    }
    if crc32fast::hash(payload) != crc {
        return Err("checksum mismatch".to_string());
    }
    Ok(payload)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The cached payload at `path`, if the entry is there and intact (a damaged one is logged and ignored).
fn read_entry(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    match decode(&bytes) {
        Ok(p) => Some(p.to_vec()),
        Err(why) => {
            tracing::warn!("ignoring kernel cache entry {}: {why}", path.display());
            None
        }
    }
}

/// The lines of a successful compile's NVRTC log that name a performance loss (ptxas serialising Hopper's warpgroup
/// mmas, for example) or a warning: logged at open, and kept out of the kernels by a test.
fn performance_warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("Performance Loss") || l.contains("warning"))
        .collect()
}

/// Compiles `source` to a cubin for `sm_{major}{minor}` with NVRTC: the cubin and NVRTC's log (empty when the
/// compiler had nothing to say).
fn compile_cubin(source: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    use cudarc::nvrtc::{result, sys};
    let err = |what: &str, e: &dyn std::fmt::Debug| {
        QuantError::Cuda(format!("compiling kernels/*.cu with NVRTC: {what}: {e:?}"))
    };
    let src = CString::new(source).map_err(|e| err("the source holds a NUL byte", &e))?;
    let prog = result::create_program(&src, None).map_err(|e| err("creating the program", &e))?;
    // SAFETY: `prog` was created above and is destroyed once, below; the buffers passed to NVRTC are sized by
    // the size queries that precede them.
    unsafe {
        let log = || {
            result::get_program_log(prog)
                .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let compiled = match result::compile_program(prog, opts) {
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| err("reading the cubin size", &e))
                    .and_then(|()| {
                        let mut cubin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                            .result()
                            .map_err(|e| err("reading the cubin", &e))
                            .map(|()| (cubin, log()))
                    })
            }
            Err(e) => Err(QuantError::Cuda(format!(
                "compiling kernels/*.cu with NVRTC ({}): {e:?}\n{}",
                opts.join(" "),
                log()
            ))),
        };
        let _ = result::destroy_program(prog);
        compiled
    }
}

/// The kernels of `source` for `sm_{major}{minor}`: from `cache_dir` when it holds an intact entry for this source,
/// these options and this NVRTC, else compiled (and stored there, when a directory is given).
pub(crate) fn kernels(
    source: &str,
    arch: (i32, i32),
    cache_dir: Option<&Path>,
) -> Result<CompiledKernels> {
    let opts = options(arch.0, arch.1);
    let path: Option<PathBuf> = match cache_dir {
        Some(dir) => Some(dir.join(entry_name(source, &opts, arch, nvrtc_version()?))),
        None => None,
    };
    if let Some(cubin) = path.as_deref().and_then(read_entry) {
        return Ok(CompiledKernels {
            cubin,
            compile_secs: 0.0,
            from_cache: true,
        });
    }
    let started = Instant::now();
    let (cubin, log) = compile_cubin(source, &opts)?;
    let compile_secs = started.elapsed().as_secs_f64();
    for line in performance_warnings(&log) {
        tracing::warn!("NVRTC ({}): {line}", opts.join(" "));
    }
    if let Some(path) = &path
        && let Err(e) = write_atomic(path, &encode(&cubin))
    {
        tracing::warn!(
            "could not store the compiled kernels in {}: {e} (they are compiled again at the next open)",
            path.display()
        );
    }
    Ok(CompiledKernels {
        cubin,
        compile_secs,
        from_cache: false,
    })
}

/// Removes an entry that the driver refused to load (written by a build whose cubin the driver no longer takes),
/// so the next open compiles afresh.
pub(crate) fn forget(source: &str, arch: (i32, i32), cache_dir: &Path) {
    let Ok(nvrtc) = nvrtc_version() else { return };
    let path = cache_dir.join(entry_name(source, &options(arch.0, arch.1), arch, nvrtc));
    let _ = std::fs::remove_file(path);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's own compile for Hopper (`sm_90a`, where the warpgroup mmas are) gives a cubin and a log with no
    /// performance loss or warning, so a kernel whose `wgmma`s ptxas would serialise fails here rather than run slow
    /// on the device. NVRTC only (no GPU), but libnvrtc must be on the library path (docs/PLATFORMS.md).
    #[test]
    fn hopper_kernels_compile_without_performance_warnings() {
        let opts = options(9, 0);
        let (cubin, log) = match compile_cubin(&super::super::kernel_source(), &opts) {
            Ok(c) => c,
            Err(e) => panic!("NVRTC for {opts:?}: {e}"),
        };
        assert!(cubin.starts_with(b"\x7fELF"), "not a cubin");
        assert!(performance_warnings(&log).is_empty(), "NVRTC said:\n{log}");
    }

    #[test]
    fn performance_losses_and_warnings_are_picked_from_a_log() {
        let log = "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized \
                   in the function 'k'\nptxas info    : Used 40 registers\nall.cu(3): warning #177-D: unused\n";
        let picked = performance_warnings(log);
        assert_eq!(picked.len(), 2, "{picked:?}");
        assert!(picked[0].contains("C7518") && picked[1].contains("#177"));
        assert!(performance_warnings("ptxas info    : Used 40 registers").is_empty());
        assert!(performance_warnings("").is_empty());
    }

    #[test]
    fn an_entry_round_trips_and_damage_is_refused() {
        let cubin: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let entry = encode(&cubin);
        assert_eq!(decode(&entry).expect("intact entry"), &cubin[..]);
        let mut flipped = entry.clone();
        flipped[HEADER + 500] ^= 1;
        assert!(
            decode(&flipped)
                .expect_err("flipped bit")
                .contains("checksum")
        );
        assert!(
            decode(&entry[..entry.len() - 1])
                .expect_err("short entry")
                .contains("header says")
        );
        assert!(decode(&entry[..HEADER - 1]).is_err());
        let mut magic = entry;
        magic[0] = b'X';
        assert!(decode(&magic).is_err());
    }

    #[test]
    fn entries_are_written_whole_and_read_back() {
        let dir = std::env::temp_dir().join(format!("deltafin-kcache-{}", std::process::id()));
        let path = dir.join("sub").join("k.cubin");
        write_atomic(&path, &encode(b"cubin bytes")).expect("write");
        assert_eq!(read_entry(&path).as_deref(), Some(&b"cubin bytes"[..]));
        // A truncated entry (a crash mid-write of a non-atomic writer) is ignored, not loaded.
        let whole = std::fs::read(&path).expect("read");
        std::fs::write(&path, &whole[..whole.len() - 3]).expect("truncate");
        assert_eq!(read_entry(&path), None);
        assert!(
            std::fs::read_dir(path.parent().expect("dir"))
                .expect("list")
                .all(|e| !e
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")),
            "no temporary file is left behind"
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn the_name_changes_with_source_options_arch_and_compiler() {
        let o = options(9, 0);
        let base = entry_name("a", &o, (9, 0), (13, 0));
        assert_ne!(base, entry_name("b", &o, (9, 0), (13, 0)));
        assert_ne!(base, entry_name("a", &options(8, 0), (8, 0), (13, 0)));
        assert_ne!(base, entry_name("a", &o, (9, 0), (13, 1)));
        assert_ne!(base, entry_name("a", &["x".to_string()], (9, 0), (13, 0)));
        assert!(base.starts_with("kernels-sm90-nvrtc13.0-"));
    }
}
