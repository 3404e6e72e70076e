//! The streamed spine: with decoder layers read from disk at every forward pass (a budget too small for the
//! spine, or `K3_PIN_LAYERS`), logits and greedy tokens are bit-identical to the resident spine, the bytes read per
//! forward pass are exactly the streamed layers' spine tensors, and bad pin lists are errors. The host tier (layers a
//! GPU streams from RAM) serves a kept layer's tensors without reading them again.

use std::path::Path;

use std::sync::Arc;

use deltafin_model::WeightSource;
use deltafin_runtime::{
    Engine, EngineOptions, GenerateOptions, PinLayers, SpineMode, SpineSource, convert_spine_int8,
};
use deltafin_storage::ModelFiles;
use deltafin_tests::corrupt::ScratchModel;
use deltafin_tests::{Golden, fixture};

const FIXTURES: [&str; 4] = [
    "k3/k3-tiny-a",
    "k3/k3-tiny-b",
    "kimi-linear/qlora",
    "kimi-linear/noqlora",
];

fn open(dir: &Path, pins: PinLayers, ram_gb: Option<f64>, spine: SpineMode) -> Engine {
    let options = EngineOptions {
        ram_gb,
        ..EngineOptions::default()
    }
    .with_spine(spine)
    .with_pin_layers(pins);
    Engine::open(dir, options).expect("open")
}

/// Everything a run produces that must not depend on where the spine lives: prefill logits, step-by-step
/// decode logits, and greedy tokens with speculation (verification passes of several rows).
#[derive(Debug, PartialEq)]
struct Outputs {
    prefill: Vec<f32>,
    steps: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn outputs(engine: &Engine, ids: &[u32]) -> Outputs {
    let prefill = engine.session().prefill(ids).expect("prefill").data;
    let mut s = engine.session();
    let steps = ids.iter().map(|&id| s.step(id).expect("step")).collect();
    let greedy = engine
        .session()
        .generate(
            &ids[..ids.len().min(6)],
            &GenerateOptions {
                max_new: 10,
                ignore_eos: true,
                speculation_depth: 2,
                ..Default::default()
            },
            |_| true,
        )
        .expect("generate")
        .tokens;
    Outputs {
        prefill,
        steps,
        greedy,
    }
}

/// The smallest budget (GiB) that runs `dir` with every layer streamed, as the engine's plan computes it.
fn least_budget(dir: &Path, spine: SpineMode) -> f64 {
    let all_streamed = open(dir, PinLayers::None, None, spine);
    budget_of(all_streamed.memory_plan().committed())
}

/// `bytes` as GiB for `EngineOptions::ram_gb`, rounded up by a KiB so the conversion back loses nothing.
fn budget_of(bytes: u64) -> f64 {
    (bytes + 1024) as f64 / (1u64 << 30) as f64
}

/// Bytes of one embedding row, which a model with streamed layers reads per token.
fn embed_row_bytes(engine: &Engine, dir: &Path) -> u64 {
    let files = ModelFiles::open(dir).expect("files");
    let name = engine.config().model_tensor("model.embed_tokens.weight");
    let t = files.get(&name).expect("embedding");
    t.len / t.shape[0] as u64
}

fn ids_of(dir: &Path) -> Vec<u32> {
    Golden::load(dir)
        .expect("golden")
        .ids("input_ids")
        .expect("ids")
}

/// Opens `dir` resident and streamed as `pins` asks, expecting `streamed` layers, and compares the outputs bit
/// for bit.
fn check(dir: &Path, spine: SpineMode, pins: PinLayers, ram_gb: Option<f64>, streamed: &[usize]) {
    let ids = ids_of(dir);
    let resident = open(dir, PinLayers::All, None, spine);
    assert!(resident.streamed_layers().is_empty());
    let expected = outputs(&resident, &ids);
    let engine = open(dir, pins.clone(), ram_gb, spine);
    assert_eq!(
        engine.streamed_layers(),
        streamed,
        "{}: {pins:?}",
        dir.display()
    );
    assert_eq!(
        outputs(&engine, &ids),
        expected,
        "{}: {pins:?} is not bit-identical to the resident spine",
        dir.display()
    );
    assert_eq!(
        resident.spine_reads().bytes,
        0,
        "a resident spine reads nothing"
    );
}

#[test]
fn streamed_spine_is_bit_identical_to_the_resident_one() {
    for name in FIXTURES {
        let dir = fixture(name);
        let n = Engine::open(&dir, EngineOptions::default())
            .expect("open")
            .config()
            .n_layers;
        let all: Vec<usize> = (0..n).collect();
        // Everything streamed: by the pin list, and by the least budget that can stream under `auto`.
        check(&dir, SpineMode::Bf16, PinLayers::None, None, &all);
        // At that budget `auto` streams a suffix of the layers (pinning a large first layer can pay for itself by
        // shrinking the streaming buffers, so the suffix may start past layer 0).
        let least = least_budget(&dir, SpineMode::Bf16);
        let auto = open(&dir, PinLayers::Auto, Some(least), SpineMode::Bf16);
        let streamed = auto.streamed_layers().to_vec();
        assert!(
            !streamed.is_empty()
                && streamed.ends_with(&[n - 1])
                && streamed.windows(2).all(|w| w[1] == w[0] + 1),
            "{name}: {streamed:?}"
        );
        assert!(auto.memory_plan().committed() <= auto.memory_budget());
        check(
            &dir,
            SpineMode::Bf16,
            PinLayers::Auto,
            Some(least),
            &streamed,
        );
        // Some layers pinned (first, last, one in the middle), the rest streamed, whatever the budget.
        let pins = PinLayers::Ranges(vec![0..=0, 2..=2, n - 1..=n - 1]);
        let rest: Vec<usize> = (0..n).filter(|l| ![0, 2, n - 1].contains(l)).collect();
        check(&dir, SpineMode::Bf16, pins, Some(least), &rest);
        check(&dir, SpineMode::Bf16, PinLayers::First(3), None, &all[3..]);
    }
}

#[test]
fn auto_keeps_the_spine_resident_when_it_fits_and_pins_a_prefix_otherwise() {
    let dir = fixture("k3/k3-tiny-b");
    let roomy = open(&dir, PinLayers::Auto, None, SpineMode::Bf16);
    assert!(roomy.streamed_layers().is_empty());
    let n = roomy.config().n_layers;
    // Room for the first two layers pinned and the rest streamed, by the engine's own plan of that.
    let two = open(&dir, PinLayers::First(2), None, SpineMode::Bf16);
    let three = open(&dir, PinLayers::First(3), None, SpineMode::Bf16);
    let budget = two.memory_plan().committed();
    assert!(
        three.memory_plan().committed() > budget,
        "the third layer costs more than the streaming it saves"
    );
    let tight = open(
        &dir,
        PinLayers::Auto,
        Some(budget_of(budget)),
        SpineMode::Bf16,
    );
    let streamed: Vec<usize> = (2..n).collect();
    assert_eq!(tight.streamed_layers(), streamed);
    assert!(tight.memory_plan().committed() <= tight.memory_budget());
    let ids = ids_of(&dir);
    assert_eq!(outputs(&tight, &ids), outputs(&roomy, &ids));
}

#[test]
fn streamed_bytes_per_pass_are_the_streamed_layers_spine_tensors() {
    for name in ["k3/k3-tiny-a", "k3/k3-tiny-b"] {
        let dir = fixture(name);
        let pins = PinLayers::Ranges(vec![1..=1, 4..=4]);
        let engine = open(&dir, pins, None, SpineMode::Bf16);
        let files = ModelFiles::open(&dir).expect("files");
        let row = embed_row_bytes(&engine, &dir);
        let cfg = engine.config();
        // Every non-expert tensor of every layer that is not pinned, as stored in the shards.
        let expected: u64 = engine
            .streamed_layers()
            .iter()
            .map(|&l| {
                let prefix = cfg.layer_tensor(l, "");
                files
                    .tensors()
                    .filter(|t| t.name.starts_with(&prefix) && !t.name.contains(".experts."))
                    .map(|t| t.len)
                    .sum::<u64>()
            })
            .sum();
        assert!(expected > 0);
        assert_eq!(engine.spine_reads().bytes, 0, "counters start after open");
        // The open's own reads are kept apart: at least the resident layers' tensors, and time spent on them.
        let opened = engine.open_reads();
        assert!(
            opened.bytes > 0 && opened.reads > 0 && opened.wait_secs > 0.0,
            "open reads {opened:?}"
        );
        let ids = ids_of(&dir);
        let mut s = engine.session();
        let mut mapped = Vec::new();
        for (t, &id) in ids.iter().take(4).enumerate() {
            let before = engine.spine_reads().bytes;
            s.step(id).expect("step");
            assert_eq!(
                engine.spine_reads().bytes - before,
                expected + row,
                "{name}: spine bytes read by decode step {t} (the streamed layers and one embedding row)"
            );
            mapped.push(engine.spine_reads().buffers_allocated);
        }
        // The streamed layers were read into buffers the reader mapped (how many more a later pass maps depends on
        // how its reads race the releases: 0 to 7 over 16 steps here, so only the count itself is checked).
        assert!(mapped[0] > 0, "{name}: no I/O buffer counted: {mapped:?}");
        // A prefill chunk reads each streamed layer once, however many tokens it holds.
        let chunks = ids.len().div_ceil(
            engine
                .prefill_chunk()
                .min(deltafin_runtime::budget::ALL_LOGITS_CHUNK),
        ) as u64;
        let before = engine.spine_reads().bytes;
        engine.session().prefill(&ids).expect("prefill");
        assert_eq!(
            engine.spine_reads().bytes - before,
            chunks * expected + ids.len() as u64 * row
        );
        assert!(engine.profile().spine_wait > std::time::Duration::ZERO);
    }
}

#[test]
fn streamed_int8_spine_is_bit_identical_to_the_resident_int8_spine() {
    let m = ScratchModel::copy_of(&fixture("k3/k3-tiny-a")).expect("copy");
    convert_spine_int8(&m.dir).expect("convert");
    let engine = open(&m.dir, PinLayers::None, None, SpineMode::Int8);
    assert!(engine.spine_is_int8());
    let n = engine.config().n_layers;
    let all: Vec<usize> = (0..n).collect();
    check(&m.dir, SpineMode::Int8, PinLayers::None, None, &all);
    check(
        &m.dir,
        SpineMode::Int8,
        PinLayers::First(2),
        None,
        &all[2..],
    );
    // The bytes served come from the int8 copy: fewer than the shards' bf16 bytes.
    let before = engine.spine_reads().bytes;
    engine.session().step(1).expect("step");
    let read = engine.spine_reads().bytes - before;
    assert_eq!(
        read,
        engine.layer_spine_bytes().iter().sum::<u64>() + embed_row_bytes(&engine, &m.dir)
    );
    let bf16 = open(&m.dir, PinLayers::None, None, SpineMode::Bf16);
    assert!(read < bf16.layer_spine_bytes().iter().sum::<u64>());
}

#[test]
fn bad_pin_lists_are_clear_errors() {
    for bad in ["some", "3-1", "1,,2", "-4", "2.5"] {
        let err = PinLayers::parse(bad).expect_err(bad);
        assert!(err.to_string().contains("K3_PIN_LAYERS"), "{bad}: {err}");
    }
    let err = Engine::open(
        &fixture("k3/k3-tiny-a"),
        EngineOptions::default().with_pin_layers(PinLayers::Ranges(vec![0..=99])),
    )
    .expect_err("layer 99 does not exist");
    assert!(err.to_string().contains("layer 99 does not exist"), "{err}");
}

/// Counts what an open reports.
#[derive(Default)]
struct Counted {
    starts: std::sync::Mutex<Vec<(String, u64)>>,
    done: std::sync::atomic::AtomicU64,
    finished: std::sync::atomic::AtomicU64,
}

impl deltafin_storage::Progress for Counted {
    fn start(&self, label: &str, total: u64) {
        self.starts
            .lock()
            .expect("lock")
            .push((label.to_string(), total));
    }
    fn advance(&self, bytes: u64) {
        self.done
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
    fn finish(&self) {
        self.finished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Opening reports one `open` phase whose total is the bytes the load reads: every spine byte with the whole spine
/// pinned, the pinned layers and fixed tensors when some layers are streamed (their bytes come at forward time).
#[test]
fn open_reports_the_spine_bytes_it_reads() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    let dir = fixture("k3/k3-tiny-a");
    for pins in [PinLayers::All, PinLayers::First(1)] {
        let counted = Arc::new(Counted::default());
        let options = EngineOptions::default().with_pin_layers(pins.clone());
        let engine = Engine::open_with_progress(
            &dir,
            options,
            Some(counted.clone() as Arc<dyn deltafin_storage::Progress + Send>),
        )
        .expect("open");
        let starts = counted.starts.lock().expect("lock").clone();
        assert_eq!(starts.len(), 1, "{pins:?}: {starts:?}");
        let (label, total) = &starts[0];
        assert_eq!(label, "open");
        assert!(*total > 0);
        assert_eq!(
            counted.done.load(Ordering::Relaxed),
            *total,
            "{pins:?}: bytes reported against the total"
        );
        assert_eq!(counted.finished.load(Ordering::Relaxed), 1);
        // Reading nothing more: the streamed layer's bytes come at forward time, not through the open's bar.
        engine.session().prefill(&[1, 2, 3]).expect("prefill");
        assert_eq!(counted.done.load(Ordering::Relaxed), *total, "{pins:?}");
    }
}

/// The host tier: a layer kept by `SpineSource::keep_layers` is read once, with the reader's direct I/O, and then
/// served from memory at every load, equal to a fresh read; a layer not kept is still read each time. For both the
/// bf16 shards and the int8 copy.
#[test]
fn kept_layers_are_read_once_and_served_from_memory() {
    let name = "k3/k3-tiny-a";
    let m = ScratchModel::copy_of(&fixture(name)).expect("copy");
    convert_spine_int8(&m.dir).expect("convert");
    for mode in [SpineMode::Bf16, SpineMode::Int8] {
        let files = Arc::new(ModelFiles::open(&m.dir).expect("files"));
        let spine = || SpineSource::open(Arc::clone(&files), mode, None, None).expect("spine");
        let (kept, fresh) = (spine(), spine());
        let engine = open(&m.dir, PinLayers::Auto, None, mode);
        let cfg = engine.config();
        let (keep, other) = (cfg.layer_tensor(1, ""), cfg.layer_tensor(0, ""));
        let bytes = kept.keep_layers(std::slice::from_ref(&keep)).expect("keep");
        assert_eq!(bytes, kept.served_bytes(&keep), "{mode:?}: bytes kept");
        assert_eq!(kept.kept_bytes(), bytes);
        assert_eq!(
            kept.read_stats().bytes,
            bytes,
            "{mode:?}: kept layer read once"
        );
        kept.reset_reads();
        let names = |prefix: &str| -> Vec<String> {
            files
                .tensors()
                .filter(|t| t.name.starts_with(prefix) && !t.name.contains(".experts."))
                .map(|t| t.name.clone())
                .collect()
        };
        for pass in 0..2 {
            for t in names(&keep) {
                let a = kept.load(&t).expect("kept load").expect("tensor");
                let b = fresh.load(&t).expect("fresh load").expect("tensor");
                assert_eq!(a.shape, b.shape, "{mode:?} {t}");
                assert_eq!(a.to_f32(), b.to_f32(), "{mode:?} {t}: pass {pass}");
            }
            assert_eq!(
                kept.read_stats().bytes,
                0,
                "{mode:?}: a kept layer read again"
            );
        }
        for t in names(&other) {
            kept.load(&t).expect("load").expect("tensor");
        }
        assert_eq!(
            kept.read_stats().bytes,
            kept.served_bytes(&other),
            "{mode:?}: a layer not kept is read"
        );
    }
}
