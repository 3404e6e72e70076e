//! The CUDA backend (feature `cuda`): one device context, its streams and the kernels of `kernels/*.cu`, compiled
//! at run time by NVRTC.
//!
//! Nothing here links against CUDA: the driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so.13`) are opened with
//! `dlopen` on first use, so a binary built with the feature starts on any machine and [`Gpu::shared`] answers
//! [`QuantError::CudaUnavailable`] with the reason when there is no driver, no NVRTC or no device.
//!
//! Submodules: [`dense`] (dense weights resident on the device and their GEMM), [`moe`] (the MXFP4 routed-expert
//! kernels, all experts of a layer per launch), `upload` (large uploads through pinned staging on the weights'
//! upload stream), `host_pins` (host buffers page-locked in place, so uploads from them need no staging),
//! `kernel_cache` (the compiled kernels kept on disk per architecture), [`rows`] (a layer's activation rows up and
//! down through reused pinned buffers), [`copy_rate`] (event timing and the device copy rate benchmarks are held
//! against).

pub mod copy_rate;
pub mod dense;
mod host_pins;
mod kernel_cache;
pub mod moe;
pub mod rows;
mod upload;
pub use upload::StagingStats;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr};

use crate::error::{QuantError, Result};

/// The kernel sources, concatenated in this order before compilation (NVRTC sees no include files).
const SOURCES: [(&str, &str); 4] = [
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    (
        "moe_mxfp4.cu",
        include_str!("../../../../kernels/moe_mxfp4.cu"),
    ),
    ("dense.cu", include_str!("../../../../kernels/dense.cu")),
    (
        "attention.cu",
        include_str!("../../../../kernels/attention.cu"),
    ),
];

/// Every kernel entry point of [`SOURCES`], each with whether it takes more than the default 48 KiB of dynamic
/// shared memory (its opt-in limit is raised at load).
pub(crate) const KERNELS: [(&str, bool); 67] = [
    ("moe_mma_gate_up_t1_m2", true),
    ("moe_mma_down_t1_m2", true),
    ("moe_mma_gate_up_t2_m2", true),
    ("moe_mma_down_t2_m2", true),
    ("moe_mma_gate_up_t4_m2", true),
    ("moe_mma_down_t4_m2", true),
    ("moe_mma_gate_up_t1_m2_s4", true),
    ("moe_mma_down_t1_m2_s4", true),
    ("moe_mma_gate_up_t1_m2_nohint", true),
    ("moe_mma_down_t1_m2_nohint", true),
    ("moe_gate_up_t1", true),
    ("moe_gate_up_t2", true),
    ("moe_gate_up_t4", true),
    ("moe_gate_up_t8", true),
    ("moe_down_t1", true),
    ("moe_down_t2", true),
    ("moe_down_t4", true),
    ("moe_down_t8", true),
    ("moe_split_hilo", false),
    ("moe_gemm_gate_up_n1", false),
    ("moe_gemm_down_n1", false),
    ("moe_gemm_gate_up_n2", false),
    ("moe_gemm_down_n2", false),
    ("moe_gemm_gate_up_n4", false),
    ("moe_gemm_down_n4", false),
    ("moe_gemm_gate_up_n8", false),
    ("moe_gemm_down_n8", false),
    ("moe_gemm_gate_up_n1_s", true),
    ("moe_gemm_down_n1_s", true),
    ("moe_gemm_gate_up_n2_s", true),
    ("moe_gemm_down_n2_s", true),
    ("moe_gemm_gate_up_n4_s", true),
    ("moe_gemm_down_n4_s", true),
    ("moe_gemm_gate_up_n8_s", true),
    ("moe_gemm_down_n8_s", true),
    ("moe_fold_gate_up_n4", false),
    ("moe_fold_down_n4", false),
    ("moe_fold_gate_up_n8", true),
    ("moe_fold_down_n8", true),
    ("moe_split_hilo_k", false),
    ("moe_wg_gate_up_n8", true),
    ("moe_wg_down_n8", true),
    ("moe_wg_gate_up_n8_f2", true),
    ("moe_wg_down_n8_f2", true),
    ("moe_wgw_gate_up_n8", true),
    ("moe_wgw_down_n8", true),
    ("moe_wgw_gate_up_n8_f2", true),
    ("moe_wgw_down_n8_f2", true),
    ("moe_wgw_gate_up_n4", true),
    ("moe_wgw_down_n4", true),
    ("moe_wgw_gate_up_n4_f2", true),
    ("moe_wgw_down_n4_f2", true),
    ("moe_combine", false),
    ("dense_gemm_f32", false),
    ("dense_gemm_bf16", false),
    ("dense_gemm_multi_f32", false),
    ("dense_gemm_multi_bf16", false),
    ("dense_quantise_i16", false),
    ("dense_gemm_int8", false),
    ("dense_gemm_multi_int8", false),
    ("copy16", false),
    ("mma_peak", false),
    ("copy_f32", false),
    ("kda_layer", true),
    ("mla_norm_rows", false),
    ("mla_attend", false),
    ("mla_absorb", false),
];

/// Whether `name` is an entry point of [`KERNELS`] that takes more than 48 KiB of shared memory.
#[cfg(test)]
pub(crate) fn is_big_smem_kernel(name: &str) -> bool {
    KERNELS.iter().any(|&(n, big)| n == name && big)
}

/// The source text NVRTC compiles (all of `kernels/`, in order).
pub fn kernel_source() -> String {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("// ---- kernels/{name}\n"));
        src.push_str(text);
        src.push('\n');
    }
    src
}

/// The module of `source`'s kernels for `arch`, through the cache in `cache_dir`. A cached cubin the driver refuses
/// is dropped from the cache and the kernels are compiled afresh.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    source: &str,
    arch: (i32, i32),
    cache_dir: Option<&std::path::Path>,
) -> Result<(Arc<CudaModule>, KernelInit)> {
    let kernel_cache::CompiledKernels {
        cubin,
        compile_secs,
        from_cache,
    } = kernel_cache::kernels(source, arch, cache_dir)?;
    let loading = std::time::Instant::now();
    let load = |cubin: Vec<u8>| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin));
    let (module, compile_secs, from_cache) = match (load(cubin), cache_dir) {
        (Ok(m), _) => (m, compile_secs, from_cache),
        (Err(e), Some(dir)) if from_cache => {
            tracing::warn!("the driver refused the cached kernels ({e}); compiling them again");
            kernel_cache::forget(source, arch, dir);
            let fresh = kernel_cache::kernels(source, arch, Some(dir))?;
            let m = load(fresh.cubin).map_err(|e| driver_err("loading the kernel module", e))?;
            (m, fresh.compile_secs, fresh.from_cache)
        }
        (Err(e), _) => return Err(driver_err("loading the kernel module", e)),
    };
    let init = KernelInit {
        compile_secs,
        load_secs: loading.elapsed().as_secs_f64(),
        from_cache,
    };
    Ok((module, init))
}

/// Wraps a driver error with what was being done.
pub(crate) fn driver_err(what: &str, e: impl std::fmt::Display) -> QuantError {
    QuantError::Cuda(format!("{what}: {e}"))
}

/// Whether the CUDA driver and NVRTC libraries can be opened, without initialising anything. `Err` says which
/// library is missing.
pub fn probe_libraries() -> Result<()> {
    // SAFETY: these only try `dlopen` on the candidate library names and close them again.
    let (driver, nvrtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(QuantError::CudaUnavailable(
            "the NVIDIA driver library libcuda.so.1 was not found (no NVIDIA GPU driver on this machine)"
                .to_string(),
        ));
    }
    if !nvrtc {
        return Err(QuantError::CudaUnavailable(
            "the NVRTC library libnvrtc.so.13 was not found; add the directory that holds it (for example \
             site-packages/nvidia/cu13/lib of the cuda-toolkit Python wheels) to LD_LIBRARY_PATH"
                .to_string(),
        ));
    }
    Ok(())
}

/// One CUDA device with its context, a compute stream, two upload streams (experts, weights) and the compiled
/// kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    /// Weights' uploads ([`Self::upload_large`], [`Self::upload_ahead`]). Apart from the experts' stream, which waits
    /// for the compute stream before it overwrites a cache slot: a streamed layer's uploads queued behind such a
    /// wait would start only when the layer before it had computed.
    weights_stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: HashMap<&'static str, CudaFunction>,
    name: String,
    /// Compute capability (major, minor).
    arch: (i32, i32),
    smem_optin: usize,
    /// How the kernels were obtained when the device was opened.
    init: KernelInit,
    /// Blocks of the dense GEMM the whole device runs at once (SMs × blocks per SM): what its column split is
    /// chosen against ([`dense::DeviceMatrix`]).
    dense_slots: usize,
    /// Whether the device shares the host's address space (unified addressing): its kernels then read and write
    /// page-locked host memory through the host's pointers ([`rows`]).
    unified: bool,
    staging: upload::Staging,
    host_pins: host_pins::HostPins,
    /// The input and output buffers of products of host rows ([`dense::DeviceMatrix::gemm`]), reused from call to
    /// call (a device allocation costs 5–20 µs, more than a small product).
    pub(crate) host_gemm: std::sync::Mutex<dense::HostGemmBuffers>,
    /// The quantised input of int8 products ([`dense::DeviceMatrix`]), reused from call to call.
    int8_inputs: std::sync::Mutex<dense::Int8Inputs>,
    /// The pinned buffers of activation-row copies ([`Gpu::row_copies`]).
    rows: std::sync::Mutex<rows::RowStaging>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("name", &self.name).finish()
    }
}

/// How a device's kernels were obtained when it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KernelInit {
    /// Seconds NVRTC took to compile them (0 when they came from the cache).
    pub compile_secs: f64,
    /// Seconds the driver took to load them.
    pub load_secs: f64,
    /// Whether the compiled kernels came from the on-disk cache.
    pub from_cache: bool,
}

impl Gpu {
    /// The process-wide device 0, opened on first use with its kernels compiled (no cache). Later calls return the
    /// same device, or the same error.
    pub fn shared() -> Result<Arc<Gpu>> {
        Self::shared_with_cache(None)
    }

    /// [`Self::shared`], the first call taking the compiled kernels from `kernel_cache` (a directory) when it holds
    /// them for this device's architecture and this build, and storing them there otherwise. Later calls return
    /// the device the first one opened, whatever their directory.
    pub fn shared_with_cache(kernel_cache: Option<&std::path::Path>) -> Result<Arc<Gpu>> {
        static GPU: OnceLock<std::result::Result<Arc<Gpu>, QuantError>> = OnceLock::new();
        GPU.get_or_init(|| Gpu::open(0, kernel_cache).map(Arc::new))
            .clone()
    }

    /// Opens device `ordinal` and loads the kernels compiled for its architecture: from `kernel_cache` when it holds
    /// them, else compiled by NVRTC (and stored there when a directory is given).
    pub fn open(ordinal: usize, kernel_cache: Option<&std::path::Path>) -> Result<Gpu> {
        probe_libraries()?;
        let unavailable = |what: &str, e: cudarc::driver::DriverError| {
            QuantError::CudaUnavailable(format!("{what}: {e}"))
        };
        let n =
            CudaContext::device_count().map_err(|e| unavailable("cuInit/cuDeviceGetCount", e))?;
        if n <= ordinal as i32 {
            return Err(QuantError::CudaUnavailable(format!(
                "no CUDA device {ordinal} (the driver sees {n})"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable("creating the context", e))?;
        // Ordering between our two streams is explicit (events); cudarc's per-buffer tracking would only add
        // synchronisation we do not need.
        // SAFETY: every buffer used on both streams is ordered by an event recorded on the writer's stream and
        // waited for on the reader's (see `moe` and the model's expert cache).
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_err("reading the compute capability", e))?;
        let smem_optin = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| driver_err("reading the shared-memory limit", e))?
            .max(48 * 1024) as usize
            // Headroom for the kernels' static shared memory (a few bytes).
            - 1024;
        let source = kernel_source();
        let (module, init) = load_kernels(&ctx, &source, (major, minor), kernel_cache)?;
        let mut functions = HashMap::new();
        for (name, big_smem) in KERNELS {
            let f = module
                .load_function(name)
                .map_err(|e| driver_err(&format!("kernel {name}"), e))?;
            if big_smem {
                // The opt-in limit covers static and dynamic shared memory together.
                let static_smem = f.shared_size_bytes().unwrap_or(0).max(0) as usize;
                f.set_attribute(
                    CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    (smem_optin - static_smem.min(smem_optin)) as i32,
                )
                .map_err(|e| {
                    driver_err(&format!("raising the shared-memory limit of {name}"), e)
                })?;
            }
            functions.insert(name, f);
        }
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| driver_err("reading the SM count", e))?
            .max(1) as usize;
        let per_sm = match functions.get("dense_gemm_bf16") {
            Some(f) => f
                .occupancy_max_active_blocks_per_multiprocessor(
                    dense::BLOCK_THREADS as u32,
                    0,
                    None,
                )
                .map_err(|e| driver_err("reading the dense GEMM's occupancy", e))?
                .max(1) as usize,
            None => 1,
        };
        let unified = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
            )
            .map_err(|e| driver_err("reading unified addressing", e))?
            == 1;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err("creating the compute stream", e))?;
        let copy_stream = ctx
            .new_stream()
            .map_err(|e| driver_err("creating the upload stream", e))?;
        let weights_stream = ctx
            .new_stream()
            .map_err(|e| driver_err("creating the weights' upload stream", e))?;
        Ok(Gpu {
            ctx,
            stream,
            copy_stream,
            weights_stream,
            _module: module,
            functions,
            name: format!("{name} (sm_{major}{minor})"),
            arch: (major, minor),
            smem_optin,
            init,
            dense_slots: sms * per_sm,
            unified,
            staging: upload::Staging::default(),
            host_pins: host_pins::HostPins::default(),
            host_gemm: std::sync::Mutex::default(),
            int8_inputs: std::sync::Mutex::default(),
            rows: std::sync::Mutex::default(),
        })
    }

    /// Blocks of the dense GEMM the whole device holds at once.
    pub fn dense_slots(&self) -> usize {
        self.dense_slots
    }

    /// The device's name and architecture, e.g. `NVIDIA H200 (sm_90)`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How the kernels were obtained when the device was opened (compile and load seconds, from the cache or not).
    pub fn kernel_init(&self) -> KernelInit {
        self.init
    }

    /// The context (bind it before using the device from another thread: [`Self::bind`]).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))
    }

    /// The stream every kernel runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream host-to-device uploads of experts run on (overlapping the compute stream).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy_stream
    }

    /// The stream weights are uploaded, and their device buffers allocated and freed, on.
    pub fn weights_stream(&self) -> &Arc<CudaStream> {
        &self.weights_stream
    }

    /// The compute capability, (9, 0) on Hopper.
    pub fn arch(&self) -> (i32, i32) {
        self.arch
    }

    /// The most dynamic shared memory one block may use.
    pub fn smem_limit(&self) -> usize {
        self.smem_optin
    }

    /// A kernel by name.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| QuantError::Cuda(format!("no kernel named {name}")))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| driver_err("cuMemGetInfo", e))
    }

    /// Copies `src` to a new device buffer on the compute stream.
    pub fn upload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(src)
            .map_err(|e| driver_err("host-to-device copy", e))
    }

    /// Copies `src` to a new device buffer on the weights' upload stream, for weights built on the host while the
    /// compute stream may still be busy (a streamed layer is built one ahead of the compute). A copy on the compute
    /// stream would queue behind its kernels, and a copy from pageable memory larger than the driver's staging
    /// returns only once its DMA has run: the builder would wait for the layer before its own. The compute stream
    /// must wait for [`Self::uploads_done`]'s event before it reads the buffer; the buffer is freed on the weights'
    /// stream, so its last reader must be done by then, as for [`Self::upload_large`]'s.
    pub fn upload_ahead<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>> {
        self.weights_stream
            .clone_htod(src)
            .map_err(|e| driver_err("host-to-device copy on the weights' upload stream", e))
    }

    /// An event recorded on the weights' upload stream: complete once every upload queued there before it
    /// ([`Self::upload_ahead`], [`Self::upload_large`]) has landed.
    pub fn uploads_done(&self) -> Result<cudarc::driver::CudaEvent> {
        self.weights_stream
            .record_event(None)
            .map_err(|e| driver_err("recording an upload", e))
    }

    /// Makes the compute stream wait for `ready` (an event of [`Self::uploads_done`]) unless it has completed.
    pub fn wait_uploaded(&self, ready: &cudarc::driver::CudaEvent) -> Result<()> {
        if ready.is_complete() {
            return Ok(());
        }
        self.stream
            .wait(ready)
            .map_err(|e| driver_err("waiting for a weight upload", e))
    }

    /// A new device buffer of `len` zeroed elements on the compute stream.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len.max(1))
            .map_err(|e| driver_err("device allocation", e))
    }

    /// Copies a device buffer back (waits for the compute stream).
    pub fn download<T: DeviceRepr>(&self, src: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(src)
            .map_err(|e| driver_err("device-to-host copy", e))
    }

    /// Waits for all work on the compute stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_err("stream synchronize", e))
    }
}

/// The device address of a buffer (for kernels that take tables of addresses).
pub fn device_address<T>(stream: &CudaStream, buf: &CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (ptr, _sync) = buf.device_ptr(stream);
    ptr
}

/// The buffer in `slot`, reallocated first when it holds fewer than `len` values (scratch reused from call to call:
/// a device allocation costs 5–20 µs; the contents are unspecified, every use writes before it reads).
pub fn sized<'a, T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    slot: &'a mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<&'a mut CudaSlice<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        *slot = Some(gpu.zeros::<T>(len)?);
    }
    slot.as_mut()
        .ok_or_else(|| QuantError::Cuda("scratch buffer missing".to_string()))
}

/// Two device events around work queued on the compute stream, for the device's time of that work (events cost a
/// few microseconds; made once and recorded again for every span).
pub struct StreamTimer {
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

impl StreamTimer {
    /// A timer on `gpu`'s context.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ev = || {
            gpu.ctx
                .new_event(flags)
                .map_err(|e| driver_err("creating an event", e))
        };
        Ok(Self {
            start: ev()?,
            end: ev()?,
        })
    }

    /// Marks where the timed work starts on the compute stream.
    pub fn start(&self, gpu: &Gpu) -> Result<()> {
        self.start
            .record(&gpu.stream)
            .map_err(|e| driver_err("recording an event", e))
    }

    /// Marks where it ends.
    pub fn stop(&self, gpu: &Gpu) -> Result<()> {
        self.end
            .record(&gpu.stream)
            .map_err(|e| driver_err("recording an event", e))
    }

    /// Marks where timed work starts on `stream` (another stream than the compute stream: the upload stream).
    pub fn start_on(&self, stream: &CudaStream) -> Result<()> {
        self.start
            .record(stream)
            .map_err(|e| driver_err("recording an event", e))
    }

    /// Marks where the work timed from [`Self::start_on`] ends on the same `stream`.
    pub fn stop_on(&self, stream: &CudaStream) -> Result<()> {
        self.end
            .record(stream)
            .map_err(|e| driver_err("recording an event", e))
    }

    /// The device time from [`Self::start`] to [`Self::stop`] (waits for the stream to pass the end).
    pub fn elapsed(&self) -> Result<std::time::Duration> {
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(|e| driver_err("reading an event's time", e))?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ))
    }
}

/// Ceiling division for launch sizes.
pub(crate) fn div_ceil(a: usize, b: usize) -> u32 {
    a.div_ceil(b.max(1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels compile for Hopper's arch-specific target (the warpgroup mmas) and for Ampere (without them);
    /// NVRTC only: no GPU needed, but libnvrtc must be on the library path.
    #[test]
    fn kernels_compile_with_nvrtc() {
        for arch in ["compute_90a", "compute_80"] {
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec![
                    format!("--gpu-architecture={arch}"),
                    "--std=c++17".to_string(),
                ],
                use_fast_math: Some(false),
                ..Default::default()
            };
            let ptx = match cudarc::nvrtc::compile_ptx_with_opts(kernel_source(), opts) {
                Ok(p) => p.to_src(),
                Err(e) => panic!("NVRTC failed for {arch}: {e:?}"),
            };
            assert_eq!(
                ptx.contains("wgmma.mma_async"),
                arch == "compute_90a",
                "{arch}"
            );
            for (name, _) in KERNELS {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "kernel {name} missing for {arch}"
                );
            }
        }
    }
}
