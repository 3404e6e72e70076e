//! `deltafin-cudabench`: measurements for the CUDA backend, run on the GPU machine (see docs/PERFORMANCE.md).
//!
//! - `moe-bw`: the MXFP4 MoE kernels on 16 experts of K3's real shape against a device-to-device copy in the
//!   same process, for several token counts.
//! - `dense-bw`: the dense (spine) GEMM at K3's attention shapes (and KDA's four input products in one launch)
//!   against a device copy, for several token counts.
//! - `kda-bw`: one launch of `kda_layer` (a KDA layer between its products) at K3's shape against a device copy.
//! - `synth`: writes a synthetic K3-architecture model (`large` has K3's real expert shape).
//! - `decode`: decode seconds per token on the CPU and on CUDA, alternating, in one process.
//! - `read-into`: direct reads of expert-sized spans into pageable, registered and driver-allocated pinned buffers.
//! - `pin-rate`: how fast fresh host buffers are page-locked, with and without faulting their pages in first.
//! - `upload-from`: host-to-device copy rates from driver-allocated and registered pinned memory, one stream or more.
//!
//! Built without the `cuda` feature it only says so.

#[cfg(feature = "cuda")]
mod bench;
#[cfg(all(feature = "cuda", target_os = "linux"))]
mod host_map;
#[cfg(feature = "cuda")]
mod kda;
#[cfg(all(feature = "cuda", target_os = "linux"))]
mod pin_rate;
#[cfg(all(feature = "cuda", target_os = "linux"))]
mod read_into;

use clap::{Parser, Subcommand};

/// CUDA checks and benchmarks for deltafin.
#[derive(Parser, Debug)]
#[command(name = "deltafin-cudabench", about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// MoE kernel bandwidth against a device-to-device copy.
    MoeBw {
        /// Experts per launch.
        #[arg(long, default_value_t = 16)]
        experts: usize,
        /// Token counts (every expert gets all of them).
        #[arg(long, default_value = "1,2,4,8,16,64", value_delimiter = ',')]
        tokens: Vec<usize>,
        /// Timed repetitions per size (median reported).
        #[arg(long, default_value_t = 30)]
        reps: usize,
        /// Kernel families to time (tensor, gemm, gemm4-ldg, gemm8, gemm8-ldg, fold, fold4, tiles, tensor-s4,
        /// tensor-nohint, simt); each one's output is compared with the first one's.
        #[arg(long, default_value = "tensor,fold,gemm,tiles", value_delimiter = ',')]
        kernels: Vec<String>,
    },
    /// Host-to-device upload rate: the engine's staged uploads (`Gpu::upload_large`) and plain pageable ones,
    /// against copies from pinned memory (the link's rate) in the same process.
    UploadBw {
        /// MiB per upload (a streamed K3 layer is about 1,270).
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Timed repetitions per kind (median reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
    },
    /// The dense (spine) GEMM at K3's attention shapes (bf16, or the int8 spine's rows) against a device copy.
    DenseBw {
        /// Token counts.
        #[arg(long, default_value = "1,3,8", value_delimiter = ',')]
        tokens: Vec<usize>,
        /// Timed repetitions per size (median reported).
        #[arg(long, default_value_t = 50)]
        reps: usize,
        /// Column splits to time (0: each launch's own choice, as the engine runs it).
        #[arg(long, default_value = "0", value_delimiter = ',')]
        splits: Vec<usize>,
        /// Weight precisions to time: bf16, int8.
        #[arg(long, default_value = "bf16", value_delimiter = ',')]
        kinds: Vec<String>,
    },
    /// `kda_layer` (a KDA layer between its input and output products) at K3's shape against a device copy.
    KdaBw {
        /// Token counts.
        #[arg(long, default_value = "1,3,64", value_delimiter = ',')]
        tokens: Vec<usize>,
        /// Timed repetitions per size (median reported).
        #[arg(long, default_value_t = 200)]
        reps: usize,
    },
    /// Direct reads of random spans of a file into pageable, registered (`cuMemHostRegister`) and driver-allocated
    /// (`cuMemHostAlloc`) host buffers (Linux).
    ReadInto {
        /// The file read (a large file of holes measures the buffers, not the disk).
        #[arg(long)]
        file: std::path::PathBuf,
        /// Bytes per read (default: one K3 expert).
        #[arg(long, default_value_t = 17_547_264)]
        span: usize,
        /// Reader thread counts.
        #[arg(long, default_value = "4,8", value_delimiter = ',')]
        threads: Vec<usize>,
        /// GiB read per kind and thread count.
        #[arg(long, default_value_t = 16.0)]
        gib: f64,
        /// Rounds over all kinds.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
    },
    /// Page-locking (`cuMemHostRegister`) fresh host buffers as the read pools' GPU hook does (Linux): untouched
    /// pages, pages faulted in first, and faulting in alone.
    PinRate {
        /// MiB per buffer (a streamed spine's buffers average about 45).
        #[arg(long, default_value_t = 44)]
        mib: usize,
        /// GiB per mode and thread count.
        #[arg(long, default_value_t = 8.0)]
        gib: f64,
        /// Thread counts.
        #[arg(long, default_value = "1,8", value_delimiter = ',')]
        threads: Vec<usize>,
        /// Modes: fresh, prefault, touch.
        #[arg(long, default_value = "fresh,prefault,touch", value_delimiter = ',')]
        modes: Vec<String>,
        /// Rounds over all modes.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
    },
    /// Host-to-device copy rates from driver-allocated pinned memory and from registered mappings (huge-page
    /// advised or on 4 KiB pages), on one stream and on several at once (Linux).
    UploadFrom {
        /// MiB per copy.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Timed copies per kind (median reported).
        #[arg(long, default_value_t = 9)]
        reps: usize,
        /// Sources: hostalloc, registered, registered-4k.
        #[arg(
            long,
            default_value = "hostalloc,registered,registered-4k",
            value_delimiter = ','
        )]
        kinds: Vec<String>,
        /// Streams copying at once.
        #[arg(long, default_value = "1,2", value_delimiter = ',')]
        streams: Vec<usize>,
    },
    /// Write a synthetic model.
    Synth {
        /// Preset name (demo, large, ...).
        #[arg(long, default_value = "large")]
        preset: String,
        /// Output directory.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Decode seconds per token per device, alternating devices.
    Decode {
        /// Model directory.
        #[arg(long)]
        model: std::path::PathBuf,
        /// Devices, in the order of the first round (the next round reverses it).
        #[arg(long, default_value = "cpu,cuda", value_delimiter = ',')]
        devs: Vec<String>,
        /// Prompt length (ids 1..=n).
        #[arg(long, default_value_t = 8)]
        prompt_len: usize,
        /// Decode steps timed per run.
        #[arg(long, default_value_t = 8)]
        tokens: usize,
        /// Counted runs per device (after one warm-up run).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// GPU expert cache size in GiB (default: half the free memory).
        #[arg(long)]
        gpu_cache_gb: Option<f64>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Cmd::Synth { preset, out } = &cli.command {
        let p = deltafin_synth::preset(preset)
            .ok_or_else(|| anyhow::anyhow!("unknown preset {preset}"))?;
        let t = std::time::Instant::now();
        let bytes = deltafin_synth::write_model(&p, out)?;
        println!(
            "wrote {} ({:.2} GB) in {:.1} s",
            out.display(),
            bytes as f64 / 1e9,
            t.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        match cli.command {
            Cmd::MoeBw {
                experts,
                tokens,
                reps,
                kernels,
            } => bench::moe_bw(experts, &tokens, reps, &kernels),
            Cmd::Decode {
                model,
                devs,
                prompt_len,
                tokens,
                runs,
                gpu_cache_gb,
            } => bench::decode(&model, &devs, prompt_len, tokens, runs, gpu_cache_gb),
            Cmd::UploadBw { mib, reps } => bench::upload_bw(mib, reps),
            Cmd::DenseBw {
                tokens,
                reps,
                splits,
                kinds,
            } => bench::dense_bw(&tokens, reps, &splits, &kinds),
            Cmd::KdaBw { tokens, reps } => kda::kda_bw(&tokens, reps),
            #[cfg(target_os = "linux")]
            Cmd::ReadInto {
                file,
                span,
                threads,
                gib,
                rounds,
            } => read_into::read_into(&file, span, &threads, gib, rounds),
            #[cfg(not(target_os = "linux"))]
            Cmd::ReadInto { .. } => anyhow::bail!("read-into runs on Linux only"),
            #[cfg(target_os = "linux")]
            Cmd::PinRate {
                mib,
                gib,
                threads,
                modes,
                rounds,
            } => pin_rate::pin_rate(mib, gib, &threads, &modes, rounds),
            #[cfg(not(target_os = "linux"))]
            Cmd::PinRate { .. } => anyhow::bail!("pin-rate runs on Linux only"),
            #[cfg(target_os = "linux")]
            Cmd::UploadFrom {
                mib,
                reps,
                kinds,
                streams,
            } => pin_rate::upload_from(mib, reps, &kinds, &streams),
            #[cfg(not(target_os = "linux"))]
            Cmd::UploadFrom { .. } => anyhow::bail!("upload-from runs on Linux only"),
            Cmd::Synth { .. } => Ok(()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        anyhow::bail!("this build has no CUDA support (rebuild with --features cuda)")
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    /// The default `moe-bw --kernels` list names kernel families that exist.
    #[test]
    fn default_moe_kernels_parse() {
        let cli = Cli::try_parse_from(["deltafin-cudabench", "moe-bw"]).expect("arguments");
        let Cmd::MoeBw { kernels, .. } = cli.command else {
            panic!("not moe-bw");
        };
        for k in kernels {
            k.parse::<deltafin_quant::cuda::moe::MoeKernel>()
                .expect("a known kernel family");
        }
    }
}
