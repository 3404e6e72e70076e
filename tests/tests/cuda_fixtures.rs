//! CUDA against the CPU f32 path on every fixture (feature `cuda`; needs a GPU: run on the device machine, see
//! docs/PLATFORMS.md): full-prefill logits, decode-mode logits and greedy tokens; with the int8 spine copy, CUDA
//! against the CPU's int8 path.
#![cfg(feature = "cuda")]

use std::path::Path;

use deltafin_model::state::LayerState;
use deltafin_runtime::{
    DevicePref, Engine, EngineOptions, GreedyOptions, PinLayers, SpineMode, convert_spine_int8,
};
use deltafin_tests::corrupt::ScratchModel;
use deltafin_tests::{Golden, fixture, max_abs_diff};

/// Max |Δlogit| allowed between CUDA and the CPU.
const TOL: f32 = 1e-3;

/// Max |Δlogit| allowed between CUDA and the CPU with the int8 spine. Both quantise each input row of an int8 product
/// to int16 by the same contract and sum it exactly, but the values reaching a product differ between the devices in
/// their last bits (their other f32 arithmetic agrees within [`TOL`], not bit for bit), and a last-bit difference can
/// move a value's rounding by a whole int16 step: a few hundred times the difference that caused it. The bound stays
/// far below the int8 spine's own error against bf16 (`tests/tests/int8_spine.rs`), which a product on wrong weights
/// or scales would reach; greedy tokens must still agree.
const TOL_INT8: f32 = 1e-2;

/// Opens `dir` on `pref`, with at most `gpu_layers` layers kept on the GPU (the rest streamed), experts and spine
/// uploaded through a staging copy when `staged`.
fn open(dir: &Path, pref: DevicePref, gpu_layers: Option<usize>, staged: bool) -> Engine {
    open_spine(
        dir,
        pref,
        gpu_layers,
        staged,
        EngineOptions::default().spine,
        PinLayers::Auto,
    )
}

/// [`open`] with the spine `spine`, and the layers `pins` kept in host memory.
fn open_spine(
    dir: &Path,
    pref: DevicePref,
    gpu_layers: Option<usize>,
    staged: bool,
    spine: SpineMode,
    pins: PinLayers,
) -> Engine {
    let mut o = EngineOptions::default()
        .with_device(pref)
        .with_spine(spine)
        .with_pin_layers(pins);
    o.device.gpu_layers = gpu_layers;
    o.device.stage_uploads = staged;
    let e = Engine::open(dir, o).expect("fixture opens");
    if pref == DevicePref::Cuda {
        assert!(e.device_name().starts_with("cuda"), "{}", e.device_name());
    }
    e
}

fn check(name: &str) {
    check_with(name, None, false);
}

/// As [`check`], with at most `gpu_layers` layers on the GPU (the others are uploaded at every forward pass), and
/// routed experts uploaded through a staging copy when `staged` (else straight from page-locked read buffers).
fn check_with(name: &str, gpu_layers: Option<usize>, staged: bool) {
    check_spine(
        name,
        &fixture(name),
        EngineOptions::default().spine,
        gpu_layers,
        staged,
        PinLayers::Auto,
    );
}

/// [`check_with`] of the model in `dir` (fixture `name` or a copy of it) with the spine `spine` on both devices,
/// the GPU's host keeping the layers `pins` in RAM (layers the GPU streams come from there, or from storage when
/// not pinned); returns the spine's bytes uploaded to the GPU.
fn check_spine(
    name: &str,
    dir: &Path,
    spine: SpineMode,
    gpu_layers: Option<usize>,
    staged: bool,
    pins: PinLayers,
) -> u64 {
    let g = Golden::load(dir).expect("golden");
    let ids = g.ids("input_ids").expect("ids");
    let prompt = g.ids("greedy_prompt").expect("prompt");
    let cpu = open_spine(dir, DevicePref::Cpu, None, false, spine, PinLayers::Auto);
    // The device's upload counters are the process's: this engine's are the difference.
    let uploads0 = deltafin_runtime::shared_gpu(&Default::default())
        .expect("a GPU")
        .staging_stats();
    let gpu = open_spine(dir, DevicePref::Cuda, gpu_layers, staged, spine, pins);
    if let Some(n) = gpu_layers {
        let want: Vec<usize> = (n..cpu.config().n_layers).collect();
        assert_eq!(gpu.streamed_layers(), want, "{name}: streamed layers");
    }
    // The layers the GPU streams and the host's plan keeps in RAM make the host tier.
    let tier: Vec<usize> = (gpu.streamed_layers().iter().copied())
        .filter(|&l| gpu.memory_plan().resident[l])
        .collect();
    assert_eq!(gpu.host_tier_layers(), tier, "{name}: host tier");

    // Whole sequence (prefill in chunks of 64).
    let a = cpu.session().prefill(&ids).expect("cpu prefill").data;
    let mut gs = gpu.session();
    let b = gs.prefill(&ids).expect("cuda prefill").data;
    // Every KDA layer ran whole on the GPU (its state stayed there), not on the CPU fallback.
    let kda: Vec<bool> = gs
        .state()
        .layers
        .iter()
        .filter_map(|l| match l {
            LayerState::Kda(k) => Some(k.is_on_device()),
            LayerState::Mla(_) => None,
        })
        .collect();
    assert!(
        !kda.is_empty() && kda.iter().all(|&d| d),
        "{name}: KDA states on the device: {kda:?}"
    );
    // Every MLA layer ran whole on the GPU too: its projections were never timed on the host (the device path
    // queues them with the attention and waits once), while the MLA blocks did run.
    let prof = gpu.profile();
    assert!(
        prof.mla > std::time::Duration::ZERO && prof.mla_proj == std::time::Duration::ZERO,
        "{name}: MLA {:?}, of it projections on the host {:?}",
        prof.mla,
        prof.mla_proj
    );
    assert_eq!(cpu.spine_is_int8(), gpu.spine_is_int8(), "{name}: spines");
    let tol = if gpu.spine_is_int8() { TOL_INT8 } else { TOL };
    let d = max_abs_diff(&a, &b);
    eprintln!(
        "{name}: prefill {} tokens, max |Δlogit| cuda vs cpu = {d:.3e}",
        ids.len()
    );
    assert!(d <= tol, "{name}: prefill max |Δlogit| {d}");
    // Layers streamed from the host tier are not read from storage again; the others are.
    let read = gpu.spine_reads().bytes;
    let from_storage = gpu.streamed_layers().len() > tier.len();
    eprintln!("{name}: host tier {tier:?}, spine bytes read by the prefill {read}");
    assert_eq!(read > 0, from_storage, "{name}: spine read {read} bytes");

    // Decode: half prefill, then one token per step.
    let split = ids.len() / 2;
    let decode = |e: &Engine| {
        let mut s = e.session();
        let mut out = s.prefill(&ids[..split]).expect("prefill").data;
        for &id in &ids[split..] {
            out.extend(s.step(id).expect("step"));
        }
        out
    };
    let d = max_abs_diff(&decode(&cpu), &decode(&gpu));
    eprintln!("{name}: decode max |Δlogit| cuda vs cpu = {d:.3e}");
    assert!(d <= tol, "{name}: decode max |Δlogit| {d}");

    // Greedy tokens.
    let opts = GreedyOptions {
        max_new: 16,
        ignore_eos: true,
    };
    let ta = cpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cpu greedy");
    let tb = gpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cuda greedy");
    eprintln!("{name}: greedy {tb:?}");
    assert_eq!(ta, tb, "{name}: greedy tokens differ");

    // The K3 fixtures' experts are MXFP4, so they ran in the GPU expert cache; every upload took the path asked for.
    let up = gpu.expert_cache_stats().expect("a GPU expert cache");
    eprintln!(
        "{name}: {} expert bytes uploaded, {} straight from page-locked read buffers",
        up.uploaded_bytes, up.uploaded_direct_bytes
    );
    if name.starts_with("k3") {
        assert!(up.uploaded_bytes > 0, "{name}: no expert went up: {up:?}");
        let want = if staged { 0 } else { up.uploaded_bytes };
        assert_eq!(
            up.uploaded_direct_bytes, want,
            "{name}: staged {staged}: {up:?}"
        );
        // Every MoE call is counted in the split, and its parts fit inside the calls' own time.
        let s = up.split;
        assert!(s.calls > 0, "{name}: no MoE call counted: {s:?}");
        assert!(
            s.reads + s.queue + s.finish <= s.total + 1e-9 && s.total > 0.0,
            "{name}: the MoE split's parts exceed its total: {s:?}"
        );
    }
    // The spine went up at open, every byte counted: through the staging buffers when `staged`, else straight
    // from the spine reader's page-locked buffers where the values lie in them as read (the K3 fixtures' bf16
    // matrices; the Kimi Linear fixtures store f32, which the host copies into aligned vectors first).
    let (staging, _) = gpu.gpu_staging_stats().expect("a GPU");
    let (uploads, bytes, direct) = (
        staging.uploads - uploads0.uploads,
        staging.bytes - uploads0.bytes,
        staging.direct_bytes - uploads0.direct_bytes,
    );
    eprintln!("{name}: spine uploads {bytes} bytes, {direct} straight from read buffers");
    assert!(
        uploads > 0 && bytes > 0 && staging.copy_secs <= staging.secs,
        "{name}: spine uploads {staging:?}"
    );
    if staged {
        assert_eq!(direct, 0, "{name}: {staging:?} (before: {uploads0:?})");
    } else if name.starts_with("k3") {
        assert!(direct > 0, "{name}: nothing went up in place: {staging:?}");
    }
    bytes
}

#[test]
fn k3_tiny_a_cuda_matches_cpu() {
    check("k3/k3-tiny-a");
}

/// Look-ahead prefetch on the GPU path: the next layer's guessed experts are read while this layer uploads, the
/// guesses are recorded, and decoding gives the CPU's greedy tokens.
#[test]
fn prefetch_on_gpu_matches_cpu() {
    let dir = fixture("k3/k3-tiny-a");
    let prompt = Golden::load(&dir)
        .expect("golden")
        .ids("greedy_prompt")
        .expect("prompt");
    let opts = GreedyOptions {
        max_new: 16,
        ignore_eos: true,
    };
    let cpu = open(&dir, DevicePref::Cpu, None, false);
    let want = cpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cpu greedy");
    let mut o = EngineOptions::default()
        .with_device(DevicePref::Cuda)
        .with_prefetch(true);
    o.device.gpu_layers = None;
    let gpu = Engine::open(&dir, o).expect("fixture opens");
    let got = gpu
        .session()
        .generate_greedy(&prompt, opts, |_| true)
        .expect("cuda greedy");
    assert_eq!(got, want, "greedy tokens with prefetch on the GPU");
    let pf = gpu.expert_stats().prefetch.expect("prefetch is on");
    eprintln!("prefetch on the GPU: {pf:?}");
    assert!(
        pf.guesses > 0 && pf.wanted > 0,
        "no guesses were made: {pf:?}"
    );
}

/// Experts uploaded through the staging copy (pageable read buffers) give the same logits as those uploaded in place.
#[test]
fn staged_expert_uploads_match_cpu() {
    check_with("k3/k3-tiny-b", None, true);
}

/// Spine layers streamed to the GPU at every pass (one layer resident, or none) give the resident path's logits,
/// uploaded from the host tier (the default budget keeps every layer in RAM) or read from storage (only layer 0
/// pinned in RAM).
#[test]
fn streamed_gpu_layers_match_cpu() {
    check_with("k3/k3-tiny-a", Some(1), false);
    check_with("kimi-linear/qlora", Some(0), false);
    let name = "k3/k3-tiny-b";
    check_spine(
        name,
        &fixture(name),
        SpineMode::Bf16,
        Some(1),
        false,
        PinLayers::First(1),
    );
}

/// With the int8 spine copy, CUDA gives the CPU int8 path's logits and greedy tokens, resident and streamed, and
/// the spine stays int8 on the GPU: fewer bytes go up than for the bf16 spine (dequantised to f32 it was twice
/// as many).
#[test]
fn int8_spine_cuda_matches_cpu() {
    let name = "k3/k3-tiny-a";
    let m = ScratchModel::copy_of(&fixture(name)).expect("copy");
    let bf16 = check_spine(name, &m.dir, SpineMode::Bf16, None, false, PinLayers::Auto);
    let report = convert_spine_int8(&m.dir).expect("convert");
    let int8 = check_spine(name, &m.dir, SpineMode::Int8, None, false, PinLayers::Auto);
    eprintln!("{name}: spine uploads bf16 {bf16} bytes, int8 {int8} bytes ({report:?})");
    assert!(int8 < bf16, "int8 spine uploads {int8} bytes, bf16 {bf16}");
    check_spine(
        name,
        &m.dir,
        SpineMode::Int8,
        Some(1),
        false,
        PinLayers::Auto,
    );
}

#[test]
fn k3_tiny_b_cuda_matches_cpu() {
    check("k3/k3-tiny-b");
}

#[test]
fn kimi_linear_qlora_cuda_matches_cpu() {
    check("kimi-linear/qlora");
}

#[test]
fn kimi_linear_noqlora_cuda_matches_cpu() {
    check("kimi-linear/noqlora");
}
